#!/usr/bin/env bash
# Everything mxval checks on a GPU, in one go (the lent H200, or any CUDA/ROCm box).
# Phase A, correctness: the GPU test suite, the full validation suite through compiled
# Triton and through vLLM's own kernels (vllm-cuda on the cuda path, every case through the
# fused pool+K op; vllm-rocm; they need the vLLM source: `mxval upstream fetch` on a
# networked machine, then XDG_CACHE_HOME or MXVAL_VLLM_SRC pointing at it), and the selftest
# with compiled Triton as the correct backend; then the full suite in graph mode
# (`--graph`: decode replayed from CUDA/HIP graphs). Phase B, timings, one step at a time: the
# study on the GPU and `make bench-gpu` (BENCH=0 skips it). Logs and reports go under
# ${GPU_OUT:-reports/gpu}; each step has its own time limit so one slow step does not hide
# the others.
#
# GPU memory: phase A's steps run side by side only when each can have a share of the GPU
# that holds the suite's largest case (GPU_SHARE_GIB, default 24 GiB: five steps fit an
# H200, and a share is over five times the largest case's tensors, 4.4 GB for the 2.2 GiB
# pool case; each report shows every case's measured peak); each process is then capped at
# its share (MXVAL_GPU_MEMORY_FRACTION, honoured by every mxval process and the GPU tests),
# so no step can take another's memory. A smaller GPU runs the steps one at a time, each
# with the whole GPU; PARALLEL=0 forces that. Every report row carries the case's GPU peak.
set -u
out=${GPU_OUT:-reports/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PY:-python3}
LIMIT_A=${LIMIT_A:-240}
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    printf '%-16s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
        "$(grep -E 'passed|failed|caught|exceeded|hold|error|pass,' "$out/$name.log" | tail -1)" >> "$out/steps.txt"
}
: > "$out/steps.txt"
{ nvidia-smi -L 2>/dev/null || rocm-smi --showproductname 2>/dev/null; } > "$out/machine.txt"
$py -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$out/machine.txt"
make -s .mxval-env-system PYTHON=$py >/dev/null
export PYTHONPATH=$PWD
mx="$py -m harness"
steps_a=(test-gpu validate-triton selftest validate-vllm-cuda validate-vllm-rocm)
run_a() {  # one phase-A step by name
    case $1 in
    test-gpu) step test-gpu "$LIMIT_A" $py -m pytest -q -p no:cacheprovider -m gpu ;;
    validate-triton) step validate-triton "$LIMIT_A" $mx validate --suite full --backend triton --report-dir "$out/validate-triton" --force ;;
    selftest) step selftest "$LIMIT_A" $mx selftest --backend triton --seeds 20 --json "$out/selftest.json" --report-dir "$out/selftest" --force -q ;;
    validate-vllm-cuda) step validate-vllm-cuda "$LIMIT_A" $mx validate --suite full --backend vllm-cuda --path cuda --report-dir "$out/validate-vllm-cuda" --force ;;
    validate-vllm-rocm) step validate-vllm-rocm "$LIMIT_A" $mx validate --suite full --backend vllm-rocm --report-dir "$out/validate-vllm-rocm" --force ;;
    esac
}
n=${#steps_a[@]}
gpu_gib=$($py -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30 if torch.cuda.is_available() else 0)')
share=${GPU_SHARE_GIB:-24}
if [ "${PARALLEL:-1}" = 1 ] && [ $((gpu_gib * 9 / 10)) -ge $((share * n)) ]; then   # each gets its share of the 90 %
    # 90% of the GPU split evenly: the rest is the CUDA contexts' and the driver's
    export MXVAL_GPU_MEMORY_FRACTION=$($py -c "print(round(0.9 / $n, 3))")
    echo "phase A: $n steps side by side, each capped at $MXVAL_GPU_MEMORY_FRACTION of ${gpu_gib} GiB" >> "$out/machine.txt"
    for s in "${steps_a[@]}"; do run_a "$s" & done
    wait
else
    echo "phase A: $n steps one at a time (${gpu_gib} GiB < $n x ${share} GiB, or PARALLEL=0)" >> "$out/machine.txt"
    for s in "${steps_a[@]}"; do run_a "$s"; done
fi
unset MXVAL_GPU_MEMORY_FRACTION
step validate-graph "$LIMIT_A" $mx validate --suite full --graph --backend triton --report-dir "$out/validate-graph" --force
step study "${LIMIT_STUDY:-90}" $mx study --device cuda --report-dir "$out/study" --force
[ "${BENCH:-1}" = 1 ] && step bench-gpu "${LIMIT_BENCH:-240}" $py -m harness.bench.gpu --quick --out "$out/bench-gpu.md"
cat "$out/machine.txt" "$out/steps.txt"
for f in test-gpu validate-triton validate-vllm-cuda validate-vllm-rocm selftest validate-graph study; do
    echo "== $f"; tail -n 30 "$out/$f.log"
done
