"""Pure-torch reference of the DeepSeek-V4 MXFP4 indexer path (NUMERICS.md).

One function per op, named as in DUMPS.md. Each takes the dump's `in/` tensors and its
scalars as keyword arguments, never modifies its inputs, and returns a dict of the `out/`
tensors by name. No Triton anywhere in this package.
"""
from .checks import NonFiniteInput
from .formats import PRESETS, ROUNDING_PATHS, ModelPreset, preset
from .fp8 import k_norm_rope_fp8_cache, paged_fp8_mqa_logits, q_rope_fp8_quant
from .k_writer import k_norm_rope_mxfp4_cache
from .pooling import compress_pool
from .q_quant import q_rope_mxfp4_quant
from .scoring import paged_mxfp4_mqa_logits
from .topk import topk

OPS = {
    "compress_pool": compress_pool,
    "k_norm_rope_mxfp4_cache": k_norm_rope_mxfp4_cache,
    "q_rope_mxfp4_quant": q_rope_mxfp4_quant,
    "paged_mxfp4_mqa_logits": paged_mxfp4_mqa_logits,
    "topk": topk,
    "k_norm_rope_fp8_cache": k_norm_rope_fp8_cache,
    "q_rope_fp8_quant": q_rope_fp8_quant,
    "paged_fp8_mqa_logits": paged_fp8_mqa_logits,
}

__all__ = ["OPS", "NonFiniteInput", "PRESETS", "ROUNDING_PATHS", "ModelPreset", "preset", *OPS]
