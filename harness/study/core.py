"""The study itself: configuration, generated runs and captured dumps.

Byte-exactness says a kernel does what the reference does; it does not say whether MXFP4
keys still select the tokens that matter. The study scores the same queries and keys with
every variant of the indexer (named configurations of the reference, NUMERICS.md §7, §8;
harness/study/variants.py) and measures, per query row, against the exact bf16 indexer:

* what the selection keeps: the share of the exact top-k's attention mass (softmax at the
  model's scale, D**-0.5 on q.k, per head), the share of the exact top-m (m = 64, 256), the
  exact ranks of the keys it misses, and top-k recall with the tie rule of §6;
* over-selection: the share of the exact top-k inside the variant's top-k' (k' >= k);
* the variant's logit noise against the margins selection works with;
* needles: a key drawn from the key distribution at a chosen depth, moved along its
  query's direction until its exact score is a margin above the row's exact k-th; is it
  kept? Only where selection happens (contexts of more than top-k entries).

Inputs are drawn per (distribution, seed) once, at the longest context; shorter contexts
are its prefixes (harness/study/inputs.py). The query rows of a context sit at positions
spread over its newer part (`query_spread`), each seeing the entries before it.
"""
from __future__ import annotations

import math
import re
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import torch

from harness.errors import StudyConfigError
from harness.io import safe_input
from harness.io.dumps import read_dump
from harness.run.signals import stopped_by
from harness.study.inputs import Distribution, draw, input_stats, make_needles
from harness.study.metrics import (
    TOP_M,
    ExactTopK,
    SparseAttention,
    head_scores,
    indexer_logits,
    needles_kept,
    noise_metrics,
    over_select,
    proxy_mass_kept,
    row_metrics,
    select,
)
from harness.study.variants import VARIANTS, Variant, key_side, key_sides, ordered, query_side
from reference import checks
from reference.formats import preset
from reference.k_writer import group_start, k_values, writer_mask
from reference.q_quant import fold_weights, q_values

STUDY_FILE = Path(__file__).resolve().parents[2] / "cases" / "study.toml"
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
    seeds: int = 20                    # seeds seed, seed + 1, ...
    seed: int = 0
    query_spread: float = 0.5          # rows spread over the newest share of the context (0: all at its end)
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
        if not 0 <= self.query_spread < 1:
            raise StudyConfigError(f"query_spread must lie in [0, 1), got {self.query_spread}")
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


def row_entries(entries: int, rows: int, spread: float, topk: int) -> torch.Tensor:
    """Entries each query row sees: row 0 the whole context, the others evenly down to
    (1 - spread) of it, never to top-k or fewer (a row that keeps everything selects nothing)."""
    lo = min(entries, max(topk + 1, math.ceil((1 - spread) * entries)))
    if rows == 1:
        return torch.tensor([entries])
    return torch.linspace(entries, lo, rows, dtype=torch.float64).round().long()


def _mean_rows(m: dict) -> dict:
    """Per-row tensors -> the cell's numbers: means (NaN rows left out), the worst recall and
    the best exact rank any row lost."""
    out = {}
    for name, t in m.items():
        t = t.double()
        out[name] = float(t.nanmean()) if bool(torch.isfinite(t).any()) else float("nan")
    out["recall_min"] = float(m["recall"].min())
    if "miss_rank_best" in m:
        out["miss_rank_best"] = float(m["miss_rank_best"].min())
    return out


