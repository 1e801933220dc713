"""The console every command writes to: standard output, guarded so that what a run does
never depends on it.

  - A stdout that cannot encode UTF-8 (`PYTHONIOENCODING=ascii`, a C locale without Python's
    UTF-8 mode) gets ASCII: the table borders are rich's ASCII boxes (rich reads the
    encoding), the symbols mxval prints (≠, …, ±, →) their ASCII spelling, and any other
    character a `\\uXXXX` escape. The report files are UTF-8 whatever the terminal.
  - A stdout that goes away (a pipe closed by `| head -1`, `/dev/full`, a log on a full
    disk) is dropped, not raised: the run finishes and writes its reports; `lost()` says why
    the console stopped, for one line on stderr at the end. Its descriptor then points at
    /dev/null, so that the interpreter's last flush cannot fail either.

`guard()` installs it on sys.stdout (harness/commands/cli.py, for every command).
"""
from __future__ import annotations

import codecs
import errno
import os
import sys
from typing import Optional

ASCII = {"≠": "!=", "…": "...", "±": "+-", "→": "->", "←": "<-", "≤": "<=", "≥": ">=", "×": "x", "−": "-",
         "µ": "u", "•": "*", "—": "--", "–": "-", "‘": "'", "’": "'", "“": '"', "”": '"', "█": "#", "▏": "|",
         "━": "-", "─": "-", "│": "|", "✓": "ok", "✗": "x", "·": "."}
_GONE = {errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EBADF, errno.ECONNRESET}


def utf8(stream) -> bool:
    enc = getattr(stream, "encoding", None) or "utf-8"
    try:
        return codecs.lookup(enc).name.startswith("utf")
    except LookupError:
        return False


def degrade(text: str, encoding: str) -> str:
    """`text` as `encoding` can hold it: mxval's symbols spelt in ASCII, the rest escaped."""
    text = "".join(ASCII.get(ch, ch) for ch in text)
    return text.encode(encoding, "backslashreplace").decode(encoding, "replace")


class Guarded:
    """A text stream that degrades to its encoding and survives its reader going away."""

    def __init__(self, stream):
        self._stream = stream
        self._ascii = not utf8(stream)
        self._enc = getattr(stream, "encoding", None) or "ascii"
        self.gone: Optional[OSError] = None

    def _lose(self, e: OSError) -> None:
        self.gone = e
        try:
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, text: str) -> int:
        if self.gone is not None:
            return len(text)
        out = degrade(text, self._enc) if self._ascii else text
        try:
            self._stream.write(out)
        except UnicodeEncodeError:
            self._ascii = True
            return self.write(text)
        except OSError as e:
            if e.errno not in _GONE:
                raise
            self._lose(e)
        return len(text)

    def flush(self) -> None:
        if self.gone is not None:
            return
        try:
            self._stream.flush()
        except OSError as e:
            if e.errno not in _GONE:
                raise
            self._lose(e)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def isatty(self) -> bool:
        try:
            return self.gone is None and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard() -> Guarded:
    """sys.stdout guarded (the one already installed, when it is)."""
    if not isinstance(sys.stdout, Guarded):
        sys.stdout = Guarded(sys.stdout)
    return sys.stdout


def unguard(g: Guarded) -> None:
    if sys.stdout is g:
        try:
            g.flush()
        finally:
            sys.stdout = g._stream


def lost(g: Guarded) -> Optional[str]:
    """Why the console stopped (None: it did not)."""
    return None if g.gone is None else (g.gone.strerror or str(g.gone))


def rich_console(**kw):
    """A rich Console for stdout; when stdout cannot encode UTF-8, one that spells every text
    in ASCII before rich measures it (so the columns stay aligned) and draws ASCII boxes."""
    from rich.console import Console

    if utf8(sys.stdout):
        return Console(**kw)

    class AsciiConsole(Console):
        def render_str(self, text, **opts):
            return super().render_str(degrade(text, "ascii"), **opts)

    return AsciiConsole(**kw)
