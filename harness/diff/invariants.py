"""Invariants that need no reference: properties of a backend op's output that hold whatever
its inputs, checked on the output and the inputs alone.

A diff says where a backend differs from the reference; an invariant says the output is
impossible. Invariants still judge where the reference cannot: a case that declares
non-finite inputs (`expect_nonfinite`, a `plant`) runs every backend op on them, and a
top-k that turns a NaN row into indices outside the row is a crash waiting downstream,
whatever the NaN's origin. Each invariant is declared once in INVARIANTS (name, the op
stages it applies to, what it checks); `check(op, inputs, scalars, actual)` runs those of
the op's stages and returns a DiffReport whose metric `invariant_violations` counts every
violation and whose findings (class `invariant`) name the invariant and where it broke.

    from harness.diff.invariants import check
    rep = check("topk", {"logits": logits, "lengths": lengths}, {"k": 8}, {"indices": idx})
    assert rep.metrics["invariant_violations"] == 0, rep.summary()

`declared_nonfinite=True` (a case that plants non-finite inputs) relaxes exactly what such
inputs make unspecified: logits before a row's end may be non-finite, and a scale byte
derived from a non-finite input row may be any byte (255 is e8m0's NaN, NUMERICS.md §4).
Everything else holds regardless: -inf past each row's end with clean_logits, the top-k
structure, no byte changed outside the written slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from reference import layout
from reference.ops import OPS

from .pages import _fp8_locate, _outside_changes
from .report import MAX_FINDINGS, Collector, DiffReport, hex_byte
from .scores import row_blocks

METRIC = "invariant_violations"
FINDING_CLASS = "invariant"
E8M0_NAN = 255
CEIL_CODES = (1, 253)            # the production `ceil` rule's codes (NUMERICS.md §4)
ANY_CODES = (0, 254)             # the other scale rules' codes: every code but NaN


@dataclass(frozen=True)
class Invariant:
    name: str
    stages: tuple[str, ...]      # op stages (reference/ops.py) whose output it checks
    doc: str
    check: Callable              # (op, inputs, scalars, actual, ctx: _Ctx) -> None (files into ctx)


class _Ctx:
    """One op's check: the collector, the violation count, and the declared-non-finite flag."""

    def __init__(self, op: str, declared_nonfinite: bool):
        self.op, self.declared_nonfinite = op, declared_nonfinite
        self.col = Collector()
        self.n = 0
        self.per: dict[str, int] = {}
        self.notes: list[str] = []

    def file(self, name: str, count: int, findings: Callable[[], list]) -> None:
        """`count` violations of invariant `name`; `findings()` gives the first few (each a
        dict with `where`), asked for only when there is a violation and room to keep it."""
        if not count:
            return
        self.n += int(count)
        self.per[name] = self.per.get(name, 0) + int(count)
        self.col.count(FINDING_CLASS, int(count))
        kept = findings() if len(self.col.kept) < MAX_FINDINGS else []
        for f in kept:
            self.col.keep({"class": FINDING_CLASS, "invariant": name, **f,
                           "where": f"{name}: {f['where']}"})
        self.col.total += max(0, int(count) - len(kept))


# --- top-k -----------------------------------------------------------------------------

def _topk_shape(op, ins, scalars, actual, ctx) -> bool:
    idx, rows, k = actual.get("indices"), ins["lengths"].shape[0], int(scalars["k"])
    if isinstance(idx, torch.Tensor) and idx.dim() == 2 and tuple(idx.shape) == (rows, k) \
            and idx.dtype == torch.int32:
        return True
    got = (f"{getattr(idx, 'dtype', type(idx).__name__)} {list(getattr(idx, 'shape', []))}"
           if idx is not None else "nothing")
    ctx.file("topk_shape", 1, lambda: [{"output": "indices",
                                        "where": f"indices: expected int32 [{rows}, {k}], got {got}"}])
    return False


