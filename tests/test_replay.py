"""Replaying dumps through the reference and through a backend."""
from __future__ import annotations

import pytest
import torch
from helpers import make_layer, sample_path

import reference
from harness.io.dumps import DumpError, OpRecord, read_dump, write_dump
from harness.run.replay import record_op, replay_dump, replay_file, replay_op
from optimized import Backend
from reference import layout

EXACT = {"page_bytes_mismatched": 0, "page_bytes_outside_owned_changed": 0, "pooled_max_ulp": 0,
         "q_bytes_mismatched": 0, "q_scale_bytes_mismatched": 0, "weights_max_ulp": 0,
         "logits_diff": 1e-12, "logits_inf_pattern_mismatch": 0, "topk_recall_min": 1.0,
         "topk_padding_errors": 0, "topk_duplicates": 0, "topk_out_of_range": 0}


@pytest.fixture(scope="module")
def layer():
    return make_layer(2)


@pytest.fixture(scope="module")
def dump_path(layer, tmp_path_factory):
    return write_dump(tmp_path_factory.mktemp("d") / "layer.safetensors", layer, source="test", layer=3, step=9)


def test_samples_replay_exact():
    (k,) = replay_file(sample_path("k_natural"))
    assert k.op == "k_norm_rope_mxfp4_cache" and k.metrics["page_bytes_mismatched"] == 0
    assert k.metrics["page_bytes_outside_owned_changed"] == 0 and k.findings == []
    (p,) = replay_file(sample_path("pool_pro"))
    assert p.op == "compress_pool" and p.metrics["pooled_max_ulp"] == 0
    assert p.metrics["pooled_rows_compared"] == 85 and p.ok(EXACT)


def test_generated_layer_replays_exact(layer, dump_path):
    reps = replay_dump(read_dump(dump_path))
    assert [r.op for r in reps] == list(layer)
    for r in reps:
        assert r.ok(EXACT), r.summary(EXACT)
    scorer = [r for r in reps if r.op == "paged_mxfp4_mqa_logits"][0]
    assert 0 < scorer.metrics["logits_diff"] < 1e-12          # recorded f32 vs the fp64 reference
    assert scorer.metrics["logits_inf_pattern_mismatch"] == 0  # clean_logits: the pattern is checked


def test_flipped_byte_in_dump_found(layer, tmp_path):
    rec = layer["k_norm_rope_mxfp4_cache"]
    out = rec.outputs["kv_cache"].clone()
    stride = out.shape[1]
    entry, byte, page = 33, 21, 1                                 # slot 97 is written by the layer
    off = page * stride + int(layout.value_offsets(torch.tensor([entry]), 64, 128, [32, 16, 2])[0, byte])
    out.view(-1)[off] ^= 0x5A
    p = write_dump(tmp_path / "flip.safetensors",
                   {rec.op: OpRecord(rec.op, rec.scalars, rec.inputs, {"kv_cache": out})}, source="t")
    (rep,) = replay_file(p)
    assert not rep.ok(EXACT) and rep.metrics["page_bytes_mismatched"] == 1
    f = rep.findings[0]
    assert (f["page"], f["entry"], f["byte"], f["slot"]) == (page, entry, byte, page * 64 + entry)


def test_nonfinite_input_is_its_own_class(layer):
    rec = layer["q_rope_mxfp4_quant"]
    q = rec.inputs["q"].clone()
    q[1, 2, 3] = float("nan")
    rep = replay_op(OpRecord(rec.op, rec.scalars, {**rec.inputs, "q": q}, rec.outputs))
    assert rep.metrics["nonfinite_inputs"] == 1 and rep.findings[0]["class"] == "nonfinite_input"
    assert not rep.ok({}) and not rep.ok(EXACT)                 # never a pass, whatever the budgets


def test_recorded_topk_on_a_nan_row_is_held_to_the_invariants(layer, tmp_path):
    """A captured top-k whose logits hold a NaN row: no reference judges that row, but the
    recorded indices are held to the invariants. In-row indices are no alarm; an index past
    the row (what a top-k does with a NaN key it mis-orders) is an invariant violation, in
    `mxval diff`'s verdict too."""
    from harness.run.budgets import load, verdict
    from harness.run.record import dump_row
    rec = layer["topk"]
    logits = rec.inputs["logits"].clone()
    logits[0, :3] = float("nan")
    good = replay_op(OpRecord(rec.op, rec.scalars, {**rec.inputs, "logits": logits}, rec.outputs))
    assert good.metrics["nonfinite_inputs"] > 0 and good.metrics["invariant_violations"] == 0
    idx = rec.outputs["indices"].clone()
    idx[0, 0] = int(rec.inputs["lengths"][0]) + 5                  # past row 0's end
    p = write_dump(tmp_path / "nan-topk.safetensors",
                   {rec.op: OpRecord(rec.op, rec.scalars, {**rec.inputs, "logits": logits}, {"indices": idx})},
                   source="t")
    (bad,) = replay_file(p)
    assert bad.metrics["invariant_violations"] >= 1
    assert any(f["class"] == "invariant" and f["invariant"] == "topk_range" for f in bad.findings), bad.findings
    row = verdict(dump_row(str(p), [bad], "reference", 0.0), load(), "diff")
    assert row["status"] == "fail" and not row["ok"], row


