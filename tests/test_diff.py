"""The diff engine: every planted fault is found, localized and classified; exact outputs pass."""
from __future__ import annotations

import pytest
import torch
from helpers import make_layer

import reference
from harness.diff import (
    ALWAYS_FAIL,
    MAX_FINDINGS,
    DiffReport,
    diff_logits,
    diff_op,
    diff_pages,
    diff_pooled,
    diff_q,
    diff_topk,
    higher_is_better,
    writer_slots,
)
from reference import layout
from reference.fp8 import fp8_slot_offsets
from reference.scoring import paged_mxfp4_mqa_logits_fp64

PS, D = 64, 128
SHUF = [32, 16, 2]


@pytest.fixture(scope="module")
def layer():
    return make_layer(1)


@pytest.fixture(scope="module")
def kw(layer):
    """K writer record with its written slots and their flat byte offsets."""
    r = layer["k_norm_rope_mxfp4_cache"]
    slots = writer_slots(r.inputs, r.scalars)
    vo, so = layout.slot_byte_offsets(slots, PS, D, SHUF, r.inputs["kv_cache"].shape[1])
    return r, slots, vo, so


def _pages(r, actual, slots):
    return diff_pages(actual, r.outputs["kv_cache"], r.inputs["kv_cache"], page_size=PS, head_dim=D,
                      shuffle=SHUF, written_slots=slots)


def _one(rep, cls):
    hits = [f for f in rep.findings if f["class"] == cls]
    assert len(hits) == 1 and rep.metrics[f"class_{cls}"] == 1, rep.summary()
    return hits[0]


def test_exact_pages_pass(kw):
    r, slots, _, _ = kw
    rep = _pages(r, r.outputs["kv_cache"].clone(), slots)
    assert rep.findings == [] and rep.ok({"page_bytes_mismatched": 0})
    assert all(v == 0 for v in rep.metrics.values()), rep.metrics


def _pick_byte(actual_flat, vo, pred):
    """(entry index i, byte b) of the first written value byte whose value satisfies pred."""
    vals = actual_flat[vo]
    hit = pred(vals.long()).nonzero()[7]          # not the very first: localization must be real
    return int(hit[0]), int(hit[1])


