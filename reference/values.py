"""Checks of plain Python values (no tensors, no torch): integers and numbers in half-open
ranges `[lo, hi)`, a bool being no number, and choices. reference/checks.py builds its tensor
checks on these; case files are checked with them without loading torch."""
from __future__ import annotations

from typing import Sequence


def is_int(v) -> bool:
    """A Python integer that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def integer(name: str, v, lo: int, hi: int) -> int:
    """A Python int (not a bool) in [lo, hi)."""
    if not is_int(v):
        raise ValueError(f"{name}: expected an integer in [{lo}, {hi}), got {_show(v)}")
    if not lo <= v < hi:
        raise ValueError(f"{name}: {v if abs(v) < 10 ** 30 else '(a ' + str(v.bit_length()) + '-bit integer)'} "
                         f"is out of range [{lo}, {hi})")
    return v


def number(name: str, v, lo: float, hi: float) -> float:
    """A finite int or float (not a bool) in [lo, hi)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name}: expected a number in [{lo:g}, {hi:g}), got {_show(v)}")
    try:
        ok = lo <= v < hi
    except OverflowError:
        ok = False
    if v != v or not ok:
        raise ValueError(f"{name}: {_show(v)} is out of range [{lo:g}, {hi:g})")
    return float(v)


def _show(v) -> str:
    if is_int(v) and abs(v) >= 10 ** 30:
        return f"a {v.bit_length()}-bit integer"
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


SCALAR_INT_HI = 2 ** 31          # an integer argument of an op (a size, a ratio, k): int32, as the kernels take it


def scalar(name: str, value, kind=(int,), *, positive: bool = False):
    """A Python scalar of `kind` (a bool is never one); an integer within int32 (a larger one
    would overflow torch's int64 arithmetic or a kernel's int32 argument)."""
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name}: expected {' or '.join(k.__name__ for k in kind)}, got {_show(value)}")
    if positive and not value > 0:
        raise ValueError(f"{name}: expected a positive value, got {_show(value)}")
    if is_int(value) and not -SCALAR_INT_HI <= value < SCALAR_INT_HI:
        raise ValueError(f"{name}: {_show(value)} is out of range [{-SCALAR_INT_HI}, {SCALAR_INT_HI})")
    return value



def choice(name: str, value, options: Sequence):
    if isinstance(value, bool) or value not in options:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, options))}, got {value!r}")
    return value