def _topk(op, ins, scalars, actual, ctx) -> None:
    """Each row: indices in [0, len) or -1, no repeats, -1 only as trailing padding, exactly
    min(k, len) indices that are not -1. Counted per index (range, repeats) and per row
    (padding, count), on the indices' device, a block of rows at a time."""
    if not _topk_shape(op, ins, scalars, actual, ctx):
        return
    idx = actual["indices"]
    dev = idx.device
    k = idx.shape[1]
    lens = ins["lengths"].to(dev).long()
    counts = {"topk_range": [], "topk_duplicates": [], "topk_padding": [], "topk_count": []}
    for r0, r1 in row_blocks(idx.shape[0], max(k, 1), 8):
        x = idx[r0:r1]
        ln = lens[r0:r1]
        pad = x == -1
        bad_range = (x < -1) | (x >= ln[:, None])          # -1 lies below every length >= 0
        srt = x.sort(1).values                             # padding first, then the indices
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != -1)
        n = k - pad.sum(1)                                 # indices that are not -1
        first_pad = torch.where(pad.any(1), pad.int().argmax(1), k)
        counts["topk_range"].append(bad_range.sum(1))
        counts["topk_duplicates"].append(dup.sum(1))
        counts["topk_padding"].append((first_pad < n).long())     # an index after a -1
        counts["topk_count"].append((n != ln.clamp(max=k)).long())
    per_row = {n: torch.cat(v).cpu() if v else torch.zeros(0, dtype=torch.long) for n, v in counts.items()}
    lens_c = lens.cpu()

    def row_text(r: int) -> str:
        row = idx[r].cpu().tolist()
        shown = row if len(row) <= 12 else row[:12] + ["..."]
        return f"row {r} (length {int(lens_c[r])}, k {k}): indices {shown}"

    def rows_of(name):
        bad = per_row[name].nonzero().flatten()[:MAX_FINDINGS]
        return lambda: [{"row": int(r), **detail(name, int(r)), "where": f"{row_text(int(r))}; {why(name, int(r))}"}
                        for r in bad.tolist()]

    def detail(name: str, r: int) -> dict:
        """The column and index of a range or repeat finding's first offender."""
        row = idx[r].cpu().long()
        ln = int(lens_c[r])
        if name == "topk_range":
            c = int(((row < -1) | (row >= ln)).nonzero()[0])
            return {"col": c, "index": int(row[c]), "length": ln}
        if name == "topk_duplicates":
            seen: set = set()
            for c, v in enumerate(row.tolist()):
                if v != -1 and v in seen:
                    return {"col": c, "index": v, "length": ln}
                seen.add(v)
        return {"length": ln}

    def why(name: str, r: int) -> str:
        row = idx[r].cpu().long()
        ln = int(lens_c[r])
        if name == "topk_range":
            cols = ((row != -1) & ((row < 0) | (row >= ln))).nonzero().flatten().tolist()
            return f"index {int(row[cols[0]])} at column {cols[0]} lies outside [0, {ln})" + \
                (f" (+{len(cols) - 1} more)" if len(cols) > 1 else "")
        if name == "topk_duplicates":
            v = row[row != -1]
            u, c = v.unique(return_counts=True)
            return f"index {int(u[c > 1][0])} appears {int(c[c > 1][0])} times"
        if name == "topk_padding":
            first = int((row == -1).nonzero()[0])
            return f"-1 at column {first} is followed by an index"
        return f"{int((row != -1).sum())} indices that are not -1, expected min(k, length) = {min(k, ln)}"

    for name in counts:
        ctx.file(name, int(per_row[name].sum()), rows_of(name))


# --- logits ------------------------------------------------------------------------------

def _logits(op, ins, scalars, actual, ctx) -> None:
    """With clean_logits, exactly -inf at and past each row's end (without it those columns
    are unspecified, NUMERICS.md §6); before the end, finite unless the case declares
    non-finite inputs."""
    lg, ends = actual.get("logits"), ins["row_ends"]
    if not isinstance(lg, torch.Tensor) or lg.dim() != 2 or lg.shape[0] != ends.shape[0] \
            or not lg.is_floating_point() or (ends.numel() and int(ends.max()) > lg.shape[1]):
        got = f"{getattr(lg, 'dtype', type(lg).__name__)} {list(getattr(lg, 'shape', []))}"
        ctx.file("logits_shape", 1, lambda: [{"output": "logits", "where": f"logits: expected a float "
                                              f"[{ends.shape[0]}, >= every row end], got {got}"}])
        return
    dev = lg.device
    cols = torch.arange(lg.shape[1], device=dev)
    e = ends.to(dev).long()
    clean = bool(scalars.get("clean_logits", False))
    past_n, fin_n = [], []
    if not clean and ctx.declared_nonfinite:
        return                                             # nothing is specified to check
    for r0, r1 in row_blocks(lg.shape[0], lg.shape[1], lg.element_size()):
        x = lg[r0:r1]
        before = cols[None, :] < e[r0:r1, None]
        if clean:                                          # bools: a > b is a & ~b
            past_n.append(((x != float("-inf")) > before).sum(1))
        if not ctx.declared_nonfinite:
            fin_n.append((before > torch.isfinite(x)).sum(1))

    def findings(per_row, mask_of, text):
        def make():
            out = []
            for r in per_row.nonzero().flatten()[:MAX_FINDINGS].tolist():
                m = mask_of(r)
                c = int(m.nonzero()[0])
                out.append({"row": r, "col": c, "actual": repr(float(lg[r, c])),
                            "where": f"row {r} column {c} (row end {int(e[r])}): {float(lg[r, c])!r} "
                                     f"{text}" + (f" (+{int(m.sum()) - 1} more in the row)" if int(m.sum()) > 1
                                                  else "")})
            return out
        return make

    if past_n:
        pr = torch.cat(past_n).cpu()
        ctx.file("logits_past_end", int(pr.sum()), findings(
            pr, lambda r: (cols >= e[r]) & (lg[r] != float("-inf")), "at or past the row's end, not -inf"))
    if fin_n:
        fr = torch.cat(fin_n).cpu()
        ctx.file("logits_finite", int(fr.sum()), findings(
            fr, lambda r: (cols < e[r]) & ~torch.isfinite(lg[r]), "before the row's end, not finite"))


