"""Reports of `mxval study`: what each variant's selection keeps (attention mass, the exact
top-m, the ranks of the keys it misses) with recall beside it, over-selection, logit noise
against the selection's margins, the needle sweep, the known-bug controls, the study set
beside reported end-to-end results, and a decision section whose every claim is computed
from the run.

Intervals: the unit of replication is the seed (it redraws outlier channels, key subspace,
norm weight, head-weight projection, queries, keys and values), so a cell is the mean over
seeds of the per-seed means, and its interval the 95 % percentile bootstrap over seeds
(harness.study.metrics.bootstrap). Needle proportions pool the needles of all seeds and
state their count n; whether depth matters is a chi-square test of equal proportions,
Bonferroni-corrected.
"""
from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import math
from pathlib import Path

import pandas as pd
import torch
from matplotlib.figure import Figure

from harness.io import atomic, escape
from harness.study.metrics import TOP_M, bootstrap, over_select
from harness.study.variants import VARIANTS

FP8, MX, MXH = "fp8-e4m3fn", "mxfp4", "mxfp4+H"
HEADLINE = ((FP8, "FP8"), (MX, "MXFP4"), (MXH, "MXFP4 + Hadamard"))
STATS = (("k_block_crest", "key 32-block crest factor (amax/RMS)"),
         ("k_kurtosis", "key kurtosis after the norm"),
         ("k_channel_ratio", "key channel RMS, max/median"))

# End-to-end evaluations reported with an FP8 and an MXFP4 (FP4) indexer, as their sources
# give them: (short name, source, model, benchmark, questions, FP8, MXFP4, note)
END_TO_END = (
    ("vLLM", "the vLLM change that adds the MXFP4 indexer cache on ROCm (its reported evaluation)", "DeepSeek-V4",
     "GSM8K", 1319, "0.9492", "0.9477", ""),
    ("vLLM", "the same change", "DeepSeek-V4", "GPQA-Diamond", 198, "0.7121", "0.7121",
     "124 questions right in both runs; 17 right only with FP8, 17 only with MXFP4"),
    ("sglang #26209", "sglang #26209 (sgl-project/sglang pull request 26209)", "DeepSeek-V4-Flash", "GSM8K", 1319,
     "0.980", "0.965", ""),
    ("ROCm/ATOM #2216", "ROCm/ATOM #2216 (ROCm/ATOM pull request 2216)", "DeepSeek-V4", "GSM8K", 1319, "0.9682",
     "0.9636", ""),
)


def distribution_fields(d) -> dict:
    """The fields of a distribution that differ from the defaults."""
    default = type(d)()
    return {f.name: getattr(d, f.name) for f in dataclasses.fields(d)
            if f.name != "name" and getattr(d, f.name) != getattr(default, f.name)}


# --- frames and cells ---------------------------------------------------------------------


def frames(result: dict):
    """-> (rows, needles, inputs, merged) with the rows of variants whose operands repeated
    another's exactly on every input removed; merged: {variant: merge record}."""
    rows = pd.DataFrame(result.get("rows", []))
    needles = pd.DataFrame(result.get("needles", []))
    inputs = pd.DataFrame(result.get("inputs", []))
    merged = {n: m for n, m in result.get("merges", {}).items() if m["values"] and m["differ"] == 0
              and not rows.empty and m["into"] in set(rows.variant)}
    if merged:
        rows = rows[~rows.variant.isin(merged)]
        if not needles.empty:
            needles = needles[~needles.variant.isin(merged)]
    return rows, needles, inputs, merged


class Cells:
    """Per (distribution, variant, context): the mean over seeds of a column and the half-width
    of its bootstrap interval, computed once per column."""

    def __init__(self, sel, topk: int = 1024):
        self.sel, self.topk = sel, topk
        self._cols: dict = {}

    def table(self, col: str) -> dict:
        if col not in self._cols:
            out = {}
            if col in self.sel:
                for key, g in self.sel.groupby(["distribution", "variant", "context_tokens"])[col]:
                    vals = [x for x in g.tolist() if x == x and abs(x) != math.inf]
                    out[(key[0], key[1], int(key[2]))] = bootstrap(vals) if vals else (float("nan"), float("nan"))
            self._cols[col] = out
        return self._cols[col]

    def get(self, d, v, c, col) -> tuple[float, float]:
        return self.table(col).get((d, v, int(c)), (float("nan"), float("nan")))

    def mean(self, d, v, c, col) -> float:
        return self.get(d, v, c, col)[0]

    def fmt(self, d, v, c, col, digits=3) -> str:
        return _fmt(*self.get(d, v, c, col), digits=digits)

    def has(self, d, v, c) -> bool:
        return (d, v, int(c)) in self.table("recall")


def paired(sel, a: str, b: str, col: str = "recall") -> dict:
    """{(distribution, context): (mean, half)} of col[a] - col[b], paired by seed."""
    sub = sel[sel.variant.isin([a, b])]
    if sub.empty or col not in sub:
        return {}
    p = sub.pivot_table(index=["distribution", "context_tokens", "seed"], columns="variant", values=col)
    if a not in p or b not in p:
        return {}
    diff = (p[a] - p[b]).dropna()
    return {(d, int(c)): bootstrap(g.tolist()) for (d, c), g in diff.groupby(level=[0, 1])}


def _fmt(mean, half=float("nan"), digits=3) -> str:
    if mean != mean:
        return "–"
    if half != half:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def _ctx(c) -> str:
    return f"{int(c) // 1024}k"


def _label(v: str, merged: dict) -> str:
    twins = [n for n, m in merged.items() if m["into"] == v]
    return " = ".join([v] + twins)


def _cost_variants(rows) -> list[str]:
    present = set(rows.variant)
    return [n for n, v in VARIANTS.items() if v.kind == "cost" and n in present]


def _dist_order(rows, meta) -> list[str]:
    order = [d for d in meta.get("distributions", []) if d in set(rows.distribution)]
    return order + [d for d in dict.fromkeys(rows.distribution) if d not in order]


def _range(xs, fmt="{:.3f}") -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "–"
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}–{hi}"


def _names(ds) -> str:
    return ", ".join(f"`{d}`" for d in ds)


# --- the decision, from the numbers --------------------------------------------------------


