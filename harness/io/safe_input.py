"""Input files read with bounds: every file mxval reads (case and budgets TOML, study TOML,
report.json, dumps) goes through here.

  - It must be a regular file: a FIFO, a device (`/dev/zero`), a socket or a directory is
    refused with one line before anything blocks on it (opened non-blocking, checked with
    fstat on the descriptor that is then read).
  - It is read up to a stated size (`MAX_TOML_BYTES`, `MAX_JSON_BYTES`); a larger file is
    refused, never read whole.
  - JSON and TOML nesting depth (`MAX_DEPTH`) and the digits of an integer literal
    (`MAX_INT_DIGITS`) are bounded before parsing (a 100k-deep array would exhaust the
    parser's recursion; a 5000-digit integer its int conversion).

Every refusal is an `InputError` subclass chosen by the caller (`error=`), one line naming
the file and the problem: exit 2.
"""
from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from typing import Optional, Type

from harness.errors import InputError

MAX_TOML_BYTES = 16 * 2 ** 20          # a suite, budgets or study file
MAX_JSON_BYTES = 512 * 2 ** 20         # a report.json
MAX_DEPTH = 64                         # nested arrays/tables/objects
MAX_INT_DIGITS = 40                    # an integer literal (2**128 has 39 digits)

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path, *, error: Type[InputError] = InputError):
    """A binary file object of `path`, which must be a regular file (never blocks on a FIFO)."""
    p = os.fspath(path)
    try:
        # stat first: a FIFO refused this way is never opened, so no writer ever sees a reader;
        # the open below is non-blocking and its fstat checks again (the path may change between)
        mode = os.stat(p).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{p}: cannot read: {_kind(mode)}, not a regular file")
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{p}: cannot read: {_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path, limit: int, *, error: Type[InputError] = InputError) -> bytes:
    """The whole of a regular file of at most `limit` bytes."""
    with open_regular(path, error=error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(f"{os.fspath(path)}: {size} bytes, more than the {limit} this file may have")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise error(f"{os.fspath(path)}: cannot read: {e.strerror or e}") from None
    if len(data) > limit:
        raise error(f"{os.fspath(path)}: more than the {limit} bytes this file may have")
    return data


def read_text(path, limit: int, *, error: Type[InputError] = InputError) -> str:
    try:
        return read_bytes(path, limit, error=error).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{os.fspath(path)}: not UTF-8 text (byte {e.start})") from None


# --- structure bounds, before parsing ---------------------------------------------------------

_TOML_STRING = re.compile(r'"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'|#[^\n]*',
                          re.DOTALL)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")
_LONG_DIGITS = re.compile(r"[0-9][0-9_]{%d,}" % MAX_INT_DIGITS)


def _structure(text: str, strings: re.Pattern) -> tuple[int, bool]:
    """(deepest nesting of [ and {, whether a digit run longer than MAX_INT_DIGITS occurs),
    outside strings and comments."""
    depth = deepest = 0
    long_number = False
    pos = 0
    for m in [*strings.finditer(text), None]:
        seg = text[pos:m.start()] if m else text[pos:]
        if not long_number and _LONG_DIGITS.search(seg):
            long_number = True
        for b in _BRACKETS.finditer(seg):
            if b.group() in "[{":
                depth += 1
                if depth > deepest:
                    deepest = depth
            else:
                depth -= 1
        if m:
            pos = m.end()
    return deepest, long_number


def check_structure(text: str, where: str, *, toml: bool, error: Type[InputError] = InputError,
                    max_depth: int = MAX_DEPTH) -> None:
    depth, long_number = _structure(text, _TOML_STRING if toml else _JSON_STRING)
    if depth > max_depth:
        raise error(f"{where}: nested {depth} deep, more than the {max_depth} levels allowed")
    if long_number:
        raise error(f"{where}: a number of more than {MAX_INT_DIGITS} digits")


def _bounded_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"a number of more than {MAX_INT_DIGITS} digits")
    return int(s)


class _Twice(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    """An object whose every key is given once: a key given twice is ambiguous (which value
    did the writer mean?), never silently the last one."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _Twice(f"key {k[:60]!r} given twice in one object")
        out[k] = v
    return out


def loads_json(text: str, where: str, *, error: Type[InputError] = InputError, max_depth: int = MAX_DEPTH,
               unusable: Optional[str] = None):
    """JSON text parsed with its depth and integer sizes bounded first (`where` names it).
    `unusable`: the whole line for text that does not parse (otherwise `where` and why)."""
    check_structure(text, where, toml=False, error=error, max_depth=max_depth)
    try:
        return json.loads(text, parse_int=_bounded_int, object_pairs_hook=_unique_keys)
    except _Twice as e:
        raise error(f"{where}: {e}") from None
    except (ValueError, RecursionError) as e:
        if unusable is not None:
            raise error(unusable) from None
        if isinstance(e, json.JSONDecodeError):
            raise error(f"{where}: not valid JSON ({e})") from None
        raise error(f"{where}: not usable JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def loads_toml(text: str, where: str, *, error: Type[InputError] = InputError, max_depth: int = MAX_DEPTH) -> dict:
    check_structure(text, where, toml=True, error=error, max_depth=max_depth)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{where}: malformed TOML: {e}") from None
    except (ValueError, RecursionError) as e:
        raise error(f"{where}: malformed TOML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def load_json(path, *, error: Type[InputError] = InputError, limit: int = MAX_JSON_BYTES):
    return loads_json(read_text(path, limit, error=error), os.fspath(path), error=error)


def load_toml(path, *, error: Type[InputError] = InputError, limit: int = MAX_TOML_BYTES) -> dict:
    return loads_toml(read_text(path, limit, error=error), os.fspath(path), error=error)
