"""MXFP4 encoding (NUMERICS.md §4) against independent oracles: ml_dtypes for the element
codes, exact integer arithmetic for the e8m0 exponent, torchao's to_mx for the other rules."""
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import round_fp32

from reference import mxfp4
from reference.formats import E2M1_VALUES, E8M0_ZERO_BLOCK

ONE_SIXTH = Fraction(float(np.float32(1.0 / 6.0)))


def all_bf16_finite() -> torch.Tensor:
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return x[torch.isfinite(x)]


def ml_codes(x: torch.Tensor) -> torch.Tensor:
    ml_dtypes = pytest.importorskip("ml_dtypes")      # optional on a GPU image
    return torch.from_numpy(x.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8).copy()) & 0xF


def away_codes(y: torch.Tensor) -> torch.Tensor:
    """A plausible wrong rule (ties away from zero) used to show the comparisons have teeth."""
    a = y.abs()
    code = sum(((a >= t).to(torch.uint8) for t in (.25, .75, 1.25, 1.75, 2.5, 3.5, 5.0)), torch.zeros_like(a, dtype=torch.uint8))
    return code | (torch.signbit(y).to(torch.uint8) << 3)


# --- element codes ------------------------------------------------------------------

def test_codes_every_bf16_value_scale_one():
    x = all_bf16_finite()
    assert x.numel() == 65536 - 256           # every bf16 but the 2 infs and 254 NaNs
    want = ml_codes(x)
    assert torch.equal(mxfp4.e2m1_codes(x), want)
    assert not torch.equal(away_codes(x), want)


def test_codes_every_bf16_value_through_quantize_at_other_scales():
    x = all_bf16_finite()
    x = x[x.abs() <= 6.0]                      # so the anchor below stays the block amax
    for k in (-100, -20, -3, 0, 1, 7, 40, 100):
        xk = x[(x.double() * 2.0 ** k).float().double() == x.double() * 2.0 ** k]   # exact in fp32
        body = torch.cat((xk, torch.zeros((-xk.numel()) % 31))).view(-1, 31) * 2.0 ** k
        blocks = torch.cat((torch.full((body.shape[0], 1), 6.0 * 2.0 ** k), body), 1)
        packed, scale = mxfp4.quantize_mxfp4(blocks)
        assert bool((scale == 127 + k).all())
        codes = mxfp4.unpack_nibbles(packed)[:, 1:].reshape(-1)[:xk.numel()]
        assert xk.numel() > 10000 and torch.equal(codes, ml_codes(xk)), k
        # teeth: nibbles swapped gives other codes
        swapped = mxfp4.unpack_nibbles((packed >> 4) | (packed << 4))[:, 1:].reshape(-1)[:xk.numel()]
        assert not torch.equal(swapped, ml_codes(xk))


def test_rne_midpoints_and_grid_at_several_scales():
    mids = {0.25: 0x0, 0.75: 0x2, 1.25: 0x2, 1.75: 0x4, 2.5: 0x4, 3.5: 0x6, 5.0: 0x6}
    grid = {0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}
    for k in (-126, -60, -1, 0, 3, 50, 120):
        for v, c in {**mids, **grid}.items():
            block = torch.zeros(32)
            block[0] = 6.0 * 2.0 ** k
            block[1], block[2] = v * 2.0 ** k, -v * 2.0 ** k
            packed, scale = mxfp4.quantize_mxfp4(block)
            codes = mxfp4.unpack_nibbles(packed)
            assert int(scale) == 127 + k
            assert (int(codes[1]), int(codes[2])) == (c, c | 8), (k, v)
            back = mxfp4.dequantize_mxfp4(packed, scale, torch.float64)
            assert float(back[1]) == E2M1_VALUES[c] * 2.0 ** k
    assert int(mxfp4.e2m1_codes(torch.tensor(0.25))) == 0 and int(away_codes(torch.tensor(0.25))) == 1


def test_zero_block_negative_zero_and_nan_scale():
    packed, scale = mxfp4.quantize_mxfp4(torch.zeros(2, 32))
    assert bool((scale == E8M0_ZERO_BLOCK).all()) and bool((packed == 0).all())
    neg = torch.zeros(32)
    neg[0] = 1.0
    neg[5] = -0.0
    neg[6] = -1e-30                              # a small negative rounds to -0: code 0x8
    packed, _ = mxfp4.quantize_mxfp4(neg)
    codes = mxfp4.unpack_nibbles(packed)
    assert int(codes[5]) == 8 and int(codes[6]) == 8 and int(codes[4]) == 0
    assert int(packed[2]) == 0x80 and int(packed[3]) == 0x08
    assert math.isnan(float(mxfp4.e8m0_to_float(torch.tensor([255], dtype=torch.uint8))[0]))
    out = mxfp4.dequantize_mxfp4(torch.zeros(16, dtype=torch.uint8), torch.tensor([255], dtype=torch.uint8))
    assert bool(torch.isnan(out).all())
    assert float(mxfp4.e8m0_to_float(torch.tensor([0], dtype=torch.uint8))[0]) == 2.0 ** -127


def test_powers_of_two_tiny_and_huge():
    for k in range(-149, 128):
        x = torch.zeros(32)
        x[0] = 2.0 ** k
        packed, scale = mxfp4.quantize_mxfp4(x)
        back = mxfp4.dequantize_mxfp4(packed, scale, torch.float64)
        want_scale = max(math.ceil(k - math.log2(6)), -126) + 127
        assert int(scale) == want_scale, k
        if k >= -127:                            # a lone power of two is always representable
            assert float(back[0]) == 2.0 ** k, k
    big = torch.full((32,), float(torch.finfo(torch.float32).max))
    packed, scale = mxfp4.quantize_mxfp4(big)
    assert int(scale) == 253 and bool((mxfp4.unpack_nibbles(packed) == 6).all())   # 2**126: y ~ 4


