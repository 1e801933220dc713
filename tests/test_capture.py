"""The capture hook, on fake aiter/vLLM modules injected into sys.modules."""
from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

import reference
from harness import capture
from harness.capture import (AITER_K_WRITER, AITER_Q_QUANT, VLLM_COMPRESS_POOL, ArgMap, Selection, Target,
                             install, set_context, uninstall, wrap)
from harness.dumps import read_dump
from harness.replay import replay_dump
from test_dumps import make_layer

EXACT = {"page_bytes_mismatched": 0, "page_bytes_outside_owned_changed": 0, "pooled_max_ulp": 0,
         "q_bytes_mismatched": 0, "q_scale_bytes_mismatched": 0, "weights_max_ulp": 0}


# --- fakes with aiter's and vLLM's calling conventions -----------------------------------------

def fake_k_writer(k, positions, cos_sin_cache, norm_weight, norm_eps, kv_cache, slot_mapping,
                  compress_ratio=1, shuffle=None):
    """aiter's convention: writes the pool [P, page_size, 1, 68] in place, returns None."""
    pages = kv_cache.view(kv_cache.shape[0], -1)
    out = reference.OPS["k_norm_rope_mxfp4_cache"](
        k=k[:slot_mapping.numel()], positions=positions[:slot_mapping.numel()], cos_sin_cache=cos_sin_cache,
        norm_weight=norm_weight, slot_mapping=slot_mapping, kv_cache=pages, norm_eps=norm_eps,
        compress_ratio=compress_ratio, page_size=kv_cache.shape[1], shuffle=shuffle)
    pages.copy_(out["kv_cache"])


def fake_q_quant(q, positions, cos_sin_cache, weights=None, weights_scale=1.0):
    out = reference.OPS["q_rope_mxfp4_quant"](q=q, positions=positions, cos_sin_cache=cos_sin_cache,
                                              weights=weights, weights_scale=weights_scale)
    return out["q_fp4"], out["q_scale"], out["weights"]


class FakePoolKernel:
    """vLLM's `_compress_pool_kernel[(num_tokens,)](...)`: writes pooled rows into `out`."""

    def __getitem__(self, grid):
        def launch(state_cache, s0, s1, token_to_req, positions, kv_slot, block_table, bt_stride,
                   block_size, out, out_stride, HEAD_SIZE, STATE_WIDTH, COMPRESS_RATIO, OVERLAP, num_warps=1):
            t = grid[0]
            res = reference.OPS["compress_pool"](state_cache=state_cache, block_table=block_table,
                                                 positions=positions[:t], req_index=token_to_req[:t],
                                                 kv_slot_mapping=kv_slot[:t], compress_ratio=COMPRESS_RATIO)
            rows = kv_slot[:t] >= 0
            out[:t][rows] = res["pooled"][rows]
        return launch


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    aiter = types.ModuleType("fake_aiter_ops")
    aiter.k_norm_rope_mxfp4_cache = fake_k_writer
    aiter.q_rope_mxfp4_quant = fake_q_quant
    vllm = types.ModuleType("fake_vllm_indexer")
    vllm._compress_pool_kernel = FakePoolKernel()
    vllm.k_store = fake_k_writer                 # imported by name before install
    monkeypatch.setitem(sys.modules, "fake_aiter_ops", aiter)
    monkeypatch.setitem(sys.modules, "fake_vllm_indexer", vllm)
    monkeypatch.setenv("MXVAL_CAPTURE_DIR", str(tmp_path / "dumps"))
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "12,20")
    monkeypatch.setenv("MXVAL_CAPTURE_STEPS", "0-1,300")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    targets = [Target("fake_aiter_ops", "k_norm_rope_mxfp4_cache", "k_norm_rope_mxfp4_cache", AITER_K_WRITER),
               Target("fake_aiter_ops", "q_rope_mxfp4_quant", "q_rope_mxfp4_quant", AITER_Q_QUANT),
               Target("fake_vllm_indexer", "_compress_pool_kernel", "compress_pool", VLLM_COMPRESS_POOL,
                      launcher=True),
               Target("no_such_module_xyz", "op", "topk", ArgMap({}, {}))]
    yield aiter, vllm, targets, tmp_path / "dumps"
    uninstall()


