"""Metrics of `mxval study`: selection recall, the sparse attention output, needles, intervals.

Scores are fp32 (the kernels accumulate in fp32); every operand is bf16-, FP8- or
MXFP4-valued, so the products are exact and only the 128-term sums round. NaN scores (a
cross-flavour FP8 read decodes 0x80 as NaN) sort first, as torch.topk sorts them: each
NaN key takes a slot of the top-k.
"""
from __future__ import annotations

import math

import torch

# two-sided 95 % Student-t quantiles by degrees of freedom
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def t975(df: int) -> float:
    if df <= 0:
        return float("nan")
    known = [d for d in _T975 if d <= df]
    return _T975[max(known)] if df <= 60 else 1.96


def interval(values) -> tuple[float, float]:
    """(mean, half-width of the 95 % t-interval of the mean); half is NaN for one value."""
    x = torch.as_tensor(list(values), dtype=torch.float64)
    n = x.numel()
    if n == 0:
        return float("nan"), float("nan")
    if n == 1:
        return float(x[0]), float("nan")
    return float(x.mean()), float(t975(n - 1) * x.std(unbiased=True) / math.sqrt(n))


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
    """What every variant of a context is compared with: the exact top-k, its k-th score and
    the entries the tie rule of NUMERICS.md §6 accepts (>= k-th - tol_rel * max|exact|)."""

    def __init__(self, exact: torch.Tensor, k: int, tol_rel: float = 1e-4):
        self.exact, self.k = exact, k
        vals, self.idx = torch.topk(exact, k, dim=1)
        kth = vals[:, -1:]
        self.acceptable = exact >= kth - tol_rel * exact.abs().amax(dim=1, keepdim=True)
        self.keep = torch.zeros_like(exact, dtype=torch.bool).scatter_(1, self.idx, True)
        self.kth_key = self.idx[:, -1:]


def row_metrics(exact: torch.Tensor, approx: torch.Tensor, k: int, tol_rel: float = 1e-4,
                ref: ExactTopK | None = None) -> dict:
    """exact, approx: [R, J] logits over the valid entries -> per-row tensors (fp64).

    recall: the share of the variant's top-k that is acceptable under the tie rule of
    NUMERICS.md §6 (exact score >= exact k-th - tol_rel * max|exact|); jaccard: of the two
    index sets; kth_rank: the rank, in the variant's order, of the exact k-th key."""
    r, j = exact.shape
    if j <= k:   # every entry is kept (and vLLM skips scoring): nothing to lose
        ones = torch.ones(r, dtype=torch.float64, device=exact.device)
        return {"recall": ones, "jaccard": ones, "kth_rank": torch.full_like(ones, float(j))}
    ref = ref or ExactTopK(exact, k, tol_rel)
    approx = nan_first(approx)
    ap_idx = torch.topk(approx, k, dim=1).indices
    keep = torch.zeros_like(exact, dtype=torch.bool).scatter_(1, ap_idx, True)
    exact_keep, acceptable, kth_key = ref.keep, ref.acceptable, ref.kth_key
    recall = (keep & acceptable).sum(1).double() / k
    jaccard = (keep & exact_keep).sum(1).double() / (keep | exact_keep).sum(1).double()
    kth_rank = (approx > approx.gather(1, kth_key)).sum(1).double() + 1
    return {"recall": recall, "jaccard": jaccard, "kth_rank": kth_rank}


class SparseAttention:
    """Attention of each query head over a selected set of entries, softmax at the model's
    scale (D**-0.5 on q.k) renormalized over the set, values generated per entry.
    The exact top-k's output is the reference a variant's selection is measured against."""

    def __init__(self, scores: torch.Tensor, values: torch.Tensor, exact_sel: torch.Tensor, scale: float):
        self.p = torch.softmax(scores * scale, dim=-1)                 # [R, H, J]
        self.v = values.float()                                        # [J, Dv]
        r, h, j = self.p.shape
        self.o_exact, self.mass_exact = self._over(exact_sel)
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
        top-k's output) and mass_kept (the attention mass of the selection over the
        exact top-k's, summed over heads)."""
        out, mass = self._over(sel)
        return {"out_err": _rel(out, self.o_exact),
                "mass_kept": (mass.sum(1) / self.mass_exact.sum(1)).double()}


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
