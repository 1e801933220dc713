"""`mxval study`: the metrics mean what they say, the distributions what their names say, and
the report says what the numbers say."""
import dataclasses
import json
import math
import re

import pytest
import torch
from helpers import sample_path

from harness import study
from harness.study import core as study_core

QUICK = dict(heads=8, rows=4, seeds=2, context_tokens=[8192], needle_depths=[0.5], needle_margins=[0.05])


def _cfg(dist, variants, **kw):
    return study.StudyConfig(distributions=[dist], variants=variants, **{**QUICK, **kw})


def _compat(dists, variants, context_tokens=(8192,), seeds=2):
    """A small study configured through the fields every version of StudyConfig has."""
    cfg = study.StudyConfig(distributions=list(dists), variants=variants, context_tokens=list(context_tokens),
                            rows=2, heads=8, needle_depths=[0.5])
    cfg.seeds = seeds
    return cfg


def _report(tmp_path, res, dists=("normal",)) -> str:
    study.render(res, tmp_path, title="t", meta=_meta(distributions=list(dists)))
    return (tmp_path / "study.md").read_text()


def _by(result, variant, key="recall"):
    return [r[key] for r in result["rows"] if r["variant"] == variant and r.get("selection", True)]


def _mean(xs):
    return sum(xs) / len(xs)


def _kurtosis(x):
    x = x.double().flatten()
    x = x - x.mean()
    return float((x ** 4).mean() / (x ** 2).mean() ** 2)


def _inputs(dist, entries=2048, seed=0, rows=2, heads=8):
    return study.make_inputs(dist, entries=entries, rows=rows, heads=heads, head_dim=128, rope_dim=64, seed=seed)


def _meta(**kw):
    return {"machine": "test", "topk": 1024, "rows": 4, "heads": 8, "seeds": [0, 1], "compress_ratio": 4,
            "distributions": ["normal"], "tolerance": 0.01, **kw}


# --- metrics ------------------------------------------------------------------------------


def test_exact_against_exact_is_perfect():
    res = study.run_study(_cfg(study.Distribution(), ["exact"]))
    for key in ("recall", "jaccard", "recall_min"):
        assert _by(res, "exact", key) == [1.0, 1.0]
    assert _by(res, "exact", "out_err") == [0.0, 0.0]
    assert _by(res, "exact", "kth_rank") == [1024.0, 1024.0]


def test_row_metrics_have_teeth():
    g = torch.Generator().manual_seed(1)
    # distinct, well-spaced scores: no key is within the tie tolerance of another
    exact = torch.stack([torch.randperm(4000, generator=g) for _ in range(3)]).double()
    worse = exact.clone()
    best = exact.topk(100, dim=1).indices
    worse.scatter_(1, best, -1e9)          # keeps the exact top-k but for its 100 best keys
    m = study.row_metrics(exact, worse, 1024)
    assert torch.allclose(m["recall"], torch.full((3,), 924 / 1024, dtype=torch.float64))
    assert (m["jaccard"] < 1).all() and (m["kth_rank"] < 1024).all()
    nan = exact.clone()
    nan[:, :50] = float("nan")             # NaN scores take slots, as torch.topk sorts them
    assert (study.row_metrics(exact, nan, 1024)["recall"] < 1).all()
    short = study.row_metrics(exact[:, :1000], worse[:, :1000], 1024)
    assert (short["recall"] == 1).all()


def test_attention_error_is_at_the_model_scale_and_has_teeth():
    from harness.study.metrics import SparseAttention
    d = 128
    scores = torch.tensor([[[4.0, 2.0, 0.0, -2.0]]]) * math.sqrt(d)     # q.k; D**-0.5 brings them to 4, 2, 0, -2
    values = torch.eye(4)
    att = SparseAttention(scores, values, torch.tensor([[0, 1]]), d ** -0.5)
    p = torch.softmax(torch.tensor([4.0, 2.0]), 0)
    assert torch.allclose(att.o_exact[0, 0, :2], p, atol=1e-6)          # softmax at D**-0.5, not T = 1
    assert float(att.cost(torch.tensor([[1, 0]]))["out_err"][0]) == 0.0  # the same set
    swapped = att.cost(torch.tensor([[0, 2]]))
    q = torch.softmax(torch.tensor([4.0, 0.0]), 0)
    want = torch.tensor([p[0] - q[0], p[1], -q[1], 0.0]).norm() / p.norm()
    assert float(swapped["out_err"][0]) == pytest.approx(float(want), rel=1e-5)
    assert float(swapped["mass_kept"][0]) < 1


