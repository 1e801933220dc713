"""The metric table: complete, one judge, steps combined by kind, the contract fully bounded."""
import math

import pytest

from harness.diff import DiffReport, diff_logits, diff_pooled
from harness.diff.metrics import ALWAYS_FAIL, METRICS, OFF, REQUIRED, Limit, aggregate, judge, required_keys, run_keys
from harness.run import budgets as B
from harness.run.cases import Catalog
from harness.run.runner import ChainRun, run_case


@pytest.fixture(scope="module")
def rows():
    cat = Catalog()
    return {n: (cat.case(n), run_case(cat.case(n), "reference"))
            for n in ("smoke-clean-logits", "smoke-fp8", "smoke-chunks-shuffled", "smoke-cuda-path",
                      "smoke-cuda-path-fp8")}


def test_every_reported_metric_is_in_the_table_and_predicted(rows):
    for name, (case, row) in rows.items():
        assert row["outcome"] == "ok", row["reason"]
        predicted = run_keys(case.ops)
        for key in row["metrics"]:
            assert key.rpartition(".")[2] in METRICS, key
            assert key in predicted, (name, key)


def test_counts_are_summed_over_steps_not_maxed():
    # names containing "err", "diff" or "ulp" used to be maxed: steps [3, 4] reported 4
    for name in ("topk_padding_errors", "pooled_values_differing", "logits_rows_differing",
                 "chain.topk_duplicates", "compress_pool.pooled_rows_differing", "class_one_ulp"):
        assert aggregate(name, [3, 4]) == 7, name
    assert aggregate("pooled_max_ulp", [3, 4]) == 4
    assert aggregate("chain.page_bytes_mismatched_frac", [0.1, 0.3]) == 0.3
    assert aggregate("topk_recall_min", [0.9, 0.7]) == 0.7
    assert math.isnan(aggregate("topk_duplicates", [1, float("nan")]))
    with pytest.raises(KeyError, match="not in the metric table"):
        aggregate("no_such_metric", [1])


def test_the_runner_sums_counts_of_a_multi_step_case(rows):
    case, _ = rows["smoke-chunks-shuffled"]
    from harness.run.inputs import build
    from optimized import get_backend
    run = ChainRun(case, get_backend("reference"), build(case, "cpu"))
    run.col.metrics["topk.topk_padding_errors"] = [3, 4]
    run.col.metrics["compress_pool.pooled_max_ulp"] = [3, 4]
    m = run.col.case_metrics()
    assert m["topk.topk_padding_errors"] == 7 and m["compress_pool.pooled_max_ulp"] == 4


def test_off_means_the_same_in_both_judges(tmp_path):
    contract = (B.default_path()).read_text()
    p = tmp_path / "b.toml"
    p.write_text(contract.replace("logits_nonfinite = 0\n", 'logits_nonfinite = "off"\n', 1))
    b = B.load(p)
    metrics = {"paged_mxfp4_mqa_logits.logits_nonfinite": 3.0}
    assert b.check(metrics, "s", "c") == []
    rep = DiffReport("paged_mxfp4_mqa_logits", {"logits_nonfinite": 3.0})
    assert rep.ok({"logits_nonfinite": "off"})
    # without a budget both fail it; with a limit both apply it
    assert B.load().check(metrics, "s", "c") and not rep.ok({})
    assert not rep.ok({"logits_nonfinite": 2}) and rep.ok({"logits_nonfinite": 3})
    keys = {"c": run_keys(["paged_mxfp4_mqa_logits"], chain=False)}
    assert b.disabled(keys, "s") == ['[default] logits_nonfinite = "off"']
    assert B.load().disabled(keys, "s") == []


def test_one_judge_for_direction_nan_and_defaults():
    lim = {"topk_recall_min": Limit.parse("topk_recall_min", 0.9), "logits_diff": Limit.parse("logits_diff", 1e-12)}
    bad = judge({"topk.topk_recall_min": 0.8, "s.logits_diff": float("nan"), "s.pooled_nonfinite": 1,
                 "s.pooled_rows_compared": 5}, lambda k: lim.get(k.rpartition(".")[2]))
    assert [(v["metric"], v["why"]) for v in bad] == [("s.logits_diff", "is NaN"), ("s.pooled_nonfinite", "1 > 0"),
                                                      ("topk.topk_recall_min", "0.8 < 0.9")]
    assert Limit.parse("pooled_max_ulp", "off") is OFF and OFF.off


