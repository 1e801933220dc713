"""The FP8 baseline (NUMERICS.md §7): scale rule, clamps, flavours, page layout, scorer."""
from fractions import Fraction

import pytest
import torch

import reference
from reference import fp8
from reference.k_writer import k_values

D, PS = 128, 64


def exact_pow2_scale(amax: float, fmax: float) -> float:
    """2**ceil(log2(fp32(max(amax, 1e-4) / fmax))) in exact arithmetic."""
    from helpers import round_fp32
    ratio = round_fp32(max(Fraction(amax), Fraction(float(torch.tensor(1e-4)))) / Fraction(fmax))
    e = ratio.numerator.bit_length() - ratio.denominator.bit_length()
    if Fraction(2) ** e > ratio:
        e -= 1
    return 2.0 ** (e + (Fraction(2) ** e != ratio))


@pytest.mark.parametrize("flavour,fmax", [("e4m3fn", 448.0), ("e4m3fnuz", 224.0)])
def test_scale_rule_and_clamp(gen, flavour, fmax):
    amax = torch.cat((torch.rand(300, generator=gen) * 10.0 ** torch.randint(-6, 4, (300,), generator=gen),
                      torch.tensor([fmax * 2.0 ** k for k in range(-20, 10)]),
                      torch.tensor([fmax * 2.0 ** k for k in range(-20, 10)]).nextafter(torch.tensor(1e9)),
                      torch.tensor([0.0, 1e-5, 1e-4, 2e-4])))
    got = fp8.pow2_scale(amax, fmax)
    assert got.tolist() == [exact_pow2_scale(a, fmax) for a in amax.tolist()]
    assert float(fp8.pow2_scale(torch.tensor([0.0]), fmax)[0]) == exact_pow2_scale(1e-4, fmax)
    x = torch.randn(64, D, generator=gen) * 3
    v, s = fp8.quantize_fp8(x, flavour)
    back = fp8.dequantize_fp8(v, flavour, torch.float32)
    assert float(back.abs().max()) <= fmax
    assert bool((back.abs().amax(-1) > fmax / 2 / 1.2).all())          # the scale is the smallest
    want = torch.clamp(x / s[:, None], -fmax, fmax).to(getattr(torch, fp8.FP8_FLAVOURS[flavour][0]))
    assert torch.equal(v, want.view(torch.uint8))


def test_flavours_give_different_bytes_and_0x80():
    x = torch.tensor([[1.0, -0.0, 0.5, -2.0] + [0.0] * (D - 4)])
    fn, _ = fp8.quantize_fp8(x, "e4m3fn")
    fnuz, _ = fp8.quantize_fp8(x, "e4m3fnuz")
    assert not torch.equal(fn, fnuz)
    assert int(fn[0, 1]) == 0x80 and int(fnuz[0, 1]) == 0x00              # -0.0: 0x80 only in OCP
    assert torch.isnan(fp8.dequantize_fp8(fn, "e4m3fnuz")[0, 1])          # written OCP, read FNUZ
    assert not torch.isnan(fp8.dequantize_fp8(fn, "e4m3fn")).any()


