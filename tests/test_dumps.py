"""The mxval-dump reader and writer: round trip, and one DumpError line per malformed file."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import save_file

import reference
from harness.io.dumps import OP_FIELDS, Dump, DumpError, OpRecord, read_dump, record_problem, write_dump
from helpers import sample_path
from reference.rope import cos_sin_cache


def make_layer(seed: int = 0, *, shuffle=(32, 16, 2), page_size: int = 64, heads: int = 4,
               k: int = 8) -> dict[str, OpRecord]:
    """A small whole-layer step of every op in DUMPS.md, outputs from the reference."""
    g = torch.Generator().manual_seed(seed)
    D, R, r = 128, 64, 4
    recs: dict[str, OpRecord] = {}

    def add(op, inputs, scalars):
        out = reference.OPS[op](**inputs, **scalars)
        if op.startswith("paged_"):
            out = {"logits": out["logits"]}
        recs[op] = OpRecord(op, dict(scalars), inputs, out)
        return out

    # pooling: one request, 40 tokens, state blocks of 16 positions, permuted table
    T = 40
    pos = torch.arange(T)
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    state = torch.randn(4, 16, 4 * D, generator=g)
    slot_pool = torch.where((pos + 1) % r == 0, pos // r, -1)
    add("compress_pool", {"state_cache": state, "block_table": table, "positions": pos,
                          "req_index": torch.zeros(T, dtype=torch.int32), "kv_slot_mapping": slot_pool},
        {"compress_ratio": r})
    # K writer: 80 boundary tokens into pages 1 and 2 of a 3-page pool of random bytes
    T = 320
    pos = torch.arange(T)
    entry = pos // r
    slots = torch.where((pos + 1) % r == 0, page_size + entry, -1)
    cs = cos_sin_cache(T + 8, R, 160000.0)
    kk = (torch.randn(T, D, generator=g) * 3).to(torch.bfloat16)
    w = (torch.rand(D, generator=g) + 0.5).to(torch.bfloat16)
    pool = torch.randint(0, 256, (3, page_size * 68), generator=g, dtype=torch.uint8)
    kout = add("k_norm_rope_mxfp4_cache",
               {"k": kk, "positions": pos, "cos_sin_cache": cs, "norm_weight": w, "slot_mapping": slots,
                "kv_cache": pool},
               {"norm_eps": 1e-6, "compress_ratio": r, "page_size": page_size,
                "shuffle": list(shuffle) if shuffle else None})
    fpool = torch.randint(0, 256, (3, page_size * 132), generator=g, dtype=torch.uint8)
    k8 = add("k_norm_rope_fp8_cache",
             {"k": kk, "positions": pos, "cos_sin_cache": cs, "norm_weight": w, "slot_mapping": slots,
              "kv_cache": fpool},
             {"norm_eps": 1e-6, "compress_ratio": r, "page_size": page_size, "fp8_dtype": "e4m3fn"})
    # Q: 6 query rows at the sequence's last positions
    Rw = 6
    qpos = torch.arange(T - Rw, T)
    q = torch.randn(Rw, heads, D, generator=g).to(torch.bfloat16)
    hw = torch.randn(Rw, heads, generator=g)
    ws = 128 ** -0.5 * heads ** -0.5
    qo = add("q_rope_mxfp4_quant", {"q": q, "positions": qpos, "cos_sin_cache": cs, "weights": hw},
             {"weights_scale": ws})
    q8 = add("q_rope_fp8_quant", {"q": q, "positions": qpos, "cos_sin_cache": cs, "weights": hw},
             {"weights_scale": ws, "fp8_dtype": "e4m3fn"})
    n = T // r
    row_ends = torch.tensor([5, k, k + 1, 40, 79, 80])          # short, exactly k, k+1, long
    paged = {"query_start_loc": torch.tensor([0, Rw]), "context_lens": torch.tensor([n]),
             "block_table": torch.tensor([[1, 2]], dtype=torch.int32), "row_ends": row_ends}
    lo = add("paged_mxfp4_mqa_logits",
             {"q_fp4": qo["q_fp4"], "q_scale": qo["q_scale"], "weights": qo["weights"],
              "kv_cache": kout["kv_cache"], **paged},
             {"page_size": page_size, "shuffle": list(shuffle) if shuffle else None, "clean_logits": True})
    add("paged_fp8_mqa_logits", {"q_fp8": q8["q_fp8"], "weights": q8["weights"], "kv_cache": k8["kv_cache"],
                                 **paged},
        {"page_size": page_size, "fp8_dtype": "e4m3fn", "clean_logits": False})
    add("topk", {"logits": lo["logits"], "lengths": row_ends}, {"k": k})
    return recs


@pytest.fixture(scope="module")
def layer():
    return make_layer()


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_op_fields_cover_every_reference_op():
    assert set(OP_FIELDS) == set(reference.OPS)


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
