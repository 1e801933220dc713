"""Reports of `mxval study`: per-distribution tables with intervals, the margin sweep, the
known-bug controls, and a decision section whose every claim is computed from the run.

Intervals: the unit of replication is the seed (it redraws outlier channels, key subspace,
norm weight, head-weight projection, queries, keys and values), so a cell is the mean over
seeds of the per-seed means and the 95 % t-interval of those means. Needle proportions
pool the needles of all seeds and state their count n; whether depth matters is a
chi-square test of equal proportions, Bonferroni-corrected.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from harness.commands.study_metrics import t975
from harness.commands.study_variants import VARIANTS

FP8, MX, MXH = "fp8-e4m3fn", "mxfp4", "mxfp4+H"
STATS = (("k_block_crest", "key 32-block crest factor (amax/RMS)"),
         ("k_kurtosis", "key kurtosis after the norm"),
         ("k_channel_ratio", "key channel RMS, max/median"))


def distribution_fields(d) -> dict:
    """The fields of a distribution that differ from the defaults."""
    default = type(d)()
    return {f.name: getattr(d, f.name) for f in dataclasses.fields(d)
            if f.name != "name" and getattr(d, f.name) != getattr(default, f.name)}


# --- frames -------------------------------------------------------------------------------


def frames(result: dict):
    """-> (rows, needles, inputs, merged) with the rows of variants whose operands repeated
    another's exactly on every input removed; merged: {variant: merge record}."""
    import pandas as pd
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


def _ci(df, keys, col):
    """Mean and 95 % t half-width over seeds of `col`, per `keys`."""
    g = df.groupby(keys)[col].agg(["mean", "std", "count"])
    g["half"] = [t975(int(n) - 1) * s / math.sqrt(n) if n > 1 else float("nan")
                 for s, n in zip(g["std"], g["count"])]
    return g


def _paired(rows, a: str, b: str, col: str = "recall"):
    """Per (distribution, context): mean and half-width over seeds of col[a] - col[b]."""
    sub = rows[rows.variant.isin([a, b]) & rows.selection]
    if sub.empty:
        return None
    p = sub.pivot_table(index=["distribution", "context_tokens", "seed"], columns="variant", values=col)
    if a not in p or b not in p:
        return None
    p = (p[a] - p[b]).rename("gap").reset_index()
    return _ci(p, ["distribution", "context_tokens"], "gap")


def _fmt(mean, half, digits=3) -> str:
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


def _cost_variants(rows, merged) -> list[str]:
    present = set(rows.variant)
    return [n for n, v in VARIANTS.items() if v.kind == "cost" and n in present]


def _dist_order(rows, meta) -> list[str]:
    order = [d for d in meta.get("distributions", []) if d in set(rows.distribution)]
    return order + [d for d in dict.fromkeys(rows.distribution) if d not in order]


# --- the decision, from the numbers --------------------------------------------------------


def _status(mean, half, tol) -> str:
    if half != half:                       # one seed: no interval, judge the mean
        return "within" if mean <= tol else "behind"
    if mean + half <= tol:
        return "within"
    if mean - half > tol:
        return "behind"
    return "undecided"


def verdicts(rows, tol: float, variant: str, against: str = FP8) -> dict:
    """{distribution: {context: (status, gap mean, gap half)}} of `against` - `variant` recall."""
    g = _paired(rows, against, variant)
    out = {}
    if g is None:
        return out
    for (dist, ctx), r in g.iterrows():
        out.setdefault(dist, {})[int(ctx)] = (_status(r["mean"], r["half"], tol), r["mean"], r["half"])
    return out


