"""The CUDA path's fused K stage: pool -> RMS norm -> RoPE -> quantize -> paged insert in one
op, as vLLM's `_fused_kv_compress_norm_rope_insert_indexer_{mxfp4_,}attn` kernels do
(NUMERICS.md §2a, docs/paths.md).

The op has no pooled output. Its reference is exactly the chain
`compress_pool(rounding="cuda")` -> `k_norm_rope_*_cache(rounding="cuda", shuffle=None)`:
the fp32 pooled row goes through the norm and RoPE unrounded (NoPE pairs through the formula
with cos = 1, sin = 0), one bf16 round, then the quantizer, in natural page order.
"""
from __future__ import annotations

from . import checks
from .fp8 import k_norm_rope_fp8_cache
from .k_writer import k_norm_rope_mxfp4_cache
from .pooling import compress_pool
from .rope import ROPE_MODES

# What vLLM 0.33.0's CUDA kernels compute, as far as the reference can say it (the defaults
# of the fused ops). Compiled with fp fusion (Triton's default) the K kernels' rotation
# contracts to `fma-oc`, the Q kernels' to `fma-es` (reference/rope.py); in the Triton
# interpreter nothing contracts (`rope="separate"`).
CUDA_ROPE = "fma-oc"
CUDA_Q_ROPE = "fma-es"
CUDA_SOFTMAX = "fp64"


def _fused(writer, *, state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio,
           rope, softmax, **write) -> dict:
    """Pool (cuda rounding: fp32 rows) and hand the rows to `writer` in natural page order.
    `rope` is checked before the pooling work; the pooling checks its own arguments."""
    checks.choice("rope", rope, ROPE_MODES)
    k = compress_pool(state_cache=state_cache, block_table=block_table, positions=positions,
                      req_index=req_index, kv_slot_mapping=kv_slot_mapping,
                      compress_ratio=compress_ratio, rounding="cuda", softmax=softmax)["pooled"]
    # rows that do not write are NaN; the writer reads only the others
    return writer(k=k, positions=positions, slot_mapping=kv_slot_mapping, compress_ratio=compress_ratio,
                  rounding="cuda", rope=rope, **write)


def compress_norm_rope_mxfp4_cache(*, state_cache, block_table, positions, req_index, kv_slot_mapping,
                                   cos_sin_cache, norm_weight, kv_cache, compress_ratio: int = 4,
                                   norm_eps: float = 1e-6, page_size: int = 64,
                                   rope: str = CUDA_ROPE, softmax: str = CUDA_SOFTMAX) -> dict:
    """The MXFP4 fused K stage -> {"kv_cache": the pool after the call} (natural page order)."""
    return _fused(k_norm_rope_mxfp4_cache, state_cache=state_cache, block_table=block_table, positions=positions,
                  req_index=req_index, kv_slot_mapping=kv_slot_mapping, compress_ratio=compress_ratio, rope=rope,
                  softmax=softmax, cos_sin_cache=cos_sin_cache, norm_weight=norm_weight, kv_cache=kv_cache,
                  norm_eps=norm_eps, page_size=page_size, shuffle=None)


def compress_norm_rope_fp8_cache(*, state_cache, block_table, positions, req_index, kv_slot_mapping,
                                 cos_sin_cache, norm_weight, kv_cache, compress_ratio: int = 4,
                                 norm_eps: float = 1e-6, page_size: int = 64, fp8_dtype: str = "e4m3fn",
                                 rope: str = CUDA_ROPE, softmax: str = CUDA_SOFTMAX) -> dict:
    """The FP8 fused K stage -> {"kv_cache": the pool after the call} (fp32 scale per entry)."""
    return _fused(k_norm_rope_fp8_cache, state_cache=state_cache, block_table=block_table, positions=positions,
                  req_index=req_index, kv_slot_mapping=kv_slot_mapping, compress_ratio=compress_ratio, rope=rope,
                  softmax=softmax, cos_sin_cache=cos_sin_cache, norm_weight=norm_weight, kv_cache=kv_cache,
                  norm_eps=norm_eps, page_size=page_size, fp8_dtype=fp8_dtype)
