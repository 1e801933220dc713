"""Backends: one small interface over every implementation of the indexer ops.

A backend is an object whose attributes are the op functions of DUMPS.md, with the same
keyword arguments and returned dicts as `reference` (`backend.k_norm_rope_mxfp4_cache(...)`),
plus `name`, `description`, `device` and `available()` (None when usable, else the reason).
The harness only ever talks to this interface and never knows which backend runs.

    from optimized import get_backend
    be = get_backend("auto")          # aiter on ROCm, triton on a GPU, triton-interpret on a CPU
    out = be.q_rope_mxfp4_quant(q=q, positions=pos, cos_sin_cache=cs, weights=w, weights_scale=s)
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from reference.op_table import OP_NAMES  # noqa: F401  (re-exported: the ops a backend may implement)


class BackendUnavailable(RuntimeError):
    """Raised with one line saying exactly what is missing."""


@dataclass
class Backend:
    name: str
    description: str
    ops: dict[str, Callable] = field(default_factory=dict)
    device: str = "cpu"                       # where it wants its input tensors
    reason: Optional[str] = None              # why it is unavailable; None when usable
    # (op, scalars) -> why this backend cannot run the op with those scalars (the case is
    # skipped with that reason, not failed); None when it can
    limits: Optional[Callable[[str, dict], Optional[str]]] = None
    source: str = ""                          # where its upstream code was loaded from ("" = mxval's own)
    # op -> reference options that say what this backend computes where the reference offers
    # a choice (e.g. {"compress_norm_rope_mxfp4_cache": {"rope": "fma-oc"}}); the runner
    # passes them to the reference and to the backend alike, and dumps record them.
    numerics: dict[str, dict] = field(default_factory=dict)
    # why its ops cannot be replayed from a CUDA/HIP graph (graph mode, harness/run/graph.py); None: they can
    no_graph: Optional[str] = None
    # K writer op -> one launch that does `compress_pool` and that op together (the ROCm path's
    # two ops fused; docs/paths.md): it takes both ops' inputs but `k` and both ops' scalars,
    # and returns both ops' outputs ({"pooled", "kv_cache"}). The runner then judges the pooling
    # and the K writer stages on that one launch's outputs; the two ops stay in `ops` for a
    # call of either alone.
    fused_pool: dict[str, Callable] = field(default_factory=dict)

    def available(self) -> Optional[str]:
        return self.reason

    def supports(self, op: str) -> bool:
        return op in self.ops

    def cannot(self, op: str, scalars: dict) -> Optional[str]:
        return self.limits(op, scalars) if self.limits else None

    def __getattr__(self, op: str) -> Callable:
        if op in OP_NAMES:
            if self.reason:
                raise BackendUnavailable(f"backend {self.name!r} is unavailable: {self.reason}")
            try:
                return self.__dict__["ops"][op]
            except KeyError:
                raise BackendUnavailable(f"backend {self.name!r} does not implement {op}") from None
        raise AttributeError(op)


@dataclass(frozen=True)
class Declared:
    """A backend as declared: what builds it, what it is, and what it needs to run here
    (optimized/probe.py checks the needs without importing torch, triton, aiter or vllm)."""
    name: str
    factory: str                  # "module:function" returning the Backend (unavailable ones carry a reason)
    summary: str                  # what it is (its factory's description starts with it)
    # "triton" (installed), "gpu" (compiled Triton: a CUDA or ROCm GPU visible to torch),
    # "rocm-gfx950", "module:<name>" (importable), "tree:vllm" / "tree:aiter" (upstream source found)
    needs: tuple = ()

    @property
    def interpreted(self) -> bool:
        return "triton" in self.needs and "gpu" not in self.needs


_TRITON = "mxval Triton kernels (optimized/triton_kernels)"
_AITER_TRITON = ("aiter's K writer k_norm_rope_mxfp4_cache and Q quant q_rope_mxfp4_quant (its wrappers and Triton "
                 "kernels, through mxval's aiter adapter) with mxval's Triton pooling, scorer and top-k (aiter's "
                 "scorer is a gfx950 Gluon kernel, its top-k a HIP kernel; the pooling is vLLM's)")
_TRITON_FUSED = (_TRITON + "; the ROCm path's pooling and MXFP4 K writer as one launch "
                 "(optimized/triton_kernels/fused_k.py)")
_VLLM_CUDA = ("vLLM's CUDA indexer path (fused K writers MXFP4/FP8 + fused Q quant) with mxval's Triton scorer "
              "and top-k (vLLM's are DeepGEMM/CUDA ops)")
_VLLM_ROCM = "vLLM's ROCm pooling kernel _compress_pool_kernel"
DECLARED: dict[str, Declared] = {d.name: d for d in (
    Declared("reference", "optimized.reference_backend:make_backend", "pure-torch reference (reference/)"),
    Declared("triton", "optimized.triton_kernels:make_backend", _TRITON, ("triton", "gpu")),
    Declared("triton-interpret", "optimized.triton_kernels:make_interpreter_backend",
             _TRITON + ", Triton interpreter on the CPU", ("triton",)),
    Declared("triton-fused", "optimized.triton_kernels:make_fused_backend", _TRITON_FUSED, ("triton", "gpu")),
    Declared("triton-fused-interpret", "optimized.triton_kernels:make_fused_interpreter_backend",
             _TRITON_FUSED + ", Triton interpreter on the CPU", ("triton",)),
    Declared("aiter", "optimized.aiter_backend:make_backend",
             "aiter's ROCm ops (K writer, Q quant, paged MXFP4 scorer, top-k), gfx950",
             ("module:aiter", "rocm-gfx950")),
    Declared("aiter-triton", "optimized.aiter_triton_backend:make_backend", _AITER_TRITON,
             ("triton", "gpu", "tree:aiter")),
    Declared("aiter-triton-interpret", "optimized.aiter_triton_backend:make_interpret_backend", _AITER_TRITON,
             ("triton", "tree:aiter")),
    Declared("vllm", "optimized.vllm_backend:make_backend",
             "vLLM's DeepSeek-V4 ROCm indexer (pooling, K store, Q quant, top-k) + aiter's scorer",
             ("module:vllm", "module:aiter", "rocm-gfx950")),
    Declared("vllm-cuda", "optimized.vllm_triton_backend:make_cuda_backend", _VLLM_CUDA, ("triton", "gpu", "tree:vllm")),
    Declared("vllm-cuda-interpret", "optimized.vllm_triton_backend:make_cuda_interpret_backend", _VLLM_CUDA,
             ("triton", "tree:vllm")),
    Declared("vllm-rocm", "optimized.vllm_triton_backend:make_rocm_backend", _VLLM_ROCM, ("triton", "gpu", "tree:vllm")),
    Declared("vllm-rocm-interpret", "optimized.vllm_triton_backend:make_rocm_interpret_backend", _VLLM_ROCM,
             ("triton", "tree:vllm")),
)}
# `auto`: the first of these that is available here (the last always is, given triton).
AUTO_ORDER = ("aiter", "triton", "triton-interpret")
_EXTRA: dict[str, Callable[[], Backend]] = {}


def register(name: str, factory: Callable[[], Backend]) -> None:
    """Add a backend (the fault catalogue registers its broken variants here)."""
    _EXTRA[name] = factory


def backend_names(include_extra: bool = False) -> list[str]:
    names = ["auto", *DECLARED]
    return names + sorted(_EXTRA) if include_extra else names


def _load_extra() -> None:
    try:
        importlib.import_module("optimized.faults")
    except ImportError:
        pass


def _quiet(fn: Callable) -> Callable:
    """`fn` with numpy's floating-point warnings off: the Triton interpreter runs every lane of
    a block through numpy, masked lanes too (a softmax's `-inf - -inf` in the padding of a
    pooling window), and numpy's "invalid value encountered" says nothing of the kernel's
    output, which is compared byte for byte; nor does its "All-NaN slice" on a planted NaN row.
    Warnings from anything else stay on."""
    @functools.wraps(fn)
    def op(*args, **kwargs):
        import warnings

        import numpy as np
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="All-NaN (slice|axis) encountered", category=RuntimeWarning)
            return fn(*args, **kwargs)
    return op


def _make(name: str) -> Backend:
    if name in DECLARED:
        mod, fn = DECLARED[name].factory.split(":")
        try:
            be = getattr(importlib.import_module(mod), fn)()
        except ImportError as e:
            return Backend(name, "", reason=f"cannot import {mod}: {e}")
        if DECLARED[name].interpreted and be.reason is None:
            be.ops = {op: _quiet(f) for op, f in be.ops.items()}
        return be
    if name not in _EXTRA:
        _load_extra()
    if name in _EXTRA:
        return _EXTRA[name]()
    known = ", ".join(backend_names()) + ", fault:<name> (see `mxval backends --faults`)"
    raise BackendUnavailable(f"unknown backend {name!r} (known: {known})")


def auto_backend_name() -> str:
    """aiter on ROCm when importable (vLLM's pooling kernel needs vllm), else triton on a
    GPU, else the Triton interpreter on the CPU."""
    for name in AUTO_ORDER[:-1]:
        if _make(name).available() is None:
            return name
    return AUTO_ORDER[-1]


def get_backend(name: str = "auto", *, require: bool = True) -> Backend:
    """The backend called `name`; with `require`, raise BackendUnavailable (one line) when
    it cannot run here."""
    be = _make(auto_backend_name() if name == "auto" else name)
    if require and be.available():
        raise BackendUnavailable(f"backend {be.name!r} is unavailable: {be.available()}")
    return be
