"""The MXFP4 K writer (NUMERICS.md §2) against an oracle built here, with its skip rules,
untouched bytes, padded strides and rounding paths."""
import pytest
import torch

import reference
from reference import layout, mxfp4
from reference.k_writer import rms_norm

D, R, RATIO, PS = 128, 64, 4, 64


def bf16(x):
    return x.to(torch.bfloat16).float()


def oracle_values(k_row, g, cs, w, eps=1e-6):
    """One entry the plain way: norm, then a pair-by-pair GPT-J loop at position g."""
    n = bf16(rms_norm(k_row.float()[None], w, eps))[0]
    out = n.clone()
    for m in range(D // 2):
        e, o = n[2 * m], n[2 * m + 1]
        if m < (D - R) // 2:
            c, s = torch.tensor(1.0), torch.tensor(0.0)         # NoPE pairs through the formula
        else:
            mm = m - (D - R) // 2
            c, s = cs[g, mm], cs[g, R // 2 + mm]
        out[2 * m], out[2 * m + 1] = bf16(e * c - o * s), bf16(o * c + e * s)
    return out


def make_inputs(gen, t=40, pages=3, stride=4352, shuffle=(32, 16, 2), cs=None):
    k = (torch.randn(t, D, generator=gen) * 2).bfloat16()
    pos = torch.arange(t) + 100
    slots = torch.randperm(pages * PS, generator=gen)[:t]
    slots[::5] = -1
    pool = torch.randint(0, 256, (pages, stride), dtype=torch.uint8, generator=gen)
    w = (torch.rand(D, generator=gen) + 0.5).bfloat16()
    return dict(k=k, positions=pos, cos_sin_cache=cs, norm_weight=w, slot_mapping=slots, kv_cache=pool,
                norm_eps=1e-6, compress_ratio=RATIO, page_size=PS,
                shuffle=list(shuffle) if shuffle else None)


@pytest.mark.parametrize("shuffle,stride", [((32, 16, 2), 4352), (None, 4352), ((32, 16, 2), 4352 + 96)])
def test_writer_matches_oracle_and_owns_only_its_bytes(gen, pro_cos_sin, shuffle, stride):
    args = make_inputs(gen, stride=stride, shuffle=shuffle, cs=pro_cos_sin)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    out = reference.k_norm_rope_mxfp4_cache(**args)["kv_cache"]
    for k in args:
        if isinstance(args[k], torch.Tensor):
            assert torch.equal(args[k], before[k]), f"{k} modified"
    pos, slots = args["positions"], args["slot_mapping"]
    writes = (slots >= 0) & ((pos + 1) % RATIO == 0)
    assert 0 < int(writes.sum()) < int((slots >= 0).sum())        # both skip rules exercised
    want = args["kv_cache"].clone()
    for i in writes.nonzero().flatten().tolist():
        v = oracle_values(args["k"][i], int(pos[i]) // RATIO * RATIO, pro_cos_sin, args["norm_weight"])
        packed, scales = mxfp4.quantize_mxfp4(v)
        want = layout.write_entries(want, slots[i:i + 1], packed[None], scales[None], page_size=PS, shuffle=shuffle)
    assert torch.equal(out, want)
    owned = layout.owned_mask(*out.shape, slots[writes], page_size=PS, head_dim=D, shuffle=shuffle)
    assert torch.equal(out[~owned], args["kv_cache"][~owned])       # padding and others untouched
    assert not torch.equal(out[owned], args["kv_cache"][owned])


def test_rope_uses_group_start(gen, pro_cos_sin):
    args = make_inputs(gen, cs=pro_cos_sin)
    out = reference.k_norm_rope_mxfp4_cache(**args)["kv_cache"]
    i = int(((args["slot_mapping"] >= 0) & ((args["positions"] + 1) % RATIO == 0)).nonzero()[0])
    p = int(args["positions"][i])
    packed, scales = layout.read_entries(out, args["slot_mapping"][i:i + 1], page_size=PS, head_dim=D,
                                         shuffle=args["shuffle"])
    for rope_pos, ok in ((p // RATIO * RATIO, True), (p, False), (p // RATIO, False)):
        got = mxfp4.quantize_mxfp4(oracle_values(args["k"][i], rope_pos, pro_cos_sin, args["norm_weight"]))
        assert (torch.equal(got[0], packed[0]) and torch.equal(got[1], scales[0])) == ok, rope_pos


def test_nope_negative_zero_through_the_formula(pro_cos_sin):
    k = torch.ones(4, D).bfloat16()
    k[:, 0] = -0.0
    k[:, 1] = -1.0                          # e' = -0*1 - (-1)*0 = +0.0 on the ROCm path
    base = dict(positions=torch.tensor([3, 7, 11, 15]), cos_sin_cache=pro_cos_sin,
                norm_weight=torch.ones(D).bfloat16(), slot_mapping=torch.arange(4),
                kv_cache=torch.zeros(1, 4352, dtype=torch.uint8), shuffle=None)
    codes = {}
    for rounding in ("rocm", "deepseek", "cuda"):
        pool = reference.k_norm_rope_mxfp4_cache(k=k, rounding=rounding, **base)["kv_cache"]
        codes[rounding] = int(pool[0, 0]) & 0xF
    # vLLM's CUDA fused kernels load cos/sin with other=1.0/0.0 for the NoPE pairs: the formula too
    assert codes == {"rocm": 0x0, "deepseek": 0x8, "cuda": 0x0}


def test_rounding_paths_differ_where_they_should(gen, pro_cos_sin):
    args = make_inputs(gen, t=400, pages=8, cs=pro_cos_sin)
    args["slot_mapping"] = torch.arange(400) // 4 + (torch.arange(400) % 4) * 100
    out = {r: reference.k_norm_rope_mxfp4_cache(**args, rounding=r)["kv_cache"] for r in ("rocm", "deepseek", "cuda")}
    assert torch.equal(out["rocm"], out["deepseek"])          # bf16 input, no signed zeros: same bytes
    assert not torch.equal(out["rocm"], out["cuda"])          # one bf16 round instead of two
    # the CUDA fused path takes fp32 pooled rows; the ROCm split path refuses them
    f32 = dict(args, k=args["k"].float() + 1e-3)
    assert not torch.equal(reference.k_norm_rope_mxfp4_cache(**f32, rounding="cuda")["kv_cache"], out["cuda"])
    with pytest.raises(ValueError, match="^k: expected dtype bfloat16"):
        reference.k_norm_rope_mxfp4_cache(**f32)


def test_hadamard_switch_changes_bytes(gen, pro_cos_sin):
    args = make_inputs(gen, cs=pro_cos_sin)
    assert not torch.equal(reference.k_norm_rope_mxfp4_cache(**args)["kv_cache"],
                           reference.k_norm_rope_mxfp4_cache(**args, hadamard=True)["kv_cache"])


def test_rms_norm_is_pinned_to_exact_sum_and_rounded_rsqrt():
    """fp32 out of: exact sum of squares rounded to fp32, / D, + eps in fp32, rsqrt via fp64
    rounded to fp32, then (x * rstd) * w. Written here with numpy, bit for bit."""
    import numpy as np
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4000, D, generator=g) * torch.exp2(torch.randint(-10, 10, (4000, 1), generator=g).float())).bfloat16().float()
    w = (torch.rand(D, generator=g) + 0.5).bfloat16()
    xd = x.double().numpy()
    v = (np.float32((xd * xd).sum(-1)) / np.float32(D) + np.float32(1e-6)).astype(np.float32)
    rstd = (1.0 / np.sqrt(v.astype(np.float64))).astype(np.float32)
    want = (x.numpy() * rstd[:, None]).astype(np.float32) * w.float().numpy()
    assert np.array_equal(rms_norm(x, w, 1e-6).numpy(), want)
    # teeth: an fp32 rsqrt or an fp32 sum of squares gives other bits
    assert not torch.equal(torch.rsqrt(torch.from_numpy(v)), torch.from_numpy(rstd))
    assert not np.array_equal(((x * x).sum(-1) / D).numpy(), (np.float32((xd * xd).sum(-1)) / np.float32(D)))
