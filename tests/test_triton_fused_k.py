"""The fused ROCm K path (optimized/triton_kernels/fused_k.py, backend `triton-fused`):
pool -> norm -> RoPE -> MXFP4 -> paged store in one launch, byte for byte the split path's.

Interpreter here; compiled in test_gpu_triton_fused_k.py. The runner tests prove that a backend's
fused launch is what the pooling and K writer stages judge (not the split ops beside it), and
that the K path's faults are caught when they come out of one launch."""
import pytest
import torch
from helpers import fused_k_case, same_bits

import reference


@pytest.fixture(scope="module")
def be():
    from optimized import get_backend
    return get_backend("triton-fused-interpret")


def _split(kw, wk):
    """The reference's split chain: compress_pool, then the K writer on its pooled rows."""
    pooled = reference.compress_pool(**kw, rounding=wk["rounding"])["pooled"]
    pages = reference.k_norm_rope_mxfp4_cache(k=pooled, positions=kw["positions"], slot_mapping=kw["kv_slot_mapping"],
                                              compress_ratio=kw["compress_ratio"], **wk)["kv_cache"]
    return pooled, pages


def _launch(kw, wk, tile, pooled_like=None):
    """fused_k.launch at `tile` on a case's inputs: (its pages, its scratch rows or None)."""
    from optimized.triton_kernels import fused_k
    args = [kw[n] for n in ("state_cache", "block_table", "positions", "req_index", "kv_slot_mapping")]
    out = wk["kv_cache"].clone()
    p = None if pooled_like is None else torch.empty_like(pooled_like)
    fused_k.launch(*args, wk["cos_sin_cache"], wk["norm_weight"], out, compress_ratio=4, norm_eps=wk["norm_eps"],
                   page_size=wk["page_size"], shuffle=wk["shuffle"], rounding=wk["rounding"], tile=tile, pooled=p)
    return out, p


# every page size aiter accepts for each layout it picks (page_size % N == 0 and a multiple of
# min(64, page_size)), and the natural layout
@pytest.mark.parametrize("shuffle,page_size", [([32, 16, 2], 64), ([32, 16, 2], 32), ([32, 16, 2], 128),
                                               ([16, 16, 4], 16), ([16, 16, 4], 48), (None, 64), (None, 8)])
def test_fused_pages_are_the_split_chains(be, shuffle, page_size):
    kw, wk = fused_k_case(page_size, shuffle, page_size)
    pooled, pages = _split(kw, wk)
    got = be.fused_pool["k_norm_rope_mxfp4_cache"](**kw, **wk)
    assert torch.equal(got["kv_cache"], pages)
    sel = ((kw["positions"] + 1) % 4 == 0) & (kw["kv_slot_mapping"] >= 0)
    assert same_bits(got["pooled"][sel], pooled[sel])            # the scratch row, -0.0 included
    assert bool(got["pooled"][~sel].isnan().all())


@pytest.mark.parametrize("shuffle,page_size,rounding", [(None, 8, "rocm"), ([16, 16, 4], 48, "rocm"),
                                                        ([32, 16, 2], 128, "deepseek"), (None, 16, "cuda")])
def test_compiled_default_tile_interpreted(be, shuffle, page_size, rounding):
    """The tile a GPU launch takes by default (tokens per program, values refined a round),
    run by the interpreter on other layouts, page sizes and rounding paths than the tilings
    test's: the same pages and scratch rows as the split chain (the register cap is CUDA's
    alone and changes no instruction)."""
    from optimized.triton_kernels import fused_k
    kw, wk = fused_k_case(page_size + 1, shuffle, page_size, rounding)
    pooled, pages = _split(kw, wk)
    out, p = _launch(kw, wk, fused_k.COMPILED_TILE, pooled)
    assert torch.equal(out, pages)
    sel = ((kw["positions"] + 1) % 4 == 0) & (kw["kv_slot_mapping"] >= 0)
    assert same_bits(p[sel], pooled[sel])


@pytest.mark.parametrize("rounding", ["deepseek", "cuda"])
def test_fused_other_rounding_paths(be, rounding):
    kw, wk = fused_k_case(3, None, 16, rounding)
    pooled, pages = _split(kw, wk)
    got = be.fused_pool["k_norm_rope_mxfp4_cache"](**kw, **wk)
    assert got["pooled"].dtype == pooled.dtype
    assert torch.equal(got["kv_cache"], pages)


@pytest.mark.parametrize("tile", [(4, 1, 4, 1), (1, 1, 8, 1), (16, 16, 1, 2), (8, 8, 2, 4), (64, 64, 8, 4),
                                  (16, 4, 2, 1), (64, 16, 4, 4), (4, 1, 4, 1, 128)])