def test_recorded_outputs_are_held_to_the_invariants_on_finite_inputs_too(layer):
    """A recorded page that changed a byte outside every written slot: the diff finds the
    byte, and the page invariant names it as a write outside owned slots."""
    rec = layer["k_norm_rope_mxfp4_cache"]
    out = rec.outputs["kv_cache"].clone()
    out[-1, -1] ^= 0xFF                                           # the last page's last byte
    rep = replay_op(OpRecord(rec.op, rec.scalars, rec.inputs, {"kv_cache": out}))
    assert rep.metrics["invariant_violations"] >= 1, rep.summary()


def test_rejected_inputs_are_a_dump_error(layer):
    rec = layer["k_norm_rope_mxfp4_cache"]
    slots = rec.inputs["slot_mapping"].clone()
    slots[3] = 10 ** 6
    with pytest.raises(DumpError, match=r"^x.safetensors: k_norm_rope_mxfp4_cache: slot_mapping: value 1000000"):
        replay_op(OpRecord(rec.op, rec.scalars, {**rec.inputs, "slot_mapping": slots}, rec.outputs),
                  path="x.safetensors")


def _backend(name, **ops) -> Backend:
    return Backend(name, "test", {**reference.FUNCTIONS, **ops})


def test_backend_replay_reproduces_and_differs(dump_path):
    dump = read_dump(dump_path)
    for r in replay_dump(dump, "reference"):
        assert r.ok(EXACT), r.summary(EXACT)
        assert any("backend 'reference'" in n for n in r.notes)

    def bad_q(**kw):
        out = reference.OPS["q_rope_mxfp4_quant"].fn(**kw)
        out["q_fp4"][2, 1, 5] ^= 0x0F
        return out

    reps = {r.op: r for r in replay_dump(dump, _backend("bad", q_rope_mxfp4_quant=bad_q))}
    q = reps["q_rope_mxfp4_quant"]
    assert not q.ok(EXACT) and (q.findings[0]["token"], q.findings[0]["head"], q.findings[0]["byte"]) == (2, 1, 5)
    assert reps["k_norm_rope_mxfp4_cache"].ok(EXACT)


def test_backend_writing_in_place_cannot_change_the_recorded_pool(dump_path):
    """A kernel that updates kv_cache in place: the diff still uses the recorded `before`."""
    def in_place(**kw):
        out = reference.OPS["k_norm_rope_mxfp4_cache"].fn(**kw)
        kw["kv_cache"].copy_(out["kv_cache"])
        return {"kv_cache": kw["kv_cache"]}

    dump = read_dump(dump_path)
    before = dump.ops["k_norm_rope_mxfp4_cache"].inputs["kv_cache"].clone()
    reps = {r.op: r for r in replay_dump(dump, _backend("inplace", k_norm_rope_mxfp4_cache=in_place))}
    assert reps["k_norm_rope_mxfp4_cache"].ok(EXACT)
    assert torch.equal(dump.ops["k_norm_rope_mxfp4_cache"].inputs["kv_cache"], before)


def test_backend_missing_op_never_passes(dump_path):
    be = Backend("partial", "test", {"topk": reference.FUNCTIONS["topk"]})
    reps = {r.op: r for r in replay_dump(read_dump(dump_path), be)}
    assert reps["topk"].ok(EXACT)
    assert reps["compress_pool"].metrics["op_unsupported"] == 1 and not reps["compress_pool"].ok({})


def test_record_op(layer):
    rec = layer["topk"]
    got = record_op("topk", rec.inputs, {"k": torch.tensor(8)}, rec.outputs)
    assert got.scalars == {"k": 8} and got.inputs["logits"] is not rec.inputs["logits"]
    with pytest.raises(ValueError, match="missing tensor topk/in/lengths"):
        record_op("topk", {"logits": rec.inputs["logits"]}, {"k": 8}, rec.outputs)


def test_scorer_replayed_at_the_recorded_width(layer):
    """Kernels size logits by max_model_len, not by the block table: the reference must
    be run at the recorded width (clean_logits: -inf past every row end)."""
    rec = layer["paged_mxfp4_mqa_logits"]
    lo = rec.outputs["logits"]
    wide = torch.cat((lo, torch.full((lo.shape[0], 32), float("-inf"))), 1)
    rep = replay_op(OpRecord(rec.op, rec.scalars, rec.inputs, {"logits": wide}))
    assert rep.ok(EXACT), rep.summary(EXACT)
