"""Every file mxval writes goes through here: whole or not at all, synced, with the mode the
user's umask asks for, never through a link or over something that is not a file.

  - Atomic: the data goes to a temporary name in the target's own directory, is fsynced,
    and is renamed over the target (the directory is fsynced too): a reader, a crash or a
    Ctrl-C never sees half a file. `mkstemp` creates its files 0600 whatever the umask;
    `chmod_umask` gives them the mode an ordinary `open(path, "w")` would have.
  - The target must be a new name or an existing regular file. A symlink, a device
    (`-o /dev/null`), a FIFO, a socket or a directory standing at the target is refused
    (`OutputError`, one line, exit 2): the rename would replace it, and writing through it
    would leave the tree the user chose. Nothing is written in that case.
  - `within`: a directory the target must stay inside once every link is resolved (a
    default output under `reports/` whose `dumps/` is a link to elsewhere is refused).
  - Names that become part of a path (a case, study, dump or backend name) go through
    `safe_name` first: reduced to letters, digits and `._-`, never `..` or a hidden name.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Callable, Optional, Union

from harness.errors import InputError

PathLike = Union[str, os.PathLike]
MAX_NAME = 120                  # characters of a name made safe (a file name is at most 255 bytes)


class OutputError(InputError):
    """An output path that cannot be written safely; one line naming it."""


def current_umask() -> int:
    """The process umask (read by setting and restoring it: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def chmod_umask(path: PathLike) -> None:
    os.chmod(path, 0o666 & ~current_umask())


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: str) -> str:
    """`name` as one safe path component: every character other than letters, digits and
    `._-` becomes `_`, a leading dot becomes `_` (no `..`, no hidden file), at most
    MAX_NAME characters (a longer name keeps its start and a short digest of the whole)."""
    text = str(name)
    out = _UNSAFE.sub("_", text) or "_"
    if out.startswith("."):
        out = "_" + out[1:]
    if len(out) > MAX_NAME:
        tag = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        out = f"{out[:MAX_NAME - 9]}-{tag}"
    return out


def check_target(path: PathLike, *, within: Optional[PathLike] = None, arg: Optional[str] = None) -> Path:
    """`path` may be written: a new name or a regular file (not a link), inside `within`
    when given. OutputError otherwise."""
    p = Path(path)
    label = f"{arg}: {p}" if arg else str(p)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{label}: cannot write there: {e.strerror or e}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        what = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
        raise OutputError(f"{label}: {what}; an output must be a new name or a regular file (never replaced "
                          "or written through)")
    if within is not None:
        root = Path(within).resolve()
        parent = p.parent.resolve()
        if parent != root and root not in parent.parents:
            raise OutputError(f"{label}: resolves to {parent / p.name}, outside {within} (a link leads out of it)")
    return p


