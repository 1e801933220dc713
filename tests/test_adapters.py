"""The aiter and vLLM adapters without the real libraries.

* Unavailability: on this machine each says exactly what is missing, in one line.
* Argument mapping: the fakes of tests/fake_upstream.py are installed at the module paths
  of optimized.upstream, for the upstream versions a test names. They have the table's
  signatures and return conventions (checked below, by the same comparison `mxval
  upstream check` makes against real sources), check what they receive and compute
  through the reference, so an adapter that maps the dump's fields correctly reproduces
  the reference's outputs exactly.
"""
import inspect
import sys
import types

import fake_upstream as fk
import pytest
import torch
from helpers import compare, k_writer_case, logits_case, pool_case, q_case, topk_case

from harness.commands.upstream_cmd import check_definition
from optimized import OP_NAMES, BackendUnavailable, aiter_backend, common, get_backend, upstream, vllm_backend
from reference import layout

tl = fk.tl
V033, V8E4F, ROW_ENDS, CU_ENDS = "vllm==0.33.0", "vllm@8e4f5df9", "aiter:row_ends", "aiter:cu_ends"


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


# --- the fakes against the table -------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(fk.FAKES))
def test_every_fake_matches_its_table_entry(key):
    c = check_definition(upstream.target(key), fk.source_of(fk.FAKES[key]))
    assert c.ok, (key, c.params, c.returns)


def test_every_target_the_adapters_and_the_hook_use_has_a_fake():
    from harness import capture
    used = set(aiter_backend.FUNCTIONS.values()) | set(vllm_backend.FUNCTIONS.values())
    used |= {k for h in capture.HOOKS for k, _ in h.maps} | set(capture.CACHED_LOOKUPS)
    keys = {t.key for k in used for t in upstream.group(k)}
    assert keys <= set(fk.FAKES), keys - set(fk.FAKES)


def test_a_fake_that_disagrees_with_the_table_is_caught():
    """The comparison has teeth: a retired keyword, a moved parameter, a u8 scale, a kernel
    whose constexpr became a runtime argument."""
    def scorer(q, q_scales, kv_cache, weights, context_lens, block_table, max_model_len, out_logits=None,
               clean_logits=True, preshuffle=1, cu_ends=None, **_) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        pass
    c = check_definition(upstream.target("aiter.scorer"), scorer)
    assert "no parameter row_ends (it would land in **kwargs)" in c.params

    def k_store(positions, k_pre, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache, kv_slot_mapping,
                compress_ratio, use_fp4_cache, num_heads) -> None:
        pass
    c = check_definition(upstream.target("vllm.ops.k_store"), k_store)
    assert any("k_pre is at position 1" in p for p in c.params)

    def q_quant(positions, index_q, index_q_cos_sin_cache, index_weights, index_weights_softmax_scale,
                index_weights_head_scale) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        q_packed, q_scale, w = fk.q_rope_mxfp4_quant(index_q, positions, index_q_cos_sin_cache, index_weights)
        return (q_packed, q_scale), w
    c = check_definition(upstream.target("vllm.ops.q_quant"), q_quant)
    assert c.returns == ["no `q_scale.view(torch.int32).squeeze(-1)` in its body"]

    def kernel(state_cache_ptr, state_cache_stride0, state_cache_stride1, token_to_req_indices_ptr, positions_ptr,
               kv_slot_mapping_ptr, block_table_ptr, block_table_stride, block_size, pooled_k_ptr, pooled_k_stride,
               HEAD_SIZE: tl.constexpr, STATE_WIDTH, COMPRESS_RATIO: tl.constexpr, OVERLAP: tl.constexpr):
        pass
    c = check_definition(upstream.target("vllm.rocm.compress_pool_kernel"), kernel)
    assert c.params == ["STATE_WIDTH is not a constexpr upstream"]


# --- the adapters on the fakes ------------------------------------------------------------------

