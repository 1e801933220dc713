"""The aiter and vLLM adapters without the real libraries.

* Unavailability: on this machine each says exactly what is missing, in one line.
* Argument mapping: fake aiter/vLLM modules are injected into sys.modules. Each fake has
  the real function's signature, checks the kinds of its positional arguments (so a
  swapped argument fails) and computes through the reference from what it received,
  the way the real op reads it (page size from the page bytes, layout from the head
  count or the preshuffle flag, row ends from cu_ends). An adapter mapping the dump's
  fields correctly therefore reproduces the reference's outputs exactly.
"""
import sys
import types

import pytest
import torch

import reference
from optimized import BackendUnavailable, OP_NAMES, common, get_backend
from reference import layout, scoring

from test_triton_cases import (compare, k_writer_case, logits_case, pool_case, q_case, topk_case)


# --- unavailability -----------------------------------------------------------------------

@pytest.mark.skipif("aiter" in sys.modules or torch.cuda.is_available(), reason="a CPU-only machine")
@pytest.mark.parametrize("name,missing", [("aiter", ["aiter is not importable"]),
                                          ("vllm", ["vllm is not importable", "aiter is not importable"])])
def test_unavailable_says_what_is_missing(name, missing):
    be = get_backend(name, require=False)
    reason = be.available()
    assert reason and "\n" not in reason
    for m in missing + ["no ROCm GPU"]:
        assert m in reason
    with pytest.raises(BackendUnavailable, match=name):
        get_backend(name)
    with pytest.raises(BackendUnavailable, match="unavailable"):
        be.topk


@pytest.mark.parametrize("hip,avail,arch,want", [
    (None, False, None, "not a ROCm build"),
    ("6.4", False, None, "no ROCm GPU visible"),
    ("6.4", True, "gfx942:sramecc+:xnack-", "the GPU is gfx942:sramecc+:xnack-, not gfx950"),
    ("6.4", True, "gfx950:sramecc+:xnack-", None),
])
def test_platform_reason(monkeypatch, hip, avail, arch, want):
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: avail)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(gcnArchName=arch))
    got = common.rocm_gfx950_reason()
    assert (got is None) if want is None else (want in got)


# --- fakes with the real signatures ---------------------------------------------------------

def _pool2d(kv_cache4d):
    assert kv_cache4d.dim() == 4 and kv_cache4d.shape[2] == 1 and kv_cache4d.dtype == torch.uint8
    return kv_cache4d.view(kv_cache4d.shape[0], -1)          # as aiter does: page_size from the bytes


def _write(k, positions, cos_sin_cache, norm_weight, eps, kv_cache, slot_mapping, ratio, shuffle):
    assert isinstance(eps, float) and isinstance(ratio, int) and k.dtype == torch.bfloat16
    pool = _pool2d(kv_cache)
    out = reference.k_norm_rope_mxfp4_cache(
        k=k, positions=positions, cos_sin_cache=cos_sin_cache, norm_weight=norm_weight, slot_mapping=slot_mapping,
        kv_cache=pool.clone(), norm_eps=eps, compress_ratio=ratio, page_size=kv_cache.shape[1],
        shuffle=list(shuffle) if shuffle else None)["kv_cache"]
    pool.copy_(out)


def fake_k_norm_rope_mxfp4_cache(k, positions, cos_sin_cache, norm_weight, norm_eps, kv_cache, slot_mapping,
                                 compress_ratio=1, shuffle=None):
    _write(k, positions, cos_sin_cache, norm_weight, norm_eps, kv_cache, slot_mapping, compress_ratio, shuffle)


def fake_q_rope_mxfp4_quant(q, positions, cos_sin_cache, weights=None, weights_scale=1.0):
    assert q.dim() == 3 and positions.dim() == 1 and isinstance(weights_scale, float)
    o = reference.q_rope_mxfp4_quant(q=q, positions=positions, cos_sin_cache=cos_sin_cache, weights=weights,
                                     weights_scale=weights_scale)
    return o["q_fp4"], o["q_scale"], o["weights"]


