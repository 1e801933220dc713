"""The indexer variants `mxval study` compares: named configurations of the reference.

Each variant turns exact operands (bf16-valued q [R,H,D] after RoPE, keys [J,D] after norm
and RoPE, raw head weights [R,H]) into what its scorer multiplies, dequantized exactly in
fp32: `key_side` is per key (so it applies to a needle or a prefix alike) and `query_side`
per (row, head). FP8's per-(token, head) q scale is a power of two; it is applied to the
dequantized q here instead of being folded into the weights (NUMERICS.md §7), which gives
the same products exactly and lets two variants be compared operand by operand.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import fp8 as ref_fp8
from reference import hadamard as ref_hadamard
from reference import mxfp4 as ref_mxfp4
from reference.q_quant import fold_weights


@dataclass(frozen=True)
class Variant:
    name: str
    quant: str | None = None          # None (exact), "mxfp4", "fp8"
    scale_rule: str = "ceil"          # MXFP4 scale rule (reference.mxfp4.SCALE_RULES)
    fp8_dtype: str = "e4m3fn"         # FP8 flavour the K writer and the Q quant use
    read_as: str | None = None        # FP8 flavour the scorer decodes the K cache as, if another
    hadamard: str = "none"            # "none", "both", "q" (one side rotated)
    kind: str = "cost"                # "exact", "cost" (a quantization's price) or "bug"
    merge_into: str | None = None     # a variant whose operands this one may repeat exactly
    note: str = ""

    @property
    def q_flavour(self) -> str:
        """The scorer's side quantizes q: a cross-flavour read uses the reader's flavour."""
        return self.read_as or self.fp8_dtype


VARIANTS = {v.name: v for v in (
    Variant("exact", kind="exact", note="bf16 q and k after norm and RoPE"),
    Variant("fp8-e4m3fn", "fp8", note="the default FP8 cache"),
    Variant("fp8-e4m3fnuz", "fp8", fp8_dtype="e4m3fnuz", merge_into="fp8-e4m3fn",
            note="gfx942 flavour, max 224"),
    Variant("fp8-e4m3fn+H", "fp8", hadamard="both"),
    Variant("fp8-e4m3fnuz+H", "fp8", fp8_dtype="e4m3fnuz", hadamard="both", merge_into="fp8-e4m3fn+H"),
    Variant("mxfp4", "mxfp4", note="as vLLM runs it (ceil scale, no rotation)"),
    Variant("mxfp4-ocp", "mxfp4", scale_rule="ocp-floor", note="OCP v1.0 floor scale"),
    Variant("mxfp4+H", "mxfp4", hadamard="both", note="DeepSeek's reference rotation"),
    Variant("mxfp4-ocp+H", "mxfp4", scale_rule="ocp-floor", hadamard="both"),
    Variant("mxfp4+H-q-only", "mxfp4", hadamard="q", kind="bug", note="Hadamard on q only"),
    Variant("fp8-fn-read-fnuz", "fp8", fp8_dtype="e4m3fn", read_as="e4m3fnuz", kind="bug",
            note="K written e4m3fn, read e4m3fnuz (0x80 = -0 becomes NaN, the rest halves)"),
    Variant("fp8-fnuz-read-fn", "fp8", fp8_dtype="e4m3fnuz", read_as="e4m3fn", kind="bug",
            note="K written e4m3fnuz, read e4m3fn (every value doubles)"),
)}


def key_config(v: Variant) -> tuple:
    """What a variant's key side depends on: variants with equal configs read equal keys."""
    return (v.hadamard == "both", v.quant, v.scale_rule if v.quant == "mxfp4" else None,
            v.fp8_dtype if v.quant == "fp8" else None, v.read_as if v.quant == "fp8" else None)


def key_sides(names, k: torch.Tensor) -> dict:
    """{variant: key_side(variant, k)}, each distinct key configuration computed once and the
    rotation once."""
    rotated, by_config, out = None, {}, {}
    for n in names:
        v = VARIANTS[n]
        cfg = key_config(v)
        if cfg not in by_config:
            if v.hadamard == "both" and rotated is None:
                rotated = ref_hadamard.rotate(k)
            by_config[cfg] = key_side(v, k, rotated=rotated if v.hadamard == "both" else None)
        out[n] = by_config[cfg]
    return out


def key_side(v: Variant, k: torch.Tensor, *, rotated: torch.Tensor | None = None) -> torch.Tensor:
    """Keys [..., D] (bf16-valued) -> the values the variant's scorer reads, fp32 (`rotated`:
    the keys already rotated, for a variant that rotates)."""
    if v.hadamard == "both":
        k = rotated if rotated is not None else ref_hadamard.rotate(k)
    if v.quant is None:
        return k.float()
    if v.quant == "mxfp4":
        return ref_mxfp4.dequantize_mxfp4(*ref_mxfp4.quantize_mxfp4(k, v.scale_rule), torch.float32)
    k8, s = ref_fp8.quantize_fp8(k, v.fp8_dtype)
    return ref_fp8.dequantize_fp8(k8, v.read_as or v.fp8_dtype, torch.float32) * s.unsqueeze(-1)


def query_side(v: Variant, q: torch.Tensor, w: torch.Tensor, weights_scale: float):
    """(q [R,H,D] bf16-valued, raw weights [R,H]) -> (q values, folded weights), fp32."""
    if v.hadamard in ("both", "q"):
        q = ref_hadamard.rotate(q)
    wf = fold_weights(w, weights_scale)
    if v.quant is None:
        return q.float(), wf
    if v.quant == "mxfp4":
        return ref_mxfp4.dequantize_mxfp4(*ref_mxfp4.quantize_mxfp4(q, v.scale_rule), torch.float32), wf
    q8, s_q = ref_fp8.quantize_fp8(q, v.q_flavour)
    return ref_fp8.dequantize_fp8(q8, v.q_flavour, torch.float32) * s_q.unsqueeze(-1), wf


def ordered(names) -> list[str]:
    """exact first, then the catalogue's order; every merge target before what merges into it."""
    names = set(names) | {"exact"}
    for n in list(names):
        if VARIANTS[n].merge_into:
            names.add(VARIANTS[n].merge_into)
    return [n for n in VARIANTS if n in names]
