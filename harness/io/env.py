"""Every environment variable mxval reads goes through here: a bounded value, and an error
that names the variable (`EnvError`, a usage error: one line, exit 2).

A variable is input like any other: its text is at most `MAX_CHARS` characters, a number in
it at most `MAX_DIGITS` digits (never Python's own "Exceeds the limit (4300 digits)"), and
the value shown in a message is cut short and stripped of control characters.

  - `flag(NAME)`: a switch, "1" on, "0" or unset off (anything else is an error).
  - `integer(NAME, default, lo, hi)`: a whole number in [lo, hi).
  - `number(NAME, lo, hi)`: a finite number in (lo, hi] (a fraction), None when unset.
  - `text(NAME, default)`: the stripped text, bounded.
  - `directory(NAME, path)`: `path` (NAME's value) made as a directory, or an error naming NAME.
"""
from __future__ import annotations

import math
import os
import re
from typing import Optional

from harness.errors import UsageError

MAX_CHARS = 4096             # characters of one variable's value
MAX_DIGITS = 40              # digits of a number in one


class EnvError(UsageError):
    """An environment variable mxval cannot use; the message names it."""


def show(value: str) -> str:
    """`value` as a message shows it: printable, at most 40 characters."""
    s = re.sub(r"[\x00-\x1f\x7f-\x9f]", "?", value)
    return repr(s if len(s) <= 40 else s[:37] + "...") + (f" ({len(value)} characters)" if len(value) > 40 else "")


def text(name: str, default: str = "") -> str:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if len(raw) > MAX_CHARS:
        raise EnvError(f"{name}: {len(raw)} characters, at most {MAX_CHARS}")
    return raw.strip()


def directory(name: str, path: str) -> str:
    """`path`, the value of `name`, made as a directory (with its parents) if it is not one;
    EnvError naming `name` when it cannot be."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise EnvError(f"{name}={show(path)}: cannot make the directory ({e.strerror or e})") from None
    return path


def flag(name: str) -> bool:
    """A switch: "1" on; "0", empty or unset off; EnvError otherwise."""
    raw = text(name)
    if raw not in ("", "0", "1"):
        raise EnvError(f"{name}={show(raw)}: expected 1 or 0")
    return raw == "1"


def digits(name: str, s: str, what: str = "a whole number") -> int:
    """`s` (decimal digits, perhaps signed) as an int; EnvError naming `name` when it is not
    one or has more than MAX_DIGITS digits."""
    if not re.fullmatch(r"[+-]?\d+", s.strip()):
        raise EnvError(f"{name}={show(s)}: expected {what}")
    if len(s.strip().lstrip("+-")) > MAX_DIGITS:
        raise EnvError(f"{name}={show(s)}: a number of more than {MAX_DIGITS} digits")
    return int(s)


def integer(name: str, default: Optional[int], lo: int, hi: int) -> Optional[int]:
    """A whole number in [lo, hi), `default` when unset or empty."""
    raw = text(name)
    if not raw:
        return default
    n = digits(name, raw, f"a whole number in [{lo}, {hi})")
    if not lo <= n < hi:
        raise EnvError(f"{name}={show(raw)}: expected a whole number in [{lo}, {hi})")
    return n


def number(name: str, lo: float, hi: float) -> Optional[float]:
    """A finite number in (lo, hi], None when unset or empty."""
    raw = text(name)
    if not raw:
        return None
    if len(raw) > MAX_DIGITS + 10:
        raise EnvError(f"{name}={show(raw)}: a number of more than {MAX_DIGITS} digits")
    try:
        f = float(raw)
    except ValueError:
        f = math.nan
    if not lo < f <= hi:
        raise EnvError(f"{name}={show(raw)}: expected a number in ({lo:g}, {hi:g}]")
    return f
