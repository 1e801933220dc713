"""The K path kernels' tilings (Triton interpreter; compiled in test_gpu_triton.py):
pooling with windows inside one or two state blocks (block_size >= 2r - 1) and across
more (smaller blocks); the K writer with several (tile, group) sizes, including tiles
where most tokens write nothing."""
import pytest
import torch
from helpers import compare, k_writer_case, pool_case

import reference


@pytest.fixture(scope="module")
def be():
    from optimized import get_backend
    return get_backend("triton-interpret")


@pytest.mark.parametrize("block_size", [4, 7, 8])
@pytest.mark.parametrize("rounding", ["rocm", "cuda"])
def test_pooling_any_block_size(be, block_size, rounding):
    kw = dict(pool_case(seed=block_size, tokens=40, block_size=block_size, reqs=2), rounding=rounding)
    assert compare("compress_pool", be.compress_pool(**kw), kw) == []


@pytest.mark.parametrize("tile", [(16, 4, 4, 128), (8, 2, 2, 64), (32, 8, 4, 32), (16, 1, 1, 64)])
def test_pooling_tilings(be, tile):
    from optimized.triton_kernels import pooling
    kw = pool_case(seed=3, tokens=40, block_size=8, reqs=2)
    args = [kw[n] for n in ("state_cache", "block_table", "positions", "req_index", "kv_slot_mapping")]
    got = pooling.launch(*args, compress_ratio=4, tile=tile)
    assert compare("compress_pool", {"pooled": got}, kw) == []        # NaN rows: any NaN


@pytest.mark.parametrize("tile", [(64, 16, 4), (32, 8, 4), (16, 4, 2)])
def test_k_writer_tilings(be, tile):
    from optimized.triton_kernels import k_writer
    kw = k_writer_case(tokens=48, pages=4)
    want = reference.k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    out = kw["kv_cache"].clone()
    k_writer.launch(kw["k"], kw["positions"], kw["cos_sin_cache"], kw["norm_weight"], kw["slot_mapping"], out,
                    norm_eps=kw["norm_eps"], compress_ratio=4, page_size=kw["page_size"], shuffle=kw["shuffle"],
                    tile=tile)
    assert torch.equal(out, want)
