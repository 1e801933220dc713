"""The diff engine: classified, localized differences between two outputs of an indexer op.

A small public API (also for other projects' pytest tests):

    from harness.diff import diff_pages, diff_pooled, diff_q, diff_logits, diff_topk, diff_op
    rep = diff_pages(actual, expected, before, page_size=64, head_dim=128,
                     shuffle=[32, 16, 2], written_slots=slots)
    rep.raise_if_failed({"page_bytes_mismatched": 0})   # AssertionError with the summary

Every function returns a `DiffReport`: `metrics` (name -> float; the class count of each
finding class is a metric too, `class_<name>`), `findings` (the first MAX_FINDINGS, each a
dict with a `class` and a human `where`), `notes`.

Budgets: a metric passes when `value <= budget`, except the metrics where larger is better
(named `*_min`, or listed in HIGHER_IS_BETTER), which pass when `value >= budget`. A metric
without a budget is not judged, except those in ALWAYS_FAIL (non-finite inputs or outputs,
missing or misshapen outputs), which fail whenever they are non-zero: never a silent pass.

Finding classes (the unit each one counts is in brackets):
  pages and Q (MXFP4): signed_zero (0x0 vs 0x8 nibble) [byte], one_step (codes adjacent on the
  e2m1 line, +-0 counting as one point) [byte], nibbles_swapped (actual = expected with its
  nibbles exchanged) [byte], value_other [byte], scale_off_by_k (e8m0 differs by k; `values`
  says whether the block's codes are equal, consistent with the other scale, or not) [scale
  block], scale_interleave (same multiset of scale bytes in an entry, wrong positions) [entry],
  not_written (every owned byte still holds its old value) [entry], outside_owned_write (a
  byte no written slot owns changed) [byte]. A byte with two differing nibbles takes the worse
  class (value_other > one_step > signed_zero). Value bytes of a block whose scale differs
  and whose codes are consistent with that scale are counted in the metrics but filed under
  the scale finding. FP8 pages and Q: the same names; scale_other when a scale is not a
  power-of-two multiple of the expected one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from reference import layout
from reference.mxfp4 import MX_BLOCK, dequantize_mxfp4, e8m0_to_float

MAX_FINDINGS = 50
HIGHER_IS_BETTER = frozenset({"topk_recall_min", "topk_jaccard_min"})
ALWAYS_FAIL = ("nonfinite_inputs", "pooled_nonfinite", "logits_nonfinite", "outputs_missing",
               "outputs_bad_shape", "op_unsupported")


def higher_is_better(metric: str) -> bool:
    return metric.endswith("_min") or metric in HIGHER_IS_BETTER


@dataclass
class DiffReport:
    op: str
    metrics: dict[str, float] = field(default_factory=dict)
    findings: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def failures(self, budgets: dict[str, float]) -> list[tuple[str, float, Optional[float]]]:
        """(metric, value, budget) of every metric that fails; budget None for ALWAYS_FAIL."""
        out = []
        for m in ALWAYS_FAIL:
            v = self.metrics.get(m, 0)
            if v != 0:
                out.append((m, v, None))
        for m, b in budgets.items():
            if m not in self.metrics or m in ALWAYS_FAIL:
                continue
            v = float(self.metrics[m])
            good = (v >= b) if higher_is_better(m) else (v <= b)
            if not good or math.isnan(v):
                out.append((m, v, b))
        return out

    def ok(self, budgets: dict[str, float]) -> bool:
        return not self.failures(budgets)

    def summary(self, budgets: Optional[dict[str, float]] = None, max_findings: int = 8) -> str:
        lines = []
        if budgets is not None:
            bad = self.failures(budgets)
            lines.append(f"{self.op}: {'OK' if not bad else 'FAIL'}")
            for m, v, b in bad:
                rule = "must be 0" if b is None else (f">= {b:g}" if higher_is_better(m) else f"<= {b:g}")
                lines.append(f"  {m} = {v:g} ({rule})")
        else:
            lines.append(f"{self.op}:")
        shown = {k: v for k, v in self.metrics.items() if v != 0 or higher_is_better(k)}
        if shown:
            lines.append("  " + ", ".join(f"{k}={_fmt_num(v)}" for k, v in shown.items()))
        for f in self.findings[:max_findings]:
            lines.append(f"  [{f['class']}] {f['where']}")
        if len(self.findings) > max_findings:
            lines.append(f"  ... {len(self.findings) - max_findings} more findings listed")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def raise_if_failed(self, budgets: dict[str, float]) -> None:
        if not self.ok(budgets):
            raise AssertionError(self.summary(budgets))


def _fmt_num(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) and not float(v).is_integer() else f"{v:g}"


class _Collector:
    """Findings in order, the first MAX_FINDINGS kept, every class counted."""

    def __init__(self):
        self.kept: list[dict] = []
        self.counts: dict[str, int] = {}
        self.total = 0

    def count(self, cls: str, n: int = 1) -> None:
        if n:
            self.counts[cls] = self.counts.get(cls, 0) + int(n)

    def keep(self, finding: dict) -> bool:
        self.total += 1
        if len(self.kept) < MAX_FINDINGS:
            self.kept.append(finding)
            return True
        return False

    def report(self, op: str, metrics: dict, notes: Optional[list] = None) -> DiffReport:
        notes = list(notes or [])
        for cls, n in sorted(self.counts.items()):
            metrics[f"class_{cls}"] = float(n)
        self.total = max(self.total, sum(self.counts.values()))
        if self.total > len(self.kept):
            notes.append(f"{self.total} findings, the first {len(self.kept)} listed")
        return DiffReport(op, {k: float(v) for k, v in metrics.items()}, self.kept, notes)


def _hex(v: int) -> str:
    return f"0x{int(v):02x}"


# --- MXFP4 entries: the shared classifier of pages and Q ---------------------------------

# class codes of one value byte, ordered by severity (a byte takes its worse nibble)
_NONE, _SZ, _ONE, _SWAP, _OTHER = 0, 1, 2, 3, 4
_BYTE_CLASS = {_SZ: "signed_zero", _ONE: "one_step", _SWAP: "nibbles_swapped", _OTHER: "value_other"}
_NIB_NAME = {_NONE: "equal", _SZ: "signed_zero", _ONE: "one_step", _OTHER: "other"}


def _nibble_class(a: torch.Tensor, e: torch.Tensor, sign_bit: int = 8) -> torch.Tensor:
    mag = sign_bit - 1
    a, e = a.long(), e.long()
    pa = torch.where(a & sign_bit > 0, -(a & mag), a & mag)     # position on the code line, +-0 one point
    pe = torch.where(e & sign_bit > 0, -(e & mag), e & mag)
    cls = torch.full_like(a, _OTHER)
    cls[(pa - pe).abs() == 1] = _ONE
    cls[((a & mag) == 0) & ((e & mag) == 0)] = _SZ
    cls[a == e] = _NONE
    return cls


def _byte_class(a: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """u8 value bytes -> (byte class, low nibble class, high nibble class)."""
    a, e = a.long(), e.long()
    lo = _nibble_class(a & 0xF, e & 0xF)
    hi = _nibble_class(a >> 4, e >> 4)
    cls = torch.maximum(lo, hi)
    swapped = (a == (((e & 0xF) << 4) | (e >> 4))) & (a != e)
    return torch.where(swapped, torch.full_like(cls, _SWAP), cls), lo, hi


@dataclass
class _EntryDiff:
    """Mismatches of n MXFP4 entries (values [n, TB], scales [n, NB])."""
    value_mismatch: torch.Tensor       # bool [n, TB]
    scale_mismatch: torch.Tensor       # bool [n, NB]
    entry_mismatch: torch.Tensor       # bool [n]
    not_written: torch.Tensor          # bool [n]
    interleave: torch.Tensor           # bool [n]
    scale_k: torch.Tensor              # int [n, NB] actual - expected e8m0
    block_values: torch.Tensor         # int [n, NB]: 0 codes equal, 1 consistent, 2 not
    value_class: torch.Tensor          # int [n, TB] (_NONE where filed under a scale finding)
    lo: torch.Tensor
    hi: torch.Tensor
    abs_err: float
    rel_err: float


_BLOCK_VALUES = ("codes_equal", "consistent", "inconsistent")
_VALUES_TEXT = {"codes_equal": "are equal", "consistent": "are consistent with the actual scale",
                "inconsistent": "differ too"}


def _compare_mxfp4(av, ev, asc, esc, bv=None, bsc=None) -> _EntryDiff:
    n, tb = av.shape
    nb = asc.shape[1]
    vm, sm = av != ev, asc != esc
    em = vm.any(1) | sm.any(1)
    if bv is not None:
        nw = em & (av == bv).all(1) & (asc == bsc).all(1)
    else:
        nw = torch.zeros(n, dtype=torch.bool, device=av.device)
    il = sm.any(1) & (asc.sort(1).values == esc.sort(1).values).all(1) & ~nw
    k = asc.long() - esc.long()
    # per block: are the codes equal, or consistent with the actual scale?
    blk_codes_equal = ~vm.view(n, nb, tb // nb).any(-1)
    a_deq = dequantize_mxfp4(av, asc, torch.float64).view(n, nb, MX_BLOCK)
    e_deq = dequantize_mxfp4(ev, esc, torch.float64).view(n, nb, MX_BLOCK)
    coarse = e8m0_to_float(torch.maximum(asc, esc), torch.float64)
    blk_err = (a_deq - e_deq).abs().amax(-1)
    consistent = blk_err <= coarse                          # within one unit of the coarser scale
    block_values = torch.where(blk_codes_equal, 0, torch.where(consistent, 1, 2))
    cls, lo, hi = _byte_class(av, ev)
    cls = torch.where(vm, cls, torch.zeros_like(cls))
    # bytes of a block that a scale finding explains are not classified again
    filed = (sm & (block_values == 1) & ~il[:, None]) | nw[:, None]
    cls = torch.where(filed.repeat_interleave(tb // nb, dim=1), torch.zeros_like(cls), cls)
    abs_err, rel_err = 0.0, 0.0
    if bool(em.any()):
        d = (a_deq - e_deq)[em].flatten(1).abs()
        d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
        ref = e_deq[em].flatten(1).abs().amax(1, keepdim=True)
        abs_err = float(d.max())
        rel = torch.where(ref > 0, d / ref.clamp_min(1e-300), torch.where(d > 0, math.inf, 0.0))
        rel_err = float(rel.max())
    return _EntryDiff(vm, sm, em, nw, il, k, block_values, cls, lo, hi, abs_err, rel_err)


def _entry_units(ed: _EntryDiff):
    """All finding units of an entry diff as rows (entry, kind, pos, class name), ordered by
    entry then kind, plus class counts. kind: 0 entry-level, 1 scale block, 2 value byte."""
    counts: dict[str, int] = {}
    n_nw, n_il = int(ed.not_written.sum()), int(ed.interleave.sum())
    counts["not_written"] = n_nw
    counts["scale_interleave"] = n_il
    sblk = ed.scale_mismatch & ~ed.interleave[:, None] & ~ed.not_written[:, None]
    counts["scale_off_by_k"] = int(sblk.sum())
    for code, name in _BYTE_CLASS.items():
        counts[name] = int((ed.value_class == code).sum())
    ent = (ed.not_written | ed.interleave).nonzero().flatten()
    e_units = torch.stack((ent, torch.zeros_like(ent), torch.zeros_like(ent)), 1).reshape(-1, 3)
    s_idx = sblk.nonzero()
    s_units = torch.stack((s_idx[:, 0], torch.ones_like(s_idx[:, 0]), s_idx[:, 1]), 1)
    v_idx = (ed.value_class > 0).nonzero()
    v_units = torch.stack((v_idx[:, 0], torch.full_like(v_idx[:, 0], 2), v_idx[:, 1]), 1)
    units = torch.cat((e_units, s_units, v_units)).long()
    if units.numel():
        key = units[:, 0] * 4_000_000 + units[:, 1] * 1_000_000 + units[:, 2]
        units = units[key.argsort()]
    return units, {k: v for k, v in counts.items() if v}


def _unit_finding(ed: _EntryDiff, unit, av, ev, asc, esc) -> dict:
    """The structured part of one unit's finding (location in the entry, bytes, class)."""
    i, kind, pos = (int(x) for x in unit)
    if kind == 0:
        if bool(ed.not_written[i]):
            return {"class": "not_written", "kind": "entry",
                    "detail": "every owned byte still holds its value from before the call"}
        return {"class": "scale_interleave", "kind": "scale",
                "expected": [_hex(x) for x in esc[i].tolist()], "actual": [_hex(x) for x in asc[i].tolist()],
                "detail": f"scale bytes {[_hex(x) for x in asc[i].tolist()]}, expected "
                          f"{[_hex(x) for x in esc[i].tolist()]} (same bytes, other positions)"}
    if kind == 1:
        k = int(ed.scale_k[i, pos])
        vals = _BLOCK_VALUES[int(ed.block_values[i, pos])]
        return {"class": "scale_off_by_k", "kind": "scale", "block": pos, "k": k, "values": vals,
                "expected": _hex(esc[i, pos]), "actual": _hex(asc[i, pos]),
                "detail": f"scale block {pos}: e8m0 {_hex(asc[i, pos])}, expected {_hex(esc[i, pos])} "
                          f"(k={k:+d}; the block's codes {_VALUES_TEXT[vals]})"}
    cls = _BYTE_CLASS[int(ed.value_class[i, pos])]
    nib = [_NIB_NAME[int(ed.lo[i, pos])], _NIB_NAME[int(ed.hi[i, pos])]]
    return {"class": cls, "kind": "value", "byte": pos, "elements": [2 * pos, 2 * pos + 1],
            "block": (2 * pos) // MX_BLOCK, "expected": _hex(ev[i, pos]), "actual": _hex(av[i, pos]),
            "nibbles": nib,
            "detail": f"value byte {pos} (elements {2 * pos},{2 * pos + 1}, block {(2 * pos) // MX_BLOCK}): "
                      f"{_hex(av[i, pos])}, expected {_hex(ev[i, pos])} (low nibble {nib[0]}, high {nib[1]})"}