def fake_paged_mxfp4_mqa_logits(q, q_scales, kv_cache, weights, context_lens, block_table, max_model_len,
                                kv_scale_cache=None, out_logits=None, clean_logits=True, preshuffle=1,
                                cu_ends=None, **_):
    b, n, h, tb = q.shape
    assert block_table.dtype == context_lens.dtype == cu_ends.dtype == torch.int32
    assert weights.shape == (b * n, h) and out_logits.shape == (b * n, max_model_len)
    ref = scoring.paged_mxfp4_mqa_logits_fp64(
        q_fp4=q.reshape(b * n, h, tb), q_scale=q_scales.reshape(b * n, h, -1), weights=weights,
        kv_cache=_pool2d(kv_cache), query_start_loc=torch.arange(0, b * n + 1, n), context_lens=context_lens,
        block_table=block_table, row_ends=cu_ends, page_size=kv_cache.shape[1],
        shuffle=layout.choose_shuffle(2 * tb, h) if preshuffle else None, width=max_model_len)
    valid = torch.arange(max_model_len)[None] < cu_ends.long()[:, None]
    out_logits[valid] = ref.float()[valid]
    return out_logits


def fake_top_k_per_row_decode(logits, next_n, seq_lens, indices, num_rows, stride0, stride1, k=2048,
                              stable=False):
    assert next_n == 1 and seq_lens.dtype == torch.int32 and (stride0, stride1) == logits.stride()
    indices.copy_(reference.topk(logits=logits, lengths=seq_lens, k=k)["indices"])


class FakePoolKernel:
    """A @triton.jit object: kernel[grid](*args, **constexprs)."""

    def __getitem__(self, grid):
        def run(state_cache, s0, s1, req, positions, slots, table, table_stride, block_size, out, out_stride,
                HEAD_SIZE, STATE_WIDTH, COMPRESS_RATIO, OVERLAP, num_warps=4):
            assert grid == (positions.shape[0],) and (s0, s1) == state_cache.stride()[:2]
            assert STATE_WIDTH == 2 * HEAD_SIZE and OVERLAP == 1 and block_size == state_cache.shape[1]
            pooled = reference.compress_pool(state_cache=state_cache, block_table=table, positions=positions,
                                             req_index=req, kv_slot_mapping=slots,
                                             compress_ratio=COMPRESS_RATIO)["pooled"]
            rows = ~pooled.isnan().any(1)
            out[rows] = pooled[rows]
        return run


def fake_k_store(k, positions, cos_sin_cache, norm_weight, eps, kv_cache, slot_mapping, compress_ratio,
                 use_fp4_cache, num_heads):
    assert use_fp4_cache is True
    _write(k, positions, cos_sin_cache, norm_weight, eps, kv_cache, slot_mapping, compress_ratio,
           layout.choose_shuffle(k.shape[1], num_heads).as_list())


def fake_q_quant(positions, q, cos_sin_cache, weights, softmax_scale, head_scale):
    q_fp4, q_scale, w = fake_q_rope_mxfp4_quant(q, positions, cos_sin_cache, weights, softmax_scale * head_scale)
    return (q_fp4, q_scale), w


@pytest.fixture
def fake_libs(monkeypatch):
    def module(name, **attrs):
        m = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(m, k, v)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    for name in ("aiter.ops", "aiter.ops.triton", "aiter.ops.triton.fusions", "aiter.ops.triton.rope",
                 "aiter.ops.triton.attention", "vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops",
                 "vllm.models", "vllm.models.deepseek_v4"):
        module(name)
    module("aiter", top_k_per_row_decode=fake_top_k_per_row_decode)
    module("aiter.ops.triton.fusions.k_norm_rope_mxfp4_cache", k_norm_rope_mxfp4_cache=fake_k_norm_rope_mxfp4_cache)
    module("aiter.ops.triton.rope.q_rope_mxfp4_quant", q_rope_mxfp4_quant=fake_q_rope_mxfp4_quant)
    module("aiter.ops.triton.attention.pa_mqa_logits_mxfp4", paged_mxfp4_mqa_logits=fake_paged_mxfp4_mqa_logits)
    module("vllm.v1.attention.ops.rocm_paged_mxfp4_indexer", rocm_mxfp4_indexer_k_store=fake_k_store,
           rocm_mxfp4_indexer_q_quant=fake_q_quant)
    module("vllm.models.deepseek_v4.rocm_mxfp4_indexer", _compress_pool_kernel=FakePoolKernel())
    monkeypatch.setattr(common, "rocm_gfx950_reason", lambda: None)
    for mod in ("optimized.aiter_backend", "optimized.vllm_backend"):
        if mod in sys.modules:
            monkeypatch.setattr(sys.modules[mod], "rocm_gfx950_reason", lambda: None)


