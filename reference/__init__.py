"""Pure-torch reference of the DeepSeek-V4 MXFP4 indexer path (NUMERICS.md).

One function per op, named as in DUMPS.md. Each takes the dump's `in/` tensors and its
scalars as keyword arguments, never modifies its inputs, and returns a dict of the `out/`
tensors by name. No Triton anywhere in this package.
"""
from .checks import NonFiniteInput
from .formats import PRESETS, ROUNDING_PATHS, ModelPreset, preset
from .fp8 import k_norm_rope_fp8_cache, paged_fp8_mqa_logits, q_rope_fp8_quant
from .fused import compress_norm_rope_fp8_cache, compress_norm_rope_mxfp4_cache
from .k_writer import k_norm_rope_mxfp4_cache
from .ops import OP_NAMES, OPS
from .pooling import compress_pool
from .q_quant import q_rope_mxfp4_quant
from .scoring import paged_mxfp4_mqa_logits
from .topk import topk

# The reference functions by op name (the op table's `fn` column).
FUNCTIONS = {name: op.fn for name, op in OPS.items()}

__all__ = ["FUNCTIONS", "OPS", "OP_NAMES", "NonFiniteInput", "PRESETS", "ROUNDING_PATHS", "ModelPreset", "preset",
           "compress_pool", "k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk",
           "k_norm_rope_fp8_cache", "q_rope_fp8_quant", "paged_fp8_mqa_logits",
           "compress_norm_rope_mxfp4_cache", "compress_norm_rope_fp8_cache"]