def _verdict_text(per_ctx: dict, tol: float) -> str:
    """'0.047 ± 0.002 behind FP8 at 8k -> 0.129 ± 0.003 at 128k (more than 0.01 at every context)'."""
    ctxs = sorted(per_ctx)
    first, last = ctxs[0], ctxs[-1]
    gap = f"{_fmt(per_ctx[first][1], per_ctx[first][2])} behind FP8 at {_ctx(first)}"
    if last != first:
        gap += f" → {_fmt(per_ctx[last][1], per_ctx[last][2])} at {_ctx(last)}"
    st = [per_ctx[c][0] for c in ctxs]
    if all(s == "within" for s in st):
        return f"{gap} (within {tol:g} at every context)"
    if all(s == "behind" for s in st):
        return f"{gap} (more than {tol:g} at every context)"
    parts = []
    for s in ("within", "behind", "undecided"):
        cs = [c for c in ctxs if per_ctx[c][0] == s]
        if cs:
            word = {"within": f"within {tol:g}", "behind": f"more than {tol:g}",
                    "undecided": "undecided"}[s]
            parts.append(f"{word} at {', '.join(_ctx(c) for c in cs)}")
    return f"{gap} ({'; '.join(parts)})"


def _effect_text(g, dist, ctx, what: str) -> str:
    """A paired difference: significant (interval excludes 0) or not."""
    if g is None or (dist, ctx) not in g.index:
        return ""
    m, h = g.loc[(dist, ctx), "mean"], g.loc[(dist, ctx), "half"]
    if h == h and abs(m) <= h:
        return f"{what} makes no measurable difference ({_fmt(m, h)})"
    return f"{what} {'buys' if m > 0 else 'costs'} {_fmt(abs(m), h)}"


