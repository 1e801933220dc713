"""Budgets: directions, scopes, the chain's own budget, strict files, and verdicts."""
import math

import pytest

from harness.diff import ALWAYS_FAIL
from harness.diff.metrics import run_keys
from harness.run import budgets as B
from harness.run.cases import Catalog
from harness.run.runner import run_case


def write(tmp_path, text):
    p = tmp_path / "b.toml"
    p.write_text(text)
    return B.load(p)


def test_default_file_is_the_exact_contract_and_names_real_metrics():
    b = B.load()
    lim = lambda k: b.limit(k, "default", "x")  # noqa: E731
    assert lim("k_norm_rope_mxfp4_cache.page_bytes_mismatched").max == 0
    assert lim("compress_pool.pooled_max_ulp").max == 1
    assert lim("paged_mxfp4_mqa_logits.logits_diff").max == 1e-12
    assert lim("topk.topk_below_threshold").max == 0
    # the fused stage is bounded by its own key; bytes outside owned slots stay exact
    assert lim("compress_norm_rope_mxfp4_cache.page_bytes_mismatched").max == 0     # the fused stage too
    assert lim("compress_norm_rope_mxfp4_cache.pool_k_bytes_mismatched_frac").max == 1e-3
    assert lim("compress_norm_rope_fp8_cache.page_bytes_outside_owned_changed").max == 0
    # every [default] key is a metric some stage really emits (a typo would check nothing)
    metrics = {}
    for name in ("smoke-clean-logits", "smoke-cuda-path", "smoke-cuda-path-fp8"):
        metrics.update(run_case(Catalog().case(name), "reference")["metrics"])
    emitted = {k.partition(".")[2] for k in metrics} | set(metrics)
    rare = set(ALWAYS_FAIL) | {"op_unsupported"}
    assert set(b.default) - emitted - rare == set()


def test_directions_off_and_nan(tmp_path):
    b = write(tmp_path, '[default]\nlogits_diff = 1e-12\ntopk_recall_min = 0.9\n'
                        'page_dequant_max_rel_err = {max = 0.5, min = 0.1}\n[case.c]\nlogits_diff = "off"\n')
    assert b.check({"s.logits_diff": 2e-12}, "s", "x")[0]["metric"] == "s.logits_diff"
    assert b.check({"s.logits_diff": 1e-12}, "s", "x") == []
    assert b.check({"s.logits_diff": 1.0}, "s", "c") == []                  # off in case c
    assert b.check({"topk.topk_recall_min": 0.8}, "s", "x")[0]["why"] == "0.8 < 0.9"
    assert b.check({"topk.topk_recall_min": 1.0}, "s", "x") == []
    assert len(b.check({"k.page_dequant_max_rel_err": 0.05}, "s", "x")) == 1
    assert b.check({"s.logits_diff": math.nan}, "s", "x")[0]["why"] == "is NaN"


def test_scopes_and_chain_keys(tmp_path):
    b = write(tmp_path, '[default]\npage_bytes_mismatched = 0\n"chain.page_bytes_mismatched_frac" = 1e-3\n'
                        '[suite.full]\npage_bytes_mismatched = 5\n[case.c]\n"k_norm_rope_mxfp4_cache.page_bytes_mismatched" = 7\n')
    k = "k_norm_rope_mxfp4_cache.page_bytes_mismatched"
    assert b.limit(k, "default", "x").max == 0
    assert b.limit(k, "full", "x").max == 5
    assert b.limit(k, "full", "c").max == 7
    assert b.limit("chain.page_bytes_mismatched", "default", "x") is None     # bare names skip the chain
    assert b.limit("chain.page_bytes_mismatched_frac", "default", "x").max == 1e-3
    run = {"c": run_keys(["k_norm_rope_mxfp4_cache"], chain=False)}
    with pytest.raises(B.BudgetError, match="no limit for page_bytes_outside_owned_changed"):
        b.check_run(run, "full", known_suites=["full"])              # incomplete: fails before any work
    with pytest.raises(B.BudgetError, match=r"\[suite.full\] page_bytes_mismatched: matches no"):
        b.check_run({"c": run_keys(["topk"], chain=False)}, "full", known_suites=["full"])
    with pytest.raises(B.BudgetError, match=r"\[case.c\] k_norm_rope_mxfp4_cache.page_bytes_mismatched: matches no"):
        b.check_run({"c": run_keys(["topk"], chain=False)}, "default", known_suites=["full"])
    with pytest.raises(B.BudgetError, match=r"\[suite.full\]: no suite named 'full'"):
        b.check_run(run, "smoke")
    with pytest.raises(B.BudgetError, match="page_bytes_mismatchd.*did you mean 'page_bytes_mismatched'"):
        write(tmp_path, '[suite.s]\npage_bytes_mismatchd = 0\n')


def test_always_fail_metrics_need_no_budget(tmp_path):
    b = write(tmp_path, "[default]\nlogits_diff = 1\n")
    assert b.check({"compress_pool.pooled_nonfinite": 1}, "s", "x")
    assert b.check({"compress_pool.pooled_nonfinite": 0}, "s", "x") == []


