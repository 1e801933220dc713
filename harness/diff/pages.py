"""Page bytes: MXFP4 (natural or preshuffled) and FP8 pools, classified per byte, scale
block and entry, localized to page, entry and slot."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from reference import checks, layout
from reference.mxfp4 import MX_BLOCK, dequantize_mxfp4, e8m0_to_float

from . import args as A
from .report import MAX_FINDINGS, Collector, DiffReport, hex_byte

# --- MXFP4 entries: the shared classifier of pages and Q ---------------------------------

# class codes of one value byte, ordered by severity (a byte takes its worse nibble)
NIB_EQUAL, NIB_SIGNED_ZERO, NIB_ONE_STEP, NIB_SWAP, NIB_OTHER = 0, 1, 2, 3, 4
_BYTE_CLASS = {NIB_SIGNED_ZERO: "signed_zero", NIB_ONE_STEP: "one_step", NIB_SWAP: "nibbles_swapped", NIB_OTHER: "value_other"}
_NIB_NAME = {NIB_EQUAL: "equal", NIB_SIGNED_ZERO: "signed_zero", NIB_ONE_STEP: "one_step", NIB_OTHER: "other"}


def nibble_class(a: torch.Tensor, e: torch.Tensor, sign_bit: int = 8) -> torch.Tensor:
    mag = sign_bit - 1
    a, e = a.long(), e.long()
    pa = torch.where(a & sign_bit > 0, -(a & mag), a & mag)     # position on the code line, +-0 one point
    pe = torch.where(e & sign_bit > 0, -(e & mag), e & mag)
    cls = torch.full_like(a, NIB_OTHER)
    cls[(pa - pe).abs() == 1] = NIB_ONE_STEP
    cls[((a & mag) == 0) & ((e & mag) == 0)] = NIB_SIGNED_ZERO
    cls[a == e] = NIB_EQUAL
    return cls


def byte_class(a: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """u8 value bytes -> (byte class, low nibble class, high nibble class)."""
    a, e = a.long(), e.long()
    lo = nibble_class(a & 0xF, e & 0xF)
    hi = nibble_class(a >> 4, e >> 4)
    cls = torch.maximum(lo, hi)
    swapped = (a == (((e & 0xF) << 4) | (e >> 4))) & (a != e)
    return torch.where(swapped, torch.full_like(cls, NIB_SWAP), cls), lo, hi


@dataclass
class EntryDiff:
    """Mismatches of n MXFP4 entries (values [n, TB], scales [n, NB])."""
    value_mismatch: torch.Tensor       # bool [n, TB]
    scale_mismatch: torch.Tensor       # bool [n, NB]
    entry_mismatch: torch.Tensor       # bool [n]
    not_written: torch.Tensor          # bool [n]
    interleave: torch.Tensor           # bool [n]
    scale_k: torch.Tensor              # int [n, NB] actual - expected e8m0
    block_values: torch.Tensor         # int [n, NB]: 0 codes equal, 1 consistent, 2 not
    value_class: torch.Tensor          # int [n, TB] (NIB_EQUAL where filed under a scale finding)
    lo: torch.Tensor
    hi: torch.Tensor
    abs_err: float
    rel_err: float


_BLOCK_VALUES = ("codes_equal", "consistent", "inconsistent")
_VALUES_TEXT = {"codes_equal": "are equal", "consistent": "are consistent with the actual scale",
                "inconsistent": "differ too"}


def compare_mxfp4(av, ev, asc, esc, bv=None, bsc=None) -> EntryDiff:
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
    cls, lo, hi = byte_class(av, ev)
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
    return EntryDiff(vm, sm, em, nw, il, k, block_values, cls, lo, hi, abs_err, rel_err)


def entry_units(ed: EntryDiff):
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


def unit_finding(ed: EntryDiff, unit, av, ev, asc, esc) -> dict:
    """The structured part of one unit's finding (location in the entry, bytes, class)."""
    i, kind, pos = (int(x) for x in unit)
    if kind == 0:
        if bool(ed.not_written[i]):
            return {"class": "not_written", "kind": "entry",
                    "detail": "every owned byte still holds its value from before the call"}
        return {"class": "scale_interleave", "kind": "scale",
                "expected": [hex_byte(x) for x in esc[i].tolist()], "actual": [hex_byte(x) for x in asc[i].tolist()],
                "detail": f"scale bytes {[hex_byte(x) for x in asc[i].tolist()]}, expected "
                          f"{[hex_byte(x) for x in esc[i].tolist()]} (same bytes, other positions)"}
    if kind == 1:
        k = int(ed.scale_k[i, pos])
        vals = _BLOCK_VALUES[int(ed.block_values[i, pos])]
        return {"class": "scale_off_by_k", "kind": "scale", "block": pos, "k": k, "values": vals,
                "expected": hex_byte(esc[i, pos]), "actual": hex_byte(asc[i, pos]),
                "detail": f"scale block {pos}: e8m0 {hex_byte(asc[i, pos])}, expected {hex_byte(esc[i, pos])} "
                          f"(k={k:+d}; the block's codes {_VALUES_TEXT[vals]})"}
    cls = _BYTE_CLASS[int(ed.value_class[i, pos])]
    nib = [_NIB_NAME[int(ed.lo[i, pos])], _NIB_NAME[int(ed.hi[i, pos])]]
    return {"class": cls, "kind": "value", "byte": pos, "elements": [2 * pos, 2 * pos + 1],
            "block": (2 * pos) // MX_BLOCK, "expected": hex_byte(ev[i, pos]), "actual": hex_byte(av[i, pos]),
            "nibbles": nib,
            "detail": f"value byte {pos} (elements {2 * pos},{2 * pos + 1}, block {(2 * pos) // MX_BLOCK}): "
                      f"{hex_byte(av[i, pos])}, expected {hex_byte(ev[i, pos])} (low nibble {nib[0]}, high {nib[1]})"}


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
    if isinstance(t, torch.Tensor):
        A.tensor(name, t)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
        raise ValueError(f"{name}: expected a u8 pool [P, page_bytes], got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
    if like is not None and t.shape != like.shape:
        raise ValueError(f"{name}: shape {list(t.shape)} differs from expected {list(like.shape)}")


def _check_pages(actual, expected, before, page_size: int, head_dim: int, shuffle, fmt: str,
                 fp8_dtype: str) -> None:
    """diff_pages' arguments (ValueError naming the first bad one)."""
    if fmt not in ("mxfp4", "fp8"):
        raise ValueError(f"fmt: expected 'mxfp4' or 'fp8', got {fmt!r}")
    _check_pool("expected", expected)
    _check_pool("actual", actual, expected)
    if before is not None:
        _check_pool("before", before, expected)
    A.pos_int("page_size", page_size)
    A.pos_int("head_dim", head_dim)
    if head_dim % 32:
        raise ValueError(f"head_dim: {head_dim} is not a multiple of 32")
    if fmt == "fp8":
        from reference.formats import FP8_FLAVOURS
        checks.choice("fp8_dtype", fp8_dtype, tuple(FP8_FLAVOURS))
        need = page_size * (head_dim + 4)
    else:
        try:
            layout.check_layout(page_size, head_dim, layout.as_shuffle(shuffle))
        except (TypeError, ValueError) as e:
            raise ValueError(f"shuffle: {e}") from None
        need = layout.page_bytes(page_size, head_dim)
    if expected.shape[1] < need:
        raise ValueError(f"expected: page stride {expected.shape[1]} is below the {need} bytes of "
                         f"{page_size} entries of head dim {head_dim}")


def _compare_entries(fmt: str, av, ev, asc, esc, bv, bsc, fp8_dtype: str):
    """The written entries' bytes compared: (entry details, units, class counts,
    (value, scale, entry) mismatch counts, max abs error, max rel error)."""
    if fmt == "mxfp4":
        ed = compare_mxfp4(av, ev, asc, esc, bv, bsc)
        units, counts = entry_units(ed)
        mism = (int(ed.value_mismatch.sum()), int(ed.scale_mismatch.sum()), int(ed.entry_mismatch.sum()))
        return ed, units, counts, mism, ed.abs_err, ed.rel_err
    ed, units, counts, abs_err, rel_err = compare_fp8(av, ev, asc, esc, bv, bsc, fp8_dtype)
    mism = (int((av != ev).sum()), int((asc != esc).sum()), int(((av != ev).any(1) | (asc != esc).any(1)).sum()))
    return ed, units, counts, mism, abs_err, rel_err


def _outside_finding(off: int, fa, ref_out, *, fmt: str, stride: int, page_size: int, head_dim: int,
                     shuffle) -> dict:
    """The finding of pool byte `off`: changed, and owned by no written slot."""
    if fmt == "mxfp4":
        loc = layout.locate(off, page_stride=stride, page_size=page_size, head_dim=head_dim, shuffle=shuffle)
    else:
        loc = _fp8_locate(off, page_stride=stride, page_size=page_size, head_dim=head_dim)
    if "entry" in loc:
        loc["slot"] = loc["page"] * page_size + loc["entry"]
    part = (f" value byte {loc['byte']}" if loc["kind"] == "value" and "byte" in loc else
            f" scale block {loc['block']}" if loc["kind"] == "scale" and "block" in loc else
            f" scale byte {loc['byte']}" if loc["kind"] == "scale" else "")
    was = hex_byte(ref_out[off])
    return {"class": "outside_owned_write", **loc, "offset": off, "expected": was, "actual": hex_byte(fa[off]),
            "where": f"{_where(loc)}{part} (pool byte {off}, not owned by any written slot): "
                     f"{hex_byte(fa[off])}, was {was}"}


# Pools are compared in chunks of this many bytes: a pool of GiBs costs no pool-sized mask.
CHUNK_BYTES = 1 << 26


def _count_differing(fa: torch.Tensor, fe: torch.Tensor) -> int:
    return sum(int((fa[i:i + CHUNK_BYTES] != fe[i:i + CHUNK_BYTES]).sum()) for i in range(0, fa.numel(), CHUNK_BYTES))


def _outside_changes(fa: torch.Tensor, ref: torch.Tensor, owned: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of `fa` that differ from `ref` at offsets not in `owned` (sorted flat offsets):
    (their count, the first MAX_FINDINGS offsets)."""
    count, first = 0, []
    for i in range(0, fa.numel(), CHUNK_BYTES):
        j = min(i + CHUNK_BYTES, fa.numel())
        changed = fa[i:j] != ref[i:j]
        lo, hi = torch.searchsorted(owned, torch.tensor([i, j], device=owned.device)).tolist()
        changed[owned[lo:hi] - i] = False
        n = int(changed.sum())
        if n and len(first) < MAX_FINDINGS:
            first += (changed.nonzero().flatten()[:MAX_FINDINGS - len(first)] + i).tolist()
        count += n
    return count, torch.tensor(first, dtype=torch.long, device=fa.device)


def _unit_offsets(units, vo, so):
    """Each unit's pool offset: its value byte, its scale byte, or its entry's first byte."""
    i_, k_, p_ = units[:, 0], units[:, 1], units[:, 2]
    return torch.where(k_ == 2, vo[i_, p_.clamp(max=vo.shape[1] - 1)],
                       torch.where(k_ == 1, so[i_, p_.clamp(max=so.shape[1] - 1)], vo[i_, 0]))


def diff_pages(actual: torch.Tensor, expected: torch.Tensor, before: Optional[torch.Tensor], *,
               page_size: int, head_dim: int, shuffle, written_slots: torch.Tensor,
               fmt: str = "mxfp4", fp8_dtype: str = "e4m3fn", op: Optional[str] = None) -> DiffReport:
    """Compare two K-cache pools [P, page_bytes] u8 after a writer wrote `written_slots`.

    Metrics: page_bytes_mismatched (all bytes, = value + scale + outside-owned mismatches),
    page_value_bytes_mismatched / page_scale_bytes_mismatched (owned bytes of the written
    slots), page_bytes_outside_owned_changed (bytes no written slot owns that differ from
    `before` in `actual`; from `expected` when `before` is None), page_entries_mismatched,
    page_dequant_max_abs_err, page_dequant_max_rel_err (relative to the entry's max |expected|)."""
    _check_pages(actual, expected, before, page_size, head_dim, shuffle, fmt, fp8_dtype)
    written_slots = A.index("written_slots", written_slots)          # -1: a skipped token
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
    owned = torch.cat((vo.flatten(), so.flatten())).sort().values
    av, ev, asc, esc = fa[vo], fe[vo], fa[so], fe[so]
    bv, bsc = (fb[vo], fb[so]) if fb is not None else (None, None)
    ed, units, counts, (value_mm, scale_mm, entries_mm), abs_err, rel_err = _compare_entries(
        fmt, av, ev, asc, esc, bv, bsc, fp8_dtype)
    # bytes outside the written slots
    ref_out = fb if fb is not None else fe
    n_outside, outside = _outside_changes(fa, ref_out, owned)
    col = Collector()
    for cls, n in counts.items():
        col.count(cls, n)
    col.count("outside_owned_write", n_outside)
    # order every unit by pool offset, keep the first MAX_FINDINGS
    n_units = units.shape[0]
    unit_off = _unit_offsets(units, vo, so) if n_units else torch.zeros(0, dtype=torch.long, device=dev)
    keys = torch.cat((unit_off * 4 + units[:, 1], outside * 4 + 3)) if n_units else outside * 4 + 3
    for j in keys.argsort()[:MAX_FINDINGS].tolist():
        if j >= n_units:
            col.keep(_outside_finding(int(outside[j - n_units]), fa, ref_out, fmt=fmt, stride=stride,
                                      page_size=page_size, head_dim=head_dim, shuffle=shuffle))
            continue
        slot = int(slots[int(units[j][0])])
        loc = {"page": slot // page_size, "entry": slot % page_size, "slot": slot}
        f = (unit_finding if fmt == "mxfp4" else fp8_unit_finding)(ed, units[j], av, ev, asc, esc)
        f = {**loc, **f, "offset": int(unit_off[j])}
        f["where"] = f"{_where(loc)} {f.pop('detail')}"
        col.keep(f)
    metrics = {
        "page_bytes_mismatched": _count_differing(fa, fe),
        "page_value_bytes_mismatched": value_mm,
        "page_scale_bytes_mismatched": scale_mm,
        "page_bytes_outside_owned_changed": n_outside,
        "page_entries_mismatched": entries_mm,
        "page_dequant_max_abs_err": abs_err,
        "page_dequant_max_rel_err": rel_err,
    }
    notes = [] if before is not None else ["no `before` pool: outside-owned bytes compared with expected"]
    return col.report(op, metrics, notes)


# --- FP8 entries ---------------------------------------------------------------------------

def compare_fp8(av, ev, asc, esc, bv, bsc, fp8_dtype):
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
    cls = nibble_class(av.long(), ev.long(), sign_bit=0x80)
    cls = torch.where(vm & ~nw[:, None], cls, torch.zeros_like(cls))
    counts = {"not_written": int(nw.sum())}
    s_bad = sm.any(1) & ~nw
    counts["scale_off_by_k"] = int((s_bad & pow2).sum())
    counts["scale_other"] = int((s_bad & ~pow2).sum())
    for code, name in ((NIB_SIGNED_ZERO, "signed_zero"), (NIB_ONE_STEP, "one_step"), (NIB_OTHER, "value_other")):
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


def fp8_unit_finding(ed, unit, av, ev, asc, esc) -> dict:
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
    cls = {NIB_SIGNED_ZERO: "signed_zero", NIB_ONE_STEP: "one_step", NIB_OTHER: "value_other"}[int(ed["cls"][i, pos])]
    return {"class": cls, "kind": "value", "byte": pos, "elements": [pos],
            "expected": hex_byte(ev[i, pos]), "actual": hex_byte(av[i, pos]),
            "detail": f"value byte {pos}: {hex_byte(av[i, pos])}, expected {hex_byte(ev[i, pos])}"}


# --- pooled rows ---------------------------------------------------------------------------