def decision_lines(rows, needles, inputs, meta: dict) -> list[str]:
    """The decision section: every claim computed from the tables of this run."""
    tol = float(meta.get("tolerance", 0.01))
    sel = rows[rows.selection]
    if sel.empty:
        return ["No context here exceeds top-k entries: every variant keeps every entry; nothing to decide."]
    variants = set(sel.variant)
    if FP8 not in variants or not ({MX, MXH} & variants):
        return [f"The decision compares {MX} and {MXH} with {FP8}; this run lacks them."]
    dists = _dist_order(sel, meta)
    longest = int(sel.context_tokens.max())
    L = _ctx(longest)
    v_mx = verdicts(sel, tol, MX) if MX in variants else {}
    v_mxh = verdicts(sel, tol, MXH) if MXH in variants else {}
    rec = _ci(sel, ["distribution", "variant", "context_tokens"], "recall")
    err = _ci(sel, ["distribution", "variant", "context_tokens"], "out_err")
    had = _paired(sel, MXH, MX) if {MX, MXH} <= variants else None
    lines = []

    def at(table, d, v, c=longest):
        key = (d, v, c)
        return _fmt(table.loc[key, "mean"], table.loc[key, "half"]) if key in table.index else "–"

    # headline: who is within tolerance at the longest context
    for name, vd in (("MXFP4 as vLLM runs it (no rotation)", v_mx), ("MXFP4 with the Hadamard rotation", v_mxh)):
        if not vd:
            continue
        groups = {s: [d for d in dists if d in vd and vd[d].get(longest, ("",))[0] == s]
                  for s in ("within", "behind", "undecided")}
        text = f"- **{name}** is within {tol:g} recall of FP8 at {L} on " + \
               (", ".join(f"`{d}`" for d in groups["within"]) or "no distribution")
        if groups["behind"]:
            text += "; more than that behind on " + ", ".join(f"`{d}`" for d in groups["behind"])
        if groups["undecided"]:
            text += f"; undecided at {len(meta.get('seeds', [])) or '?'} seeds on " + \
                    ", ".join(f"`{d}`" for d in groups["undecided"])
        lines.append(text + ".")
    # output error ratio
    ratios = []
    for d in dists:
        for v in (MX, MXH):
            a, b = (d, v, longest), (d, FP8, longest)
            if a in err.index and b in err.index and err.loc[b, "mean"] > 0:
                ratios.append((v, err.loc[a, "mean"] / err.loc[b, "mean"]))
    for v in (MX, MXH):
        rs = [r for vv, r in ratios if vv == v]
        if rs:
            lines.append(f"- **Downstream**: at {L} the attention output over {v}'s top-k is "
                         f"{_range(rs, '{:.1f}')}× as far from the exact top-k's as FP8's, across distributions.")
    # what the rotation buys MXFP4
    if had is not None:
        gains, none = [], []
        for d in dists:
            if (d, longest) not in had.index:
                continue
            m, h = had.loc[(d, longest), "mean"], had.loc[(d, longest), "half"]
            (none if h == h and abs(m) <= h else gains).append((d, m, h))
        text = f"- **The Hadamard rotation** changes MXFP4's recall at {L} on " + (
            ", ".join(f"`{d}` ({'+' if m > 0 else ''}{_fmt(m, h)})" for d, m, h in gains) or "no distribution")
        if none:
            text += "; it makes no measurable difference on " + ", ".join(f"`{d}`" for d, _, _ in none)
        lines.append(text + ".")
    # like normal
    if "normal" in dists and len(dists) > 1:
        costs = [v for v in _cost_variants(sel, {}) if v in variants]
        alike = []
        for d in dists:
            if d == "normal":
                continue
            same = True
            for v in costs:
                for c in sorted(sel.context_tokens.unique()):
                    a, b = (d, v, c), ("normal", v, c)
                    if a not in rec.index or b not in rec.index:
                        continue
                    ha, hb = rec.loc[a, "half"], rec.loc[b, "half"]
                    if ha != ha or hb != hb or abs(rec.loc[a, "mean"] - rec.loc[b, "mean"]) > ha + hb:
                        same = False
            if same:
                alike.append(d)
        lines.append("- **Like `normal`** (every cost variant's recall within the intervals at every context): "
                     + (", ".join(f"`{d}`" for d in alike) if alike else "none of the other distributions") + ".")
    # per distribution
    lines.append("")
    lines.append(f"Per distribution, at {L} (recall of the exact top-k; output error against the exact "
                 "top-k's output):")
    lines.append("")
    fph = _paired(sel, FP8 + "+H", FP8) if FP8 + "+H" in variants else None
    for d in dists:
        parts = [f"FP8 {at(rec, d, FP8)}"]
        fph_eff = _effect_text(fph, d, longest, "rotating FP8")
        if fph_eff and "no measurable" not in fph_eff:
            parts[0] += f" ({fph_eff}: FP8+H {at(rec, d, FP8 + '+H')})"
        if d in v_mx:
            parts.append(f"MXFP4 {at(rec, d, MX)}, {_verdict_text(v_mx[d], tol)}")
        if d in v_mxh:
            parts.append(f"MXFP4+H {at(rec, d, MXH)}, {_verdict_text(v_mxh[d], tol)}")
        eff = _effect_text(had, d, longest, "the rotation")
        errs = ", ".join(f"{n} {at(err, d, v)}" for n, v in (("FP8", FP8), ("MXFP4", MX), ("MXFP4+H", MXH))
                         if (d, v, longest) in err.index)
        lines.append(f"- `{d}`: " + "; ".join(parts) + (f"; for MXFP4 {eff}" if eff else "")
                     + f". Output error: {errs}.")
    lines += _needle_lines(needles, meta, longest)
    lines += _capture_lines(v_mxh or v_mx, MXH if v_mxh else MX, inputs, dists, longest, tol)
    return lines


def _pooled(needles, keys):
    g = needles.groupby(keys)[["kept", "n"]].sum()
    g["frac"] = g["kept"] / g["n"].where(g["n"] > 0)
    return g


def homogeneity_p(kept: list[int], n: list[int]) -> float:
    """p-value of the chi-square test that every group keeps the same share."""
    import torch
    tot, tot_n = sum(kept), sum(n)
    if tot_n == 0 or tot in (0, tot_n) or len(n) < 2:
        return 1.0
    p = tot / tot_n
    chi2 = sum((k - m * p) ** 2 / (m * p * (1 - p)) for k, m in zip(kept, n) if m)
    df = sum(1 for m in n if m) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def _range(xs, fmt="{:.2f}") -> str:
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}–{hi}"