def _k_args(layer):
    r = layer["k_norm_rope_mxfp4_cache"]
    a = dict(r.inputs)
    pool = a.pop("kv_cache")
    a["kv_cache"] = pool.clone().view(pool.shape[0], 64, 1, 68)
    return r, a


def _run_step(aiter, vllm, layer):
    """One indexer layer step through the (maybe wrapped) module attributes; returns outputs."""
    p = layer["compress_pool"].inputs
    out = torch.full((p["positions"].numel() + 5, 128), 7.0, dtype=torch.bfloat16)   # scratch, longer than T
    sc = p["state_cache"]
    vllm._compress_pool_kernel[(p["positions"].numel(),)](
        sc, sc.stride(0), sc.stride(1), p["req_index"], p["positions"], p["kv_slot_mapping"], p["block_table"],
        p["block_table"].stride(0), sc.shape[1], out, out.stride(0),
        HEAD_SIZE=128, STATE_WIDTH=256, COMPRESS_RATIO=4, OVERLAP=1, num_warps=1)
    r, a = _k_args(layer)
    vllm.k_store(a["k"], a["positions"], a["cos_sin_cache"], a["norm_weight"], 1e-6, a["kv_cache"],
                 a["slot_mapping"], compress_ratio=4, shuffle=(32, 16, 2))
    q = layer["q_rope_mxfp4_quant"].inputs
    qo = aiter.q_rope_mxfp4_quant(q["q"], q["positions"], q["cos_sin_cache"], q["weights"],
                                  weights_scale=layer["q_rope_mxfp4_quant"].scalars["weights_scale"])
    return out, a["kv_cache"], qo


def _bits(t):
    return t.contiguous().view(torch.uint8)


def test_selection():
    s = Selection("0-3,300")
    assert [n in s for n in (0, 3, 4, 299, 300, None)] == [True, True, False, False, True, False]
    assert 10 ** 6 in Selection("all") and None in Selection("ALL")
    for bad in ("1-", "a", "3-1", "1,,2"):
        with pytest.raises(ValueError, match="selection"):
            Selection(bad)


def test_install_is_a_no_op_without_the_env(monkeypatch, fakes):
    aiter, _, targets, _ = fakes
    monkeypatch.delenv("MXVAL_CAPTURE_DIR")
    assert install(targets, quiet=True) == []
    assert aiter.k_norm_rope_mxfp4_cache is fake_k_writer


def test_capture_writes_replayable_dumps_without_changing_results(fakes):
    aiter, vllm, targets, out_dir = fakes
    layer = make_layer(4)
    plain = _run_step(aiter, vllm, layer)
    assert install(targets, quiet=True, rebind_prefixes=("fake_",)) == ["fake_aiter_ops.k_norm_rope_mxfp4_cache",
                                            "fake_aiter_ops.q_rope_mxfp4_quant",
                                            "fake_vllm_indexer._compress_pool_kernel"]
    assert vllm.k_store is not fake_k_writer          # rebound where it had been imported by name
    set_context(layer=12, step=0)
    wrapped = _run_step(aiter, vllm, layer)
    for a, b in zip((plain[0], plain[1], *plain[2]), (wrapped[0], wrapped[1], *wrapped[2])):
        assert torch.equal(_bits(a), _bits(b))      # the op computes exactly the same
    set_context(layer=13, step=0)                    # not a chosen layer: nothing recorded
    _run_step(aiter, vllm, layer)
    set_context(layer=20, step=2)                    # not a chosen step
    _run_step(aiter, vllm, layer)
    set_context(layer=20, step=300)
    _run_step(aiter, vllm, layer)
    paths = capture.flush()
    assert [p.rsplit("/", 1)[1] for p in capture.written()] == ["layer12_step0.safetensors",
                                                                "layer20_step300.safetensors"]
    assert paths == capture.written()[1:]
    d = read_dump(capture.written()[0])
    assert (d.meta["layer"], d.meta["step"]) == (12, 0)
    assert set(d.ops) == {"compress_pool", "k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant"}
    k = d.ops["k_norm_rope_mxfp4_cache"]
    rec = layer["k_norm_rope_mxfp4_cache"]
    assert torch.equal(k.inputs["kv_cache"], rec.inputs["kv_cache"])        # the pool BEFORE the call
    assert torch.equal(k.outputs["kv_cache"], rec.outputs["kv_cache"])      # and AFTER it
    assert k.scalars == {"norm_eps": 1e-6, "compress_ratio": 4, "page_size": 64, "shuffle": [32, 16, 2]}
    assert d.ops["compress_pool"].outputs["pooled"].shape == (40, 128)     # the scratch cut to T
    for r in replay_dump(d):
        assert r.ok(EXACT), r.summary(EXACT)
        assert r.op != "compress_pool" or r.metrics["pooled_rows_compared"] == 10