def test_limits_no_value_can_meet_are_refused():
    for name, v in (("pooled_max_ulp", -1), ("topk_recall_min", 1.5), ("logits_diff", {"max": 1, "min": 2}),
                    ("page_bytes_mismatched", float("nan")), ("chain.page_bytes_mismatched_frac", {"min": 2}),
                    ("logits_diff", float("inf")), ("topk_recall_min", {"min": float("-inf")})):
        with pytest.raises(ValueError):
            Limit.parse(name.rpartition(".")[2], v)


def test_the_contract_bounds_every_required_metric_of_every_suite():
    cat = Catalog()
    b = B.load()
    for suite in cat.suites:
        cases = cat.suite_cases(suite)
        b.check_run({c.name: run_keys(c.ops) for c in cases}, suite, known_cases=cat.by_name)
    assert set(REQUIRED) <= set(b.default)
    assert set(ALWAYS_FAIL) & set(REQUIRED) == set()


def test_required_keys_and_chain_rules():
    keys = run_keys(["k_norm_rope_mxfp4_cache", "topk"])
    req = required_keys(keys)
    assert "chain.page_bytes_mismatched_frac" in req and "chain.topk_duplicates" in req
    assert "chain.logits_diff" not in req and "chain.page_bytes_mismatched" not in req
    assert "k_norm_rope_mxfp4_cache.page_bytes_mismatched" in req
    assert not any(k.startswith("compress_pool.") for k in keys)


def test_differs_report_only_table_metrics():
    import torch
    a = torch.zeros(4, 128, dtype=torch.bfloat16)
    rep = diff_pooled(a, a, torch.ones(4, dtype=torch.bool))
    assert set(rep.metrics) <= set(METRICS)
    rep = diff_logits(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float64), torch.tensor([3, 8]), clean=True)
    assert set(rep.metrics) <= set(METRICS)


def test_the_fused_stage_reports_what_its_op_table_entry_says():
    """The fused pool+K op is judged as a K writer because its op-table entry says it fuses
    pooling and the K writer (`Op.fuses`): no stage alias, no op-name prefix."""
    from harness.diff.metrics import emitted_by, op_emits
    from reference.ops import OPS
    fused = OPS["compress_norm_rope_mxfp4_cache"]
    assert fused.stage == "pool_k" and fused.fuses == ("pooling", "k_writer") and fused.diffed_as == "k_writer"
    assert OPS["k_norm_rope_mxfp4_cache"].stages == ("k_writer",)
    # the attribute is what makes the K writer's metrics the fused op's: its own stage alone has none
    assert not emitted_by("page_bytes_outside_owned_changed", "pool_k")
    assert op_emits("page_bytes_outside_owned_changed", fused.name)
    assert op_emits("pool_k_bytes_mismatched_frac", fused.name)
    assert not op_emits("pool_k_bytes_mismatched_frac", "k_norm_rope_mxfp4_cache")
    assert not op_emits("pooled_max_ulp", fused.name)           # its output is pages, not pooled rows
    assert "compress_norm_rope_mxfp4_cache.page_bytes_mismatched" in run_keys([fused.name])


def test_one_chain_prefix():
    from harness.diff.metrics import CHAIN, chain_key, is_chain
    assert chain_key("logits_diff") == f"{CHAIN}.logits_diff" and is_chain(chain_key("logits_diff"))
    assert not is_chain("paged_mxfp4_mqa_logits.logits_diff") and not is_chain("chainx.logits_diff")


def test_a_replay_reproduces_a_logged_row_up_to_the_order_of_its_sums():
    from harness.diff.metrics import REPRO_REL, not_reproduced
    logged = {"paged_mxfp4_mqa_logits.logits_diff": 1e-20, "topk.topk_mass_kept_min": 0.75,
              "k_norm_rope_mxfp4_cache.page_bytes_mismatched": 68, "paged_mxfp4_mqa_logits.logits_max_abs_err": 0.5}
    again = dict(logged)
    again["paged_mxfp4_mqa_logits.logits_diff"] = 1e-20 * (1 + REPRO_REL / 2)    # fp64 sums in another order
    again["topk.topk_mass_kept_min"] = 0.75 * (1 - REPRO_REL / 2)
    assert not_reproduced(logged, again) == {}
    for key, value in (("paged_mxfp4_mqa_logits.logits_diff", 1e-20 * (1 + 4 * REPRO_REL)),
                       ("k_norm_rope_mxfp4_cache.page_bytes_mismatched", 69),
                       ("paged_mxfp4_mqa_logits.logits_max_abs_err", 0.5 + 2 ** -50)):     # maxima: exactly
        assert set(not_reproduced(logged, {**again, key: value})) == {key}
    assert set(not_reproduced(logged, {**again, "topk.topk_duplicates": 0})) == {"topk.topk_duplicates"}