def test_downstream_error_orders_the_variants():
    variants = ["exact", "fp8-e4m3fn", "mxfp4", "mxfp4+H-q-only"]
    res = study.run_study(_compat([study.Distribution()], variants, seeds=1))
    assert all("out_err" in r for r in res["rows"])      # the attention output, not only the proxy
    err = {v: _by(res, v, "out_err")[0] for v in variants}
    assert err["exact"] == 0 < err["fp8-e4m3fn"] < err["mxfp4"] < err["mxfp4+H-q-only"]


# --- distributions mean what their names say ----------------------------------------------


def test_heavy_tails_survive_the_norm():
    k = _inputs(study.Distribution(name="t", tails="student-t", tail_df=3))["k"]
    normal = _inputs(study.Distribution())["k"]
    assert _kurtosis(normal) < 3.3
    assert _kurtosis(k) > 6          # a per-row chi-square divisor leaves ~3.0 after the RMS norm


def test_head_weights_are_a_signed_projection():
    inp = _inputs(study.Distribution(), rows=64, heads=64)
    w = inp["w"]
    assert (w < 0).float().mean() > 0.3 and (w > 0).float().mean() > 0.3
    assert 0.7 < float(w.std()) < 1.3
    assert inp["weights_scale"] == pytest.approx(128 ** -0.5 * 64 ** -0.5)   # H**-0.5 in the scale
    old = _inputs(study.Distribution(head_weights="abs"), rows=64, heads=64)["w"]
    assert (old >= 0).all()


def test_outliers_shared_by_q_and_k_is_a_named_option():
    assert "outliers_on" in {f.name for f in dataclasses.fields(study.Distribution)}
    from harness.study.inputs import channel_ratio
    k_only = _inputs(study.Distribution(outlier_channels=2, outlier_scale=64.0))
    shared = _inputs(study.Distribution(outlier_channels=2, outlier_scale=64.0, outliers_on="qk"))
    assert channel_ratio(k_only["k"]) > 10 and channel_ratio(shared["k"]) > 10
    assert channel_ratio(k_only["q"]) < 3 < 10 < channel_ratio(shared["q"])
    with pytest.raises(ValueError, match="outliers_on"):
        study.Distribution(outliers_on="v")


def test_nested_contexts_share_their_prefix_and_the_seed_fixes_the_channels():
    dist = study.Distribution(outlier_channels=2, outlier_scale=64.0, correlation=0.5)
    short, long = _inputs(dist, entries=1024, seed=3), _inputs(dist, entries=3000, seed=3)
    assert torch.equal(short["k"], long["k"][:1024])
    assert short["draw"].outlier_idx == long["draw"].outlier_idx
    assert torch.equal(short["w"], long["w"])


def test_the_study_draws_once_per_distribution_and_seed(monkeypatch):
    calls = []
    real = study_core.draw
    monkeypatch.setattr(study_core, "draw", lambda *a, **kw: calls.append(kw["entries"]) or real(*a, **kw))
    res = study.run_study(_compat([study.Distribution()], ["exact"], context_tokens=[8192, 16384], seeds=2))
    assert calls == [4096, 4096]                 # the longest context; the shorter is its prefix
    assert len(res["inputs"]) == 2


def test_drift_sinks_depends_on_position():
    cfg = study.load_config("default")
    dist = next((d for d in cfg.distributions if d.name == "drift-sinks"), None)
    assert dist is not None and dist.sinks and dist.drift
    inp = _inputs(dist, entries=32768, rows=4, heads=64)
    k = inp["k"][:, :64]                         # NoPE dims: RoPE does not move them
    early, late = k[4:2048].mean(0), k[-2048:].mean(0)
    assert float(torch.cosine_similarity(early, late, dim=0)) < 0.5       # the keys drift
    logits = study.indexer_logits(inp["q"], inp["k"], inp["w"] * inp["weights_scale"])
    top = logits.topk(1024, dim=1).indices
    for r in range(top.shape[0]):                # the sinks are in every row's exact top-k
        assert set(range(dist.sinks)) <= set(top[r].tolist())
    recent = (top >= 32768 - 8192).float().mean()
    assert recent > 0.4                          # the query favours recent entries (a quarter of them)


