"""Each field bug class of NUMERICS.md §10 that concerns the reference, written here by
composing the reference's stage functions, gives a result the reference does not."""
import pytest
import torch

import reference
from reference import fp8, hadamard, layout, mxfp4, pooling, scoring
from reference.k_writer import group_start, k_values, rms_norm, writer_mask
from reference.q_quant import fold_weights, q_values
from reference.rope import bf16_round, cos_sin_at, rope_gptj_tail

D, R, RATIO, PS, H, T, BS = 128, 64, 4, 64, 8, 96, 16
SHUF = [32, 16, 2]


@pytest.fixture(scope="module")
def chain():
    """One request of T tokens through pooling, the K writer and the Q quant."""
    from reference import preset, rope
    p = preset("deepseek-v4-pro")
    cs = rope.cos_sin_cache(T + 8, R, p.rope_base, yarn_factor=p.yarn_factor)
    g = torch.Generator().manual_seed(5)
    blocks = -(-T // BS)
    table = torch.randperm(blocks, generator=g)[None].int()
    pos = torch.arange(T)
    ape = torch.randn(RATIO, 2 * D, generator=g)
    rows = pooling.state_rows(torch.randn(T, 2 * D, generator=g), torch.randn(T, 2 * D, generator=g), ape, pos)
    state = pooling.write_state(torch.zeros(blocks, BS, 4 * D), table, torch.zeros(T, dtype=torch.long), pos, rows)
    slots = torch.where((pos + 1) % RATIO == 0, pos // RATIO, -1)
    w = (torch.rand(D, generator=g) + 0.5).bfloat16()
    pool_args = dict(state_cache=state, block_table=table, positions=pos, req_index=torch.zeros(T, dtype=torch.long),
                     kv_slot_mapping=slots, compress_ratio=RATIO)
    pooled = reference.compress_pool(**pool_args)["pooled"]
    kw = dict(k=pooled, positions=pos, cos_sin_cache=cs, norm_weight=w, slot_mapping=slots,
              kv_cache=torch.zeros(1, 4352, dtype=torch.uint8), norm_eps=1e-6, compress_ratio=RATIO, page_size=PS,
              shuffle=SHUF)
    kv = reference.k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    q = (torch.randn(4, H, D, generator=g) * 2).bfloat16()
    qpos = torch.tensor([T - 1, T - 2, T - 3, 50])
    qw = torch.randn(4, H, generator=g)
    qout = reference.q_rope_mxfp4_quant(q=q, positions=qpos, cos_sin_cache=cs, weights=qw, weights_scale=D ** -0.5 * H ** -0.5)
    row_ends = (qpos + 1) // RATIO
    score_kw = dict(q_fp4=qout["q_fp4"], q_scale=qout["q_scale"], weights=qout["weights"], kv_cache=kv,
                    query_start_loc=torch.tensor([0, 4]), context_lens=torch.tensor([T // RATIO]),
                    block_table=torch.tensor([[0]]), row_ends=row_ends, page_size=PS, shuffle=SHUF)
    logits = scoring.paged_mxfp4_mqa_logits_fp64(**score_kw)
    return dict(pool_args=pool_args, pooled=pooled, kw=kw, kv=kv, q=q, qpos=qpos, qw=qw, qout=qout, cs=cs,
                score_kw=score_kw, logits=logits, sel=writer_mask(pos, slots, RATIO))


def store(c, values, slots=None, shuffle=SHUF, rule="ceil"):
    packed, scales = mxfp4.quantize_mxfp4(values, rule)
    slots = c["kw"]["slot_mapping"][c["sel"]] if slots is None else slots
    return layout.write_entries(c["kw"]["kv_cache"], slots, packed, scales, page_size=PS, shuffle=shuffle)


def sel_values(c, rope_pos=None, **kv):
    pos = c["kw"]["positions"][c["sel"]]
    rp = group_start(pos, RATIO) if rope_pos is None else rope_pos(pos)
    return k_values(c["pooled"][c["sel"]], rp, c["cs"], c["kw"]["norm_weight"], 1e-6, **kv)


def test_chain_recomposes(chain):
    """The composition used below reproduces the op (so the variants differ only by the bug)."""
    assert torch.equal(store(chain, sel_values(chain)), chain["kv"])


def test_pooling_window_shift(chain):
    a = chain["pool_args"]
    pos = a["positions"][chain["sel"]]
    kv, score, _ = pooling.gather_windows(a["state_cache"], a["block_table"], pos - 1, a["req_index"][chain["sel"]], RATIO)
    assert not torch.equal(pooling.softmax_pool(kv, score).bfloat16(), chain["pooled"][chain["sel"]])


def test_pooling_halves_swapped(chain):
    a = chain["pool_args"]
    st = a["state_cache"]
    swapped = torch.cat((st[..., D:2 * D], st[..., :D], st[..., 3 * D:], st[..., 2 * D:3 * D]), -1)
    out = reference.compress_pool(**dict(a, state_cache=swapped))["pooled"]
    assert not torch.equal(out[chain["sel"]], chain["pooled"][chain["sel"]])


def test_neox_rope_and_rope_on_first_dims(chain):
    pos = group_start(chain["kw"]["positions"][chain["sel"]], RATIO)
    cos, sin = cos_sin_at(chain["cs"], pos)
    n = bf16_round(rms_norm(chain["pooled"][chain["sel"]].float(), chain["kw"]["norm_weight"], 1e-6))
    x1, x2 = n[:, D - R:D - R // 2], n[:, D - R // 2:]
    neox = torch.cat((n[:, :D - R], bf16_round(x1 * cos - x2 * sin), bf16_round(x2 * cos + x1 * sin)), -1)
    assert not torch.equal(store(chain, neox), chain["kv"])
    first = torch.cat((rope_gptj_tail(n[:, :R], cos, sin, nope_through_formula=False), n[:, R:]), -1)
    assert not torch.equal(store(chain, first), chain["kv"])


def test_rope_at_p_or_p_over_r(chain):
    assert not torch.equal(store(chain, sel_values(chain, rope_pos=lambda p: p)), chain["kv"])
    assert not torch.equal(store(chain, sel_values(chain, rope_pos=lambda p: p // RATIO)), chain["kv"])


def test_boundary_off_by_one(chain):
    kw = chain["kw"]
    pos = kw["positions"]
    sel = pos % RATIO == 0                                  # the buggy rule: p % r == 0 writes p // r
    slots = pos // RATIO
    kv, score, _ = pooling.gather_windows(chain["pool_args"]["state_cache"], chain["pool_args"]["block_table"],
                                          pos[sel], torch.zeros_like(pos[sel]), RATIO)
    pooled = pooling.softmax_pool(kv, score).bfloat16()      # windows ending at the wrong token
    vals = k_values(pooled, group_start(pos[sel], RATIO), chain["cs"], kw["norm_weight"], 1e-6)
    assert not torch.equal(store(chain, vals, slots=slots[sel]), chain["kv"])


def test_nibbles_swapped_and_ocp_floor(chain):
    packed, scales = mxfp4.quantize_mxfp4(sel_values(chain))
    slots = chain["kw"]["slot_mapping"][chain["sel"]]
    swapped = layout.write_entries(chain["kw"]["kv_cache"], slots, (packed << 4) | (packed >> 4), scales,
                                   page_size=PS, shuffle=SHUF)
    assert not torch.equal(swapped, chain["kv"])
    assert not torch.equal(store(chain, sel_values(chain), rule="ocp-floor"), chain["kv"])


def test_scale_interleave_mismatch_between_writer_and_reader(chain):
    for reader in (None, [16, 16, 4]):
        wrong = scoring.paged_mxfp4_mqa_logits_fp64(**dict(chain["score_kw"], shuffle=reader))
        assert not torch.equal(wrong, chain["logits"])


def test_missing_bf16_round(chain):
    pos = group_start(chain["kw"]["positions"][chain["sel"]], RATIO)
    cos, sin = cos_sin_at(chain["cs"], pos)
    n = rms_norm(chain["pooled"][chain["sel"]].float(), chain["kw"]["norm_weight"], 1e-6)   # no bf16 here
    assert not torch.equal(store(chain, rope_gptj_tail(n, cos, sin)), chain["kv"])
    q_no_round = rope_gptj_tail(chain["q"].float(), *[c[:, None] for c in cos_sin_at(chain["cs"], chain["qpos"])],
                                round_bf16=False, nope_through_formula=False)
    assert not torch.equal(mxfp4.quantize_mxfp4(q_no_round)[0], chain["qout"]["q_fp4"])


def test_fp8_written_ocp_read_fnuz(chain):
    vals = sel_values(chain)
    v, s = fp8.quantize_fp8(vals, "e4m3fn")
    assert not torch.equal(fp8.dequantize_fp8(v, "e4m3fnuz"), fp8.dequantize_fp8(v, "e4m3fn"))


def test_hadamard_on_q_only(chain):
    """Exact scores: both sides rotated equal no rotation; q alone rotated does not."""
    k = sel_values(chain).double()
    q = q_values(chain["q"], chain["qpos"], chain["cs"]).double()
    h = hadamard.hadamard_matrix(D)
    plain = scoring.weighted_relu_logits(q, k, chain["qw"])
    both = scoring.weighted_relu_logits(q @ h, k @ h, chain["qw"])
    q_only = scoring.weighted_relu_logits(q @ h, k, chain["qw"])
    assert torch.allclose(both, plain, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(q_only, plain, rtol=1e-2)


def test_mask_off_by_one_and_missing_mask(chain):
    kw = chain["score_kw"]
    short = scoring.paged_mxfp4_mqa_logits_fp64(**dict(kw, row_ends=chain["qpos"] // RATIO))
    assert not torch.equal(torch.isfinite(short), torch.isfinite(chain["logits"]))
    ends = (chain["qpos"] + 1) // RATIO
    good = reference.topk(logits=chain["logits"], lengths=ends, k=T // RATIO)["indices"]
    bad = reference.topk(logits=chain["logits"], lengths=chain["qpos"] // RATIO, k=T // RATIO)["indices"]
    assert not torch.equal(good, bad)                      # short rows: one index less, one more -1
    good4 = reference.topk(logits=chain["logits"], lengths=ends, k=4)["indices"]
    unmasked = reference.topk(logits=chain["logits"].nan_to_num(neginf=1e6), lengths=torch.full_like(ends, T // RATIO), k=4)
    assert not torch.equal(unmasked["indices"], good4)


def test_weights_scale_missing_or_twice(chain):
    s = D ** -0.5 * H ** -0.5
    for w in (chain["qw"], fold_weights(fold_weights(chain["qw"], s), s)):
        wrong = scoring.paged_mxfp4_mqa_logits_fp64(**dict(chain["score_kw"], weights=w))
        fin = torch.isfinite(wrong)
        assert not torch.allclose(wrong[fin], chain["logits"][fin])


def test_no_32_bit_offset_wrap_past_2_gib():
    stride = 4352
    slot = torch.tensor([600_000 * PS + 37])              # page 600000: ~2.6 GB into the pool
    vo, so = layout.slot_byte_offsets(slot, PS, D, SHUF, stride)
    assert vo.dtype == torch.int64 and int(vo.min()) > 2 ** 31
    assert int(vo[0, 0]) == 600_000 * stride + int(layout.value_offsets(torch.tensor([37]), PS, D, SHUF)[0, 0])
    wrapped = (vo.to(torch.int32))                        # what a 32-bit kernel offset would hold
    assert not torch.equal(wrapped.long(), vo)
