"""`mxval study`: the metrics mean what they say, the distributions what their names say, and
the report says what the numbers say."""
import dataclasses
import math
import re

import pytest
import torch
from helpers import sample_path

from harness.commands import study

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
    from harness.commands.study_metrics import SparseAttention
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
    from harness.commands.study_inputs import channel_ratio
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
    real = getattr(study, "draw", None)
    monkeypatch.setattr(study, "draw", lambda *a, **kw: calls.append(kw["entries"]) or real(*a, **kw),
                        raising=False)
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
    from harness.commands.study_variants import VARIANTS, key_side
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
    chance = 1024 / 4096
    assert f"chance level, the recall of a random top-1024, is **{chance:.3f}**" in md[bugs:]
    assert abs(_mean(_by(res, "mxfp4+H-q-only")) - chance) < 0.1      # a negative control, not a cost
    assert study.VARIANTS["mxfp4+H-q-only"].kind == "bug"


def test_tables_are_per_distribution_with_intervals(tmp_path):
    assert getattr(study.load_config("default"), "seeds", 1) >= 5
    dists = [study.Distribution(), study.Distribution(name="outliers-64x", outlier_channels=2, outlier_scale=64.0)]
    res = study.run_study(_compat(dists, ["exact", "fp8-e4m3fn", "mxfp4", "mxfp4+H"]))
    md = _report(tmp_path, res, ("normal", "outliers-64x")).split("## Every context")[0]
    for d in ("normal", "outliers-64x"):
        assert f"#### `{d}`" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| mxfp4 |")]
    assert len(rows) == 2 and all(ln.count("±") >= 2 for ln in rows)
    assert not re.search(r"(mean|median|average)[^.|]*distributions", md)   # no mean across them


def _synthetic(gap, fp8=0.97, dists=("a",), seeds=5):
    rows = []
    for d in dists:
        for s in range(seeds):
            noise = 0.002 * (s - 2)
            for v, r, e in (("exact", 1.0, 0.0), ("fp8-e4m3fn", fp8 + noise, 0.2),
                            ("mxfp4", fp8 - gap + noise, 0.4), ("mxfp4+H", fp8 - gap / 2 + noise, 0.3)):
                rows.append({"distribution": d, "seed": s, "variant": v, "kind": "cost" if v != "exact" else "exact",
                             "context_tokens": 32768, "entries": 8192, "selection": True, "chance": 0.125,
                             "recall": r, "recall_min": r, "jaccard": r, "kth_rank": 1024.0, "out_err": e,
                             "mass_kept": 1.0, "nan_keys": 0.0})
    return {"rows": rows, "needles": [], "inputs": [], "merges": {}}


def test_decision_text_follows_the_numbers():
    meta = _meta(distributions=["a"], seeds=list(range(5)))
    close = study.summary_markdown(_synthetic(gap=0.004), meta).split("### Decision")[1].split("###")[0]
    far = study.summary_markdown(_synthetic(gap=0.2), meta).split("### Decision")[1].split("###")[0]
    assert "**MXFP4 as vLLM runs it (no rotation)** is within 0.01 recall of FP8 at 32k on `a`." in close
    assert "on no distribution; more than that behind on `a`" in far
    assert "the rotation buys 0.100" in far and "the rotation buys 0.002" in close
    assert "2.0× as far" in far and "changes MXFP4's recall at 32k on `a` (+0.100" in far
    tight = study.summary_markdown(_synthetic(gap=0.2), {**meta, "tolerance": 0.5})
    assert "within 0.5 recall of FP8 at 32k on `a`" in tight


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
    assert first == study.run_study(cfg)
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
    assert study.main(["study", "--study", "quick", "--device", "cpu", "--report-dir", str(tmp_path / "r"),
                       "--readme", str(first)]) == 0
    assert study.main(["study", "--from-json", str(tmp_path / "r" / "study.json"), "--readme", str(again)]) == 0
    assert first.read_text() == again.read_text() and "### Decision" in first.read_text()
    with pytest.raises(ValueError, match="not a study.json"):
        study.main(["study", "--from-json", str(first)])