# --- K pages -------------------------------------------------------------------------------

def _written(op, ins, scalars):
    """(the written slots, their source rows' indices into the op's per-token inputs)."""
    from reference.k_writer import writer_mask
    name = "kv_slot_mapping" if OPS[op].stage == "pool_k" else "slot_mapping"
    pos = ins["positions"]
    slots = ins[name].to(pos.device)
    sel = writer_mask(pos, slots, scalars["compress_ratio"])
    return slots[sel].long(), sel.nonzero().flatten()


def _geometry(op, ins, scalars):
    fmt = OPS[op].format
    d = ins["state_cache"].shape[-1] // 4 if OPS[op].stage == "pool_k" else ins["k"].shape[1]
    shuffle = None if fmt == "fp8" or OPS[op].stage == "pool_k" else layout.as_shuffle(scalars.get("shuffle"))
    return fmt, d, shuffle, int(scalars["page_size"])


def _pool_ok(op, ins, actual, ctx) -> bool:
    pool, before = actual.get("kv_cache"), ins["kv_cache"]
    if isinstance(pool, torch.Tensor) and pool.shape == before.shape and pool.dtype == before.dtype:
        return True
    got = f"{getattr(pool, 'dtype', type(pool).__name__)} {list(getattr(pool, 'shape', []))}"
    ctx.file("page_shape", 1, lambda: [{"output": "kv_cache", "where": f"kv_cache: expected "
                                        f"{before.dtype} {list(before.shape)} (the pool before the call), got {got}"}])
    return False


def _offsets(fmt, slots, page_size, d, shuffle, stride):
    if fmt == "mxfp4":
        return layout.slot_byte_offsets(slots, page_size, d, shuffle, stride)
    from reference.fp8 import fp8_slot_offsets
    return fp8_slot_offsets(slots, page_size, d, stride)


