"""`mxval study`: the metrics mean what they say, and the known effects show."""
import dataclasses

import pytest
import torch

from harness import study
from helpers import sample_path

QUICK = dict(heads=8, rows=4, needle_trials=4, context_tokens=[8192], needle_depths=[0.0, 0.5, 1.0])


def _cfg(dist, variants, **kw):
    return study.StudyConfig(distributions=[dist], variants=variants, **{**QUICK, **kw})


def _by(result, variant, key="recall_mean"):
    return [r[key] for r in result["rows"] if r["variant"] == variant]


def test_exact_against_exact_is_perfect():
    res = study.run_study(_cfg(study.Distribution(), ["exact"]))
    for key in ("recall_mean", "jaccard_mean", "mass_recall_mean", "recall_min"):
        assert _by(res, "exact", key) == [1.0]
    assert _by(res, "exact", "kth_rank_mean") == [1024.0]


def test_row_metrics_have_teeth():
    g = torch.Generator().manual_seed(1)
    # distinct, well-spaced scores: no key is within the tie tolerance of another
    exact = torch.stack([torch.randperm(4000, generator=g) for _ in range(3)]).double()
    # a variant that keeps the exact top-k but for its 100 best keys
    worse = exact.clone()
    best = exact.topk(100, dim=1).indices
    worse.scatter_(1, best, -1e9)
    m = study.row_metrics(exact, worse, 1024)
    assert torch.allclose(m["recall"], torch.full((3,), 924 / 1024, dtype=torch.float64))
    assert (m["mass_recall"] < 1).all() and (m["jaccard"] < 1).all()
    assert (m["kth_rank"] < 1024).all()      # the exact k-th moved up: 100 better keys are gone
    # rows no longer than k keep everything
    short = study.row_metrics(exact[:, :1000], worse[:, :1000], 1024)
    assert (short["recall"] == 1).all()


def test_outliers_cost_recall_and_hadamard_buys_it_back():
    dist = study.Distribution(name="outliers", outlier_channels=2, outlier_scale=64.0)
    res = study.run_study(_cfg(dist, ["exact", "mxfp4", "mxfp4+H", "mxfp4+H-q-only"]))
    plain, rotated, one_sided = (_by(res, v)[0] for v in ("mxfp4", "mxfp4+H", "mxfp4+H-q-only"))
    assert plain < 0.99
    assert rotated > plain
    assert one_sided < plain      # the known bug wrecks retrieval


def test_overwhelming_needles_are_always_found_by_the_exact_indexer():
    res = study.run_study(_cfg(study.Distribution(), ["exact"], needle_strength=1.0,
                               context_tokens=[8192, 16384]))
    kept = [n["kept_frac"] for n in res["needles"]]
    assert kept and all(k == 1.0 for k in kept)


def test_needle_probe_has_teeth():
    base = torch.zeros(1, 5000, dtype=torch.float64)
    base[0, :2000] = 10.0                 # 2000 keys beat a needle scoring 1.0
    assert not study.needle_kept(base, torch.tensor([1.0], dtype=torch.float64), 4000, 1024)[0]
    assert study.needle_kept(base, torch.tensor([11.0], dtype=torch.float64), 4000, 1024)[0]


def test_same_seed_same_results_other_seed_other_inputs():
    cfg = _cfg(study.Distribution(name="t", tails="student-t"), ["exact", "mxfp4"])
    assert study.run_study(cfg) == study.run_study(cfg)
    other = study.run_study(dataclasses.replace(cfg, seed=5))
    assert other["rows"] != study.run_study(cfg)["rows"]


def test_config_errors_are_one_line(tmp_path):
    bad = tmp_path / "s.toml"
    bad.write_text("[study.x]\ndistributions = ['nope']\n")
    with pytest.raises(ValueError, match="unknown distribution"):
        study.load_config("x", bad)
    with pytest.raises(ValueError, match="no study named"):
        study.load_config("missing", bad)
    bad.write_text("[study.x\n")
    with pytest.raises(ValueError, match="cannot read"):
        study.load_config("x", bad)


def test_quick_study_writes_every_format(tmp_path):
    cfg = study.load_config("quick")
    res = study.run_study(cfg)
    paths = study.render(res, tmp_path, title="t", meta={"machine": "test"})
    for name in ("study.json", "study.md", "study.html", "study.csv"):
        assert (tmp_path / name).stat().st_size > 100
    assert "data:image/png;base64," in (tmp_path / "study.html").read_text()
    assert "| mxfp4 |" in (tmp_path / "study.md").read_text()


@pytest.mark.parametrize("margin, kept", [(0.05, 1.0), (-0.05, 0.0)])
def test_needle_margin_places_needles_around_the_kth_score(margin, kept):
    res = study.run_study(_cfg(study.Distribution(), ["exact"], needle_margin=margin,
                               context_tokens=[16384]))
    assert {n["kept_frac"] for n in res["needles"]} == {kept}


def test_study_of_a_captured_dump():
    cfg = study.load_config("quick")
    res = study.study_dump(str(sample_path("k_natural")), cfg)
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["exact"]["recall_mean"] == 1.0 and rows["exact"]["entries"] == 98
    assert rows["mxfp4+H-q-only"]["recall_mean"] < rows["mxfp4"]["recall_mean"] < 1.0
    assert rows["mxfp4"]["queries"].startswith("generated")
