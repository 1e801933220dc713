"""Argument checks, one vocabulary for the whole project: one clear ValueError naming the
argument. The reference ops, the diff API (harness/diff/args.py), the case schema
(harness/run/cases.py) and the dump reader (harness/io/dumps.py) all build on it.

Conventions, for every caller:
  - An integer is a Python `int`, never a `bool` (`True` is not 1 here): `is_int`.
  - An integer tensor (an index, a position, a length) has a dtype in `INT_DTYPES`, the
    int32/int64 vLLM passes; bool, uint8, int8 and int16 tensors are refused.
  - A range `(lo, hi)` is half-open, `lo <= v < hi`, as `range()` and tensor indices are;
    messages print it `[lo, hi)`. An upper bound that is a maximum `m` is written `m + 1`.
  - A tensor is a plain one: strided, with data (not `meta`), not nested, not sparse, not
    requiring grad (`plain`); anything else would fail deep inside torch instead of naming
    the argument. An integer scalar is within int32 (`scalar`).
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterable, Sequence

import torch

from .values import _show, choice, integer, is_int, number, scalar  # noqa: F401  (this module's API too)

INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def plain(name: str, t) -> torch.Tensor:
    """`t` is a tensor with strided data (not meta, sparse, nested or another layout)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.is_nested:
        raise ValueError(f"{name}: a nested tensor, expected a plain strided tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: layout {str(t.layout).replace('torch.', '')}, expected a plain strided tensor")
    if t.is_meta:
        raise ValueError(f"{name}: a meta tensor (no data), expected a tensor with values")
    if t.requires_grad:
        raise ValueError(f"{name}: requires grad; the ops are not differentiable (pass `{name}.detach()`)")
    return t


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(name: str, t, dtypes: Sequence[torch.dtype] | torch.dtype, shape: Sequence) -> torch.Tensor:
    """Check dtype and shape. `shape` entries: int (exact), None (any), or str (a named
    dimension, returned consistent via `dims`)."""
    plain(name, t)
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != len(shape) or any(s is not None and not isinstance(s, str) and s != n for s, n in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    return t


class Dims:
    """Binds named dimensions across arguments: `d.bind("T", "k", k.shape[0])`."""

    def __init__(self):
        self.values: dict[str, tuple[int, str]] = {}

    def bind(self, dim: str, name: str, value: int) -> int:
        if dim in self.values and self.values[dim][0] != value:
            v, first = self.values[dim]
            raise ValueError(f"{name}: dimension {dim} is {value} but {first} has {v}")
        self.values.setdefault(dim, (value, name))
        return value

    def check(self, name: str, t: torch.Tensor, dtypes, shape: Sequence) -> torch.Tensor:
        tensor(name, t, dtypes, shape)
        for s, n in zip(shape, t.shape):
            if isinstance(s, str):
                self.bind(s, name, int(n))
        return t


_KERNEL_LIKE = threading.local()


@contextlib.contextmanager
def values_unchecked():
    """Inside, non-finite tensor values pass the argument checks (shapes, dtypes and ranges are
    still checked): a backend's wrapper that shares the reference's checks then runs its
    kernel on whatever values it is given, as a kernel does, and its outputs are held to the
    invariants that need no reference (NUMERICS.md §11). The reference never enters it."""
    before = getattr(_KERNEL_LIKE, "on", False)
    _KERNEL_LIKE.on = True
    try:
        yield
    finally:
        _KERNEL_LIKE.on = before


def nonfinite(name: str, bad: torch.Tensor) -> None:
    """Report the non-finite values flagged in `bad` (NonFiniteInput), unless inside
    `values_unchecked`."""
    if bool(bad.any()) and not getattr(_KERNEL_LIKE, "on", False):
        raise NonFiniteInput(name, int(bad.sum()), bad.nonzero()[0].tolist())


def finite(name: str, t: torch.Tensor) -> None:
    """Non-finite inputs are outside the contract: report them, never encode them."""
    if t.is_floating_point():
        nonfinite(name, ~torch.isfinite(t))


def first_failure(tests) -> None:
    """`tests`: (bool tensor, check) pairs. The device-side flags are read with one host
    sync; the check of the first flag that is set runs and raises with its own words (a
    check whose flag is clear is never run)."""
    tests = list(tests)
    if not tests:
        return
    flags = torch.stack([t.reshape(()).to(torch.bool) for t, _ in tests]).tolist()
    for flag, (_, check) in zip(flags, tests):
        if flag:
            check()


class NonFiniteInput(ValueError):
    """Raised for NaN/Inf inputs: a separate class of result, never a pass."""

    def __init__(self, name: str, count: int, first: list[int]):
        self.arg, self.count, self.first = name, count, first
        super().__init__(f"{name}: {count} non-finite value(s), first at index {first} "
                         "(outside the MXFP4 contract; not encoded)")


def int_range(name: str, t: torch.Tensor, lo: int, hi: int, *, allow_negative: bool = False) -> None:
    """All entries in [lo, hi) (half-open, the one convention), except negatives when
    `allow_negative` (skip markers)."""
    if t.numel() == 0:
        return
    vals = t[t >= 0] if allow_negative else t
    if vals.numel() == 0:
        return
    mn, mx = int(vals.min()), int(vals.max())
    if mn < lo or mx >= hi:
        bad = mn if mn < lo else mx
        raise ValueError(f"{name}: value {bad} out of range [{lo}, {hi})")


def int_tensor(name: str, v, *, ndim: int = 1, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
    """An integer tensor of INT_DTYPES (or a list of ints) with `ndim` dimensions, values in
    [lo, hi) (either bound optional); returned as int64 on the CPU."""
    if isinstance(v, (list, tuple)):
        if any(isinstance(x, bool) for x in _flat(v)):
            raise ValueError(f"{name}: expected integers, got a bool in {v!r:.60}")
        try:
            v = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise ValueError(f"{name}: expected a tensor or a list of integers, got {v!r:.60}") from None
        if v.numel() == 0:
            v = v.long()
    plain(name, v)
    if v.dtype not in INT_DTYPES:
        raise ValueError(f"{name}: dtype {str(v.dtype).replace('torch.', '')}, expected {_dtype_names(INT_DTYPES)}")
    if v.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension(s), got shape {list(v.shape)}")
    v = v.cpu().long()
    if v.numel():
        mn, mx = int(v.min()), int(v.max())
        if lo is not None and mn < lo:
            raise ValueError(f"{name}: value {mn} is out of range [{lo}, {'' if hi is None else hi})")
        if hi is not None and mx >= hi:
            raise ValueError(f"{name}: value {mx} is out of range [{'' if lo is None else lo}, {hi})")
    return v


def _flat(v):
    for x in v:
        if isinstance(x, (list, tuple)):
            yield from _flat(x)
        else:
            yield x


def head_and_rope_dims(name: str, t: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[int, int]:
    """(D, R) of a head tensor `t` (D its last dim) and its RoPE cache: D in whole 32-blocks,
    R even and at most D."""
    d, rdim = t.shape[-1], cos_sin_cache.shape[1]
    if d % 32:
        raise ValueError(f"{name}: head dim {d} is not a multiple of 32")
    if rdim % 2 or rdim > d:
        raise ValueError(f"cos_sin_cache: rope dim {rdim} must be even and at most D={d}")
    return d, rdim


def positive_finite(name: str, value) -> float:
    """A scalar that must be a finite number > 0 (an eps, a scale): NaN and inf are
    non-finite inputs (NonFiniteInput), 0 and negative values a ValueError; none is encoded."""
    scalar(name, value, (float, int))
    if not math.isfinite(value):
        raise NonFiniteInput(name, 1, [])
    if value <= 0:
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
    f32 = float(torch.tensor(float(value), dtype=torch.float32))       # the ops use it in fp32
    if not math.isfinite(f32) or f32 <= 0:
        raise ValueError(f"{name}: {value!r} is {f32!r} in fp32, expected a finite number > 0 there")
    return value