# --- the e8m0 exponent against exact integer arithmetic --------------------------------

def exact_e8m0(amax: float) -> int:
    """The contract's rule in exact arithmetic: ratio = fp32(max(amax, 6*2**-126) * fp32(1/6)),
    e8m0 = 127 + ceil(log2(ratio))."""
    ratio = round_fp32(max(Fraction(amax), 6 * Fraction(2) ** -126) * ONE_SIXTH)
    e = ratio.numerator.bit_length() - ratio.denominator.bit_length()
    if Fraction(2) ** e > ratio:
        e -= 1
    return 127 + e + (Fraction(2) ** e != ratio)


def around_6_pow2(steps: int) -> torch.Tensor:
    centers = torch.tensor([6.0 * 2.0 ** k for k in range(-148, 126)], dtype=torch.float64).float()
    bits = centers.view(torch.int32)[:, None] + torch.arange(-steps, steps + 1, dtype=torch.int32)
    return bits.view(torch.float32).flatten()


def test_ceil_exponent_every_positive_bf16():
    x = all_bf16_finite()
    x = x[x > 0]
    got = mxfp4.e8m0_ceil(x).tolist()
    want = [exact_e8m0(v) for v in x.tolist()]
    assert got == want
    assert mxfp4.e8m0_ocp_floor(x).tolist() != want          # teeth: another rule is caught


def test_ceil_exponent_around_each_6_pow2_and_float_log2_disagrees():
    x = around_6_pow2(12)
    got = mxfp4.e8m0_ceil(x).tolist()
    want = [exact_e8m0(v) for v in x.tolist()]
    assert got == want
    # teeth: a float ceil(log2(amax / 6)) rule is wrong somewhere near the boundaries
    naive = torch.ceil(torch.log2(x * (1.0 / 6.0))).clamp(-127, 127).int() + 127
    assert (naive != torch.tensor(want)).any()
    assert (mxfp4.e8m0_rceil(x) != torch.tensor(want)).any()


def test_ceil_scale_never_saturates_and_is_smallest():
    x = around_6_pow2(12)
    x = x[x > 6.0 * 2.0 ** -126]
    e = mxfp4.e8m0_ceil(x).double()
    y = x.double() * torch.pow(2.0, 127 - e)
    # fp32(1/6) > 1/6, so the product never rounds down onto 2**k: the rule is the true
    # ceil(log2(amax / 6)) and nothing saturates, even one ulp above 6 * 2**k
    assert float(y.max()) <= 6.0
    assert float(y.min()) > 3.0


# --- other scale rules against torchao's to_mx -------------------------------------------

@pytest.fixture(scope="module")
def to_mx():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
    return mx.to_mx, ScaleCalculationMode


def mx_study_data(gen) -> torch.Tensor:
    """Blocks with amax spread over many binades, boundaries 6*2**k included."""
    x = torch.randn(4096, 32, generator=gen) * torch.pow(2.0, torch.randint(-30, 30, (4096, 1), generator=gen).float())
    edge = around_6_pow2(3).view(-1, 1)
    edge = edge[(edge > 2.0 ** -100).flatten() & (edge < 2.0 ** 100).flatten()][:2048]
    fill = torch.rand(edge.shape[0], 31, generator=gen) * edge
    return torch.cat((x, torch.cat((edge, fill), 1)), 0)


@pytest.mark.parametrize("ours,theirs", [("ocp-floor", "FLOOR"), ("even", "EVEN"), ("rceil", "RCEIL")])
def test_scale_rules_match_torchao(to_mx, gen, ours, theirs):
    fn, mode = to_mx
    x = mx_study_data(gen)
    scale_t, data_t = fn(x, torch.float4_e2m1fn_x2, 32, getattr(mode, theirs))
    scale_t = scale_t.view(torch.uint8).reshape(-1)
    codes_t = mxfp4.unpack_nibbles(data_t.view(torch.uint8).reshape(x.shape[0], 16))   # even element low
    packed, scale = mxfp4.quantize_mxfp4(x, ours)
    assert torch.equal(scale.reshape(-1), scale_t)
    assert torch.equal(mxfp4.unpack_nibbles(packed), codes_t)
    if ours == "ocp-floor":   # teeth: the production ceil rule is a different one
        assert not torch.equal(mxfp4.quantize_mxfp4(x, "ceil")[1].reshape(-1), scale_t)


def test_the_ceil_lookup_is_the_ceil_rule():
    """On a GPU quantize_mxfp4 takes the ceil scale from a lookup on the amax bits
    (_ceil_tables): the byte and inv of e8m0_ceil at one ulp either side of every step
    (6 * 2**k), at the ends, at NaNs, and at random amaxes; a scale row's byte in every column."""
    bounds, inv, table = mxfp4._ceil_tables(torch.device("cpu"))
    edges = (6 * 2.0 ** torch.arange(-149, 128, dtype=torch.float64)).float().view(torch.int32)
    g = torch.Generator().manual_seed(5)
    bits = torch.cat([edges + d for d in (-1, 0, 1)] + [
        torch.tensor([0, 1, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF], dtype=torch.int32),
        torch.randint(0, 0x7F800000, (1 << 16,), generator=g, dtype=torch.int32)])
    row = torch.bucketize(bits, bounds, right=True)
    e = mxfp4.e8m0_ceil(bits.view(torch.float32))
    assert torch.equal(table[row, 0], e.to(torch.uint8))
    assert torch.equal(inv[row].view(torch.int32), (254 - e) << 23)
    assert bool((table[18:] == table[18:, :1]).all())
