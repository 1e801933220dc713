"""`mxval study`: what the quantized indexer costs against the exact one.

Byte-exactness says a kernel does what the reference does; it does not say whether MXFP4
keys still select the right tokens, nor what a wrong selection costs the attention. The
study scores the same queries and keys with every variant of the indexer (named
configurations of the reference, NUMERICS.md §7, §8; harness/commands/study_variants.py) and
measures, per query row, against the exact bf16 indexer:

* top-k recall with the tie rule of §6 (and Jaccard, and the rank of the exact k-th key);
* the downstream cost: the sparse attention output over the variant's top-k against the
  output over the exact top-k (softmax at the model's scale, D**-0.5 on q.k, generated
  values), and the attention mass the selection keeps;
* needles: a key drawn from the key distribution at a chosen depth, moved along its
  query's direction until its exact score is a margin above the row's exact k-th; is it
  kept? Only where selection happens (contexts of more than top-k entries).

Inputs are drawn per (distribution, seed) once, at the longest context; shorter contexts
are its prefixes (harness/commands/study_inputs.py). Tables give the mean over seeds and the 95 %
t-interval of the seeds' means (harness/commands/study_report.py).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.commands.study_inputs import Distribution, draw, input_stats, make_inputs, make_needles  # noqa: F401
from harness.commands.study_metrics import (  # noqa: F401
    ExactTopK,
    SparseAttention,
    head_scores,
    indexer_logits,
    needles_kept,
    row_metrics,
    select,
)
from harness.commands.study_report import render, summary_markdown  # noqa: F401
from harness.commands.study_variants import VARIANTS, Variant, key_side, ordered, query_side  # noqa: F401
from harness.errors import EXIT_INTERRUPTED, StudyConfigError
from harness.io import atomic, escape, safe_input
from harness.run.signals import hold, release, stopped_by
from reference import checks
from reference.formats import preset
from reference.k_writer import group_start, k_values
from reference.q_quant import fold_weights, q_values

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
MAX_CONTEXT = 2 ** 21          # tokens of one studied context (the preset's 1M and some)
MAX_ROWS = 4096                # query rows per seed
MAX_SEEDS = 1000


@dataclass
class StudyConfig:
    name: str = "default"
    model: str = "deepseek-v4-pro"
    distributions: list = field(default_factory=lambda: [Distribution()])
    variants: list = field(default_factory=lambda: list(VARIANTS))
    context_tokens: list = field(default_factory=lambda: [8192, 16384, 32768, 65536, 131072])
    rows: int = 8                      # query rows per seed
    seeds: int = 5                     # seeds seed, seed + 1, ...
    seed: int = 0
    needle_depths: list = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    needle_margins: list = field(default_factory=lambda: [0.01, 0.02, 0.05, 0.1])
    heads: int | None = None
    value_dim: int = 128
    tolerance: float = 0.01            # "within" in the decision: recall gap to FP8

    def __post_init__(self):
        for key, hi in (("rows", MAX_ROWS), ("seeds", MAX_SEEDS), ("seed", 2 ** 63), ("value_dim", 4097)):
            try:
                checks.integer(key, getattr(self, key), 0 if key == "seed" else 1, hi)
            except ValueError as e:
                raise StudyConfigError(str(e)) from None
        if self.heads is not None and not (checks.is_int(self.heads) and 1 <= self.heads <= 256):
            raise StudyConfigError(f"heads: expected an integer in [1, 257), got {self.heads!r:.60}")
        if (not isinstance(self.context_tokens, list) or not 1 <= len(self.context_tokens) <= 64
                or any(not checks.is_int(c) or not 1 <= c <= MAX_CONTEXT for c in self.context_tokens)):
            raise StudyConfigError(f"context_tokens: expected 1 to 64 integers in [1, {MAX_CONTEXT + 1}), "
                                   f"got {self.context_tokens!r:.80}")
        for key in ("needle_depths", "needle_margins", "variants", "distributions"):
            v = getattr(self, key)
            if not isinstance(v, list) or len(v) > 64:
                raise StudyConfigError(f"{key}: expected a list of at most 64 entries, got {v!r:.80}")
        if any(not 0 <= dp <= 1 for dp in self.needle_depths):
            raise StudyConfigError(f"needle_depths must lie in [0, 1], got {self.needle_depths}")
        if any(not 0 < m < 1 for m in self.needle_margins):
            raise StudyConfigError(f"needle_margins must lie in (0, 1), got {self.needle_margins}")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad:
            raise StudyConfigError(f"unknown variant(s) {bad} (known: {', '.join(VARIANTS)})")
        preset(self.model)

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seed, self.seed + self.seeds))


def _exact_extra(att: SparseAttention, sel: torch.Tensor | None = None, entries: int = 0) -> dict:
    """What the exact top-k itself holds: its share of the attention mass, its output's
    distance from dense attention over every entry, and the share of it in the newest
    quarter of the entries (a quarter when position does not matter)."""
    parts = [att.topk_mass.mean(), att.topk_vs_dense.mean()]
    if sel is not None:
        parts.append((sel >= entries - entries // 4).double().mean())
    return dict(zip(("topk_mass", "topk_vs_dense_err", "recent_share"), torch.stack(parts).tolist()))


def _score_variant(v: Variant, q, w, ws, keys, exact, att: SparseAttention, topk: int, reuse=None,
                   ref: ExactTopK | None = None) -> tuple:
    """-> (row dict of per-row means, the variant's logits, its q operands)."""
    if v.kind == "exact":
        qv, wv, logits = q.float(), fold_weights(w, ws), exact
    else:
        qv, wv = query_side(v, q, w, ws)
        logits = reuse if reuse is not None else indexer_logits(qv, keys, wv)
    m = row_metrics(exact, logits, topk, ref=ref)
    a = att.cost(select(logits, topk))
    names = ("recall", "recall_min", "jaccard", "kth_rank", "out_err", "mass_kept", "nan_keys")
    vals = torch.stack([m["recall"].mean(), m["recall"].min(), m["jaccard"].mean(), m["kth_rank"].mean(),
                        a["out_err"].mean(), a["mass_kept"].mean(), torch.isnan(keys).any(1).double().mean()])
    return dict(zip(names, vals.tolist())), logits, (qv, wv)


def _no_selection_rows(base, names):
    return [{**base, "variant": n, "kind": VARIANTS[n].kind, "selection": False, "recall": 1.0,
             "recall_min": 1.0, "jaccard": 1.0, "kth_rank": float(base["entries"]), "out_err": 0.0,
             "mass_kept": 1.0, "nan_keys": 0.0} for n in names]


def _study_context(cfg, d, names, kside, same_k, tokens, res, merges):
    p = d.preset
    topk, ws = p.topk, p.weights_scale
    j = tokens // p.compress_ratio
    base = {"distribution": d.dist.name, "seed": d.seed, "context_tokens": tokens, "entries": j,
            "chance": min(1.0, topk / j)}
    if j <= topk:   # every entry kept: nothing to measure, no needle to place
        res["rows"] += _no_selection_rows(base, names)
        return
    q = d.queries(j)
    keys = d.k[:j]
    s = head_scores(q, keys)
    wf = fold_weights(d.w, ws)
    exact = torch.bmm(wf.unsqueeze(1), s.clamp_min(0)).squeeze(1)
    ref = ExactTopK(exact, topk)
    att = SparseAttention(s, d.v[:j], ref.idx, p.softmax_scale)
    kth, kth_idx = exact.gather(1, ref.kth_key)[:, 0], ref.kth_key[:, 0]
    # the margin's unit: the k-th key's gross score, sum_h |w_h| relu(q_h . k); with signed
    # weights the k-th score is a difference of such terms and can sit near 0
    gross = (wf.abs() * s.gather(2, kth_idx[:, None, None].expand(-1, s.shape[1], 1))[..., 0].clamp_min(0)).sum(1)
    del s
    nd = make_needles(d, j, q, wf, kth, cfg.needle_depths, cfg.needle_margins, scale=gross)
    rows, ndep, nmar = q.shape[0], len(cfg.needle_depths), len(cfg.needle_margins)
    n_keys = nd["keys"].reshape(rows, ndep * nmar, -1)
    cols = torch.tensor(nd["cols"], device=q.device).repeat_interleave(nmar).expand(rows, -1)
    valid = nd["valid"].reshape(rows, ndep, nmar)
    norm_ratio = (n_keys.norm(dim=-1) / keys.norm(dim=-1).median()).reshape(rows, ndep, nmar)
    done = {}
    for n in names:
        v = VARIANTS[n]
        reuse = None
        if v.merge_into and same_k.get(n):
            qv, wv = query_side(v, q, d.w, ws)
            tq, tw = done[v.merge_into]["ops"]
            same = torch.equal(qv, tq) and torch.equal(wv, tw)
            merges[n]["values"] += qv.numel()
            merges[n]["differ"] += int((qv != tq).sum()) if qv.shape == tq.shape else qv.numel()
            reuse = done[v.merge_into]["logits"] if same else None
        row, logits, ops = _score_variant(v, q, d.w, ws, kside[n][:j], exact, att, topk, reuse, ref)
        done[n] = {"logits": logits, "ops": ops}
        extra = _exact_extra(att, ref.idx, j) if v.kind == "exact" else {}
        res["rows"].append({**base, "variant": n, "kind": v.kind, "selection": True, **row, **extra})
        # needles: the variant's own quantization of each needle, scored against its row
        qv, wv = ops
        kn = key_side(v, n_keys)
        sc = torch.bmm(wv.unsqueeze(1), torch.matmul(qv, kn.transpose(1, 2)).clamp_min(0)).squeeze(1)
        kept, rank = needles_kept(logits, sc, cols, topk)
        kept, rank = kept.reshape(rows, ndep, nmar), rank.reshape(rows, ndep, nmar).double()
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=q.device)
        per_cell = torch.stack([valid.sum(0).double(), (kept & valid).sum(0).double(),
                                torch.where(valid, rank, nan).nanmedian(0).values,
                                torch.where(valid, nd["margin"].double(), nan).nanmean(0),
                                torch.where(valid, norm_ratio.double(), nan).nanmean(0)], -1).tolist()
        for di, depth in enumerate(cfg.needle_depths):
            for mi, margin in enumerate(cfg.needle_margins):
                cnt, kc, rmed, mreal, nrat = per_cell[di][mi]
                res["needles"].append({
                    **base, "variant": n, "kind": v.kind, "depth": depth, "margin": margin,
                    "column": nd["cols"][di], "n": int(cnt), "kept": int(kc), "rank_median": rmed,
                    "margin_realized": mreal, "norm_ratio": nrat})


