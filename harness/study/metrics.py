"""Metrics of `mxval study`: selection recall, the sparse attention output, needles, intervals.

Scores are fp32 (the kernels accumulate in fp32); every operand is bf16-, FP8- or
MXFP4-valued, so the products are exact and only the 128-term sums round. (The op
reference of NUMERICS.md §6 scores in fp64, to hold kernels to the true scores; an fp32
score is within a few fp32 ulps of it, far inside the tie rule's tolerance, and is what a
kernel's selection sees.) NaN scores (a
cross-flavour FP8 read decodes 0x80 as NaN) sort first, as torch.topk sorts them: each
NaN key takes a slot of the top-k.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from harness.diff.scores import TOP_M, mass_kept, score_weights

BOOT_REPS = 2000   # bootstrap resamples of the seeds


@functools.lru_cache(maxsize=64)
def _resamples(n: int, reps: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(reps, n))


def bootstrap(values, *, reps: int = BOOT_REPS, seed: int = 0) -> tuple[float, float]:
    """(mean, half-width of the 95 % percentile bootstrap interval of the mean): the seeds are
    resampled with replacement `reps` times (a fixed generator: the same values give the same
    interval); half is (97.5th - 2.5th percentile) / 2, NaN for fewer than two values."""
    x = np.asarray(list(values), dtype=np.float64)
    n = x.size
    if n == 0:
        return float("nan"), float("nan")
    if n == 1:
        return float(x[0]), float("nan")
    means = x[_resamples(n, reps, seed)].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(x.mean()), float(hi - lo) / 2


# --- scores -------------------------------------------------------------------------------

_TILE = 1 << 24   # per-head scores materialized at once


def head_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [R, H, D], k [J, D] -> q.k per head, fp32 [R, H, J]."""
    return torch.matmul(q.float(), k.float().T)


def indexer_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_h w[r,h] * relu(q[r,h] . k[j]) -> fp32 [R, J], a tile of J at a time."""
    r, h, _ = q.shape
    j = k.shape[0]
    out = torch.empty(r, j, dtype=torch.float32, device=q.device)
    jc = max(1, _TILE // max(1, r * h))
    wr = w.float().unsqueeze(1)                                        # [R, 1, H]
    for j0 in range(0, j, jc):
        s = torch.matmul(q.float(), k[j0:j0 + jc].float().T).clamp_min_(0)   # NaN stays NaN
        out[:, j0:j0 + jc] = torch.bmm(wr, s).squeeze(1)
    return out


def nan_first(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=float("inf"))


def select(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [R, k] of the top-k (NaN counted as the largest)."""
    return torch.topk(nan_first(logits), k, dim=1).indices


class ExactTopK:
    """What every variant of a context is compared with: the exact top-k in exact-rank order
    (idx[:, i] holds exact rank i + 1), its k-th score and the entries the tie rule of
    NUMERICS.md §6 accepts (>= k-th - tol_rel * max|exact| over the row's valid entries).
    Entries past a row's end are -inf in `exact`."""

    def __init__(self, exact: torch.Tensor, k: int, tol_rel: float = 1e-4):
        self.exact, self.k = exact, k
        vals, self.idx = torch.topk(exact, k, dim=1)
        self.kth = vals[:, -1]
        self.valid = torch.isfinite(exact)
        amax = torch.where(self.valid, exact.abs(), torch.zeros_like(exact)).amax(dim=1, keepdim=True)
        self.acceptable = exact >= vals[:, -1:] - tol_rel * amax
        self.keep = torch.zeros_like(exact, dtype=torch.bool).scatter_(1, self.idx, True)
        self.kth_key = self.idx[:, -1:]
        self.sd = None                 # the exact logits' SD per row, once asked for
        self.proxy_w = None            # the reports' mass proxy over the exact logits, once asked for


OVER_SELECT = (1.0, 1.25, 1.5, 2.0)        # k' / k of the over-selection sweep


def over_select(k: int) -> tuple[int, ...]:
    """The k' of the over-selection sweep for a top-k (1024 -> 1024, 1280, 1536, 2048)."""
    return tuple(dict.fromkeys(max(1, round(k * f)) for f in OVER_SELECT))


