"""vLLM's own DeepSeek-V4 indexer Triton kernels, run outside vLLM.

* source.py     where the kernel source comes from (installed vllm, the fetched release,
                or a directory), recorded so every result can say it
* loader.py     ast: the @triton.jit functions the upstream table names, the jit helpers
                and module constants they reference; every name checked; compiled in a
                namespace of their own with `triton` and `tl` bound (vllm is never imported)
* e2m1.py       the exact emulation of vLLM's sm_100-only `_fp32x2_to_fp4x2` (PTX
                cvt.rn.satfinite.e2m1x2.f32), used on other GPUs and in the interpreter
* interp_patch  what the Triton interpreter needs to run the kernels unmodified
* launch.py     grids and constexprs, written by mxval from vLLM's launchers, checked
                against each kernel's parameter list (drift is an error)
* kernelset.py  one loaded set per process and mode
"""
