"""`mxval study`: what the quantized indexer costs against the exact one.

Byte-exactness says a kernel does what the reference does; it does not say whether MXFP4
keys still select the right tokens. The study scores the same queries and keys with every
variant of the indexer (each a named configuration of the reference, NUMERICS.md §7, §8)
and measures, per query row, against the exact bf16 indexer:

* top-k recall with the tie rule of §6, and Jaccard of the two index sets;
* attention-mass recall: the share of the exact softmax mass (softmax of the exact index
  logits over the row's valid entries) that the kept keys carry, relative to the exact
  top-k's share (so exact vs exact is 1);
* the rank, in the variant's order, of the exact k-th key;
* a needle probe: a key planted at a chosen depth that matches the query; is it kept?

Quantization is per entry (MXFP4: per 32-block of one key; FP8: one scale per key), so
planting a needle changes exactly one column of each variant's logits: the probe reuses
the base logits and rescored only that column.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reference import fp8 as ref_fp8
from reference import hadamard as ref_hadamard
from reference import mxfp4 as ref_mxfp4
from reference.formats import preset
from reference.k_writer import group_start, k_values
from reference.q_quant import fold_weights, q_values
from reference.rope import cos_sin_cache
from reference.scoring import weighted_relu_logits

# --- variants: named configurations of the reference ------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    quant: str | None = None          # None (exact), "mxfp4", "fp8"
    scale_rule: str = "ceil"          # MXFP4 scale rule (reference.mxfp4.SCALE_RULES)
    fp8_dtype: str = "e4m3fn"
    hadamard: str = "none"            # "none", "both", "q" (the known-bad one-sided rotation)
    note: str = ""


VARIANTS = {v.name: v for v in (
    Variant("exact", note="bf16 q and k after norm and RoPE"),
    Variant("fp8-e4m3fn", "fp8", fp8_dtype="e4m3fn", note="the default FP8 cache"),
    Variant("fp8-e4m3fnuz", "fp8", fp8_dtype="e4m3fnuz", note="gfx942 flavour, max 224"),
    Variant("mxfp4", "mxfp4", note="as vLLM runs it (ceil scale)"),
    Variant("mxfp4-ocp", "mxfp4", scale_rule="ocp-floor", note="OCP v1.0 floor scale"),
    Variant("fp8-e4m3fn+H", "fp8", fp8_dtype="e4m3fn", hadamard="both"),
    Variant("fp8-e4m3fnuz+H", "fp8", fp8_dtype="e4m3fnuz", hadamard="both"),
    Variant("mxfp4+H", "mxfp4", hadamard="both", note="DeepSeek's reference rotation"),
    Variant("mxfp4-ocp+H", "mxfp4", scale_rule="ocp-floor", hadamard="both"),
    Variant("mxfp4+H-q-only", "mxfp4", hadamard="q", note="known bug: one side rotated"),
)}


def variant_operands(v: Variant, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                     weights_scale: float):
    """Exact operands (bf16-valued q [R,H,D], k [J,D], raw weights [R,H]) -> what the
    variant's scorer multiplies: (q values, k values, folded weights), all exact in fp64."""
    if v.hadamard in ("both", "q"):
        q = ref_hadamard.rotate(q)
    if v.hadamard == "both":
        k = ref_hadamard.rotate(k)
    if v.quant is None:
        return q, k, fold_weights(w, weights_scale)
    if v.quant == "mxfp4":
        qv = ref_mxfp4.dequantize_mxfp4(*ref_mxfp4.quantize_mxfp4(q, v.scale_rule), torch.float64)
        kv = ref_mxfp4.dequantize_mxfp4(*ref_mxfp4.quantize_mxfp4(k, v.scale_rule), torch.float64)
        return qv, kv, fold_weights(w, weights_scale)
    q8, s_q = ref_fp8.quantize_fp8(q, v.fp8_dtype)
    k8, s_k = ref_fp8.quantize_fp8(k, v.fp8_dtype)
    qv = ref_fp8.dequantize_fp8(q8, v.fp8_dtype)
    kv = ref_fp8.dequantize_fp8(k8, v.fp8_dtype) * s_k.double().unsqueeze(-1)
    wv = w.float() * s_q * torch.tensor(weights_scale, dtype=torch.float32, device=w.device)
    return qv, kv, wv