def temp_in(directory: PathLike, name: str) -> str:
    """A fresh temporary file next to `name` in `directory` (closed, umask mode)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name[:MAX_NAME]}.", suffix=".tmp", dir=directory)
    os.close(fd)
    chmod_umask(tmp)
    return tmp


def _fsync_dir(directory: PathLike) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_via(path: PathLike, fill: Callable[[str], None], *, within: Optional[PathLike] = None,
              make_parent: bool = False) -> str:
    """Atomic write of a file another library writes: `fill(tmp)` writes the temporary file
    (safetensors' `save_file`), which is then fsynced and renamed over `path`. `make_parent`:
    its directory is made (with any missing parents) once `path` has passed `check_target`,
    so nothing is made for a target that is refused."""
    path = check_target(path, within=within)
    if make_parent:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = temp_in(path.parent, path.name)
    try:
        fill(tmp)
        chmod_umask(tmp)                 # a library may have created its own file in its place
        fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        check_target(path, within=within)       # nothing swapped in while it was written
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):          # a full disk, a quota, an I/O error: bad luck, not a bug
            raise OutputError(f"{path}: cannot write: {e.strerror or e}; nothing written") from None
        raise
    return str(path)


def write_bytes(path: PathLike, data: bytes, *, within: Optional[PathLike] = None) -> str:
    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
    return write_via(path, fill, within=within)


def write_text(path: PathLike, text: str, *, within: Optional[PathLike] = None) -> str:
    return write_bytes(path, text.encode("utf-8"), within=within)


def write_new_temp(prefix: str, suffix: str, text: str) -> str:
    """A new file in the system's temporary directory holding `text` (synced, umask mode);
    its path. For output with no place of its own (the traceback of a crash outside a run)."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    chmod_umask(name)
    return name


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


# --- report directories: held open, their files replaced as a set -------------------------------

_HELD: dict[str, int] = {}          # a claimed directory's absolute path -> its open descriptor
STAGING_PREFIX = ".mxval-staging-"


def _key(directory: PathLike) -> str:
    return os.path.abspath(os.fspath(directory))


def hold_dir(directory: PathLike) -> None:
    """Open `directory` and keep it open: every later `write_set` into it writes into this very
    directory, even if its path is swapped for a link (or another directory) meanwhile."""
    key = _key(directory)
    if key not in _HELD:
        _HELD[key] = os.open(key, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def release_dirs() -> None:
    while _HELD:
        _, fd = _HELD.popitem()
        try:
            os.close(fd)
        except OSError:
            pass


def moved(directory: PathLike) -> bool:
    """Whether the path of a held directory no longer leads to the directory it held."""
    fd = _HELD.get(_key(directory))
    if fd is None:
        return False
    try:
        a, b = os.stat(_key(directory)), os.fstat(fd)
    except OSError:
        return True
    return (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)


def _refuse_non_file(dir_fd: int, name: str, label: str) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        what = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "not a regular file")
        raise OutputError(f"{label}: {what}; an output must be a new name or a regular file (never replaced "
                          "or written through)")


def _write_fd(fd: int, blob: bytes) -> None:
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def write_set(directory: PathLike, files: dict, *, remove: tuple = ()) -> dict[str, str]:
    """Replace files of `directory` as a set: `files` ({name: bytes or str}) are all written
    and synced in a staging directory beside them first; only when every one is whole are they
    renamed over the old ones, in the order given (put the file that vouches for the others
    last). A failure while writing (a full disk) leaves the old set untouched and the staging
    removed: OSError for the caller to report. `remove`: names of the old set that this set
    does not replace, removed after the swap so that no stale file outlives it. A directory
    held by `hold_dir` is written through its descriptor. {name: path}."""
    key = _key(directory)
    own = key not in _HELD
    fd = os.open(key, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)) if own else _HELD[key]
    staging = f"{STAGING_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    try:
        for name in files:
            _refuse_non_file(fd, name, os.path.join(key, name))
        os.mkdir(staging, 0o700, dir_fd=fd)
        sfd = os.open(staging, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0), dir_fd=fd)
        try:
            for name, data in files.items():
                blob = data.encode("utf-8") if isinstance(data, str) else bytes(data)
                f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666,
                            dir_fd=sfd)
                try:
                    _write_fd(f, blob)
                finally:
                    os.close(f)
            for name in files:                       # the swap: every file is whole by now
                _refuse_non_file(fd, name, os.path.join(key, name))
                os.rename(name, name, src_dir_fd=sfd, dst_dir_fd=fd)
            for name in remove:
                if name not in files:
                    try:
                        _refuse_non_file(fd, name, os.path.join(key, name))
                        os.unlink(name, dir_fd=fd)
                    except FileNotFoundError:
                        pass
            try:
                os.fsync(fd)
            except OSError:
                pass
        finally:
            for left in os.listdir(sfd):
                try:
                    os.unlink(left, dir_fd=sfd)
                except OSError:
                    pass
            os.close(sfd)
            os.rmdir(staging, dir_fd=fd)
    finally:
        if own:
            os.close(fd)
    return {name: os.path.join(os.fspath(directory), name) for name in files}
