"""The op table's declared columns, without torch: every indexer op of the contract (its
stage, cache format, paths, the stages it fuses, the fields a dump of it carries) and the
chain each format and path runs (docs/spec/DUMPS.md).

reference/ops.py builds the op table (`OPS`) on this, adding each op's reference functions;
the commands that only list ops or check case files (`mxval cases`) read this one and load no
torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# --- the field table ------------------------------------------------------------------

# dtypes by their torch names (`str(dtype)` without "torch.")
U8 = ("uint8",)
I32 = ("int32",)
INT = ("int32", "int64")
F32 = ("float32",)
BF16 = ("bfloat16",)
FLT = ("bfloat16", "float32")


@dataclass(frozen=True)
class Field:
    """dtypes allowed (torch's names: "uint8"), and the shape as named dims. A dim is an int,
    a name ("T"), or a linear expression of one name: "D/2", "D/32", "4*D", "B+1"."""
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
class OpDecl:
    """An op's declared columns (reference/ops.py adds its reference functions)."""
    name: str
    stage: str                        # one of STAGES
    format: Optional[str]             # "mxfp4" | "fp8" | None (shared by both chains)
    fields: OpSpec                    # what a dump of it carries
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


_DECLARED = (
    OpDecl("compress_pool", "pooling", None, _FIELDS["compress_pool"], paths=("rocm",)),
    OpDecl("k_norm_rope_mxfp4_cache", "k_writer", "mxfp4", _FIELDS["k_norm_rope_mxfp4_cache"], paths=("rocm",)),
    OpDecl("q_rope_mxfp4_quant", "q_quant", "mxfp4", _FIELDS["q_rope_mxfp4_quant"]),
    OpDecl("paged_mxfp4_mqa_logits", "scorer", "mxfp4", _FIELDS["paged_mxfp4_mqa_logits"]),
    OpDecl("topk", "topk", None, _FIELDS["topk"]),
    OpDecl("k_norm_rope_fp8_cache", "k_writer", "fp8", _FIELDS["k_norm_rope_fp8_cache"], paths=("rocm",)),
    OpDecl("q_rope_fp8_quant", "q_quant", "fp8", _FIELDS["q_rope_fp8_quant"]),
    OpDecl("paged_fp8_mqa_logits", "scorer", "fp8", _FIELDS["paged_fp8_mqa_logits"]),
    OpDecl("compress_norm_rope_mxfp4_cache", "pool_k", "mxfp4", _FIELDS["compress_norm_rope_mxfp4_cache"],
           paths=("cuda",), fuses=("pooling", "k_writer")),
    OpDecl("compress_norm_rope_fp8_cache", "pool_k", "fp8", _FIELDS["compress_norm_rope_fp8_cache"],
           paths=("cuda",), fuses=("pooling", "k_writer")),
)
DECLARED: dict[str, OpDecl] = {op.name: op for op in _DECLARED}
OP_NAMES: tuple[str, ...] = tuple(DECLARED)
FORMATS = ("mxfp4", "fp8")


def chain(fmt: str, path: str = "rocm") -> tuple[str, ...]:
    """The ops of one format's chain on one path, in chain order (pooling ... top-k)."""
    if fmt not in FORMATS:
        raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if path not in PATHS:
        raise ValueError(f"path: expected one of {', '.join(PATHS)}, got {path!r}")
    return tuple(sorted((o.name for o in _DECLARED if o.format in (fmt, None) and path in o.paths),
                        key=lambda n: DECLARED[n].chain_pos))


def op_of(fmt: str, stage: str, path: str = "rocm") -> str:
    """The op that does `stage` in `fmt`'s chain on `path`."""
    (name,) = [n for n in chain(fmt, path) if DECLARED[n].stage == stage]
    return name


def path_of(ops) -> str:
    """The path a set of ops belongs to (cuda when any op is cuda-only)."""
    return "cuda" if any(DECLARED[o].paths == ("cuda",) for o in ops) else "rocm"


def format_of(ops) -> str:
    """The chain format a set of ops belongs to (fp8 when any op is an fp8 op)."""
    return "fp8" if any(DECLARED[o].format == "fp8" for o in ops) else "mxfp4"
