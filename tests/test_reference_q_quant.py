"""Q quant and folded weights (NUMERICS.md §3), and the RoPE tables and rotation (§2)."""
import math

import numpy as np
import torch

import reference
from reference import mxfp4, preset, rope

T, H, D, R = 6, 4, 128, 64


def bf16(x):
    return x.to(torch.bfloat16).float()


def q_inputs(gen, cs):
    q = (torch.randn(T, H, D, generator=gen) * 3).bfloat16()
    q[:, :, 0] = -0.0                       # NoPE signed zeros, partner negative
    q[:, :, 1] = -1.0
    return dict(q=q, positions=torch.tensor([0, 5, 17, 1000, 4095, 3]), cos_sin_cache=cs,
                weights=torch.randn(T, H, generator=gen), weights_scale=D ** -0.5 * H ** -0.5)


def oracle_q(q, pos, cs):
    out = q.float().clone()
    for t in range(q.shape[0]):
        for m in range(R // 2):
            c, s = cs[pos[t], m], cs[pos[t], R // 2 + m]
            e, o = q[t, :, D - R + 2 * m].float(), q[t, :, D - R + 2 * m + 1].float()
            out[t, :, D - R + 2 * m], out[t, :, D - R + 2 * m + 1] = bf16(e * c - o * s), bf16(o * c + e * s)
    return out


def test_q_quant_matches_oracle_and_keeps_nope_zeros(gen, pro_cos_sin):
    args = q_inputs(gen, pro_cos_sin)
    q_before = args["q"].clone()
    out = reference.q_rope_mxfp4_quant(**args)
    assert torch.equal(args["q"], q_before)
    want_p, want_s = mxfp4.quantize_mxfp4(oracle_q(args["q"], args["positions"], pro_cos_sin))
    assert torch.equal(out["q_fp4"], want_p) and torch.equal(out["q_scale"], want_s)
    assert out["q_fp4"].shape == (T, H, D // 2) and out["q_scale"].shape == (T, H, D // 32)
    assert bool(((out["q_fp4"][:, :, 0] & 0xF) == 0x8).all())          # -0.0 kept: code 0x8
    # teeth: the K writer's NoPE-through-the-formula would have made it +0.0
    pushed = rope.rope_gptj_tail(args["q"].float(), *[c[:, None] for c in rope.cos_sin_at(pro_cos_sin, args["positions"])])
    assert bool(((mxfp4.quantize_mxfp4(pushed)[0][:, :, 0] & 0xF) == 0).all())


def test_weights_one_multiply():
    from reference.q_quant import fold_weights
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(8192, 32, generator=gen)
    s = D ** -0.5 * 32 ** -0.5
    out = fold_weights(w, s)
    assert out.dtype == torch.float32 and torch.equal(out, w * torch.tensor(s, dtype=torch.float32))
    in_turn = (w * torch.tensor(D ** -0.5)) * torch.tensor(32 ** -0.5)
    assert not torch.equal(out, in_turn)          # H=32: multiplying in turn differs (teeth)
    in_turn64 = (w * torch.tensor(D ** -0.5)) * torch.tensor(64 ** -0.5)
    assert torch.equal(fold_weights(w, D ** -0.5 * 64 ** -0.5), in_turn64)   # H=64: the same bits
    op = reference.q_rope_mxfp4_quant(q=torch.zeros(2, 32, D).bfloat16(), positions=torch.zeros(2, dtype=torch.long),
                                      cos_sin_cache=torch.zeros(1, R), weights=w[:2].bfloat16(), weights_scale=s)
    assert torch.equal(op["weights"], w[:2].bfloat16().float() * torch.tensor(s, dtype=torch.float32))


def test_head_scales_as_little_endian_int32(gen, pro_cos_sin):
    args = q_inputs(gen, pro_cos_sin)
    sc = reference.q_rope_mxfp4_quant(**args)["q_scale"]
    as_int = torch.from_numpy(sc.numpy().copy().view("<i4"))[..., 0]
    want = sum(sc[..., k].long() << (8 * k) for k in range(4))
    assert torch.equal(as_int.long() & 0xFFFFFFFF, want)
    # byte k is block k's own exponent
    vals = oracle_q(args["q"], args["positions"], pro_cos_sin)
    for k in range(4):
        assert torch.equal(mxfp4.e8m0_ceil(vals[..., 32 * k:32 * (k + 1)].abs().amax(-1)).to(torch.uint8), sc[..., k])


def test_cos_sin_cache_formulas():
    cs = rope.cos_sin_cache(50, R, 10000.0)
    inv = 1.0 / 10000.0 ** (np.arange(0, R, 2) / R)
    ang = np.outer(np.arange(50), inv)
    assert np.allclose(cs[:, : R // 2].numpy(), np.cos(ang), atol=1e-7)
    assert np.allclose(cs[:, R // 2:].numpy(), np.sin(ang), atol=1e-7)
    # DeepSeek YaRN, written out independently: ramp between the beta_fast/beta_slow dims
    p = preset("deepseek-v4-pro")
    base, fac, orig = p.rope_base, p.yarn_factor, p.yarn_original_max_pos
    freqs = 1.0 / base ** (np.arange(0, R, 2) / R)
    dim = lambda rot: R * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = max(math.floor(dim(32)), 0), min(math.ceil(dim(1)), R - 1)
    smooth = 1 - np.clip((np.arange(R // 2) - lo) / (hi - lo), 0, 1)
    yarn = freqs / fac * (1 - smooth) + freqs * smooth
    cs = rope.cos_sin_cache(3000, R, base, yarn_factor=fac, yarn_original_max_pos=orig)
    ang = np.outer(np.arange(3000), yarn)
    assert np.allclose(cs[:, : R // 2].numpy(), np.cos(ang), atol=2e-7)
    assert np.allclose(cs[:, R // 2:].numpy(), np.sin(ang), atol=2e-7)
    assert not np.allclose(yarn, freqs)