def _needle_lines(needles, meta, longest) -> list[str]:
    if needles is None or needles.empty:
        return []
    nd = needles[needles.context_tokens == longest]
    if nd.empty:
        return []
    L = _ctx(longest)
    lines = [""]
    g = _pooled(nd, ["distribution", "variant", "margin"])
    margins = sorted(nd.margin.unique())
    dists = [d for d in _dist_order(nd, meta)]
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
        text = (f"- **Needles** at {L}, {v}: {_range(fr)} kept at a {top:.0%} margin across distributions; "
                if fr else f"- **Needles** at {L}, {v}: ")
        if reached:
            by = {}
            for d, m in reached.items():
                by.setdefault(m, []).append(d)
            text += "99 % kept from a margin of " + "; ".join(
                f"{m:.0%} on " + ", ".join(f"`{d}`" for d in ds) for m, ds in sorted(by.items()))
            rest = [d for d in dists if d not in reached]
            if rest:
                text += f"; below 99 % up to {top:.0%} on " + ", ".join(f"`{d}`" for d in rest)
        else:
            text += f"below 99 % at every margin up to {top:.0%} on every distribution"
        lines.append(text + ".")
    ex = nd[nd.variant == "exact"].groupby(["margin", "distribution"])["rank_median"].median()
    if not ex.empty:
        lines.append("- A needle's exact rank (the median per distribution, its range across them) at those "
                     "margins: " + ", ".join(f"{m:.0%} → {_range(ex[m], '{:.0f}')}" for m in margins
                                             if m in ex.index.get_level_values(0))
                     + f" of {meta.get('topk', '?')}.")
    # depth: does the kept share differ between depths? chi-square test of homogeneity per
    # (distribution, variant), Bonferroni-corrected over every test made here
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


def _capture_lines(vd, which, inputs, dists, longest, tol) -> list[str]:
    lines = ["", "**What a capture must show.** "]
    if inputs is None or inputs.empty or not vd:
        return lines[:1] + ["A capture (`mxval study --dump FILE`) settles it by its own recall and output error."]
    st = inputs.groupby("distribution")[[s for s, _ in STATS]].mean()
    groups = {"within": [], "behind": []}
    for d in dists:
        s = vd.get(d, {}).get(longest, ("",))[0]
        if s in groups and d in st.index:
            groups[s].append(d)
    found = []
    if groups["within"] and groups["behind"]:
        for s, desc in STATS:
            wmax, bmin = st.loc[groups["within"], s].max(), st.loc[groups["behind"], s].min()
            bmax, wmin = st.loc[groups["behind"], s].max(), st.loc[groups["within"], s].min()
            if wmax < bmin:
                found.append(f"{desc} at most {wmax:.2f} on every distribution where {which} is within {tol:g} "
                             f"of FP8, at least {bmin:.2f} where it is not")
            elif bmax < wmin:
                found.append(f"{desc} at least {wmin:.2f} where {which} is within {tol:g}, "
                             f"at most {bmax:.2f} where not")
        text = ("In this run " + "; ".join(found) + ". A capture's keys fall on one side or the other"
                if found else "No single key statistic separates the distributions where "
                f"{which} is within {tol:g} of FP8 from those where it is not; only a capture's own recall decides")
    else:
        where = "within" if groups["within"] else "more than"
        rng = "; ".join(f"{desc} {st[s].min():.2f}–{st[s].max():.2f}" for s, desc in STATS)
        text = (f"{which} is {where} {tol:g} {'of' if where == 'within' else 'behind'} FP8 at {_ctx(longest)} on every "
                f"distribution studied, over {rng}. A capture inside those ranges is expected to agree; one outside "
                "them is not covered")
    lines[-1] += (text + f". To stand for the model, the capture (`mxval study --dump FILE`) needs the K-writer "
                  f"op of sequences of {_ctx(longest)} tokens or more (so selection happens among as "
                  "many entries), the Q-quant op (real queries and signed head weights: generated ones are used "
                  "otherwise), and several layers; `--dump` prints the same statistics and measures recall and "
                  "output error on the capture itself, which decides.")
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
                     "of its entries from the newest quarter of the context.")
    return text