def test_flipped_byte_localized(kw):
    r, slots, vo, _ = kw
    act = r.outputs["kv_cache"].clone()
    flat = act.view(-1)
    i, b = 50, 37
    flat[vo[i, b]] ^= 0x77
    rep = _pages(r, act, slots)
    assert rep.metrics["page_bytes_mismatched"] == 1 and rep.metrics["page_value_bytes_mismatched"] == 1
    assert rep.metrics["page_entries_mismatched"] == 1 and rep.metrics["page_dequant_max_abs_err"] > 0
    f = rep.findings[0]
    slot = int(slots[i])
    assert (f["page"], f["entry"], f["slot"], f["byte"], f["block"]) == (slot // PS, slot % PS, slot, b, 2)
    assert f["elements"] == [74, 75] and f["offset"] == int(vo[i, b])
    assert f"page {slot // PS} entry {slot % PS}" in f["where"] and "value byte 37" in f["where"]
    assert not rep.ok({"page_bytes_mismatched": 0})
    with pytest.raises(AssertionError, match="page_bytes_mismatched = 1"):
        rep.raise_if_failed({"page_bytes_mismatched": 0})


def test_nibble_swap(kw):
    r, slots, vo, _ = kw
    act = r.outputs["kv_cache"].clone()
    flat = act.view(-1)
    i, b = _pick_byte(flat, vo, lambda v: (v & 15) != (v >> 4))
    x = int(flat[vo[i, b]])
    flat[vo[i, b]] = ((x & 15) << 4) | (x >> 4)
    f = _one(_pages(r, act, slots), "nibbles_swapped")
    assert (f["entry"], f["byte"]) == (int(slots[i]) % PS, b)


def test_signed_zero_and_one_step(kw):
    r, slots, vo, _ = kw
    act = r.outputs["kv_cache"].clone()
    flat = act.view(-1)
    i, b = _pick_byte(flat, vo, lambda v: ((v & 15) == 8) & ((v >> 4) & 7 != 0))
    flat[vo[i, b]] &= 0xF0                         # -0.0 -> +0.0 in the low nibble
    f = _one(_pages(r, act, slots), "signed_zero")
    assert f["byte"] == b and f["nibbles"] == ["signed_zero", "equal"]
    act = r.outputs["kv_cache"].clone()
    flat = act.view(-1)
    i, b = _pick_byte(flat, vo, lambda v: ((v >> 4) & 7 > 0) & ((v >> 4) & 7 < 7))
    flat[vo[i, b]] += 0x10                         # high nibble one code up (same sign)
    f = _one(_pages(r, act, slots), "one_step")
    assert f["byte"] == b and f["nibbles"] == ["equal", "one_step"]


def test_scale_off_by_one(kw):
    r, slots, _, so = kw
    act = r.outputs["kv_cache"].clone()
    act.view(-1)[so[20, 3]] += 1
    rep = _pages(r, act, slots)
    f = _one(rep, "scale_off_by_k")
    assert (f["entry"], f["block"], f["k"], f["values"]) == (int(slots[20]) % PS, 3, 1, "codes_equal")
    assert rep.metrics["page_scale_bytes_mismatched"] == 1 and rep.metrics["page_value_bytes_mismatched"] == 0
    assert rep.metrics["page_dequant_max_rel_err"] > 0.1


def test_requantized_block_filed_under_its_scale(kw):
    """A block quantized with a scale one lower (OCP floor) and codes to match: one scale
    finding, its value bytes counted but not classified again."""
    r, slots, vo, so = kw
    act = r.outputs["kv_cache"].clone()
    flat = act.view(-1)
    i, blk = 5, 1
    e = flat[so[i, blk]].item()
    packed = flat[vo[i, 16 * blk:16 * blk + 16]].clone()
    vals = reference.mxfp4.dequantize_mxfp4(packed, torch.tensor([e], dtype=torch.uint8))
    y = vals * 2.0 ** (127 - (e - 1))            # the same values at the next lower scale
    codes = reference.mxfp4.e2m1_codes(y.clamp(-6, 6))
    flat[vo[i, 16 * blk:16 * blk + 16]] = reference.mxfp4.pack_nibbles(codes)
    flat[so[i, blk]] = e - 1
    rep = _pages(r, act, slots)
    f = _one(rep, "scale_off_by_k")
    assert f["k"] == -1 and f["values"] == "consistent"
    assert rep.metrics["page_value_bytes_mismatched"] > 0
    assert not any(f["class"] in ("value_other", "one_step") for f in rep.findings)


def test_scale_interleave(kw):
    r, slots, _, so = kw
    flat_e = r.outputs["kv_cache"].view(-1)
    sc = flat_e[so]
    i = int((sc[:, 0] != sc[:, 1]).nonzero()[2])
    act = r.outputs["kv_cache"].clone()
    flat = act.view(-1)
    flat[so[i, 0]], flat[so[i, 1]] = sc[i, 1], sc[i, 0]
    rep = _pages(r, act, slots)
    f = _one(rep, "scale_interleave")
    assert f["entry"] == int(slots[i]) % PS and "class_scale_off_by_k" not in rep.metrics


def test_outside_owned_write(kw):
    r, slots, vo, so = kw
    act = r.outputs["kv_cache"].clone()
    stride = act.shape[1]
    # page 2 entry 40 was not written (the layer writes slots 64..143): a stray scale byte
    stray = 2 * stride + int(layout.scale_offsets(torch.tensor([40]), PS, D, SHUF)[0, 3])
    act.view(-1)[stray] ^= 0x01
    act.view(-1)[0] ^= 0x80                        # page 0, not written at all
    rep = _pages(r, act, slots)
    assert rep.metrics["page_bytes_outside_owned_changed"] == 2
    assert rep.metrics["page_value_bytes_mismatched"] == 0 and rep.metrics["page_entries_mismatched"] == 0
    fs = [f for f in rep.findings if f["class"] == "outside_owned_write"]
    assert [(f["page"], f["entry"], f["kind"]) for f in fs] == [(0, 0, "value"), (2, 40, "scale")]
    assert fs[1]["block"] == 3 and fs[1]["offset"] == stray


def test_padding_write_is_outside_owned(kw):
    r, slots, _, _ = kw
    pad = 16
    def padded(t):
        return torch.cat((t, torch.full((t.shape[0], pad), 0xAB, dtype=torch.uint8)), 1)
    before, exp = padded(r.inputs["kv_cache"]), padded(r.outputs["kv_cache"])
    act = exp.clone()
    act[1, -3] = 0
    rep = diff_pages(act, exp, before, page_size=PS, head_dim=D, shuffle=SHUF, written_slots=slots)
    f = _one(rep, "outside_owned_write")
    assert (f["page"], f["kind"]) == (1, "padding") and "padding" in f["where"]


def test_not_written_entry(kw):
    r, slots, vo, so = kw
    act = r.outputs["kv_cache"].clone()
    flat, before = act.view(-1), r.inputs["kv_cache"].view(-1)
    flat[vo[9]] = before[vo[9]]
    flat[so[9]] = before[so[9]]
    rep = _pages(r, act, slots)
    f = _one(rep, "not_written")
    assert f["entry"] == int(slots[9]) % PS and len(rep.findings) == 1


def test_findings_capped_and_counted(kw):
    r, slots, vo, _ = kw
    act = r.outputs["kv_cache"].clone()
    act.view(-1)[vo[:, :10].flatten()] ^= 0x77
    rep = _pages(r, act, slots)
    assert len(rep.findings) == MAX_FINDINGS
    assert rep.metrics["page_value_bytes_mismatched"] == 800
    assert sum(v for k, v in rep.metrics.items() if k.startswith("class_")) == 800
    assert any("800 findings" in n for n in rep.notes)


def test_fp8_pages(layer):
    r = layer["k_norm_rope_fp8_cache"]
    slots = writer_slots(r.inputs, r.scalars)
    stride = r.inputs["kv_cache"].shape[1]
    vo, so = fp8_slot_offsets(slots, PS, D, stride)
    exp = r.outputs["kv_cache"]

    def run(act):
        return diff_pages(act, exp, r.inputs["kv_cache"], page_size=PS, head_dim=D, shuffle=None,
                          written_slots=slots, fmt="fp8")

    assert run(exp.clone()).findings == []
    act = exp.clone()
    s = act.view(-1)[so[3]].view(torch.float32)
    act.view(-1)[so[3]] = (s * 4).view(torch.uint8)
    f = _one(run(act), "scale_off_by_k")
    assert f["k"] == 2 and f["entry"] == int(slots[3]) % PS
    act = exp.clone()
    act.view(-1)[vo[7, 9]] ^= 0x80                 # sign flip of a non-zero value
    f = _one(run(act), "value_other")
    assert (f["page"], f["entry"], f["byte"]) == (int(slots[7]) // PS, int(slots[7]) % PS, 9)
    act = exp.clone()
    flat = act.view(-1)
    x = int(flat[vo[11, 5]])
    flat[vo[11, 5]] = x + 1 if (x & 0x7F) < 0x7E else x - 1
    f = _one(run(act), "one_step")
    assert (f["entry"], f["byte"]) == (int(slots[11]) % PS, 5)


# --- pooled rows -----------------------------------------------------------------------------

def test_pooled(layer):
    r = layer["compress_pool"]
    exp = r.outputs["pooled"]
    rows = (r.inputs["kv_slot_mapping"] >= 0)
    rep = diff_pooled(exp.clone(), exp, rows)
    assert rep.metrics["pooled_max_ulp"] == 0 and rep.ok({})
    row = int(rows.nonzero()[3])
    for ulps in (1, 2):
        act = exp.clone()
        bits = act.view(torch.int16)
        bits[row, 17] += ulps
        rep = diff_pooled(act, exp, rows)
        assert rep.metrics["pooled_max_ulp"] == ulps and rep.metrics["pooled_values_differing"] == 1
        f = rep.findings[0]
        assert (f["row"], f["channel"]) == (row, 17)
        assert rep.ok({"pooled_max_ulp": 1}) == (ulps == 1)
    act = exp.clone()
    act[row, 3] = float("nan")
    rep = diff_pooled(act, exp, rows)
    assert rep.metrics["pooled_nonfinite"] == 1 and not rep.ok({})     # never a silent pass
    # rows of tokens that write nothing are NaN on both sides and not compared
    assert bool(torch.isnan(exp[~rows]).all())


def test_fp8_signed_zero_class():
    from harness.diff.pages import NIB_SIGNED_ZERO, nibble_class
    c = nibble_class(torch.tensor([0x80, 0x00, 0x81]), torch.tensor([0x00, 0x80, 0x01]), sign_bit=0x80)
    assert c.tolist()[:2] == [NIB_SIGNED_ZERO, NIB_SIGNED_ZERO] and c.tolist()[2] != NIB_SIGNED_ZERO


def test_pooled_ulp_across_zero():
    e = torch.tensor([[0.0, -0.0, 1e-40]]).to(torch.bfloat16)
    a = torch.tensor([[-0.0, 0.0, -1e-40]]).to(torch.bfloat16)
    rep = diff_pooled(a, e, torch.tensor([True]))
    assert rep.metrics["pooled_values_differing"] == 3
    n = int(e.view(torch.int16)[0, 2])
    assert rep.metrics["pooled_max_ulp"] == 2 * n


# --- Q -----------------------------------------------------------------------------------------

def test_q(layer):
    r = layer["q_rope_mxfp4_quant"]
    exp = r.outputs
    assert diff_q({k: v.clone() for k, v in exp.items()}, exp).findings == []
    act = {k: v.clone() for k, v in exp.items()}
    x = int(act["q_fp4"][4, 2, 9])
    act["q_fp4"][4, 2, 9] = x ^ 0x88 if (x & 7) and (x >> 4) & 7 else x ^ 0x77
    act["weights"].view(torch.int32)[1, 3] += 1
    act["q_scale"][0, 1, 2] -= 2
    rep = diff_q(act, exp)
    assert rep.metrics["q_bytes_mismatched"] == 1 and rep.metrics["q_scale_bytes_mismatched"] == 1
    assert rep.metrics["weights_max_ulp"] == 1
    byte = [f for f in rep.findings if f.get("byte") == 9][0]
    assert (byte["token"], byte["head"]) == (4, 2)
    sc = _one(rep, "scale_off_by_k")
    assert (sc["token"], sc["head"], sc["block"], sc["k"]) == (0, 1, 2, -2)
    r8 = layer["q_rope_fp8_quant"]
    act = {k: v.clone() for k, v in r8.outputs.items()}
    act["q_fp8"][2, 1, 100] ^= 0x80
    rep = diff_q(act, r8.outputs)
    assert rep.metrics["q_bytes_mismatched"] == 1
    assert (rep.findings[0]["token"], rep.findings[0]["head"], rep.findings[0]["byte"]) == (2, 1, 100)


# --- logits ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scorer(layer):
    r = layer["paged_mxfp4_mqa_logits"]
    ref64 = paged_mxfp4_mqa_logits_fp64(**r.inputs, **r.scalars, width=r.outputs["logits"].shape[1])
    return r, ref64


def test_logits_fp32_rounding_passes(scorer):
    r, ref64 = scorer
    rep = diff_logits(ref64.float(), ref64, r.inputs["row_ends"], clean=True)
    assert 0 < rep.metrics["logits_diff"] <= 1e-12 and rep.ok({"logits_diff": 1e-12})
    assert rep.findings == [] and rep.metrics["logits_rows_differing"] == 0
    assert rep.metrics["logits_inf_pattern_mismatch"] == 0 and rep.metrics["logits_nonfinite"] == 0


def test_logits_shuffled_row_fails(scorer):
    r, ref64 = scorer
    act = ref64.float().clone()
    row, end = 4, int(r.inputs["row_ends"][4])
    act[row, :end] = act[row, :end][torch.randperm(end, generator=torch.Generator().manual_seed(0))]
    rep = diff_logits(act, ref64, r.inputs["row_ends"], clean=True)
    assert rep.metrics["logits_diff"] > 1e-6 and not rep.ok({"logits_diff": 1e-12})
    assert rep.findings[0]["row"] == row and rep.metrics["logits_rows_differing"] == 1


def test_logits_inf_pattern_and_nonfinite(scorer):
    r, ref64 = scorer
    act = ref64.float().clone()
    act[0, int(r.inputs["row_ends"][0]) + 2] = 0.0        # past the row end
    assert diff_logits(act, ref64, r.inputs["row_ends"], clean=True).metrics["logits_inf_pattern_mismatch"] == 1
    rep = diff_logits(act, ref64, r.inputs["row_ends"], clean=False)
    assert "logits_inf_pattern_mismatch" not in rep.metrics and rep.ok({"logits_diff": 1e-12})
    act = ref64.float().clone()
    act[2, 1] = float("nan")
    rep = diff_logits(act, ref64, r.inputs["row_ends"], clean=False)
    assert rep.metrics["logits_nonfinite"] == 1 and not rep.ok({})
    assert _one(rep, "nonfinite")["row"] == 2


# --- top-k -------------------------------------------------------------------------------------

def _topk_ref(logits, lengths, k):
    return reference.topk(logits=logits, lengths=lengths, k=k)["indices"]


def test_topk_exact_and_padding():
    k = 4
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([2, 4, 9])
    idx = _topk_ref(logits, lengths, k)
    rep = diff_topk(idx, logits.double(), lengths, k)
    assert rep.findings == [] and rep.metrics["topk_recall_min"] == 1.0 and rep.metrics["topk_rows_not_exact_frac"] == 0
    bad = idx.clone()
    bad[0] = torch.tensor([1, 0, -1, -1], dtype=torch.int32)       # short row out of order
    rep = diff_topk(bad, logits.double(), lengths, k)
    assert rep.metrics["topk_padding_errors"] == 1 and rep.findings[0]["row"] == 0
    assert rep.metrics["topk_recall_min"] == 1.0                     # the set is right, the order is not
    bad = idx.clone()
    bad[0] = torch.tensor([0, 1, 2, -1], dtype=torch.int32)        # padding missing: 2 >= len
    rep = diff_topk(bad, logits.double(), lengths, k)
    assert rep.metrics["topk_padding_errors"] == 1 and rep.metrics["topk_out_of_range"] == 1
    bad = idx.clone()
    bad[2, 1] = -1                                                  # a long row holding -1
    rep = diff_topk(bad, logits.double(), lengths, k)
    assert rep.metrics["topk_padding_errors"] == 1 and rep.metrics["topk_recall_min"] == 0.75
    assert rep.findings[0]["row"] == 2 and "padding" in rep.findings[0]["classes"]


def test_topk_report_carries_its_rows_and_others_none():
    """`DiffReport.rows` is a declared field: the top-k diff fills it (the recall plot reads
    it), every other report has None."""
    import dataclasses

    from harness.diff.report import DiffReport
    assert "rows" in {f.name for f in dataclasses.fields(DiffReport)} and DiffReport("x").rows is None
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([2, 4, 9])
    rep = diff_topk(_topk_ref(logits, lengths, 4), logits.double(), lengths, 4)
    assert set(rep.rows) == {"recall", "exact", "mass", "lengths"} and rep.rows["recall"].shape[0] == 3


def test_topk_duplicates_and_range():
    k = 4
    logits = torch.arange(12, dtype=torch.float64).repeat(2, 1)
    lengths = torch.tensor([12, 10])
    idx = torch.tensor([[11, 10, 9, 8], [9, 8, 7, 6]], dtype=torch.int32)
    assert diff_topk(idx, logits, lengths, k).findings == []
    bad = idx.clone()
    bad[0, 3] = 11
    rep = diff_topk(bad, logits, lengths, k)
    assert rep.metrics["topk_duplicates"] == 1 and rep.metrics["topk_recall_min"] == 0.75
    assert rep.metrics["topk_jaccard_min"] == pytest.approx(3 / (3 + 4 - 3))
    bad = idx.clone()
    bad[1, 0] = 10                                                  # >= length 10
    rep = diff_topk(bad, logits, lengths, k)
    assert rep.metrics["topk_out_of_range"] == 1 and rep.findings[0]["row"] == 1
    assert rep.metrics["topk_jaccard_min"] == pytest.approx(3 / (4 + 4 - 3))


def test_topk_tie_rule():
    k = 3
    s = torch.tensor([[5.0, 4.0, 3.0, 3.0, 1.0, 0.0]], dtype=torch.float64)
    lengths = torch.tensor([6])
    tie = torch.tensor([[0, 1, 3]], dtype=torch.int32)             # the other 3.0: a legal tie break
    rep = diff_topk(tie, s, lengths, k)
    assert rep.metrics["topk_below_threshold"] == 0 and rep.metrics["topk_recall_min"] == 1.0
    assert rep.ok({"topk_recall_min": 1.0, "topk_below_threshold": 0})
    low = torch.tensor([[0, 1, 4]], dtype=torch.int32)             # 1.0 < 3.0 - 5e-4
    rep = diff_topk(low, s, lengths, k)
    assert rep.metrics["topk_below_threshold"] == 1 and rep.metrics["topk_recall_min"] == pytest.approx(2 / 3)
    assert not rep.ok({"topk_recall_min": 1.0})
    assert rep.findings[0]["first_below"] == [4]
    near = torch.tensor([[5.0, 4.0, 3.0, 2.9996, 1.0, 0.0]], dtype=torch.float64)
    alt = torch.tensor([[0, 1, 3]], dtype=torch.int32)
    assert diff_topk(alt, near, lengths, k).metrics["topk_below_threshold"] == 0    # within 1e-4*max
    assert diff_topk(alt, near, lengths, k, tol=0.0).metrics["topk_below_threshold"] == 1


# --- reports and dispatch ----------------------------------------------------------------------

def test_report_budget_directions():
    rep = DiffReport("x", {"page_bytes_mismatched": 2.0, "topk_recall_min": 0.9, "nonfinite_inputs": 0.0})
    assert higher_is_better("topk_recall_min") and not higher_is_better("page_bytes_mismatched")
    assert rep.ok({"page_bytes_mismatched": 2, "topk_recall_min": 0.9}) and not rep.ok({"page_bytes_mismatched": 1})
    assert not rep.ok({"topk_recall_min": 0.95}) and rep.ok({"q_bytes_mismatched": 0})  # a metric not reported
    assert not DiffReport("x", {"logits_diff": float("nan")}).ok({"logits_diff": 1})
    for m in ALWAYS_FAIL:                       # no budget: must be 0; "off" and a limit mean the same as in mxval
        assert not DiffReport("x", {m: 1.0}).ok({}) and DiffReport("x", {m: 0.0}).ok()
        assert DiffReport("x", {m: 1.0}).ok({m: "off"}) and DiffReport("x", {m: 1.0}).ok({m: 5})
    with pytest.raises(ValueError, match="unknown metric 'foo_min'"):
        rep.ok({"foo_min": 1})
    with pytest.raises(ValueError, match="no value can pass"):
        rep.ok({"page_bytes_mismatched": -1})
    s = rep.summary({"page_bytes_mismatched": 1})
    assert "FAIL" in s and "page_bytes_mismatched = 2" in s


def test_diff_op_every_op_exact(layer):
    for op, rec in layer.items():
        rep = diff_op(op, rec.inputs, rec.scalars, {k: v.clone() for k, v in rec.outputs.items()}, rec.outputs)
        assert rep.op == op and rep.findings == [], (op, rep.summary())
        kept_all = ("topk_recall_min", "topk_jaccard_min", "topk_mass_kept_min", "topk_top64_kept_min",
                    "topk_top256_kept_min")             # an exact selection keeps everything
        assert all(v == 1.0 if k in kept_all else v == 0 or k == "pooled_rows_compared"
                   for k, v in rep.metrics.items()), (op, rep.metrics)
        assert "topk_rank_lost_min" not in rep.metrics   # nothing lost


def test_diff_op_missing_or_misshapen_output(layer):
    rec = layer["q_rope_mxfp4_quant"]
    act = {"q_fp4": rec.outputs["q_fp4"], "q_scale": rec.outputs["q_scale"][:1]}
    rep = diff_op(rec.op, rec.inputs, rec.scalars, act, rec.outputs)
    assert rep.metrics["outputs_missing"] == 1 and rep.metrics["outputs_bad_shape"] == 1 and not rep.ok({})


# --- on a GPU: the same findings where the pool lives, and offsets past 2 GiB ------------------

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    return torch.device("cuda")


@pytest.mark.gpu
def test_pages_on_gpu_match_cpu(kw):
    dev = _cuda()
    r, slots, vo, so = kw
    act = r.outputs["kv_cache"].clone()
    act.view(-1)[vo[50, 37]] ^= 0x77
    act.view(-1)[so[20, 3]] += 1
    act.view(-1)[5] ^= 1
    cpu = _pages(r, act, slots)
    gpu = diff_pages(act.to(dev), r.outputs["kv_cache"].to(dev), r.inputs["kv_cache"].to(dev), page_size=PS,
                     head_dim=D, shuffle=SHUF, written_slots=slots.to(dev))
    assert gpu.metrics == cpu.metrics and gpu.findings == cpu.findings


@pytest.mark.gpu
def test_pages_past_2gib_localized():
    """A pool over 2 GiB: a byte past offset 2**31 is found at the right page and entry."""
    dev = _cuda()
    stride = PS * 68
    pages = (2 ** 31) // stride + 8
    before = torch.zeros(pages, stride, dtype=torch.uint8, device=dev)
    slots = torch.arange((pages - 2) * PS, pages * PS, device=dev)       # the last two pages
    packed = torch.randint(0, 256, (slots.numel(), 64), dtype=torch.uint8, device=dev)
    scales = torch.randint(120, 130, (slots.numel(), 4), dtype=torch.uint8, device=dev)
    expected = layout.write_entries(before, slots, packed, scales, page_size=PS, shuffle=SHUF)
    actual = expected.clone()
    vo, _ = layout.slot_byte_offsets(slots[70:71], PS, D, SHUF, stride)
    off = int(vo[0, 11])
    assert off > 2 ** 31
    actual.view(-1)[off] ^= 0xFF
    rep = diff_pages(actual, expected, before, page_size=PS, head_dim=D, shuffle=SHUF, written_slots=slots)
    f = rep.findings[0]
    assert rep.metrics["page_bytes_mismatched"] == 1 and f["offset"] == off
    assert (f["page"], f["entry"], f["byte"]) == (pages - 1, 70 - PS, 11)


def test_diff_op_checks_its_index_inputs():
    """Per-token index inputs of different lengths, or float ones, are a ValueError naming the
    input (they used to end in a torch error inside the differ)."""
    import pytest
    import torch

    from harness.diff import diff_op
    pooled = {"pooled": torch.zeros(4, 8, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"inputs\['kv_slot_mapping'\]: dimension T is 3"):
        diff_op("compress_pool", {"positions": torch.arange(4), "kv_slot_mapping": torch.arange(3)},
                {"compress_ratio": 4}, pooled, pooled)
    with pytest.raises(ValueError, match=r"inputs\['positions'\]: expected dtype int32 or int64"):
        diff_op("compress_pool", {"positions": torch.arange(4.0), "kv_slot_mapping": torch.arange(4)},
                {"compress_ratio": 4}, pooled, pooled)


def test_topk_findings_past_the_kept_ones_are_counted_and_the_recall_rows_come_with_the_report():
    """More flagged rows than a report keeps: each row counted under its classes, the first
    MAX_FINDINGS written in row order; the report's per-row tensors give `recall_rows`."""
    from harness.diff.report import MAX_FINDINGS
    from harness.diff.scores import diff_topk, recall_points, recall_rows
    g = torch.Generator().manual_seed(5)
    rows, w, k = MAX_FINDINGS + 30, 64, 8
    s = torch.randn(rows, w, generator=g, dtype=torch.float64)
    lens = torch.full((rows,), w)
    idx = torch.topk(s, k, 1).indices
    idx[:, -1] = torch.topk(s, w, 1).indices[:, -1]          # every row: its worst key instead
    idx[::4, 0] = idx[::4, 1]                                 # a quarter: a duplicate too
    rep = diff_topk(idx, s, lens, k)
    assert rep.metrics["class_below_threshold"] == rows
    assert rep.metrics["class_duplicates"] == len(range(0, rows, 4))
    assert [f["row"] for f in rep.findings] == list(range(MAX_FINDINGS))
    assert any(f"the first {MAX_FINDINGS} listed" in n for n in rep.notes)
    assert recall_points(rep.rows) == recall_rows(idx, s, lens, k)
    assert all(p[1] < 1 for p in recall_points(rep.rows))