def test_fused_tilings_and_no_scratch_row(be, tile):
    """The compiled tilings (interpreted), among them the writing tokens of a program
    compacted into fewer at once, and the production form (no pooled row stored) write the
    same pages; bytes the call does not own keep their values."""
    kw, wk = fused_k_case(5, [32, 16, 2], 64)
    _, pages = _split(kw, wk)
    assert torch.equal(_launch(kw, wk, tile)[0], pages)


@pytest.mark.parametrize("tile", [(16, 4, 2, 1), (8, 1, 4, 1), (8, 1, 1, 1), (16, 4, 1, 1), (8, 1, 2, 1, 128)])
def test_fused_program_of_writing_tokens_only(be, tile):
    """A decode step's shape: every token is at its group's end (11 of 12 with a slot), so a
    program holds more writing tokens than it pools at once and takes them in turns. With
    one value refined a round, each pooled value on a bf16 midpoint (all of them refined)."""
    kw, wk = fused_k_case(6, [32, 16, 2], 64)
    sel = (kw["positions"] + 1) % 4 == 0
    kw = dict(kw, **{n: kw[n][sel] for n in ("positions", "req_index", "kv_slot_mapping")})
    assert int((kw["kv_slot_mapping"] >= 0).sum()) == 11
    if tile[2] == 1:           # one value refined a round (its own code path): every value refined
        from helpers import on_bf16_midpoints
        kw = on_bf16_midpoints(kw)
    pooled, pages = _split(kw, wk)
    out, p = _launch(kw, wk, tile, pooled)
    assert torch.equal(out, pages)
    written = kw["kv_slot_mapping"] >= 0
    assert same_bits(p[written], pooled[written]) and bool(p[~written].isnan().all())


def test_fused_rejects_what_the_split_ops_reject(be):
    kw, wk = fused_k_case(1, [32, 16, 2], 64)
    fn = be.fused_pool["k_norm_rope_mxfp4_cache"]
    with pytest.raises(ValueError, match="hadamard"):
        fn(**kw, **wk, hadamard=True)
    with pytest.raises(ValueError, match="page_size"):
        fn(**fused_k_case(1, [32, 16, 2], 96)[0], **fused_k_case(1, [32, 16, 2], 96)[1])   # a page size aiter refuses
    bad = dict(kw, kv_slot_mapping=kw["kv_slot_mapping"].clone())
    bad["kv_slot_mapping"][3] = 10 ** 6
    with pytest.raises(ValueError, match="slot_mapping"):
        fn(**bad, **wk)


# --- the runner: the two stages are judged on the one launch -------------------------------

def _smoke_case(name="chain", **change):
    """A selftest case, its chain cut to the K path (the stages the fused launch feeds)."""
    import dataclasses

    from harness.run.cases import Catalog
    return dataclasses.replace(Catalog().case(name), ops=("compress_pool", "k_norm_rope_mxfp4_cache"), **change)


def _run(case, backend):
    from harness.run import budgets
    from harness.run.runner import run_case
    from optimized import register
    register(backend.name, lambda: backend)
    return budgets.verdict(run_case(case, backend.name), budgets.load(), "selftest")


def test_runner_judges_the_fused_launch(be):
    """The pooling and K writer stages come from the fused launch (one launch per step and
    repeat), never from the split ops, and the case passes with no byte differing."""
    from optimized import Backend
    calls = {"fused": 0}
    fused = be.fused_pool["k_norm_rope_mxfp4_cache"]

    def counted(**kw):
        calls["fused"] += 1
        return fused(**kw)

    def split_called(**_):
        raise AssertionError("a split op ran where the fused launch should")
    ops = dict(be.ops, compress_pool=split_called, k_norm_rope_mxfp4_cache=split_called)
    spy = Backend("test-fused-spy", "spy", ops, device="cpu", fused_pool={"k_norm_rope_mxfp4_cache": counted})
    row = _run(_smoke_case(repeat=2), spy)
    assert row["status"] == "pass", row.get("reason")
    steps = len(row["summaries"]["k_norm_rope_mxfp4_cache"])
    assert steps >= 2 and calls["fused"] == steps * 3                        # per step: the pooling stage twice, the K repeat once
    assert row["metrics"]["k_norm_rope_mxfp4_cache.page_bytes_mismatched"] == 0
    assert row["metrics"]["chain.page_bytes_mismatched"] == 0


def _k_path_faults():
    from optimized import faults as F
    k_ops = {"compress_pool", "k_norm_rope_mxfp4_cache"}
    # graph-only faults are correct eagerly by design (tests/test_graph.py catches them replayed)
    return [n for n, f in F.FAULTS.items() if set(f.ops) & k_ops and not f.large and not f.graph]