def test_capture_failure_never_reaches_the_op(fakes):
    aiter, _, _, out_dir = fakes
    layer = make_layer(5)
    broken = ArgMap({"k": lambda b: b["no_such_argument"]}, {})
    install([Target("fake_aiter_ops", "k_norm_rope_mxfp4_cache", "k_norm_rope_mxfp4_cache", broken)], quiet=True)
    set_context(layer=12, step=1)
    r, a = _k_args(layer)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        aiter.k_norm_rope_mxfp4_cache(a["k"], a["positions"], a["cos_sin_cache"], a["norm_weight"], 1e-6,
                                      a["kv_cache"], a["slot_mapping"], 4, (32, 16, 2))
    assert any("cannot read the call's inputs" in str(x.message) for x in w)
    assert torch.equal(a["kv_cache"].view(3, -1), r.outputs["kv_cache"])
    assert capture.flush() == []


def test_op_exceptions_propagate_unchanged(fakes, monkeypatch):
    def failing(k, positions, cos_sin_cache, norm_weight, norm_eps, kv_cache, slot_mapping,
                compress_ratio=1, shuffle=None):
        raise RuntimeError("kernel says no")
    aiter = fakes[0]
    monkeypatch.setattr(aiter, "k_norm_rope_mxfp4_cache", failing)
    install([Target("fake_aiter_ops", "k_norm_rope_mxfp4_cache", "k_norm_rope_mxfp4_cache", AITER_K_WRITER)],
            quiet=True)
    set_context(layer=12, step=0)
    r, a = _k_args(make_layer(6))
    with pytest.raises(RuntimeError, match="kernel says no"):
        aiter.k_norm_rope_mxfp4_cache(a["k"], a["positions"], a["cos_sin_cache"], a["norm_weight"], 1e-6,
                                      a["kv_cache"], a["slot_mapping"])


def test_auto_layer_counting(fakes, monkeypatch):
    aiter, vllm, targets, _ = fakes
    monkeypatch.setenv("MXVAL_CAPTURE_AUTO_LAYERS", "2")
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "1")
    monkeypatch.setenv("MXVAL_CAPTURE_STEPS", "1")
    install(targets, quiet=True)
    layer = make_layer(7)
    for _ in range(5):                                # anchor calls 0..4: (0,0) (1,0) (0,1) (1,1) (0,2)
        _run_step(aiter, vllm, layer)
    assert capture.context() == (0, 2)
    capture.flush()
    assert [p.rsplit("/", 1)[1] for p in capture.written()] == ["layer1_step1.safetensors"]


def test_wrap_generic_function_with_out_argument(fakes, monkeypatch):
    """wrap() on any callable: an out-argument is captured before and after the call."""
    calls = []

    def topk_into(logits, lengths, k, out):
        calls.append(1)
        out.copy_(reference.OPS["topk"](logits=logits, lengths=lengths, k=k)["indices"])
        return None

    rec = make_layer(8)["topk"]
    amap = ArgMap({"logits": "logits", "lengths": "lengths"}, {"indices": "out"}, {"k": "k"})
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "all")
    install([], quiet=True)
    w = wrap(topk_into, "topk", amap)
    set_context(layer=0, step=0)
    out = torch.full_like(rec.outputs["indices"], 99)
    assert w(rec.inputs["logits"], rec.inputs["lengths"], rec.scalars["k"], out) is None
    assert calls == [1] and torch.equal(out, rec.outputs["indices"])
    (p,) = capture.flush()
    assert torch.equal(read_dump(p).ops["topk"].outputs["indices"], rec.outputs["indices"])
