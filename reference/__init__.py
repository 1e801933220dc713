"""Pure-torch reference of the DeepSeek-V4 MXFP4 indexer path (NUMERICS.md).
One function per op, named as in DUMPS.md. Each takes the dump's `in/` tensors and its
scalars as keyword arguments, never modifies its inputs, and returns a dict of the `out/`
tensors by name. No Triton anywhere in this package.

The names below load their modules on first use (torch with them), so that a command that
only reads the declared op table (reference/op_table.py) or the formats loads no torch.
"""
import importlib
import sys
import types

from .op_table import OP_NAMES

# name -> the module (of this package) that defines it
_WHERE = {
    "NonFiniteInput": "checks", "PRESETS": "formats", "ROUNDING_PATHS": "formats", "ModelPreset": "formats",
    "preset": "formats", "OPS": "ops",
    "compress_pool": "pooling", "k_norm_rope_mxfp4_cache": "k_writer", "q_rope_mxfp4_quant": "q_quant",
    "paged_mxfp4_mqa_logits": "scoring", "topk": "topk", "k_norm_rope_fp8_cache": "fp8",
    "q_rope_fp8_quant": "fp8", "paged_fp8_mqa_logits": "fp8",
    "compress_norm_rope_mxfp4_cache": "fused", "compress_norm_rope_fp8_cache": "fused",
}

__all__ = ["FUNCTIONS", "OP_NAMES", *_WHERE]


def __getattr__(name: str):
    if name == "FUNCTIONS":          # the reference functions by op name (the op table's `fn` column)
        from .ops import OPS
        value = {n: op.fn for n, op in OPS.items()}
    elif name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    else:                            # a submodule (`reference.layout`) not imported yet
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """`reference.topk` is the top-k function, as every op name of the package is, even once
    its module `reference.topk` is imported (which would otherwise set the attribute to the
    module)."""

    def __setattr__(self, name, value):
        if name == "topk" and isinstance(value, types.ModuleType):
            value = value.topk
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
