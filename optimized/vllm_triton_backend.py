"""Backends that run vLLM's own DeepSeek-V4 indexer Triton kernels (0.33.0, 0.34.0), loaded from source
by optimized.vllm_kernels (vllm itself is not imported):

* `vllm-cuda`: vLLM's CUDA indexer path. The fused K writers (pool -> RMSNorm -> RoPE ->
  MXFP4 or FP8 -> paged insert, natural page order) as the ops
  `compress_norm_rope_{mxfp4,fp8}_cache`, and the fused Q quants
  (`FusedIndexerQRope{MxFp4,Quant}TritonKernel`). vLLM scores and selects with DeepGEMM /
  CUDA ops, not Triton: the scorer and top-k here are mxval's own Triton kernels.
* `vllm-rocm`: vLLM's ROCm pooling kernel `_compress_pool_kernel` for `compress_pool`; the
  K writer, Q quant, scorer and top-k from aiter when aiter is importable on a gfx950 GPU,
  else mxval's own Triton kernels.

Each also as `-interpret` (the Triton interpreter on the CPU). The description says where
the kernels came from and whether vLLM's sm_100-only e2m1 helper was emulated.
"""
from __future__ import annotations

from typing import Optional

import torch

from reference import checks
from reference.formats import FP8_FLAVOURS, ROUNDING_PATHS
from reference.fused import CUDA_Q_ROPE, CUDA_ROPE
from reference.pooling import check_pool_args
from reference.q_quant import check_q_args, check_scale_pair

from . import DECLARED, Backend
from .common import on_device
from .probe import no_gpu

FUSED_OPS = ("compress_norm_rope_mxfp4_cache", "compress_norm_rope_fp8_cache")
CUDA_FP8 = "e4m3fn"          # vLLM's CUDA kernels: tl.float8e4nv, FP8_MAX 448
# The reference's options that say what vLLM's CUDA kernels compute (NUMERICS.md §2, §3;
# docs/paths.md), declared as Backend.numerics so the runner asks the reference for the same:
# compiled, the fused K kernels contract RoPE as fma-oc and the Q kernels as fma-es; the
# interpreter contracts nothing. A different value asked of the backend is refused.
FUSED_OPTIONS = ("rope", "softmax")
Q_OPTIONS = ("rope",)


def cuda_numerics(interpreted: bool) -> dict:
    fused, q = ("separate", "separate") if interpreted else (CUDA_ROPE, CUDA_Q_ROPE)
    return {**{op: {"rope": fused} for op in FUSED_OPS},
            **{op: {"rope": q} for op in ("q_rope_mxfp4_quant", "q_rope_fp8_quant")}}


def _own_rope(op: str, options: dict, numerics: dict, allowed=Q_OPTIONS) -> None:
    """The reference options the runner passes (`allowed` ones only) are those vLLM's kernel computes."""
    bad = sorted(set(options) - set(allowed))
    if bad:
        raise TypeError(f"unexpected keyword(s) {', '.join(bad)}")
    want = numerics[op]["rope"]
    if options.get("rope", want) != want:
        raise ValueError(f"rope: vLLM's {op} kernel computes rope={want!r} here, got {options['rope']!r}")
    if options.get("softmax", "fp64") != "fp64":
        raise ValueError(f"softmax: the reference's 'fp64' softmax is the one compared with vLLM's kernel "
                         f"(its approximate exp has no exact model), got {options['softmax']!r}")


def _triton_mode(interpret: bool) -> Optional[str]:
    """None when mxval's Triton kernels can run in this mode here, else why not."""
    from . import triton_kernels as tk
    be = tk.make_interpreter_backend() if interpret else tk.make_backend()
    return be.available()


def _mxval_triton_ops(device: str, names) -> dict:
    from .triton_kernels import _ops
    ops = _ops(device)
    return {n: ops[n] for n in names}


# --- checks the kernels need (they do not bounds-check; an interpreter store out of range is silent)

