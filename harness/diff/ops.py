"""One entry point for a whole op: `diff_op` picks the stage's differ from the op table."""
from __future__ import annotations

from typing import Optional

import torch

from .pages import diff_pages
from .report import DiffReport
from .rows import diff_pooled, diff_q
from .scores import diff_logits, diff_topk

def writer_slots(inputs: dict, scalars: dict) -> torch.Tensor:
    from reference.k_writer import writer_mask
    sel = writer_mask(inputs["positions"], inputs["slot_mapping"].to(inputs["positions"].device),
                      scalars["compress_ratio"])
    return inputs["slot_mapping"].to(sel.device)[sel]


def _shape_report(op: str, actual: dict, expected: dict) -> Optional[DiffReport]:
    missing = [n for n in expected if n not in actual]
    bad = [n for n in expected if n in actual and (
        not isinstance(actual[n], torch.Tensor) or actual[n].shape != expected[n].shape)]
    if not missing and not bad:
        return None
    findings = [{"class": "output_missing", "output": n, "where": f"output {n} is missing"} for n in missing]
    findings += [{"class": "output_bad_shape", "output": n,
                  "where": f"output {n}: shape {list(getattr(actual[n], 'shape', []))}, expected "
                           f"{list(expected[n].shape)}"} for n in bad]
    return DiffReport(op, {"outputs_missing": float(len(missing)), "outputs_bad_shape": float(len(bad))},
                      findings, [])


def diff_op(op: str, inputs: dict, scalars: dict, actual: dict, expected: dict) -> DiffReport:
    """Diff one op's outputs (`actual` against `expected`, both dicts of DUMPS.md out names)
    on the inputs that produced them; written slots, compared rows and row ends come from
    the inputs. For the scorer, `expected["logits"]` may be fp64 (preferred) or f32. For
    top-k, the reference scores are `inputs["logits"]` and `expected` is not used."""
    from harness.io.dumps import OP_FIELDS
    if op not in OP_FIELDS:
        raise ValueError(f"op: unknown op {op!r} (known: {', '.join(OP_FIELDS)})")
    if op != "topk":
        shape_rep = _shape_report(op, actual, expected)
        if shape_rep:
            return shape_rep
    if op == "compress_pool":
        from reference.pooling import boundary_mask
        rows = boundary_mask(inputs["positions"].cpu(), scalars["compress_ratio"]) & \
            (inputs["kv_slot_mapping"].cpu() >= 0)
        return diff_pooled(actual["pooled"], expected["pooled"], rows, op=op)
    if op in ("k_norm_rope_mxfp4_cache", "k_norm_rope_fp8_cache"):
        fp8 = op == "k_norm_rope_fp8_cache"
        return diff_pages(actual["kv_cache"], expected["kv_cache"], inputs["kv_cache"],
                          page_size=scalars["page_size"], head_dim=inputs["k"].shape[1],
                          shuffle=None if fp8 else scalars.get("shuffle"),
                          written_slots=writer_slots(inputs, scalars), fmt="fp8" if fp8 else "mxfp4",
                          fp8_dtype=scalars.get("fp8_dtype", "e4m3fn"), op=op)
    if op in ("q_rope_mxfp4_quant", "q_rope_fp8_quant"):
        return diff_q(actual, expected, op=op)
    if op in ("paged_mxfp4_mqa_logits", "paged_fp8_mqa_logits"):
        return diff_logits(actual["logits"], expected["logits"], inputs["row_ends"],
                           clean=bool(scalars.get("clean_logits", False)), op=op)
    if "indices" not in actual:
        return _shape_report(op, actual, {"indices": torch.empty(0)})
    return diff_topk(actual["indices"], inputs["logits"], inputs["lengths"], scalars["k"], op=op)
