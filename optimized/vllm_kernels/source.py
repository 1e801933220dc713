"""Where vLLM's kernel source comes from, in this order:

1. an explicit directory (`find_source(path)` or $MXVAL_VLLM_SRC): a checkout, an
   installed package directory, or a tree that holds `vllm/`;
2. the installed vllm, when `import vllm` would find it: on an sm_100 GPU its modules are
   imported and the kernels taken as they are (kernelset.py); elsewhere its source files
   are read, as for a directory, so the e2m1 helper can be replaced;
3. the release fetched by `mxval upstream fetch` (~/.cache/mxval/upstream/vllm-<v>/).

`KernelSource.describe()` is the one line every result carries.
"""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ENV = "MXVAL_VLLM_SRC"


class SourceError(RuntimeError):
    """No usable vLLM source: one line saying what to do."""


@dataclass(frozen=True)
class KernelSource:
    kind: str          # "dir" | "installed" | "fetched"
    root: Path         # the directory that holds vllm/
    version: str

    def path_of(self, module: str) -> Optional[Path]:
        base = self.root / module.replace(".", "/")
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def read(self, module: str) -> tuple[str, str]:
        """(file path relative to root, text) of `module`; SourceError when absent."""
        p = self.path_of(module)
        if p is None:
            raise SourceError(f"{self.describe()}: no module {module} "
                              f"(run `mxval upstream fetch` or pass a vLLM tree in ${ENV})")
        return str(p.relative_to(self.root)), p.read_text(encoding="utf-8")

    def describe(self) -> str:
        what = {"dir": "vLLM tree", "installed": "installed vllm", "fetched": "fetched vllm"}[self.kind]
        return f"{what} {self.version} at {self.root}"


def _version(root: Path) -> str:
    for rel in ("vllm/_version.py", "vllm/version.py"):
        p = root / rel
        if p.is_file():
            m = re.search(r"""__version__\s*(?:=\s*version\s*)?=\s*['"]([^'"]+)['"]""", p.read_text())
            if m:
                return m[1]
    return "version unknown"


def _root_of(path: Path) -> Path:
    if (path / "vllm" / "__init__.py").is_file() or (path / "vllm").is_dir():
        return path
    if path.name == "vllm" and path.is_dir():
        return path.parent
    raise SourceError(f"{path}: holds no vllm/ package (pass the directory that contains vllm/)")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mxval" / "upstream"


def find_source(explicit: Optional[str] = None, *, version: Optional[str] = None,
                use_installed: bool = True) -> KernelSource:
    """The vLLM source to load kernels from (see the module docstring for the order)."""
    explicit = explicit or os.environ.get(ENV) or None
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_dir():
            raise SourceError(f"{ENV}={explicit}: no such directory")
        root = _root_of(p)
        return KernelSource("dir", root, _version(root))
    if use_installed:
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            root = Path(list(spec.submodule_search_locations)[0]).parent
            return KernelSource("installed", root, _version(root))
    from .. import upstream
    v = version or upstream.newest("vllm")
    root = cache_root() / f"vllm-{v}"
    if not (root / "vllm").is_dir():
        raise SourceError(f"vllm {v} is not fetched ({root} is missing): run `mxval upstream fetch` "
                          f"or set {ENV} to a vLLM tree")
    return KernelSource("fetched", root, _version(root) if _version(root) != "version unknown" else v)