def distribution_tables(rows, inputs, merged, meta, *, full: bool = False) -> list[str]:
    sel = rows[rows.selection]
    lines = []
    ctxs = sorted(sel.context_tokens.unique())
    if not ctxs:
        return lines
    longest = ctxs[-1]
    rec = _ci(sel, ["distribution", "variant", "context_tokens"], "recall")
    err = _ci(sel, ["distribution", "variant", "context_tokens"], "out_err")
    variants = _cost_variants(sel, merged) + ([v for v in VARIANTS if VARIANTS[v].kind == "bug"
                                               and v in set(sel.variant)] if full else [])
    fields = meta.get("distribution_fields", {})
    for d in _dist_order(sel, meta):
        desc = ", ".join(f"{k} = {v}" for k, v in fields.get(d, {}).items())
        desc = f"Fields: {desc}." if desc else "Every field at its default."
        lines += ["", f"#### `{d}`", "", f"{desc} {_stats_line(inputs, d, rows)}", ""]
        err_cols = ctxs if full else [longest]
        head = "| variant | " + " | ".join(f"recall {_ctx(c)}" for c in ctxs) + " | " + \
            " | ".join(f"output error {_ctx(c)}" for c in err_cols) + " |"
        ncol = len(ctxs) + (len(ctxs) if full else 1)
        lines += [head, "|---" * (ncol + 1) + "|"]
        for v in variants:
            cells = [_fmt(rec.loc[(d, v, c), "mean"], rec.loc[(d, v, c), "half"]) if (d, v, c) in rec.index else "–"
                     for c in ctxs]
            ec = ctxs if full else [longest]
            cells += [_fmt(err.loc[(d, v, c), "mean"], err.loc[(d, v, c), "half"], 2)
                      if (d, v, c) in err.index else "–" for c in ec]
            lines.append(f"| {_label(v, merged)} | " + " | ".join(cells) + " |")
    return lines


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
        costs = _cost_variants(nd, merged)
        variants = costs + [v for v in VARIANTS if VARIANTS[v].kind == "bug" and v in set(nd.variant)] if full \
            else [v for v in costs if v in (FP8, MX, MXH)] or costs
        lines += ["", f"Needles kept at {_ctx(ctx)} (share of n needles, pooled over seeds and depths; "
                      "first row: the needles' median exact rank"
                      + ("" if full else "; every variant and context in study.md") + "):", "",
                  "| distribution | variant | n | " + " | ".join(f"{m:.0%}" for m in margins) + " |",
                  "|---" * (3 + len(margins)) + "|"]
        for d in _dist_order(nd, meta):
            n = int(g.loc[(d, "exact", margins[0]), "n"]) if (d, "exact", margins[0]) in g.index else 0
            lines.append(f"| `{d}` | exact rank | {n} | " + " | ".join(
                f"{ex.loc[(d, m)]:.0f}" if (d, m) in ex.index else "–" for m in margins) + " |")
            for v in variants:
                cells = [f"{g.loc[(d, v, m), 'frac']:.3f}" if (d, v, m) in g.index else "–" for m in margins]
                lines.append(f"| | {_label(v, merged)} | {n} | " + " | ".join(cells) + " |")
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
    lines = ["", f"{variant} needles kept by depth at {_ctx(longest)}, {mid:.0%} margin "
                 "(0 = the oldest entry after any sinks, 1 = the newest):", "",
             "| distribution | n per depth | " + " | ".join(f"{dp:g}" for dp in depths) + " |",
             "|---" * (2 + len(depths)) + "|"]
    for d in _dist_order(nd, meta):
        n = int(g.loc[(d, depths[0]), "n"]) if (d, depths[0]) in g.index else 0
        lines.append(f"| `{d}` | {n} | " + " | ".join(
            f"{g.loc[(d, dp), 'frac']:.3f}" if (d, dp) in g.index else "–" for dp in depths) + " |")
    return lines