# --- inputs ---------------------------------------------------------------------------


@dataclass
class Distribution:
    """How pooled keys and raw queries are drawn. Named and seeded in cases/study.toml."""
    name: str = "normal"
    outlier_channels: int = 0
    outlier_scale: float = 1.0        # magnitude of outlier channels relative to the rest
    tails: str = "normal"             # "normal" or "student-t"
    tail_df: float = 3.0
    head_scale_spread: float = 0.0    # per-head query scale ~ 2**U(-s, s)
    correlation: float = 0.0          # share of a low-rank common component in keys
    rank: int = 8
    query_key_affinity: float = 0.3   # share of queries drawn from the key subspace

    def sample(self, shape, gen) -> torch.Tensor:
        if self.tails == "student-t":
            # Student-t: normal / sqrt(chi2 / df), the chi2 a sum of df squares (seeded by gen).
            z = torch.randn(shape, generator=gen)
            g = torch.randn(*shape[:-1], int(self.tail_df), generator=gen)
            chi = (g * g).sum(-1, keepdim=True) / self.tail_df
            return z / chi.sqrt().clamp_min(1e-3)
        return torch.randn(shape, generator=gen)


def make_inputs(dist: Distribution, *, entries: int, rows: int, heads: int, head_dim: int,
                rope_dim: int, seed: int, model: str = "deepseek-v4-pro"):
    """-> dict(q [rows,H,D] exact bf16-valued, k [entries,D] exact bf16-valued, w [rows,H])."""
    p = preset(model)
    gen = torch.Generator().manual_seed(seed)
    d = head_dim
    chan = torch.ones(d)
    if dist.outlier_channels:
        idx = torch.randperm(d, generator=gen)[:dist.outlier_channels]
        chan[idx] = dist.outlier_scale
    basis = torch.linalg.qr(torch.randn(d, dist.rank, generator=gen))[0].T   # [rank, D]
    pooled = dist.sample((entries, d), gen)
    if dist.correlation:
        common = torch.randn(entries, dist.rank, generator=gen) @ basis * math.sqrt(d / dist.rank)
        pooled = math.sqrt(1 - dist.correlation) * pooled + math.sqrt(dist.correlation) * common
    pooled = (pooled * chan).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    pos_total = entries * p.compress_ratio
    cs = cos_sin_cache(pos_total + 1, rope_dim, p.rope_base, yarn_factor=p.yarn_factor,
                       yarn_original_max_pos=p.yarn_original_max_pos)
    boundary = torch.arange(entries) * p.compress_ratio + p.compress_ratio - 1
    k = k_values(pooled, group_start(boundary, p.compress_ratio), cs, norm_w, p.rms_eps)
    qraw = dist.sample((rows, heads, d), gen)
    if dist.query_key_affinity:
        aligned = torch.randn(rows, heads, dist.rank, generator=gen) @ basis * math.sqrt(d / dist.rank)
        qraw = math.sqrt(1 - dist.query_key_affinity) * qraw + math.sqrt(dist.query_key_affinity) * aligned
    qraw = qraw * chan
    if dist.head_scale_spread:
        qraw = qraw * 2 ** ((torch.rand(1, heads, 1, generator=gen) * 2 - 1) * dist.head_scale_spread)
    qpos = torch.full((rows,), pos_total - 1, dtype=torch.long)
    q = q_values(qraw.to(torch.bfloat16), qpos, cs)
    w = torch.randn(rows, heads, generator=gen).abs().to(torch.bfloat16).float()
    return {"q": q, "k": k, "w": w, "weights_scale": p.weights_scale}


# --- metrics --------------------------------------------------------------------------