# --- pages ---------------------------------------------------------------------------------

def _fp8_offsets(slots, page_size, head_dim, stride):
    from reference.fp8 import fp8_slot_offsets
    return fp8_slot_offsets(slots, page_size, head_dim, stride)


def _fp8_locate(offset: int, *, page_stride: int, page_size: int, head_dim: int) -> dict:
    page, off = divmod(int(offset), page_stride)
    if off < page_size * head_dim:
        return {"page": page, "kind": "value", "entry": off // head_dim, "byte": off % head_dim}
    off2 = off - page_size * head_dim
    if off2 < page_size * 4:
        return {"page": page, "kind": "scale", "entry": off2 // 4, "byte": off2 % 4}
    return {"page": page, "kind": "padding", "offset": off}


def _where(loc: dict) -> str:
    s = f"page {loc['page']}"
    if loc.get("kind") == "padding":
        return s + f" padding byte {loc['offset']}"
    if "entry" in loc:
        s += f" entry {loc['entry']}"
        if "slot" in loc:
            s += f" (slot {loc['slot']})"
    return s


def _check_pool(name, t, like=None):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
        raise ValueError(f"{name}: expected a u8 pool [P, page_bytes], got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
    if like is not None and t.shape != like.shape:
        raise ValueError(f"{name}: shape {list(t.shape)} differs from expected {list(like.shape)}")


def diff_pages(actual: torch.Tensor, expected: torch.Tensor, before: Optional[torch.Tensor], *,
               page_size: int, head_dim: int, shuffle, written_slots: torch.Tensor,
               fmt: str = "mxfp4", fp8_dtype: str = "e4m3fn", op: Optional[str] = None) -> DiffReport:
    """Compare two K-cache pools [P, page_bytes] u8 after a writer wrote `written_slots`.

    Metrics: page_bytes_mismatched (all bytes, = value + scale + outside-owned mismatches),
    page_value_bytes_mismatched / page_scale_bytes_mismatched (owned bytes of the written
    slots), page_bytes_outside_owned_changed (bytes no written slot owns that differ from
    `before` in `actual`; from `expected` when `before` is None), page_entries_mismatched,
    page_dequant_max_abs_err, page_dequant_max_rel_err (relative to the entry's max |expected|)."""
    if fmt not in ("mxfp4", "fp8"):
        raise ValueError(f"fmt: expected 'mxfp4' or 'fp8', got {fmt!r}")
    _check_pool("expected", expected)
    _check_pool("actual", actual, expected)
    if before is not None:
        _check_pool("before", before, expected)
    op = op or ("k_norm_rope_mxfp4_cache" if fmt == "mxfp4" else "k_norm_rope_fp8_cache")
    dev = expected.device            # a pool of GiBs is compared where it lives
    actual = actual.to(dev)
    before = before.to(dev) if before is not None else None
    stride = expected.shape[1]
    slots = torch.unique(written_slots.to(dev).long())
    slots = slots[slots >= 0]
    if slots.numel() and int(slots[-1]) >= expected.shape[0] * page_size:
        raise ValueError(f"written_slots: slot {int(slots[-1])} is past the pool's "
                         f"{expected.shape[0] * page_size} slots")
    shuffle = layout.as_shuffle(shuffle) if fmt == "mxfp4" else None
    if fmt == "mxfp4":
        vo, so = layout.slot_byte_offsets(slots, page_size, head_dim, shuffle, stride)
    else:
        vo, so = _fp8_offsets(slots, page_size, head_dim, stride)
    fa, fe = actual.reshape(-1), expected.reshape(-1)
    fb = before.reshape(-1) if before is not None else None
    owned = torch.zeros(fa.numel(), dtype=torch.bool, device=dev)
    owned[vo.flatten()] = True
    owned[so.flatten()] = True
    av, ev, asc, esc = fa[vo], fe[vo], fa[so], fe[so]
    bv, bsc = (fb[vo], fb[so]) if fb is not None else (None, None)
    col = _Collector()
    if fmt == "mxfp4":
        ed = _compare_mxfp4(av, ev, asc, esc, bv, bsc)
        units, counts = _entry_units(ed)
        value_mm, scale_mm, entries_mm = int(ed.value_mismatch.sum()), int(ed.scale_mismatch.sum()), \
            int(ed.entry_mismatch.sum())
        abs_err, rel_err = ed.abs_err, ed.rel_err
    else:
        ed, units, counts, abs_err, rel_err = _compare_fp8(av, ev, asc, esc, bv, bsc, fp8_dtype)
        value_mm, scale_mm = int((av != ev).sum()), int((asc != esc).sum())
        entries_mm = int(((av != ev).any(1) | (asc != esc).any(1)).sum())
    # bytes outside the written slots
    ref_out = fb if fb is not None else fe
    outside = ((fa != ref_out) & ~owned).nonzero().flatten()
    for cls, n in counts.items():
        col.count(cls, n)
    col.count("outside_owned_write", outside.numel())
    # order every unit by pool offset, keep the first MAX_FINDINGS
    n_units = units.shape[0]
    if n_units:
        i_, k_, p_ = units[:, 0], units[:, 1], units[:, 2]
        unit_off = torch.where(k_ == 2, vo[i_, p_.clamp(max=vo.shape[1] - 1)],
                               torch.where(k_ == 1, so[i_, p_.clamp(max=so.shape[1] - 1)], vo[i_, 0]))
        keys = torch.cat((unit_off * 4 + k_, outside * 4 + 3))
    else:
        unit_off = torch.zeros(0, dtype=torch.long, device=dev)
        keys = outside * 4 + 3
    for j in keys.argsort()[:MAX_FINDINGS].tolist():
        if j < n_units:
            u = units[j]
            i = int(u[0])
            slot = int(slots[i])
            loc = {"page": slot // page_size, "entry": slot % page_size, "slot": slot}
            f = (_unit_finding if fmt == "mxfp4" else _fp8_unit_finding)(ed, u, av, ev, asc, esc)
            f = {**loc, **f, "offset": int(unit_off[j])}
            f["where"] = f"{_where(loc)} {f.pop('detail')}"
        else:
            off = int(outside[j - n_units])
            if fmt == "mxfp4":
                loc = layout.locate(off, page_stride=stride, page_size=page_size, head_dim=head_dim,
                                    shuffle=shuffle)
            else:
                loc = _fp8_locate(off, page_stride=stride, page_size=page_size, head_dim=head_dim)
            if "entry" in loc:
                loc["slot"] = loc["page"] * page_size + loc["entry"]
            part = (f" value byte {loc['byte']}" if loc["kind"] == "value" and "byte" in loc else
                    f" scale block {loc['block']}" if loc["kind"] == "scale" and "block" in loc else
                    f" scale byte {loc['byte']}" if loc["kind"] == "scale" else "")
            was = _hex(ref_out[off])
            f = {"class": "outside_owned_write", **loc, "offset": off, "expected": was,
                 "actual": _hex(fa[off]),
                 "where": f"{_where(loc)}{part} (pool byte {off}, not owned by any written slot): "
                          f"{_hex(fa[off])}, was {was}"}
        col.keep(f)
    metrics = {
        "page_bytes_mismatched": int((fa != fe).sum()),
        "page_value_bytes_mismatched": value_mm,
        "page_scale_bytes_mismatched": scale_mm,
        "page_bytes_outside_owned_changed": outside.numel(),
        "page_entries_mismatched": entries_mm,
        "page_dequant_max_abs_err": abs_err,
        "page_dequant_max_rel_err": rel_err,
    }
    notes = [] if before is not None else ["no `before` pool: outside-owned bytes compared with expected"]
    return col.report(op, metrics, notes)


# --- FP8 entries ---------------------------------------------------------------------------

def _compare_fp8(av, ev, asc, esc, bv, bsc, fp8_dtype):
    from reference.fp8 import dequantize_fp8
    n = av.shape[0]
    vm, sm = av != ev, asc != esc
    em = vm.any(1) | sm.any(1)
    nw = em & (av == bv).all(1) & (asc == bsc).all(1) if bv is not None else \
        torch.zeros(n, dtype=torch.bool, device=av.device)
    sa = asc.contiguous().view(torch.float32).reshape(n).double()
    se = esc.contiguous().view(torch.float32).reshape(n).double()
    ratio = sa / se
    k = torch.where((sa > 0) & (se > 0), torch.log2(ratio), torch.full_like(ratio, math.nan))
    pow2 = torch.isfinite(k) & (k == k.round())
    cls = _nibble_class(av.long(), ev.long(), sign_bit=0x80)
    cls = torch.where(vm & ~nw[:, None], cls, torch.zeros_like(cls))
    counts = {"not_written": int(nw.sum())}
    s_bad = sm.any(1) & ~nw
    counts["scale_off_by_k"] = int((s_bad & pow2).sum())
    counts["scale_other"] = int((s_bad & ~pow2).sum())
    for code, name in ((_SZ, "signed_zero"), (_ONE, "one_step"), (_OTHER, "value_other")):
        counts[name] = int((cls == code).sum())
    ent = nw.nonzero().flatten()
    sidx = s_bad.nonzero().flatten()
    vidx = (cls > 0).nonzero()
    units = torch.cat((torch.stack((ent, torch.zeros_like(ent), torch.zeros_like(ent)), 1),
                       torch.stack((sidx, torch.ones_like(sidx), torch.zeros_like(sidx)), 1),
                       torch.stack((vidx[:, 0], torch.full_like(vidx[:, 0], 2), vidx[:, 1]), 1))).long()
    if units.numel():
        units = units[(units[:, 0] * 4_000_000 + units[:, 1] * 1_000_000 + units[:, 2]).argsort()]
    abs_err = rel_err = 0.0
    if bool(em.any()):
        a = dequantize_fp8(av[em], fp8_dtype) * sa[em, None]
        e = dequantize_fp8(ev[em], fp8_dtype) * se[em, None]
        d = (a - e).abs()
        d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
        ref = e.abs().amax(1, keepdim=True)
        abs_err = float(d.max())
        rel_err = float(torch.where(ref > 0, d / ref.clamp_min(1e-300), torch.where(d > 0, math.inf, 0.0)).max())
    ed = {"nw": nw, "cls": cls, "k": k, "pow2": pow2, "sa": sa, "se": se}
    return ed, units, {c: v for c, v in counts.items() if v}, abs_err, rel_err


def _fp8_unit_finding(ed, unit, av, ev, asc, esc) -> dict:
    i, kind, pos = (int(x) for x in unit)
    if kind == 0:
        return {"class": "not_written", "kind": "entry",
                "detail": "every owned byte still holds its value from before the call"}
    if kind == 1:
        sa, se = float(ed["sa"][i]), float(ed["se"][i])
        if bool(ed["pow2"][i]):
            k = int(ed["k"][i])
            return {"class": "scale_off_by_k", "kind": "scale", "k": k, "expected": se, "actual": sa,
                    "detail": f"fp32 scale {sa:g}, expected {se:g} (k={k:+d})"}
        return {"class": "scale_other", "kind": "scale", "expected": se, "actual": sa,
                "detail": f"fp32 scale {sa:g}, expected {se:g}"}
    cls = {_SZ: "signed_zero", _ONE: "one_step", _OTHER: "value_other"}[int(ed["cls"][i, pos])]
    return {"class": cls, "kind": "value", "byte": pos, "elements": [pos],
            "expected": _hex(ev[i, pos]), "actual": _hex(av[i, pos]),
            "detail": f"value byte {pos}: {_hex(av[i, pos])}, expected {_hex(ev[i, pos])}"}


# --- pooled rows ---------------------------------------------------------------------------

def _ordered(bits: torch.Tensor, sign_mask: int) -> torch.Tensor:
    """Sign-magnitude float bits -> integers in numeric order (+0 and -0 both map to 0)."""
    b = bits.long()
    mag = b & (sign_mask - 1)
    return torch.where((b & sign_mask) != 0, -mag, mag)


def _bf16_ulps(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return (_ordered(a.contiguous().view(torch.int16).long() & 0xFFFF, 0x8000)
            - _ordered(e.contiguous().view(torch.int16).long() & 0xFFFF, 0x8000)).abs()


def _f32_ulps(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return (_ordered(a.contiguous().view(torch.int32).long() & 0xFFFFFFFF, 0x80000000)
            - _ordered(e.contiguous().view(torch.int32).long() & 0xFFFFFFFF, 0x80000000)).abs()


def diff_pooled(actual: torch.Tensor, expected: torch.Tensor, rows, *,
                op: str = "compress_pool") -> DiffReport:
    """Pooled bf16 rows [T, D]; only `rows` (bool mask [T] or indices) are compared.
    Metrics: pooled_max_ulp (bf16 ulps; +0 and -0 are 0 ulps apart), pooled_values_differing
    (bit patterns differ), pooled_rows_differing, pooled_nonfinite (NaN/inf in a compared
    row of either side: never a pass)."""
    if actual.shape != expected.shape:
        raise ValueError(f"actual: shape {list(actual.shape)} differs from expected {list(expected.shape)}")
    a, e = actual.cpu().to(torch.bfloat16), expected.cpu().to(torch.bfloat16)
    rows = torch.as_tensor(rows).cpu()
    idx = rows.nonzero().flatten() if rows.dtype == torch.bool else rows.long().flatten()
    a, e = a[idx], e[idx]
    fin = torch.isfinite(a.float()) & torch.isfinite(e.float())
    ulp = torch.where(fin, _bf16_ulps(a, e), torch.zeros((), dtype=torch.long))
    differ = a.view(torch.int16) != e.view(torch.int16)
    col = _Collector()
    row_bad = differ.any(1) | ~fin.all(1)
    for r in row_bad.nonzero().flatten().tolist():
        nf = int((~fin[r]).sum())
        mu = int(ulp[r].max())
        cls = "nonfinite" if nf else ("signed_zero" if mu == 0 else "one_ulp" if mu == 1 else "multi_ulp")
        col.count(cls)
        if len(col.kept) < MAX_FINDINGS:
            c = int((ulp[r] + (~fin[r]).long() * (1 << 40) + differ[r].long()).argmax())
            col.keep({"class": cls, "row": int(idx[r]), "channel": c, "max_ulp": mu,
                      "values_differing": int(differ[r].sum()), "nonfinite": nf,
                      "expected": float(e[r, c]), "actual": float(a[r, c]),
                      "where": f"row {int(idx[r])} channel {c}: {float(a[r, c])!r}, expected "
                               f"{float(e[r, c])!r} ({mu} ulp max, {int(differ[r].sum())} values "
                               f"differ{f', {nf} non-finite' if nf else ''})"})
        else:
            col.total += 1
    metrics = {"pooled_max_ulp": int(ulp.max()) if ulp.numel() else 0,
               "pooled_values_differing": int(differ.sum()),
               "pooled_rows_differing": int(row_bad.sum()),
               "pooled_rows_compared": int(idx.numel()),
               "pooled_nonfinite": int((~fin).sum())}
    return col.report(op, metrics)


# --- Q -----------------------------------------------------------------------------------

def diff_q(actual: dict, expected: dict, *, op: Optional[str] = None) -> DiffReport:
    """Q quant outputs: MXFP4 (q_fp4 [T,H,D/2], q_scale [T,H,D/32], weights) or FP8 (q_fp8
    [T,H,D], weights). Metrics: q_bytes_mismatched, q_scale_bytes_mismatched,
    weights_max_ulp (fp32 ulps), weights_differing; findings per (token, head, byte)."""
    fp8 = "q_fp8" in expected
    op = op or ("q_rope_fp8_quant" if fp8 else "q_rope_mxfp4_quant")
    col = _Collector()
    vkey = "q_fp8" if fp8 else "q_fp4"
    for key in (vkey, "weights") + (() if fp8 else ("q_scale",)):
        if key not in actual or key not in expected:
            raise ValueError(f"{key}: missing from {'actual' if key not in actual else 'expected'}")
        if actual[key].shape != expected[key].shape:
            raise ValueError(f"actual {key}: shape {list(actual[key].shape)} differs from expected "
                             f"{list(expected[key].shape)}")
    t, h = expected[vkey].shape[:2]
    av, ev = actual[vkey].cpu().reshape(t * h, -1), expected[vkey].cpu().reshape(t * h, -1)
    if fp8:
        cls = _nibble_class(av.long(), ev.long(), sign_bit=0x80)
        cls = torch.where(av != ev, cls, torch.zeros_like(cls))
        names = {_SZ: "signed_zero", _ONE: "one_step", _OTHER: "value_other"}
        for code, name in names.items():
            col.count(name, int((cls == code).sum()))
        units = (cls > 0).nonzero()
        scale_mm = 0
        for i, b in units[:MAX_FINDINGS].tolist():
            col.keep({"class": names[int(cls[i, b])], "token": i // h, "head": i % h, "byte": b,
                      "expected": _hex(ev[i, b]), "actual": _hex(av[i, b]),
                      "where": f"token {i // h} head {i % h} byte {b}: {_hex(av[i, b])}, expected {_hex(ev[i, b])}"})
        col.total = units.shape[0]
    else:
        asc = actual["q_scale"].cpu().reshape(t * h, -1)
        esc = expected["q_scale"].cpu().reshape(t * h, -1)
        ed = _compare_mxfp4(av, ev, asc, esc)
        units, counts = _entry_units(ed)
        for c, n in counts.items():
            col.count(c, n)
        for u in units[:MAX_FINDINGS]:
            i = int(u[0])
            f = _unit_finding(ed, u, av, ev, asc, esc)
            f = {"token": i // h, "head": i % h, **f}
            f["where"] = f"token {i // h} head {i % h} {f.pop('detail')}"
            col.keep(f)
        col.total = units.shape[0]
        scale_mm = int(ed.scale_mismatch.sum())
    wa, we = actual["weights"].cpu().float(), expected["weights"].cpu().float()
    wdiff = wa.view(torch.int32) != we.view(torch.int32)
    fin = torch.isfinite(wa) & torch.isfinite(we)
    wulp = torch.where(fin, _f32_ulps(wa, we).double(), torch.where(wdiff, math.inf, 0.0))
    if bool(wdiff.any()):
        col.count("weights_differ", int(wdiff.sum()))
        i = int(wulp.flatten().argmax())
        col.keep({"class": "weights_differ", "token": i // h, "head": i % h,
                  "expected": float(we.flatten()[i]), "actual": float(wa.flatten()[i]),
                  "where": f"weights token {i // h} head {i % h}: {float(wa.flatten()[i])!r}, expected "
                           f"{float(we.flatten()[i])!r} ({int(wdiff.sum())} weights differ)"})
    metrics = {"q_bytes_mismatched": int((av != ev).sum()), "q_scale_bytes_mismatched": scale_mm,
               "weights_max_ulp": float(wulp.max()) if wulp.numel() else 0.0,
               "weights_differing": int(wdiff.sum())}
    return col.report(op, metrics)


# --- logits --------------------------------------------------------------------------------

def diff_logits(actual: torch.Tensor, expected_fp64: torch.Tensor, row_ends, *, clean: bool,
                op: str = "paged_mxfp4_mqa_logits", worst_rows: int = 10,
                row_threshold: float = 1e-12) -> DiffReport:
    """Scorer logits [Rw, W] against the reference (fp64 preferred) on the valid region
    (column < row_ends[r]). logits_diff = 1 - 2*sum(xy)/sum(x^2+y^2) in fp64, computed as
    sum((x-y)^2)/sum(x^2+y^2), the same quantity without the cancellation; 0 when both are
    all zero. logits_max_rel_err is over entries whose expected value is not 0.
    logits_nonfinite: NaN/inf in the valid region (never a pass). When `clean`,
    logits_inf_pattern_mismatch counts columns >= row_end that are not -inf.
    logits_rows_differing: rows whose own difference exceeds `row_threshold` (fp32 rounding
    of fp64 scores stays far below the default 1e-12); findings list the worst of them."""
    if actual.dim() != 2 or actual.shape != expected_fp64.shape:
        raise ValueError(f"actual: shape {list(actual.shape)} differs from expected "
                         f"{list(expected_fp64.shape)}")
    x, y = actual.cpu().double(), expected_fp64.cpu().double()
    rw, w = x.shape
    ends = torch.as_tensor(row_ends).cpu().long().reshape(-1)
    if ends.numel() != rw:
        raise ValueError(f"row_ends: {ends.numel()} entries for {rw} rows")
    if rw and int(ends.max()) > w:
        raise ValueError(f"row_ends: a row ends at {int(ends.max())}, past the logits width {w}")
    valid = torch.arange(w)[None, :] < ends[:, None]
    fin = torch.isfinite(x) & torch.isfinite(y)
    nonfinite = valid & ~fin
    good = valid & fin
    xv, yv = torch.where(good, x, 0.0), torch.where(good, y, 0.0)
    den = float((xv * xv + yv * yv).sum())
    num = float(((xv - yv) ** 2).sum())
    err = (xv - yv).abs()
    rel = torch.where(good & (yv != 0), err / yv.abs().clamp_min(1e-300), 0.0)
    metrics = {"logits_diff": num / den if den > 0 else 0.0,
               "logits_max_abs_err": float(err.max()) if err.numel() else 0.0,
               "logits_max_rel_err": float(rel.max()) if rel.numel() else 0.0,
               "logits_nonfinite": int(nonfinite.sum())}
    col = _Collector()
    if clean:
        bad_inf = ~valid & ~(torch.isinf(x) & (x < 0))
        metrics["logits_inf_pattern_mismatch"] = int(bad_inf.sum())
        for r in bad_inf.any(1).nonzero().flatten().tolist():
            col.count("inf_pattern")
            c = int(bad_inf[r].nonzero()[0])
            if not col.keep({"class": "inf_pattern", "row": r, "row_end": int(ends[r]), "col": c,
                             "actual": float(x[r, c]),
                             "where": f"row {r} (row_end {int(ends[r])}): column {c} is {float(x[r, c])!r}, "
                                      f"expected -inf ({int(bad_inf[r].sum())} such columns)"}):
                pass
    for r in nonfinite.any(1).nonzero().flatten().tolist():
        col.count("nonfinite")
        c = int(nonfinite[r].nonzero()[0])
        col.keep({"class": "nonfinite", "row": r, "row_end": int(ends[r]), "col": c,
                  "actual": float(x[r, c]), "expected": float(y[r, c]),
                  "where": f"row {r} column {c}: {float(x[r, c])!r}, expected {float(y[r, c])!r}"})
    row_num = ((xv - yv) ** 2).sum(1)
    row_den = (xv * xv + yv * yv).sum(1)
    row_diff = torch.where(row_den > 0, row_num / row_den.clamp_min(1e-300), 0.0)
    bad_rows = (row_diff > row_threshold).nonzero().flatten()
    metrics["logits_rows_differing"] = bad_rows.numel()
    col.count("row_differs", bad_rows.numel())
    for r in bad_rows[row_diff[bad_rows].argsort(descending=True)][:worst_rows].tolist():
        c = int(err[r].argmax())
        rn, rd = float(row_num[r]), float(row_den[r])
        col.keep({"class": "row_differs", "row": r, "row_end": int(ends[r]), "col": c,
                  "actual": float(x[r, c]), "expected": float(y[r, c]), "abs_err": float(err[r, c]),
                  "row_diff": rn / rd if rd > 0 else 0.0,
                  "where": f"row {r} (row_end {int(ends[r])}) column {c}: {float(x[r, c])!r}, expected "
                           f"{float(y[r, c])!r} (abs err {float(err[r, c]):.3g}, row diff "
                           f"{(rn / rd if rd > 0 else 0.0):.3g})"})
    col.total = max(col.total, len(col.kept))
    return col.report(op, metrics)


# --- top-k ---------------------------------------------------------------------------------

def diff_topk(indices: torch.Tensor, ref_logits_fp64: torch.Tensor, lengths, k: int, *,
              tol: Optional[float] = None, op: str = "topk") -> DiffReport:
    """Top-k indices [Rw, k] against reference scores [Rw, W].

    Rows with length <= k must read 0..len-1 then -1. Longer rows are sets with a tie
    rule: an index is acceptable when its reference score >= the reference k-th score
    minus tol; tol defaults per row to 1e-4 * max|score| over the row's valid region (the
    tolerance of vLLM's top-k test). Metrics:
      topk_rows_not_exact_frac  rows whose set differs from the reference's own top-k set
                                (ties may make this non-zero legitimately; budget it as such)
      topk_recall_min           min over rows of acceptable distinct indices / min(len, k)
      topk_jaccard_min          min over rows of m / (|returned| + |reference| - m), m acceptable
      topk_padding_errors       rows: short rows not 0..len-1 then -1; long rows holding -1
      topk_duplicates           repeated indices (other than -1)
      topk_out_of_range         indices < -1 or >= the row's length
      topk_below_threshold      distinct in-range indices of long rows failing the tie rule"""
    idx = indices.cpu().long()
    s = ref_logits_fp64.cpu().double()
    rw, w = s.shape
    if idx.dim() != 2 or idx.shape[0] != rw or idx.shape[1] != k:
        raise ValueError(f"indices: expected shape [{rw}, {k}], got {list(idx.shape)}")
    lens = torch.as_tensor(lengths).cpu().long().reshape(-1)
    if lens.numel() != rw:
        raise ValueError(f"lengths: {lens.numel()} entries for {rw} rows")
    if rw and int(lens.max()) > w:
        raise ValueError(f"lengths: a row has length {int(lens.max())}, past the logits width {w}")
    cols = torch.arange(w)
    valid_cols = cols[None, :] < lens[:, None]
    nan_scores = int((torch.isnan(s) & valid_cols).sum())
    masked = torch.where(valid_cols, s, -math.inf)
    masked = torch.where(torch.isnan(masked), -math.inf, masked)
    short = lens <= k
    kcols = torch.arange(k)
    want_short = torch.where(kcols[None, :] < lens[:, None], kcols[None, :], -1)
    oor = (idx < -1) | (idx >= lens[:, None])
    # duplicates: equal neighbours after sorting, -1 excluded
    srt = idx.sort(1).values
    dup_mask = torch.zeros_like(idx, dtype=torch.bool)
    dup_mask[:, 1:] = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != -1)
    dups = dup_mask.sum(1)
    first = ~dup_mask                                     # on the sorted view
    s_in = (srt >= 0) & (srt < lens[:, None]) & first
    distinct_returned = ((srt != -1) & first).sum(1)
    # tie rule on long rows
    kk = min(k, w)
    topv, topi = torch.topk(masked, kk, dim=1) if w else (torch.zeros(rw, 0), torch.zeros(rw, 0, dtype=torch.long))
    kth = topv[:, -1] if kk else torch.zeros(rw, dtype=torch.float64)
    finite_abs = torch.where(valid_cols & torch.isfinite(s), s.abs(), 0.0)
    row_tol = (finite_abs.amax(1) * 1e-4) if tol is None else torch.full((rw,), float(tol), dtype=torch.float64)
    sc = masked.gather(1, srt.clamp(0, max(w - 1, 0))) if w else torch.zeros_like(srt, dtype=torch.float64)
    acceptable = s_in & torch.where(short[:, None], torch.ones_like(s_in), sc >= (kth - row_tol)[:, None])
    m = acceptable.sum(1)
    below = (s_in & ~acceptable & ~short[:, None]).sum(1)
    ref_size = torch.minimum(lens, torch.tensor(k))
    recall = torch.where(ref_size > 0, m.double() / ref_size.clamp_min(1).double(), 1.0)
    union = distinct_returned + ref_size - m
    jacc = torch.where(union > 0, m.double() / union.clamp_min(1).double(), 1.0)
    pad_err = torch.where(short, (idx != want_short).any(1), (idx == -1).any(1))
    ref_sorted = torch.where(kcols[None, :kk] < ref_size[:, None], topi, -1).sort(1).values if kk else topi
    exact_long = (srt[:, :kk] == ref_sorted).all(1) & (dups == 0) if kk else torch.ones(rw, dtype=torch.bool)
    exact = torch.where(short, ~pad_err, exact_long & ~pad_err)
    col = _Collector()
    for r in (~exact | (below > 0) | (dups > 0) | oor.any(1)).nonzero().flatten().tolist():
        L = int(lens[r])
        kinds = []
        if bool(pad_err[r]):
            kinds.append("padding")
        if int(dups[r]):
            kinds.append("duplicates")
        if bool(oor[r].any()):
            kinds.append("out_of_range")
        if int(below[r]):
            kinds.append("below_threshold")
        if not kinds:
            kinds.append("tie_swap")          # a different set, every index within the tie rule
        for kd in kinds:
            col.count(kd)
        detail = f"row {r} (length {L}, k {k}): {', '.join(kinds)}"
        f = {"class": kinds[0], "classes": kinds, "row": r, "length": L,
             "recall": float(recall[r]), "duplicates": int(dups[r]),
             "out_of_range": int(oor[r].sum()), "below_threshold": int(below[r])}
        if not bool(short[r]) and kk:
            bad = srt[r][s_in[r] & ~acceptable[r]][:5].tolist()
            f.update({"kth_score": float(kth[r]), "tol": float(row_tol[r]), "first_below": bad,
                      "first_below_scores": [float(s[r, j]) for j in bad]})
            if bad:
                detail += (f"; e.g. index {bad[0]} scores {float(s[r, bad[0]]):.6g} < k-th "
                           f"{float(kth[r]):.6g} - tol {float(row_tol[r]):.3g}")
        else:
            wrong = (idx[r] != want_short[r]).nonzero().flatten()[:1].tolist()
            if wrong:
                c = wrong[0]
                detail += f"; position {c} holds {int(idx[r, c])}, expected {int(want_short[r, c])}"
        f["where"] = detail
        col.keep(f)
    metrics = {"topk_rows_not_exact_frac": float((~exact).sum()) / rw if rw else 0.0,
               "topk_recall_min": float(recall.min()) if rw else 1.0,
               "topk_jaccard_min": float(jacc.min()) if rw else 1.0,
               "topk_padding_errors": int(pad_err.sum()),
               "topk_duplicates": int(dups.sum()),
               "topk_out_of_range": int(oor.sum()),
               "topk_below_threshold": int(below.sum())}
    notes = []
    if nan_scores:
        metrics["nonfinite_inputs"] = nan_scores
        notes.append(f"{nan_scores} NaN reference score(s) in the valid region")
    return col.report(op, metrics, notes)


# --- dispatch by op --------------------------------------------------------------------------

def _writer_slots(inputs: dict, scalars: dict) -> torch.Tensor:
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
    from .dumps import OP_FIELDS
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
                          written_slots=_writer_slots(inputs, scalars), fmt="fp8" if fp8 else "mxfp4",
                          fp8_dtype=scalars.get("fp8_dtype", "e4m3fn"), op=op)
    if op in ("q_rope_mxfp4_quant", "q_rope_fp8_quant"):
        return diff_q(actual, expected, op=op)
    if op in ("paged_mxfp4_mqa_logits", "paged_fp8_mqa_logits"):
        return diff_logits(actual["logits"], expected["logits"], inputs["row_ends"],
                           clean=bool(scalars.get("clean_logits", False)), op=op)
    if "indices" not in actual:
        return _shape_report(op, actual, {"indices": torch.empty(0)})
    return diff_topk(actual["indices"], inputs["logits"], inputs["lengths"], scalars["k"], op=op)
