"""The op table: every indexer op of the contract, declared once (docs/spec/DUMPS.md).

Each `Op` names its stage, its cache format, its reference function, the exact-scores
variant the harness compares a scorer against, its place in the chain, and the fields a
dump of it carries. The declared columns (all but the functions) are reference/op_table.py,
which loads no torch; this module adds the reference functions. Everything that lists ops
(backends, dumps, cases, runner, replay, the diff engine, the selftest) reads this table; the
harness adds its own columns (differ, label) in harness/diff/ops.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from .fp8 import k_norm_rope_fp8_cache, paged_fp8_mqa_logits, paged_fp8_mqa_logits_fp64, q_rope_fp8_quant
from .fused import compress_norm_rope_fp8_cache, compress_norm_rope_mxfp4_cache
from .k_writer import k_norm_rope_mxfp4_cache
from .op_table import (  # noqa: F401  (the declared columns, re-exported)
    BOTH,
    DECLARED,
    FORMATS,
    OP_NAMES,
    PATHS,
    STAGES,
    Field,
    OpDecl,
    OpSpec,
    chain,
    format_of,
    op_of,
    path_of,
)
from .pooling import compress_pool
from .q_quant import q_rope_mxfp4_quant
from .scoring import paged_mxfp4_mqa_logits, paged_mxfp4_mqa_logits_fp64
from .topk import topk


@dataclass(frozen=True, kw_only=True)
class Op(OpDecl):
    """A declared op with its reference functions."""
    fn: Callable                      # the reference: fn(**inputs, **scalars) -> {out name: tensor}
    fp64: Optional[Callable] = None   # exact scores (scorers): what their logits are judged against


# op -> (reference function, exact-scores function or None)
_FUNCTIONS = {
    "compress_pool": (compress_pool, None),
    "k_norm_rope_mxfp4_cache": (k_norm_rope_mxfp4_cache, None),
    "q_rope_mxfp4_quant": (q_rope_mxfp4_quant, None),
    "paged_mxfp4_mqa_logits": (paged_mxfp4_mqa_logits, paged_mxfp4_mqa_logits_fp64),
    "topk": (topk, None),
    "k_norm_rope_fp8_cache": (k_norm_rope_fp8_cache, None),
    "q_rope_fp8_quant": (q_rope_fp8_quant, None),
    "paged_fp8_mqa_logits": (paged_fp8_mqa_logits, paged_fp8_mqa_logits_fp64),
    "compress_norm_rope_mxfp4_cache": (compress_norm_rope_mxfp4_cache, None),
    "compress_norm_rope_fp8_cache": (compress_norm_rope_fp8_cache, None),
}
OPS: dict[str, Op] = {name: Op(**{f.name: getattr(d, f.name) for f in dataclasses.fields(OpDecl)},
                               fn=_FUNCTIONS[name][0], fp64=_FUNCTIONS[name][1])
                      for name, d in DECLARED.items()}