def row_metrics(exact: torch.Tensor, approx: torch.Tensor, k: int, tol_rel: float = 1e-4) -> dict:
    """exact, approx: fp64 [R, J] logits over the valid entries. Per-row tensors."""
    r, j = exact.shape
    if j <= k:   # every entry is kept (and vLLM skips scoring): nothing to lose
        ones = torch.ones(r, dtype=torch.float64)
        return {"recall": ones, "jaccard": ones, "mass_recall": ones,
                "kth_rank": torch.full((r,), float(j), dtype=torch.float64)}
    ex_sorted, ex_idx = torch.sort(exact, dim=1, descending=True)
    kth = ex_sorted[:, k - 1:k]
    tol = tol_rel * exact.abs().amax(dim=1, keepdim=True)
    ap_idx = torch.topk(approx, k, dim=1).indices
    keep = torch.zeros_like(exact, dtype=torch.bool).scatter_(1, ap_idx, True)
    exact_keep = torch.zeros_like(keep).scatter_(1, ex_idx[:, :k], True)
    acceptable = exact >= kth - tol
    recall = (keep & acceptable).sum(1).double() / k
    jaccard = (keep & exact_keep).sum(1).double() / (keep | exact_keep).sum(1).double()
    p = torch.softmax(exact, dim=1)
    mass_recall = (p * keep).sum(1) / (p * exact_keep).sum(1)
    # rank (1-based) of the exact k-th key in the variant's descending order
    kth_key = ex_idx[:, k - 1:k]
    kth_rank = (approx > approx.gather(1, kth_key)).sum(1).double() + 1
    return {"recall": recall, "jaccard": jaccard, "mass_recall": mass_recall, "kth_rank": kth_rank}


def needle_kept(base: torch.Tensor, needle_col: torch.Tensor, depth_idx: int, k: int) -> torch.Tensor:
    """Rows' logits `base` [R, J] with column `depth_idx` replaced by `needle_col` [R]:
    is the needle among the top-k? (Ties resolved against the needle.)"""
    j = base.shape[1]
    if j <= k:
        return torch.ones(base.shape[0], dtype=torch.bool)
    others = base.clone()
    others[:, depth_idx] = float("-inf")
    better = (others > needle_col[:, None]).sum(1) + (others == needle_col[:, None]).sum(1)
    return better < k


def needle_key(q: torch.Tensor, w: torch.Tensor, k_typical: torch.Tensor, strength: float,
               gen: torch.Generator) -> torch.Tensor:
    """A key matching query row `q` [H, D]: the weighted mean query direction, mixed with a
    random typical key, rescaled to the typical key norm, as bf16 values."""
    direction = (w[:, None] * q).sum(0)
    direction = direction / direction.norm()
    noise = k_typical[torch.randint(len(k_typical), (1,), generator=gen)].squeeze(0)
    norm = k_typical.norm(dim=1).median()
    key = strength * direction * norm + (1 - strength) * noise
    return (key / key.norm() * norm).to(torch.bfloat16).float()


def place_needles(q, k, w, weights_scale, exact_logits, trial_rows, cfg, gen, topk) -> torch.Tensor:
    """One needle per trial row. With `needle_margin` set, each needle is scaled so that its
    exact score is (1 + margin) times the row's exact k-th score: the exact indexer keeps
    it, and whether a quantized one does measures how much margin quantization eats."""
    needles = []
    for r in trial_rows:
        key = needle_key(q[r].cpu(), w[r].cpu(), k.cpu(), cfg.needle_strength, gen)
        if cfg.needle_margin is not None and exact_logits.shape[1] > topk:
            kth = exact_logits[r].topk(topk).values[-1]
            s0 = weighted_relu_logits(q[r:r + 1].cpu(), key[None], fold_weights(w[r:r + 1].cpu(), weights_scale))[0, 0]
            if s0 > 0 and kth > 0:
                key = (key * float((1 + cfg.needle_margin) * kth / s0)).to(torch.bfloat16).float()
        needles.append(key)
    return torch.stack(needles).to(q.device)


# --- the study ------------------------------------------------------------------------


