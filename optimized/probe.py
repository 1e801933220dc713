"""What `mxval backends` says without building a backend: each declared backend's needs
(`optimized.DECLARED`) checked without importing torch, triton, aiter or vllm. The torch build
is read from torch's own version file (a CPU build has no GPU to offer); packages are looked up
with `importlib.util.find_spec`; upstream trees are located, not loaded. What only an import
can tell (a GPU visible to a CUDA or ROCm build, a package that imports, a tree whose files
match the pins) is said to be unchecked; `mxval backends --check` builds every backend.

The reasons a compiled backend gives for a missing GPU or ROCm build are written here once
(`no_gpu`, `not_rocm_build`) and used by the backends too.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import AUTO_ORDER, DECLARED

AVAILABLE, UNAVAILABLE, UNCHECKED = "available", "unavailable", "not checked"
CHECK = "`mxval backends --check` builds every backend and says"


def no_gpu(name: str, detail: str = "") -> str:
    """Why a compiled-Triton backend cannot run: no GPU; its `-interpret` twin can."""
    return (f"no CUDA or ROCm GPU visible to torch{detail}: use {name}-interpret (the same kernels through "
            "the Triton interpreter on the CPU)")


def not_rocm_build(version: str) -> str:
    return f"no ROCm GPU: torch {version} is not a ROCm build"


def rocm_gfx950_reason() -> str | None:
    """None on a ROCm GPU of the gfx950 family (MI350/MI355), else what is missing (imports torch)."""
    import torch
    if getattr(torch.version, "hip", None) is None:
        return not_rocm_build(torch.__version__)
    if not torch.cuda.is_available():
        return "no ROCm GPU visible to torch"
    arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "unknown")
    if not arch.startswith("gfx950"):
        return f"the GPU is {arch}, not gfx950 (aiter's MXFP4 kernels are gfx950-only)"
    return None


@dataclass(frozen=True)
class TorchBuild:
    version: str
    cuda: Optional[str]
    hip: Optional[str]
    gpu: Optional[bool]          # a GPU visible to torch: None when only importing torch can tell


def _loaded_torch():
    """torch when this process has imported it already (then it answers itself), else None."""
    return sys.modules.get("torch")


def torch_build() -> Optional[TorchBuild]:
    """The installed torch's build, without importing it (None: torch is not installed). When
    torch is already imported in this process, it answers itself."""
    torch = _loaded_torch()
    if torch is not None:
        return TorchBuild(torch.__version__, torch.version.cuda, getattr(torch.version, "hip", None),
                          bool(torch.cuda.is_available()))
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    values: dict = {}
    try:
        tree = ast.parse((Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        tree = ast.Module(body=[], type_ignores=[])
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            values[target.id] = node.value.value
    cuda, hip = values.get("cuda"), values.get("hip")
    return TorchBuild(str(values.get("__version__", "(version unknown)")), cuda, hip,
                      None if (cuda or hip) else False)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Probe:
    status: str                  # AVAILABLE, UNAVAILABLE or UNCHECKED
    device: str
    text: str                    # what it is, or why not, or what is not checked


def _need(name: str, need: str, build: Optional[TorchBuild]) -> tuple[Optional[str], Optional[str]]:
    """(why it cannot run, what is not known) for one need; (None, None) when met."""
    if need == "triton":
        return (None, None) if _installed("triton") else ("triton is not installed (no module named 'triton')", None)
    if need.startswith("module:"):
        mod = need.split(":", 1)[1]
        if not _installed(mod):
            return f"{mod} is not installed (no module named {mod!r})", None
        return None, f"{mod} is installed, not imported"
    if need.startswith("tree:"):
        from .vllm_kernels.source import SourceError, find_source
        try:
            src = find_source(package=need.split(":", 1)[1])
        except SourceError as e:
            return str(e), None
        return None, f"source: {src.describe()}, its files checked against the pins when it loads"
    if build is None:
        return "torch is not installed", None
    if need == "gpu":
        if build.gpu is False:
            return no_gpu(name, "" if _loaded_torch() else f" (torch {build.version} is a CPU build)"), None
        if build.gpu is None:
            kind = "ROCm" if build.hip else "CUDA"
            return None, (f"a GPU visible to torch {build.version} (a {kind} build) is known once torch loads; "
                          f"without one, use {name}-interpret")
        return None, None
    if need == "rocm-gfx950":
        if not build.hip:
            return not_rocm_build(build.version), None
        if _loaded_torch():
            return rocm_gfx950_reason(), None
        return None, f"a gfx950 GPU visible to torch {build.version} (a ROCm build) is known once torch loads"
    raise ValueError(f"backend {name}: unknown need {need!r}")


def probe(name: str) -> Probe:
    """A declared backend's availability here, as far as it is known without building it."""
    d = DECLARED[name]
    build = torch_build()
    problems, unknown = [], []
    for need in d.needs:
        why, open_ = _need(name, need, build)
        problems += [why] if why else []
        unknown += [open_] if open_ else []
    if d.interpreted:
        device = "cpu"
    elif d.needs:
        device = "cuda"
    else:                                        # the reference: where a GPU is, it runs there
        device = {False: "cpu", True: "cuda", None: "cuda if visible, else cpu"}[build.gpu if build else False]
    if problems:
        return Probe(UNAVAILABLE, device, "; ".join(dict.fromkeys(problems)))
    if unknown:
        return Probe(UNCHECKED, device, f"{d.summary}; not checked: {'; '.join(unknown)} ({CHECK})")
    return Probe(AVAILABLE, device, d.summary)


def auto() -> tuple[str, str]:
    """(status, the backend `auto` picks here or what decides it)."""
    open_ = []
    for name in AUTO_ORDER:
        p = probe(name)
        if p.status == AVAILABLE and not open_:
            return AVAILABLE, name
        if p.status != UNAVAILABLE:
            open_.append(name)
    if not open_:
        return UNAVAILABLE, "no backend runs here"
    return UNCHECKED, f"the first of {', '.join(open_)} that loads here ({CHECK})"