@pytest.mark.parametrize("name", _k_path_faults())
def test_k_path_faults_caught_through_one_launch(name):
    """Each selftest fault of the ROCm K path (but the 2 GiB pool's), its pooling and writer
    composed into one call offered as the backend's fused launch, on its case with the
    pooling in the chain: still caught by the budgets."""
    from optimized import Backend
    from optimized import faults as F
    fault = F.FAULTS[name]
    fb = fault.backend()
    pool_fn, write_fn = fb.ops["compress_pool"], fb.ops["k_norm_rope_mxfp4_cache"]

    def one_call(*, state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio=4,
                 rounding="rocm", **write):
        pooled = pool_fn(state_cache=state_cache, block_table=block_table, positions=positions,
                         req_index=req_index, kv_slot_mapping=kv_slot_mapping, compress_ratio=compress_ratio,
                         rounding=rounding)["pooled"]
        pages = write_fn(k=pooled, positions=positions, slot_mapping=kv_slot_mapping,
                         compress_ratio=compress_ratio, rounding=rounding, **write)["kv_cache"]
        return {"pooled": pooled, "kv_cache": pages}
    be = Backend(f"test-fused-{name}", "fault in one launch", fb.ops, device="cpu",
                 fused_pool={"k_norm_rope_mxfp4_cache": one_call})
    row = _run(_smoke_case(fault.cases[0]), be)            # its K path, pooled, through the launch
    assert row["violations"], f"{name} passed through the fused launch"


def test_fused_kernel_without_the_scratch_round_is_caught(be):
    """A fused kernel that skips the bf16 round of the pooled row (it keeps fp32 through the
    norm, as the CUDA path does) while storing a correct scratch row: the pooling stage
    passes, the K writer stage fails on its pages."""
    from optimized import Backend
    fused = be.fused_pool["k_norm_rope_mxfp4_cache"]

    def no_round(**kw):
        good = fused(**kw)
        pages = fused(**dict(kw, rounding="cuda"))["kv_cache"]
        return {"pooled": good["pooled"], "kv_cache": pages}
    bad = Backend("test-fused-no-round", "fault", be.ops, device="cpu",
                  fused_pool={"k_norm_rope_mxfp4_cache": no_round})
    row = _run(_smoke_case(), bad)
    metrics = {v["metric"] for v in row["violations"]}
    assert "k_norm_rope_mxfp4_cache.page_bytes_mismatched" in metrics
    assert not any(m.startswith("compress_pool.") for m in metrics)


def test_certified_pooling_on_bf16_midpoints(be):
    """Every pooled value on a bf16 rounding midpoint: fp32 pooling without the bound's check
    gets bf16 values wrong there (the check has teeth); with it, the fp64 fallback gives the
    split path's rows and pages exactly."""
    from helpers import fused_wrong_by_certify, on_bf16_midpoints
    kw, wk = fused_k_case(11, [32, 16, 2], 64, tokens=256, pages=8)
    kw = on_bf16_midpoints(kw)
    pooled, pages = _split(kw, wk)
    sel = ((kw["positions"] + 1) % 4 == 0) & (kw["kv_slot_mapping"] >= 0)
    wrong = fused_wrong_by_certify(kw, wk, pooled, pages, sel)
    assert wrong[True] == (0, 0) and wrong["unchecked"][0] > 0, wrong


def test_fused_extreme_scores(be):
    """Scores near fp32's largest (s - max overflows to -inf, the bound to inf or NaN) and kv
    near its smallest and largest: the bound decides nothing there, the fp64 pooling does."""
    kw, wk = fused_k_case(13, [32, 16, 2], 64)
    plain = _split(kw, wk)[0]
    st = kw["state_cache"]
    st[0, :, 2 * 128:2 * 128 + 16] = 3e38
    st[0, 1::2, 2 * 128:2 * 128 + 16] = -3e38
    st[1, :, 64:80] = 1e-38
    st[1, :, 80:96] = 3e37
    pooled, pages = _split(kw, wk)
    got = be.fused_pool["k_norm_rope_mxfp4_cache"](**kw, **wk)
    sel = ((kw["positions"] + 1) % 4 == 0) & (kw["kv_slot_mapping"] >= 0)
    assert not same_bits(plain[sel], pooled[sel])                 # the windows read the changed rows
    assert same_bits(got["pooled"][sel], pooled[sel])
    assert torch.equal(got["kv_cache"], pages)


@pytest.mark.parametrize("name", ["gen-nonfinite-normweight-inf", "gen-nonfinite-cossincache-nan"])
def test_fused_launch_takes_nonfinite_inputs_as_the_split_kernels_do(be, name):
    """A planted non-finite norm weight or RoPE table reaches the fused kernel (as it reaches
    the split Triton ops): the case is judged `nonfinite_input` with the invariants on what
    the launch wrote, never an error from a wrapper that refused the value."""
    from harness.run.cases import Catalog
    case = Catalog().case(name)
    row = _run(case, be)
    assert row["status"] == "nonfinite_input" and row["ok"], row.get("reason")
    assert row["metrics"]["k_norm_rope_mxfp4_cache.invariant_violations"] == 0