@pytest.mark.parametrize("text, needle", [
    ("[default]\nx = true\n", "x"), ("[default]\nx = {maximum = 1}\n", "x"),
    ("[suite]\nx = 1\n", "suite"), ("oops = 1\n", "unknown top-level"), ("[default\n", "malformed"),
    ("", "empty budgets file"), ("[default]\n", "empty budgets file"), ("[default]\nx = 1\n", "unknown metric"),
    ("[default]\npooled_max_ulp = -1\n", "no value can pass"), ("[default]\ntopk_recall_min = 1.5\n", "no value"),
    ("[default]\n\"compress_pool.page_bytes_mismatched\" = 0\n", "does not report"),
    ("[default]\n\"chain.pooled_max_ulp\" = 0\n", "whole-chain comparison does not report"),
    ("[default]\npage_bytes_mismatched_frac = 0\n", "whole-chain metric"),
    ("[default]\npooled_rows_compared = 3\n", "no bad side"), ("[case.c]\n", "empty"),
])
def test_malformed_files(tmp_path, text, needle):
    with pytest.raises(B.BudgetError) as e:
        write(tmp_path, text)
    assert "b.toml" in str(e.value) and needle in str(e.value)


def _row(**kw):
    return {"case": "c", "outcome": "ok", "reason": "", "metrics": {}, "expect_nonfinite": False, **kw}


def test_verdicts():
    b = B.load()
    assert B.verdict(_row(), b, "s")["status"] == "pass"
    v = B.verdict(_row(metrics={"k_norm_rope_mxfp4_cache.page_bytes_mismatched": 3}), b, "s")
    assert (v["status"], v["ok"]) == ("fail", False) and "page_bytes_mismatched 3 > 0" in v["reason"]
    assert B.verdict(_row(outcome="error", reason="boom"), b, "s")["ok"] is False
    assert B.verdict(_row(outcome="skipped"), b, "s")["ok"] is True
    # non-finite inputs: their own class; ok only when the case declares it
    v = B.verdict(_row(outcome="nonfinite_input", reason="q: 1 non-finite"), b, "s")
    assert (v["status"], v["ok"]) == ("nonfinite_input", False)
    v = B.verdict(_row(outcome="nonfinite_input", expect_nonfinite=True), b, "s")
    assert (v["status"], v["ok"]) == ("nonfinite_input", True)
    # a case that planted non-finites but saw none fails: the harness missed them
    v = B.verdict(_row(expect_nonfinite=True, planted=["q[0] = nan"]), b, "s")
    assert (v["status"], v["ok"]) == ("fail", False)
    # on non-finite inputs the invariants still judge: a broken one is a failure, a held one is not
    nf = dict(outcome="nonfinite_input", expect_nonfinite=True, reason="q_rope_mxfp4_quant (step 0): weights: ...")
    v = B.verdict(_row(**nf, metrics={"topk.invariant_violations": 0.0}), b, "s")
    assert (v["status"], v["ok"], v["violations"]) == ("nonfinite_input", True, [])
    v = B.verdict(_row(**nf, metrics={"topk.invariant_violations": 3.0}), b, "s")
    assert (v["status"], v["ok"]) == ("fail", False)
    assert v["reason"].startswith("topk fails: topk.invariant_violations 3 > 0; on non-finite inputs: q_rope")


def test_the_first_failing_stage_is_the_earliest_in_chain_order():
    def v(*keys):
        return [{"metric": k} for k in keys]
    assert B.first_failing_stage(v("chain.topk_recall_min", "topk.topk_duplicates", "paged_mxfp4_mqa_logits.logits_diff",
                                   "q_rope_mxfp4_quant.q_bytes_mismatched")) == "q_rope_mxfp4_quant"
    assert B.first_failing_stage(v("topk.topk_duplicates", "compress_norm_rope_fp8_cache.page_bytes_mismatched")) \
        == "compress_norm_rope_fp8_cache"
    assert B.first_failing_stage(v("k_norm_rope_mxfp4_cache.page_bytes_mismatched", "compress_pool.pooled_max_ulp")) \
        == "compress_pool"
    assert B.first_failing_stage(v("chain.topk_recall_min")) == "chain"
    assert B.first_failing_stage([]) == ""


def test_a_limit_text_parses_back_to_its_limit():
    """`Limit.from_text` is `Limit.text`'s inverse (the recheck parses a report's recorded
    budgets with it), and refuses anything else."""
    from harness.diff.metrics import OFF, Limit
    for lim in (Limit(max=0.0), Limit(min=0.99), Limit(max=1.0, min=0.0), OFF, Limit(max=0.1 + 0.2),
                Limit(min=-5e-324)):
        assert Limit.from_text(lim.text()) == lim, lim.text()
    for bad in ("<= nan", "<= inf", ">= -inf", "< 1", "<=1", "<= 1 and <= 2", "<=  1", "", "on", None, 5):
        with pytest.raises(ValueError, match="limit text"):
            Limit.from_text(bad)