# --- variants and the report ---------------------------------------------------------------


def test_outliers_cost_recall_and_hadamard_buys_it_back():
    dist = study.Distribution(name="outliers", outlier_channels=4, outlier_scale=8.0, outliers_on="qk")
    res = study.run_study(_cfg(dist, ["exact", "mxfp4", "mxfp4+H"], context_tokens=[32768], rows=4, seeds=2))
    plain, rotated = _mean(_by(res, "mxfp4")), _mean(_by(res, "mxfp4+H"))
    assert plain < 0.92
    assert rotated > plain + 0.04


def test_fnuz_rows_are_merged_with_the_reason(tmp_path):
    res = study.run_study(_compat([study.Distribution()], ["exact", "fp8-e4m3fn", "fp8-e4m3fnuz"], seeds=1))
    md = _report(tmp_path, res)
    assert "| fp8-e4m3fnuz |" not in md
    assert "| fp8-e4m3fn = fp8-e4m3fnuz |" in md
    assert re.search(r"`fp8-e4m3fnuz` is merged into `fp8-e4m3fn`: 0 of [\d,]+ dequantized", md)
    assert res["merges"]["fp8-e4m3fnuz"]["differ"] == 0 and res["merges"]["fp8-e4m3fnuz"]["values"] > 0


def test_cross_flavour_fp8_read_is_a_bug_variant():
    assert {"fp8-fn-read-fnuz", "fp8-fnuz-read-fn"} <= set(study.VARIANTS)
    from harness.study.variants import VARIANTS, key_side
    fn_fnuz, fnuz_fn, fp8 = (VARIANTS[n] for n in ("fp8-fn-read-fnuz", "fp8-fnuz-read-fn", "fp8-e4m3fn"))
    assert fn_fnuz.kind == fnuz_fn.kind == "bug"
    k = torch.randn(4, 128).to(torch.bfloat16).float()
    k[0, 5] = -1e-30                             # rounds to e4m3fn's -0 (0x80)
    assert torch.isnan(key_side(fn_fnuz, k)[0]).any() and not torch.isnan(key_side(fn_fnuz, k)[1:]).any()
    assert torch.equal(key_side(fn_fnuz, k)[1:], key_side(fp8, k)[1:] / 2)
    assert torch.equal(key_side(fnuz_fn, k), key_side(fp8, k) * 2)


def test_known_bugs_are_apart_and_labelled_with_chance(tmp_path):
    res = study.run_study(_compat([study.Distribution()], ["exact", "fp8-e4m3fn", "mxfp4", "mxfp4+H-q-only"],
                                  context_tokens=[16384]))
    md = _report(tmp_path, res)
    assert "### Known bugs" in md
    bugs = md.index("### Known bugs")
    assert md.index("mxfp4+H-q-only") > bugs and "| mxfp4 |" in md[:bugs]
    seen = study.row_entries(4096, 2, study.StudyConfig().query_spread, 1024)
    chance = float((1024 / seen.double()).mean())                   # each query row sees its own entries
    assert f"chance level, the recall of a random top-1024 (the mean over query rows of top-k / the entries the " \
        f"row sees), is **{chance:.3f}**" in md[bugs:]
    assert abs(_mean(_by(res, "mxfp4+H-q-only")) - chance) < 0.1      # a negative control, not a cost
    assert study.VARIANTS["mxfp4+H-q-only"].kind == "bug"


def test_tables_are_per_distribution_with_intervals(tmp_path):
    assert study.load_config("default").seeds >= 20
    dists = [study.Distribution(), study.Distribution(name="outliers-64x", outlier_channels=2, outlier_scale=64.0)]
    res = study.run_study(_compat(dists, ["exact", "fp8-e4m3fn", "mxfp4", "mxfp4+H"]))
    md = _report(tmp_path, res, ("normal", "outliers-64x")).split("## Every variant and context")[0]
    for d in ("normal", "outliers-64x"):
        assert f"#### `{d}`" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| mxfp4 |")]
    assert len(rows) == 2 and all(ln.count("±") >= 2 for ln in rows)
    assert not re.search(r"(mean|median|average)[^.|]*distributions", md)   # no mean across them