@pytest.fixture
def cpu_backend(monkeypatch):
    """`make(name, *versions)`: the backend over fakes of those upstream versions, on the CPU."""
    monkeypatch.setattr(common, "rocm_gfx950_reason", lambda: None)
    for mod in (aiter_backend, vllm_backend):
        monkeypatch.setattr(mod, "rocm_gfx950_reason", lambda: None)

    def make(name, *versions, without=()):
        fk.install(monkeypatch, *versions, without=without)
        be = get_backend(name, require=False)
        assert be.available() is None, be.available()
        mod = aiter_backend if name == "aiter" else vllm_backend
        keys = mod.FUNCTIONS if name == "aiter" else {**vllm_backend.FUNCTIONS, **vllm_backend.AITER_FUNCTIONS}
        fns, which, _ = common.import_targets(keys)
        be.ops = (aiter_backend.make_ops(fns, device="cpu") if name == "aiter"
                  else vllm_backend.make_ops(fns, device="cpu", pool_kind=which["pool"].kind))
        fk.CALLS.clear()
        return be
    return make


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
    ("topk-narrow", "topk", lambda: topk_case(width=50, k=64, rows=4) | {"lengths": torch.tensor([50, 3, 0, 49])}),
]
STACKS = [("aiter", (ROW_ENDS,)), ("aiter", (CU_ENDS,)), ("vllm", (V033, ROW_ENDS)), ("vllm", (V8E4F, CU_ENDS))]
MAPPED = [(name, versions, *c) for name, versions in STACKS for c in MAPPED_CASES
          if not (name == "aiter" and c[1] == "compress_pool")
          and not (V8E4F in versions and c[1] == "topk")]


@pytest.mark.parametrize("name,versions,case,op,make", MAPPED,
                         ids=[f"{m[0]}-{'+'.join(m[1])}-{m[2]}" for m in MAPPED])
def test_mapping_reproduces_the_reference(cpu_backend, name, versions, case, op, make):
    be = cpu_backend(name, *versions)
    assert be.supports(op)
    kw = make()
    assert compare(op, getattr(be, op)(**kw), kw) == []


def test_vllm_provides_every_mxfp4_op_and_aiter_all_but_pooling(cpu_backend):
    a = cpu_backend("aiter", ROW_ENDS)
    v = cpu_backend("vllm", V033, ROW_ENDS)
    from reference.ops import OPS
    mx = [op for op in OP_NAMES if "fp8" not in op and "rocm" in OPS[op].paths]    # the ROCm path's ops
    assert [op for op in mx if not a.supports(op)] == ["compress_pool"]
    assert all(v.supports(op) for op in mx)
    # a layout without vLLM's top-k still serves the rest
    old = cpu_backend("vllm", V8E4F, CU_ENDS)
    assert [op for op in mx if not old.supports(op)] == ["topk"]


def test_adapters_refuse_what_the_real_ops_do_not_do(cpu_backend):
    a = cpu_backend("aiter", ROW_ENDS)
    with pytest.raises(ValueError, match="rounding"):
        a.k_norm_rope_mxfp4_cache(**k_writer_case(), rounding="cuda")
    with pytest.raises(ValueError, match="scale_rule"):
        a.q_rope_mxfp4_quant(**q_case(), scale_rule="ocp-floor")
    with pytest.raises(ValueError, match="shuffle: aiter's scorer reads"):
        a.paged_mxfp4_mqa_logits(**logits_case(heads=16, shuffle=(32, 16, 2)))
    v = cpu_backend("vllm", V033, ROW_ENDS)
    with pytest.raises(ValueError, match="shuffle"):
        v.k_norm_rope_mxfp4_cache(**k_writer_case(shuffle=None))
    with pytest.raises(ValueError, match="rounding"):
        v.compress_pool(**pool_case(), rounding="cuda")


