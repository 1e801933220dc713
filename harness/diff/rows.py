"""Row outputs: pooled rows (bf16 ulps) and quantized queries (codes, scales, weights)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import args as A
from .pages import NIB_ONE_STEP, NIB_OTHER, NIB_SIGNED_ZERO, compare_mxfp4, entry_units, nibble_class, unit_finding
from .report import MAX_FINDINGS, Collector, DiffReport, hex_byte


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
    """Pooled bf16 rows [T, D] (fp32 rows of the CUDA fused path are compared at bf16, both
    sides of one dtype); only `rows` (bool mask [T] or indices) are compared.
    Metrics: pooled_max_ulp (bf16 ulps; +0 and -0 are 0 ulps apart), pooled_values_differing
    (bit patterns differ), pooled_rows_differing, pooled_nonfinite (NaN/inf in a compared
    row of either side: never a pass)."""
    A.tensor("expected", expected, (torch.bfloat16, torch.float32), 2)
    A.tensor("actual", actual, (torch.bfloat16, torch.float32), 2)
    A.same("actual", actual, "expected", expected)      # an fp32 actual is never rounded onto bf16
    a, e = actual.cpu().to(torch.bfloat16), expected.cpu().to(torch.bfloat16)
    t = a.shape[0]
    rows = A.index("rows", rows, lo=0, hi=t, mask=True)
    if rows.dtype == torch.bool:
        if rows.dim() != 1 or rows.numel() != t:
            raise ValueError(f"rows: a bool mask needs shape [{t}], got {list(rows.shape)}")
        idx = rows.cpu().nonzero().flatten()
    else:
        idx = rows
    a, e = a[idx], e[idx]
    fin = torch.isfinite(a.float()) & torch.isfinite(e.float())
    ulp = torch.where(fin, _bf16_ulps(a, e), torch.zeros((), dtype=torch.long))
    differ = a.view(torch.int16) != e.view(torch.int16)
    col = Collector()
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
    A.mapping("actual", actual)
    A.mapping("expected", expected)
    fp8 = "q_fp8" in expected
    op = op or ("q_rope_fp8_quant" if fp8 else "q_rope_mxfp4_quant")
    col = Collector()
    vkey = "q_fp8" if fp8 else "q_fp4"
    specs = {vkey: ((torch.uint8,), 3), "weights": ((torch.float32,), 2)}
    if not fp8:
        specs["q_scale"] = ((torch.uint8,), 3)
    for key, (dtypes, ndim) in specs.items():
        if key not in actual or key not in expected:
            raise ValueError(f"{key}: missing from {'actual' if key not in actual else 'expected'}")
        A.tensor(f"expected[{key!r}]", expected[key], dtypes, ndim)
        A.tensor(f"actual[{key!r}]", actual[key], dtypes, ndim)
        A.same(f"actual[{key!r}]", actual[key], f"expected[{key!r}]", expected[key])
    t, h, nv = expected[vkey].shape
    if expected["weights"].shape != (t, h):
        raise ValueError(f"expected['weights']: shape {list(expected['weights'].shape)}, expected [{t}, {h}]")
    if nv == 0:
        raise ValueError(f"expected[{vkey!r}]: head dim 0")
    if not fp8 and (nv % 16 or expected["q_scale"].shape != (t, h, nv // 16)):
        raise ValueError(f"expected['q_scale']: shape {list(expected['q_scale'].shape)} does not fit q_fp4 "
                         f"{list(expected[vkey].shape)} (D/32 scales for D/2 bytes)")
    av, ev = actual[vkey].cpu().reshape(t * h, nv), expected[vkey].cpu().reshape(t * h, nv)
    # only the (token, head) rows that differ are classified (the others add nothing): a
    # passing step of thousands of tokens costs one comparison, not a classification
    if fp8:
        rows = (av != ev).any(1).nonzero().flatten()
        sav, sev = av[rows], ev[rows]
        cls = nibble_class(sav.long(), sev.long(), sign_bit=0x80)
        cls = torch.where(sav != sev, cls, torch.zeros_like(cls))
        names = {NIB_SIGNED_ZERO: "signed_zero", NIB_ONE_STEP: "one_step", NIB_OTHER: "value_other"}
        for code, name in names.items():
            col.count(name, int((cls == code).sum()))
        units = (cls > 0).nonzero()
        scale_mm = 0
        for j, b in units[:MAX_FINDINGS].tolist():
            i = int(rows[j])
            col.keep({"class": names[int(cls[j, b])], "token": i // h, "head": i % h, "byte": b,
                      "expected": hex_byte(ev[i, b]), "actual": hex_byte(av[i, b]),
                      "where": f"token {i // h} head {i % h} byte {b}: {hex_byte(av[i, b])}, expected {hex_byte(ev[i, b])}"})
        col.total = units.shape[0]
    else:
        asc = actual["q_scale"].cpu().reshape(t * h, nv // 16)
        esc = expected["q_scale"].cpu().reshape(t * h, nv // 16)
        rows = ((av != ev).any(1) | (asc != esc).any(1)).nonzero().flatten()
        sav, sev, sasc, sesc = av[rows], ev[rows], asc[rows], esc[rows]
        ed = compare_mxfp4(sav, sev, sasc, sesc)
        units, counts = entry_units(ed)
        for c, n in counts.items():
            col.count(c, n)
        for u in units[:MAX_FINDINGS]:
            i = int(rows[int(u[0])])
            f = unit_finding(ed, u, sav, sev, sasc, sesc)
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