def _synthetic(gap, fp8=0.97, dists=("a",), seeds=5, mass=0.998, top64=1.0):
    rows = []
    for d in dists:
        for s in range(seeds):
            noise = 0.002 * (s - 2)
            for v, r, e, mk, t64 in (("exact", 1.0, 0.0, 1.0, 1.0), ("fp8-e4m3fn", fp8 + noise, 0.2, 0.9999, 1.0),
                                     ("mxfp4", fp8 - gap + noise, 0.4, mass, top64),
                                     ("mxfp4+H", fp8 - gap / 2 + noise, 0.3, mass, top64)):
                cover = {f"cover{k}": min(1.0, r + (k - 1024) / 2048) for k in (1024, 1280, 1536, 2048)}
                rows.append({"distribution": d, "seed": s, "variant": v, "kind": "cost" if v != "exact" else "exact",
                             "context_tokens": 32768, "entries": 8192, "selection": True, "chance": 0.125,
                             "recall": r, "recall_min": r, "jaccard": r, "kth_rank": 1024.0, "out_err": e,
                             "mass_kept": mk + noise / 10, "top64": t64, "top256": t64, "miss_n": 1024 * (1 - r),
                             "miss_rank_median": 900.0, "miss_q4": 1024 * (1 - r), "noise_rel": 0.2,
                             "near_kth": 900.0, "noise_gap": 0.15, "topk_mass": 0.2, "chance_mass": 0.125,
                             "mass_kept_chance": 0.6, "nan_keys": 0.0, **cover})
    return {"rows": rows, "needles": [], "inputs": [], "merges": {}}


def test_decision_text_follows_the_numbers():
    meta = _meta(distributions=["a"], seeds=list(range(5)))
    close = study.summary_markdown(_synthetic(gap=0.004), meta).split("### Decision")[1].split("###")[0]
    far = study.summary_markdown(_synthetic(gap=0.2), meta).split("### Decision")[1].split("###")[0]
    assert "MXFP4 scores 0.966 at 32k against FP8's 0.970: within 0.01 of FP8 on `a`." in close
    assert "within 0.01 of FP8 on no distribution; more than 0.01 behind on `a`" in far
    assert "changes MXFP4's recall at 32k on `a` (+0.100" in far and "(+0.002" in close
    assert "as far" not in far and "Downstream" not in far     # the output error follows from recall
    tight = study.summary_markdown(_synthetic(gap=0.2), {**meta, "tolerance": 0.5})
    assert "within 0.5 of FP8 on `a`" in tight


# --- needles ------------------------------------------------------------------------------


def test_needles_only_where_selection_happens():
    res = study.run_study(study.StudyConfig(distributions=[study.Distribution()], variants=["exact"],
                                            context_tokens=[4096, 8192], rows=2, heads=8))
    assert {n["context_tokens"] for n in res["needles"]} == {8192}
    assert all(r["selection"] == (r["context_tokens"] > 4096) for r in res["rows"])


def test_needles_sweep_margins_state_n_and_come_from_the_key_distribution():
    assert getattr(study.load_config("default"), "needle_margins", None) == [0.01, 0.02, 0.05, 0.1]
    res = study.run_study(_cfg(study.Distribution(), ["exact", "mxfp4"], needle_margins=[0.01, 0.1],
                               needle_depths=[0.0, 1.0]))
    nd = res["needles"]
    assert {n["margin"] for n in nd} == {0.01, 0.1}
    assert all(n["n"] == 4 for n in nd)                    # rows per seed, per (depth, margin, seed)
    ex = [n for n in nd if n["variant"] == "exact"]
    assert all(n["kept"] == n["n"] for n in ex)            # the exact indexer keeps every needle
    assert all(abs(n["norm_ratio"] - 1) < 0.05 for n in ex)   # a key's norm, not rescaled out of it
    assert all(abs(n["margin_realized"] - n["margin"]) < 5e-3 for n in ex)
    lo = [n["kept"] for n in nd if n["variant"] == "mxfp4" and n["margin"] == 0.01]
    hi = [n["kept"] for n in nd if n["variant"] == "mxfp4" and n["margin"] == 0.1]
    assert sum(lo) <= sum(hi)