def test_a_swapped_argument_is_caught():
    """The fakes check what they receive: the mapping tests above have teeth."""
    kw = k_writer_case()
    with pytest.raises(AssertionError):
        fk.k_norm_rope_mxfp4_cache(kw["k"], kw["positions"], kw["cos_sin_cache"], kw["norm_weight"],
                                   common.paged_view(kw["kv_cache"].clone(), 32, 68), 1e-6,
                                   kw["slot_mapping"], 4, (32, 16, 2))
    # and a wrong head-count mapping gives different pages than the reference
    out = kw["kv_cache"].clone()
    fk.k_norm_rope_mxfp4_cache(kw["k"], kw["positions"], kw["cos_sin_cache"], kw["norm_weight"], 1e-6,
                               common.paged_view(out, 32, 68), kw["slot_mapping"], 4,
                               list(layout.choose_shuffle(128, 16).as_list()))
    assert compare("k_norm_rope_mxfp4_cache", {"kv_cache": out}, kw)


# --- one test per mismatch with the real upstream ------------------------------------------------

def test_vllm_pooling_binds_the_033_dispatcher_and_the_8e4f5df9_kernel(cpu_backend):
    kw = pool_case()
    for versions, called in (((V033, ROW_ENDS), "vllm.rocm.compress_pool_kernel"),
                             ((V8E4F, CU_ENDS), "vllm.rocm.compress_pool@8e4f5df9")):
        v = cpu_backend("vllm", *versions)
        assert compare("compress_pool", v.compress_pool(**kw), kw) == []
        assert [c[0] for c in fk.CALLS] == [called]


def test_vllm_pooling_derives_its_constants_and_refuses_other_ratios(cpu_backend, monkeypatch):
    v = cpu_backend("vllm", V033, ROW_ENDS)
    seen = {}
    spec = fk.POOL_DISPATCHER._dispatch

    def dispatch(*args):
        grid, launch = spec(*args)
        seen.update(launch)
        return grid, launch
    monkeypatch.setattr(fk.POOL_DISPATCHER, "_dispatch", dispatch)
    kw = pool_case()
    v.compress_pool(**kw)
    d = kw["state_cache"].shape[-1] // 4
    assert (seen["HEAD_SIZE"], seen["STATE_WIDTH"], seen["COMPRESS_RATIO"], seen["OVERLAP"]) == (d, 2 * d, 4, True)
    with pytest.raises(ValueError, match="compress_ratio: vLLM's compressor pools overlapping windows only at ratio 4"):
        v.compress_pool(**{**kw, "compress_ratio": 8})


@pytest.mark.parametrize("versions,launches", [((ROW_ENDS,), [("aiter.scorer", "varlen", "")]),
                                               ((CU_ENDS,), [("aiter.scorer@cu_ends", "batched", "")] * 3)])
def test_aiter_scorer_binds_both_api_generations(cpu_backend, versions, launches):
    """row_ends: one varlen launch for the whole batch (as vLLM launches a prefill chunk);
    cu_ends: one launch per run of equal row counts. Chosen from the signature."""
    a = cpu_backend("aiter", *versions)
    kw = dict(logits_case(heads=16, shuffle=(16, 16, 4), seqs=((2, 40), (2, 50), (3, 60), (1, 0))), clean_logits=True)
    assert compare("paged_mxfp4_mqa_logits", a.paged_mxfp4_mqa_logits(**kw), kw) == []
    assert fk.CALLS == launches


def test_aiter_scorer_of_an_unknown_generation_is_one_clear_line(cpu_backend, monkeypatch):
    a = cpu_backend("aiter", ROW_ENDS)

    def oldest(q, q_scales, kv_cache, weights, context_lens, block_table, max_model_len, kv_scale_cache=None,
               out_logits=None, clean_logits=True, preshuffle=1, dynamic=0, schedule=None):
        raise AssertionError("must not be called")
    fns = {**common.import_targets(aiter_backend.FUNCTIONS)[0], "paged_mxfp4_mqa_logits": oldest}
    a.ops = aiter_backend.make_ops(fns, device="cpu")
    with pytest.raises(BackendUnavailable, match=r"has none of the parameters mxval binds \(row_ends/query_start_loc; cu_ends\)"):
        a.paged_mxfp4_mqa_logits(**logits_case(heads=16, shuffle=(16, 16, 4)))


