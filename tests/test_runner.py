"""The runner: each stage diffed on the backend's own upstream output, the whole chain
on its own, errors and non-finite inputs as their own outcomes, parallel runs."""
import pytest
import torch

import reference
from harness.run.budgets import load, verdict
from harness.run.cases import Catalog
from harness.run.runner import run_case, run_cases
from optimized import Backend, register
from reference import layout
from reference.k_writer import writer_mask
from reference.pooling import boundary_mask

KW = "k_norm_rope_mxfp4_cache"


@pytest.fixture(scope="module")
def cat():
    return Catalog()


def backend(name, **ops):
    register(name, lambda: Backend(name, "test backend", dict(reference.FUNCTIONS, **ops)))
    return name


def stage_values(row, metric):
    return {k.partition(".")[0]: v for k, v in row["metrics"].items() if k.endswith("." + metric)}


def test_reference_is_exact_on_every_stage(cat):
    row = run_case(cat.case("smoke-chunks-shuffled"), "reference")
    assert row["outcome"] == "ok", row["reason"]
    assert set(row["summaries"]) == {"compress_pool", KW, "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits",
                                     "topk", "chain"}
    m = row["metrics"]
    assert m[f"{KW}.page_bytes_mismatched"] == 0 and m["chain.page_bytes_mismatched"] == 0
    assert m["compress_pool.pooled_max_ulp"] == 0 and m["q_rope_mxfp4_quant.q_bytes_mismatched"] == 0
    assert m["topk.topk_recall_min"] == 1 and m["chain.topk_recall_min"] == 1
    assert verdict(row, load(), "smoke")["status"] == "pass"


def _bad_pool(**a):
    out = reference.compress_pool(**a)
    sel = (boundary_mask(a["positions"], a["compress_ratio"]) & (a["kv_slot_mapping"] >= 0)).nonzero().flatten()
    p = out["pooled"].clone()
    p[sel[0], 7] = p[sel[0], 7] * 2 + 1
    return {"pooled": p}


def test_later_stages_see_the_backends_upstream_output(cat):
    """A pooling bug is blamed on pooling only; the K writer, fed the backend's pooled
    rows on both sides, matches; the whole-chain comparison shows the consequence."""
    row = run_case(cat.case("smoke-rowend-k"), backend("test-bad-pool", compress_pool=_bad_pool))
    m = row["metrics"]
    assert m["compress_pool.pooled_max_ulp"] > 1 and m["compress_pool.pooled_rows_differing"] == 1
    assert m[f"{KW}.page_bytes_mismatched"] == 0
    assert m["chain.page_bytes_mismatched"] > 0 and m["chain.page_bytes_mismatched_frac"] > 0
    v = [x["metric"] for x in verdict(row, load(), "smoke")["violations"]]
    assert v[0] == "compress_pool.pooled_max_ulp" and "chain.page_bytes_mismatched_frac" in v
    assert not any(x.startswith(KW) for x in v)


def test_in_place_writer_outside_its_slots_is_caught(cat):
    def kw(**a):
        out = reference.k_norm_rope_mxfp4_cache(**a)
        pool = a["kv_cache"]                       # the caller's tensor, written in place (as aiter does)
        pool.copy_(out["kv_cache"])
        stride = pool.shape[1]
        pool[0, stride - 1] ^= 0xFF                # the padding byte at the end of page 0
        return {"kv_cache": pool}
    row = run_case(cat.case("smoke-chunks-shuffled"), backend("test-in-place", k_norm_rope_mxfp4_cache=kw))
    m = row["metrics"]
    assert m[f"{KW}.page_bytes_outside_owned_changed"] >= 1
    assert any(f.get("class") == "outside_owned_write" for f in row["findings"])
    assert row["details"]["mismatch_map"] and any(e == -1 for _, e, _ in row["details"]["mismatch_map"])


def test_backend_exception_is_an_error_naming_the_stage(cat):
    def boom(**a):
        raise RuntimeError("kernel launch failed")
    row = run_case(cat.case("smoke-rowend-k"), backend("test-boom", paged_mxfp4_mqa_logits=boom))
    assert row["outcome"] == "error"
    assert "paged_mxfp4_mqa_logits (step 0)" in row["reason"] and "kernel launch failed" in row["reason"]
    assert verdict(row, load(), "smoke")["ok"] is False


def test_nonfinite_from_the_backend_is_not_an_input_class(cat):
    def nan_pool(**a):
        out = reference.compress_pool(**a)
        return {"pooled": torch.full_like(out["pooled"], float("nan"))}
    row = run_case(cat.case("smoke-rowend-k"), backend("test-nan-pool", compress_pool=nan_pool))
    assert row["outcome"] == "error" and "upstream" in row["reason"]
    assert row["metrics"]["compress_pool.pooled_nonfinite"] > 0


def test_planted_nonfinite_is_its_own_outcome(cat):
    row = run_case(cat.case("smoke-nan-state"), "reference")
    assert row["outcome"] == "nonfinite_input" and "state_cache" in row["reason"]
    assert verdict(row, load(), "smoke")["status"] == "nonfinite_input"


def test_gpu_cases_skip_on_cpu(cat):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    row = run_case(cat.case("full-pool-2gib"), "reference")
    assert row["outcome"] == "skipped" and "GPU" in row["reason"]


def test_parallel_matches_serial_and_sees_registered_backends(cat):
    def kw(**a):
        out = reference.k_norm_rope_mxfp4_cache(**a)
        slots = a["slot_mapping"][writer_mask(a["positions"], a["slot_mapping"], a["compress_ratio"])]
        pool = out["kv_cache"].clone()
        if slots.numel():
            page, entry = divmod(int(slots[0]), a["page_size"])
            vo = layout.value_offsets(torch.tensor(entry), a["page_size"], 128, a["shuffle"])
            pool[page, vo[3]] ^= 0x88
        return {"kv_cache": pool}
    name = backend("test-flip-par", k_norm_rope_mxfp4_cache=kw)
    cases = [cat.case("smoke-rowend-k"), cat.case("smoke-chunk-edges")]
    serial = run_cases(cases, name, jobs=1)
    seen = []
    par = run_cases(cases, name, jobs=2, progress=lambda r: seen.append(r["case"]))
    assert sorted(seen) == sorted(c.name for c in cases)
    for s, p in zip(serial, par):
        assert p["outcome"] == "ok", p["reason"]
        assert s["case"] == p["case"] and s["metrics"] == p["metrics"]
        assert p["metrics"][f"{KW}.page_bytes_mismatched"] >= 1


def test_a_report_row_has_one_shape():
    """Rows are built in one place (harness/run/record.py): a field it does not know is a bug."""
    from harness.run.record import row
    r = row("c", "s", "reference", metrics={"x.y": 1.0})
    assert r["outcome"] == "ok" and r["metrics"] == {"x.y": 1.0} and r["findings"] == []
    with pytest.raises(TypeError, match="metricz"):
        row("c", "s", "reference", metricz={})