def _status(mean, half, tol) -> str:
    if half != half:                       # one seed: no interval, judge the mean
        return "within" if mean <= tol else "behind"
    if mean + half <= tol:
        return "within"
    if mean - half > tol:
        return "behind"
    return "undecided"


def verdicts(sel, tol: float, variant: str, against: str = FP8) -> dict:
    """{distribution: {context: (status, gap mean, gap half)}} of `against` - `variant` recall."""
    out = {}
    for (dist, ctx), (m, h) in paired(sel, against, variant).items():
        out.setdefault(dist, {})[ctx] = (_status(m, h, tol), m, h)
    return out


def _oversel_reach(cells, d, v, c) -> int | None:
    """The smallest k' of the sweep whose top-k' holds as much of the exact top-k as FP8's top-k."""
    ks = over_select(cells.topk)
    target = cells.mean(d, FP8, c, f"cover{ks[0]}")
    for kp in ks:
        m = cells.mean(d, v, c, f"cover{kp}")
        if m == m and target == target and m >= target:
            return kp
    return None


@dataclasses.dataclass
class _Decide:
    """What every decision paragraph reads: the selection rows at the longest context."""
    sel: object
    cells: Cells
    variants: set
    dists: list
    longest: int
    L: str
    k: int
    tol: float

    def over(self, v, col):
        return [self.cells.mean(d, v, self.longest, col) for d in self.dists]

    def headline(self):
        """(variant, name) of each headline variant this run holds."""
        return [(v, name) for v, name in HEADLINE[1:] if v in self.variants]


def _mass_lines(x: _Decide) -> list[str]:
    over, L, k = x.over, x.L, x.k
    chance = over("exact", "mass_kept_chance")
    return [f"- **{name}** keeps {_range(over(v, 'mass_kept'))} of the exact top-k's attention mass at {L} "
            f"across the {len(x.dists)} distributions (FP8 {_range(over(FP8, 'mass_kept'))}; a random "
            f"top-k keeps {_range(chance)}), {_range(over(v, 'top64'))} of the exact top-64 and "
            f"{_range(over(v, 'top256'))} of the exact top-256 (FP8 {_range(over(FP8, 'top64'))} and "
            f"{_range(over(FP8, 'top256'))}). The exact top-k keys it misses sit at a median exact rank "
            f"of {_range(over(v, 'miss_rank_median'), '{:.0f}')} of {k}."
            for v, name in x.headline()]


def _recall_lines(x: _Decide) -> list[str]:
    lines = []
    tol = x.tol
    for v, name in x.headline():
        vd = verdicts(x.sel, tol, v)
        groups = {s: [d for d in x.dists if vd.get(d, {}).get(x.longest, ("",))[0] == s]
                  for s in ("within", "behind", "undecided")}
        text = (f"- **By recall** (the share of its top-k the exact indexer keeps too), {name} scores "
                f"{_range(x.over(v, 'recall'))} at {x.L} against FP8's {_range(x.over(FP8, 'recall'))}: within "
                f"{tol:g} of FP8 on " + (_names(groups["within"]) or "no distribution"))
        if groups["behind"]:
            text += f"; more than {tol:g} behind on " + _names(groups["behind"])
        if groups["undecided"]:
            text += "; undecided on " + _names(groups["undecided"])
        lines.append(text + ".")
    return lines


def _parting_lines(x: _Decide) -> list[str]:
    """Why the two readings differ: noise against the margins at the cut."""
    if MX not in x.variants:
        return []
    over, L, k, cells, longest, dists = x.over, x.L, x.k, x.cells, x.longest, x.dists
    q4 = [cells.mean(d, MX, longest, "miss_q4") / cells.mean(d, MX, longest, "miss_n")
          if cells.mean(d, MX, longest, "miss_n") else float("nan") for d in dists]
    lines = [f"- **Where recall and mass part**: at {L} MXFP4's logit noise is "
             f"{_range(over(MX, 'noise_rel'))} of the logits' SD (FP8 {_range(over(FP8, 'noise_rel'))}); "
             f"{_range(over(MX, 'near_kth'), '{:.0f}')} entries lie within one noise SD of the exact k-th "
             f"score (FP8 {_range(over(FP8, 'near_kth'), '{:.0f}')}), and {_range(q4, '{:.0%}')} of "
             f"MXFP4's misses are exact ranks {3 * k // 4 + 1}–{k}. The exact top-k holds "
             f"{_range(over('exact', 'topk_mass'), '{:.1%}')} of a head's attention mass where a random "
             f"top-k holds {_range(over('exact', 'chance_mass'), '{:.1%}')}."]
    lossy = [d for d in dists for v in (MX, MXH) if v in x.variants
             and (cells.mean(d, v, longest, "mass_kept") < 0.99 or cells.mean(d, v, longest, "top64") < 0.99)]
    lossy = list(dict.fromkeys(lossy))
    if not lossy:
        lines.append(f"  On every distribution here both MXFP4 variants keep at least 0.99 of the mass and of "
                     f"the exact top-64 at {L}: their recall gap counts exchanges of keys near the cut, which "
                     "hold little of the mass.")
    else:
        rest = [d for d in dists if d not in lossy]
        lines.append(f"  On {_names(lossy)} an MXFP4 variant keeps less than 0.99 of the mass or of the exact "
                     f"top-64 at {L}: there its misses reach keys that hold mass"
                     + (f"; on {_names(rest)} both keep at least 0.99 of each." if rest else "."))
    return lines


def _oversel_lines(x: _Decide) -> list[str]:
    lines = []
    k = x.k
    for v, name in x.headline():
        reach = {d: _oversel_reach(x.cells, d, v, x.longest) for d in x.dists}
        by = {}
        for d, kp in reach.items():
            by.setdefault(kp, []).append(d)
        parts = [f"k′ = {kp} on {_names(ds)}" for kp, ds in sorted(by.items(), key=lambda x: x[0] or 1 << 30)
                 if kp is not None]
        if None in by:
            parts.append(f"not within k′ ≤ {over_select(k)[-1]} on {_names(by[None])}")
        lines.append(f"- **Over-selection**: {name}'s top-k′ holds as much of the exact top-{k} as FP8's top-{k} from "
                     + "; ".join(parts) + f" ({name}'s top-{over_select(k)[-1]} holds "
                     f"{_range(x.over(v, f'cover{over_select(k)[-1]}'))} of it).")
    return lines


