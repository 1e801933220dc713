"""The op table: every indexer op of the contract, declared once (docs/spec/DUMPS.md).

Each `Op` names its stage, its cache format, its reference function, the exact-scores
variant the harness compares a scorer against, its place in the chain, and the fields a
dump of it carries. Everything that lists ops (backends, dumps, cases, runner, replay, the
diff engine, the selftest) reads this table; the harness adds its own columns (differ,
label) in harness/diff/ops.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import checks
from .fp8 import k_norm_rope_fp8_cache, paged_fp8_mqa_logits, paged_fp8_mqa_logits_fp64, q_rope_fp8_quant
from .fused import compress_norm_rope_fp8_cache, compress_norm_rope_mxfp4_cache
from .k_writer import k_norm_rope_mxfp4_cache
from .pooling import compress_pool
from .q_quant import q_rope_mxfp4_quant
from .scoring import paged_mxfp4_mqa_logits, paged_mxfp4_mqa_logits_fp64
from .topk import topk

# --- the field table ------------------------------------------------------------------

U8 = (torch.uint8,)
I32 = (torch.int32,)
INT = checks.INT_DTYPES
F32 = (torch.float32,)
BF16 = (torch.bfloat16,)
FLT = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Field:
    """dtypes allowed, and the shape as named dims. A dim is an int, a name ("T"), or a
    linear expression of one name: "D/2", "D/32", "4*D", "B+1"."""
    dtypes: tuple
    shape: tuple


@dataclass(frozen=True)
class OpSpec:
    inputs: dict
    outputs: dict
    scalars: dict                    # required: name -> kind (kinds: see harness/io/dumps.py check_scalar)
    optional: dict = field(default_factory=dict)   # study switches the reference accepts


_K_IN = {
    "k": Field(BF16, ("T", "D")),
    "positions": Field(INT, ("T",)),
    "cos_sin_cache": Field(F32, ("max_pos", "R")),
    "norm_weight": Field(FLT, ("D",)),
    "slot_mapping": Field(INT, ("T",)),
    "kv_cache": Field(U8, ("P", "page_bytes")),
}
_Q_IN = {
    "q": Field(BF16, ("T", "H", "D")),
    "positions": Field(INT, ("T",)),
    "cos_sin_cache": Field(F32, ("max_pos", "R")),
    "weights": Field(FLT, ("T", "H")),
}
_PAGED_IN = {
    "weights": Field(F32, ("Rw", "H")),
    "kv_cache": Field(U8, ("P", "page_bytes")),
    "query_start_loc": Field(INT, ("B+1",)),
    "context_lens": Field(INT, ("B",)),
    "block_table": Field(INT, ("B", "max_pages")),
    "row_ends": Field(INT, ("Rw",)),
}
_LOGITS_OUT = {"logits": Field(F32, ("Rw", "W"))}
_K_SCALARS = {"norm_eps": "float+", "compress_ratio": "int+", "page_size": "int+"}
_STUDY_K = {"rounding": "rounding", "hadamard": "bool", "rope": "rope"}
_Q_OPTIONS = {"hadamard": "bool", "rope": "rope", "softmax_scale": "float+", "head_scale": "float+"}
_POOL_IN = {
    "state_cache": Field(F32, ("num_blocks", "block_size", "4*D")),
    "block_table": Field(INT, ("num_reqs", "max_blocks")),
    "positions": Field(INT, ("T",)),
    "req_index": Field(INT, ("T",)),
    "kv_slot_mapping": Field(INT, ("T",)),
}
_FUSED_IN = {
    **_POOL_IN,
    "cos_sin_cache": Field(F32, ("max_pos", "R")),
    "norm_weight": Field(FLT, ("D",)),
    "kv_cache": Field(U8, ("P", "page_bytes")),
}
_FUSED_SCALARS = {"compress_ratio": "int+", "norm_eps": "float+", "page_size": "int+"}
_FUSED_OPTIONS = {"rope": "rope", "softmax": "softmax"}

_FIELDS: dict[str, OpSpec] = {
    "compress_pool": OpSpec(
        inputs=_POOL_IN,
        outputs={"pooled": Field(BF16, ("T", "D"))},
        scalars={"compress_ratio": "int+"},
        optional={"softmax": "softmax"}),
    "k_norm_rope_mxfp4_cache": OpSpec(
        inputs=_K_IN,
        outputs={"kv_cache": Field(U8, ("P", "page_bytes"))},
        scalars={**_K_SCALARS, "shuffle": "shuffle"},
        optional={**_STUDY_K, "scale_rule": "scale_rule"}),
    "q_rope_mxfp4_quant": OpSpec(
        inputs=_Q_IN,
        outputs={"q_fp4": Field(U8, ("T", "H", "D/2")), "q_scale": Field(U8, ("T", "H", "D/32")),
                 "weights": Field(F32, ("T", "H"))},
        scalars={"weights_scale": "float+"},
        optional={**_Q_OPTIONS, "scale_rule": "scale_rule"}),
    "paged_mxfp4_mqa_logits": OpSpec(
        inputs={"q_fp4": Field(U8, ("Rw", "H", "D/2")), "q_scale": Field(U8, ("Rw", "H", "D/32")),
                **_PAGED_IN},
        outputs=_LOGITS_OUT,
        scalars={"page_size": "int+", "shuffle": "shuffle", "clean_logits": "bool"}),
    "topk": OpSpec(
        inputs={"logits": Field(F32, ("Rw", "W")), "lengths": Field(INT, ("Rw",))},
        outputs={"indices": Field(I32, ("Rw", "k"))},
        scalars={"k": "int+"}),
    "k_norm_rope_fp8_cache": OpSpec(
        inputs={**_K_IN, "k": Field(FLT, ("T", "D"))},     # f32 for the CUDA fused rounding
        outputs={"kv_cache": Field(U8, ("P", "page_bytes"))},
        scalars={**_K_SCALARS, "fp8_dtype": "fp8_dtype"},
        optional=_STUDY_K),
    "q_rope_fp8_quant": OpSpec(
        inputs=_Q_IN,
        outputs={"q_fp8": Field(U8, ("T", "H", "D")), "weights": Field(F32, ("T", "H"))},
        scalars={"weights_scale": "float+", "fp8_dtype": "fp8_dtype"},
        optional=_Q_OPTIONS),
    "paged_fp8_mqa_logits": OpSpec(
        inputs={"q_fp8": Field(U8, ("Rw", "H", "D")), **_PAGED_IN},
        outputs=_LOGITS_OUT,
        scalars={"page_size": "int+", "fp8_dtype": "fp8_dtype", "clean_logits": "bool"}),
    "compress_norm_rope_mxfp4_cache": OpSpec(
        inputs=_FUSED_IN,
        outputs={"kv_cache": Field(U8, ("P", "page_bytes"))},
        scalars=_FUSED_SCALARS,
        optional=_FUSED_OPTIONS),
    "compress_norm_rope_fp8_cache": OpSpec(
        inputs=_FUSED_IN,
        outputs={"kv_cache": Field(U8, ("P", "page_bytes"))},
        scalars={**_FUSED_SCALARS, "fp8_dtype": "fp8_dtype"},
        optional=_FUSED_OPTIONS),
}



STAGES = ("pooling", "k_writer", "pool_k", "q_quant", "scorer", "topk")   # chain order
# Which chain an op belongs to (docs/paths.md): the ROCm split path pools, then writes K
# (preshuffled or natural pages); vLLM's CUDA path does both in one fused op (`pool_k`,
# natural pages). Q quant, scorer and top-k serve both.
PATHS = ("rocm", "cuda")
BOTH = PATHS


@dataclass(frozen=True)
class Op:
    name: str
    stage: str                        # one of STAGES
    format: Optional[str]             # "mxfp4" | "fp8" | None (shared by both chains)
    fn: Callable                      # the reference: fn(**inputs, **scalars) -> {out name: tensor}
    fields: OpSpec                    # what a dump of it carries
    fp64: Optional[Callable] = None   # exact scores (scorers): what their logits are judged against
    paths: tuple = BOTH               # the paths whose chain holds the op
    fuses: tuple = ()                 # a fused op: the stages it does in one launch, in chain order

    @property
    def chain_pos(self) -> int:
        return STAGES.index(self.stage)

    @property
    def diffed_as(self) -> str:
        """The stage whose output the op writes, and whose metrics it reports: its own, or a
        fused op's last (the fused pool+K op writes K pages, judged as a K writer's)."""
        return self.fuses[-1] if self.fuses else self.stage

    @property
    def stages(self) -> tuple:
        """Every stage whose metrics the op reports: its own, and the one it is diffed as."""
        return tuple(dict.fromkeys((self.stage, self.diffed_as)))


_OPS = (
    Op("compress_pool", "pooling", None, compress_pool, _FIELDS["compress_pool"], paths=("rocm",)),
    Op("k_norm_rope_mxfp4_cache", "k_writer", "mxfp4", k_norm_rope_mxfp4_cache, _FIELDS["k_norm_rope_mxfp4_cache"],
       paths=("rocm",)),
    Op("q_rope_mxfp4_quant", "q_quant", "mxfp4", q_rope_mxfp4_quant, _FIELDS["q_rope_mxfp4_quant"]),
    Op("paged_mxfp4_mqa_logits", "scorer", "mxfp4", paged_mxfp4_mqa_logits, _FIELDS["paged_mxfp4_mqa_logits"],
       fp64=paged_mxfp4_mqa_logits_fp64),
    Op("topk", "topk", None, topk, _FIELDS["topk"]),
    Op("k_norm_rope_fp8_cache", "k_writer", "fp8", k_norm_rope_fp8_cache, _FIELDS["k_norm_rope_fp8_cache"],
       paths=("rocm",)),
    Op("q_rope_fp8_quant", "q_quant", "fp8", q_rope_fp8_quant, _FIELDS["q_rope_fp8_quant"]),
    Op("paged_fp8_mqa_logits", "scorer", "fp8", paged_fp8_mqa_logits, _FIELDS["paged_fp8_mqa_logits"],
       fp64=paged_fp8_mqa_logits_fp64),
    Op("compress_norm_rope_mxfp4_cache", "pool_k", "mxfp4", compress_norm_rope_mxfp4_cache,
       _FIELDS["compress_norm_rope_mxfp4_cache"], paths=("cuda",), fuses=("pooling", "k_writer")),
    Op("compress_norm_rope_fp8_cache", "pool_k", "fp8", compress_norm_rope_fp8_cache,
       _FIELDS["compress_norm_rope_fp8_cache"], paths=("cuda",), fuses=("pooling", "k_writer")),
)
OPS: dict[str, Op] = {op.name: op for op in _OPS}
OP_NAMES: tuple[str, ...] = tuple(OPS)
FORMATS = ("mxfp4", "fp8")


def chain(fmt: str, path: str = "rocm") -> tuple[str, ...]:
    """The ops of one format's chain on one path, in chain order (pooling ... top-k)."""
    if fmt not in FORMATS:
        raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if path not in PATHS:
        raise ValueError(f"path: expected one of {', '.join(PATHS)}, got {path!r}")
    return tuple(sorted((o.name for o in _OPS if o.format in (fmt, None) and path in o.paths),
                        key=lambda n: OPS[n].chain_pos))


def op_of(fmt: str, stage: str, path: str = "rocm") -> str:
    """The op that does `stage` in `fmt`'s chain on `path`."""
    (name,) = [n for n in chain(fmt, path) if OPS[n].stage == stage]
    return name


def path_of(ops) -> str:
    """The path a set of ops belongs to (cuda when any op is cuda-only)."""
    return "cuda" if any(OPS[o].paths == ("cuda",) for o in ops) else "rocm"


def format_of(ops) -> str:
    """The chain format a set of ops belongs to (fp8 when any op is an fp8 op)."""
    return "fp8" if any(OPS[o].format == "fp8" for o in ops) else "mxfp4"