def _check_fused(fmt, state_cache, block_table, positions, req_index, kv_slot_mapping, cos_sin_cache,
                 norm_weight, kv_cache, norm_eps, compress_ratio, page_size, entry) -> None:
    from .vllm_kernels import launch
    check_pool_args(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
    checks.positive_finite("norm_eps", norm_eps)
    d = state_cache.shape[-1] // 4
    entry_bytes = entry(d)
    dims = checks.Dims()
    dims.check("cos_sin_cache", cos_sin_cache, torch.float32, ("max_pos", "R"))
    dims.check("norm_weight", norm_weight, (torch.bfloat16, torch.float32), ("D",))
    dims.check("kv_cache", kv_cache, torch.uint8, ("P", "page_bytes"))
    if norm_weight.shape[0] != d:
        raise ValueError(f"norm_weight: {norm_weight.shape[0]} values, the state cache has D={d}")
    r = cos_sin_cache.shape[1]
    if r % 2 or r > d:
        raise ValueError(f"cos_sin_cache: rope width R={r} must be even and at most D={d}")
    if d & (d - 1):
        raise ValueError(f"state_cache: vLLM's writers need a power-of-two head dim (TRITON_BLOCK_SIZE == D), got {d}")
    if fmt == "fp8" and d != launch.FP8_QUANT_BLOCK:
        raise ValueError(f"state_cache: vLLM's FP8 writer quantizes one block of {launch.FP8_QUANT_BLOCK} "
                         f"(QUANT_BLOCK == D), got D={d}")
    if fmt == "fp8" and kv_cache.shape[1] % 4:
        raise ValueError(f"kv_cache: vLLM's FP8 writer stores fp32 scales; pages of {kv_cache.shape[1]} "
                         "bytes (not a multiple of 4) fault on the GPU (misaligned address)")
    checks.scalar("page_size", page_size, positive=True)
    if kv_cache.shape[1] < page_size * entry_bytes:
        raise ValueError(f"kv_cache: pages of {kv_cache.shape[1]} bytes hold fewer than page_size={page_size} "
                         f"entries of {entry_bytes} bytes")
    if compress_ratio != 4:
        raise ValueError(f"compress_ratio: vLLM's fused writer overlaps windows only at ratio 4, got {compress_ratio}")
    writes = ((positions.long() + 1) % compress_ratio == 0) & (kv_slot_mapping.long() >= 0)
    if bool(writes.any()):
        checks.int_range("kv_slot_mapping (written)", kv_slot_mapping[writes], 0, kv_cache.shape[0] * page_size)
        checks.int_range("positions (written)", positions[writes], 0, cos_sin_cache.shape[0])


def _no_hadamard(hadamard: bool, scale_rule: str = "ceil") -> None:
    if hadamard:
        raise ValueError("hadamard: vLLM's kernels do not rotate; use the reference backend for Hadamard studies")
    if scale_rule != "ceil":
        raise ValueError(f"scale_rule: vLLM's kernels compute 'ceil' (2^ceil(log2(amax/6))), got {scale_rule!r}")


# --- the CUDA path -----------------------------------------------------------------------

def _fused_op(ks, device: str, numerics: dict, fmt: str):
    """vLLM's fused compress+norm+RoPE+quant K writer for `fmt`, as an mxval op."""
    from .vllm_kernels import launch
    key = launch.K_KEYS[fmt]
    from reference import fp8 as ref_fp8
    from reference import layout
    entry = layout.entry_bytes if fmt == "mxfp4" else ref_fp8.entry_bytes

    def op(*, state_cache, block_table, positions, req_index, kv_slot_mapping, cos_sin_cache, norm_weight,
           kv_cache, compress_ratio: int = 4, norm_eps: float = 1e-6, page_size: int = 64,
           fp8_dtype: str = CUDA_FP8, **options) -> dict:
        _own_rope(f"compress_norm_rope_{fmt}_cache", options, numerics, FUSED_OPTIONS)
        if fmt == "fp8" and fp8_dtype != CUDA_FP8:
            checks.choice("fp8_dtype", fp8_dtype, tuple(FP8_FLAVOURS))
            raise ValueError(f"fp8_dtype: vLLM's CUDA FP8 writer stores e4m3fn (FP8_MAX 448), got {fp8_dtype!r}")
        _check_fused(fmt, state_cache, block_table, positions, req_index, kv_slot_mapping, cos_sin_cache,
                     norm_weight, kv_cache, norm_eps, compress_ratio, page_size, entry)
        (sc, bt, pos, req, slots, cs, w), back = on_device(device, state_cache, block_table, positions,
                                                         req_index, kv_slot_mapping, cos_sin_cache, norm_weight)
        out = kv_cache.to(device, copy=True).contiguous()
        launch.run(ks.kernels[key], launch.fused_k(fmt, state_cache=sc.contiguous(), block_table=bt.contiguous(),
                                          positions=pos.contiguous(), req_index=req.contiguous(),
                                          kv_slot_mapping=slots.contiguous(), cos_sin_cache=cs.contiguous(),
                                          norm_weight=w.contiguous(), norm_eps=norm_eps, kv_cache=out,
                                          page_size=page_size, compress_ratio=compress_ratio),
                   interpreted=ks.interpreted)
        return {"kv_cache": back(out, kv_cache)}
    op.__name__ = f"compress_norm_rope_{fmt}_cache"
    return op


def _q_launch(ks, device: str, fmt, q, positions, cos_sin_cache, weights, weights_scale, softmax_scale, head_scale):
    """Check, allocate and launch vLLM's Q kernel for `fmt`: (out, scale, weights, back)."""
    from .vllm_kernels import launch
    check_q_args(q, positions, cos_sin_cache, weights, weights_scale)
    nope, r = q.shape[2] - cos_sin_cache.shape[1], cos_sin_cache.shape[1]
    if fmt == "mxfp4" and (nope % 32 or r % 32):
        raise ValueError("q: vLLM's MXFP4 Q kernel needs the NoPE and RoPE widths in whole 32-blocks")
    if fmt == "fp8" and any(n < 1 or n & (n - 1) for n in (nope, r // 2)):
        raise ValueError(f"q: vLLM's FP8 Q kernel needs power-of-two NoPE and half-RoPE widths "
                         f"(tl.arange), got {nope} and {r // 2}")
    ss, hs = check_scale_pair(weights_scale, softmax_scale, head_scale) or (float(weights_scale), 1.0)
    (qd, pd, cd, wd), back = on_device(device, q, positions, cos_sin_cache, weights)
    t, h, d = q.shape
    w_out = torch.empty((t, h), dtype=torch.float32, device=device)
    if fmt == "mxfp4":
        out = torch.empty((t, h, d // 2), dtype=torch.uint8, device=device)
        scale = torch.empty((t, h, d // 32), dtype=torch.uint8, device=device)
    else:
        out, scale = torch.empty((t, h, d), dtype=torch.float8_e4m3fn, device=device), None
    launch.run(ks.kernels[launch.Q_KEYS[fmt]],
               launch.q_quant(fmt, q=qd.contiguous(), positions=pd.contiguous(), cos_sin_cache=cd.contiguous(),
                              weights=wd.contiguous(), softmax_scale=ss, head_scale=hs, out=out, scale=scale,
                              weights_out=w_out), interpreted=ks.interpreted)
    return out, scale, w_out, back


def make_cuda_ops(ks, device: str) -> dict:
    numerics = cuda_numerics(ks.interpreted)
    ops: dict = {}

    ops["compress_norm_rope_mxfp4_cache"] = _fused_op(ks, device, numerics, "mxfp4")
    ops["compress_norm_rope_fp8_cache"] = _fused_op(ks, device, numerics, "fp8")

    def q_rope_mxfp4_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float, hadamard: bool = False,
                           scale_rule: str = "ceil", softmax_scale=None, head_scale=None, **options) -> dict:
        _no_hadamard(hadamard, scale_rule)
        _own_rope("q_rope_mxfp4_quant", options, numerics)
        out, scale, w, back = _q_launch(ks, device, "mxfp4", q, positions, cos_sin_cache, weights, weights_scale,
                                        softmax_scale, head_scale)
        return {"q_fp4": back(out, q), "q_scale": back(scale, q), "weights": back(w, weights)}

    def q_rope_fp8_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float, fp8_dtype: str = CUDA_FP8,
                         hadamard: bool = False, softmax_scale=None, head_scale=None, **options) -> dict:
        _no_hadamard(hadamard)
        _own_rope("q_rope_fp8_quant", options, numerics)
        checks.choice("fp8_dtype", fp8_dtype, tuple(FP8_FLAVOURS))
        if fp8_dtype != CUDA_FP8:
            raise ValueError(f"fp8_dtype: vLLM's CUDA FP8 Q kernel is launched with e4m3fn here "
                             f"(USE_FNUZ is its gfx942 variant), got {fp8_dtype!r}")
        out, _, w, back = _q_launch(ks, device, "fp8", q, positions, cos_sin_cache, weights, weights_scale,
                                    softmax_scale, head_scale)
        return {"q_fp8": back(out.view(torch.uint8), q), "weights": back(w, weights)}

    ops["q_rope_mxfp4_quant"] = q_rope_mxfp4_quant
    ops["q_rope_fp8_quant"] = q_rope_fp8_quant
    ops.update(_mxval_triton_ops(device, ("paged_mxfp4_mqa_logits", "paged_fp8_mqa_logits", "topk")))
    return ops


def cuda_limits(op: str, scalars: dict) -> Optional[str]:
    """Cases vLLM's CUDA kernels cannot do: skipped with this reason, not failed."""
    if scalars.get("fp8_dtype", CUDA_FP8) != CUDA_FP8:
        return f"vLLM's CUDA FP8 kernels store e4m3fn; {scalars['fp8_dtype']} is the ROCm gfx942 format"
    if op in FUSED_OPS and scalars.get("compress_ratio", 4) != 4:
        return "vLLM's fused writer overlaps windows only at compress ratio 4"
    return None


# --- the ROCm path -----------------------------------------------------------------------

def make_rocm_ops(ks, device: str, *, interpret: bool) -> tuple[dict, str]:
    from .vllm_kernels import launch

    def compress_pool(*, state_cache, block_table, positions, req_index, kv_slot_mapping,
                      compress_ratio: int = 4, rounding: str = "rocm") -> dict:
        checks.choice("rounding", rounding, ROUNDING_PATHS)
        if rounding != "rocm":
            raise ValueError(f"rounding: vLLM's ROCm pooling kernel stores bf16 rows ('rocm'), got {rounding!r}")
        check_pool_args(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
        if compress_ratio != launch.OVERLAP_RATIO:
            raise ValueError(f"compress_ratio: vLLM's compressor overlaps windows only at ratio 4, got {compress_ratio}")
        d = state_cache.shape[-1] // 4
        if d & (d - 1):
            raise ValueError(f"state_cache: the kernel's tl.arange(0, HEAD_SIZE) needs a power-of-two D, got {d}")
        (sc, bt, pos, req, slots), back = on_device(device, state_cache, block_table, positions, req_index,
                                                    kv_slot_mapping)
        out = torch.full((positions.shape[0], d), float("nan"), dtype=torch.bfloat16, device=device)
        launch.run(ks.kernels[launch.POOL_KEY], launch.pool(state_cache=sc.contiguous(), block_table=bt.contiguous(),
                                       positions=pos.contiguous(), req_index=req.contiguous(),
                                       kv_slot_mapping=slots.contiguous(), out=out, compress_ratio=compress_ratio),
                   interpreted=ks.interpreted)
        return {"pooled": back(out, state_cache)}

    ops = {"compress_pool": compress_pool}
    rest = ("k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk",
            "k_norm_rope_fp8_cache", "q_rope_fp8_quant", "paged_fp8_mqa_logits")
    if not interpret:
        from . import aiter_backend
        aiter = aiter_backend.make_backend()
        if aiter.available() is None:
            ops.update({n: aiter.ops[n] for n in rest if n in aiter.ops})
            return ops, "aiter's K writer, Q quant, scorer and top-k"
    ops.update(_mxval_triton_ops(device, rest))
    return ops, "mxval's Triton K writer, Q quant, scorer and top-k (aiter is not usable here)"


def rocm_limits(op: str, scalars: dict) -> Optional[str]:
    if op == "compress_pool" and scalars.get("compress_ratio", 4) != 4:
        return "vLLM's ROCm pooling kernel overlaps windows only at compress ratio 4"
    return None


# --- factories ---------------------------------------------------------------------------

def load_upstream(name: str, head: str, interpret: bool, load) -> tuple:
    """(the loaded upstream set, device, None), or (None, None, an unavailable Backend saying
    why): Triton must run in this mode here, and `load(interpreted=...)` must find and resolve
    the upstream source (KernelSetError otherwise)."""
    from .vllm_kernels.kernelset import KernelSetError
    if not interpret and not torch.cuda.is_available():
        return None, None, Backend(name, head, reason=no_gpu(name))
    why = _triton_mode(interpret)
    if why:
        return None, None, Backend(name, head, reason=why)
    try:
        return load(interpreted=interpret), ("cpu" if interpret else "cuda"), None
    except KernelSetError as e:
        return None, None, Backend(name, head, reason=str(e))


def _make(name: str, path: str, interpret: bool) -> Backend:
    from .vllm_kernels.kernelset import kernel_set
    head = DECLARED[name].summary
    ks, device, unavailable = load_upstream(name, head, interpret, kernel_set)
    if unavailable:
        return unavailable
    numerics: dict = {}
    if path == "cuda":
        ops = make_cuda_ops(ks, device)
        numerics = cuda_numerics(ks.interpreted)
        desc = (f"{head}; {ks.note()}; compared with the reference's rope="
                f"{numerics['compress_norm_rope_mxfp4_cache']['rope']} (K) / "
                f"{numerics['q_rope_mxfp4_quant']['rope']} (Q)")
        limits = cuda_limits
    else:
        ops, rest = make_rocm_ops(ks, device, interpret=interpret)
        desc = f"{head} + {rest}; {ks.note().split(';')[0]}"
        limits = rocm_limits
    return Backend(name, desc, ops, device=device, limits=limits, source=ks.source.describe(), numerics=numerics)


def make_cuda_backend() -> Backend:
    return _make("vllm-cuda", "cuda", False)


def make_cuda_interpret_backend() -> Backend:
    return _make("vllm-cuda-interpret", "cuda", True)


def make_rocm_backend() -> Backend:
    return _make("vllm-rocm", "rocm", False)


def make_rocm_interpret_backend() -> Backend:
    return _make("vllm-rocm-interpret", "rocm", True)