def _rotation_lines(x: _Decide) -> list[str]:
    """What the rotation changes."""
    if not {MX, MXH} <= x.variants:
        return []
    lines = []
    for col, what in (("mass_kept", "mass kept"), ("recall", "recall")):
        eff = paired(x.sel, MXH, MX, col)
        moved, none = [], []
        for d in x.dists:
            if (d, x.longest) not in eff:
                continue
            m, h = eff[(d, x.longest)]
            (none if h == h and abs(m) <= h else moved).append((d, m, h))
        digits = 4 if col == "mass_kept" else 3
        text = f"- **The Hadamard rotation** changes MXFP4's {what} at {x.L} on " + (
            ", ".join(f"`{d}` ({'+' if m > 0 else '−'}{_fmt(abs(m), h, digits)})" for d, m, h in moved)
            or "no distribution")
        if none:
            text += "; it makes no measurable difference on " + _names(d for d, _, _ in none)
        lines.append(text + ".")
    return lines


_DECISION = (_mass_lines, _recall_lines, _parting_lines, _oversel_lines, _rotation_lines)


def decision_lines(rows, needles, inputs, meta: dict) -> list[str]:
    """The decision section: every claim computed from the tables of this run."""
    sel = rows[rows.selection]
    if sel.empty:
        return ["No context here exceeds top-k entries: every variant keeps every entry; nothing to decide."]
    variants = set(sel.variant)
    if FP8 not in variants or not ({MX, MXH} & variants):
        return [f"The decision compares {MX} and {MXH} with {FP8}; this run lacks them."]
    k = int(meta.get("topk", 1024))
    longest = int(sel.context_tokens.max())
    x = _Decide(sel, Cells(sel, k), variants, _dist_order(sel, meta), longest, _ctx(longest), k,
                float(meta.get("tolerance", 0.01)))
    lines = [line for section in _DECISION for line in section(x)]
    return lines + _needle_lines(needles, meta, longest)


# --- needles ------------------------------------------------------------------------------


def _pooled(needles, keys):
    g = needles.groupby(keys)[["kept", "n"]].sum()
    g["frac"] = g["kept"] / g["n"].where(g["n"] > 0)
    return g