def test_vllm_q_quant_scale_is_viewed_back_to_bytes(cpu_backend):
    v = cpu_backend("vllm", V033, ROW_ENDS)
    kw = q_case()
    out = v.q_rope_mxfp4_quant(**kw)
    assert out["q_scale"].dtype == torch.uint8 and out["q_scale"].shape == (6, 8, 4)
    assert compare("q_rope_mxfp4_quant", out, kw) == []
    with pytest.raises(ValueError, match=r"q_scale: vLLM's Q quant returned int16 \[6, 8\]"):
        vllm_backend.scale_bytes(torch.zeros(6, 8, dtype=torch.int16), out["q_fp4"])


@pytest.mark.parametrize("rows,width,k,kernel", [
    (5, 3000, 64, "torch.ops._C.top_k_per_row_decode"),     # few rows, small k: vLLM's own kernel
    (128, 300, 64, "aiter.topk"),                          # from 128 rows on: aiter's
    (3, 2500, 2048, "aiter.topk"),                         # k >= 2048: aiter's
    (130, 50, 64, "torch.ops._C.top_k_per_row_decode"),    # narrower than k: never aiter's
])
def test_vllm_topk_runs_the_kernel_vllm_chooses(cpu_backend, rows, width, k, kernel):
    v = cpu_backend("vllm", V033, ROW_ENDS)
    g = torch.Generator().manual_seed(rows)
    kw = dict(logits=torch.randn(rows, width, generator=g), k=k,
              lengths=torch.randint(0, width + 1, (rows,), generator=g))
    assert compare("topk", v.topk(**kw), kw) == []
    assert [c[0] for c in fk.CALLS] == [kernel]


def test_aiter_topk_never_sees_rows_narrower_than_k(cpu_backend):
    a = cpu_backend("aiter", ROW_ENDS)
    kw = dict(logits=torch.randn(3, 10), lengths=torch.tensor([10, 4, 0]), k=16)
    assert compare("topk", a.topk(**kw), kw) == []
    assert fk.CALLS == [("aiter.topk", 3, 16, 16)]


def test_the_adapters_name_no_upstream_module():
    """Module paths live in optimized.upstream only."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    paths = {m for t in upstream.TABLE for m in t.modules}
    pattern = re.compile("|".join(re.escape(p) for p in sorted(paths)) + r"|\bvllm\.(v1|models|model_executor|_custom_ops)\.|\baiter\.ops\.")
    hits = []
    for py in list((root / "optimized").rglob("*.py")) + list((root / "harness").rglob("*.py")):
        if py.name == "upstream.py" and py.parent.name == "optimized":
            continue
        for n, line in enumerate(py.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{py.relative_to(root)}:{n}: {line.strip()}")
    assert hits == []
    assert inspect.getsourcefile(aiter_backend) and inspect.getsourcefile(vllm_backend)


@pytest.mark.parametrize("op,case", [("k_norm_rope_mxfp4_cache", k_writer_case), ("q_rope_mxfp4_quant", q_case)])
def test_the_aiter_adapter_refuses_a_rope_its_kernel_does_not_compute(op, case):
    """A backend declaring rope=fma-oc (Backend.numerics) refuses any other rope, before its
    kernel runs; the declared one reaches the kernel."""
    ran = []
    ops = aiter_backend.make_ops({op: lambda *a: ran.append(a) or a[:3]}, "cpu", {op: {"rope": "fma-oc"}})
    kw = case()
    kw.pop("rope", None)
    with pytest.raises(ValueError, match=r"rope: aiter's .* computes rope='fma-oc' here, got 'separate'"):
        ops[op](**kw, rope="separate")
    assert ran == []
    ops[op](**kw, rope="fma-oc")
    assert len(ran) == 1
