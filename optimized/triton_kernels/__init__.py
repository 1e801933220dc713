"""mxval's own Triton implementation of the indexer ops, written from NUMERICS.md.

Two backends share these kernels:
* `triton`: compiled, on a CUDA or ROCm GPU (inputs may arrive on the CPU; outputs go
  back to the input's device);
* `triton-interpret`: the same kernels through the Triton interpreter on the CPU (CI, and
  machines without a GPU);
* `triton-fused` / `triton-fused-interpret`: the same, and the ROCm path's pooling and MXFP4
  K writer also as one launch (`fused_k`, offered as `Backend.fused_pool`). TRITON_INTERPRET must be set before any kernel is decorated,
  so the kernel modules are imported only after the mode is fixed; one process runs one
  mode. Interpreter workarounds live in interp.py and nowhere else.
"""
from __future__ import annotations

import functools
import os
import sys

from optimized import DECLARED, Backend
from optimized.probe import no_gpu


def _kernels_mode() -> str | None:
    """'interpret' / 'compiled' when the kernel modules are already imported, else None."""
    mod = sys.modules.get(__name__ + ".interp")
    if mod is None:
        return None
    return "interpret" if bool(mod.INTERPRETED) else "compiled"


def _ops(device: str) -> dict:
    from . import fp8, k_writer, pooling, q_quant, scoring, topk
    ops: dict = {}
    for mod in (pooling, k_writer, q_quant, scoring, topk, fp8):
        ops.update(mod.make_op(device))
    return {name: _kernel_like(fn) for name, fn in ops.items()}


def _kernel_like(fn):
    """The op as a kernel takes its inputs: the wrappers' argument checks are the reference's,
    but non-finite values reach the kernels (whose outputs the invariants then judge) rather
    than being refused."""
    from reference.checks import values_unchecked

    @functools.wraps(fn)
    def op(**kw):
        with values_unchecked():
            return fn(**kw)
    return op


def compiled_reason() -> str | None:
    """Why mxval's compiled Triton kernels cannot run in this process (no triton, the
    interpreter mode fixed, no GPU), or None."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not importable ({e})"
    import torch
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or _kernels_mode() == "interpret":
        return "TRITON_INTERPRET=1 in this process: use the triton-interpret backend"
    if not torch.cuda.is_available():
        return no_gpu("triton")
    return None


def _fused(device: str) -> dict:
    from . import fused_k
    return {name: _kernel_like(fn) for name, fn in fused_k.make_fused(device).items()}


def make_backend(name: str = "triton") -> Backend:
    desc = DECLARED[name].summary
    reason = compiled_reason()
    if reason:
        return Backend(name, desc, reason=reason)
    import torch
    fused = _fused("cuda") if name == "triton-fused" else {}
    return Backend(name, f"{desc}, compiled on {torch.cuda.get_device_name(0)}", _ops("cuda"), device="cuda",
                   fused_pool=fused)


def make_fused_backend() -> Backend:
    return make_backend("triton-fused")


def _triton_for_interpreter() -> None:
    """Interpreter workaround (listed in interp.py): triton's own library functions
    (tl.sum, tl.cdiv, ...) are decorated when triton is imported; imported before
    TRITON_INTERPRET=1 they are compiled-mode functions that the interpreter cannot call.
    Set the variable, and re-import triton when it was imported without it (our kernels
    are not loaded yet, so nothing of ours holds the old modules)."""
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" not in sys.modules:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    if isinstance(tl.standard.sum, InterpretedFunction):
        return
    for name in [m for m in sys.modules if (m == "triton" or m.startswith("triton."))
                 and not m.startswith("triton._C")]:   # the native extension stays
        del sys.modules[name]
    import triton.language  # noqa: F401  (re-decorated in interpreter mode)


def make_interpreter_backend(name: str = "triton-interpret") -> Backend:
    desc = DECLARED[name].summary
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return Backend(name, desc, reason=f"triton is not importable ({e})")
    if _kernels_mode() == "compiled":
        return Backend(name, desc, reason="the kernels are already compiled in this "
                       "process; start a new one with TRITON_INTERPRET=1")
    _triton_for_interpreter()
    fused = _fused("cpu") if name == "triton-fused-interpret" else {}
    return Backend(name, desc, _ops("cpu"), device="cpu", fused_pool=fused)


def make_fused_interpreter_backend() -> Backend:
    return make_interpreter_backend("triton-fused-interpret")
