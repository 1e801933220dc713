#!/usr/bin/env bash
# Everything mxval checks on a GPU, in one go (the lent H200, or any CUDA/ROCm box):
# the GPU test suite, the full validation suite through compiled Triton, the selftest
# with compiled Triton as the correct backend, and the study's timing. Logs and reports
# go under ${OUT:-reports/gpu}. Each step has its own time limit so one slow step does
# not hide the others.
set -u
out=${OUT:-reports/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=python3
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$(grep -E 'passed|failed|caught|exceeded|hold|error' "$out/$name.log" | tail -1)"
}
nvidia-smi -L 2>/dev/null || rocm-smi --showproductname 2>/dev/null
$py -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
make -s .mxval-env-system PYTHON=$py >/dev/null
export PYTHONPATH=$PWD
step test-gpu 130 $py -m pytest -q -m gpu
step study 60 $py -m harness study --report-dir "$out/study"
step validate 120 $py -m harness validate --suite full --backend triton -j 2 --report-dir "$out/validate" --force
step selftest 110 $py -m harness selftest --backend triton --seeds 20 --json "$out/selftest.json" --report-dir "$out/selftest" --force -q
for f in test-gpu study validate selftest; do echo "== $f"; tail -n 25 "$out/$f.log"; done
