"""Argument checks shared by every op: one clear ValueError naming the argument."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(name: str, t, dtypes: Sequence[torch.dtype] | torch.dtype, shape: Sequence) -> torch.Tensor:
    """Check dtype and shape. `shape` entries: int (exact), None (any), or str (a named
    dimension, returned consistent via `dims`)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
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


def finite(name: str, t: torch.Tensor) -> None:
    """Non-finite inputs are outside the contract: report them, never encode them."""
    if t.is_floating_point():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            idx = bad.nonzero()[0].tolist()
            raise NonFiniteInput(name, int(bad.sum()), idx)


class NonFiniteInput(ValueError):
    """Raised for NaN/Inf inputs: a separate class of result, never a pass."""

    def __init__(self, name: str, count: int, first: list[int]):
        self.arg, self.count, self.first = name, count, first
        super().__init__(f"{name}: {count} non-finite value(s), first at index {first} "
                         "(outside the MXFP4 contract; not encoded)")


def int_range(name: str, t: torch.Tensor, lo: int, hi: int, *, allow_negative: bool = False) -> None:
    """All entries in [lo, hi), except negatives when `allow_negative` (skip markers)."""
    if t.numel() == 0:
        return
    vals = t[t >= 0] if allow_negative else t
    if vals.numel() == 0:
        return
    mn, mx = int(vals.min()), int(vals.max())
    if mn < lo or mx >= hi:
        bad = mn if mn < lo else mx
        raise ValueError(f"{name}: value {bad} out of range [{lo}, {hi})")


def scalar(name: str, value, kind=(int,), *, positive: bool = False):
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name}: expected {' or '.join(k.__name__ for k in kind)}, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name}: expected a positive value, got {value!r}")
    return value


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


def choice(name: str, value, options: Sequence):
    if value not in options:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, options))}, got {value!r}")
    return value
