"""One loaded set of vLLM's kernels per process and mode (compiled / interpreted).

`kernel_set(path=None)` finds the source (source.py), loads the kernels of the upstream
table's CUDA-path and ROCm pooling entries (loader.py), checks their parameters against
the table (launch.check_kernel), and says how they run: `e2m1` is "unmodified" on an
sm_100-class GPU, else "emulated" (e2m1.py replaces vLLM's PTX helper). Errors are one
line (KernelSetError); the backends turn them into an unavailable reason.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

from .. import upstream
from . import e2m1, launch
from .loader import KernelRef, Loader, LoadError, Replacement
from .source import KernelSource, SourceError, find_source, trusted_from_env

K_KEYS = launch.K_KEYS
Q_KEYS = launch.Q_KEYS
POOL_KEY = launch.POOL_KEY
HELPER_MODULE = upstream.target("vllm.cuda.q_mxfp4").module     # where _fp32x2_to_fp4x2 lives


class KernelSetError(RuntimeError):
    pass


@dataclass
class KernelSet:
    source: KernelSource
    interpreted: bool
    e2m1: str                        # "unmodified" | "emulated"
    kernels: dict                    # table key -> JITFunction
    files: dict                      # module -> file read

    def note(self) -> str:
        """What every result from these kernels says about where they came from."""
        how = ("the Triton interpreter on the CPU" if self.interpreted else "compiled")
        e = ("e2m1 conversion unmodified (sm_100 PTX)" if self.e2m1 == "unmodified" else
             "e2m1 conversion _fp32x2_to_fp4x2 replaced by mxval's exact emulation (its PTX is sm_100-only)")
        return f"vLLM kernels from {self.source.describe()}, {how}; {e}"


class LazyKernels(Mapping):
    """{table key: kernel}, compiled on first use: building a backend (and `mxval backends`)
    only parses and resolves the upstream source; the selected definitions run when an op
    first launches."""

    def __init__(self, keys, make: Callable[[], dict]):
        self._keys, self._make, self._done = tuple(keys), make, None

    def _all(self) -> dict:
        if self._done is None:
            try:
                self._done = self._make()
            except LoadError as e:
                raise KernelSetError(str(e)) from None
        return self._done

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        return self._all()[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def compiled(self) -> bool:
        return self._done is not None


_CACHE: dict = {}


def _capability() -> Optional[tuple[int, int]]:
    import torch
    if getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))


def kernel_set(*, interpreted: bool, path: Optional[str] = None,
               keys: tuple[str, ...] = (*K_KEYS.values(), *Q_KEYS.values(), POOL_KEY)) -> KernelSet:
    src_key = (interpreted, path or os.environ.get("MXVAL_VLLM_SRC"), keys, trusted_from_env())
    if src_key in _CACHE:
        return _CACHE[src_key]
    try:
        src = find_source(path)
    except SourceError as e:
        raise KernelSetError(str(e)) from None
    native = not interpreted and e2m1.runs_unmodified(_capability())
    replace = {} if native else {
        (HELPER_MODULE, e2m1.HELPER): Replacement(e2m1.EMULATION_SOURCE, "optimized/vllm_kernels/e2m1.py",
                                                  e2m1.HELPER_PARAMS, e2m1.PTX_MARK)}

    def read(module: str):
        return src.read(module)

    refs = {k: KernelRef(upstream.target(k).module, upstream.target(k).name) for k in keys}
    loader = Loader(read, label=f"vllm {src.version}", replace=replace)
    try:
        params = loader.resolve(refs.values())
        for k, ref in refs.items():
            launch.check_kernel(k, params[ref])
    except (LoadError, launch.LaunchDrift, SourceError) as e:
        raise KernelSetError(str(e)) from None
    files = {name: mod.rel for name, mod in loader.mods.items()}

    def make() -> dict:
        # the installed vllm on an sm_100 GPU: its own (imported) kernel objects, unmodified;
        # the source was resolved above all the same, for the parameter checks
        imported = _import_installed(refs) if native and src.kind == "installed" else None
        if imported:
            return imported
        done = loader.materialize(refs.values())
        return {k: done[r] for k, r in refs.items()}

    ks = KernelSet(src, interpreted, "unmodified" if native else "emulated", LazyKernels(refs, make), files)
    _CACHE[src_key] = ks
    return ks


def _import_installed(refs: dict) -> Optional[dict]:
    """The kernels as the installed vllm defines them (imported; sm_100 only, where nothing
    is replaced); None when importing fails (then the source files are loaded instead)."""
    import importlib
    out = {}
    try:
        for key, ref in refs.items():
            obj = importlib.import_module(ref.module)
            for part in ref.name.split("."):
                obj = getattr(obj, part)
            out[key] = obj
    except Exception:
        return None
    return out
