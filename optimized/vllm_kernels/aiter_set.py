"""aiter's Triton K writer and Q quant, loaded from an aiter source tree (aiter is never
imported: it needs a ROCm build).

The upstream table's `aiter.k_writer` and `aiter.q_quant` are aiter's own Python wrappers
(`k_norm_rope_mxfp4_cache`, `q_rope_mxfp4_quant`): they check their arguments, size the
outputs and launch `_k_norm_rope_mxfp4_cache_kernel` / `_q_rope_mxfp4_quant_kernel`, which
call aiter's `_mxfp4_quant_op` (SCALING_MODE=1: the bit-derived ceil scale; USE_ASM=True:
gfx950's `v_cvt_scalef32_pk_fp4_f32` where `is_hip_cdna4()`, else the bit arithmetic of
`_mxfp4_pack_bits`, which is what runs on NVIDIA GPUs and in the interpreter). The loader
takes the wrappers (host functions), the kernels and every jit helper and constant they
use, verified against the table's pins, and replaces two things that are not numerics:

* `AiterTritonLogger` (the wrappers log their shapes): mxval's silent stand-in, LOGGER_SOURCE;
* `make_kernel_repr` (the kernels' `@triton.jit(repr=...)`: the compiled kernel's name):
  mxval's REPR_SOURCE, the same name format without the value sanitizing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .. import upstream
from .kernelset import KernelSetError, LazyKernels
from .loader import KernelRef, Loader, LoadError, Replacement
from .source import ENVS, KernelSource, SourceError, find_source, trusted_from_env

K_KEY, Q_KEY = "aiter.k_writer", "aiter.q_quant"
LOGGER_KEY, REPR_KEY = "aiter.triton.logger", "aiter.triton.kernel_repr"
KEYS = (K_KEY, Q_KEY)

LOGGER_SOURCE = '''
class AiterTritonLogger:
    """mxval's stand-in for aiter's logger: the wrappers log shapes only; nothing is printed."""

    def get_logger(self):
        return None

    def debug(self, msg, *args):
        pass

    info = warning = error = critical = debug
'''

REPR_SOURCE = '''
def make_kernel_repr(base_name, config_keys, name_key=None):
    """mxval's stand-in: the compiled kernel's name, base_name + KEY_value per config key."""
    def _repr(specialization):
        constants = specialization.constants
        parts = [f"{key}_{constants.get(key)}" for key in config_keys]
        return "_".join([base_name, *parts])
    return _repr
'''


def replacements() -> dict:
    lg, rp = upstream.target(LOGGER_KEY), upstream.target(REPR_KEY)
    return {(lg.module, lg.name): Replacement(LOGGER_SOURCE, "optimized/vllm_kernels/aiter_set.py logger",
                                              ("info",), kind="class"),
            (rp.module, rp.name): Replacement(REPR_SOURCE, "optimized/vllm_kernels/aiter_set.py repr",
                                              rp.bound_params(), kind="function")}


@dataclass
class AiterSet:
    source: KernelSource
    interpreted: bool
    wrappers: LazyKernels            # table key -> aiter's wrapper function
    files: dict                      # module -> file read

    def note(self) -> str:
        how = "the Triton interpreter on the CPU" if self.interpreted else "compiled"
        return (f"aiter's K writer and Q quant (wrappers + Triton kernels) from {self.source.describe()}, "
                f"{how}; e2m1 packing by aiter's bit arithmetic (_mxfp4_pack_bits; its gfx950 "
                "instruction path needs is_hip_cdna4())")


_CACHE: dict = {}


def aiter_set(*, interpreted: bool, path: Optional[str] = None, trusted: Optional[bool] = None) -> AiterSet:
    """aiter's wrappers, resolved now (parsed, names checked, files verified), compiled on
    first use. KernelSetError (one line) when the tree is missing, not pinned or drifted."""
    trusted = trusted_from_env() if trusted is None else trusted
    key = (interpreted, path or os.environ.get(ENVS["aiter"]), trusted)
    if key in _CACHE:
        return _CACHE[key]
    try:
        src = find_source(path, package="aiter", trusted=trusted)
    except SourceError as e:
        raise KernelSetError(str(e)) from None
    refs = {k: KernelRef(upstream.target(k).module, upstream.target(k).name, host=True) for k in KEYS}
    loader = Loader(src.read, label=f"aiter {src.version}", replace=replacements())
    try:
        params = loader.resolve(refs.values())
    except (LoadError, SourceError) as e:
        raise KernelSetError(str(e)) from None
    for k, ref in refs.items():
        want, have = upstream.target(k).bound_params(), tuple(p.name for p in params[ref])
        if have[:len(want)] != want:
            raise KernelSetError(f"{src.describe()}: {ref}: parameters {', '.join(have)}; mxval binds "
                                 f"{', '.join(want)} (run `mxval upstream check --aiter DIR`)")

    def make() -> dict:
        done = loader.materialize(refs.values())
        return {k: done[r] for k, r in refs.items()}

    s = AiterSet(src, interpreted, LazyKernels(refs, make), {n: m.rel for n, m in loader.mods.items()})
    _CACHE[key] = s
    return s
