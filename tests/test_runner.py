"""The runner: each stage diffed on the backend's own upstream output, the whole chain
on its own, errors and non-finite inputs as their own outcomes, parallel runs."""
import math

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
    """NaN from a backend stage is a numerics failure of that stage (never an error, never a
    non-finite input); the K writer downstream runs on the reference's pooled rows."""
    def nan_pool(**a):
        out = reference.compress_pool(**a)
        return {"pooled": torch.full_like(out["pooled"], float("nan"))}
    row = run_case(cat.case("smoke-rowend-k"), backend("test-nan-pool", compress_pool=nan_pool))
    assert row["outcome"] == "ok"
    assert row["metrics"]["compress_pool.pooled_nonfinite"] > 0
    assert any(s.startswith("k_norm_rope_mxfp4_cache (step 0)") for s in row["details"]["substituted"])
    assert row["metrics"]["k_norm_rope_mxfp4_cache.page_bytes_mismatched"] == 0     # judged, and right
    v = verdict(row, load(), "smoke")
    assert v["status"] == "fail" and v["reason"].startswith("compress_pool fails: ")


def test_a_scorer_leaving_inf_fails_at_the_scorer_and_topk_is_still_judged(cat):
    """-inf where the reference scores a column: the scorer stage fails with its findings
    (row, column, expected value); top-k runs on the logits with those columns replaced by
    the reference's and is judged (here: right)."""
    def holes(**a):
        out = reference.paged_mxfp4_mqa_logits(**a)["logits"].clone()
        out[:, 1] = float("-inf")
        return {"logits": out}
    row = run_case(cat.case("smoke-rowend-k"), backend("test-inf-holes", paged_mxfp4_mqa_logits=holes))
    assert row["outcome"] == "ok"
    assert row["metrics"]["paged_mxfp4_mqa_logits.logits_nonfinite"] > 0
    f = next(x for x in row["findings"] if x["stage"] == "paged_mxfp4_mqa_logits" and x["class"] == "nonfinite")
    assert f["col"] == 1 and f["actual"] == "-inf" and math.isfinite(f["expected"])   # JSON-able
    assert row["metrics"]["topk.topk_below_threshold"] == 0 and "topk.topk_padding_errors" in row["metrics"]
    assert any(s.startswith("topk (step 0)") for s in row["details"]["substituted"])
    v = verdict(row, load(), "smoke")
    assert v["status"] == "fail" and v["reason"].startswith("paged_mxfp4_mqa_logits fails: ")


def test_a_stage_the_reference_cannot_judge_is_never_a_pass():
    row = {"case": "x", "outcome": "ok", "metrics": {}, "not_judged": "topk (step 0): not judged: ..."}
    v = verdict(row, load(), "smoke")
    assert v["status"] == "fail" and v["ok"] is False and "not judged" in v["reason"]


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


def test_repeat_requires_the_same_bytes_every_run(cat):
    """`repeat`: each backend op runs N times on the same inputs; an op whose bytes change is
    its own failure class, with the bytes that changed."""
    import dataclasses
    calls = {"n": 0}

    def flaky(**a):
        out = reference.topk(**a)["indices"].clone()
        calls["n"] += 1
        if calls["n"] % 2 == 0 and out.shape[0] and out.shape[1] > 1:
            out[-1, :2] = out[-1, :2].flip(0)             # the same set, another order
        return {"indices": out}
    case = dataclasses.replace(cat.case("smoke-rowend-k"), repeat=3)
    row = run_case(case, backend("test-flaky-topk", topk=flaky))
    v = verdict(row, load(), "smoke")
    assert v["status"] == "fail" and v["reason"].startswith("nondeterministic: topk (step 0) output indices: ")
    f = next(x for x in row["findings"] if x["class"] == "nondeterministic")
    assert f["stage"] == "topk" and f["bytes_changed"] > 0 and f["run"] == 2
    assert verdict(run_case(case, "reference"), load(), "smoke")["status"] == "pass"
    once = run_case(cat.case("smoke-rowend-k"), backend("test-flaky-topk", topk=flaky))
    assert verdict(once, load(), "smoke")["status"] == "pass"          # one run: nothing to compare


