"""Upstream Triton kernels run outside their packages: vLLM's DeepSeek-V4 indexer kernels and
aiter's K writer and Q quant (vllm and aiter are never imported).

* source.py     where the source comes from (installed vllm, a fetched tree, or a named
                directory), every file verified against the sha256 the upstream table pins
* reader.py     upstream source read as data with `ast`, bounded (shared with `mxval
                upstream check`)
* loader.py     the @triton.jit functions (and, for aiter, the Python launchers) the upstream
                table names, the jit helpers and module constants they reference; every name
                checked; compiled in a namespace of their own with `triton` and `tl` bound
* e2m1.py       the exact emulation of vLLM's sm_100-only `_fp32x2_to_fp4x2` (PTX
                cvt.rn.satfinite.e2m1x2.f32), used on other GPUs and in the interpreter
* interp_patch  what the Triton interpreter needs to run the kernels unmodified
* launch.py     grids and constexprs, written by mxval from vLLM's launchers, checked
                against each kernel's parameter list (drift is an error)
* kernelset.py  one resolved set of vLLM's kernels per process and mode, compiled on first use
* aiter_set.py  the same for aiter's wrappers and kernels
"""