def _exact_extra(att: SparseAttention, sel: torch.Tensor, seen: torch.Tensor, topk: int) -> dict:
    """What the exact top-k itself holds: its share of the attention mass (and a random
    top-k's, k / entries), its output's distance from dense attention over every entry, and
    the share of it among the newest quarter of each row's entries."""
    seen = seen.to(sel.device)
    chance = topk / seen.double()
    recent = (sel >= (seen - seen // 4)[:, None]).double().mean(1)
    return {"topk_mass": float(att.topk_mass.mean()), "chance_mass": float(chance.mean()),
            "mass_kept_chance": float((chance / att.topk_mass).mean()),
            "topk_vs_dense_err": float(att.topk_vs_dense.mean()), "recent_share": float(recent.mean())}


def _score_variant(v: Variant, q, w, ws, keys, ref: ExactTopK, att: SparseAttention, topk: int, valid,
                   reuse=None, key_nan=None) -> tuple:
    """-> (cell dict of per-row means, the variant's logits, its q operands)."""
    if v.kind == "exact":
        qv, wv, logits = q.float(), fold_weights(w, ws), ref.exact
    else:
        qv, wv = query_side(v, q, w, ws)
        logits = reuse if reuse is not None else \
            indexer_logits(qv, keys, wv).masked_fill(~valid, float("-inf"))
    m = row_metrics(ref.exact, logits, topk, ref=ref)
    sel = select(logits, topk)
    m.update(att.cost(sel))
    m["proxy_mass_kept"] = proxy_mass_kept(ref, sel)
    m.update(noise_metrics(ref, logits))
    cell = _mean_rows(m)
    key_nan = torch.isnan(keys).any(1) if key_nan is None else key_nan
    cell["nan_keys"] = float(key_nan.double().mean())
    return cell, logits, (qv, wv)


def _no_selection_rows(base, names):
    full = {"recall": 1.0, "recall_min": 1.0, "jaccard": 1.0, "kth_rank": float(base["entries"]),
            "out_err": 0.0, "mass_kept": 1.0, "proxy_mass_kept": 1.0, "nan_keys": 0.0, "miss_n": 0.0,
            **{f"top{m}": 1.0 for m in TOP_M}, **{f"cover{k}": 1.0 for k in over_select(base["topk"])}}
    return [{**base, "variant": n, "kind": VARIANTS[n].kind, "selection": False, **full} for n in names]


def _study_context(cfg, d, names, kside, same_k, tokens, res, merges):
    p = d.preset
    topk, ws = p.topk, p.weights_scale
    j = tokens // p.compress_ratio
    base = {"distribution": d.dist.name, "seed": d.seed, "context_tokens": tokens, "entries": j, "topk": topk,
            "chance": min(1.0, topk / j)}
    if j <= topk:   # every entry kept: nothing to measure, no needle to place
        res["rows"] += _no_selection_rows(base, names)
        return
    seen = row_entries(j, cfg.rows, cfg.query_spread, topk)
    base["entries_min"] = int(seen.min())
    q = d.queries(seen)
    keys = d.k[:j]
    valid = torch.arange(j, device=q.device)[None, :] < seen.to(q.device)[:, None]       # [R, J]
    s = head_scores(q, keys)
    wf = fold_weights(d.w, ws)
    exact = torch.bmm(wf.unsqueeze(1), s.clamp_min(0)).squeeze(1).masked_fill(~valid, float("-inf"))
    ref = ExactTopK(exact, topk)
    att = SparseAttention(s, d.v[:j], ref.idx, p.softmax_scale, valid)
    kth, kth_idx = ref.kth, ref.kth_key[:, 0]
    # the margin's unit: the k-th key's gross score, sum_h |w_h| relu(q_h . k); with signed
    # weights the k-th score is a difference of such terms and can sit near 0
    gross = (wf.abs() * s.gather(2, kth_idx[:, None, None].expand(-1, s.shape[1], 1))[..., 0].clamp_min(0)).sum(1)
    del s
    # needles sit among the entries every row sees
    nd = make_needles(d, int(seen.min()), q, wf, kth, cfg.needle_depths, cfg.needle_margins, scale=gross)
    rows, ndep, nmar = q.shape[0], len(cfg.needle_depths), len(cfg.needle_margins)
    n_keys = nd["keys"].reshape(rows, ndep * nmar, nd["keys"].shape[-1])        # no needles: [R, 0, D]
    cols = torch.tensor(nd["cols"], device=q.device).repeat_interleave(nmar).expand(rows, -1)
    ok = nd["valid"].reshape(rows, ndep, nmar)
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
        cell, logits, ops = _score_variant(v, q, d.w, ws, kside[n][:j], ref, att, topk, valid, reuse,
                                           key_nan=kside[n + "/nan"][:j])
        done[n] = {"logits": logits, "ops": ops}
        extra = _exact_extra(att, ref.idx, seen, topk) if v.kind == "exact" else {}
        res["rows"].append({**base, "variant": n, "kind": v.kind, "selection": True, **cell, **extra})
        # needles: the variant's own quantization of each needle, scored against its row
        qv, wv = ops
        kn = key_side(v, n_keys)
        sc = torch.bmm(wv.unsqueeze(1), torch.matmul(qv, kn.transpose(1, 2)).clamp_min(0)).squeeze(1)
        kept, rank = needles_kept(logits, sc, cols, topk)
        kept, rank = kept.reshape(rows, ndep, nmar), rank.reshape(rows, ndep, nmar).double()
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=q.device)
        per_cell = torch.stack([ok.sum(0).double(), (kept & ok).sum(0).double(),
                                torch.where(ok, rank, nan).nanmedian(0).values,
                                torch.where(ok, nd["margin"].double(), nan).nanmean(0),
                                torch.where(ok, norm_ratio.double(), nan).nanmean(0)], -1).tolist()
        for di, depth in enumerate(cfg.needle_depths):
            for mi, margin in enumerate(cfg.needle_margins):
                cnt, kc, rmed, mreal, nrat = per_cell[di][mi]
                res["needles"].append({
                    **base, "variant": n, "kind": v.kind, "depth": depth, "margin": margin,
                    "column": nd["cols"][di], "tried": rows, "n": int(cnt), "kept": int(kc),
                    "rank_median": rmed, "margin_realized": mreal, "norm_ratio": nrat})


def _one_draw(cfg: StudyConfig, dist: Distribution, seed: int, device: str, res: dict | None = None,
              mark: dict | None = None) -> tuple[dict, dict]:
    """Every context of one (distribution, seed) -> (rows, needles, inputs; merge counts).
    `res`/`mark`: append there, and record after each whole context how much is kept (what a
    Ctrl-C keeps)."""
    p = preset(cfg.model)
    contexts = sorted(set(int(c) for c in cfg.context_tokens))
    jmax = max(c // p.compress_ratio for c in contexts)
    names = ordered(cfg.variants)
    res = {"rows": [], "needles": [], "inputs": []} if res is None else res
    merges = {n: {"into": VARIANTS[n].merge_into, "values": 0, "differ": 0}
              for n in names if VARIANTS[n].merge_into}
    with torch.no_grad():
        d = draw(dist, seed, entries=jmax, rows=cfg.rows, heads=cfg.heads or p.index_heads, model=cfg.model,
                 value_dim=cfg.value_dim, device=device)
        res["inputs"].append({"distribution": dist.name, "seed": seed, **input_stats(d.k, d.queries(jmax)),
                              "outlier_channels": d.outlier_idx, "sink_channels": d.sink_idx})
        kside, same_k = key_sides(names, d.k), {}
        nans = {id(t): torch.isnan(t).any(1) for t in kside.values()}
        kside.update({n + "/nan": nans[id(kside[n])] for n in names})
        for n in names:
            v = VARIANTS[n]
            if v.merge_into:
                a, b = kside[n], kside[v.merge_into]
                same_k[n] = torch.equal(a, b)
                merges[n]["values"] += a.numel()
                merges[n]["differ"] += int((a != b).sum())
        for tokens in contexts:
            _study_context(cfg, d, names, kside, same_k, tokens, res, merges)
            if mark is not None:
                mark.update({k: len(res[k]) for k in mark})          # a whole context: kept on Ctrl-C
    return res, merges


def _worker_init() -> None:
    torch.set_num_threads(1)


def _add_merges(total: dict, merges: dict) -> None:
    for n, m in merges.items():
        t = total.setdefault(n, {"into": m["into"], "values": 0, "differ": 0})
        t["values"] += m["values"]
        t["differ"] += m["differ"]


def run_study(cfg: StudyConfig, *, device: str = "cpu", progress=None, jobs: int = 1) -> dict:
    """-> {"rows": per (distribution, seed, context, variant), "needles": per (..., depth,
    margin), "inputs": per (distribution, seed) statistics, "merges": variants whose
    operands were compared with another's}. `jobs` > 1 (CPU only) spreads the (distribution,
    seed) draws over that many single-threaded worker processes; the result is assembled in
    the same order. `progress()` is called once per finished draw. Ctrl-C or SIGTERM stops
    it: what finished is kept (in one process, every whole context; with workers, every whole
    draw) and "interrupted" says so."""
    tasks = [(dist, seed) for dist in cfg.distributions for seed in cfg.seed_list]
    units = len(tasks) * len(set(int(c) for c in cfg.context_tokens))
    res = {"rows": [], "needles": [], "inputs": [], "merges": {}}
    try:
        if jobs > 1 and device == "cpu" and len(tasks) > 1:
            _run_workers(cfg, tasks, device, progress, jobs, res)
        else:
            mark = {k: 0 for k in ("rows", "needles", "inputs")}
            try:
                for dist, seed in tasks:
                    _, merges = _one_draw(cfg, dist, seed, device, res, mark)
                    _add_merges(res["merges"], merges)
                    if progress:
                        progress()
            except KeyboardInterrupt:
                for k, n in mark.items():
                    del res[k][n:]
                raise
    except KeyboardInterrupt:
        done = len({(r["distribution"], r["seed"], r["context_tokens"]) for r in res["rows"]})
        res["interrupted"] = {"signal": stopped_by(), "cases_done": done,
                              "cancelled": [f"{units - done} of {units} (distribution, seed, context)"]}
    return res


def _run_workers(cfg, tasks, device, progress, jobs, res) -> None:
    """The draws in worker processes, assembled in task order; on Ctrl-C the draws that
    finished are kept (in order, up to the first that did not) and the rest cancelled."""
    ex, futures = None, []
    try:
        ex = ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=get_context("spawn"), initializer=_worker_init)
        futures = [ex.submit(_one_draw, cfg, dist, seed, device) for dist, seed in tasks]
        for _ in as_completed(futures):
            if progress:
                progress()
    except KeyboardInterrupt:
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
            for proc in list((getattr(ex, "_processes", None) or {}).values()):     # a draw may take minutes
                proc.terminate()
        for f in futures:
            if not (f.done() and not f.cancelled() and f.exception() is None):
                break
            part, merges = f.result()
            for k in ("rows", "needles", "inputs"):
                res[k] += part[k]
            _add_merges(res["merges"], merges)
        raise
    ex.shutdown()
    for f in futures:
        part, merges = f.result()
        for k in ("rows", "needles", "inputs"):
            res[k] += part[k]
        _add_merges(res["merges"], merges)


# --- configuration ------------------------------------------------------------------------


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
    if q.shape[-1] != k.shape[-1]:
        raise StudyConfigError(f"{path}: queries have {q.shape[-1]} dims, keys {k.shape[-1]}")
    j = k.shape[0]
    topk = min(p.topk, max(1, j // 4))   # short captures: keep a quarter so loss shows
    gen = torch.Generator().manual_seed(cfg.seed)
    values = torch.randn(j, cfg.value_dim, generator=gen).to(torch.bfloat16).float()
    q, k, w, values = (t.to(device) for t in (q, k, w, values))
    sc = head_scores(q, k)
    wf = fold_weights(w, ws)
    exact = torch.bmm(wf.unsqueeze(1), sc.clamp_min(0)).squeeze(1)
    ref = ExactTopK(exact, topk)
    valid = torch.ones_like(exact, dtype=torch.bool)
    att = SparseAttention(sc, values, ref.idx, p.softmax_scale)
    seen = torch.full((q.shape[0],), j)
    base = {"distribution": f"dump:{Path(path).name}", "seed": cfg.seed, "context_tokens": j * s["compress_ratio"],
            "entries": j, "topk": topk, "chance": topk / j, "selection": True,
            "queries": "captured" if qop is not None else "generated (no Q op in the dump)"}
    rows = []
    for n in ordered(cfg.variants):
        v = VARIANTS[n]
        cell, _, _ = _score_variant(v, q, w, ws, key_side(v, k), ref, att, topk, valid)
        extra = _exact_extra(att, ref.idx, seen, topk) if v.kind == "exact" else {}
        rows.append({**base, "variant": n, "kind": v.kind, **cell, **extra})
    stats = {"distribution": base["distribution"], "seed": cfg.seed, **input_stats(k, q)}
    return {"rows": rows, "needles": [], "inputs": [stats], "merges": {}}