def bug_table(rows, meta, *, full=False) -> list[str]:
    sel = rows[rows.selection]
    bugs = [v for v in VARIANTS if VARIANTS[v].kind == "bug" and v in set(sel.variant)]
    if not bugs:
        return []
    ctxs = sorted(sel.context_tokens.unique())
    show = ctxs if full else [ctxs[-1]]
    rec = _ci(sel, ["distribution", "variant", "context_tokens"], "recall")
    err = _ci(sel, ["distribution", "variant", "context_tokens"], "out_err")
    nan = sel.groupby(["distribution", "variant", "context_tokens"])["nan_keys"].mean()
    lines = []
    for c in show:
        j = c // meta.get("compress_ratio", 4)
        chance = min(1.0, meta.get("topk", 1024) / j)
        lines += ["", f"At {_ctx(c)} ({j} entries): chance level, the recall of a random top-{meta.get('topk')}, is "
                      f"**{chance:.3f}**; two selections with no entry in common give an output error of about "
                      "√2 ≈ 1.41 when attention is flat.", "",
                  "| distribution | " + " | ".join(f"{b} recall | output error" for b in bugs) + " | NaN keys (fn→fnuz) |",
                  "|---" * (2 + 2 * len(bugs)) + "|"]
        for d in _dist_order(sel, meta):
            cells = []
            for b in bugs:
                k = (d, b, c)
                cells += [_fmt(rec.loc[k, "mean"], rec.loc[k, "half"]) if k in rec.index else "–",
                          _fmt(err.loc[k, "mean"], err.loc[k, "half"], 2) if k in err.index else "–"]
            nk = nan.get((d, "fp8-fn-read-fnuz", c), float("nan"))
            lines.append(f"| `{d}` | " + " | ".join(cells) + f" | {'–' if nk != nk else f'{nk:.2%}'} |")
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


# --- the documents ------------------------------------------------------------------------


