"""Argument checks of the public diff API: one ValueError naming the argument, up front.

The differs never trust their caller: a list where a tensor belongs, an fp32 `actual`
against a bf16 `expected` (which would be rounded and reported exact), a wrong rank, a
head dim of 0, negative row ends (nothing compared, a silent pass), strides too small for
the page size... each is refused before anything is compared.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
FLOATS = (torch.float32, torch.float64)


def _dt(d) -> str:
    return str(d).replace("torch.", "")


def tensor(name: str, t, dtypes: Optional[Sequence[torch.dtype]] = None, ndim: Optional[int] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
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
          allow_bool: bool = False) -> torch.Tensor:
    """An integer tensor (or a list of ints) of `ndim` dimensions, values in [lo, hi]; long, on the CPU."""
    if isinstance(v, (list, tuple)):
        try:
            v = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name}: expected a tensor or a list of integers, got {v!r:.60}") from None
        if v.numel() == 0:
            v = v.long()
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"{name}: expected an integer tensor, got {type(v).__name__}")
    if v.dtype == torch.bool and allow_bool:
        return v
    if v.dtype not in INT_DTYPES:
        raise ValueError(f"{name}: dtype {_dt(v.dtype)}, expected an integer tensor")
    if v.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension(s), got shape {list(v.shape)}")
    v = v.cpu().long()
    if v.numel():
        mn, mx = int(v.min()), int(v.max())
        if lo is not None and mn < lo:
            raise ValueError(f"{name}: value {mn} is below {lo}")
        if hi is not None and mx > hi:
            raise ValueError(f"{name}: value {mx} is above {hi}")
    return v


def pos_int(name: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}: expected an integer, got {v!r}")
    if v < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {v}")
    return v


def flag(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name}: expected True or False, got {v!r}")
    return v


def choice(name: str, v, options: Sequence) -> None:
    if isinstance(v, bool) or v not in options:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, options))}, got {v!r}")


def nonneg(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0 or math.isinf(v):
        raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
    return float(v)


def mapping(name: str, v) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"{name}: expected a dict of name -> tensor, got {type(v).__name__}")
    return v
