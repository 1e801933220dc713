"""The capture hook, on the table-built fakes of tests/fake_upstream.py, driven the way vLLM
0.33.0 (and the 8e4f5df9 layout) calls them: through module attributes, the K writer and
Q quant through vLLM's cached look-up, the scorer through `_aiter()`."""
from __future__ import annotations

import warnings

import fake_upstream as fk
import pytest
import torch
from helpers import FakeGraph, emit, fake_graphs, make_layer

import reference
from harness import capture
from harness.capture import (
    AITER_K_WRITER,
    AITER_Q_QUANT,
    VLLM_COMPRESS_POOL,
    VLLM_COMPRESS_POOL_KERNEL,
    ArgMap,
    Selection,
    Target,
    hook,
    install,
    set_context,
    uninstall,
    wrap,
)
from harness.io.dumps import read_dump
from harness.run.replay import replay_dump
from optimized import upstream

V033, V8E4F, ROW_ENDS, CU_ENDS = "vllm==0.33.0", "vllm@8e4f5df9", "aiter:row_ends", "aiter:cu_ends"
EXACT = {"page_bytes_mismatched": 0, "page_bytes_outside_owned_changed": 0, "pooled_max_ulp": 0,
         "q_bytes_mismatched": 0, "q_scale_bytes_mismatched": 0, "weights_max_ulp": 0, "logits_diff": 1e-12,
         "logits_nonfinite": 0, "topk_below_threshold": 0, "topk_padding_errors": 0, "topk_duplicates": 0,
         "topk_out_of_range": 0}
ALL_OPS = {"compress_pool", "k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"}
FUSED_OPS = {"compress_norm_rope_mxfp4_cache", "compress_norm_rope_fp8_cache"}
HEADS = 32                                   # [32, 16, 2] pages are what aiter reads for 32 heads


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("MXVAL_CAPTURE_DIR", str(tmp_path / "dumps"))
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "12,20")
    monkeypatch.setenv("MXVAL_CAPTURE_STEPS", "0-1,300")
    for name in ("RANK", "LOCAL_RANK", "MXVAL_CAPTURE_AUTO_LAYERS", "MXVAL_CAPTURE_RING", "MXVAL_CAPTURE_ANCHOR"):
        monkeypatch.delenv(name, raising=False)
    yield tmp_path / "dumps"
    uninstall()


@pytest.fixture(scope="module")
def layer():
    return make_layer(4, heads=HEADS)


def _mod(key):
    import sys
    return sys.modules[upstream.target(key).module]