def test_needles_at_each_depth_are_distinct_draws():
    inp = _inputs(study.Distribution(), entries=4096, rows=2, heads=64)
    d, q = inp["draw"], inp["q"]
    wf = inp["w"] * inp["weights_scale"]
    kth = study.indexer_logits(q, d.k, wf).topk(1024, dim=1).values[:, -1]
    nd = study.make_needles(d, 4096, q, wf, kth, [0.0, 0.5, 1.0], [0.05, -0.05])
    keys = nd["keys"]
    assert not torch.equal(keys[:, 0], keys[:, 1]) and not torch.equal(keys[:, 1], keys[:, 2])
    assert nd["valid"].all()
    exact = study.indexer_logits(q, d.k, wf)
    cols = torch.tensor(nd["cols"]).repeat_interleave(2).expand(2, -1)
    kept, _ = study.needles_kept(exact, nd["score"].reshape(2, -1), cols, 1024)
    kept = kept.reshape(2, 3, 2)
    assert kept[..., 0].all() and not kept[..., 1].any()   # 5 % above the k-th kept, 5 % below not


def test_needle_probe_has_teeth():
    base = torch.zeros(1, 5000)
    base[0, :2000] = 10.0                 # 2000 keys beat a needle scoring 1.0
    cols = torch.tensor([[4000, 4000]])
    kept, rank = study.needles_kept(base, torch.tensor([[1.0, 11.0]]), cols, 1024)
    assert kept.tolist() == [[False, True]] and rank.tolist() == [[2001, 1]]
    base[0, 4000] = 50.0                  # the entry the needle replaces does not compete
    assert study.needles_kept(base, torch.tensor([[11.0]]), cols[:, :1], 1024)[0].all()


# --- determinism, configuration, files -------------------------------------------------------


def test_same_seed_same_results_other_seed_other_inputs():
    cfg = _cfg(study.Distribution(name="t", tails="student-t"), ["exact", "mxfp4"], seeds=1, rows=2)
    first = study.run_study(cfg)
    assert json.dumps(first, sort_keys=True) == json.dumps(study.run_study(cfg), sort_keys=True)   # NaN != NaN
    assert study.run_study(dataclasses.replace(cfg, seed=5))["rows"] != first["rows"]


