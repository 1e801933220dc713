"""Argument checks of the public diff API: one ValueError naming the argument, up front.

The differs never trust their caller: a list where a tensor belongs, an fp32 `actual`
against a bf16 `expected` (which would be rounded and reported exact), a wrong rank, a
head dim of 0, negative row ends (nothing compared, a silent pass), strides too small for
the page size, a meta, sparse or nested tensor... each is refused before anything is
compared. Built on reference/checks.py: its INT_DTYPES, its half-open ranges `[lo, hi)`,
`bool` never an integer.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from reference import checks

INT_DTYPES = checks.INT_DTYPES
FLOATS = (torch.float32, torch.float64)


def _dt(d) -> str:
    return str(d).replace("torch.", "")


def tensor(name: str, t, dtypes: Optional[Sequence[torch.dtype]] = None, ndim: Optional[int] = None) -> torch.Tensor:
    checks.plain(name, t)
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {_dt(t.dtype)}, expected {' or '.join(_dt(d) for d in dtypes)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(t.shape)}")
    return t


def same(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor, *, dtype: bool = True) -> None:
    """`t` has the shape (and dtype) of `like`: an fp32 actual is never rounded onto a bf16 expected."""
    if t.shape != like.shape:
        raise ValueError(f"{name}: shape {list(t.shape)} differs from {like_name} {list(like.shape)}")
    if dtype and t.dtype != like.dtype:
        raise ValueError(f"{name}: dtype {_dt(t.dtype)} differs from {like_name} {_dt(like.dtype)}")


def index(name: str, v, *, ndim: int = 1, lo: Optional[int] = None, hi: Optional[int] = None,
          mask: bool = False) -> torch.Tensor:
    """An integer tensor of INT_DTYPES (or a list of ints) of `ndim` dimensions, values in
    [lo, hi); long, on the CPU. `mask`: a bool tensor is accepted as a row mask (returned
    as it is, for the caller to check its length) instead of being refused."""
    if mask and isinstance(v, torch.Tensor) and v.dtype == torch.bool:
        return checks.plain(name, v)
    return checks.int_tensor(name, v, ndim=ndim, lo=lo, hi=hi)


def pos_int(name: str, v, lo: int = 1) -> int:
    if not checks.is_int(v):
        raise ValueError(f"{name}: expected an integer, got {v!r}")
    if v < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {v}")
    return v


def flag(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name}: expected True or False, got {v!r}")
    return v


def nonneg(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0 or math.isinf(v):
        raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
    return float(v)


def mapping(name: str, v) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"{name}: expected a dict of name -> value, got {type(v).__name__}")
    for k, t in v.items():
        if isinstance(t, torch.Tensor):
            checks.plain(f"{name}[{k!r}]", t)
    return v