def vllm_step(layer, *, layout=V033, candidate_write=False):
    """One indexer layer step as vLLM runs it; returns every output (to compare bits)."""
    ops = _mod("vllm.ops.k_store")
    p = layer["compress_pool"].inputs
    sc, t, d = p["state_cache"], p["positions"].numel(), 128
    pooled_k = torch.full((t + 5, d), 7.0, dtype=torch.bfloat16)[:t]     # the persistent scratch
    if layout == V033:
        _mod("vllm.rocm.compress_pool").compress_pool(sc, p["req_index"], p["positions"], p["kv_slot_mapping"],
                                                      p["block_table"], sc.shape[1], pooled_k, 2 * d, 4, True)
    else:
        _mod("vllm.rocm.compress_pool@8e4f5df9")._compress_pool_kernel[(t,)](
            sc, sc.stride(0), sc.stride(1), p["req_index"], p["positions"], p["kv_slot_mapping"], p["block_table"],
            p["block_table"].stride(0), sc.shape[1], pooled_k, pooled_k.stride(0),
            HEAD_SIZE=d, STATE_WIDTH=2 * d, COMPRESS_RATIO=4, OVERLAP=True, num_warps=1)
    k = layer["k_norm_rope_mxfp4_cache"]
    kv = k.inputs["kv_cache"].clone().view(3, 64, 68)                  # vLLM's [pages, entries, bytes]
    ops.rocm_mxfp4_indexer_k_store(k.inputs["k"], k.inputs["positions"], k.inputs["cos_sin_cache"],
                                   k.inputs["norm_weight"], 1e-6, kv, k.inputs["slot_mapping"], 4, True,
                                   num_heads=HEADS)
    q = layer["q_rope_mxfp4_quant"]
    (q_fp4, q_scale), w = ops.rocm_mxfp4_indexer_q_quant(q.inputs["positions"], q.inputs["q"],
                                                         q.inputs["cos_sin_cache"], q.inputs["weights"],
                                                         q.scalars["weights_scale"], 1.0)
    s = layer["paged_mxfp4_mqa_logits"].inputs
    rows, width = q_fp4.shape[0], layer["paged_mxfp4_mqa_logits"].outputs["logits"].shape[1]
    qs = q_scale.view(torch.uint8).view(rows, HEADS, -1)                # as vLLM's _layer views it
    pages = torch.as_strided(kv, (3, 64, 1, 68), (kv.stride(0), 68, 68, 1))
    logits = torch.empty(rows, width)
    i32 = lambda x: x.to(torch.int32)
    extra, scores = {}, None
    if candidate_write:
        scores = torch.empty(rows, -(-width // 8))
        extra = dict(calc_block_scores=True, block_scores=scores, candidate_block_size=8)
    if layout == V033:                                                   # one varlen prefill launch
        ops._aiter().paged_mxfp4_mqa_logits(q_fp4, qs, pages, w, i32(s["context_lens"]), s["block_table"], width,
                                            out_logits=logits, clean_logits=False, row_ends=i32(s["row_ends"]),
                                            query_start_loc=i32(s["query_start_loc"]), **extra)
    else:                                                                # [B, next_n, H, D/2] with cu_ends
        ops._aiter().paged_mxfp4_mqa_logits(q_fp4.unsqueeze(0), qs.unsqueeze(0), pages, w, i32(s["context_lens"]),
                                            s["block_table"], width, out_logits=logits, clean_logits=False,
                                            cu_ends=i32(s["row_ends"]))
    kk = layer["topk"].scalars["k"]
    buf = torch.full((rows, kk + 3), -1, dtype=torch.int32)              # vLLM's top-k buffer, cleared
    if candidate_write:
        cands = torch.full((rows, 4), -1, dtype=torch.int32)
        ends = (i32(s["row_ends"]) + 7) // 8
        ops._topk(scores, ends, cands, cands.shape[1])
    if layout == V033:
        ops._topk(logits, i32(s["row_ends"]), buf[:, :kk], kk)
    else:
        fk._load("aiter.topk")(logits, 1, i32(s["row_ends"]), buf[:, :kk], rows, logits.stride(0), 1, kk)
    valid = torch.arange(width)[None] < s["row_ends"][:, None]
    return pooled_k, kv, q_fp4, q_scale, w, logits[valid], buf


def gather_step(layer):
    """A DeepSeek-V4.1 candidate consumer: the gather launch over candidate slots, then
    top-k over its compact logits."""
    ops = _mod("vllm.ops.k_store")
    s = layer["paged_mxfp4_mqa_logits"]
    rows = s.inputs["q_fp4"].shape[0]
    kv = layer["k_norm_rope_mxfp4_cache"].outputs["kv_cache"].clone().view(3, 64, 1, 68)
    compact, slot_ends = torch.empty(rows, 32), torch.full((rows,), 20, dtype=torch.int32)
    ops._aiter().paged_mxfp4_mqa_logits(s.inputs["q_fp4"].unsqueeze(0), s.inputs["q_scale"].unsqueeze(0), kv,
                                        s.inputs["weights"], slot_ends[:1], s.inputs["block_table"], 32,
                                        out_logits=compact, clean_logits=False, row_ends=slot_ends,
                                        use_gather=True, candidates={"slots": None})
    compact[:, :20] = torch.randn(rows, 20)
    out = torch.full((rows, 8), -1, dtype=torch.int32)
    ops._topk(compact, slot_ends, out, 8)
    return compact, out


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same(a, b):
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _replays_exactly(path):
    d = read_dump(path)
    for r in replay_dump(d):
        assert r.ok(EXACT), r.summary(EXACT)
    return d


# --- selections and switches --------------------------------------------------------------------

def test_selection():
    s = Selection("0-3,300")
    assert [n in s for n in (0, 3, 4, 299, 300, None)] == [True, True, False, False, True, False]
    assert 10 ** 6 in Selection("all") and None in Selection("ALL")
    for bad in ("1-", "a", "3-1", "1,,2"):
        with pytest.raises(ValueError, match="selection"):
            Selection(bad)


def test_install_is_a_no_op_without_the_env(monkeypatch, env):
    fk.install(monkeypatch, V033, ROW_ENDS)
    monkeypatch.delenv("MXVAL_CAPTURE_DIR")
    assert install(quiet=True) == []
    assert _mod("aiter.k_writer").k_norm_rope_mxfp4_cache is fk.k_norm_rope_mxfp4_cache


def test_targets_come_from_the_upstream_table():
    for hk, alts in zip(capture.HOOKS, capture.TARGETS):
        want = [(m, upstream.target(k).name) for k, _ in hk.maps for m in upstream.target(k).modules]
        assert [(t.module, t.attr) for t in alts] == want and {t.op for t in alts} == {hk.op}
    assert {h.op for h in capture.HOOKS} == ALL_OPS | FUSED_OPS


# --- vLLM 0.33.0 ------------------------------------------------------------------------------

def test_capture_on_vllm_033_records_every_op_without_changing_results(monkeypatch, env, layer):
    fk.install(monkeypatch, V033, ROW_ENDS)
    plain = vllm_step(layer)
    assert sorted(install(quiet=True)) == sorted(
        f"{upstream.target(k).module}.{upstream.target(k).name}"
        for k in ("vllm.rocm.compress_pool", "aiter.k_writer", "aiter.q_quant", "aiter.scorer", "vllm.ops.topk"))
    set_context(layer=12, step=0)
    assert _same(plain, vllm_step(layer))                  # the ops compute exactly the same
    set_context(layer=13, step=0)                          # not a chosen layer: nothing recorded
    vllm_step(layer)
    set_context(layer=20, step=300)
    vllm_step(layer)
    capture.flush()
    assert [p.rsplit("/", 1)[1] for p in capture.written()] == ["layer12_step0.safetensors",
                                                                "layer20_step300.safetensors"]
    d = _replays_exactly(capture.written()[0])
    assert set(d.ops) == ALL_OPS
    k, rec = d.ops["k_norm_rope_mxfp4_cache"], layer["k_norm_rope_mxfp4_cache"]
    assert torch.equal(k.inputs["kv_cache"], rec.inputs["kv_cache"])        # the pool BEFORE the call
    assert torch.equal(k.outputs["kv_cache"], rec.outputs["kv_cache"])      # and AFTER it
    assert k.scalars == {"norm_eps": 1e-6, "compress_ratio": 4, "page_size": 64, "shuffle": [32, 16, 2]}
    assert d.ops["compress_pool"].outputs["pooled"].shape == (40, 128)     # the scratch's T rows
    q_scale = d.ops["q_rope_mxfp4_quant"].outputs["q_scale"]            # aiter's bytes, not vLLM's int32
    assert q_scale.dtype == torch.uint8 and torch.equal(q_scale, layer["q_rope_mxfp4_quant"].outputs["q_scale"])
    assert torch.equal(d.ops["paged_mxfp4_mqa_logits"].inputs["row_ends"], layer["paged_mxfp4_mqa_logits"].inputs["row_ends"].int())
    assert d.ops["topk"].scalars == {"k": layer["topk"].scalars["k"]}


def test_the_dispatcher_keeps_its_attributes_when_wrapped(monkeypatch, env):
    fk.install(monkeypatch, V033, ROW_ENDS)
    install(quiet=True)
    pool = _mod("vllm.rocm.compress_pool").compress_pool
    assert pool is not fk.POOL_DISPATCHER and pool.__wrapped__ is fk.POOL_DISPATCHER
    pool.register_warmup(head_dim=128, state_width=256, compress_ratio=4, overlap=True)   # at model init
    assert fk.POOL_DISPATCHER.warmups == [dict(head_dim=128, state_width=256, compress_ratio=4, overlap=True)]
    assert pool.kernel is fk.POOL_KERNEL_033 and pool.arg_names == fk.POOL_KERNEL_033.arg_names
    assert pool.__name__ == "compress_pool" and callable(pool[(1,)])
    cached = wrap(fk._aiter_topk, "topk", ArgMap({}, {}))
    cached.cache_clear()                                   # a functools cache stays one


def test_capture_installed_after_the_first_call(monkeypatch, env, layer):
    """vLLM fetches aiter's K writer and Q quant once, through a functools cache."""
    fk.install(monkeypatch, V033, ROW_ENDS)
    vllm_step(layer)                                       # the cache now holds the originals
    install(quiet=True)
    set_context(layer=12, step=1)
    vllm_step(layer)
    (path,) = capture.flush()
    assert set(_replays_exactly(path).ops) == ALL_OPS
    uninstall()
    assert fk._aiter_indexer_cache_ops()[0] is fk.k_norm_rope_mxfp4_cache     # restored, cache cleared


def test_v41_block_score_and_gather_calls_are_not_mislabelled(monkeypatch, env, layer):
    fk.install(monkeypatch, V033, ROW_ENDS)
    install(quiet=True)
    set_context(layer=12, step=0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = vllm_step(layer, candidate_write=True)       # the candidate source: logits + block scores
        set_context(layer=20, step=0)
        compact, idx = gather_step(layer)                  # a candidate consumer
        capture.flush()
    said = " ".join(str(x.message) for x in w)
    assert "top-k over block scores" in said and "candidate gather launch (use_gather" in said
    src, consumer = (read_dump(p) for p in capture.written())
    assert set(src.ops) == ALL_OPS
    assert torch.equal(src.ops["topk"].outputs["indices"], out[-1][:, :layer["topk"].scalars["k"]])
    assert src.ops["topk"].inputs["logits"].shape[1] == layer["paged_mxfp4_mqa_logits"].outputs["logits"].shape[1]
    assert set(consumer.ops) == {"topk"}                   # the gather's scores are not the scorer's
    assert torch.equal(consumer.ops["topk"].inputs["logits"][:, :20], compact[:, :20])
    _replays_exactly(capture.written()[0])


def test_pooling_without_overlap_is_passed_through():
    assert VLLM_COMPRESS_POOL.classify({"compress_ratio": 128, "overlap": False})
    assert VLLM_COMPRESS_POOL.classify({"compress_ratio": 4, "overlap": True}) is None


# --- the 8e4f5df9 layout with the cu_ends aiter ----------------------------------------------------

def test_capture_on_the_8e4f5df9_layout(monkeypatch, env, layer):
    fk.install(monkeypatch, V8E4F, CU_ENDS)
    plain = vllm_step(layer, layout=V8E4F)
    done = install(quiet=True)
    assert f"{upstream.target('vllm.rocm.compress_pool@8e4f5df9').module}._compress_pool_kernel" in done
    assert f"{upstream.target('aiter.topk').module}.top_k_per_row_decode" in done     # no vLLM _topk here
    set_context(layer=12, step=0)
    assert _same(plain, vllm_step(layer, layout=V8E4F))
    (path,) = capture.flush()
    d = _replays_exactly(path)
    assert set(d.ops) == ALL_OPS
    # batched [B, next_n, H, D/2] with cu_ends: the rows' bounds are cu_ends, not the context
    assert torch.equal(d.ops["paged_mxfp4_mqa_logits"].inputs["row_ends"],
                       layer["paged_mxfp4_mqa_logits"].inputs["row_ends"].int())


# --- the wrapper itself --------------------------------------------------------------------------

def test_capture_failure_never_reaches_the_op(monkeypatch, env, layer):
    fk.install(monkeypatch, V033, ROW_ENDS)
    broken = ArgMap({"k": lambda b: b["no_such_argument"]}, {})
    t = upstream.target("aiter.k_writer")
    install([Target(t.module, t.name, "k_norm_rope_mxfp4_cache", broken)], quiet=True)
    set_context(layer=12, step=1)
    r = layer["k_norm_rope_mxfp4_cache"]
    kv = r.inputs["kv_cache"].clone().view(3, 64, 1, 68)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _mod("aiter.k_writer").k_norm_rope_mxfp4_cache(r.inputs["k"], r.inputs["positions"], r.inputs["cos_sin_cache"],
                                                       r.inputs["norm_weight"], 1e-6, kv, r.inputs["slot_mapping"],
                                                       4, (32, 16, 2))
    assert any("cannot read the call's inputs" in str(x.message) for x in w)
    assert torch.equal(kv.view(3, -1), r.outputs["kv_cache"])
    assert capture.flush() == []


def test_op_exceptions_propagate_unchanged(monkeypatch, env, layer):
    def failing(k, positions, cos_sin_cache, norm_weight, norm_eps, kv_cache, slot_mapping,
                compress_ratio=1, shuffle=None):
        raise RuntimeError("kernel says no")
    fk.install(monkeypatch, V033, ROW_ENDS)
    m = _mod("aiter.k_writer")
    monkeypatch.setattr(m, "k_norm_rope_mxfp4_cache", failing)
    install([Target(m.__name__, "k_norm_rope_mxfp4_cache", "k_norm_rope_mxfp4_cache", AITER_K_WRITER)], quiet=True)
    set_context(layer=12, step=0)
    r = layer["k_norm_rope_mxfp4_cache"]
    with pytest.raises(RuntimeError, match="kernel says no"):
        m.k_norm_rope_mxfp4_cache(r.inputs["k"], r.inputs["positions"], r.inputs["cos_sin_cache"],
                                  r.inputs["norm_weight"], 1e-6, r.inputs["kv_cache"].view(3, 64, 1, 68),
                                  r.inputs["slot_mapping"])


def test_auto_layer_counting(monkeypatch, env, layer):
    monkeypatch.setenv("MXVAL_CAPTURE_AUTO_LAYERS", "2")
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "1")
    monkeypatch.setenv("MXVAL_CAPTURE_STEPS", "1")
    fk.install(monkeypatch, V033, ROW_ENDS)
    install(quiet=True)
    for _ in range(5):                                # anchor calls 0..4: (0,0) (1,0) (0,1) (1,1) (0,2)
        vllm_step(layer)
    assert capture.context() == (0, 2)
    capture.flush()
    assert [p.rsplit("/", 1)[1] for p in capture.written()] == ["layer1_step1.safetensors"]


def test_auto_layer_counting_over_many_steps(monkeypatch, env, layer):
    """Anchor calls of layers not chosen, and of chosen layers on steps not chosen, take the
    idle path (`_idle_anchor`); the count, the context and the chosen (layer, step)s are
    those of the full path, steps past the first few included."""
    monkeypatch.setenv("MXVAL_CAPTURE_AUTO_LAYERS", "3")
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "1")
    monkeypatch.setenv("MXVAL_CAPTURE_STEPS", "3,5")
    fk.install(monkeypatch, V033, ROW_ENDS)
    install(quiet=True)
    for call in range(3 * 7 + 2):                     # 23 anchor calls: the last at (1, 7)
        vllm_step(layer)
        assert capture.context() == (call % 3, call // 3)
    capture.flush()
    assert [p.rsplit("/", 1)[1] for p in capture.written()] == ["layer1_step3.safetensors", "layer1_step5.safetensors"]


def test_custom_targets_and_the_kernel_launch_map(monkeypatch, env, layer):
    """install() takes Targets of the caller's own; a Triton launch records with its map."""
    fk.install(monkeypatch, V8E4F, CU_ENDS)
    t = upstream.target("vllm.rocm.compress_pool@8e4f5df9")
    q = upstream.target("aiter.q_quant")
    assert install([Target(t.module, t.name, "compress_pool", VLLM_COMPRESS_POOL_KERNEL, launcher=True),
                    Target(q.module, q.name, "q_rope_mxfp4_quant", AITER_Q_QUANT),
                    Target("no_such_module_xyz", "op", "topk", ArgMap({}, {}))], quiet=True) == [
        f"{t.module}.{t.name}", f"{q.module}.{q.name}"]
    set_context(layer=12, step=0)
    vllm_step(layer, layout=V8E4F)
    (path,) = capture.flush()
    assert set(_replays_exactly(path).ops) == {"compress_pool", "q_rope_mxfp4_quant"}


def test_wrap_generic_function_with_out_argument(monkeypatch, env):
    """wrap() on any callable: an out-argument is captured before and after the call."""
    calls = []

    def topk_into(logits, lengths, k, out):
        calls.append(1)
        out.copy_(reference.OPS["topk"].fn(logits=logits, lengths=lengths, k=k)["indices"])
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


# --- vLLM's CUDA path: the fused K kernels -------------------------------------------------------

def fused_launch(fmt, *, seed=0, tokens=40, page_size=16, mx_scale=False, pad_token=None):
    """One launch of vLLM's fused K kernel as its launcher makes it; -> (kwargs, pool)."""
    from helpers import pool_case

    from reference import fp8 as ref_fp8
    from reference import layout, rope
    kw = pool_case(seed=seed, tokens=tokens)
    g = torch.Generator().manual_seed(seed + 7)
    d = 128
    entry = layout.entry_bytes(d) if fmt == "mxfp4" else ref_fp8.entry_bytes(d)
    pages = -(-tokens // page_size) + 1
    kv = torch.randint(0, 256, (pages, page_size, entry), dtype=torch.uint8, generator=g)   # vLLM's pages
    sc, bt, cs = kw["state_cache"], kw["block_table"], rope.cos_sin_cache(64, 64, 160000.0)
    state_slots = torch.arange(tokens)
    if pad_token is not None:
        state_slots[pad_token] = -1                            # a padding token: writes nothing
    args = (sc, sc.stride(0), sc.stride(1), kw["req_index"], kw["positions"], state_slots, bt, bt.stride(0),
            sc.shape[1], (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16), 1e-6, cs, cs.stride(0), kv,
            kw["kv_slot_mapping"], page_size)
    consts = dict(HEAD_SIZE=d, TRITON_BLOCK_SIZE=d, STATE_WIDTH=2 * d, COMPRESS_RATIO=4, OVERLAP=True,
                  ROPE_HEAD_DIM=64, FP8_MAX=448.0, QUANT_BLOCK=32 if fmt == "mxfp4" else d,
                  TOKEN_STRIDE=d // 2 if fmt == "mxfp4" else d, SCALE_DIM=d // 32 if fmt == "mxfp4" else 4,
                  KV_BLOCK_STRIDE=kv.stride(0), MX_SCALE=mx_scale)
    return args, consts, kv


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_capture_of_vllm_cuda_fused_k_kernels(monkeypatch, env, fmt):
    fk.install(monkeypatch, V033, ROW_ENDS, fused=True)
    key = f"vllm.cuda.k_{fmt}"
    args, consts, kv = fused_launch(fmt, pad_token=11)
    plain = kv.clone()
    fk._load(key)[(40,)](*args[:13], plain, *args[14:], **consts, num_warps=1)
    assert f"{upstream.target(key).module}.{upstream.target(key).name}" in install(quiet=True)
    kernel = fk._load(key)
    assert kernel.__wrapped__ is fk.FAKES[key] and kernel.arg_names == fk.FAKES[key].arg_names
    set_context(layer=12, step=0)
    before = kv.clone()
    kernel[(40,)](*args, **consts, num_warps=1)
    assert torch.equal(kv, plain)                          # the kernel computes exactly the same
    (path,) = capture.flush()
    d = _replays_exactly(path)
    op = f"compress_norm_rope_{fmt}_cache"
    rec = d.ops[op]
    assert set(d.ops) == {op}
    assert torch.equal(rec.inputs["kv_cache"], before.view(before.shape[0], -1))
    assert torch.equal(rec.outputs["kv_cache"], kv.view(kv.shape[0], -1))
    assert rec.inputs["kv_slot_mapping"][11] == -1 and rec.inputs["kv_slot_mapping"][15] == 15   # padding folded in
    assert rec.scalars["page_size"] == 16 and rec.scalars["compress_ratio"] == 4


def test_fused_launches_that_are_not_the_indexers_pass_through(monkeypatch, env):
    fk.install(monkeypatch, V033, ROW_ENDS, fused=True)
    install(quiet=True)
    set_context(layer=12, step=0)
    args, consts, kv = fused_launch("fp8")
    amap = capture.VLLM_FUSED_K_FP8
    bound = dict(zip(amap.params, args), **consts)
    assert amap.classify(bound) is None
    assert "MX scales" in amap.classify({**bound, "MX_SCALE": True})
    assert "HEAD_SIZE=96" in amap.classify({**bound, "HEAD_SIZE": 96})


# --- under CUDA graphs (the graph faked on the CPU: captured work replays as thunks) ---------------

@pytest.fixture
def graphs(monkeypatch, env):
    fake_graphs(monkeypatch, hook)
    return env


def _topk_op(fault=False):
    """A top-k launch with vLLM's _topk signature that writes `out` in place, as a kernel
    in the graph would (`fault`: row 0's last index replaced by its lowest-scoring entry)."""
    def _topk(logits, lengths, out, k):
        def work():
            idx = reference.topk(logits=logits, lengths=lengths, k=k)["indices"]
            if fault:
                idx[0, -1] = logits[0, :int(lengths[0])].argmin()
            out.copy_(idx)
        emit(work)
    return wrap(_topk, "topk", capture.VLLM_TOPK)


class Model:
    """Two indexer layers of top-k on static input buffers, as a graph-captured forward reads them."""

    def __init__(self, seed=0, layers=2, rows=3, width=40, k=5, fault=False):
        self.g = torch.Generator().manual_seed(seed)
        self.logits = torch.zeros(layers, rows, width)
        self.lengths = torch.zeros(rows, dtype=torch.int32)
        self.out = torch.full((layers, rows, k + 2), -1, dtype=torch.int32)
        self.k, self.topk = k, _topk_op(fault)

    def feed(self):
        """New inputs for the next step (copied into the static buffers); -> them."""
        self.logits.copy_(torch.randn(self.logits.shape, generator=self.g))
        self.lengths.copy_(torch.randint(self.k + 1, self.logits.shape[2] + 1, self.lengths.shape, generator=self.g))
        return self.logits.clone(), self.lengths.clone()

    def forward(self, explicit=False):
        for layer in range(self.logits.shape[0]):
            if explicit:
                set_context(layer=layer, step=capture.context()[1])
            self.topk(self.logits[layer], self.lengths, self.out[layer, :, :self.k], self.k)

    def capture(self, explicit=False):
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        self.forward(explicit)
        assert all(not c.ring_inputs for c in hook._S.capture.calls)    # no ring inside the graph's pool
        g.capture_end()
        return g


def _names(paths):
    return [p.rsplit("/", 1)[1] for p in paths]


def test_graph_replays_record_the_chosen_steps_into_a_ring(monkeypatch, graphs):
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "1")
    monkeypatch.setenv("MXVAL_CAPTURE_STEPS", "1-3,5")
    monkeypatch.setenv("MXVAL_CAPTURE_AUTO_LAYERS", "2")
    monkeypatch.setenv("MXVAL_CAPTURE_ANCHOR", "topk")
    monkeypatch.setenv("MXVAL_CAPTURE_RING", "2")
    install([], quiet=True)
    m = Model()
    m.feed()
    m.forward()                                            # eager warm-up: step 0 (not chosen)
    g = m.capture()
    rec = getattr(g, hook.GRAPH_ATTR)
    assert [(c.op, c.layer) for c in rec.calls] == [("topk", 1)]           # layer 1 only, chosen at capture
    # the graph's memory pool lends a staging buffer's bytes to kernels earlier in the graph:
    # scribbled over at the start of every replay, the staged fields must still come out right
    stages = [t for c in rec.calls for t in (*c.inputs.values(), *c.outputs.values())]
    g.work.insert(0, lambda: [t.fill_(77) for t in stages])
    assert rec.calls[0].inputs["logits"].shape == (3, 40)                  # staged in the graph
    assert rec.calls[0].ring_inputs["logits"].shape == (2, 3, 40)          # the ring, made at capture end
    fed, written_at = {}, []
    for step in range(1, 7):                               # a replay is one forward step
        fed[step] = m.feed()
        g.replay()
        assert torch.equal(m.out[1, :, :m.k], reference.topk(logits=fed[step][0][1], lengths=fed[step][1],
                                                              k=m.k)["indices"])    # the graph's own work ran
        # the recording copies run on chosen replays only (behind the record's device flag)
        assert all(bool((t == 77).all()) for t in stages) == (step not in (1, 2, 3, 5)), step
        written_at.append(_names(capture.written()))
    assert written_at[1] == [] and written_at[2] == ["layer1_step1.safetensors", "layer1_step2.safetensors"]
    assert [e["step"] for e in hook._S.ring] == [3, 5]     # steps 4 and 6 were not copied out
    assert _names(capture.flush()) == ["layer1_step3.safetensors", "layer1_step5.safetensors"]
    for p in capture.written():
        d = _replays_exactly(p)
        logits, lengths = fed[d.meta["step"]]
        assert d.meta["layer"] == 1 and torch.equal(d.ops["topk"].inputs["logits"], logits[1])
        assert torch.equal(d.ops["topk"].inputs["lengths"], lengths)


def test_a_computed_input_field_is_finished_when_the_ring_is_read_not_in_the_graph(monkeypatch, graphs):
    # the pooling's state rows are a cat of two column ranges of vLLM's state pool: under a
    # graph the capture stages the pool itself (its flagged copy), and the cat runs when a
    # sampled replay is read, not at every replay
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.capture.maps import _pool_rows
    d, sw = 128, 256
    state = torch.randn(4, 8, 4 * d + 16)                  # kv at 0, scores at sw, 16 columns past them
    pooled = torch.zeros(4, d, dtype=torch.bfloat16)
    meta = (torch.zeros(4, dtype=torch.int32), torch.arange(4, 8), torch.arange(4), torch.tensor([[0, 1], [2, 3]],
                                                                                                     dtype=torch.int32))

    def pool(state_cache, token_to_req_indices, positions, kv_slot_mapping, block_table, block_size, pooled_k,
             state_width, compress_ratio, overlap):
        emit(lambda: pooled_k.fill_(1))
    pool = wrap(pool, "compress_pool", capture.VLLM_COMPRESS_POOL)
    install(quiet=True)
    done = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            done.append(str(func))
            return func(*args, **(kwargs or {}))
    set_context(layer=12, step=0)
    g = torch.cuda.CUDAGraph()
    g.capture_begin()
    with Spy():
        pool(state, meta[0], meta[1], meta[2], meta[3], 8, pooled, sw, 4, True)
    g.capture_end()
    assert not [f for f in done if "cat" in f or "_to_copy" in f], done        # nothing computed into the graph
    (call,) = getattr(g, hook.GRAPH_ATTR).calls
    assert call.inputs["state_cache"].shape == state.shape                      # the pool, staged as it is
    state.copy_(torch.randn(state.shape))                  # the next step's state, then its replay
    set_context(layer=12, step=1)
    g.replay()
    ins, _, _ = call.at(0)
    assert torch.equal(ins["state_cache"], _pool_rows(state, d, sw))            # finished when read
    assert ins["state_cache"].shape == (4, 8, 4 * d)


def test_graph_capture_with_explicit_context_and_two_graphs_in_one_step(monkeypatch, graphs):
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "0")
    monkeypatch.setenv("MXVAL_CAPTURE_STEPS", "7")
    install([], quiet=True)
    a, b = Model(seed=1), Model(seed=2, layers=1)
    a.feed(), b.feed()
    ga, gb = a.capture(explicit=True), b.capture(explicit=True)
    idle = Model(seed=3)
    set_context(layer=5)                                   # not a chosen layer: nothing recorded
    g_idle = idle.capture()
    assert not hasattr(g_idle, hook.GRAPH_ATTR)
    for step in (6, 7):
        set_context(step=step)
        fa, fb = a.feed(), b.feed()
        ga.replay(), gb.replay(), g_idle.replay()
    paths = capture.drain()
    assert _names(paths) == ["layer0_step7.safetensors", "layer0_step7_1.safetensors"]
    da, db = (read_dump(p) for p in paths)
    assert torch.equal(da.ops["topk"].inputs["logits"], fa[0][0]) and torch.equal(db.ops["topk"].inputs["logits"], fb[0][0])
    assert capture.drain() == []


def test_a_fault_inside_the_graph_is_caught_from_the_dumps(monkeypatch, graphs):
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "all")
    monkeypatch.setenv("MXVAL_CAPTURE_STEPS", "all")
    install([], quiet=True)
    m = Model(fault=True, layers=1, width=64, k=8)
    g = m.capture()
    for _ in range(3):
        m.feed()
        g.replay()
    paths = capture.flush()
    assert _names(paths) == [f"layerx_step{s}.safetensors" for s in range(3)]     # steps number the replays
    for p in paths:
        (r,) = replay_dump(read_dump(p))
        assert not r.ok(EXACT)