def row_metrics(exact: torch.Tensor, approx: torch.Tensor, k: int, tol_rel: float = 1e-4,
                ref: ExactTopK | None = None, top_m=TOP_M, over=None) -> dict:
    """exact, approx: [R, J] logits (-inf past a row's end) -> per-row tensors (fp64).

    recall: the share of the variant's top-k that is acceptable under the tie rule of
    NUMERICS.md §6; jaccard: of the two index sets; kth_rank: the rank, in the variant's
    order, of the exact k-th key; top{m}: the share of the exact top-m in the variant's top-k;
    miss_*: the exact ranks of the exact top-k keys the variant's top-k lacks (their count,
    median, the best one, and the count in each quarter of 1..k); cover{k'}: the share of the
    exact top-k in the variant's top-k' (over-selection)."""
    r, j = exact.shape
    if j <= k:   # every entry is kept (and vLLM skips scoring): nothing to lose
        ones = torch.ones(r, dtype=torch.float64, device=exact.device)
        return {"recall": ones, "jaccard": ones, "kth_rank": torch.full_like(ones, float(j))}
    ref = ref or ExactTopK(exact, k, tol_rel)
    approx = nan_first(approx)
    over = over_select(k) if over is None else tuple(over)
    kmax = min(j, max((k,) + over))
    order = torch.topk(approx, kmax, dim=1).indices                    # the variant's order
    # the variant's rank (0-based) of every entry in its top-kmax; kmax for the rest
    pos = torch.full_like(exact, kmax, dtype=torch.int32).scatter_(
        1, order, torch.arange(kmax, dtype=torch.int32, device=exact.device).expand(r, kmax).contiguous())
    keep = pos < k
    recall = (keep & ref.acceptable).sum(1).double() / k
    inter = (keep & ref.keep).sum(1).double()
    jaccard = inter / (2 * k - inter)
    kth_rank = (approx > approx.gather(1, ref.kth_key)).sum(1).double() + 1
    at = pos.gather(1, ref.idx)                                          # [R, k] by exact rank
    held = at < k
    ranks = torch.arange(1, k + 1, device=exact.device, dtype=torch.float64).expand(r, k)
    missed = ~held
    out = {"recall": recall, "jaccard": jaccard, "kth_rank": kth_rank,
           "miss_n": missed.sum(1).double(),
           "miss_rank_median": torch.where(missed, ranks, torch.nan).nanmedian(1).values,
           "miss_rank_best": torch.where(missed, ranks, torch.inf).amin(1)}
    for qi in range(4):
        out[f"miss_q{qi + 1}"] = missed[:, qi * k // 4:(qi + 1) * k // 4].sum(1).double()
    for m in top_m:   # (a top-m wider than the top-k is not measured)
        out[f"top{m}"] = held[:, :m].double().mean(1) if m <= k else torch.full_like(recall, torch.nan)
    for kp in over:
        out[f"cover{kp}"] = (at < min(kp, kmax)).double().mean(1)
    return out


def _sd(x: torch.Tensor, ok: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Per row: the SD of x over the entries `ok` (n of them), fp64 sums."""
    x = torch.where(ok, x, torch.zeros_like(x)).double()
    s1, s2 = x.sum(1), x.square().sum(1)
    return ((s2 - s1 * s1 / n) / (n - 1)).clamp_min(0).sqrt()


def noise_metrics(ref: ExactTopK, approx: torch.Tensor, m: int = TOP_M[0]) -> dict:
    """The variant's logit error against the selection's margins, per row (fp64):
    noise_rel: SD of (variant - exact) over the SD of the exact logits; near_kth: how many
    entries lie within one noise SD of the exact k-th score; noise_gap: the noise SD over the
    gap between the exact m-th and k-th scores (what a top-m key must lose to drop out).
    Entries past a row's end and non-finite variant scores are left out."""
    ex = ref.exact
    m = min(m, ref.k)
    ok = ref.valid & torch.isfinite(approx)
    n = ok.sum(1).clamp_min(2).double()
    noise = _sd(approx - ex, ok, n)
    if ref.sd is None:
        ref.sd = _sd(ex, ref.valid, ref.valid.sum(1).clamp_min(2).double())
    kth = ref.kth.double()
    gap = ex.gather(1, ref.idx[:, m - 1:m])[:, 0].double() - kth
    near = (ok & ((ex - ref.kth[:, None]).abs() <= noise.float()[:, None])).sum(1).double()
    return {"noise_rel": noise / ref.sd.clamp_min(1e-300), "near_kth": near,
            "noise_gap": noise / gap.clamp_min(1e-300)}


class SparseAttention:
    """Attention of each query head over a selected set of entries, softmax at the model's
    scale (D**-0.5 on q.k) renormalized over the set, values generated per entry.
    The exact top-k's output is the reference a variant's selection is measured against."""

    def __init__(self, scores: torch.Tensor, values: torch.Tensor, exact_sel: torch.Tensor, scale: float,
                 valid: torch.Tensor | None = None):
        x = scores * scale
        if valid is not None:                                          # [R, J]: entries before the row's end
            x = x.masked_fill(~valid[:, None, :], float("-inf"))
        self.p = torch.softmax(x, dim=-1)                              # [R, H, J]
        self.v = values.float()                                        # [J, Dv]
        r, h, j = self.p.shape
        self.exact_sel = exact_sel
        self.o_exact, self.mass_exact = self._over(exact_sel)
        self.w_heads = self.p.sum(1).double()                          # [R, J]: mass_kept sums over heads
        dense = (self.p.reshape(r * h, j) @ self.v).reshape(r, h, -1)
        self.topk_mass = self.mass_exact.mean(1).double()              # [R]: share the top-k holds
        self.topk_vs_dense = _rel(self.o_exact, dense)

    def _over(self, sel: torch.Tensor):
        r, h, _ = self.p.shape
        ps = self.p.gather(2, sel[:, None, :].expand(r, h, sel.shape[1]))      # [R, H, k]
        mass = ps.sum(-1)
        out = torch.bmm(ps, self.v[sel]) / mass[..., None]
        return out, mass

    def cost(self, sel: torch.Tensor) -> dict:
        """-> per row: out_err (relative L2 over heads and value dims against the exact
        top-k's output) and mass_kept (harness.diff.scores.mass_kept, the one formula the
        reports use too, of the heads' attention probabilities: the mass the selection
        holds over the mass the exact top-k holds, summed over heads, at most 1)."""
        out, _ = self._over(sel)
        return {"out_err": _rel(out, self.o_exact), "mass_kept": mass_kept(self.w_heads, sel, self.exact_sel)}


def proxy_mass_kept(ref: "ExactTopK", sel: torch.Tensor) -> torch.Tensor:
    """Per row: `mass_kept` of the reports' proxy (harness.diff.scores.MASS_PROXY: the softmax
    of the exact indexer logits over the row's entries)."""
    if ref.proxy_w is None:
        ref.proxy_w = score_weights(ref.exact, ref.valid)
    return mass_kept(ref.proxy_w, sel, ref.idx)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row (dim 0): ||a - ref|| / ||ref|| over the remaining dims, fp64."""
    d = (a.double() - ref.double()).flatten(1).norm(dim=1)
    return d / ref.double().flatten(1).norm(dim=1).clamp_min(1e-300)


def needles_kept(logits: torch.Tensor, scores: torch.Tensor, cols: torch.Tensor, k: int):
    """A needle replaces column `cols[r, n]` of row r and scores `scores[r, n]`: is it in the
    top-k? Ties go against the needle. -> (kept [R, N] bool, rank [R, N] among the others + 1)."""
    lg = nan_first(logits)
    sc = nan_first(scores).to(lg.dtype).contiguous()
    srt = torch.sort(lg, dim=1).values
    ge = lg.shape[1] - torch.searchsorted(srt, sc, right=False)
    ge = ge - (lg.gather(1, cols) >= sc).long()
    return ge < k, ge + 1
