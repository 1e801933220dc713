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


def _hardware_errors():
    """(exp2's largest relative error for normal results and largest absolute error below
    2**-126, over every fp32 argument <= 0; the full-range divide's largest relative error
    of 1/S over every fp32 S in [1, 8]): the two operations `fused_k.pool_bf16` uses as it
    uses them (`tl.math.exp2` of an fp32, `1.0 / S`), against fp64."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from optimized.triton_kernels.interp import LAUNCH

    @triton.jit
    def exp2_err(out_ptr, start, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        y = (start + i).to(tl.int32).to(tl.float32, bitcast=True)
        e = tl.math.exp2(y).to(tl.float64)
        ref = libdevice.exp2(y.to(tl.float64))
        normal = ref >= 2.0 ** -126
        rel = tl.where(normal & m, tl.abs(e - ref) / ref, 0.0)
        ab = tl.where(m & (normal == 0), tl.abs(e - ref), 0.0)
        tl.atomic_max(out_ptr, tl.max(rel, axis=0).to(tl.int64, bitcast=True))
        tl.atomic_max(out_ptr + 1, tl.max(ab, axis=0).to(tl.int64, bitcast=True))

    @triton.jit
    def rcp_err(out_ptr, start, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        s = (start + i).to(tl.int32).to(tl.float32, bitcast=True)
        r = (1.0 / s).to(tl.float64)
        ref = 1.0 / s.to(tl.float64)
        tl.atomic_max(out_ptr, tl.max(tl.where(m, tl.abs(r - ref) / ref, 0.0), axis=0).to(tl.int64, bitcast=True))

    out = torch.zeros(3, dtype=torch.int64, device="cuda")
    block = 1024
    n = 0xFF800000 - 0x80000000 + 1                   # -0.0 .. -inf, as int32 from -2**31 on
    exp2_err[(triton.cdiv(n, block),)](out, -(1 << 31), n, BLOCK=block, **LAUNCH)
    lo, hi = 0x3F800000, 0x41000000                   # 1.0 .. 8.0
    rcp_err[(triton.cdiv(hi - lo + 1, block),)](out[2:], lo, hi - lo + 1, BLOCK=block, **LAUNCH)
    return tuple(out.cpu().view(torch.float64).tolist())


@needs_gpu
def test_the_hardware_exp2_and_divide_are_within_the_pooling_bound():
    """The certified pooling's bound (fused_k.py) takes this GPU's exp2 and full-range divide
    at 2 ulp (4u relative) each, and an exp2 below 2**-126 as off by 2**-126 at most (the
    bound's 2**-125 |kv| term): checked over every input each can get there, every fp32
    exponent <= 0 and every sum of exps S in [1, 8] (the largest exp is 1, there are 8)."""
    u = 2.0 ** -24
    exp2_rel, exp2_abs, rcp_rel = _hardware_errors()
    assert exp2_rel <= 4 * u and exp2_abs <= 2.0 ** -126 and rcp_rel <= 4 * u, (exp2_rel / u, exp2_abs, rcp_rel / u)
    assert exp2_rel > 0 and rcp_rel > 0                      # approximations, measured as such