def homogeneity_p(kept: list[int], n: list[int]) -> float:
    """p-value of the chi-square test that every group keeps the same share."""
    tot, tot_n = sum(kept), sum(n)
    if tot_n == 0 or tot in (0, tot_n) or len(n) < 2:
        return 1.0
    p = tot / tot_n
    chi2 = sum((k - m * p) ** 2 / (m * p * (1 - p)) for k, m in zip(kept, n) if m)
    df = sum(1 for m in n if m) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def _needle_lines(needles, meta, longest) -> list[str]:
    if needles is None or needles.empty:
        return []
    nd = needles[needles.context_tokens == longest]
    if nd.empty:
        return []
    L = _ctx(longest)
    lines = []
    g = _pooled(nd, ["distribution", "variant", "margin"])
    margins = sorted(nd.margin.unique())
    dists = _dist_order(nd, meta)
    for v in (FP8, MX, MXH):
        if v not in set(nd.variant):
            continue
        knees = {}
        for d in dists:
            ok = [m for m in margins if (d, v, m) in g.index and g.loc[(d, v, m), "frac"] >= 0.99]
            knees[d] = ok[0] if ok else None
        reached = {d: m for d, m in knees.items() if m is not None}
        top = margins[-1]
        fr = [g.loc[(d, v, top), "frac"] for d in dists if (d, v, top) in g.index]
        text = (f"- **Needles** at {L}, {v}: {_range(fr, '{:.2f}')} kept at a {top:.0%} margin across distributions; "
                if fr else f"- **Needles** at {L}, {v}: ")
        if reached:
            by = {}
            for d, m in reached.items():
                by.setdefault(m, []).append(d)
            text += "99 % kept from a margin of " + "; ".join(
                f"{m:.0%} on " + _names(ds) for m, ds in sorted(by.items()))
            rest = [d for d in dists if d not in reached]
            if rest:
                text += f"; below 99 % up to {top:.0%} on " + _names(rest)
        else:
            text += f"below 99 % at every margin up to {top:.0%} on every distribution"
        lines.append(text + ".")
    depths = sorted(nd.depth.unique())
    if len(depths) > 1:
        mid = margins[len(margins) // 2]
        gd = _pooled(nd[nd.margin == mid], ["distribution", "variant", "depth"])
        tests = []
        for d in dists:
            for v in (MX, MXH, FP8):
                cells = [gd.loc[(d, v, dp)] for dp in depths if (d, v, dp) in gd.index]
                if len(cells) == len(depths):
                    tests.append((d, v, homogeneity_p([int(c["kept"]) for c in cells], [int(c["n"]) for c in cells]),
                                  {dp: c["frac"] for dp, c in zip(depths, cells)}))
        alpha = 0.05 / max(1, len(tests))
        moved = [f"`{d}` {v} (kept {', '.join(f'{fr[dp]:.2f}' for dp in depths)} at depths "
                 f"{', '.join(f'{dp:g}' for dp in depths)}; p = {p:.1e})" for d, v, p, fr in tests if p < alpha]
        lines.append(f"- **Depth** (needles at a {mid:.0%} margin, {L}; χ² test of equal shares across depths, "
                     f"Bonferroni over {len(tests)} tests): " + ("it matters for " + "; ".join(moved) if moved
                     else "no variant's needle retention moves with depth beyond chance") + ".")
    return lines


def _failed_needles(needles, longest) -> str:
    """Needles whose bisection found no placement, by distribution and margin."""
    if needles is None or needles.empty or "tried" not in needles:
        return ""
    nd = needles[(needles.context_tokens == longest) & (needles.variant == "exact")]
    g = nd.groupby(["distribution", "margin"])[["tried", "n"]].sum()
    g = g[g["tried"] > g["n"]]
    tried = int(nd["tried"].sum())
    if g.empty:
        return f"Every needle was placed ({tried} at {_ctx(longest)})."
    failed = int((g["tried"] - g["n"]).sum())
    return (f"{failed} of {tried} needles at {_ctx(longest)} could not be placed (the bisection found no move "
            "within ±8 noise norms that reaches the margin) and are left out of n: "
            + ", ".join(f"`{d}` at {m:.0%}: {int(r.tried - r.n)} of {int(r.tried)}" for (d, m), r in g.iterrows())
            + ".")


def needle_table(needles, merged, meta, longest, *, full=False) -> list[str]:
    if needles is None or needles.empty:
        return []
    ctx_list = sorted(needles.context_tokens.unique()) if full else [longest]
    lines = []
    margins = sorted(needles.margin.unique())
    for ctx in ctx_list:
        nd = needles[needles.context_tokens == ctx]
        if nd.empty:
            continue
        g = _pooled(nd, ["distribution", "variant", "margin"])
        ex = nd[nd.variant == "exact"].groupby(["distribution", "margin"])["rank_median"].median()
        costs = _cost_variants(nd)
        variants = costs + [v for v in VARIANTS if VARIANTS[v].kind == "bug" and v in set(nd.variant)] if full \
            else [v for v in costs if v in (FP8, MX, MXH)] or costs
        lines += ["", f"Needles kept at {_ctx(ctx)} (share of the n needles placed, pooled over seeds and depths; "
                      "per distribution, the first row gives n per margin and the second the needles' median "
                      "exact rank" + ("" if full else "; every variant and context in study.md") + "):", "",
                  "| distribution | variant | " + " | ".join(f"{m:.0%}" for m in margins) + " |",
                  "|---" * (2 + len(margins)) + "|"]
        for d in _dist_order(nd, meta):
            lines.append(f"| `{d}` | n | " + " | ".join(
                f"{int(g.loc[(d, 'exact', m), 'n'])}" if (d, "exact", m) in g.index else "–" for m in margins) + " |")
            lines.append("| | exact rank | " + " | ".join(
                f"{ex.loc[(d, m)]:.0f}" if (d, m) in ex.index else "–" for m in margins) + " |")
            for v in variants:
                cells = [f"{g.loc[(d, v, m), 'frac']:.3f}" if (d, v, m) in g.index else "–" for m in margins]
                lines.append(f"| | {_label(v, merged)} | " + " | ".join(cells) + " |")
    return lines


def depth_table(needles, meta, longest, variant=MX) -> list[str]:
    if needles is None or needles.empty:
        return []
    nd = needles[(needles.context_tokens == longest) & (needles.variant == variant)]
    if nd.empty or nd.depth.nunique() < 2:
        return []
    margins = sorted(nd.margin.unique())
    mid = margins[len(margins) // 2]
    g = _pooled(nd[nd.margin == mid], ["distribution", "depth"])
    depths = sorted(nd.depth.unique())
    lines = ["", f"{variant} needles kept by depth at {_ctx(longest)}, {mid:.0%} margin (share kept / n placed; "
                 "0 = the oldest entry after any sinks, 1 = the newest entry every query row sees):", "",
             "| distribution | " + " | ".join(f"{dp:g}" for dp in depths) + " |",
             "|---" * (1 + len(depths)) + "|"]
    for d in _dist_order(nd, meta):
        lines.append(f"| `{d}` | " + " | ".join(
            f"{g.loc[(d, dp), 'frac']:.3f} / {int(g.loc[(d, dp), 'n'])}" if (d, dp) in g.index else "–"
            for dp in depths) + " |")
    return lines


# --- tables -------------------------------------------------------------------------------


def _stats_line(inputs, d, rows=None) -> str:
    if inputs is None or inputs.empty or d not in set(inputs.distribution):
        return ""
    s = inputs[inputs.distribution == d]
    text = ("Keys after the norm: kurtosis {:.1f}, 32-block crest {:.2f}, channel RMS max/median {:.1f}; "
            "queries: crest {:.2f}, channel ratio {:.1f} (means over seeds).").format(
        s.k_kurtosis.mean(), s.k_block_crest.mean(), s.k_channel_ratio.mean(), s.q_block_crest.mean(),
        s.q_channel_ratio.mean())
    if rows is not None and "recent_share" in rows:
        ex = rows[(rows.distribution == d) & (rows.variant == "exact") & rows.selection]
        if not ex.empty:
            c = ex.context_tokens.max()
            text += (f" At {_ctx(c)} the exact top-k takes {ex[ex.context_tokens == c].recent_share.mean():.0%} "
                     "of its entries from the newest quarter of each row's context.")
    return text


def headline_table(sel, meta, merged, longest, variants=None, proxy=False) -> list[str]:
    cells = Cells(sel)
    variants = variants or [v for v, _ in HEADLINE if v in set(sel.variant)]
    k = int(meta.get("topk", 1024))
    lines = ["| distribution | exact top-k's mass (random top-k's) | variant | mass kept | top-64 kept | "
             "top-256 kept | misses: median exact rank | recall |" + (" proxy mass kept |" if proxy else ""),
             "|---" * (9 if proxy else 8) + "|"]
    for d in _dist_order(sel, meta):
        first = True
        for v in variants:
            if not cells.has(d, v, longest):
                continue
            lead = (f"| `{d}` | {cells.mean(d, 'exact', longest, 'topk_mass'):.1%} "
                    f"({cells.mean(d, 'exact', longest, 'chance_mass'):.1%}) |") if first else "| | |"
            first = False
            lines.append(f"{lead} {_label(v, merged)} | {cells.fmt(d, v, longest, 'mass_kept', 4)} | "
                         f"{cells.fmt(d, v, longest, 'top64')} | {cells.fmt(d, v, longest, 'top256')} | "
                         f"{cells.fmt(d, v, longest, 'miss_rank_median', 0)} of {k} | "
                         f"{cells.fmt(d, v, longest, 'recall')} |"
                         + (f" {cells.fmt(d, v, longest, 'proxy_mass_kept', 4)} |" if proxy else ""))
    return lines


def oversel_table(sel, meta, merged, longest, variants) -> list[str]:
    cells = Cells(sel)
    k = int(meta.get("topk", 1024))
    ks = over_select(k)
    lines = ["| distribution | variant | " + " | ".join(f"top-{kp}" for kp in ks) + " |",
             "|---" * (2 + len(ks)) + "|"]
    for d in _dist_order(sel, meta):
        first = True
        for v in variants:
            if not cells.has(d, v, longest):
                continue
            lines.append(f"| {'`' + d + '`' if first else ''} | {_label(v, merged)} | "
                         + " | ".join(cells.fmt(d, v, longest, f"cover{kp}") for kp in ks) + " |")
            first = False
    return [f"Share of the exact top-{k} inside the variant's top-k′:", ""] + lines


def noise_table(sel, meta, merged, longest, variants) -> list[str]:
    cells = Cells(sel)
    k = int(meta.get("topk", 1024))
    m = TOP_M[0]
    lines = ["| distribution | variant | noise SD / logit SD | entries within one noise SD of the k-th score | "
             f"noise SD / (exact {m}th − k-th score) | misses per row | share of misses in exact ranks "
             + ", ".join(f"{q * k // 4 + 1}–{(q + 1) * k // 4}" for q in range(4)) + " | best exact rank lost |",
             "|---" * 8 + "|"]
    for d in _dist_order(sel, meta):
        first = True
        for v in variants:
            if not cells.has(d, v, longest):
                continue
            n = cells.mean(d, v, longest, "miss_n")
            bands = " / ".join(f"{cells.mean(d, v, longest, f'miss_q{q + 1}') / n:.0%}" if n else "–"
                               for q in range(4))
            best = sel[(sel.distribution == d) & (sel.variant == v) & (sel.context_tokens == longest)]
            best = best["miss_rank_best"].min() if "miss_rank_best" in best else float("nan")
            lines.append(f"| {'`' + d + '`' if first else ''} | {_label(v, merged)} | "
                         f"{cells.fmt(d, v, longest, 'noise_rel')} | {cells.fmt(d, v, longest, 'near_kth', 0)} | "
                         f"{cells.fmt(d, v, longest, 'noise_gap')} | {cells.fmt(d, v, longest, 'miss_n', 1)} | "
                         f"{bands} | {'none' if best != best or best == math.inf else int(best)} |")
            first = False
    return lines


def distribution_tables(rows, inputs, merged, meta, *, full: bool = False) -> list[str]:
    sel = rows[rows.selection]
    cells = Cells(sel)
    lines = []
    ctxs = sorted(int(c) for c in sel.context_tokens.unique())
    if not ctxs:
        return lines
    variants = _cost_variants(sel) + ([v for v in VARIANTS if VARIANTS[v].kind == "bug"
                                       and v in set(sel.variant)] if full else [])
    fields = meta.get("distribution_fields", {})
    for d in _dist_order(sel, meta):
        desc = ", ".join(f"{k} = {v}" for k, v in fields.get(d, {}).items())
        desc = f"Fields: {desc}." if desc else "Every field at its default."
        lines += ["", f"#### `{d}`", "", f"{desc} {_stats_line(inputs, d, rows)}", "",
                  "| variant | " + " | ".join(f"mass kept {_ctx(c)}" for c in ctxs) + " | "
                  + " | ".join(f"recall {_ctx(c)}" for c in ctxs) + " |", "|---" * (1 + 2 * len(ctxs)) + "|"]
        for v in variants:
            lines.append(f"| {_label(v, merged)} | " + " | ".join(cells.fmt(d, v, c, "mass_kept", 4) for c in ctxs)
                         + " | " + " | ".join(cells.fmt(d, v, c, "recall") for c in ctxs) + " |")
    return lines


def bug_table(rows, meta, *, full=False) -> list[str]:
    sel = rows[rows.selection]
    bugs = [v for v in VARIANTS if VARIANTS[v].kind == "bug" and v in set(sel.variant)]
    if not bugs:
        return []
    cells = Cells(sel)
    ctxs = sorted(int(c) for c in sel.context_tokens.unique())
    show = ctxs if full else [ctxs[-1]]
    nan = sel.groupby(["distribution", "variant", "context_tokens"])["nan_keys"].mean()
    lines = []
    for c in show:
        j = c // meta.get("compress_ratio", 4)
        chance = min(1.0, meta.get("topk", 1024) / j)
        ex = sel[(sel.variant == "exact") & (sel.context_tokens == c)]
        if "chance_mass" in ex and ex.chance_mass.notna().any():
            chance = float(ex.chance_mass.mean())      # k / entries, averaged over the query rows
        lines += ["", f"At {_ctx(c)} ({j} entries): chance level, the recall of a random top-{meta.get('topk')} "
                      f"(the mean over query rows of top-k / the entries the row sees), is **{chance:.3f}**.", "",
                  "| distribution | " + " | ".join(f"{b} recall | mass kept" for b in bugs) + " | NaN keys (fn→fnuz) |",
                  "|---" * (2 + 2 * len(bugs)) + "|"]
        for d in _dist_order(sel, meta):
            cols = []
            for b in bugs:
                cols += [cells.fmt(d, b, c, "recall"), cells.fmt(d, b, c, "mass_kept", 3)]
            nk = nan.get((d, "fp8-fn-read-fnuz", c), float("nan"))
            lines.append(f"| `{d}` | " + " | ".join(cols) + f" | {'–' if nk != nk else f'{nk:.2%}'} |")
    return lines


def _same_as_fp8(rows) -> list[str]:
    """Whether a bug variant selected exactly what FP8 selects, cell by cell."""
    sel = rows[rows.selection]
    out = []
    for b in ("fp8-fnuz-read-fn", "fp8-fn-read-fnuz"):
        if b not in set(sel.variant) or FP8 not in set(sel.variant):
            continue
        p = sel[sel.variant.isin([b, FP8])].pivot_table(
            index=["distribution", "context_tokens", "seed"], columns="variant", values="recall")
        same = int((p[b] == p[FP8]).sum())
        out.append(f"`{b}` selects what `{FP8}` selects (equal recall) in {same} of {len(p)} cells "
                   "(distribution × context × seed).")
    return ["", " ".join(out)] if out else []


def merge_lines(merged, result) -> list[str]:
    lines = []
    for n, m in result.get("merges", {}).items():
        if n in merged:
            lines.append(f"- `{n}` is merged into `{m['into']}`: 0 of {m['values']:,} dequantized q and k values "
                         "differ. Both scales are powers of two and e4m3fnuz's is exactly twice e4m3fn's (max 224 "
                         "against 448), and the e4m3fnuz grid is the e4m3fn grid halved, so every value rounds to "
                         "the same number: one FP8 row per scale rule.")
        elif m["values"]:
            lines.append(f"- `{n}` kept apart from `{m['into']}`: {m['differ']:,} of {m['values']:,} dequantized "
                         "values differ.")
    return lines


# --- the study beside end-to-end results ----------------------------------------------------


def end_to_end_lines(sel, meta, longest) -> list[str]:
    lines = ["Reported end-to-end evaluations of an FP8 and an MXFP4 (FP4) indexer, as their sources give them "
             "(not measured here). The last column divides the difference by its binomial standard error for two "
             "independent runs, √(2p(1 − p)/n), p the FP8 score, n the benchmark's question count (GSM8K: the full "
             "1,319-question test set, which a source may not have used):", "",
             "| source | model | benchmark | FP8 indexer | MXFP4 indexer | FP8 − MXFP4 | in standard errors |",
             "|---|---|---|---|---|---|---|"]
    zs = []
    for short, src, model, bench, n, a, b, note in END_TO_END:
        pa, pb = float(a), float(b)
        z = (pa - pb) / math.sqrt(2 * pa * (1 - pa) / n)
        zs.append((short, bench, z))
        lines.append(f"| {src} | {model} | {bench} | {a} | {b}" + (f" ({note})" if note else "")
                     + f" | {pa - pb:+.4f} | {z:.1f} |")
    small = [f"{short} {bench}" for short, bench, z in zs if abs(z) < 1]
    large = [f"{short} {bench} ({z:.1f})" for short, bench, z in zs if abs(z) >= 2]
    lines += ["", (f"Within one standard error: {', '.join(small)}. " if small else "")
              + (f"Two or more: {', '.join(large)}. " if large else "")
              + "The 17 / 17 split of the GPQA-Diamond questions only one run got right is what two runs of equal "
                "accuracy give."]
    cells = Cells(sel)
    dists = _dist_order(sel, meta)
    if {FP8, MX} <= set(sel.variant) and "normal" in dists:
        L = _ctx(longest)
        gap = cells.mean("normal", FP8, longest, "recall") - cells.mean("normal", MX, longest, "recall")
        lines += ["", f"Set beside them: on `normal` at {L} MXFP4's recall is {gap:.3f} below FP8's, while it keeps "
                      f"{cells.fmt('normal', MX, longest, 'mass_kept', 4)} of the exact top-k's attention mass "
                      f"(FP8 {cells.fmt('normal', FP8, longest, 'mass_kept', 4)}) and "
                      f"{cells.fmt('normal', MX, longest, 'top64')} of the exact top-64. A recall gap is a count of "
                      "exchanged keys, not a forecast of an accuracy gap."]
    lines += ["", "**What the generated data can predict**: the mechanics of selection under each quantization — "
                  "which keys are exchanged (their exact ranks and their margin to the cut), how much of the exact "
                  "top-k's attention mass and of its best keys survive, how much over-selection recovers, how "
                  "outlier channels, heavy tails, drift, sinks, locality and head-weight coupling move these, and "
                  "that the known bugs destroy selection. **What it cannot predict**: how concentrated the real "
                  "model's attention is (on generated data the exact top-k holds "
                  f"{_range([cells.mean(d, 'exact', longest, 'topk_mass') for d in dists], '{:.1%}')} of the mass "
                  "where a random top-k holds "
                  f"{_range([cells.mean(d, 'exact', longest, 'chance_mass') for d in dists], '{:.1%}')}), whether the keys near the cut carry information a task needs, and "
                  "benchmark accuracy. Those need the model's own activations (below) or end-to-end evaluations "
                  "like the ones above."]
    return lines


def _capture_lines(inputs, longest) -> list[str]:
    lines = ["No real activations of DeepSeek-V4 are available on the machines this study ran on: every number "
             "above comes from generated inputs. To run the same measurements on the model's own: capture the "
             "indexer's inputs (the capture hook, or `mxval dump` for a harness case; docs/dumps-and-diff.md), then "
             "`mxval study --dump FILE [--dump FILE ...] --report-dir DIR`. The dump's K-writer op supplies the keys "
             "(pooled rows through the norm and RoPE), its Q-quant op the queries and signed head weights "
             "(generated ones are used when it has none); values are generated. Every query row scores every "
             "captured entry; top-k is a quarter of the entries when the capture holds fewer than 4 × top-k."]
    if inputs is None or inputs.empty:
        return lines
    st = inputs.groupby("distribution")[[s for s, _ in STATS]].mean()
    rng = "; ".join(f"{desc} {st[s].min():.2f}–{st[s].max():.2f}" for s, desc in STATS)
    lines += ["", f"The distributions here span {rng}. A capture's report prints the same statistics; one outside "
                  f"these ranges is not covered by this run. To stand for the model, a capture needs sequences of "
                  f"{_ctx(longest)} tokens or more (selection among as many entries), the Q-quant op, and several "
                  "layers."]
    return lines


# --- the documents ------------------------------------------------------------------------


def _header(rows, meta) -> list[str]:
    seeds = meta.get("seeds", [])
    ctxs = meta.get("contexts", sorted(rows.context_tokens.unique()) if not rows.empty else [])
    r = meta.get("compress_ratio", 4)
    load, load1 = meta.get("load_before"), meta.get("load_after")
    cpu = meta.get("cpu_seconds")
    timing = f"{meta.get('seconds', 0):.0f} s"
    if cpu is not None:
        timing += f" wall, {cpu:.0f} s CPU in {meta.get('jobs', 1)} worker process(es)"
    loadtxt = (f" (1-minute load average {load:.1f} at the start, {load1:.1f} at the end: other jobs shared "
               "the cores)") if load is not None and load1 is not None \
        and not str(meta.get("device", "cpu")).startswith("cuda") else ""
    if meta.get("dump"):
        return [f"Measured {meta.get('when', '')} on {meta.get('machine', '?')}: {timing}. Captured keys from "
                f"{_names(meta.get('distributions', []))}; values are generated, and queries too where the capture "
                "has no Q-quant op. Every query row scores every captured entry; top-k is a quarter of the entries "
                "when the capture holds fewer than 4 × top-k."]
    no_sel = [c for c in ctxs if c // r <= meta.get("topk", 1024)]
    spread = meta.get("query_spread", 0)
    lines = [f"Measured {meta.get('when', '')} on {meta.get('machine', '?')}: {timing}{loadtxt}. "
             f"{len(meta.get('distributions', []))} distributions × {len(seeds)} seeds × {meta.get('rows')} query rows "
             f"× {meta.get('heads')} heads, contexts {', '.join(_ctx(c) for c in ctxs)} tokens, top-k "
             f"{meta.get('topk')}. Generated inputs: no real activations were available (see *Real activations*)."]
    lines += ["", "Method: per (distribution, seed) the outlier channels, key subspace, norm weight, head-weight "
              "projection, queries, keys and values are drawn once at the longest context; a shorter context is "
              "its prefix. "
              + (f"A context's query rows sit at positions spread evenly over its newest {spread:.0%} (row 0 at its "
                 "last token), each seeing only the entries before it. " if spread else
                 "Every query row sits at the context's last token. ")
              + f"A cell is the mean over the {len(seeds)} seeds ± the half-width of the 95 % percentile bootstrap "
              "interval over seeds. **Mass kept**: the attention mass (softmax of D^-0.5 q·k per head over the "
              "row's entries, summed over heads) the variant's top-k holds over the mass the exact top-k holds, "
              "at most 1 per row (harness.diff.scores.mass_kept, the formula the run reports use on their "
              "proxy; study.md and study.csv also give that proxy, the softmax of the exact indexer logits, "
              "as `proxy_mass_kept`). **Top-m "
              "kept**: the share of the exact top-m in the variant's top-k. **Misses**: the exact top-k keys "
              "missing from the variant's top-k, by exact rank. **Recall**: the share of the variant's top-k that "
              "the exact bf16 indexer accepts too (tie rule of NUMERICS.md §6). **Over-selection**: the share of "
              "the exact top-k inside the variant's top-k′. **Noise**: the SD of the variant's logits minus the "
              "exact ones. Scores are fp32, as the kernels accumulate (NUMERICS.md §8). The attention output over "
              "the selection is in study.csv (`out_err`) but not reported: with values drawn independently of "
              "the keys it follows from recall alone (≈ √(2(1 − recall)))."
              + (f" At {', '.join(_ctx(c) for c in no_sel)} every entry is kept (no selection), so nothing is "
                 "reported there." if no_sel else "")]
    return lines


def summary_markdown(result: dict, meta: dict) -> str:
    """The README section: headline, decision, over-selection, noise, the end-to-end results,
    per-distribution tables, needles, known bugs, real activations."""
    rows, needles, inputs, merged = frames(result)
    lines = _header(rows, meta)
    if rows.empty:
        return "\n".join(lines)
    if meta.get("dump"):
        return "\n".join(lines + dump_tables(rows, inputs, meta))
    sel = rows[rows.selection]
    if sel.empty:
        return "\n".join(lines + ["", "No context here exceeds top-k entries: nothing is selected, nothing to report."])
    longest = int(sel.context_tokens.max())
    L = _ctx(longest)
    head = [v for v, _ in HEADLINE if v in set(sel.variant)]
    lines += ["", f"### What the selection keeps, at {L}", ""] + headline_table(sel, meta, merged, longest)
    lines += ["", "### Decision", ""] + decision_lines(rows, needles, inputs, meta)
    lines += ["", f"### Over-selection, at {L}", ""] + oversel_table(sel, meta, merged, longest, head)
    lines += ["", f"### Noise against the margins, and where the misses sit, at {L}", ""]
    lines += noise_table(sel, meta, merged, longest, head)
    lines += ["", "### The study beside end-to-end results", ""] + end_to_end_lines(sel, meta, longest)
    lines += ["", "### Mass kept and recall per distribution and context",
              "", "Cost variants only (the known bugs are below). `exact` is 1 by definition."]
    lines += distribution_tables(rows, inputs, merged, meta)
    if not needles.empty:
        lines += ["", "### Needles: margin sweep and depth", "",
                  "A needle is a key drawn from the distribution at its depth's entry (drift and locality included), "
                  "moved along its query's direction before the norm (so its norm is a key's norm) until its exact "
                  "score exceeds the row's exact k-th score by the margin times the k-th key's gross score "
                  "Σ_h |w_h|·relu(q_h·k) (the k-th score itself when every head weight is positive; with signed "
                  "weights the k-th score is a difference of such terms and can sit near 0). It replaces the entry "
                  "there. The exact indexer keeps every needle; a variant keeps it when its error eats less than "
                  "the margin. n counts the needles placed (query rows × depths × seeds); each is its own draw. "
                  + _failed_needles(needles, longest)]
        lines += needle_table(needles, merged, meta, longest)
        lines += depth_table(needles, meta, longest)
    lines += ["", "### Known bugs (negative controls, not costs)", "",
              "Hadamard on q only scores against unrotated keys: its recall is chance. A K cache written in one "
              "FP8 flavour and read as the other: e4m3fn bytes read as e4m3fnuz halve every key (invisible to "
              "top-k) and turn 0x80 (-0) into NaN; a NaN score sorts first here, as in torch.topk, so each NaN "
              "key takes a slot (a scorer whose ReLU drops NaN loses just those keys instead). e4m3fnuz bytes "
              "read as e4m3fn double every key: harmless for selection."]
    lines += bug_table(rows, meta)
    lines += _same_as_fp8(rows)
    ml = merge_lines(merged, result)
    if ml:
        lines += ["", "### Rows merged", ""] + ml
    lines += ["", "### Real activations", ""]
    lines += _capture_lines(inputs, longest)
    return "\n".join(lines)


def full_markdown(result: dict, meta: dict) -> str:
    """study.md: the summary, then every context, every variant and per-seed inputs."""
    rows, needles, inputs, merged = frames(result)
    lines = [summary_markdown(result, meta)]
    if rows.empty or meta.get("dump"):
        return "\n".join(lines)
    sel = rows[rows.selection]
    if sel.empty:
        return "\n".join(lines)
    longest = int(sel.context_tokens.max())
    every = _cost_variants(sel)
    lines += ["", "## Every variant and context", "", f"### What the selection keeps, at {_ctx(longest)}", ""]
    lines += headline_table(sel, meta, merged, longest, every, proxy=True)
    lines += ["", "### Over-selection", ""] + oversel_table(sel, meta, merged, longest, every)
    lines += ["", "### Noise and misses", ""] + noise_table(sel, meta, merged, longest, every)
    lines += distribution_tables(rows, inputs, merged, meta, full=True)
    if not needles.empty:
        lines += needle_table(needles, merged, meta, longest, full=True)
    lines += bug_table(rows, meta, full=True)
    if not inputs.empty:
        lines += ["", "## Inputs per seed", ""] + _md_table(inputs.round(3))
    return "\n".join(lines)


def _md_table(df) -> list[str]:
    cols = list(df.columns)
    return (["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
            + ["| " + " | ".join(str(x) for x in r) + " |" for r in df.itertuples(index=False)])


def dump_tables(rows, inputs, meta=None) -> list[str]:
    lines = []
    for d in dict.fromkeys(rows.distribution):
        r = rows[rows.distribution == d]
        first = r.iloc[0]
        topk = int(first.topk)
        lines += ["", f"#### `{d}`", "", f"{int(first.entries)} entries, top-k {topk} (chance "
                  f"{first.chance:.3f}), queries {first.queries}. {_stats_line(inputs, d)}", "",
                  "| variant | kind | mass kept | top-64 kept | misses: median exact rank | recall | worst row | "
                  + " | ".join(f"top-{kp}" for kp in over_select(topk)) + " |",
                  "|---" * (7 + len(over_select(topk))) + "|"]
        for _, x in r.iterrows():
            med = x.get("miss_rank_median", float("nan"))
            lines.append(f"| {x.variant} | {x.kind} | {x.mass_kept:.4f} | {_fmt(x.get('top64', float('nan')))} | "
                         f"{'–' if med != med else f'{med:.0f}'} | {x.recall:.4f} | {x.recall_min:.4f} | "
                         + " | ".join(_fmt(x.get(f"cover{kp}", float("nan"))) for kp in over_select(topk)) + " |")
        if topk < TOP_M[0]:
            lines.append(f"\nThe top-k ({topk}) is narrower than {TOP_M[0]}: top-{TOP_M[0]} kept is not measured.")
    return lines


def _figure_png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _html(result, meta, title, md) -> str:
    rows, needles, _, merged = frames(result)
    imgs = []
    sel = rows[rows.selection] if not rows.empty else rows
    if not sel.empty and not meta.get("dump"):
        dists = _dist_order(sel, meta)
        cells = Cells(sel)
        cols = min(4, len(dists))
        nr = math.ceil(len(dists) / cols)
        ctxs = sorted(int(c) for c in sel.context_tokens.unique())
        for metric, ylabel in (("mass_kept", "attention mass kept vs exact top-k"), ("recall", "top-k recall vs exact")):
            fig = Figure(figsize=(3.6 * cols, 3.0 * nr))
            axes = fig.subplots(nr, cols, squeeze=False, sharey=True)
            for ax, d in zip(axes.flat, dists):
                for v in _cost_variants(sel):
                    pts = [(c, *cells.get(d, v, c, metric)) for c in ctxs if cells.has(d, v, c)]
                    if pts:
                        ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                                    yerr=[0 if p[2] != p[2] else p[2] for p in pts], marker="o", ms=3, capsize=2,
                                    label=_label(v, merged))
                ax.set_xscale("log", base=2)
                ax.set_title(d, fontsize=8)
                ax.grid(alpha=.3)
            for ax in list(axes.flat)[len(dists):]:
                ax.axis("off")
            axes.flat[0].set_ylabel(ylabel)
            axes.flat[0].legend(fontsize=6)
            imgs.append((f"{ylabel} against context (95 % bootstrap intervals over seeds)", _figure_png(fig)))
    if not needles.empty:
        longest = needles.context_tokens.max()
        nd = needles[needles.context_tokens == longest]
        g = _pooled(nd, ["distribution", "variant", "margin"]).reset_index()
        dists = _dist_order(nd, meta)
        cols = min(4, len(dists))
        nr = math.ceil(len(dists) / cols)
        fig = Figure(figsize=(3.6 * cols, 3.0 * nr))
        axes = fig.subplots(nr, cols, squeeze=False, sharey=True)
        for ax, d in zip(axes.flat, dists):
            for v in _cost_variants(nd):
                x = g[(g.distribution == d) & (g.variant == v)].sort_values("margin")
                ax.plot(x.margin * 100, x.frac, marker="o", ms=3, label=_label(v, merged))
            ax.set_title(d, fontsize=8)
            ax.grid(alpha=.3)
        for ax in list(axes.flat)[len(dists):]:
            ax.axis("off")
        axes.flat[0].set_ylabel("needles kept")
        axes.flat[0].legend(fontsize=6)
        imgs.append((f"Needles kept against margin (%) at {_ctx(longest)}", _figure_png(fig)))
    body = "".join(f"<h2>{html.escape(t)}</h2><img src='data:image/png;base64,{b}'/>" for t, b in imgs)
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>body{{font-family:sans-serif;max-width:1200px;margin:auto}}pre{{white-space:pre-wrap}}"
            f"</style><h1>{html.escape(title)}</h1>{body}<pre>{html.escape(md)}</pre>")


def render(result: dict, out_dir: Path, *, title: str, meta: dict) -> dict:
    """Write study.json, study.md, study.html, study.csv, study-needles.csv as one set
    (harness/io/atomic.py `write_set`: all or none replaced, study.json last); their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = full_markdown(result, meta)
    files = {"study.csv": escape.csv_frame(pd.DataFrame(result["rows"])).to_csv(index=False),
             "study-needles.csv": escape.csv_frame(pd.DataFrame(result["needles"])).to_csv(index=False),
             "study.md": f"# {title}\n\n{md}\n", "study.html": _html(result, meta, title, md),
             "study.json": json.dumps({"meta": meta, **result}, indent=1, default=str)}
    atomic.write_set(out_dir, files)
    return {n: str(out_dir / n) for n in ("study.json", "study.md", "study.html", "study.csv", "study-needles.csv")}