def _on_cpu(be):
    """The adapters run on the GPU; the fakes run anywhere, so point the ops at the CPU."""
    from optimized import aiter_backend, vllm_backend
    mod = aiter_backend if be.name == "aiter" else vllm_backend
    fns, missing = common.import_reason(mod.FUNCTIONS if be.name == "aiter" else {
        **vllm_backend.FUNCTIONS, **{k: v for k, v in aiter_backend.FUNCTIONS.items()
                                     if k in ("paged_mxfp4_mqa_logits", "topk")}})
    assert not missing
    if be.name == "vllm":
        fns["pool"] = vllm_backend._find_pool_kernel()[0]
    be.ops = mod.make_ops(fns, device="cpu")
    return be


MAPPED_CASES = [
    ("k-padded-shuffled", "k_norm_rope_mxfp4_cache", lambda: k_writer_case(page_size=32, shuffle=(32, 16, 2))),
    ("k-16lane", "k_norm_rope_mxfp4_cache", lambda: k_writer_case(seed=1, page_size=32, shuffle=(16, 16, 4))),
    ("q", "q_rope_mxfp4_quant", lambda: q_case()),
    ("pool", "compress_pool", lambda: pool_case()),
    ("logits-groups", "paged_mxfp4_mqa_logits",
     lambda: dict(logits_case(heads=16, shuffle=(16, 16, 4), seqs=((2, 40), (2, 50), (3, 60), (1, 0))),
                  clean_logits=True)),
    ("logits-natural", "paged_mxfp4_mqa_logits", lambda: dict(logits_case(heads=16, shuffle=None), clean_logits=False)),
    ("topk", "topk", lambda: topk_case()),
]


# aiter has no pooling op (vLLM's kernel does it): the test below pins who provides what.
MAPPED = [(name, *c) for name in ("aiter", "vllm") for c in MAPPED_CASES
          if not (name == "aiter" and c[1] == "compress_pool")]


@pytest.mark.parametrize("name,case,op,make", MAPPED, ids=[f"{m[0]}-{m[1]}" for m in MAPPED])
def test_mapping_reproduces_the_reference(fake_libs, name, case, op, make):
    be = get_backend(name, require=False)
    assert be.available() is None, be.available()
    be = _on_cpu(be)
    assert be.supports(op)
    kw = make()
    assert compare(op, getattr(be, op)(**kw), kw) == []


def test_vllm_provides_every_mxfp4_op_and_aiter_all_but_pooling(fake_libs):
    a, v = (_on_cpu(get_backend(n, require=False)) for n in ("aiter", "vllm"))
    mx = [op for op in OP_NAMES if "fp8" not in op]
    assert [op for op in mx if not a.supports(op)] == ["compress_pool"]
    assert all(v.supports(op) for op in mx)


def test_adapters_refuse_what_the_real_ops_do_not_do(fake_libs):
    a, v = (_on_cpu(get_backend(n, require=False)) for n in ("aiter", "vllm"))
    with pytest.raises(ValueError, match="rounding"):
        a.k_norm_rope_mxfp4_cache(**k_writer_case(), rounding="cuda")
    with pytest.raises(ValueError, match="scale_rule"):
        a.q_rope_mxfp4_quant(**q_case(), scale_rule="ocp-floor")
    with pytest.raises(ValueError, match="shuffle"):
        v.k_norm_rope_mxfp4_cache(**k_writer_case(shuffle=None))
    with pytest.raises(ValueError, match="shuffle: aiter's scorer reads"):
        a.paged_mxfp4_mqa_logits(**logits_case(heads=16, shuffle=(32, 16, 2)))
    with pytest.raises(ValueError, match="rounding"):
        v.compress_pool(**pool_case(), rounding="cuda")


def test_a_swapped_argument_is_caught(fake_libs):
    """The fakes check what they receive: the mapping tests above have teeth."""
    kw = k_writer_case()
    with pytest.raises(AssertionError):
        fake_k_norm_rope_mxfp4_cache(kw["k"], kw["positions"], kw["cos_sin_cache"], kw["norm_weight"],
                                     common.paged_view(kw["kv_cache"].clone(), 32, 68), 1e-6,
                                     kw["slot_mapping"], 4, (32, 16, 2))
    # and a wrong head-count mapping gives different pages than the reference
    out = kw["kv_cache"].clone()
    fake_k_store(kw["k"], kw["positions"], kw["cos_sin_cache"], kw["norm_weight"], 1e-6,
                 common.paged_view(out, 32, 68), kw["slot_mapping"], 4, True, num_heads=16)
    assert compare("k_norm_rope_mxfp4_cache", {"kv_cache": out}, kw)
