"""Capture hook: record the indexer's op calls in a running vLLM as mxval dumps, eager or
under CUDA/HIP graphs (vLLM's default `cudagraph_mode`, FULL_AND_PIECEWISE included).

Each wrapped op, on a chosen layer and step, records its inputs before the call (in-place
outputs such as the K pool are recorded BEFORE and AFTER), calls the real op with the very
same arguments, and returns its result untouched; the records become one dump per (layer,
step) (harness.io.dumps format), which `mxval diff FILE` replays anywhere. Capture problems
are logged once and never reach the op: capturing cannot change what the op computes.

Enable it (the environment is read at install() time):

    export MXVAL_CAPTURE_DIR=/data/mxval-dumps     # required; nothing is wrapped without it
    export MXVAL_CAPTURE_LAYERS=12,20              # or "all" (default)
    export MXVAL_CAPTURE_STEPS=0-3,300             # or "all" (default); ranges inclusive
    export MXVAL_CAPTURE_AUTO_LAYERS=30            # indexer layers per forward (see below)
    export MXVAL_CAPTURE_RING=4                    # graph steps held on the GPU between drains
    # then, before vLLM imports its model code, in every process that runs the model:
    #   a sitecustomize.py on PYTHONPATH holding
    #       import harness.capture; harness.capture.boot()   # install(); a bad variable: one line, exit 2
    #   or for one process:
    python -c "import harness.capture as c; c.install(); from vllm.entrypoints.cli.main import main; main()" \\
        serve deepseek-ai/DeepSeek-V4-Pro --compilation-config '{"cudagraph_mode": "FULL_AND_PIECEWISE"}' ...

Eager calls (prefill, `--enforce-eager`, piecewise mode's eager attention) are cloned at
the call. Under CUDA/HIP graphs the Python wrappers run only while vLLM captures a graph:
install() also wraps `torch.cuda.CUDAGraph.capture_begin`, `capture_end` and `replay`.
During a capture, a call on a chosen layer records device-to-device copies of its fields
into staging buffers allocated then, so the copies are part of the graph; they run only on
replays whose step is chosen (one launch per recorded call reads a device flag the hook
sets before such a replay, optimized/triton_kernels/copy_if.py), and where the driver
allows their graph nodes are switched off between chosen replays (harness.capture.nodes:
graphs created while installed keep their template graph for it, and are instantiated
at capture_end): other replays launch none of them, or where nodes cannot be switched a
near-empty kernel per launch. When the capture ends, the hook preallocates a ring of RING buffers per field,
outside the graph's memory pool (the graph lends a staging buffer's bytes to its earlier
kernels, so a staged field lives only to the end of a replay). After a replay whose step
is chosen, the hook copies the staged fields into the step's ring position (device to
device, in the replay's stream order); other replays leave the ring alone, and graphs that
recorded nothing are replayed untouched. When the ring is full, the next chosen step
first drains it: the ring is moved to the host and written as dumps (this synchronizes
the device). `drain()` does the same on demand (the model runner can call it between
requests); flush() and exit drain too. Memory: every recorded field costs RING + 1 buffers
per captured graph (vLLM captures one graph per batch size): choose few layers (the K pool
is large).

Layer and step. The model integration says where it is:

    import harness.capture as capture
    capture.set_context(layer=self.layer_idx, step=step)     # before the indexer runs

(under graphs the layer set while capturing is the one recorded; set the step before each
replay). Without it, `MXVAL_CAPTURE_AUTO_LAYERS=N` (N indexer layers per forward: 30 in
V4-Pro) counts calls of the anchor op (`MXVAL_CAPTURE_ANCHOR`, default compress_pool;
compress_norm_rope_mxfp4_cache on vLLM's CUDA path): eager call c is indexer layer c % N of
forward step c // N (layer = the indexer layer's ordinal, not the model layer number);
inside a capture the count starts again (one capture is one forward), and a replay of a
graph that recorded is the next whole step. With neither, graph steps number the replays.
Dumps are written when the context moves on, by flush(), drain() and at exit, as
`layer<L>_step<S>[_rank<R>].safetensors` (R from RANK or LOCAL_RANK under TP/DP).

Targets. The hook wraps, per mxval op, the first upstream function of its list in
`optimized.upstream` that is present (vLLM 0.33.0 first, then older layouts):

    compress_pool            vLLM's pooling dispatcher (0.33.0) or its kernel launch (8e4f5df9)
    k_norm_rope_mxfp4_cache  aiter's K writer          q_rope_mxfp4_quant  aiter's Q quant
    paged_mxfp4_mqa_logits   aiter's scorer (row_ends or cu_ends generation)
    topk                     vLLM's top-k choice (aiter's or its own kernel), else aiter's
    compress_norm_rope_{mxfp4,fp8}_cache   vLLM's CUDA-path fused K kernels (their launches)

install() replaces each attribute, rebinds every loaded module (and class) that holds the
original by name, and clears vLLM's cached look-up of aiter's K writer and Q quant, so it
may run after the first call too (installing before vLLM imports its model code is still
the way). A wrapper passes every attribute of what it wraps through (vLLM's dispatcher
keeps `register_warmup`, `kernel`, ...). Calls that are not one of mxval's ops are passed
through unrecorded, with one warning: DeepSeek-V4.1's candidate gather (`use_gather`), its
block-score-only launches and the top-k over block scores, pooling without overlap, fused
K launches with MX-scaled FP8 or a head size that is not a power of two. For another
version, pass your own targets: `install([Target(module, attr, op, ArgMap(...))])`.

Shadow mode (harness.capture.shadow): `MXVAL_SHADOW=0.001` with `MXVAL_SHADOW_DIR=DIR`
(or `install(shadow=Shadow(DIR, 0.001))`) checks a sampled share of the chosen layers'
steps against the reference off the serving path, instead of writing dumps: a verdict log,
Prometheus counters and the failing steps as dumps in DIR.
"""
from __future__ import annotations

from .hook import (
    ENV_ANCHOR,
    ENV_AUTO,
    ENV_DIR,
    ENV_LAYERS,
    ENV_MODEL,
    ENV_RING,
    ENV_STEPS,
    boot,
    context,
    current_shadow,
    drain,
    flush,
    install,
    set_context,
    uninstall,
    wrap,
    wrap_launcher,
    written,
)
from .maps import (
    AITER_K_WRITER,
    AITER_Q_QUANT,
    AITER_SCORER,
    AITER_TOPK,
    CACHED_LOOKUPS,
    HOOKS,
    TARGETS,
    VLLM_COMPRESS_POOL,
    VLLM_COMPRESS_POOL_KERNEL,
    VLLM_FUSED_K_FP8,
    VLLM_FUSED_K_MXFP4,
    VLLM_TOPK,
    ArgMap,
    Hook,
    Selection,
    Target,
)

__all__ = ["ENV_ANCHOR", "ENV_AUTO", "ENV_DIR", "ENV_LAYERS", "ENV_MODEL", "ENV_RING", "ENV_STEPS", "boot", "context",
           "drain", "flush", "install", "set_context", "current_shadow", "uninstall", "wrap", "wrap_launcher", "written",
           "AITER_K_WRITER", "AITER_Q_QUANT", "AITER_SCORER", "AITER_TOPK", "CACHED_LOOKUPS", "HOOKS", "TARGETS",
           "VLLM_COMPRESS_POOL", "VLLM_COMPRESS_POOL_KERNEL", "VLLM_FUSED_K_FP8", "VLLM_FUSED_K_MXFP4", "VLLM_TOPK",
           "ArgMap", "Hook", "Selection", "Target"]