def _pages(op, ins, scalars, actual, ctx) -> None:
    """No byte outside the written slots changes (the pool before the call is the op's
    `kv_cache` input); every owned scale byte is a code the format defines."""
    if not _pool_ok(op, ins, actual, ctx):
        return
    fmt, d, shuffle, ps = _geometry(op, ins, scalars)
    pool = actual["kv_cache"]
    dev = pool.device
    before = ins["kv_cache"].to(dev)
    stride = pool.shape[1]
    slots, src = _written(op, ins, scalars)
    slots = slots.to(dev)
    keep = (slots >= 0) & (slots < pool.shape[0] * ps)
    slots, src = slots[keep], src.to(dev)[keep]
    uniq = torch.unique(slots)
    vo, so = _offsets(fmt, uniq, ps, d, shuffle, stride)
    owned = torch.cat((vo.flatten(), so.flatten())).sort().values
    fa, fb = pool.reshape(-1), before.reshape(-1)
    n_out, first = _outside_changes(fa, fb, owned)

    def outside():
        out = []
        for off in first.tolist():
            loc = (layout.locate(off, page_stride=stride, page_size=ps, head_dim=d, shuffle=shuffle)
                   if fmt == "mxfp4" else _fp8_locate(off, page_stride=stride, page_size=ps, head_dim=d))
            where = f"page {loc['page']}" + (f" entry {loc['entry']} (slot {loc['page'] * ps + loc['entry']})"
                                             if "entry" in loc else "") + f" {loc['kind']} byte"
            out.append({**loc, "offset": off, "before": hex_byte(fb[off]), "actual": hex_byte(fa[off]),
                        "where": f"{where} (pool byte {off}, owned by no written slot): "
                                 f"{hex_byte(fa[off])}, was {hex_byte(fb[off])}"})
        return out
    ctx.file("page_outside_owned", n_out, outside)
    # scale codes of the written entries (the last write of a slot written twice is the one kept)
    if not uniq.numel():
        return
    exempt = _exempt_rows(op, ins, ctx, src, slots)              # per written token: its inputs are non-finite
    if exempt is None:
        entry_exempt = torch.zeros_like(uniq, dtype=torch.bool)
    else:                                                        # a slot written twice keeps the later token's
        at = torch.searchsorted(uniq, slots)
        last = torch.full_like(uniq, -1).scatter_reduce_(0, at, torch.arange(slots.numel(), device=dev), "amax")
        entry_exempt = exempt[last]
    if fmt == "mxfp4":
        codes = fa[so].long()                                    # [n, D/32]
        lo, hi = CEIL_CODES if scalars.get("scale_rule", "ceil") == "ceil" else ANY_CODES
        bad = ((codes < lo) | (codes > hi)) & ~entry_exempt[:, None]

        def scale_findings():
            out = []
            for e, b in bad.nonzero()[:MAX_FINDINGS].tolist():
                s = int(uniq[e])
                out.append({"page": s // ps, "entry": s % ps, "slot": s, "block": b, "offset": int(so[e, b]),
                            "actual": hex_byte(codes[e, b]),
                            "where": f"page {s // ps} entry {s % ps} (slot {s}) scale block {b}: e8m0 "
                                     f"{hex_byte(codes[e, b])} outside [{lo}, {hi}]"
                                     + (" (255 is NaN)" if int(codes[e, b]) == E8M0_NAN else "")})
            return out
        ctx.file("scale_code", int(bad.sum()), scale_findings)
    else:
        sc = fa[so].contiguous().view(torch.float32).reshape(-1)     # [n]: little-endian fp32
        bad = ~(torch.isfinite(sc) & (sc > 0)) & ~entry_exempt

        def fp8_findings():
            out = []
            for e in bad.nonzero().flatten()[:MAX_FINDINGS].tolist():
                s = int(uniq[e])
                out.append({"page": s // ps, "entry": s % ps, "slot": s, "offset": int(so[e, 0]),
                            "actual": repr(float(sc[e])),
                            "where": f"page {s // ps} entry {s % ps} (slot {s}) fp32 scale {float(sc[e])!r}: "
                                     "not a finite positive scale"})
            return out
        ctx.file("scale_code", int(bad.sum()), fp8_findings)


def _nonfinite(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())


def _exempt_rows(op, ins, ctx, src, slots) -> Optional[torch.Tensor]:
    """Where the case declares non-finite inputs: per written token, whether its scale may be
    any byte (a non-finite input row; every row where another input the row reads, or the
    fused op's state cache, holds one). None: nothing is exempt."""
    if not ctx.declared_nonfinite:
        return None
    dev = slots.device
    shared = [n for n in ("norm_weight", "cos_sin_cache", "state_cache") if _nonfinite(ins.get(n))]
    if shared or "k" not in ins:
        if shared:
            ctx.notes.append(f"scale codes not checked: non-finite {', '.join(shared)} reach every entry")
        return torch.ones(slots.numel(), dtype=torch.bool, device=dev)
    k = ins["k"].to(dev)
    return ~torch.isfinite(k[src].float()).all(1)


# --- Q scales ------------------------------------------------------------------------------

