"""Backends that run aiter's own K writer and Q quant (its Python wrappers and Triton
kernels, loaded from an aiter source tree by optimized.vllm_kernels.aiter_set; aiter is never
imported) through the same adapter code as the `aiter` backend (optimized.aiter_backend),
so the adapter a ROCm user runs is exercised on any GPU and on the CPU:

* `aiter-triton`: compiled Triton (an NVIDIA or AMD GPU);
* `aiter-triton-interpret`: the Triton interpreter on the CPU.

The pooling (vLLM's op, not aiter's), scorer and top-k are mxval's own Triton kernels: aiter's scorer
(`paged_mxfp4_mqa_logits`) is a Gluon kernel for gfx950 only and its top-k
(`top_k_per_row_decode`) a HIP kernel; neither runs outside a gfx950 ROCm build.

The tree: `--aiter DIR` on `mxval validate`, $MXVAL_AITER_SRC, or the one `mxval upstream
fetch --aiter` put in the cache; its files must match the table's pins (optimized.upstream
PINS) unless named and trusted (`--trust-upstream`).
"""
from __future__ import annotations

from typing import Optional

from . import DECLARED, Backend
from .aiter_backend import make_ops

OPS = ("k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant")
MXVAL_OPS = ("compress_pool", "paged_mxfp4_mqa_logits", "topk")
HEAD = DECLARED["aiter-triton"].summary
# Compiled with enable_fp_fusion (both wrappers launch with it), LLVM contracts the rotation
# `e*cos - o*sin`, `o*cos + e*sin` into fma(e, cos, -(o*sin)), fma(o, cos, e*sin): the
# reference's `fma-oc` (reference/rope.py); the interpreter contracts nothing.
COMPILED_ROPE = "fma-oc"


def numerics(interpreted: bool) -> dict:
    rope = "separate" if interpreted else COMPILED_ROPE
    return {op: {"rope": rope} for op in OPS}


def limits(op: str, scalars: dict) -> Optional[str]:
    if op == "q_rope_mxfp4_quant" and "softmax_scale" in scalars:
        return ("aiter's Q quant takes one weights_scale (the ROCm path); the case asks vLLM's CUDA path "
                "(softmax_scale then head_scale)")
    return None


def _interpreted(fn):
    """aiter's wrapper, run with mxval's interpreter patch in force (its kernels launch inside)."""
    from .vllm_kernels import interp_patch

    def call(*args, **kwargs):
        with interp_patch.active():
            return fn(*args, **kwargs)
    call.__name__ = getattr(fn, "__name__", "aiter_wrapper")
    return call


class _Wrappers(dict):
    """The adapter's `fn` table over the lazily compiled wrappers (nothing upstream runs until
    an op is called)."""

    def __init__(self, s, interpreted: bool):
        super().__init__()
        from .vllm_kernels.aiter_set import K_KEY, Q_KEY
        for label, key in (("k_norm_rope_mxfp4_cache", K_KEY), ("q_rope_mxfp4_quant", Q_KEY)):
            def call(*args, _key=key, **kwargs):
                fn = s.wrappers[_key]
                return (_interpreted(fn) if interpreted else fn)(*args, **kwargs)
            self[label] = call


def _make(name: str, interpret: bool) -> Backend:
    from .vllm_kernels.aiter_set import aiter_set
    from .vllm_triton_backend import _mxval_triton_ops, load_upstream
    s, device, unavailable = load_upstream(name, HEAD, interpret, aiter_set)
    if unavailable:
        return unavailable
    num = numerics(interpret)
    ops = make_ops(_Wrappers(s, interpret), device, num)
    ops.update(_mxval_triton_ops(device, MXVAL_OPS))
    desc = f"{HEAD}; {s.note()}; compared with the reference's rope={num['k_norm_rope_mxfp4_cache']['rope']}"
    return Backend(name, desc, ops, device=device, limits=limits, source=s.source.describe(), numerics=num)


def make_backend() -> Backend:
    return _make("aiter-triton", False)


def make_interpret_backend() -> Backend:
    return _make("aiter-triton-interpret", True)