def test_config_errors_are_one_line(tmp_path):
    bad = tmp_path / "s.toml"
    for text, needle in [("[study.x]\ndistributions = ['nope']\n", "unknown distribution"),
                         ("[distribution.a]\ntails = 'cauchy'\n[study.x]\ndistributions = ['a']\n", "tails"),
                         ("[distribution.a]\nheavy = 1\n[study.x]\ndistributions = ['a']\n", "heavy"),
                         ("[distribution.normal]\n[study.x]\nneedle_margins = [0]\n", "needle_margins"),
                         ("[distribution.normal]\n[study.x]\nvariants = ['mxfp5']\n", "unknown variant")]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle) as e:
            study.load_config("x", bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no study named"):
        study.load_config("missing", bad)
    bad.write_text("[study.x\n")
    with pytest.raises(ValueError, match="cannot read"):
        study.load_config("x", bad)


def test_quick_study_writes_every_format(tmp_path):
    cfg = study.load_config("quick")
    res = study.run_study(cfg)
    study.render(res, tmp_path, title="t", meta=_meta(distributions=[d.name for d in cfg.distributions]))
    for name in ("study.json", "study.md", "study.html", "study.csv", "study-needles.csv"):
        assert (tmp_path / name).stat().st_size > 100
    assert "data:image/png;base64," in (tmp_path / "study.html").read_text()
    assert "| mxfp4 |" in (tmp_path / "study.md").read_text()


def test_study_of_a_captured_dump():
    cfg = study.load_config("quick")
    res = study.study_dump(str(sample_path("k_natural")), cfg)
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["exact"]["recall"] == 1.0 and rows["exact"]["entries"] == 98
    assert rows["mxfp4+H-q-only"]["recall"] < rows["mxfp4"]["recall"] < 1.0
    assert rows["mxfp4"]["queries"].startswith("generated")
    assert res["inputs"][0]["k_block_crest"] > 1
    md = study.summary_markdown(res, _meta(dump=True, distributions=["k_natural.safetensors"]))
    assert "| mxfp4 | cost |" in md and "crest" in md


def test_reports_re_render_from_a_saved_run(tmp_path, capsys):
    first, again = tmp_path / "a.md", tmp_path / "b.md"
    from harness.commands import cli
    assert cli.main(["study", "--study", "quick", "--device", "cpu", "--report-dir", str(tmp_path / "r"),
                     "--readme", str(first), "--jobs", "1"]) == 0
    assert cli.main(["study", "--from-json", str(tmp_path / "r" / "study.json"), "--readme", str(again)]) == 0
    assert first.read_text() == again.read_text() and "### Decision" in first.read_text()
    capsys.readouterr()
    assert cli.main(["study", "--from-json", str(first)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mxval: ") and "not a study.json" in err[0], err


# --- what the selection keeps, over-selection, noise, intervals, realism -------------------


def test_selection_metrics_have_teeth():
    g = torch.Generator().manual_seed(2)
    exact = torch.stack([torch.randperm(4000, generator=g) for _ in range(2)]).float()
    order = exact.topk(1024, dim=1).indices                     # exact rank i+1 at column order[:, i]
    best = exact.clone()
    best.scatter_(1, order[:, :10], -1e9)                       # loses the 10 best keys outright
    m = study.row_metrics(exact, best, 1024)
    assert torch.allclose(m["top64"], torch.full((2,), 54 / 64, dtype=torch.float64))
    assert (m["miss_rank_best"] == 1).all() and (m["miss_n"] == 10).all() and (m["miss_q1"] == 10).all()
    assert torch.allclose(m["cover2048"], torch.full((2,), 1014 / 1024, dtype=torch.float64))
    near = exact.clone()
    near.scatter_(1, order[:, 1014:], exact.gather(1, order[:, 1014:]) - 20)   # the last 10 fall just below the cut
    m = study.row_metrics(exact, near, 1024)
    assert (m["top64"] == 1).all() and (m["top256"] == 1).all()
    assert (m["miss_rank_best"] >= 1015).all() and (m["miss_q4"] == m["miss_n"]).all() and (m["miss_n"] > 0).all()
    assert (m["cover1280"] == 1).all() and (m["cover1024"] < 1).all()


def test_rows_past_their_end_are_never_selected():
    exact = torch.arange(3000, dtype=torch.float32).expand(2, -1).clone()
    exact[1, 2000:] = float("-inf")                              # row 1 sees 2000 entries
    ref = study.ExactTopK(exact, 1024)
    assert int(ref.idx[1].max()) < 2000 and ref.acceptable[1, 2000:].sum() == 0
    approx = exact + torch.randn(2, 3000, generator=torch.Generator().manual_seed(0))
    m = study.row_metrics(exact, approx, 1024, ref=ref)
    assert (m["recall"] > 0.9).all()
    assert study.row_entries(8192, 4, 0.5, 1024).tolist() == [8192, 6827, 5461, 4096]
    assert study.row_entries(2048, 3, 0.9, 1024).tolist() == [2048, 1536, 1025]   # never top-k or fewer


def test_noise_metrics_measure_the_noise():
    g = torch.Generator().manual_seed(3)
    exact = torch.randn(4, 20000, generator=g, dtype=torch.float64).float()
    ref = study.ExactTopK(exact, 1024)
    noisy = exact + 0.1 * torch.randn(4, 20000, generator=g)
    n = study.noise_metrics(ref, noisy)
    assert torch.allclose(n["noise_rel"], torch.full((4,), 0.1, dtype=torch.float64), rtol=0.05)
    clean = study.noise_metrics(ref, exact.clone())
    assert (clean["noise_rel"] == 0).all() and (clean["near_kth"] <= 1).all()
    assert (n["near_kth"] > 50).all()          # ~ 2 * 0.1 * density at the cut


def test_bootstrap_interval():
    m, h = study.bootstrap([1.0])
    assert m == 1.0 and h != h
    x = torch.randn(20, generator=torch.Generator().manual_seed(4), dtype=torch.float64).tolist()
    m, h = study.bootstrap(x)
    assert study.bootstrap(x) == (m, h)                   # fixed resampling
    sd = float(torch.tensor(x).std())
    assert 0.6 < h / (1.96 * sd / math.sqrt(20)) < 1.3   # about the normal interval for 20 seeds
    assert study.bootstrap([2.0] * 20)[1] == 0.0


def test_locality_scores_recent_keys_up():
    base = dict(seeds=1, rows=4, context_tokens=[65536], needle_depths=[0.5], needle_margins=[0.05],
                variants=["exact"], heads=16)
    share = {}
    for name, dist in (("plain", study.Distribution()),
                       ("local", study.Distribution(name="local", locality=1.0, locality_query=1.0))):
        res = study.run_study(study.StudyConfig(distributions=[dist], **base))
        share[name] = res["rows"][0]["recent_share"]
    assert share["plain"] < 0.3 and share["local"] > 0.35


def test_weight_coupling_ties_the_weights_to_the_scores():
    coupled = _inputs(study.Distribution(weight_coupling=1.0), rows=16, heads=64)
    plain = _inputs(study.Distribution(), rows=16, heads=64)

    def corr(inp):
        return float(torch.corrcoef(torch.stack([inp["w"].flatten(), inp["q"].norm(dim=-1).flatten()]))[0, 1])
    assert corr(coupled) > 0.5 and abs(corr(plain)) < 0.2


def test_query_rows_sit_at_their_own_positions():
    d = _inputs(study.Distribution(), entries=4096, rows=3)["draw"]
    seen = torch.tensor([4096, 3000, 2048])
    q = d.queries(seen)
    for r in range(3):
        assert torch.equal(q[r], d.queries(int(seen[r]))[r])
    assert not torch.equal(q[1], d.queries(4096)[1])


def test_headline_is_mass_kept_beside_recall(tmp_path):
    res = study.run_study(_compat([study.Distribution()], ["exact", "fp8-e4m3fn", "mxfp4", "mxfp4+H"]))
    md = _report(tmp_path, res)
    head = md.split("### What the selection keeps")[1].split("###")[0]
    assert "| mass kept | top-64 kept | top-256 kept | misses: median exact rank | recall |" in head
    assert md.index("### What the selection keeps") < md.index("### Decision") < md.index("### Over-selection")
    assert "| top-1024 | top-1280 | top-1536 | top-2048 |" in md
    assert "noise SD / logit SD" in md
    e2e = md.split("### The study beside end-to-end results")[1].split("###")[0]
    for fact in ("0.9492", "0.9477", "0.7121", "124 questions right in both", "17 right only with FP8",
                 "sglang #26209", "0.980", "0.965", "ROCm/ATOM #2216", "0.9682", "0.9636",
                 "What the generated data can predict", "What it cannot predict"):
        assert fact in e2e, fact
    assert "No real activations" in md and "mxval study --dump FILE" in md


def test_decision_on_mass_follows_the_numbers():
    meta = _meta(distributions=["a"], seeds=list(range(5)))
    kept = study.summary_markdown(_synthetic(gap=0.1), meta).split("### Decision")[1].split("###")[0]
    lost = study.summary_markdown(_synthetic(gap=0.1, mass=0.9, top64=0.8), meta).split("### Decision")[1]
    lost = lost.split("###")[0]
    assert "both MXFP4 variants keep at least 0.99 of the mass and of the exact top-64" in kept
    assert "there its misses reach keys that hold mass" in lost and "at least 0.99" not in lost
    assert "keeps 0.998 of the exact top-k's attention mass" in kept
    assert "keeps 0.900 of the exact top-k's attention mass" in lost and "0.800 of the exact top-64" in lost
    assert "from k′ = 1280 on `a`" in kept        # synthetic cover: recall + (k' - 1024) / 2048


def _needle_rows(ns_by_margin, ns_by_depth=None, tried=10):
    out = []
    for v in ("exact", "mxfp4"):
        for mi, (m, n) in enumerate(ns_by_margin.items()):
            for di, dp in enumerate((0.0, 1.0)):
                cnt = n if ns_by_depth is None else ns_by_depth[dp]
                out.append({"distribution": "normal", "seed": 0, "context_tokens": 32768, "entries": 8192,
                            "variant": v, "kind": "exact" if v == "exact" else "cost", "depth": dp, "margin": m,
                            "column": 0, "tried": tried, "n": cnt, "kept": cnt, "rank_median": 900.0,
                            "margin_realized": m, "norm_ratio": 1.0})
    return out


def test_needle_and_depth_tables_give_each_cell_its_n():
    rows = _synthetic(gap=0.1, dists=("normal",))["rows"]
    needles = _needle_rows({0.01: 9, 0.02: 8, 0.05: 7, 0.1: 6})
    md = study.summary_markdown({"rows": rows, "needles": needles, "inputs": [], "merges": {}},
                                _meta(distributions=["normal"], seeds=list(range(5))))
    assert "| `normal` | n | 18 | 16 | 14 | 12 |" in md          # two depths per margin
    assert "could not be placed" in md and "`normal` at 1%: 2 of 20" in md and "at 10%: 8 of 20" in md
    needles = _needle_rows({0.01: 10, 0.05: 10, 0.1: 10}, ns_by_depth={0.0: 10, 1.0: 4})
    md = study.summary_markdown({"rows": rows, "needles": needles, "inputs": [], "merges": {}},
                                _meta(distributions=["normal"], seeds=list(range(5))))
    assert "| `normal` | 1.000 / 10 | 1.000 / 4 |" in md           # n per depth, not depth 0's
    full = _needle_rows({0.01: 10}, tried=10)
    md = study.summary_markdown({"rows": rows, "needles": full, "inputs": [], "merges": {}},
                                _meta(distributions=["normal"], seeds=list(range(5))))
    assert "Every needle was placed" in md


def test_study_of_a_dump_made_by_mxval_dump(tmp_path):
    from harness.commands import cli
    dump = tmp_path / "step.safetensors"
    assert cli.main(["dump", "--case", "smoke-rowend-k", "--backend", "reference", "-o", str(dump)]) == 0
    out = tmp_path / "r"
    assert cli.main(["study", "--dump", str(dump), "--study", "quick", "--report-dir", str(out)]) == 0
    md = (out / "study.md").read_text()
    assert "queries captured" in md and "| mxfp4 | cost |" in md
    rows = {r["variant"]: r for r in json.loads((out / "study.json").read_text())["rows"]}
    assert rows["exact"]["recall"] == 1.0 and rows["exact"]["mass_kept"] == 1.0
    assert rows["mxfp4+H-q-only"]["recall"] < 1.0


def test_workers_give_the_same_study_as_one_process():
    cfg = _cfg(study.Distribution(), ["exact", "mxfp4"], seeds=2, rows=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                  # as each worker runs: the same fp32 sums
    try:
        one = study.run_study(cfg)
    finally:
        torch.set_num_threads(threads)
    two = study.run_study(cfg, jobs=2)
    assert [r["seed"] for r in one["rows"]] == [r["seed"] for r in two["rows"]]
    assert [r["variant"] for r in one["rows"]] == [r["variant"] for r in two["rows"]]
    for key in ("recall", "mass_kept", "noise_rel"):
        assert [r[key] for r in one["rows"]] == [r[key] for r in two["rows"]], key


def test_bad_jobs_is_bad_input(capsys):
    from harness.commands import cli
    assert cli.main(["study", "--study", "quick", "--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert "--jobs" in err and err.strip().count("\n") == 0


def test_mass_kept_is_the_reports_formula_on_the_heads_attention():
    from harness.diff.scores import mass_kept
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 4, 300, generator=g) * 30
    values = torch.randn(300, 8, generator=g)
    exact = torch.topk(scores.sum(1), 64, dim=1).indices
    att = study.SparseAttention(scores, values, exact, 0.1)
    sel = torch.topk(scores.sum(1) + 20 * torch.randn(2, 300, generator=g), 64, dim=1).indices
    p = torch.softmax(scores * 0.1, -1)
    assert torch.allclose(att.cost(sel)["mass_kept"], mass_kept(p, sel, exact))
    assert (att.cost(sel)["mass_kept"] <= 1).all() and (att.cost(exact)["mass_kept"] == 1).all()


def test_study_csvs_escape_formula_cells(tmp_path):
    """A distribution named like a spreadsheet formula is written as text in both CSVs."""
    res = study.run_study(_compat([study.Distribution(name="=HYPERLINK(1)")], ["exact", "mxfp4"], seeds=1))
    study.render(res, tmp_path, title="t", meta=_meta(distributions=["=HYPERLINK(1)"]))
    for name in ("study.csv", "study-needles.csv"):
        text = (tmp_path / name).read_text()
        cells = [c for line in text.splitlines() for c in line.split(",")]
        assert "'=HYPERLINK(1)" in cells and not any(c.startswith("=") for c in cells), name