def test_k_writer_page_layout_token_major(gen, pro_cos_sin):
    t = 24
    k = (torch.randn(t, D, generator=gen) * 2).bfloat16()
    pos = torch.arange(t) + 8
    slots = torch.randperm(2 * PS, generator=gen)[:t]
    stride = PS * (D + 4) + 16
    pool = torch.randint(0, 256, (2, stride), dtype=torch.uint8, generator=gen)
    w = (torch.rand(D, generator=gen) + 0.5).bfloat16()
    out = reference.k_norm_rope_fp8_cache(k=k, positions=pos, cos_sin_cache=pro_cos_sin, norm_weight=w,
                                          slot_mapping=slots, kv_cache=pool, page_size=PS)["kv_cache"]
    want = pool.clone()
    for i in range(t):
        p = int(pos[i])
        if (p + 1) % 4:
            continue
        v, s = fp8.quantize_fp8(k_values(k[i:i + 1], torch.tensor([p // 4 * 4]), pro_cos_sin, w, 1e-6), "e4m3fn")
        page, row = divmod(int(slots[i]), PS)
        want[page, row * D:(row + 1) * D] = v[0]
        want[page, PS * D + 4 * row:PS * D + 4 * row + 4] = s.view(torch.uint8)
    assert torch.equal(out, want)
    assert torch.equal(out[:, PS * (D + 4):], pool[:, PS * (D + 4):])      # padding untouched


def test_q_fp8_folds_the_q_scale(gen, pro_cos_sin):
    q = (torch.randn(3, 4, D, generator=gen) * 5).bfloat16()
    w = torch.randn(3, 4, generator=gen)
    out = reference.q_rope_fp8_quant(q=q, positions=torch.tensor([1, 2, 3]), cos_sin_cache=pro_cos_sin,
                                     weights=w, weights_scale=0.01)
    from reference.q_quant import q_values
    v, s = fp8.quantize_fp8(q_values(q, torch.tensor([1, 2, 3]), pro_cos_sin), "e4m3fn")
    assert torch.equal(out["q_fp8"], v)
    assert torch.equal(out["weights"], w * s * torch.tensor(0.01))
    assert not torch.equal(out["weights"], w * torch.tensor(0.01))        # teeth: q scale not folded


def test_fp8_scorer_matches_dense_loop(gen):
    lens, pages = [70, 5], 4
    pool = torch.randint(0, 256, (pages, PS * (D + 4)), dtype=torch.uint8, generator=gen)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    for b, n in enumerate(lens):
        x = torch.randn(n, D, generator=gen)
        v, s = fp8.quantize_fp8(x, "e4m3fn")
        for j in range(n):
            page = int(table[b, j // PS])
            pool[page, (j % PS) * D:(j % PS + 1) * D] = v[j]
            pool[page, PS * D + 4 * (j % PS):PS * D + 4 * (j % PS) + 4] = s[j:j + 1].view(torch.uint8)
    q8, _ = fp8.quantize_fp8(torch.randn(3, 4, D, generator=gen), "e4m3fn")
    w = torch.randn(3, 4, generator=gen)
    kw = dict(q_fp8=q8, weights=w, kv_cache=pool, query_start_loc=torch.tensor([0, 2, 3]),
              context_lens=torch.tensor(lens), block_table=table, row_ends=torch.tensor([70, 33, 5]), page_size=PS)
    got = reference.paged_fp8_mqa_logits(**kw)["logits"]
    q = fp8.dequantize_fp8(q8, "e4m3fn")
    for r, (b, end) in enumerate([(0, 70), (0, 33), (1, 5)]):
        for j in range(got.shape[1]):
            if j >= end:
                assert got[r, j] == float("-inf")
                continue
            page = int(table[b, j // PS])
            k = fp8.dequantize_fp8(pool[page, (j % PS) * D:(j % PS + 1) * D], "e4m3fn")
            sk = pool[page, PS * D + 4 * (j % PS):PS * D + 4 * (j % PS) + 4].view(torch.float32).double()
            want = float((w[r].double() * ((q[r] @ k) * sk).clamp_min(0)).sum())
            assert abs(float(got[r, j]) - want) <= 1e-6 * abs(want) + 1e-30


@pytest.mark.parametrize("flavour,fmax", [("e4m3fn", 448.0), ("e4m3fnuz", 224.0)])
def test_amax_at_the_scale_boundary(flavour, fmax):
    """amax = fmax * 2**k encodes to exactly +-fmax with scale 2**k; one fp32 ulp more doubles
    the scale. (The clamp to +-fmax never binds under this ceil rule: x / s exceeds fmax by
    at most one fp32 rounding, which the fp8 cast rounds back to fmax.)"""
    for k in (-12, 0, 5):
        x = torch.zeros(1, D)
        x[0, 0], x[0, 1] = fmax * 2.0 ** k, -fmax * 2.0 ** k
        v, s = fp8.quantize_fp8(x, flavour)
        assert float(s[0]) == 2.0 ** k
        assert fp8.dequantize_fp8(v, flavour)[0, :2].tolist() == [fmax, -fmax]
        x[0, 0] = x[0, 0].nextafter(torch.tensor(1e30))
        assert float(fp8.quantize_fp8(x, flavour)[1][0]) == 2.0 ** (k + 1)
