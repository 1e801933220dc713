"""One entry point for a whole op: `diff_op` picks the stage's differ from the op table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from reference import checks
from reference.ops import OPS

from . import args as A
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


def _diff_pool(op, inputs, scalars, actual, expected):
    from reference.pooling import boundary_mask
    rows = boundary_mask(inputs["positions"].cpu(), scalars["compress_ratio"]) & \
        (inputs["kv_slot_mapping"].cpu() >= 0)
    return diff_pooled(actual["pooled"], expected["pooled"], rows, op=op)


def _diff_k_pages(op, inputs, scalars, actual, expected):
    fp8 = OPS[op].format == "fp8"
    return diff_pages(actual["kv_cache"], expected["kv_cache"], inputs["kv_cache"],
                      page_size=scalars["page_size"], head_dim=inputs["k"].shape[1],
                      shuffle=None if fp8 else scalars.get("shuffle"),
                      written_slots=writer_slots(inputs, scalars), fmt=OPS[op].format,
                      fp8_dtype=scalars.get("fp8_dtype", "e4m3fn"), op=op)


def _diff_fused(op, inputs, scalars, actual, expected):
    """The fused K stage's pages (natural order), byte for byte like a writer's, plus the
    fraction of owned bytes that differ (`pool_k_bytes_mismatched_frac`, its own budget: the
    stage pools too, and a kernel's fp32 pooling moves a few bytes, NUMERICS.md §2a)."""
    from reference import fp8 as ref_fp8
    from reference import layout
    from reference.k_writer import writer_mask
    pos = inputs["positions"]
    slots_all = inputs["kv_slot_mapping"].to(pos.device)
    slots = slots_all[writer_mask(pos, slots_all, scalars["compress_ratio"])]
    d = inputs["state_cache"].shape[-1] // 4
    fmt = OPS[op].format
    rep = diff_pages(actual["kv_cache"], expected["kv_cache"], inputs["kv_cache"],
                     page_size=scalars["page_size"], head_dim=d, shuffle=None, written_slots=slots,
                     fmt=fmt, fp8_dtype=scalars.get("fp8_dtype", "e4m3fn"), op=op)
    owned = int(torch.unique(slots.long()).numel()) * (layout.entry_bytes(d) if fmt == "mxfp4"
                                                        else ref_fp8.entry_bytes(d))
    mism = rep.metrics["page_value_bytes_mismatched"] + rep.metrics["page_scale_bytes_mismatched"]
    rep.metrics["pool_k_bytes_mismatched_frac"] = float(mism) / owned if owned else 0.0
    return rep


def _diff_q(op, inputs, scalars, actual, expected):
    return diff_q(actual, expected, op=op)


def _diff_scores(op, inputs, scalars, actual, expected):
    return diff_logits(actual["logits"], expected["logits"], inputs["row_ends"],
                       clean=bool(scalars.get("clean_logits", False)), op=op)


def _diff_topk(op, inputs, scalars, actual, expected):
    if "indices" not in actual:
        return _shape_report(op, actual, {"indices": torch.empty(0)})
    return diff_topk(actual["indices"], inputs["logits"], inputs["lengths"], scalars["k"], op=op)


@dataclass(frozen=True)
class StageView:
    """The harness's columns of the op table, per stage: how to diff it, what to call it,
    which inputs and scalars its differ reads."""
    differ: Callable
    label: str
    checks_shape: bool = True          # top-k validates its own output (width k, not the reference's)
    inputs: tuple = ()
    scalars: tuple = ()


STAGE_VIEWS: dict[str, StageView] = {
    "pooling": StageView(_diff_pool, "pooling", inputs=("positions", "kv_slot_mapping"),
                         scalars=("compress_ratio",)),
    "k_writer": StageView(_diff_k_pages, "K writer", inputs=("kv_cache", "k", "positions", "slot_mapping"),
                          scalars=("compress_ratio", "page_size")),
    "pool_k": StageView(_diff_fused, "fused pool+K", inputs=("kv_cache", "state_cache", "positions", "kv_slot_mapping"),
                        scalars=("compress_ratio", "page_size")),
    "q_quant": StageView(_diff_q, "Q quant"),
    "scorer": StageView(_diff_scores, "scorer", inputs=("row_ends",)),
    "topk": StageView(_diff_topk, "top-k", checks_shape=False, inputs=("logits", "lengths"), scalars=("k",)),
}


def label(op: str) -> str:
    """A short human name of `op` (its stage, and the format where two ops share a stage)."""
    o = OPS[op]
    return STAGE_VIEWS[o.stage].label + (" (fp8)" if o.format == "fp8" else "")


def diff_op(op: str, inputs: dict, scalars: dict, actual: dict, expected: dict) -> DiffReport:
    """Diff one op's outputs (`actual` against `expected`, both dicts of DUMPS.md out names)
    on the inputs that produced them; written slots, compared rows and row ends come from
    the inputs. For the scorer, `expected["logits"]` may be fp64 (preferred) or f32. For
    top-k, the reference scores are `inputs["logits"]` and `expected` is not used."""
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op: unknown op {op!r} (known: {', '.join(OPS)})")
    for name, d in (("inputs", inputs), ("scalars", scalars), ("actual", actual), ("expected", expected)):
        A.mapping(name, d)               # a meta, sparse or nested tensor: named here, not deep in torch
    view = STAGE_VIEWS[OPS[op].stage]
    for name in view.inputs:
        if name not in inputs:
            raise ValueError(f"inputs: {op} needs {name!r}")
        if not isinstance(inputs[name], torch.Tensor):
            raise ValueError(f"inputs[{name!r}]: expected a tensor, got {type(inputs[name]).__name__}")
    # index inputs: 1-D integer tensors, the per-token ones of one length (else a torch error deep down)
    dims = checks.Dims()
    for name, dim in (("positions", "T"), ("kv_slot_mapping", "T"), ("slot_mapping", "T"), ("row_ends", "Rw"),
                      ("lengths", "rows")):
        if name in view.inputs:
            dims.check(f"inputs[{name!r}]", inputs[name], checks.INT_DTYPES, (dim,))
    for name in view.scalars:
        if name not in scalars:
            raise ValueError(f"scalars: {op} needs {name!r}")
    if "compress_ratio" in view.scalars and (isinstance(scalars["compress_ratio"], bool)
                                             or not isinstance(scalars["compress_ratio"], int)
                                             or scalars["compress_ratio"] < 1):
        raise ValueError(f"scalars['compress_ratio']: expected a positive integer, got {scalars['compress_ratio']!r}")
    if view.checks_shape:
        shape_rep = _shape_report(op, actual, expected)
        if shape_rep:
            return shape_rep
    return view.differ(op, inputs, scalars, actual, expected)