def run_study(cfg: StudyConfig, *, device: str = "cpu", progress=None) -> dict:
    """-> {"rows": per (distribution, seed, context, variant), "needles": per (..., depth,
    margin), "inputs": per (distribution, seed) statistics, "merges": variants whose
    operands were compared with another's}. Ctrl-C or SIGTERM stops it: the contexts that
    finished are kept (a context half scored is dropped), and "interrupted" says so."""
    p = preset(cfg.model)
    heads = cfg.heads or p.index_heads
    contexts = sorted(set(int(c) for c in cfg.context_tokens))
    jmax = max(c // p.compress_ratio for c in contexts)
    names = ordered(cfg.variants)
    res = {"rows": [], "needles": [], "inputs": [], "merges": {}}
    merges = {n: {"into": VARIANTS[n].merge_into, "values": 0, "differ": 0}
              for n in names if VARIANTS[n].merge_into}
    mark = {k: 0 for k in ("rows", "needles", "inputs")}
    units = len(cfg.distributions) * len(cfg.seed_list) * len(contexts)
    try:
        _study_all(cfg, device, progress, contexts, jmax, names, heads, res, merges, mark)
    except KeyboardInterrupt:
        for k, n in mark.items():
            del res[k][n:]
        done = len({(r["distribution"], r["seed"], r["context_tokens"]) for r in res["rows"]})
        res["interrupted"] = {"signal": stopped_by(), "cases_done": done, "cancelled": [f"{units - done} of {units} "
                                                                                        "(distribution, seed, context)"]}
    res["merges"] = merges
    return res


def _study_all(cfg, device, progress, contexts, jmax, names, heads, res, merges, mark) -> None:
    with torch.no_grad():
        for dist in cfg.distributions:
            for seed in cfg.seed_list:
                d = draw(dist, seed, entries=jmax, rows=cfg.rows, heads=heads, model=cfg.model,
                         value_dim=cfg.value_dim, device=device)
                res["inputs"].append({"distribution": dist.name, "seed": seed,
                                      **input_stats(d.k, d.queries(jmax)),
                                      "outlier_channels": d.outlier_idx, "sink_channels": d.sink_idx})
                kside, same_k = {}, {}
                for n in names:
                    v = VARIANTS[n]
                    kside[n] = key_side(v, d.k)
                    if v.merge_into:
                        a, b = kside[n], kside[v.merge_into]
                        same_k[n] = torch.equal(a, b)
                        merges[n]["values"] += a.numel()
                        merges[n]["differ"] += int((a != b).sum())
                for tokens in contexts:
                    _study_context(cfg, d, names, kside, same_k, tokens, res, merges)
                    mark.update({k: len(res[k]) for k in mark})      # a whole context: kept on Ctrl-C
                    if progress:
                        progress()


# --- configuration ------------------------------------------------------------------------

STUDY_FILE = Path(__file__).resolve().parents[2] / "cases" / "study.toml"


def load_config(name: str, path: Path = STUDY_FILE) -> StudyConfig:
    try:
        data = safe_input.load_toml(path, error=StudyConfigError)
    except StudyConfigError as e:
        msg = str(e)
        if "cannot read" not in msg:
            msg = msg.replace(f"{path}: ", f"{path}: cannot read study file: ", 1)
        raise StudyConfigError(msg) from None
    studies = data.get("study", {})
    if not isinstance(studies, dict) or not all(isinstance(v, dict) for v in studies.values()):
        raise StudyConfigError(f"{path}: [study.<name>] tables expected")
    if not isinstance(data.get("distribution", {}), dict):
        raise StudyConfigError(f"{path}: [distribution.<name>] tables expected")
    for kind, names in (("study", list(studies)), ("distribution", list(data.get("distribution", {})))):
        bad = next((n for n in names if not _NAME.fullmatch(n)), None)
        if bad is not None:                 # names become file names, CSV cells, figure titles
            raise StudyConfigError(f"{path}: [{kind}.{bad!r:.60}]: a name is 1 to 64 letters, digits, "
                                   "'.', '_' or '-' (not starting with '.' or '-')")
    if name not in studies:
        raise StudyConfigError(f"{path}: no study named {name!r} (known: {', '.join(studies)})")
    s = dict(studies[name])
    dists = data.get("distribution", {})
    names = s.pop("distributions", ["normal"])
    unknown = [n for n in names if n not in dists]
    if unknown:
        raise StudyConfigError(f"{path}: study {name!r} names unknown distribution(s) {unknown}")
    try:
        return StudyConfig(name=name, distributions=[Distribution(name=n, **dists[n]) for n in names], **s)
    except (TypeError, ValueError) as e:
        raise StudyConfigError(f"{path}: study {name!r}: {e}") from None


# --- a captured dump ----------------------------------------------------------------------


def study_dump(path: str, cfg: StudyConfig, *, device: str = "cpu") -> dict:
    """Real activations: keys from a dump's K-writer inputs (pooled rows -> norm -> RoPE),
    queries and head weights from its Q-quant inputs when present (generated otherwise);
    values are generated. Every query row scores every captured entry."""
    from harness.io.dumps import read_dump
    from reference.k_writer import writer_mask
    dump = read_dump(path)
    kop = dump.ops.get("k_norm_rope_mxfp4_cache") or dump.ops.get("k_norm_rope_fp8_cache")
    if kop is None:
        raise StudyConfigError(f"{path}: the study needs a K-writer op (k_norm_rope_*_cache) in the dump")
    i, s = kop.inputs, kop.scalars
    sel = writer_mask(i["positions"], i["slot_mapping"], s["compress_ratio"])
    k = k_values(i["k"][sel], group_start(i["positions"][sel], s["compress_ratio"]), i["cos_sin_cache"],
                 i["norm_weight"], s["norm_eps"])
    if k.shape[0] < 2:
        raise StudyConfigError(f"{path}: the K-writer op writes {k.shape[0]} entries; the study needs at least 2")
    qop = dump.ops.get("q_rope_mxfp4_quant") or dump.ops.get("q_rope_fp8_quant")
    p = preset(cfg.model)
    if qop is not None:
        q = q_values(qop.inputs["q"], qop.inputs["positions"], qop.inputs["cos_sin_cache"])
        w, ws = qop.inputs["weights"].float(), float(qop.scalars["weights_scale"])
    else:   # generated as the study's default distribution draws them
        d = draw(Distribution(), cfg.seed, entries=1, rows=cfg.rows, heads=cfg.heads or p.index_heads,
                 model=cfg.model)
        q, w, ws = d.q_base.to(torch.bfloat16).float(), d.w, p.weights_scale
    j = k.shape[0]
    topk = min(p.topk, max(1, j // 4))   # short captures: keep a quarter so loss shows
    gen = torch.Generator().manual_seed(cfg.seed)
    values = torch.randn(j, cfg.value_dim, generator=gen).to(torch.bfloat16).float()
    q, k, w, values = (t.to(device) for t in (q, k, w, values))
    sc = head_scores(q, k)
    wf = fold_weights(w, ws)
    exact = torch.bmm(wf.unsqueeze(1), sc.clamp_min(0)).squeeze(1)
    att = SparseAttention(sc, values, select(exact, topk), p.softmax_scale)
    base = {"distribution": f"dump:{Path(path).name}", "seed": cfg.seed, "context_tokens": j * s["compress_ratio"],
            "entries": j, "topk": topk, "chance": topk / j, "selection": True,
            "queries": "captured" if qop is not None else "generated (no Q op in the dump)"}
    rows = []
    for n in ordered(cfg.variants):
        v = VARIANTS[n]
        row, _, _ = _score_variant(v, q, w, ws, key_side(v, k), exact, att, topk)
        extra = _exact_extra(att) if v.kind == "exact" else {}
        rows.append({**base, "variant": n, "kind": v.kind, **row, **extra})
    stats = {"distribution": base["distribution"], "seed": cfg.seed, **input_stats(k, q)}
    return {"rows": rows, "needles": [], "inputs": [stats], "merges": {}}


# --- CLI ----------------------------------------------------------------------------------


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
    ap = sub.add_parser("study", help="what MXFP4 costs against FP8 and exact: per distribution, "
                                      "context, needle margin and depth, with intervals over seeds")
    ap.add_argument("--study", default="default", help="study name in cases/study.toml")
    ap.add_argument("--study-file", default=str(STUDY_FILE))
    ap.add_argument("--dump", action="append", default=[], help="study a captured dump's activations")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--report-dir", default=None)
    ap.add_argument("--readme", default=None, help="also write the README summary section to this file")
    ap.add_argument("--from-json", default=None, metavar="STUDY_JSON",
                    help="re-render the reports of a saved study.json (its run's numbers and machine) instead of running")


def run(args) -> int:
    import datetime
    import os

    from harness.commands import study_report
    if args.from_json:
        given = [f for f, v in (("--dump", args.dump), ("--device", args.device)) if v]
        if given:
            raise StudyConfigError(f"{given[0]}: not with --from-json (it re-renders a saved study, running nothing)")
        return _rerender(args)
    cfg = load_config(args.study, Path(args.study_file))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.partition(":")[0] not in ("cpu", "cuda"):
        raise StudyConfigError(f"--device: expected cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StudyConfigError(f"--device: {device} requested but torch sees no CUDA/ROCm GPU")
    out = Path(args.report_dir or f"reports/study-{atomic.safe_name(cfg.name)}")
    t0 = time.time()
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if args.dump:
        parts = []
        try:
            for path in args.dump:
                parts.append(study_dump(path, cfg, device=device))
            stopped = None
        except KeyboardInterrupt:               # the dumps studied so far are the report
            stopped = {"signal": stopped_by(), "cases_done": len(parts), "cancelled": list(args.dump[len(parts):])}
        result = {k: sum((p[k] for p in parts), []) for k in ("rows", "needles", "inputs")}
        result["merges"] = {}
        if stopped:
            result["interrupted"] = stopped
    else:
        from rich.progress import Progress
        total = len(cfg.distributions) * len(cfg.seed_list) * len(set(cfg.context_tokens))
        with Progress(transient=True) as bar:
            task = bar.add_task(f"study {cfg.name}", total=total)
            result = run_study(cfg, device=device, progress=lambda: bar.advance(task))
    hold()                                    # from here a Ctrl-C waits until the report is whole
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    stopped = result.pop("interrupted", None)
    p = preset(cfg.model)
    meta = {"study": cfg.name, "machine": machine_name(device), "device": device,
            "seconds": time.time() - t0, "when": datetime.date.today().isoformat(),
            "load_before": load0, "load_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "topk": p.topk, "rows": cfg.rows, "seeds": cfg.seed_list, "heads": cfg.heads or p.index_heads,
            "contexts": sorted(set(cfg.context_tokens)), "compress_ratio": p.compress_ratio,
            "distributions": [d.name for d in cfg.distributions] if not args.dump else list(args.dump),
            "distribution_fields": {d.name: study_report.distribution_fields(d) for d in cfg.distributions},
            "needle_depths": cfg.needle_depths, "needle_margins": cfg.needle_margins,
            "tolerance": cfg.tolerance, "dump": bool(args.dump)}
    if stopped:
        meta["interrupted"] = stopped
    paths = study_report.render(result, out, title=f"mxval study: {cfg.name}", meta=meta)
    md = study_report.summary_markdown(result, meta)
    late = release()
    print(escape.terminal(md, lines=True))
    print(f"\nreports: {', '.join(paths.values())}")
    if stopped or late:
        print(f"mxval: interrupted: partial study report ({len(result['rows'])} row(s) kept; re-render with "
              f"`mxval study --from-json {out / 'study.json'}`)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.readme:
        atomic.write_text(args.readme, md + "\n")
    return 0


def _rerender(args) -> int:

    from harness.commands import study_report
    try:
        saved = safe_input.load_json(args.from_json, error=StudyConfigError)
    except StudyConfigError as e:
        raise StudyConfigError(f"--from-json: not a study.json ({e})") from None
    try:
        meta = saved["meta"]
        result = {k: saved[k] for k in ("rows", "needles", "inputs", "merges")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StudyConfigError(f"--from-json: {args.from_json}: not a study.json ({e})") from None
    out = Path(args.report_dir or Path(args.from_json).parent)
    paths = study_report.render(result, out, title=f"mxval study: {meta.get('study', '?')}", meta=meta)
    md = study_report.summary_markdown(result, meta)
    print(escape.terminal(md, lines=True))
    print(f"\nreports: {', '.join(paths.values())}")
    if args.readme:
        atomic.write_text(args.readme, md + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mxval")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    return run(ap.parse_args(argv))
