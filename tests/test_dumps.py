"""The mxval-dump reader and writer: round trip, and one DumpError line per malformed file."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from helpers import make_layer, sample_path
from safetensors.torch import save_file

import reference
from harness.io.dumps import Dump, DumpError, OpRecord, read_dump, record_problem, write_dump


@pytest.fixture(scope="module")
def layer():
    return make_layer()


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_op_fields_cover_every_reference_op():
    assert all(op.fields.inputs and op.fields.outputs for op in reference.OPS.values())


def test_round_trip_every_op(tmp_path, layer):
    p = write_dump(tmp_path / "d.safetensors", layer, source="test", layer=12, step=300)
    d = read_dump(p)
    assert isinstance(d, Dump) and d.meta["layer"] == 12 and d.meta["step"] == 300
    assert d.meta["format"] == "mxval-dump" and d.meta["version"] == 1
    assert list(d.ops) == list(layer)
    for op, rec in layer.items():
        got = d.ops[op]
        assert got.scalars == rec.scalars
        for a, b in ((got.inputs, rec.inputs), (got.outputs, rec.outputs)):
            assert a.keys() == b.keys()
            for name in a:
                assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, (op, name)
                assert torch.equal(a[name].flatten().view(torch.uint8),
                                   b[name].flatten().view(torch.uint8)), (op, name)   # NaN rows too


def test_samples_read(tmp_path):
    for name, op in (("k_natural", "k_norm_rope_mxfp4_cache"), ("pool_pro", "compress_pool")):
        path = sample_path(name)
        h = _sha(path)
        d = read_dump(path)
        assert list(d.ops) == [op]
        assert _sha(path) == h


# --- malformed files: each gets one DumpError line naming the file ------------------------

def _raw(tmp_path, tensors: dict, meta) -> str:
    p = str(tmp_path / "bad.safetensors")
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, p,
              metadata=None if meta is None else {"mxval": meta if isinstance(meta, str) else json.dumps(meta)})
    return p


def _good(layer, op="q_rope_mxfp4_quant"):
    rec = layer[op]
    tensors = {f"{op}/in/{k}": v for k, v in rec.inputs.items()}
    tensors.update({f"{op}/out/{k}": v for k, v in rec.outputs.items()})
    meta = {"format": "mxval-dump", "version": 1, "source": "t", "model": "deepseek-v4-pro",
            "layer": 1, "step": 2, "ops": {op: rec.scalars}}
    return tensors, meta


def _expect_error(path, *needles):
    h = _sha(path)
    with pytest.raises(DumpError) as ei:
        read_dump(path)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(str(path) + ": "), msg
    for n in needles:
        assert n in msg, msg
    assert _sha(path) == h                     # never modified
    return msg


def test_good_raw_file_reads(tmp_path, layer):
    tensors, meta = _good(layer)
    read_dump(_raw(tmp_path, tensors, meta))   # the baseline every malformed case departs from


def test_truncated(tmp_path, layer):
    p = write_dump(tmp_path / "d.safetensors", layer, source="t")
    data = open(p, "rb").read()
    for cut, needle in ((len(data) - 100, "truncated: tensor data needs"), (20, "truncated"), (5, "too short")):
        q = tmp_path / f"cut{cut}.safetensors"
        q.write_bytes(data[:cut])
        _expect_error(q, needle)


def test_bad_header_and_foreign_files(tmp_path):
    p = tmp_path / "json.safetensors"
    p.write_bytes(struct.pack("<Q", 8) + b"not json")
    _expect_error(p, "not a safetensors file")
    p = tmp_path / "text.txt"
    p.write_text("hello, this is not a dump at all, just some text that is long enough")
    _expect_error(p, "not a safetensors file")
    with pytest.raises(DumpError, match=r"missing.safetensors: cannot read: No such file"):
        read_dump(tmp_path / "missing.safetensors")
    d = tmp_path / "dir.safetensors"
    d.mkdir()
    with pytest.raises(DumpError, match="cannot read"):
        read_dump(d)


def test_metadata_problems(tmp_path, layer):
    tensors, meta = _good(layer)
    _expect_error(_raw(tmp_path, tensors, None), "no 'mxval' metadata key")
    _expect_error(_raw(tmp_path, tensors, "{not json"), "not valid JSON")
    _expect_error(_raw(tmp_path, tensors, {**meta, "version": 2}), "unknown version 2")
    _expect_error(_raw(tmp_path, tensors, {k: v for k, v in meta.items() if k != "version"}), "version is missing")
    _expect_error(_raw(tmp_path, tensors, {**meta, "format": "other"}), "format")
    _expect_error(_raw(tmp_path, tensors, {**meta, "layer": "x"}), "layer")
    _expect_error(_raw(tmp_path, tensors, {**meta, "ops": {"frobnicate": {}}}), "unknown op 'frobnicate'")
    t2 = {k.replace("q_rope_mxfp4_quant", "frob"): v for k, v in tensors.items()}
    _expect_error(_raw(tmp_path, {**tensors, "frob/in/q": t2["frob/in/q"]}, meta), "unknown op 'frob'")
    _expect_error(_raw(tmp_path, tensors, {**meta, "ops": {"q_rope_mxfp4_quant": {}}}),
                  "missing scalar 'weights_scale'")
    _expect_error(_raw(tmp_path, tensors, {**meta, "ops": {"q_rope_mxfp4_quant": {"weights_scale": "a"}}}),
                  "weights_scale")
    _expect_error(_raw(tmp_path, tensors, {**meta, "ops": {"q_rope_mxfp4_quant": {"weights_scale": 1.0,
                                                                                   "bogus": 1}}}),
                  "unknown scalar 'bogus'")


def test_tensor_problems(tmp_path, layer):
    tensors, meta = _good(layer)
    op = "q_rope_mxfp4_quant"
    _expect_error(_raw(tmp_path, {k: v for k, v in tensors.items() if k != f"{op}/in/positions"}, meta),
                  f"missing tensor {op}/in/positions")
    _expect_error(_raw(tmp_path, {**tensors, f"{op}/in/extra": torch.zeros(3)}, meta),
                  f"unexpected tensor {op}/in/extra")
    _expect_error(_raw(tmp_path, {**tensors, "stray": torch.zeros(3)}, meta), "unexpected tensor name 'stray'")
    _expect_error(_raw(tmp_path, {**tensors, f"{op}/in/q": tensors[f"{op}/in/q"].float()}, meta),
                  f"{op}/in/q: dtype float32, expected bfloat16")
    _expect_error(_raw(tmp_path, {**tensors, f"{op}/out/q_scale": tensors[f"{op}/out/q_scale"][:, :, :3]}, meta),
                  f"{op}/out/q_scale", "dimension D")
    _expect_error(_raw(tmp_path, {**tensors, f"{op}/in/positions": tensors[f"{op}/in/positions"][:-1]}, meta),
                  f"{op}/in/positions", "dimension T")
    _expect_error(_raw(tmp_path, {**tensors, f"{op}/in/weights": tensors[f"{op}/in/weights"][0]}, meta),
                  "shape", "expected [T, H]")
    # an op present in the tensors but not listed in mxval.ops
    other = layer["topk"]
    extra = {f"topk/in/{k}": v for k, v in other.inputs.items()}
    _expect_error(_raw(tmp_path, {**tensors, **extra}, meta), "which mxval.ops does not list")


@pytest.mark.parametrize("op,field,bad,needle", [
    ("k_norm_rope_mxfp4_cache", ("out", "kv_cache"), lambda t: t[:2], "dimension P"),
    ("k_norm_rope_mxfp4_cache", ("in", "kv_cache"), lambda t: t[:, :100], "page"),
    ("paged_mxfp4_mqa_logits", ("in", "query_start_loc"), lambda t: t[:1], "dimension B"),
    ("paged_mxfp4_mqa_logits", ("in", "row_ends"), lambda t: t[:2], "dimension Rw"),
    ("topk", ("out", "indices"), lambda t: t[:, :3], "dimension k"),
    ("topk", ("out", "indices"), lambda t: t.long(), "dtype int64, expected int32"),
    ("compress_pool", ("in", "state_cache"), lambda t: t[..., :300], "dimension"),
    ("q_rope_fp8_quant", ("out", "q_fp8"), lambda t: t[..., :64], "dimension D"),
])
def test_cross_field_shapes(tmp_path, layer, op, field, bad, needle):
    tensors, meta = _good(layer, op)
    key = f"{op}/{field[0]}/{field[1]}"
    _expect_error(_raw(tmp_path, {**tensors, key: bad(tensors[key])}, meta), needle)


def test_writer_refuses_invalid_records(tmp_path, layer):
    rec = layer["topk"]
    bad = OpRecord("topk", rec.scalars, rec.inputs, {"indices": rec.outputs["indices"].long()})
    with pytest.raises(DumpError, match="dtype int64"):
        write_dump(tmp_path / "x.safetensors", {"topk": bad}, source="t")
    assert not list(tmp_path.iterdir())             # nothing half-written
    assert record_problem(rec) is None


def test_the_header_structure_is_scanned_once(monkeypatch):
    """The reader bounds the header's nesting in one pass (and the mxval metadata's in its own),
    and still names a header nested too deep."""
    from harness.io import safe_input
    scanned = []
    real = safe_input._structure
    monkeypatch.setattr(safe_input, "_structure", lambda text, strings: scanned.append(text) or real(text, strings))
    read_dump(sample_path("k_natural"))
    assert len(scanned) == 2 and len(set(scanned)) == 2          # the header, then the mxval metadata key


def test_a_header_nested_too_deep_is_named(tmp_path):
    p = tmp_path / "deep.safetensors"
    head = ("[" * 100 + "]" * 100).encode()
    p.write_bytes(struct.pack("<Q", len(head)) + head)
    _expect_error(p, "safetensors header: nested 100 deep")


def test_a_dump_write_checks_its_target_once_then_again_before_the_rename(tmp_path, layer, monkeypatch):
    from harness.io import atomic
    calls = []
    real = atomic.check_target
    monkeypatch.setattr(atomic, "check_target", lambda p, **kw: calls.append(str(p)) or real(p, **kw))
    p = tmp_path / "new" / "d.safetensors"
    write_dump(p, layer, source="t")
    assert calls == [str(p)] * 2 and read_dump(p).meta["source"] == "t"
    with pytest.raises(atomic.OutputError, match="outside"):       # refused before any directory is made
        write_dump(tmp_path / "a" / "b" / "d.safetensors", layer, source="t", within=tmp_path / "reports")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("head,problem", [
    (b"not json", "not a safetensors file (its header is not a JSON object)"),
    (b"[1, 2]", "not a safetensors file (its header is not a JSON object)"),
    (b'{"a": [1, 2}', "not a safetensors file (its header is not a JSON object)"),
    (b'{"a": ' + b"9" * 5000 + b"}", "safetensors header: a number of more than"),
    (b"[" * 70 + b"]" * 70, "safetensors header: nested 70 deep, more than the"),
])
def test_a_header_that_is_no_json_object_is_one_line(tmp_path, head, problem):
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)
    msg = _expect_error(p, problem)
    assert msg.startswith(f"{p}: {problem}"), msg
