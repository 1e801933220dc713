"""Replaying captured dumps: re-run each recorded op and diff.

Two questions, one function:
* `replay_dump(dump)`: is the recorded output what the contract says? Runs the reference
  (reference.OPS) on the recorded inputs; `expected` = reference, `actual` = recorded.
* `replay_dump(dump, backend="triton")`: does my kernel reproduce this capture? Runs the
  backend on the recorded inputs; `expected` = recorded, `actual` = the backend's.

The scorer is compared on each row's valid region (the -inf pattern too when the dump says
`clean_logits`), at the recorded width, against the reference's fp64 logits. For top-k the
recorded logits are the reference scores. Non-finite inputs are their own result
(`nonfinite_inputs` > 0, class `nonfinite_input`), never a pass. A recorded input the
reference rejects (a slot past the pool, a bad shuffle...) is a broken dump: DumpError.

The output a kernel produced (the recorded one; the backend's when one replays) is also held
to the invariants that need no reference (harness/diff/invariants.py, metric
`invariant_violations`), non-finite inputs included: a top-k that turns a NaN row of live
traffic into out-of-row indices is caught although no reference judges that row.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

import reference
from harness.diff import DiffReport, diff_op, invariants
from harness.io.dumps import Dump, DumpError, OpRecord, json_scalar, read_dump, record_problem
from reference.checks import NonFiniteInput


def record_op(op: str, inputs: dict, scalars: dict, outputs: dict, host=None) -> OpRecord:
    """An OpRecord of one op call, copied to the CPU and validated against OP_FIELDS
    (ValueError naming the problem). Pass the pool as it was BEFORE the call in `inputs`.
    `host(shape, dtype)`: where each copy goes (an empty CPU tensor; default torch.empty)."""
    def copy(v):
        if host is None:
            return v.detach().to("cpu", copy=True)
        out = host(tuple(v.shape), v.dtype)
        out.copy_(v.detach())
        return out
    rec = OpRecord(op, {k: json_scalar(v) for k, v in scalars.items()},
                   {k: copy(v) for k, v in inputs.items()}, {k: copy(v) for k, v in outputs.items()})
    problem = record_problem(rec)
    if problem:
        raise ValueError(problem)
    return rec


def _nonfinite_report(op: str, e: NonFiniteInput) -> DiffReport:
    return DiffReport(op, {"nonfinite_inputs": float(e.count), "class_nonfinite_input": 1.0},
                      [{"class": "nonfinite_input", "arg": e.arg, "first": e.first, "where": str(e)}],
                      ["non-finite inputs are outside the contract: not compared"])


def _call(fn, rec: OpRecord, device, extra: dict) -> dict:
    # clones: a kernel that writes its pool in place must not change the recorded `before`
    ins = {k: v.to(device).clone() for k, v in rec.inputs.items()}
    out = fn(**ins, **rec.scalars, **extra)
    if isinstance(out, torch.Tensor):        # the fp64 scorer returns the logits alone
        out = {"logits": out}
    return {k: v.detach().cpu() for k, v in out.items()}


def _unsupported_option(op: str, rec: OpRecord, fn) -> Optional[str]:
    """The first recorded optional scalar that the backend's function has no parameter for
    (by its signature), or None."""
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):          # no signature to read: let the call say
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return next((n for n in reference.OPS[op].fields.optional if n in rec.scalars and n not in params), None)


def _unsupported(op: str, why: str) -> DiffReport:
    return DiffReport(op, {"op_unsupported": 1.0}, [{"class": "op_unsupported", "where": why}],
                      [f"{why}: not compared"])


def replay_op(rec: OpRecord, backend=None, *, path: Optional[str] = None, device=None) -> DiffReport:
    """Replay one record; see the module docstring. `backend`: None (the reference), a
    backend name, or an optimized.Backend. `device`: where the reference runs (default the
    CPU; the same bytes anywhere, NUMERICS.md); the diff runs on the host."""
    op = rec.op
    extra = {"width": rec.outputs["logits"].shape[1]} if reference.OPS[op].fp64 else {}
    where = f"{path or '<dump>'}: {op}"
    actual = None
    try:
        if backend is None:
            fn = (reference.OPS[op].fp64 or reference.OPS[op].fn)
            expected = _call(fn, rec, device or "cpu", extra)
            actual, label = rec.outputs, "recorded output vs the reference"
        else:
            be = backend
            if isinstance(backend, str):
                from optimized import get_backend
                be = get_backend(backend)
            if not be.supports(op):
                return _unsupported(op, f"backend {be.name!r} does not implement {op}")
            fn = getattr(be, op)
            opt = _unsupported_option(op, rec, fn)
            if opt is not None:
                return _unsupported(op, f"backend {be.name!r} does not implement {op}'s option "
                                        f"{opt} = {rec.scalars[opt]!r}")
            actual = _call(fn, rec, be.device, extra)
            expected, label = rec.outputs, f"backend {be.name!r} vs the recorded output"
    except NonFiniteInput as e:
        # the kernel's output on inputs outside the contract: the invariants alone judge it
        # (the recorded output; a backend that refused the inputs has none)
        out = rec.outputs if backend is None else actual
        rep = _nonfinite_report(op, e)
        return rep if out is None else invariants.merge(
            rep, invariants.check(op, rec.inputs, rec.scalars, out, declared_nonfinite=True))
    except TypeError as e:
        if backend is not None:           # a backend that does not take the interface's arguments
            raise
        raise DumpError(f"{where}: the op rejects the recorded arguments ({e})") from None
    except ValueError as e:               # the op's own argument checks: the recorded inputs are bad
        raise DumpError(f"{where}: {e}") from None
    rep = diff_op(op, rec.inputs, rec.scalars, actual, expected)
    rep.notes.append(label)
    return invariants.merge(rep, invariants.check(op, rec.inputs, rec.scalars, actual))


def replay_dump(dump: Dump, backend: Union[None, str, object] = None) -> list[DiffReport]:
    """One DiffReport per op of the dump, in the dump's op order."""
    if isinstance(backend, str):
        from optimized import get_backend
        backend = get_backend(backend)       # BackendUnavailable: one line, before any work
    return [replay_op(rec, backend, path=dump.path) for rec in dump.ops.values()]


def replay_file(path, backend=None) -> list[DiffReport]:
    return replay_dump(read_dump(path), backend)
