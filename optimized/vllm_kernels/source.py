"""Where an upstream package's kernel source comes from (vLLM or aiter), in this order:

1. an explicit directory (`find_source(path)`, `--aiter DIR`, or $MXVAL_VLLM_SRC /
   $MXVAL_AITER_SRC): a checkout, an installed package directory, or a tree that holds
   `vllm/` (`aiter/`);
2. vLLM only: the installed vllm, when `import vllm` would find it: on an sm_100 GPU its
   modules are imported and the kernels taken as they are (kernelset.py); elsewhere its
   source files are read, as for a directory, so the e2m1 helper can be replaced;
3. the tree fetched by `mxval upstream fetch` (~/.cache/mxval/upstream/vllm-<v>/,
   aiter-<ref>/).

Upstream trees are data until verified: every file read is checked against the sha256 the
upstream table pins for it (`optimized.upstream.PINS`, one set per known release); a file
whose hash is not pinned is refused, unless the tree is trusted (`trusted=True`: the user
named the tree and said it is trusted, `--trust-upstream` / $MXVAL_TRUST_UPSTREAM). Files are
read with a size bound (reader.MAX_SOURCE_CHARS).

`KernelSource.describe()` is the one line every result carries.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .. import upstream
from .reader import MAX_SOURCE_CHARS

ENV = "MXVAL_VLLM_SRC"
ENVS = {"vllm": ENV, "aiter": "MXVAL_AITER_SRC"}
TRUST_ENV = "MXVAL_TRUST_UPSTREAM"      # "1": the named trees are trusted (hashes not enforced)


class SourceError(RuntimeError):
    """No usable source: one line saying what to do."""


def read_bounded(path: Path, limit: int = MAX_SOURCE_CHARS) -> bytes:
    """A regular file's bytes, refused past `limit` (never reads more than limit + 1)."""
    if not path.is_file():
        raise SourceError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise SourceError(f"{path}: larger than {limit} bytes; not an upstream source file")
    return data


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class KernelSource:
    kind: str          # "dir" | "installed" | "fetched"
    root: Path         # the directory that holds <package>/
    version: str
    package: str = "vllm"
    trusted: bool = False

    def path_of(self, module: str) -> Optional[Path]:
        base = self.root / module.replace(".", "/")
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def read(self, module: str) -> tuple[str, str]:
        """(file path relative to root, text) of `module`, verified against the table's
        pins; SourceError when absent, too large, or not pinned (and not trusted)."""
        p = self.path_of(module)
        if p is None:
            raise SourceError(f"{self.describe()}: no module {module} "
                              f"(run `mxval upstream fetch` or pass a {self.package} tree in "
                              f"${ENVS[self.package]})")
        rel = p.relative_to(self.root).as_posix()
        data = read_bounded(p)
        if not self.trusted:
            verify(self.package, rel, data, where=str(p))
        try:
            return rel, data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SourceError(f"{p}: not UTF-8 text ({e.reason})") from None

    def describe(self) -> str:
        what = {"dir": f"{self.package} tree", "installed": f"installed {self.package}",
                "fetched": f"fetched {self.package}"}[self.kind]
        return f"{what} {self.version} at {self.root}" + (" (trusted, hashes not enforced)" if self.trusted else "")


def verify(package: str, rel: str, data: bytes, *, where: str) -> str:
    """The release whose pinned sha256 `data` has at `rel`; SourceError when none does."""
    digest = sha256(data)
    hits = upstream.pinned_releases(package, rel, digest)
    if hits:
        return hits[0]
    known = upstream.pinned_releases(package, rel)
    why = (f"its sha256 {digest[:16]}... is not the one pinned for {', '.join(known)}" if known
           else f"no known {package} release pins {rel}")
    raise SourceError(f"{where}: refused: {why} (optimized/upstream.py PINS); if you trust this tree, "
                      f"name it and pass --trust-upstream (or set {TRUST_ENV}=1)")


def _version(root: Path, package: str = "vllm") -> str:
    for rel in (f"{package}/_version.py", f"{package}/version.py"):
        p = root / rel
        if p.is_file():
            try:
                v = upstream.version_in(read_bounded(p, 64 << 10).decode("utf-8", "replace"))
            except SourceError:
                v = None
            if v:
                return v
    return "version unknown"


def _root_of(path: Path, package: str = "vllm") -> Path:
    if (path / package / "__init__.py").is_file() or (path / package).is_dir():
        return path
    if path.name == package and path.is_dir():
        return path.parent
    raise SourceError(f"{path}: holds no {package}/ package (pass the directory that contains {package}/)")


def trusted_from_env() -> bool:
    return os.environ.get(TRUST_ENV, "") not in ("", "0")


def find_source(explicit: Optional[str] = None, *, version: Optional[str] = None,
                use_installed: bool = True, package: str = "vllm",
                trusted: Optional[bool] = None) -> KernelSource:
    """The source to load kernels from (see the module docstring for the order). `trusted`
    applies to an explicitly named tree only (default: $MXVAL_TRUST_UPSTREAM)."""
    env = ENVS[package]
    explicit = explicit or os.environ.get(env) or None
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_dir():
            raise SourceError(f"{env}={explicit}: no such directory")
        root = _root_of(p, package)
        return KernelSource("dir", root, _version(root, package), package,
                            trusted_from_env() if trusted is None else trusted)
    if use_installed and package == "vllm":
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            root = Path(list(spec.submodule_search_locations)[0]).parent
            return KernelSource("installed", root, _version(root), package)
    if package == "aiter":
        ref = version or upstream.AITER_REF
        root = upstream.cache_root() / f"aiter-{ref}"
        if version is None and not (root / "aiter").is_dir():
            # the tree `fetch --aiter` brought last (another ref, or an archive)
            cands = sorted(upstream.cache_root().glob("aiter-*/.mxval-manifest.json"), key=lambda m: m.stat().st_mtime)
            if cands:
                root, ref = cands[-1].parent, cands[-1].parent.name[len("aiter-"):]
        if not (root / "aiter").is_dir():
            raise SourceError(f"aiter {ref} is not fetched ({root} is missing): run `mxval upstream fetch "
                              f"--aiter` or pass --aiter DIR / set {env} to an aiter tree")
        return KernelSource("fetched", root, ref, package)
    v = version or upstream.newest("vllm")
    root = upstream.cache_root() / f"vllm-{v}"
    if not (root / "vllm").is_dir():
        raise SourceError(f"vllm {v} is not fetched ({root} is missing): run `mxval upstream fetch` "
                          f"or set {env} to a vLLM tree")
    return KernelSource("fetched", root, _version(root) if _version(root) != "version unknown" else v)
