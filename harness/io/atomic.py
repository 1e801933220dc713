"""Files written whole or not at all, with the mode the user's umask asks for.

Every report file (and every dump) goes to a temporary name in its own directory and is
renamed over the target: a reader, a crash or a Ctrl-C never sees half a file. `mkstemp`
creates its files 0600 whatever the umask; `chmod_umask` gives them the mode an ordinary
`open(path, "w")` would have (0666 & ~umask).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

PathLike = Union[str, os.PathLike]


def current_umask() -> int:
    """The process umask (read by setting and restoring it: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def chmod_umask(path: PathLike) -> None:
    os.chmod(path, 0o666 & ~current_umask())


def temp_in(directory: PathLike, name: str) -> str:
    """A fresh temporary file next to `name` in `directory` (closed, umask mode)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    chmod_umask(tmp)
    return tmp


def write_bytes(path: PathLike, data: bytes) -> str:
    path = Path(path)
    tmp = temp_in(path.parent, path.name)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return str(path)


def write_text(path: PathLike, text: str) -> str:
    return write_bytes(path, text.encode("utf-8"))


def check_writable_dir(directory: PathLike) -> None:
    """Create `directory` (and parents) and prove a file can be created and renamed in it;
    OSError when not (the caller turns it into one line)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    probe = temp_in(d, "mxval-write-probe")
    try:
        os.replace(probe, probe + ".renamed")
        probe += ".renamed"
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
