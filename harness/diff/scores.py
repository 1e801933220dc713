"""Scores: logits against the fp64 reference, top-k sets with the tie tolerance, and what a
different selection costs (the selection metrics, with the declared mass proxy)."""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import torch

from . import args as A
from .pages import CHUNK_BYTES
from .report import Collector, DiffReport

# Full-size work runs where the tensors live, a block of rows at a time: each block's
# temporaries stay near CHUNK_BYTES per full-size term, whatever the width (a logits buffer
# of 2^20 columns costs no buffer-sized mask), and at most about 1/BLOCKS of the whole (the
# few full-size terms of a block then cost less than the compared tensors themselves); only
# per-row results leave the device.
BLOCKS = 8


def row_blocks(rows: int, width: int, itemsize: int = 8):
    """(start, end) of blocks of rows whose [rows, width] terms of `itemsize` bytes each stay
    near CHUNK_BYTES and near 1/BLOCKS of all the rows (at least one row per block)."""
    step = max(1, min(CHUNK_BYTES // max(1, width * itemsize), -(-rows // BLOCKS)))
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def _logit_rows(actual: torch.Tensor, expected_fp64: torch.Tensor, ends: torch.Tensor, clean: bool) -> dict:
    """`diff_logits`' per-row results, a block of rows at a time on `expected_fp64`'s device,
    read back once: the squared-difference and magnitude sums (num, den), the largest
    absolute error and its column, the largest relative error, the non-finite entries of the
    valid region and the first one's column, and (clean) the columns past the row end that
    are not -inf and the first one's column."""
    dev = expected_fp64.device
    rw, w = expected_fp64.shape
    ends_d = ends.to(dev)
    cols = torch.arange(w, device=dev)
    per_row = {n: [] for n in ("num", "den", "err_max", "err_col", "rel_max", "nf", "nf_col", "inf", "inf_col")}
    for r0, r1 in row_blocks(rw, w):
        x = actual[r0:r1].to(dev, torch.float64)
        y = expected_fp64[r0:r1].double()
        valid = cols[None, :] < ends_d[r0:r1, None]
        fin = torch.isfinite(x) & torch.isfinite(y)
        nonfinite = valid & ~fin
        good = valid & fin
        if clean:
            bad_inf = ~valid & ~(torch.isinf(x) & (x < 0))
            per_row["inf"].append(bad_inf.sum(1))
            per_row["inf_col"].append(bad_inf.int().argmax(1) if w else bad_inf.sum(1))
            del bad_inf
        xv = torch.where(good, x, 0.0)
        del x                                          # few full-size terms alive at once
        yv = torch.where(good, y, 0.0)
        d = xv - yv
        per_row["num"].append((d * d).sum(1))
        per_row["den"].append((xv.square_() + yv * yv).sum(1))
        del xv
        err = d.abs_()
        m, c = err.max(1) if w else (err.new_zeros(r1 - r0), torch.zeros(r1 - r0, dtype=torch.long, device=dev))
        per_row["err_max"].append(m)
        per_row["err_col"].append(c)
        rel = torch.where(good & (yv != 0), err / yv.abs().clamp_min(1e-300), 0.0)
        per_row["rel_max"].append(rel.amax(1) if w else rel.new_zeros(r1 - r0))
        per_row["nf"].append(nonfinite.sum(1))
        per_row["nf_col"].append(nonfinite.int().argmax(1) if w else c)
    return {n: (torch.cat(v).cpu() if v else torch.zeros(0)) for n, v in per_row.items()}


def diff_logits(actual: torch.Tensor, expected_fp64: torch.Tensor, row_ends, *, clean: bool,
                op: str = "paged_mxfp4_mqa_logits", worst_rows: int = 10,
                row_threshold: float = 1e-12) -> DiffReport:
    """Scorer logits [Rw, W] against the reference (fp64 preferred) on the valid region
    (column < row_ends[r]). logits_diff = 1 - 2*sum(xy)/sum(x^2+y^2) in fp64, computed as
    sum((x-y)^2)/sum(x^2+y^2), the same quantity without the cancellation (each sum taken
    per row, then over the rows); 0 when both are all zero. logits_max_rel_err is over
    entries whose expected value is not 0.
    logits_nonfinite: NaN/inf in the valid region (never a pass). When `clean`,
    logits_inf_pattern_mismatch counts columns >= row_end that are not -inf.
    logits_rows_differing: rows whose own difference exceeds `row_threshold` (fp32 rounding
    of fp64 scores stays far below the default 1e-12); findings list the worst of them.
    Computed on `expected_fp64`'s device, a block of rows at a time (`row_blocks`)."""
    A.tensor("expected_fp64", expected_fp64, A.FLOATS, 2)
    A.tensor("actual", actual, A.FLOATS, 2)
    A.same("actual", actual, "expected_fp64", expected_fp64, dtype=False)
    A.flag("clean", clean)
    A.pos_int("worst_rows", worst_rows, 0)
    A.nonneg("row_threshold", row_threshold)
    rw, w = expected_fp64.shape
    ends = A.index("row_ends", row_ends, lo=0, hi=w + 1)
    if ends.numel() != rw:
        raise ValueError(f"row_ends: {ends.numel()} entries for {rw} rows")
    t = _logit_rows(actual, expected_fp64, ends, clean)
    row_num, row_den = t["num"].double(), t["den"].double()
    num, den = float(row_num.sum()), float(row_den.sum())
    n_nonfinite = t["nf"].long()

    def at(tensor, r, c):
        return float(tensor[r, c])

    metrics = {"logits_diff": num / den if den > 0 else 0.0,
               "logits_max_abs_err": float(t["err_max"].max()) if rw * w else 0.0,
               "logits_max_rel_err": float(t["rel_max"].max()) if rw * w else 0.0,
               "logits_nonfinite": int(n_nonfinite.sum())}
    col = Collector()
    if clean:
        n_inf = t["inf"].long()
        metrics["logits_inf_pattern_mismatch"] = int(n_inf.sum())

        def inf_finding(r):
            c = int(t["inf_col"][r])
            v = at(actual, r, c)
            return {"class": "inf_pattern", "row": r, "row_end": int(ends[r]), "col": c,
                    "actual": v,
                    "where": f"row {r} (row_end {int(ends[r])}): column {c} is {v!r}, "
                             f"expected -inf ({int(n_inf[r])} such columns)"}
        inf_rows = (n_inf > 0).nonzero().flatten()
        col.count("inf_pattern", inf_rows.numel())
        col.keep_rows(inf_rows, inf_finding)

    def nonfinite_finding(r):
        c = int(t["nf_col"][r])
        xa, ye = at(actual, r, c), at(expected_fp64, r, c)
        return {"class": "nonfinite", "row": r, "row_end": int(ends[r]), "col": c,
                "actual": xa, "expected": ye,
                "where": f"row {r} column {c}: {xa!r}, expected {ye!r}"}
    nf_rows = (n_nonfinite > 0).nonzero().flatten()
    col.count("nonfinite", nf_rows.numel())
    col.keep_rows(nf_rows, nonfinite_finding)
    row_diff = torch.where(row_den > 0, row_num / row_den.clamp_min(1e-300), 0.0)
    bad_rows = (row_diff > row_threshold).nonzero().flatten()
    metrics["logits_rows_differing"] = bad_rows.numel()
    col.count("row_differs", bad_rows.numel())
    for r in bad_rows[row_diff[bad_rows].argsort(descending=True)][:worst_rows].tolist():
        c = int(t["err_col"][r])
        xa, ye, ea = at(actual, r, c), at(expected_fp64, r, c), float(t["err_max"][r])
        rn, rd = float(row_num[r]), float(row_den[r])
        col.keep({"class": "row_differs", "row": r, "row_end": int(ends[r]), "col": c,
                  "actual": xa, "expected": ye, "abs_err": ea,
                  "row_diff": rn / rd if rd > 0 else 0.0,
                  "where": f"row {r} (row_end {int(ends[r])}) column {c}: {xa!r}, expected "
                           f"{ye!r} (abs err {ea:.3g}, row diff "
                           f"{(rn / rd if rd > 0 else 0.0):.3g})"})
    col.total = max(col.total, len(col.kept))
    return col.report(op, metrics)


# --- what a selection keeps (shared with `mxval study`) ------------------------------------
#
# The declared proxy of attention mass: the softmax of the exact indexer logits over a
# row's valid entries. vLLM folds the softmax scale into the indexer's head weights
# (weights * head_dim**-0.5 * heads**-0.5), so the logits sit on the attention-logit scale
# and their softmax is the indexer's own estimate of where the attention mass lies.
# `mass_kept` is the one formula: the weight a selection holds over the weight the exact
# top-k holds (per row; weights with a head dimension are summed over heads first). The
# study passes its per-head attention probabilities, the reports this proxy.

TOP_M = (64, 256)          # the exact top-m whose keeping the reports show (m < k only)
MASS_PROXY = ("mass kept: the softmax of the exact indexer logits over each row's valid entries "
              "(the logits carry the softmax scale), held by the selection over that held by the exact top-k")


def score_weights(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mass proxy: softmax over each row's valid, finite scores (fp64 [R, J]); entries
    outside `valid` weigh 0, and a row without any valid score is all 0."""
    s = scores.double()
    return _weights(s, valid & torch.isfinite(s))


def _weights(s: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """`score_weights` of fp64 scores with `ok` (valid and finite) given."""
    top = torch.where(ok, s, -math.inf).amax(1, keepdim=True) if s.shape[1] else s[:, :1]
    e = torch.where(ok, torch.exp(s - torch.where(torch.isfinite(top), top, 0.0)), 0.0)
    return e / e.sum(1, keepdim=True).clamp_min(1e-300)


def mass_kept(weights: torch.Tensor, selected: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Per row (fp64 [R]): the weight of `selected` over the weight of `exact` (both bool
    masks, or index tensors [R, n] into the last dim of `weights`). `weights` [R, J] or
    [R, H, J] (summed over H). 1 where the exact selection weighs nothing; at most 1 when
    `exact` is the top-|selected| by weight (rounding clamped)."""
    w = weights.double()
    if w.dim() == 3:
        w = w.sum(1)                   # a key's weight: its heads' summed

    def held(sel):
        m = sel if sel.dtype == torch.bool else torch.zeros_like(w, dtype=torch.bool).scatter_(1, sel, True)
        return (w * m).sum(1)
    num, den = held(selected), held(exact)
    return torch.where(den > 0, (num / den.clamp_min(1e-300)).clamp(max=1.0), 1.0)


def selection_metrics(scores: torch.Tensor, lengths: torch.Tensor, selected: torch.Tensor, k: int,
                      tol: torch.Tensor, recall: torch.Tensor, *, shared: SimpleNamespace) -> dict:
    """What a selection keeps of the exact top-k, per row (fp64 [R] each):
      mass       `mass_kept` of the proxy `score_weights`
      top<m>     of the exact top-min(m, len), the share the selection keeps, an entry tied
                 with the m-th (within `tol`) standing for it; for each m in TOP_M below k
      rank_lost  the exact rank (1 = the best key) of the best exact top-k key the selection
                 lacks, in rows the tie rule does not excuse (recall < 1); NaN elsewhere
    `scores` fp64 [R, W], `selected` bool [R, W] (distinct in-range indices), `tol` and
    `recall` [R] as `diff_topk` computes them. `shared`: `_topk_rows`'s namespace of the same
    scores and lengths (its finite mask and, where no valid score is +inf, its top-k), so
    that the full-size passes are not repeated."""
    rw, w = scores.shape
    dev = scores.device
    fin = shared.fin
    size = torch.minimum(lengths, torch.tensor(k, device=dev))
    kk = min(k, w)
    if not shared.pos_inf:
        # the same masked scores (only +inf would differ): the same top-k
        topv, topi = shared.topv, shared.topi
    else:
        masked = torch.where(fin, scores, -math.inf)
        topv, topi = (torch.topk(masked, kk, dim=1) if kk
                      else (masked[:, :0], torch.zeros(rw, 0, dtype=torch.long, device=dev)))
    in_ref = torch.arange(kk, device=dev)[None, :] < size[:, None]
    exact = torch.zeros(rw, w, dtype=torch.bool, device=dev)
    if kk:
        exact.scatter_(1, topi, in_ref)
    out = {"mass": mass_kept(_weights(scores.double(), fin), selected, exact)}
    for m in TOP_M:
        if m >= k:
            continue
        me = torch.minimum(lengths, torch.tensor(m, device=dev))
        mth = topv.gather(1, (me - 1).clamp_min(0)[:, None])[:, 0] if kk else torch.zeros(rw, dtype=torch.float64, device=dev)
        held = (selected & fin & (scores >= (mth - tol)[:, None])).sum(1)
        out[f"top{m}"] = torch.where(me > 0, torch.minimum(held, me).double() / me.clamp_min(1).double(), 1.0)
    rank = torch.full((rw,), math.nan, dtype=torch.float64, device=dev)
    if kk:
        lacks = ~selected.gather(1, topi) & in_ref
        first = lacks.int().argmax(1)
        at = topv.gather(1, first[:, None])
        best = 1 + (topv > at).sum(1).double()
        rank = torch.where(lacks.any(1) & (recall < 1), best, rank)
    out["rank_lost"] = rank
    return out


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
      topk_below_threshold      distinct in-range indices of long rows failing the tie rule
    and what the selection keeps (`selection_metrics`, min over rows):
      topk_mass_kept_min        the proxy attention mass kept (`score_weights`, `mass_kept`)
      topk_top64_kept_min       the exact top-64 kept (k > 64 only); topk_top256_kept_min alike
      topk_rank_lost_min        the best exact rank lost beyond the tie rule (absent: none lost)
    The report's `rows`: the per-row tensors recall, exact (the reference's own set), mass
    and lengths (`recall_points`)."""
    A.pos_int("k", k)
    A.tensor("ref_logits_fp64", ref_logits_fp64, A.FLOATS, 2)
    A.tensor("indices", indices, A.INT_DTYPES, 2)
    if tol is not None:
        A.nonneg("tol", tol)
    dev = ref_logits_fp64.device
    rw, w = ref_logits_fp64.shape
    if indices.shape[0] != rw or indices.shape[1] != k:
        raise ValueError(f"indices: expected shape [{rw}, {k}], got {list(indices.shape)}")
    lens = A.index("lengths", lengths, lo=0, hi=w + 1)
    if lens.numel() != rw:
        raise ValueError(f"lengths: {lens.numel()} entries for {rw} rows")
    lens_d = lens.to(dev)

    def rows_of(r0, r1):
        return _topk_rows(indices[r0:r1].to(dev).long(), ref_logits_fp64[r0:r1].double(), lens_d[r0:r1], k, tol)

    per_row: dict[str, list] = {}
    for r0, r1 in row_blocks(rw, w) or [(0, 0)]:             # no rows: one empty pass gives the empty results
        t = rows_of(r0, r1)
        sel_cols = torch.zeros(r1 - r0, w + 1, dtype=torch.bool, device=dev).scatter_(
            1, torch.where(t.s_in, t.srt, w), True)[:, :w]
        kept = selection_metrics(t.s, t.lens, sel_cols, k, t.row_tol, t.recall, shared=t)
        for name, v in dict(exact=t.exact, recall=t.recall, jacc=t.jacc, pad_err=t.pad_err, dups=t.dups,
                            oor=t.oor.sum(1), below=t.below, nan=t.nan_scores.reshape(1),
                            **{f"kept_{n}": x for n, x in kept.items()}).items():
            per_row.setdefault(name, []).append(v)
    # one read-back: the per-row results
    t = SimpleNamespace(**{n: torch.cat(v).cpu() for n, v in per_row.items()})
    col = Collector()
    oor_rows = t.oor > 0
    flagged = (~t.exact | (t.below > 0) | (t.dups > 0) | oor_rows).nonzero().flatten()
    # every flagged row counted by its classes at once; findings written for those kept
    named = (t.pad_err[flagged], t.dups[flagged] > 0, oor_rows[flagged], t.below[flagged] > 0)
    for kd, has in zip(("padding", "duplicates", "out_of_range", "below_threshold"), named):
        col.count(kd, int(has.sum()))
    col.count("tie_swap", int((~(named[0] | named[1] | named[2] | named[3])).sum()))
    # a kept row's finding: its row alone through the same per-row pass
    col.keep_rows(flagged, lambda r: _row_finding(_cpu(rows_of(r, r + 1)), 0, r))
    kept = {n[len("kept_"):]: v for n, v in vars(t).items() if n.startswith("kept_")}
    metrics = _topk_metrics(t, kept, rw)
    notes = []
    nan_scores = int(t.nan.sum())
    if nan_scores:
        metrics["nonfinite_inputs"] = nan_scores
        notes.append(f"{nan_scores} NaN reference score(s) in the valid region")
    report = col.report(op, metrics, notes)
    report.rows = dict(recall=t.recall, exact=t.exact, mass=kept["mass"], lengths=lens)   # `recall_points`
    return report


def _cpu(t: SimpleNamespace) -> SimpleNamespace:
    """The tensors of `_topk_rows`' namespace on the CPU (one row's: a finding's)."""
    return SimpleNamespace(**{n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in vars(t).items()})


def _topk_rows(idx, s, lens, k: int, tol: Optional[float]) -> SimpleNamespace:
    """The per-row tensors of diff_topk: the returned set sorted (`srt`), its duplicates,
    out-of-range and below-threshold indices, the tie rule's k-th score and tolerance,
    recall, Jaccard, padding errors and whether each row is the reference's own set."""
    rw, w = s.shape
    dev = s.device
    cols = torch.arange(w, device=dev)
    valid_cols = cols[None, :] < lens[:, None]
    nan = torch.isnan(s)
    nan_scores = (nan & valid_cols).sum()
    fin = valid_cols & torch.isfinite(s)
    masked = torch.where(valid_cols & ~nan, s, -math.inf)
    pos_inf = bool((masked == math.inf).any())
    short = lens <= k
    kcols = torch.arange(k, device=dev)
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
    topv, topi = (torch.topk(masked, kk, dim=1) if w else
                  (torch.zeros(rw, 0, device=dev), torch.zeros(rw, 0, dtype=torch.long, device=dev)))
    kth = topv[:, -1] if kk else torch.zeros(rw, dtype=torch.float64, device=dev)
    finite_abs = torch.where(fin, s.abs(), 0.0)
    row_tol = (((finite_abs.amax(1) if w else torch.zeros(rw, dtype=torch.float64, device=dev)) * 1e-4) if tol is None
               else torch.full((rw,), float(tol), dtype=torch.float64, device=dev))
    sc = masked.gather(1, srt.clamp(0, max(w - 1, 0))) if w else torch.zeros_like(srt, dtype=torch.float64)
    acceptable = s_in & torch.where(short[:, None], torch.ones_like(s_in), sc >= (kth - row_tol)[:, None])
    m = acceptable.sum(1)
    below = (s_in & ~acceptable & ~short[:, None]).sum(1)
    ref_size = torch.minimum(lens, torch.tensor(k, device=dev))
    recall = torch.where(ref_size > 0, m.double() / ref_size.clamp_min(1).double(), 1.0)
    union = distinct_returned + ref_size - m
    jacc = torch.where(union > 0, m.double() / union.clamp_min(1).double(), 1.0)
    pad_err = torch.where(short, (idx != want_short).any(1), (idx == -1).any(1))
    ref_sorted = torch.where(kcols[None, :kk] < ref_size[:, None], topi, -1).sort(1).values if kk else topi
    exact_long = (srt[:, :kk] == ref_sorted).all(1) & (dups == 0) if kk else torch.ones(rw, dtype=torch.bool, device=dev)
    exact = torch.where(short, ~pad_err, exact_long & ~pad_err)
    return SimpleNamespace(idx=idx, s=s, lens=lens, k=k, kk=kk, nan_scores=nan_scores, short=short,
                           want_short=want_short, oor=oor, srt=srt, dups=dups, s_in=s_in, kth=kth,
                           row_tol=row_tol, acceptable=acceptable, below=below, recall=recall, jacc=jacc,
                           pad_err=pad_err, exact=exact, fin=fin, pos_inf=pos_inf,
                           topv=topv, topi=topi)


def _row_finding(t: SimpleNamespace, r: int, row: Optional[int] = None) -> dict:
    """The finding of row r of `t` (its classes first: padding, duplicates, out_of_range,
    below_threshold, or tie_swap when the set differs within the tie rule), reported as
    row `row` (default r)."""
    row = r if row is None else row
    L = int(t.lens[r])
    kinds = []
    if bool(t.pad_err[r]):
        kinds.append("padding")
    if int(t.dups[r]):
        kinds.append("duplicates")
    if bool(t.oor[r].any()):
        kinds.append("out_of_range")
    if int(t.below[r]):
        kinds.append("below_threshold")
    if not kinds:
        kinds.append("tie_swap")          # a different set, every index within the tie rule
    detail = f"row {row} (length {L}, k {t.k}): {', '.join(kinds)}"
    f = {"class": kinds[0], "classes": kinds, "row": row, "length": L,
         "recall": float(t.recall[r]), "duplicates": int(t.dups[r]),
         "out_of_range": int(t.oor[r].sum()), "below_threshold": int(t.below[r])}
    if not bool(t.short[r]) and t.kk:
        bad = t.srt[r][t.s_in[r] & ~t.acceptable[r]][:5].tolist()
        f.update({"kth_score": float(t.kth[r]), "tol": float(t.row_tol[r]), "first_below": bad,
                  "first_below_scores": [float(t.s[r, j]) for j in bad]})
        if bad:
            detail += (f"; e.g. index {bad[0]} scores {float(t.s[r, bad[0]]):.6g} < k-th "
                       f"{float(t.kth[r]):.6g} - tol {float(t.row_tol[r]):.3g}")
    else:
        wrong = (t.idx[r] != t.want_short[r]).nonzero().flatten()[:1].tolist()
        if wrong:
            c = wrong[0]
            detail += f"; position {c} holds {int(t.idx[r, c])}, expected {int(t.want_short[r, c])}"
    f["where"] = detail
    return f


def _topk_metrics(t: SimpleNamespace, kept: dict, rw: int) -> dict:
    metrics = {"topk_rows_not_exact_frac": float((~t.exact).sum()) / rw if rw else 0.0,
               "topk_recall_min": float(t.recall.min()) if rw else 1.0,
               "topk_jaccard_min": float(t.jacc.min()) if rw else 1.0,
               "topk_padding_errors": int(t.pad_err.sum()),
               "topk_duplicates": int(t.dups.sum()),
               "topk_out_of_range": int(t.oor.sum()),
               "topk_below_threshold": int(t.below.sum()),
               "topk_mass_kept_min": float(kept["mass"].min()) if rw else 1.0}
    lost = kept["rank_lost"][~torch.isnan(kept["rank_lost"])]
    if lost.numel():
        metrics["topk_rank_lost_min"] = float(lost.min())
    for top_m in TOP_M:
        if f"top{top_m}" in kept:
            metrics[f"topk_top{top_m}_kept_min"] = float(kept[f"top{top_m}"].min()) if rw else 1.0
    return metrics


def recall_rows(indices: torch.Tensor, ref_logits_fp64: torch.Tensor, lengths, k: int) -> list[list]:
    """[[row length, recall within the tie rule, 1 if the set is the reference's own else 0,
    proxy mass kept], ...] of the rows with a non-empty reference set (the recall plot: a
    row below 1 lost keys; a row at 1 marked 0 is a tie swap the rule accepts)."""
    return recall_points(diff_topk(indices, ref_logits_fp64, lengths, k).rows)


def recall_points(rows: dict) -> list[list]:
    """`recall_rows` from the per-row tensors a `diff_topk` report gave (its `rows`)."""
    return [[int(n), float(r), int(e), float(m)] for n, r, e, m in
            zip(rows["lengths"].tolist(), rows["recall"].tolist(), rows["exact"].tolist(), rows["mass"].tolist())
            if n > 0]