def _q_scales(op, ins, scalars, actual, ctx) -> None:
    """Every q scale byte (MXFP4) is a code the format defines; a (token, head) whose q
    holds a non-finite value is exempt where the case declares non-finite inputs. The FP8
    Q quant folds its scale into the weights: nothing to check."""
    qs = actual.get("q_scale")
    if OPS[op].format != "mxfp4" or not isinstance(qs, torch.Tensor) or qs.dtype != torch.uint8:
        return
    codes = qs.long()
    lo, hi = CEIL_CODES if scalars.get("scale_rule", "ceil") == "ceil" else ANY_CODES
    bad = (codes < lo) | (codes > hi)
    if ctx.declared_nonfinite:
        q = ins["q"].to(qs.device)
        if _nonfinite(ins.get("cos_sin_cache")):
            bad = torch.zeros_like(bad)
        elif q.shape[:-1] == qs.shape[:-1]:
            bad &= torch.isfinite(q.float()).all(-1, keepdim=True)

    def findings():
        out = []
        for pos in bad.nonzero()[:MAX_FINDINGS].tolist():
            c = int(codes[tuple(pos)])
            out.append({"index": pos, "actual": hex_byte(c),
                        "where": f"q_scale{pos} (token {pos[0]}" + (f", head {pos[1]}" if len(pos) > 2 else "")
                                 + f", block {pos[-1]}): e8m0 {hex_byte(c)} outside [{lo}, {hi}]"
                                 + (" (255 is NaN)" if c == E8M0_NAN else "")})
        return out
    ctx.file("scale_code", int(bad.sum()), findings)


# --- the table ------------------------------------------------------------------------------

INVARIANTS: tuple[Invariant, ...] = (
    Invariant("topk", ("topk",), "indices: int32 [rows, k] (topk_shape); each index in [0, row length) or "
              "-1 (topk_range); no index twice in a row (topk_duplicates); -1 only as trailing padding "
              "(topk_padding); exactly min(k, row length) indices that are not -1 (topk_count)", _topk),
    Invariant("logits", ("scorer",), "a float [rows, >= every row end] (logits_shape); with clean_logits, "
              "exactly -inf at and past each row's end (logits_past_end); finite before it, unless the case "
              "declares non-finite inputs (logits_finite)", _logits),
    Invariant("pages", ("k_writer", "pool_k"), "the pool keeps its shape and dtype (page_shape); no byte "
              "outside the written slots changes from the pool before the call (page_outside_owned); every "
              "written scale is a code the format defines: e8m0 in [1, 253] under the ceil rule ([0, 254] "
              "under another), an FP8 entry's fp32 scale finite and > 0 (scale_code); a written entry whose "
              "input row is non-finite is exempt from scale_code in a case that declares non-finite inputs",
              _pages),
    Invariant("q_scales", ("q_quant",), "every MXFP4 q scale byte a code the format defines, as for pages "
              "(scale_code); a (token, head) with a non-finite q exempt in a case that declares non-finite "
              "inputs", _q_scales),
)
# The checks each invariant files findings under (the `invariant` field of a finding).
CHECKS: tuple[str, ...] = ("topk_shape", "topk_range", "topk_duplicates", "topk_padding", "topk_count",
                           "logits_shape", "logits_past_end", "logits_finite", "page_shape",
                           "page_outside_owned", "scale_code")


def applies(op: str) -> tuple[Invariant, ...]:
    """The invariants of op `op` (those of its own stage)."""
    return tuple(i for i in INVARIANTS if OPS[op].stage in i.stages)


def check(op: str, inputs: dict, scalars: dict, actual: dict, *, declared_nonfinite: bool = False) -> DiffReport:
    """Every invariant of `op` on a backend's `actual` outputs and the `inputs` that produced
    them: a DiffReport with `invariant_violations` (0 when every invariant holds; absent for
    an op without invariants, pooling) and one finding of class `invariant` per violation
    kept (its `invariant` names the check)."""
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r} (known: {', '.join(OPS)})")
    ctx = _Ctx(op, declared_nonfinite)
    invs = applies(op)
    if isinstance(actual, dict):
        for inv in invs:
            inv.check(op, inputs, scalars, actual, ctx)
    notes = ctx.notes + ([f"invariants broken: {', '.join(f'{n} {c}' for n, c in ctx.per.items())}"]
                         if ctx.per else [])
    return ctx.col.report(op, {METRIC: float(ctx.n)} if invs else {}, notes)


def merge(report: DiffReport, inv: DiffReport) -> DiffReport:
    """A stage's diff report with its invariants' metrics, findings and notes. The findings
    alternate (the diff's first), so that a report row's first few show both kinds."""
    metrics = {**report.metrics, **inv.metrics}
    a, b = list(report.findings), list(inv.findings)
    findings = [f for pair in zip(a, b) for f in pair] + a[len(b):] + b[len(a):]
    return DiffReport(report.op, metrics, findings, list(report.notes) + list(inv.notes), report.rows)


__all__ = ["CHECKS", "FINDING_CLASS", "INVARIANTS", "METRIC", "Invariant", "applies", "check", "merge"]