@dataclass
class StudyConfig:
    name: str = "default"
    model: str = "deepseek-v4-pro"
    distributions: list = field(default_factory=lambda: [Distribution()])
    variants: list = field(default_factory=lambda: list(VARIANTS))
    context_tokens: list = field(default_factory=lambda: [4096, 8192, 16384, 32768, 65536, 131072])
    rows: int = 8
    needle_depths: list = field(default_factory=lambda: [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
    needle_strength: float = 0.25
    needle_margin: float | None = None   # exact needle score = (1 + margin) * k-th score
    needle_trials: int = 8
    heads: int | None = None
    seed: int = 0


def run_study(cfg: StudyConfig, *, device: str = "cpu", progress=None) -> dict:
    """-> {"rows": [...per (dist, variant, context) aggregates], "needles": [...]}."""
    p = preset(cfg.model)
    heads = cfg.heads or p.index_heads
    rows_out, needles_out = [], []
    for di, dist in enumerate(cfg.distributions):
        for ci, tokens in enumerate(cfg.context_tokens):
            entries = tokens // p.compress_ratio
            seed = cfg.seed * 1000003 + di * 1009 + ci
            inp = make_inputs(dist, entries=entries, rows=max(cfg.rows, cfg.needle_trials),
                              heads=heads, head_dim=p.head_dim, rope_dim=p.rope_dim, seed=seed,
                              model=cfg.model)
            q, k, w = (inp[n].to(device) for n in ("q", "k", "w"))
            gen = torch.Generator().manual_seed(seed + 7)
            trial_rows = list(range(cfg.needle_trials))
            exact_logits = weighted_relu_logits(q, k, fold_weights(w, inp["weights_scale"])).cpu()
            needles = place_needles(q, k, w, inp["weights_scale"], exact_logits, trial_rows, cfg, gen, p.topk)
            for vname in ["exact"] + [v for v in cfg.variants if v != "exact"]:
                v = VARIANTS[vname]
                qv, kv, wv = variant_operands(v, q, k, w, inp["weights_scale"])
                logits = exact_logits if vname == "exact" else weighted_relu_logits(qv, kv, wv).cpu()
                m = row_metrics(exact_logits[:cfg.rows], logits[:cfg.rows], p.topk)
                rows_out.append({"distribution": dist.name, "variant": vname, "context_tokens": tokens,
                                 "entries": entries, **{f"{n}_mean": float(t.mean()) for n, t in m.items()},
                                 "recall_min": float(m["recall"].min()),
                                 "mass_recall_min": float(m["mass_recall"].min())})
                # needle: the variant's own quantization of the needle key, one column rescored
                _, nv, _ = variant_operands(v, q[:1], needles, w[:1], inp["weights_scale"])
                for depth in cfg.needle_depths:
                    col = round(depth * (entries - 1))
                    kept = []
                    for r in trial_rows:
                        score = weighted_relu_logits(qv[r:r + 1], nv[r:r + 1], wv[r:r + 1]).cpu()[0, 0]
                        kept.append(bool(needle_kept(logits[r:r + 1], score.reshape(1), col, p.topk)[0]))
                    needles_out.append({"distribution": dist.name, "variant": vname,
                                        "context_tokens": tokens, "depth": depth,
                                        "kept_frac": sum(kept) / len(kept)})
                if progress:
                    progress()
    return {"rows": rows_out, "needles": needles_out}


# --- configuration, CLI, reports --------------------------------------------------------

STUDY_FILE = Path(__file__).resolve().parent.parent / "cases" / "study.toml"


def load_config(name: str, path: Path = STUDY_FILE) -> StudyConfig:
    import tomllib
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: cannot read study file: {e}") from None
    studies = data.get("study", {})
    if name not in studies:
        raise ValueError(f"{path}: no study named {name!r} (known: {', '.join(studies)})")
    s = dict(studies[name])
    dists = data.get("distribution", {})
    names = s.pop("distributions", ["normal"])
    unknown = [n for n in names if n not in dists]
    if unknown:
        raise ValueError(f"{path}: study {name!r} names unknown distribution(s) {unknown}")
    bad = [v for v in s.get("variants", []) if v not in VARIANTS]
    if bad:
        raise ValueError(f"{path}: unknown variant(s) {bad} (known: {', '.join(VARIANTS)})")
    try:
        return StudyConfig(name=name, distributions=[Distribution(name=n, **dists[n]) for n in names], **s)
    except TypeError as e:
        raise ValueError(f"{path}: study {name!r}: {e}") from None


def study_dump(path: str, cfg: StudyConfig) -> dict:
    """Real activations: keys from a dump's K-writer inputs (pooled rows -> norm -> RoPE),
    queries and weights from its Q-quant inputs when present."""
    from harness.dumps import read_dump
    from reference.k_writer import writer_mask
    dump = read_dump(path)
    kop = dump.ops.get("k_norm_rope_mxfp4_cache") or dump.ops.get("k_norm_rope_fp8_cache")
    if kop is None:
        raise ValueError(f"{path}: the study needs a K-writer op (k_norm_rope_*_cache) in the dump")
    i, s = kop.inputs, kop.scalars
    sel = writer_mask(i["positions"], i["slot_mapping"], s["compress_ratio"])
    k = k_values(i["k"][sel], group_start(i["positions"][sel], s["compress_ratio"]), i["cos_sin_cache"],
                 i["norm_weight"], s["norm_eps"])
    qop = dump.ops.get("q_rope_mxfp4_quant") or dump.ops.get("q_rope_fp8_quant")
    p = preset(cfg.model)
    if qop is not None:
        q = q_values(qop.inputs["q"], qop.inputs["positions"], qop.inputs["cos_sin_cache"])
        w, ws = qop.inputs["weights"].float(), float(qop.scalars["weights_scale"])
    else:
        gen = torch.Generator().manual_seed(cfg.seed)
        q = torch.randn(cfg.rows, p.index_heads, k.shape[1], generator=gen).to(torch.bfloat16).float()
        w, ws = torch.randn(cfg.rows, p.index_heads, generator=gen).abs(), p.weights_scale
    rows = []
    exact = None
    topk = min(p.topk, max(1, k.shape[0] // 4))  # short captures: keep a quarter so loss shows
    for vname in ["exact"] + [v for v in cfg.variants if v != "exact"]:
        qv, kv, wv = variant_operands(VARIANTS[vname], q, k, w, ws)
        logits = weighted_relu_logits(qv, kv, wv)
        exact = logits if exact is None else exact
        m = row_metrics(exact, logits, topk)
        rows.append({"distribution": f"dump:{Path(path).name}", "variant": vname,
                     "context_tokens": k.shape[0] * s["compress_ratio"], "entries": k.shape[0],
                     "topk": topk, "queries": "captured" if qop is not None else "generated (no Q op in the dump)",
                     **{f"{n}_mean": float(t.mean()) for n, t in m.items()},
                     "recall_min": float(m["recall"].min()), "mass_recall_min": float(m["mass_recall"].min())})
    return {"rows": rows, "needles": []}


def render(result: dict, out_dir: Path, *, title: str, meta: dict) -> dict:
    """Write study.json, study.md, study.html, study.csv; return their paths."""
    import pandas as pd
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = pd.DataFrame(result["rows"])
    needles = pd.DataFrame(result["needles"])
    rows.to_csv(out_dir / "study.csv", index=False)
    (out_dir / "study.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    md = summary_markdown(rows, needles, meta)
    (out_dir / "study.md").write_text(f"# {title}\n\n{md}\n")
    (out_dir / "study.html").write_text(_html(rows, needles, title, md))
    return {n: str(out_dir / n) for n in ("study.json", "study.md", "study.html", "study.csv")}


def summary_markdown(rows, needles, meta: dict) -> str:
    lines = [f"Measured {meta.get('when', '')} on {meta.get('machine', '?')} "
             f"({meta.get('seconds', 0):.0f} s); top-k {meta.get('topk')}, {meta.get('rows')} query rows "
             f"per context, distributions: {', '.join(meta.get('distributions', []))}.", ""]
    if rows.empty:
        return "\n".join(lines)
    longest = rows["context_tokens"].max()
    lines.append(f"Top-k recall (mean over rows and distributions; tie rule of NUMERICS.md §6) by "
                 f"context length, and at {longest // 1024}k tokens the attention-mass recall, the "
                 f"worst row's recall and the rank of the exact k-th key:")
    lines.append("")
    piv = rows.pivot_table(index="variant", columns="context_tokens", values="recall_mean", aggfunc="mean")
    at = rows[rows.context_tokens == longest].groupby("variant").agg(
        mass=("mass_recall_mean", "mean"), worst=("recall_min", "min"), rank=("kth_rank_mean", "mean"))
    order = [v for v in VARIANTS if v in piv.index]
    head = "| variant | " + " | ".join(f"{c // 1024}k" for c in piv.columns) + \
           f" | mass recall @{longest // 1024}k | worst row | k-th key rank |"
    lines += [head, "|" + "---|" * (len(piv.columns) + 4)]
    for v in order:
        lines.append(f"| {v} | " + " | ".join(f"{piv.loc[v, c]:.4f}" for c in piv.columns)
                     + f" | {at.loc[v, 'mass']:.5f} | {at.loc[v, 'worst']:.4f} | {at.loc[v, 'rank']:.0f} |")
    if not needles.empty:
        nk = needles.groupby("variant")["kept_frac"].mean()
        margin = meta.get("needle_margin")
        lines += ["", "Needles kept (mean over depths, lengths and distributions"
                  + (f"; each needle's exact score {margin:.0%} above the row's exact k-th" if margin else "")
                  + "): "
                  + ", ".join(f"{v} {nk[v]:.3f}" for v in order if v in nk.index)]
    return "\n".join(lines)


def _figure_png(fig) -> str:
    import base64
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _html(rows, needles, title, md) -> str:
    import html
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    imgs = []
    if not rows.empty:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for v, g in rows.groupby("variant"):
            g = g.groupby("context_tokens")["recall_mean"].mean()
            ax.plot(g.index, g.values, marker="o", label=v, linestyle="--" if "q-only" in v else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("top-k recall vs exact")
        ax.grid(alpha=.3)
        ax.legend(fontsize=7, ncol=2)
        imgs.append(("Top-k recall against context length", _figure_png(fig)))
        plt.close(fig)
    if not needles.empty:
        variants = [v for v in VARIANTS if v in set(needles.variant)]
        cols = min(4, len(variants))
        nrows = math.ceil(len(variants) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False)
        for ax, v in zip(axes.flat, variants):
            piv = needles[needles.variant == v].pivot_table(index="depth", columns="context_tokens",
                                                            values="kept_frac", aggfunc="mean")
            ax.imshow(piv.values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_title(v, fontsize=8)
            ax.set_xticks(range(len(piv.columns)), [f"{c // 1024}k" for c in piv.columns], fontsize=6)
            ax.set_yticks(range(len(piv.index)), [f"{d:.0%}" for d in piv.index], fontsize=6)
        for ax in list(axes.flat)[len(variants):]:
            ax.axis("off")
        fig.suptitle("needles kept in the top-k: depth (rows) x context (columns)", fontsize=9)
        imgs.append(("Needle heatmaps", _figure_png(fig)))
        plt.close(fig)
    body = "".join(f"<h2>{html.escape(t)}</h2><img src='data:image/png;base64,{b}'/>" for t, b in imgs)
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}pre{{white-space:pre-wrap}}"
            f"</style><h1>{html.escape(title)}</h1><pre>{html.escape(md)}</pre>{body}")


def machine_name(device: str) -> str:
    import os
    import platform
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores (torch {torch.__version__}, CPU)"


def add_parser(sub) -> None:
    ap = sub.add_parser("study", help="what MXFP4 costs against FP8 and exact, by context and needle depth")
    ap.add_argument("--study", default="default", help="study name in cases/study.toml")
    ap.add_argument("--study-file", default=str(STUDY_FILE))
    ap.add_argument("--dump", action="append", default=[], help="study a captured dump's activations")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--report-dir", default=None)
    ap.add_argument("--readme", default=None, help="also write the README summary section to this file")


def run(args) -> int:
    import datetime
    cfg = load_config(args.study, Path(args.study_file))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.partition(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device: {device} requested but torch sees no CUDA/ROCm GPU")
    out = Path(args.report_dir or f"reports/study-{cfg.name}")
    t0 = time.time()
    if args.dump:
        parts = [study_dump(path, cfg) for path in args.dump]
        result = {"rows": sum((p["rows"] for p in parts), []), "needles": []}
    else:
        from rich.progress import Progress
        total = len(cfg.distributions) * len(cfg.context_tokens) * len(cfg.variants)
        with Progress(transient=True) as bar:
            task = bar.add_task(f"study {cfg.name}", total=total)
            result = run_study(cfg, device=device, progress=lambda: bar.advance(task))
    p = preset(cfg.model)
    meta = {"study": cfg.name, "machine": machine_name(device), "seconds": time.time() - t0,
            "when": datetime.date.today().isoformat(), "topk": p.topk, "rows": cfg.rows,
            "distributions": [d.name for d in cfg.distributions] + list(args.dump),
            "needle_strength": cfg.needle_strength, "needle_margin": cfg.needle_margin}
    paths = render(result, out, title=f"mxval study: {cfg.name}", meta=meta)
    import pandas as pd
    md = summary_markdown(pd.DataFrame(result["rows"]), pd.DataFrame(result["needles"]), meta)
    print(md)
    print(f"\nreports: {', '.join(paths.values())}")
    if args.readme:
        Path(args.readme).write_text(md + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mxval")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    return run(ap.parse_args(argv))