@pytest.mark.parametrize("text", ["0", "101", "x", "2.5"])
def test_repeat_flag_takes_1_to_100_runs(text):
    import argparse

    from harness.commands.args import repeat_count
    assert repeat_count("1") == 1 and repeat_count("100") == 100
    with pytest.raises(argparse.ArgumentTypeError, match="from 1 to 100"):
        repeat_count(text)


@pytest.mark.parametrize("where", ["past", "inside"])
def test_repeat_compares_the_scorers_valid_region_only(cat, where):
    """Without clean logits, columns past a row's end are unspecified: a scorer whose bytes
    change there each run repeats; one whose valid bytes change does not."""
    import dataclasses
    calls = {"n": 0}
    seen = {"past_end": False}

    def drifting(*, clean_logits=False, **a):
        out = reference.paged_mxfp4_mqa_logits(clean_logits=clean_logits, **a)["logits"].clone()
        calls["n"] += 1
        ends = a["row_ends"].long()
        r = int(ends.argmin())
        c = int(ends[r]) if where == "past" else int(ends[r]) - 1
        seen["past_end"] |= int(ends[r]) < out.shape[1]
        out[r, c] = float(calls["n"])
        return {"logits": out}
    case = dataclasses.replace(cat.case("smoke-rowend-k"), repeat=2)
    row = run_case(case, backend(f"test-drifting-scorer-{where}", paged_mxfp4_mqa_logits=drifting))
    assert row["outcome"] == "ok", row["reason"]
    assert calls["n"] >= 2 and seen["past_end"]
    found = [f for f in row["findings"] if f["class"] == "nondeterministic"]
    if where == "past":
        assert not found
    else:
        assert found and found[0]["stage"] == "paged_mxfp4_mqa_logits" and found[0]["bytes_changed"] > 0


@pytest.mark.parametrize("name, direct", [("batch-mixed", False), ("batch-mixed", True),
                                          ("smoke-cuda-path-fp8", False)])
def test_history_written_in_blocks_is_the_same_pool(name, direct, monkeypatch):
    """The history goes through the reference a block of tokens at a time (bounded memory):
    the same pool, to the byte, as one call over every token (pooled, direct, fused)."""
    import dataclasses

    from harness.run import runner
    from harness.run.inputs import build
    from optimized import get_backend
    from reference.ops import OPS
    case = Catalog().case(name)
    if direct:
        case = dataclasses.replace(case, history="direct")
    inp = build(case, "cpu")
    kw = runner._ops(inp)[0]

    def pool(min_tokens, token_bytes):
        monkeypatch.setattr(runner, "HISTORY_MIN_TOKENS", min_tokens)
        monkeypatch.setattr(runner, "HISTORY_TOKEN_BYTES", token_bytes)
        r = runner.ChainRun(case, get_backend("reference"), inp)
        r.fused = bool(OPS[kw].fuses)
        return r._written_history(kw)
    whole, blocks = pool(10 ** 9, 1), pool(6, 10 ** 12)
    n = inp.history.n
    assert n > 3 * 6 and n % 6, n                               # several blocks, the last one partial
    assert not torch.equal(whole, inp.kv_cache)                 # the history wrote entries
    assert torch.equal(whole, blocks)


def test_topk_reading_one_column_past_a_row_end_is_caught(cat):
    """Without clean_logits the columns past a row's end are unspecified: top-k's input holds
    the largest fp32 there, so a top-k whose mask is `col <= len` selects column len. With
    clean_logits the scorer's -inf stays (and is compared at the scorer)."""
    def mask_le(*, logits, lengths, k):
        n = lengths.long()
        long_rows = n > k
        ln = torch.where(long_rows, (n + 1).clamp(max=logits.shape[1]), n)
        return reference.topk(logits=torch.nan_to_num(logits, posinf=3e38, neginf=-3e38), lengths=ln, k=k)

    name = backend("test-topk-mask-le", topk=mask_le)
    row = verdict(run_case(cat.case("smoke-chunks-shuffled"), name), load(), "default")
    assert not row["ok"] and row["metrics"]["topk.topk_out_of_range"] > 0, row.get("reason")
    for case in ("smoke-chunks-shuffled", "smoke-clean-logits"):
        assert verdict(run_case(cat.case(case), "reference"), load(), "default")["ok"]
    assert verdict(run_case(cat.case("smoke-clean-logits"), name), load(), "default")["ok"]   # -inf past ends