def test_uninstall_restores_the_graph_methods(monkeypatch, graphs):
    orig = dict(FakeGraph.__dict__)
    install([], quiet=True)
    assert FakeGraph.replay is not orig["replay"] and FakeGraph.replay.__mxval_capture__ == "replay"
    uninstall()
    assert all(FakeGraph.__dict__[n] is orig[n] for n in ("capture_begin", "capture_end", "replay"))


def test_bad_ring_size_is_refused(monkeypatch, env):
    monkeypatch.setenv("MXVAL_CAPTURE_RING", "0")
    with pytest.raises(ValueError, match="MXVAL_CAPTURE_RING"):
        install([], quiet=True)


def test_graph_methods_a_class_inherits_are_wrapped_and_removed_again(monkeypatch, graphs):
    class Inheriting(FakeGraph):
        pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Inheriting)
    install([], quiet=True)
    assert "replay" in Inheriting.__dict__ and Inheriting.replay.__mxval_capture__ == "replay"
    uninstall()
    assert not {"capture_begin", "capture_end", "replay"} & set(Inheriting.__dict__)


def test_calls_that_cannot_be_recorded_pass_straight_through(monkeypatch, env):
    """Installed but idle, a wrapper looks at nothing: not even the arguments' binding."""
    seen = []
    amap = ArgMap({"x": lambda b: seen.append("read") or b["x"]}, {})
    install([], quiet=True)
    w = wrap(lambda x: x, "topk", amap)
    set_context(layer=13, step=0)                  # not a chosen layer
    assert w(1) == 1 and seen == []
    set_context(layer=12, step=0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        w(torch.zeros(1))
    assert seen == ["read"]


def test_capture_on_vllm_034_every_op_and_the_fused_kernels(monkeypatch, env, layer):
    """0.34.0 reaches the ops through the same table entries (its own versions listed there)."""
    v034 = "vllm==0.34.0"
    fk.install(monkeypatch, v034, ROW_ENDS, fused=True)
    plain = vllm_step(layer)
    done = install(quiet=True)
    keys = ("vllm.rocm.compress_pool", "aiter.k_writer", "aiter.q_quant", "aiter.scorer", "vllm.ops.topk",
            "vllm.cuda.k_mxfp4", "vllm.cuda.k_fp8")
    assert all(v034 in upstream.target(k).versions for k in keys if k.startswith("vllm"))
    assert sorted(done) == sorted(f"{upstream.target(k).module}.{upstream.target(k).name}" for k in keys)
    set_context(layer=12, step=0)
    assert _same(plain, vllm_step(layer))
    args, consts, kv = fused_launch("mxfp4")
    fk._load("vllm.cuda.k_mxfp4")[(40,)](*args, **consts, num_warps=1)
    (path,) = capture.flush()
    assert set(_replays_exactly(path).ops) == ALL_OPS | {"compress_norm_rope_mxfp4_cache"}


def test_overhead_table_words_and_the_idle_target():
    """The bench's overhead rows: a slower row says slower, a faster one faster; idle runs
    faster than off by more than the 1 % target leave the target unresolved, never met."""
    from harness.bench.capture import table
    rows = [("eager", "off", 342.6), ("eager", "installed, idle", 435.5),
            ("eager", "recording (1 layer, every step)", 25.9),
            ("graph", "off", 4551.5), ("graph", "installed, idle", 4530.0)]
    text = "\n".join(table(rows, layers=4, batch=32, context=8192))
    assert "| eager | installed, idle | 435.5 | 27.1 % faster |" in text
    assert "| eager | recording (1 layer, every step) | 25.9 | 92.4 % slower |" in text
    assert "* eager, installed but idle: 27.1 % faster (target < 1 % slower: not resolved" in text
    assert "* graph, installed but idle: 0.5 % slower (target < 1 % slower: met)" in text
    slow = [("graph", "off", 100.0), ("graph", "installed, idle", 98.0)]
    assert "2.0 % slower (target < 1 % slower: NOT met)" in "\n".join(table(slow, layers=1, batch=1, context=1))


def test_a_capture_without_a_gpu_loads_no_compiled_kernel(monkeypatch, graphs):
    """The flagged copy is compiled before a capture only where a GPU is: on a host, loading
    it would fix this process's Triton mode as compiled and refuse the interpreter later."""
    import sys
    monkeypatch.delitem(sys.modules, "optimized.triton_kernels.copy_if", raising=False)
    monkeypatch.setattr(hook._S, "kernels", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    install([], quiet=True)
    Model().capture()
    assert "optimized.triton_kernels.copy_if" not in sys.modules