def _header(rows, meta) -> list[str]:
    seeds = meta.get("seeds", [])
    ctxs = meta.get("contexts", sorted(rows.context_tokens.unique()) if not rows.empty else [])
    r = meta.get("compress_ratio", 4)
    load, load1 = meta.get("load_before"), meta.get("load_after")
    loadtxt = (f" (1-minute load average {load:.1f} at the start, {load1:.1f} at the end: other jobs shared "
               "the cores)") if load is not None and load1 is not None \
        and not str(meta.get("device", "cpu")).startswith("cuda") else ""
    sel = rows[rows.selection] if not rows.empty else rows
    no_sel = [c for c in ctxs if c // r <= meta.get("topk", 1024)]
    if meta.get("dump"):
        return [f"Measured {meta.get('when', '')} on {meta.get('machine', '?')}: {meta.get('seconds', 0):.0f} s. "
                f"Captured keys from {', '.join(f'`{d}`' for d in meta.get('distributions', []))}; values are "
                "generated, and queries too where the capture has no Q-quant op. Every query row scores every "
                "captured entry; top-k is a quarter of the entries when the capture holds fewer than 4 × top-k."]
    lines = [f"Measured {meta.get('when', '')} on {meta.get('machine', '?')}: {meta.get('seconds', 0):.0f} s"
             f"{loadtxt}. {len(meta.get('distributions', []))} distributions × {len(seeds)} seeds × "
             f"{meta.get('rows')} query rows × {meta.get('heads')} heads, contexts "
             f"{', '.join(_ctx(c) for c in ctxs)} tokens, top-k {meta.get('topk')}."]
    lines += ["", "Method: per (distribution, seed) the outlier channels, key subspace, norm weight, head-weight "
              "projection, queries, keys and values are drawn once at the longest context; a shorter context is "
              "its prefix (its query sits at the context's last token), so a trend along context is a trend. "
              f"A cell is the mean over the {len(seeds)} seeds ± the half-width of the 95 % t-interval of the "
              "seeds' means. **Recall**: the share of the variant's top-k that the exact bf16 indexer keeps too "
              "(tie rule of NUMERICS.md §6). **Output error**: ‖o − o*‖ / ‖o*‖ per query row over all heads, o the "
              "sparse attention output over the variant's top-k (softmax of D^-0.5 q·k over the selected "
              "entries, generated bf16 N(0, 1) values), o* the same over the exact top-k; it replaces the "
              "temperature-1 mass recall of earlier versions. Scores are fp32, as the kernels accumulate."
              + (f" At {', '.join(_ctx(c) for c in no_sel)} every entry is kept (no selection), so no needle "
                 "and no recall is reported there." if no_sel else "")]
    ex = sel[(sel.variant == "exact")] if not sel.empty else sel
    if not ex.empty and "topk_mass" in ex and "normal" in set(ex.distribution):
        longest = int(ex.context_tokens.max())
        m = ex[(ex.distribution == "normal") & (ex.context_tokens == longest)]["topk_mass"].mean()
        lines[-1] += (f" At this scale attention is flat on generated data: on `normal` at {_ctx(longest)} the "
                      f"exact top-k holds {m:.0%} of a head's attention mass.")
    return lines


def summary_markdown(result: dict, meta: dict) -> str:
    """The README section: decision, per-distribution tables, margin sweep, depth, known bugs."""
    rows, needles, inputs, merged = frames(result)
    lines = _header(rows, meta)
    if rows.empty:
        return "\n".join(lines)
    if meta.get("dump"):
        return "\n".join(lines + dump_tables(rows, inputs))
    sel = rows[rows.selection]
    longest = int(sel.context_tokens.max()) if not sel.empty else None
    lines += ["", "### Decision", ""] + decision_lines(rows, needles, inputs, meta)
    lines += ["", "### Recall and output error, per distribution",
              "", "Cost variants only (the known bugs are below). `exact` is 1 and 0 by definition."]
    lines += distribution_tables(rows, inputs, merged, meta)
    if longest is not None and not needles.empty:
        lines += ["", "### Needles: margin sweep and depth", "",
                  "A needle is a key drawn from the distribution at its depth's entry (drift included), moved "
                  "along its query's direction before the norm (so its norm is a key's norm) until its exact "
                  "score exceeds the row's exact k-th score by the margin times the k-th key's gross score "
                  "Σ_h |w_h|·relu(q_h·k) (that is the k-th score itself when every head weight is positive; with "
                  "signed weights the k-th score is a difference of such terms and can sit near 0). It replaces "
                  "the entry there. The exact indexer keeps every needle; a variant keeps it when its error eats "
                  "less than the margin. n counts needles (query rows × depths × seeds); each is its own draw."]
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
    return "\n".join(lines)


def full_markdown(result: dict, meta: dict) -> str:
    """study.md: the summary, then every context, every variant and per-seed inputs."""
    rows, needles, inputs, merged = frames(result)
    lines = [summary_markdown(result, meta)]
    if rows.empty or meta.get("dump"):
        return "\n".join(lines)
    sel = rows[rows.selection]
    lines += ["", "## Every context", ""]
    lines += distribution_tables(rows, inputs, merged, meta, full=True)
    if not needles.empty:
        lines += needle_table(needles, merged, meta, int(sel.context_tokens.max()), full=True)
    lines += bug_table(rows, meta, full=True)
    if not inputs.empty:
        lines += ["", "## Inputs per seed", ""] + _md_table(inputs.round(3))
    return "\n".join(lines)


def _md_table(df) -> list[str]:
    cols = list(df.columns)
    return (["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
            + ["| " + " | ".join(str(x) for x in r) + " |" for r in df.itertuples(index=False)])


def dump_tables(rows, inputs) -> list[str]:
    lines = []
    for d in dict.fromkeys(rows.distribution):
        r = rows[rows.distribution == d]
        first = r.iloc[0]
        lines += ["", f"#### `{d}`", "", f"{int(first.entries)} entries, top-k {int(first.topk)} (chance "
                  f"{first.chance:.3f}), queries {first.queries}. {_stats_line(inputs, d)}", "",
                  "| variant | kind | recall | worst row | output error |", "|---|---|---|---|---|"]
        for _, x in r.iterrows():
            lines.append(f"| {x.variant} | {x.kind} | {x.recall:.4f} | {x.recall_min:.4f} | {x.out_err:.3f} |")
    return lines


def _figure_png(fig) -> str:
    import base64
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _html(result, meta, title, md) -> str:
    import html

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, needles, _, merged = frames(result)
    imgs = []
    sel = rows[rows.selection] if not rows.empty else rows
    if not sel.empty and not meta.get("dump"):
        dists = _dist_order(sel, meta)
        cols = min(4, len(dists))
        nr = math.ceil(len(dists) / cols)
        rec = _ci(sel, ["distribution", "variant", "context_tokens"], "recall").reset_index()
        for metric, ylabel in (("recall", "top-k recall vs exact"), ("out_err", "output error vs exact top-k")):
            tab = rec if metric == "recall" else \
                _ci(sel, ["distribution", "variant", "context_tokens"], metric).reset_index()
            fig, axes = plt.subplots(nr, cols, figsize=(3.6 * cols, 3.0 * nr), squeeze=False, sharey=True)
            for ax, d in zip(axes.flat, dists):
                for v in _cost_variants(sel, merged):
                    g = tab[(tab.distribution == d) & (tab.variant == v)].sort_values("context_tokens")
                    ax.errorbar(g.context_tokens, g["mean"], yerr=g["half"].fillna(0), marker="o", ms=3,
                                capsize=2, label=_label(v, merged))
                ax.set_xscale("log", base=2)
                ax.set_title(d, fontsize=8)
                ax.grid(alpha=.3)
            for ax in list(axes.flat)[len(dists):]:
                ax.axis("off")
            axes.flat[0].set_ylabel(ylabel)
            axes.flat[0].legend(fontsize=6)
            imgs.append((f"{ylabel} against context (95 % intervals over seeds)", _figure_png(fig)))
            plt.close(fig)
    if not needles.empty:
        longest = needles.context_tokens.max()
        nd = needles[needles.context_tokens == longest]
        g = _pooled(nd, ["distribution", "variant", "margin"]).reset_index()
        dists = _dist_order(nd, meta)
        cols = min(4, len(dists))
        nr = math.ceil(len(dists) / cols)
        fig, axes = plt.subplots(nr, cols, figsize=(3.6 * cols, 3.0 * nr), squeeze=False, sharey=True)
        for ax, d in zip(axes.flat, dists):
            for v in _cost_variants(nd, merged):
                x = g[(g.distribution == d) & (g.variant == v)].sort_values("margin")
                ax.plot(x.margin * 100, x.frac, marker="o", ms=3, label=_label(v, merged))
            ax.set_title(d, fontsize=8)
            ax.grid(alpha=.3)
        for ax in list(axes.flat)[len(dists):]:
            ax.axis("off")
        axes.flat[0].set_ylabel("needles kept")
        axes.flat[0].legend(fontsize=6)
        imgs.append((f"Needles kept against margin (%) at {_ctx(longest)}", _figure_png(fig)))
        plt.close(fig)
    body = "".join(f"<h2>{html.escape(t)}</h2><img src='data:image/png;base64,{b}'/>" for t, b in imgs)
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>body{{font-family:sans-serif;max-width:1200px;margin:auto}}pre{{white-space:pre-wrap}}"
            f"</style><h1>{html.escape(title)}</h1>{body}<pre>{html.escape(md)}</pre>")


def render(result: dict, out_dir: Path, *, title: str, meta: dict) -> dict:
    """Write study.json, study.md, study.html, study.csv, study-needles.csv; return their paths."""
    import pandas as pd
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from harness.io import atomic  # each file whole or not at all, umask modes
    atomic.write_text(out_dir / "study.csv", pd.DataFrame(result["rows"]).to_csv(index=False))
    atomic.write_text(out_dir / "study-needles.csv", pd.DataFrame(result["needles"]).to_csv(index=False))
    md = full_markdown(result, meta)
    atomic.write_text(out_dir / "study.md", f"# {title}\n\n{md}\n")
    atomic.write_text(out_dir / "study.html", _html(result, meta, title, md))
    atomic.write_text(out_dir / "study.json", json.dumps({"meta": meta, **result}, indent=1, default=str))
    return {n: str(out_dir / n) for n in ("study.json", "study.md", "study.html", "study.csv", "study-needles.csv")}
