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

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from reference.ops import OP_NAMES  # noqa: F401  (re-exported: the ops a backend may implement)


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


# name -> "module:factory"; factories return a Backend (unavailable ones carry a reason).
_FACTORIES: dict[str, str] = {
    "reference": "optimized.reference_backend:make_backend",
    "triton": "optimized.triton_kernels:make_backend",
    "triton-interpret": "optimized.triton_kernels:make_interpreter_backend",
    "aiter": "optimized.aiter_backend:make_backend",
    "aiter-triton": "optimized.aiter_triton_backend:make_backend",
    "aiter-triton-interpret": "optimized.aiter_triton_backend:make_interpret_backend",
    "vllm": "optimized.vllm_backend:make_backend",
    "vllm-cuda": "optimized.vllm_triton_backend:make_cuda_backend",
    "vllm-cuda-interpret": "optimized.vllm_triton_backend:make_cuda_interpret_backend",
    "vllm-rocm": "optimized.vllm_triton_backend:make_rocm_backend",
    "vllm-rocm-interpret": "optimized.vllm_triton_backend:make_rocm_interpret_backend",
}
_EXTRA: dict[str, Callable[[], Backend]] = {}


def register(name: str, factory: Callable[[], Backend]) -> None:
    """Add a backend (the fault catalogue registers its broken variants here)."""
    _EXTRA[name] = factory


def backend_names(include_extra: bool = False) -> list[str]:
    names = ["auto", *_FACTORIES]
    return names + sorted(_EXTRA) if include_extra else names


def _load_extra() -> None:
    try:
        importlib.import_module("optimized.faults")
    except ImportError:
        pass


def _make(name: str) -> Backend:
    if name in _FACTORIES:
        mod, fn = _FACTORIES[name].split(":")
        try:
            return getattr(importlib.import_module(mod), fn)()
        except ImportError as e:
            return Backend(name, "", reason=f"cannot import {mod}: {e}")
    if name not in _EXTRA:
        _load_extra()
    if name in _EXTRA:
        return _EXTRA[name]()
    known = ", ".join(backend_names()) + ", fault:<name> (see `mxval backends --faults`)"
    raise BackendUnavailable(f"unknown backend {name!r} (known: {known})")


def auto_backend_name() -> str:
    """aiter on ROCm when importable (vLLM's pooling kernel needs vllm), else triton on a
    GPU, else the Triton interpreter on the CPU."""
    for name in ("aiter", "triton"):
        if _make(name).available() is None:
            return name
    return "triton-interpret"


def get_backend(name: str = "auto", *, require: bool = True) -> Backend:
    """The backend called `name`; with `require`, raise BackendUnavailable (one line) when
    it cannot run here."""
    be = _make(auto_backend_name() if name == "auto" else name)
    if require and be.available():
        raise BackendUnavailable(f"backend {be.name!r} is unavailable: {be.available()}")
    return be
