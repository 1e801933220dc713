"""The fused ROCm K path compiled on a GPU (`make test-gpu`): byte for byte the split path's
(the compiled pooling and K writer) and the reference's, for every layout and page size aiter
accepts, each rounding path, every tiling of the benchmark's sweep, and a prefill chunk."""
import pytest
import torch
from helpers import fused_k_case, needs_gpu, same_bits

import reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def be():
    from optimized import get_backend
    return get_backend("triton-fused")


def _cuda(d):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


@needs_gpu
@pytest.mark.parametrize("shuffle,page_size", [([32, 16, 2], 64), ([32, 16, 2], 32), ([32, 16, 2], 128),
                                               ([16, 16, 4], 16), ([16, 16, 4], 48), (None, 64), (None, 8)])
@pytest.mark.parametrize("rounding", ["rocm", "deepseek", "cuda"])
def test_fused_is_the_split_path(be, shuffle, page_size, rounding):
    kw, wk = fused_k_case(page_size, shuffle, page_size, rounding, tokens=512, pages=160)
    kw, wk = _cuda(kw), _cuda(wk)
    got = be.fused_pool["k_norm_rope_mxfp4_cache"](**kw, **wk)
    pooled = be.compress_pool(**kw, rounding=rounding)["pooled"]
    split = be.k_norm_rope_mxfp4_cache(k=pooled, positions=kw["positions"], slot_mapping=kw["kv_slot_mapping"],
                                       compress_ratio=4, **wk)["kv_cache"]
    ref = reference.k_norm_rope_mxfp4_cache(
        k=reference.compress_pool(**kw, rounding=rounding)["pooled"], positions=kw["positions"],
        slot_mapping=kw["kv_slot_mapping"], compress_ratio=4, **wk)["kv_cache"]
    assert torch.equal(got["kv_cache"], split) and torch.equal(got["kv_cache"], ref)
    assert same_bits(got["pooled"], pooled)                  # NaN rows included (same NaN bits)


@needs_gpu
def test_fused_prefill_chunk_every_tiling():
    """The benchmark's 16384-token chunk: every tiling of the sweep, with and without the
    scratch row, writes the split path's pages."""
    from harness.bench.gpu import FUSED_TILES, k_path_inputs
    from optimized.triton_kernels import fused_k, k_writer, pooling
    pool_kw, k_kw = k_path_inputs()
    pk = dict(pool_kw)
    r = pk.pop("compress_ratio")
    opts = dict(norm_eps=k_kw["norm_eps"], compress_ratio=r, page_size=64, shuffle=[32, 16, 2])
    pooled = pooling.launch(*pk.values(), compress_ratio=r)
    split = k_writer.launch(pooled, k_kw["positions"], k_kw["cos_sin_cache"], k_kw["norm_weight"],
                            k_kw["slot_mapping"], k_kw["kv_cache"].clone(), **opts)
    for tile in FUSED_TILES:
        out, p2 = k_kw["kv_cache"].clone(), torch.empty_like(pooled)
        fused_k.launch(*pk.values(), k_kw["cos_sin_cache"], k_kw["norm_weight"], out, **opts, tile=tile, pooled=p2)
        assert torch.equal(out, split), tile
        assert same_bits(p2, pooled), tile
        out = k_kw["kv_cache"].clone()
        fused_k.launch(*pk.values(), k_kw["cos_sin_cache"], k_kw["norm_weight"], out, **opts, tile=tile)
        assert torch.equal(out, split), tile


@needs_gpu
def test_certified_pooling_on_bf16_midpoints_compiled(be):
    """Every pooled value on a bf16 rounding midpoint, compiled (libdevice expf, the GPU's
    sums): the certified pooling gives the split path's rows and pages; fp32 without the
    check does not."""
    from helpers import fused_wrong_by_certify, on_bf16_midpoints
    kw, wk = fused_k_case(12, [32, 16, 2], 64, tokens=4096, pages=80)
    kw = _cuda(on_bf16_midpoints(kw))
    wk = _cuda(wk)
    pooled = be.compress_pool(**kw)["pooled"]
    pages = be.k_norm_rope_mxfp4_cache(k=pooled, positions=kw["positions"], slot_mapping=kw["kv_slot_mapping"],
                                       compress_ratio=4, **wk)["kv_cache"]
    wrong = fused_wrong_by_certify(kw, wk, pooled, pages)
    assert wrong[True] == (0, 0) and wrong["unchecked"][0] > 0, wrong
