"""Paged scoring (NUMERICS.md §6) against dense and exact oracles, the exact-fp32 fast
core's proof conditions, block tables, row ends, and top-k rules."""
from fractions import Fraction

import pytest
import torch

import reference
from reference import layout, mxfp4, scoring

H, D, PS = 4, 128, 64
SHUF = [32, 16, 2]


def rand_entries(gen, n, lo=118, hi=124, h=None):
    shape = (n,) if h is None else (n, h)
    packed = torch.randint(0, 256, (*shape, D // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.randint(lo, hi, (*shape, 1), generator=gen)
              + torch.randint(0, 2, (*shape, D // 32), generator=gen)).to(torch.uint8)
    return packed, scales


def paged_case(gen, lens=(150, 64, 3), rows=(2, 1, 3), pages=12, shuffle=SHUF, stride=4352):
    """Sequences with permuted block tables over a shared pool; row ends inside each context."""
    pool = torch.randint(0, 256, (pages, stride), dtype=torch.uint8, generator=gen)
    perm = torch.randperm(pages, generator=gen)
    max_pages = max(-(-n // PS) for n in lens)
    table = torch.zeros(len(lens), max_pages, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        np_ = -(-n // PS)
        table[b, :np_] = perm[used:used + np_]
        used += np_
        packed, scales = rand_entries(gen, n)
        slots = scoring.entry_slots(table[b], n, PS)
        pool = layout.write_entries(pool, slots, packed, scales, page_size=PS, shuffle=shuffle)
    q_fp4, q_scale = rand_entries(gen, sum(rows), h=H)
    qsl = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    row_ends = torch.cat([torch.randint(1, n + 1, (r,), generator=gen) for n, r in zip(lens, rows)]).int()
    row_ends[0] = lens[0]
    return dict(q_fp4=q_fp4, q_scale=q_scale, weights=torch.randn(sum(rows), H, generator=gen), kv_cache=pool,
                query_start_loc=qsl, context_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
                row_ends=row_ends, page_size=PS, shuffle=shuffle)


def dense_loop(kw):
    """fp64, one row and one entry at a time, keys found by the slot formula."""
    q = mxfp4.dequantize_mxfp4(kw["q_fp4"], kw["q_scale"], torch.float64)
    width = kw["block_table"].shape[1] * PS
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float64)
    qsl = kw["query_start_loc"].tolist()
    for b in range(len(qsl) - 1):
        for r in range(qsl[b], qsl[b + 1]):
            for j in range(int(kw["row_ends"][r])):
                slot = int(kw["block_table"][b, j // PS]) * PS + j % PS
                p, s = layout.read_entries(kw["kv_cache"], torch.tensor([slot]), page_size=PS, head_dim=D,
                                           shuffle=kw["shuffle"])
                k = mxfp4.dequantize_mxfp4(p, s, torch.float64)[0]
                out[r, j] = float((kw["weights"][r].double() * (q[r] @ k).clamp_min(0)).sum())
    return out


@pytest.mark.parametrize("shuffle", [SHUF, None])
def test_paged_logits_match_dense_loop(gen, shuffle):
    kw = paged_case(gen, shuffle=shuffle)
    got = scoring.paged_mxfp4_mqa_logits_fp64(**kw)
    want = dense_loop(kw)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)                 # row_ends mask, -inf past it
    assert torch.allclose(got[fin], want[fin], rtol=1e-14, atol=0)
    f32 = reference.paged_mxfp4_mqa_logits(**kw)["logits"]
    assert f32.dtype == torch.float32 and torch.equal(f32, got.float())


def test_block_table_permutation_and_pool_placement_do_not_matter(gen):
    kw = paged_case(gen)
    base = scoring.paged_mxfp4_mqa_logits_fp64(**kw)
    perm = torch.randperm(kw["kv_cache"].shape[0], generator=gen)       # page p moves to perm[p]
    pool = torch.empty_like(kw["kv_cache"])
    pool[perm] = kw["kv_cache"]
    moved = dict(kw, kv_cache=pool, block_table=perm[kw["block_table"].long()].int())
    assert torch.equal(scoring.paged_mxfp4_mqa_logits_fp64(**moved), base)
    # teeth: the same pool read through a table with two pages swapped gives other scores
    swapped = kw["block_table"].clone()
    swapped[0, :2] = swapped[0, :2].flip(0)
    assert not torch.equal(scoring.paged_mxfp4_mqa_logits_fp64(**dict(kw, block_table=swapped)), base)


def exact_logit(q64, k64, w):
    """Exact rational value of sum_h w_h relu(q_h . k)."""
    total = Fraction(0)
    for h in range(q64.shape[0]):
        dot = sum((Fraction(a) * Fraction(b) for a, b in zip(q64[h].tolist(), k64.tolist())), Fraction(0))
        total += Fraction(float(w[h])) * max(dot, Fraction(0))
    return total


def test_fp64_accuracy_claim_and_exact_fp32_columns(gen):
    kq, sq = rand_entries(gen, 3, h=H)
    kk, sk = rand_entries(gen, 24)
    sk[8:16, 0] = 100                     # a wide block-exponent spread: not provably exact in fp32
    sk[16:20] = 1                         # tiny blocks, subnormal fp32 products
    kk[20:24, :16] = 0                    # dead first block with an extreme scale byte
    sk[20:24, 0] = 254
    w = torch.randn(3, H, generator=gen)
    fast = scoring.exact_f32_columns(kq, sq, kk, sk)
    assert fast[:8].all() and not fast[8:20].any() and fast[20:].all()
    got = scoring.mxfp4_relu_logits(kq, sq, kk, sk, w)
    q64 = mxfp4.dequantize_mxfp4(kq, sq, torch.float64)
    k64 = mxfp4.dequantize_mxfp4(kk, sk, torch.float64)
    for r in range(3):
        for j in range(24):
            ex = exact_logit(q64[r], k64[j], w[r])
            bound = sum(abs(float(w[r, h])) * max(float(q64[r, h] @ k64[j]), 0.0) for h in range(H)) * 2.0 ** -50
            assert abs(Fraction(float(got[r, j])) - ex) <= Fraction(bound) + Fraction(2) ** -1074, (r, j)
    # the fp32 dots of the flagged columns are exact; a flagged-wide column is not (teeth)
    q32 = scoring.dequantize_mxfp4_f32(kq, sq).double()
    k32 = scoring.dequantize_mxfp4_f32(kk, sk).double()
    f32_dots = (scoring.dequantize_mxfp4_f32(kq, sq) @ scoring.dequantize_mxfp4_f32(kk, sk).T).double()
    exact_dots = q64 @ k64.T
    assert torch.equal(f32_dots[..., fast], exact_dots[..., fast])
    assert not torch.equal(f32_dots[..., 8:16], exact_dots[..., 8:16])
    assert torch.equal(q32, q64) and torch.equal(k32[:16], k64[:16])


def test_fast_core_falls_back_where_fp32_would_round(gen):
    """Block exponents 13 binades apart, and products below fp32's subnormal grid: fp32 dots
    round there, so those columns must come from the fp64 core."""
    kq, sq = rand_entries(gen, 2, lo=120, hi=121, h=H)
    kk, sk = rand_entries(gen, 64, lo=120, hi=121)
    sk[:32, 1] = 107                                  # spread 13 (+1 jitter): fp32 sums lose bits
    w = torch.randn(2, H, generator=gen)
    q64 = mxfp4.dequantize_mxfp4(kq, sq, torch.float64)
    k64 = mxfp4.dequantize_mxfp4(kk, sk, torch.float64)
    f32 = (scoring.dequantize_mxfp4_f32(kq, sq) @ scoring.dequantize_mxfp4_f32(kk, sk).T).double()
    assert not torch.equal(f32[..., :32], q64 @ k64.T[:, :32])             # the hazard is real
    assert not scoring.exact_f32_columns(kq, sq, kk, sk)[:32].any()
    plain = scoring.weighted_relu_logits(q64, k64, w)
    assert torch.allclose(scoring.mxfp4_relu_logits(kq, sq, kk, sk, w), plain, rtol=1e-15, atol=0)
    # tiny: q and k scales near 2**-75 each put products at 2**-152 and below
    sq_t, sk_t = torch.full_like(sq, 52), torch.full_like(sk, 53)
    q64 = mxfp4.dequantize_mxfp4(kq, sq_t, torch.float64)
    k64 = mxfp4.dequantize_mxfp4(kk, sk_t, torch.float64)
    f32 = (scoring.dequantize_mxfp4_f32(kq, sq_t) @ scoring.dequantize_mxfp4_f32(kk, sk_t).T).double()
    assert not torch.equal(f32, q64 @ k64.T)
    assert not scoring.exact_f32_columns(kq, sq_t, kk, sk_t).any()
    plain = scoring.weighted_relu_logits(q64, k64, w)
    assert torch.allclose(scoring.mxfp4_relu_logits(kq, sq_t, kk, sk_t, w), plain, rtol=1e-15, atol=0)


def test_fast_core_equals_plain_fp64_core(gen):
    kq, sq = rand_entries(gen, 5, h=H)
    kk, sk = rand_entries(gen, 3000, lo=110, hi=126)
    sk[::7, 2] = 90
    kk[::11] = 0
    w = torch.randn(5, H, generator=gen)
    fast = scoring.mxfp4_relu_logits(kq, sq, kk, sk, w)
    plain = scoring.weighted_relu_logits(mxfp4.dequantize_mxfp4(kq, sq, torch.float64),
                                         mxfp4.dequantize_mxfp4(kk, sk, torch.float64), w)
    assert torch.allclose(fast, plain, rtol=1e-15, atol=1e-300)
    # NaN scale bytes give NaN scores on both paths, never a number
    sk[5, 1] = 255
    assert torch.isnan(scoring.mxfp4_relu_logits(kq, sq, kk, sk, w)[:, 5]).all()
    sq[0, 0, 0] = 255
    assert torch.isnan(scoring.mxfp4_relu_logits(kq, sq, kk, sk, w)[0]).all()


# --- top-k -----------------------------------------------------------------------------

def test_topk_short_rows_in_order_then_minus_one():
    logits = torch.randn(3, 10)
    out = reference.topk(logits=logits, lengths=torch.tensor([0, 3, 4]), k=4)["indices"]
    assert out.dtype == torch.int32
    assert out.tolist() == [[-1, -1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3]]


def test_topk_long_rows_are_the_best_set_within_length(gen):
    logits = torch.randn(4, 300, generator=gen)
    logits[:, 250:] = 100.0                       # past each row's length: must never be chosen
    lengths = torch.tensor([250, 120, 9, 250])
    out = reference.topk(logits=logits, lengths=lengths, k=8)["indices"]
    for r in range(4):
        n = int(lengths[r])
        want = set(logits[r, :n].topk(8).indices.tolist())
        assert set(out[r].tolist()) == want and len(set(out[r].tolist())) == 8
    # width < k: every row is short
    out = reference.topk(logits=torch.randn(2, 5), lengths=torch.tensor([5, 2]), k=16)["indices"]
    assert out.tolist() == [[0, 1, 2, 3, 4] + [-1] * 11, [0, 1] + [-1] * 14]


def test_topk_rejects_nan_in_valid_region():
    logits = torch.randn(2, 6)
    logits[1, 5] = float("nan")
    reference.topk(logits=logits, lengths=torch.tensor([6, 5]), k=2)          # NaN past the end: fine
    with pytest.raises(reference.NonFiniteInput, match="logits"):
        reference.topk(logits=logits, lengths=torch.tensor([6, 6]), k=2)


def test_cores_by_scale_spread_and_their_exactness(gen):
    """Each column goes to the first core proved exact for it: narrow spreads to one fp32
    matmul, wide (here 12 binades per side) to one fp64 matmul, wider than 38 binades to
    per-block fp32 dots summed in fp64, NaN/extreme bytes to the generic fp64 dot; the
    exact cores agree with the exact rational logits."""
    kq, sq = rand_entries(gen, 2, h=H)
    sq = torch.randint(115, 127, sq.shape, generator=gen).to(torch.uint8)       # 12 binades
    kk, sk = rand_entries(gen, 40)
    sk[10:20] = torch.randint(115, 127, (10, D // 32), generator=gen).to(torch.uint8)
    sk[20:30, 0], sk[20:30, 1:] = 150, 105                                     # 45 binades
    sk[30:35, 2] = 253                                                          # fp32 cannot hold it
    cores = scoring.column_cores(kq, sq, kk, sk)
    assert (cores[:10] == scoring.CORE_F64).all()          # q alone spans 12: no fp32 proof
    assert (cores[10:20] == scoring.CORE_F64).all()
    assert (cores[20:30] == scoring.CORE_BLOCKS).all()
    assert (cores[30:35] == scoring.CORE_FP64_GENERIC).all()
    narrow = scoring.column_cores(kq, torch.full_like(sq, 120), kk[:10], sk[:10])
    assert (narrow == scoring.CORE_F32).all()
    w = torch.randn(2, H, generator=gen)
    got = scoring.mxfp4_relu_logits(kq, sq, kk, sk, w)
    q64 = mxfp4.dequantize_mxfp4(kq, sq, torch.float64)
    k64 = mxfp4.dequantize_mxfp4(kk, sk, torch.float64)
    for r in range(2):
        for jj in (0, 12, 25, 31):
            ex = exact_logit(q64[r], k64[jj], w[r])
            bound = sum(abs(float(w[r, h])) * max(float(q64[r, h] @ k64[jj]), 0.0) for h in range(H)) * 2.0 ** -50
            assert abs(Fraction(float(got[r, jj])) - ex) <= Fraction(bound) + Fraction(2) ** -1074, (r, jj)
    # the dots themselves: exact on the fp64 and block cores
    q32 = scoring.dequantize_mxfp4_f32(kq, sq)
    k32 = scoring.dequantize_mxfp4_f32(kk[:30], sk[:30])
    exact_dots = torch.tensor([[[float(sum((Fraction(a) * Fraction(b) for a, b in zip(q64[r, h].tolist(),
                                                                                       k64[jj].tolist())), Fraction(0)))
                                 for jj in range(30)] for h in range(H)] for r in range(2)], dtype=torch.float64)
    f64_dots = q32.double() @ k32.double().T
    assert torch.equal(f64_dots[..., :20], exact_dots[..., :20])
    # teeth: one fp32 matmul rounds on these spreads
    f32_dots = (q32 @ k32.T).double()
    assert not torch.equal(f32_dots[..., :20], exact_dots[..., :20])
    # 39 binades: past the fp64 proof, the block core's dots are still exact
    sq1 = torch.full_like(sq, 120)
    sk1 = torch.full((6, D // 32), 111, dtype=torch.uint8)
    sk1[:, 0] = 150
    assert (scoring.column_cores(kq, sq1, kk[:6], sk1) == scoring.CORE_BLOCKS).all()
    q1, k1 = scoring.dequantize_mxfp4_f32(kq, sq1), scoring.dequantize_mxfp4_f32(kk[:6], sk1)
    blk = (q1.view(2, H, 4, 32).transpose(1, 2) @ k1.view(6, 4, 32).permute(1, 2, 0)).double().sum(1)
    q1e, k1e = mxfp4.dequantize_mxfp4(kq, sq1, torch.float64), mxfp4.dequantize_mxfp4(kk[:6], sk1, torch.float64)
    exact1 = torch.tensor([[[float(sum((Fraction(a) * Fraction(b) for a, b in zip(q1e[r, h].tolist(), k1e[jj].tolist())),
                                       Fraction(0))) for jj in range(6)] for h in range(H)] for r in range(2)],
                          dtype=torch.float64)
    assert torch.equal(blk, exact1)


def test_cores_give_the_generic_values(gen):
    """Whatever core a column takes, the logits equal the generic fp64 core's (past 40
    binades, where neither dot is exactly representable, to fp64 accuracy)."""
    kq, sq = rand_entries(gen, 3, h=H)
    kk, sk = rand_entries(gen, 900)
    sk[::5] = torch.randint(110, 122, (180, D // 32), generator=gen).to(torch.uint8)
    sk[::17, 1] = 165
    sk[::23, 2] = 254
    w = torch.randn(3, H, generator=gen)
    cores = scoring.column_cores(kq, sq, kk, sk)
    assert set(cores.tolist()) == {0, 1, 2, 3}
    plain = scoring.weighted_relu_logits(mxfp4.dequantize_mxfp4(kq, sq, torch.float64),
                                         mxfp4.dequantize_mxfp4(kk, sk, torch.float64), w)
    got = scoring.mxfp4_relu_logits(kq, sq, kk, sk, w)
    exact = cores != scoring.CORE_BLOCKS
    assert torch.allclose(got[:, exact], plain[:, exact], rtol=1e-15, atol=0)
    scale = plain[:, ~exact].abs().amax(1, keepdim=True)
    assert bool(((got[:, ~exact] - plain[:, ~exact]).abs() <= 1e-13 * scale).all())


# --- many sequences at once (the GPU's default path), against one sequence at a time -----

def group_operands(gen, g, r, h, j, mode):
    """Queries [g, r, h], keys [g, j] with scale bytes by `mode`; dead blocks, all-zero and
    all -0.0 vectors planted."""
    def vecs(shape):
        packed = torch.randint(0, 256, (*shape, D // 2), dtype=torch.uint8, generator=gen)
        if mode == "realistic":
            sc = torch.randint(118, 124, (*shape, 1), generator=gen) + torch.randint(0, 2, (*shape, D // 32), generator=gen)
        elif mode == "int8-edge":     # spreads of exactly 3 anywhere in e8m0's range, 0 and 254 included
            sc = torch.randint(0, 252, (*shape, 1), generator=gen) + torch.randint(0, 4, (*shape, D // 32), generator=gen)
            sc.view(-1, D // 32)[::3] = torch.tensor([0, 3, 1, 2])
            sc.view(-1, D // 32)[1::3] = torch.tensor([254, 251, 252, 253])
        elif mode == "fp64":          # 12 binades per vector: past the fp32 proof, inside fp64's
            sc = torch.randint(110, 120, (*shape, 1), generator=gen) + torch.tensor([0, 12, 0, 1])
        elif mode == "spread-4":
            sc = torch.randint(100, 130, (*shape, 1), generator=gen) + torch.tensor([0, 4, 1, 2])
        else:                         # wide: 40 binades per vector
            sc = torch.randint(100, 140, (*shape, D // 32), generator=gen)
        flat = packed.view(-1, D // 2)
        flat[::7] = 0                                    # all-zero vectors
        flat[2::7] = 0x88                                # all -0.0
        flat[3::5, :16] = 0x80                           # a dead first block (its scale byte is free)
        sc.view(-1, D // 32)[3::5, 0] = 0
        return packed, sc.clamp(0, 254).to(torch.uint8)
    qp, qs = vecs((g, r, h))
    kp, ks = vecs((g, j))
    w = torch.randn(g, r, h, generator=gen)
    w.view(-1)[::11] = 0.0
    w.view(-1)[1::13] = -0.0
    n = torch.randint(1, j + 1, (g,), generator=gen)
    n[0] = j
    return qp, qs, kp, ks, w, n


def bits_equal_valid(a, b, n):
    valid = torch.arange(a.shape[-1])[None, None, :] < n[:, None, None]
    return bool(((a.view(torch.int64) == b.view(torch.int64)) | ~valid).all())


def same_sum_valid(a, b, n, mag, h):
    """Equal up to the order of the fp64 head sum: every dot is exact and every product
    w * relu(dot) too, so two orders differ by at most 2 * H * 2**-53 * sum_h |w| relu(dot)
    (`mag`); the matmul libraries pick the order by shape."""
    valid = torch.arange(a.shape[-1])[None, None, :] < n[:, None, None]
    ok = (a - b).abs() <= 2 * h * 2.0 ** -53 * mag
    return bool((ok | ~valid).all())


# the bulk path each mode takes without the int8 core (None: one sequence at a time)
BULK = {"realistic": torch.float32, "fp64": torch.float64, "int8-edge": None, "wide": None}


@pytest.mark.parametrize("mode", list(BULK))
@pytest.mark.parametrize("shape", [(5, 1, 32, 333), (2, 7, 8, 100), (3, 3, 4, 64)])
def test_batched_cores_give_the_per_sequence_bits(gen, monkeypatch, mode, shape):
    """Exact dots; the head sums agree to the bit where the shapes match, else within the
    fp64 rounding of a 64-term sum; CORE_I8 gives the dense fp32 core's bits exactly."""
    g, r, h, j = shape
    qp, qs, kp, ks, w, n = group_operands(gen, g, r, h, j, mode)
    one = scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=False)
    mag = scoring.grouped_relu_logits(qp, qs, kp, ks, w.abs(), n, batched=False)
    monkeypatch.setitem(scoring._GROUP_TILE_ELEMS, "cpu", h * 64 * 3)   # several row and group tiles
    used = []
    dense = scoring._dense_logits
    monkeypatch.setattr(scoring, "_dense_logits", lambda *a: used.append(a[-1]) or dense(*a))
    got = scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=True, int8=False)
    assert same_sum_valid(got, one, n, mag, h), (mode, shape)
    assert used == ([BULK[mode]] if BULK[mode] else [])
    if BULK[mode] is None:
        assert bits_equal_valid(got, one, n)             # one sequence at a time: the same calls
    i8 = scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=True, int8=True)
    assert same_sum_valid(i8, one, n, mag, h), (mode, shape, "int8")
    if BULK[mode] == torch.float32:
        assert bits_equal_valid(i8, got, n)


def test_int8_core_serves_spreads_up_to_3_and_its_bound_has_teeth(gen, monkeypatch):
    qp, qs, kp, ks, w, n = group_operands(gen, 2, 2, 16, 72, "int8-edge")
    _, _, spread = scoring.int8_operand(kp, ks)
    assert int(spread.max()) == 3
    called = []
    real = scoring._i8_logits
    monkeypatch.setattr(scoring, "_i8_logits", lambda *a: called.append(1) or real(*a))
    one = scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=True, int8=False)
    assert bits_equal_valid(scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=True, int8=True), one, n)
    assert called
    # a spread of 4 overflows int8 (12 * 2**4 = 192): the core is refused, and would be wrong
    qp, qs, kp, ks, w, n = group_operands(gen, 2, 2, 16, 72, "spread-4")
    one = scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=True, int8=False)
    mag = scoring.grouped_relu_logits(qp, qs, kp, ks, w.abs(), n, batched=False)
    called.clear()
    assert bits_equal_valid(scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=True, int8=True), one, n)
    assert not called
    monkeypatch.setattr(scoring, "_I8_SPREAD", 4)
    assert not same_sum_valid(scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=True, int8=True),
                              one, n, mag, 16)


@pytest.mark.parametrize("batched", [(), ("cpu",)])
def test_paged_scorer_groups_sequences_by_rows(gen, monkeypatch, batched):
    """Sequences of 2, 1, 2, 1 and 3 rows (three groups, pages past a sequence's end read
    from its first page), batched or not: the dense loop's values, -inf past row ends."""
    monkeypatch.setattr(scoring, "BATCHED_DEVICES", batched)
    monkeypatch.setattr(scoring, "INT8_DEVICES", batched)
    kw = paged_case(gen, lens=(150, 64, 70, 3, 129), rows=(2, 1, 2, 1, 3), pages=16)
    got = scoring.paged_mxfp4_mqa_logits_fp64(**kw)
    ref = dense_loop(kw)
    assert torch.equal(got.isinf(), ref.isinf())
    assert torch.allclose(got[~ref.isinf()], ref[~ref.isinf()], rtol=1e-15, atol=0)


def test_batched_path_reports_a_nan_scale_by_sequence(gen, monkeypatch):
    monkeypatch.setattr(scoring, "BATCHED_DEVICES", ("cpu",))
    kw = paged_case(gen, lens=(150, 64, 70), rows=(1, 1, 1), pages=8)
    slot = int(kw["block_table"][2, 0]) * PS + 5
    _, so = layout.slot_byte_offsets(torch.tensor([slot]), PS, D, kw["shuffle"], kw["kv_cache"].shape[1])
    kw["kv_cache"].view(-1)[so[0, 1]] = 255
    with pytest.raises(reference.NonFiniteInput, match="sequence 2's entries"):
        scoring.paged_mxfp4_mqa_logits_fp64(**kw)


@pytest.mark.parametrize("shuffle,stride", [(SHUF, 4352), ([16, 16, 4], 4352), (None, 4353), ([32, 8, 2], 4360)])
def test_paged_int8_keys_give_the_grouped_int8_bits(gen, monkeypatch, shuffle, stride):
    """CORE_I8 read straight from the pages (one add, one gather) gives the bits of CORE_I8
    on the unshuffled keys, for every layout; a tile narrower than a block (Dt = 8), a key
    whose scale bytes span 4 binades, or a dead block's stray byte makes it step aside."""
    monkeypatch.setattr(scoring, "BATCHED_DEVICES", ("cpu",))
    monkeypatch.setattr(scoring, "INT8_DEVICES", ("cpu",))
    kw = paged_case(gen, lens=(150, 64, 70, 3, 129), rows=(2, 1, 2, 1, 3), pages=16, shuffle=shuffle, stride=stride)
    used = []
    real = scoring.paged_int8_keys
    monkeypatch.setattr(scoring, "paged_int8_keys", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    got = scoring.paged_mxfp4_mqa_logits_fp64(**kw)
    assert used and all(u is None for u in used) == (shuffle == [32, 8, 2])
    monkeypatch.setattr(scoring, "paged_int8_keys", lambda *a, **k: None)
    want = scoring.paged_mxfp4_mqa_logits_fp64(**kw)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    ref = dense_loop(kw)
    assert torch.allclose(got[~ref.isinf()], ref[~ref.isinf()], rtol=1e-15, atol=0)


def test_paged_int8_keys_step_aside_past_a_spread_of_3(gen, monkeypatch):
    """The paged CORE_I8 is computed before its spreads are read (one host sync per group);
    a key whose scale bytes span 4 binades makes the group fall back, and the values hold."""
    monkeypatch.setattr(scoring, "BATCHED_DEVICES", ("cpu",))
    monkeypatch.setattr(scoring, "INT8_DEVICES", ("cpu",))
    kw = paged_case(gen, lens=(150, 64), rows=(2, 2), pages=8)    # one group
    slot = int(kw["block_table"][1, 0]) * PS + 5
    vo, so = layout.slot_byte_offsets(torch.tensor([slot]), PS, D, kw["shuffle"], kw["kv_cache"].shape[1])
    flat = kw["kv_cache"].view(-1)
    base = int(flat[so[0, 1]])
    for b, v in enumerate((base, base + 4, base, base)):
        flat[so[0, b]] = v
    i8, fallback = [], []
    real, grouped = scoring._i8_logits, scoring.grouped_relu_logits
    monkeypatch.setattr(scoring, "_i8_logits", lambda *a: i8.append(1) or real(*a))
    monkeypatch.setattr(scoring, "grouped_relu_logits", lambda *a, **k: fallback.append(1) or grouped(*a, **k))
    got = scoring.paged_mxfp4_mqa_logits_fp64(**kw)
    want = dense_loop(kw)
    assert fallback and len(i8) == 1                 # the paged try only: spread 4 rules CORE_I8 out
    assert torch.allclose(got[~want.isinf()], want[~want.isinf()], rtol=1e-15, atol=0)
    # the same span in a dead (all-zero) block: the paged read (all blocks) steps aside, the
    # grouped core's live-block spread still allows CORE_I8, and the values hold
    flat[vo[0, 16:32]] = 0
    i8.clear()
    fallback.clear()
    got = scoring.paged_mxfp4_mqa_logits_fp64(**kw)
    want = dense_loop(kw)
    assert fallback and len(i8) == 2
    assert torch.allclose(got[~want.isinf()], want[~want.isinf()], rtol=1e-15, atol=0)
    # and ignoring the flag would have been wrong: the paged values differ there
    monkeypatch.setattr(scoring, "grouped_relu_logits", lambda *a, **k: pytest.fail("fallback"))
    base_ok = scoring._paged_i8_logits
    monkeypatch.setattr(scoring, "_paged_i8_logits", lambda *a: (base_ok(*a)[0], torch.tensor(True)))
    flat[vo[0, 16:32]] = 0x77
    assert not torch.allclose(scoring.paged_mxfp4_mqa_logits_fp64(**kw)[~want.isinf()], dense_loop(kw)[~want.isinf()],
                              rtol=1e-15, atol=0)


# --- the CPU's table-decoded cores (one sequence at a time) ----------------------------

def bits(a):
    return a.contiguous().view(torch.int64)


def cpu_case(gen, r, h, j, q_lo_hi, k_mode):
    """Queries with scale bytes q_lo_hi[0] + [0, q_lo_hi[1]); keys by k_mode; dead blocks,
    all-zero and all -0.0 vectors, zero and -0.0 weights planted."""
    qp, qs = rand_entries(gen, r, h=h)
    qs = (torch.randint(q_lo_hi[0], q_lo_hi[0] + q_lo_hi[1], qs.shape, generator=gen)).to(torch.uint8)
    kp, ks = rand_entries(gen, j)
    if k_mode == "spread-3":          # e8m0's extremes included
        ks = (torch.randint(0, 252, (j, 1), generator=gen) + torch.randint(0, 4, (j, D // 32), generator=gen))
        ks[::5] = torch.tensor([0, 3, 1, 2])
        ks[1::5] = torch.tensor([254, 251, 252, 253])
    elif k_mode == "spread-11":
        ks = torch.randint(100, 140, (j, 1), generator=gen) + torch.randint(0, 12, (j, D // 32), generator=gen)
        ks[::4] = torch.tensor([0, 11, 7, 1])
        ks[1::4] = torch.tensor([243, 254, 244, 250])
    elif k_mode == "mixed":           # every core: int8, fp64 table, column cores, NaN
        ks = torch.randint(115, 119, (j, D // 32), generator=gen)
        ks[::3] = torch.randint(110, 126, (ks[::3].shape[0], D // 32), generator=gen)
        ks[::7, 1] = 165
        ks[::11, 2] = 255
    ks = ks.clamp(0, 255).to(torch.uint8)
    kp[::9] = 0
    kp[4::9] = 0x88
    kp[2::5, 16:32] = 0x80            # a dead block whose scale byte is off by far
    ks[2::5, 1] = ks[2::5, 1] // 2
    w = torch.randn(r, h, generator=gen)
    w.view(-1)[::11] = 0.0
    w.view(-1)[1::13] = -0.0
    return qp, qs, kp, ks, w


def generic(qp, qs, kp, ks, w):
    return scoring.weighted_relu_logits(mxfp4.dequantize_mxfp4(qp, qs, torch.float64),
                                        mxfp4.dequantize_mxfp4(kp, ks, torch.float64), w)


@pytest.mark.parametrize("case", [
    ((2, 64, 333), (118, 4), "spread-3", "int8"),
    ((3, 8, 300), (0, 4), "spread-3", "int8"),
    ((2, 16, 300), (118, 4), "spread-11", "fp64"),
    ((2, 16, 300), (100, 20), "spread-3", "fp64"),                   # q spans 19: no int8
    ((2, 16, 400), (118, 3), "mixed", None),
])
def test_cpu_table_cores_give_the_generic_fp64_bits(gen, monkeypatch, case):
    """Every column of `mxfp4_relu_logits` on a CPU has the bits of the generic fp64 core
    (exactly dequantized operands, one fp64 matmul, relu, the fp64 head sum), whichever
    core scores it; key chunks and row tiles split the work several ways. Keys with a
    dead block of a far-off scale byte (every 5th) may go to a slower core, never wrong."""
    (r, h, j), qsc, k_mode, main = case
    qp, qs, kp, ks, w = cpu_case(gen, r, h, j, qsc, k_mode)
    monkeypatch.setattr(scoring, "_CPU_KEYS", 128)                    # 3 chunks, a short tail
    monkeypatch.setattr(scoring, "_CPU_TILE", h * 128)               # one row per tile
    used = {}
    real = scoring._table_core
    monkeypatch.setattr(scoring, "_table_core", lambda q, *a: used.update(
        {("int8" if q.dtype == torch.int8 else "fp64"): a[1].shape[0]}) or real(q, *a))
    got = scoring.mxfp4_relu_logits(qp, qs, kp, ks, w)
    want = generic(qp, qs, kp, ks, w)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    exact = scoring.column_cores(qp, qs, kp, ks) != scoring.CORE_BLOCKS   # past 40 binades: 3 sums round
    assert torch.equal(bits(got[~nan & exact]), bits(want[~nan & exact]))
    if main is None:
        assert set(used) == {"int8", "fp64"} and sum(used.values()) < j and (~exact).any() and nan.any()
        blk = ~exact & ~nan
        assert bool(((got - want).abs()[blk] <= 1e-13 * want.abs().nan_to_num(0).amax(1, keepdim=True).expand_as(want)[blk]).all())
    else:
        assert used[main] >= j - len(range(2, j, 5)) and sum(used.values()) <= j


def wrong_with_bound(monkeypatch, name, value, lut, score, want) -> bool:
    """Whether `score()` goes wrong (off `want` by more than 1e-3) with scoring.`name` raised
    to `value` (its cached table `lut` rebuilt for it, and again after)."""
    monkeypatch.setattr(scoring, name, value)
    lut.cache_clear()
    try:
        return not torch.allclose(score(), want, rtol=1e-3)
    finally:
        monkeypatch.undo()
        lut.cache_clear()


def test_cpu_table_cores_bounds_have_teeth(gen, monkeypatch):
    """The bounds that send a column to a core are needed: a key spread of 4 overflows the
    int8 operand (12 * 2**4 > 127), one of 12 the fp64 core's int16 decode, and an fp32
    matmul rounds the spreads the fp64 core takes."""
    qp, qs, kp, ks, w = cpu_case(gen, 2, 16, 200, (118, 4), "spread-11")
    ks = ks.clamp(100, 150)
    ks[:, 0] = ks[:, 1] + 4
    ks[:, 2:] = ks[:, 1:2]
    want = generic(qp, qs, kp, ks, w)
    assert torch.equal(bits(scoring.mxfp4_relu_logits(qp, qs, kp, ks, w)), bits(want))
    assert wrong_with_bound(monkeypatch, "_I8_SPREAD", 4, scoring._shifted_word_lut,
                            lambda: scoring.mxfp4_relu_logits(qp, qs, kp, ks, w), want)
    # a key spread of 12 overflows the fp64 core's int16 decode (12 * 2**12 > 32767)
    ks12 = ks.clone()
    ks12[:, 0] = ks12[:, 1] + 12
    want = generic(qp, qs, kp, ks12, w)
    assert torch.equal(bits(scoring.mxfp4_relu_logits(qp, qs, kp, ks12, w)), bits(want))
    assert wrong_with_bound(monkeypatch, "_F64_SHIFTS", 12, scoring._shift_byte_lut_i16,
                            lambda: scoring.mxfp4_relu_logits(qp, qs, kp, ks12, w), want)
    qp, qs, kp, ks, w = cpu_case(gen, 2, 16, 200, (110, 12), "spread-11")
    q32 = scoring.dequantize_mxfp4_f32(qp, qs)
    f32 = torch.matmul(q32, scoring.dequantize_mxfp4_f32(kp, ks).T).double()
    exact = torch.matmul(q32.double(), scoring.dequantize_mxfp4_f32(kp, ks, torch.float64).T)
    assert not torch.equal(f32, exact)
    assert torch.equal(bits(scoring.mxfp4_relu_logits(qp, qs, kp, ks, w)), bits(generic(qp, qs, kp, ks, w)))


def test_cpu_int8_core_needs_an_exact_int8_gemm(gen, monkeypatch):
    """An int8 GEMM that saturates (u8 x s8 pair sums in int16, the way some int8 GEMMs
    without VNNI compute s8 x s8) is caught by the probe; the int8 core is then never used,
    and the values hold."""
    before = scoring._cpu_int_mm_exact()                              # this machine's answer
    qp, qs, kp, ks, w = cpu_case(gen, 2, 16, 100, (118, 4), "spread-3")
    real = torch._int_mm

    def saturating(a, b, out=None):
        u = a.long() + 128                                               # u8 = s8 + 128
        pairs = (u[:, None, :] * b.T.long()[None]).view(a.shape[0], b.shape[1], -1, 2).sum(-1)
        res = (pairs.clamp(-32768, 32767).sum(-1) - 128 * b.long().sum(0)[None]).int()
        return out.copy_(res) if out is not None else res
    small = torch.randint(-12, 13, (3, 32), dtype=torch.int8, generator=gen)
    assert torch.equal(saturating(small, small.T), real(small, small.T))        # the model is right
    monkeypatch.setattr(torch, "_int_mm", saturating)
    scoring._cpu_int_mm_exact.cache_clear()
    try:
        assert not scoring._cpu_int_mm_exact()
        used = []
        core = scoring._table_core
        monkeypatch.setattr(scoring, "_table_core", lambda q, *a: used.append(q.dtype) or core(q, *a))
        got = scoring.mxfp4_relu_logits(qp, qs, kp, ks, w)
        assert torch.int8 not in used
        assert torch.equal(bits(got), bits(generic(qp, qs, kp, ks, w)))
        monkeypatch.setattr(scoring, "_cpu_int_mm_exact", lambda: True)     # teeth: it would be wrong
        assert not torch.equal(scoring.mxfp4_relu_logits(qp, qs, kp, ks, w), got)
    finally:
        monkeypatch.undo()
        scoring._cpu_int_mm_exact.cache_clear()
    assert scoring._cpu_int_mm_exact() == before                         # the probe is not left stuck


def test_dequantize_mxfp4_f32_is_exact_for_every_scale_byte(gen):
    kp = torch.randint(0, 256, (256, D // 2), dtype=torch.uint8, generator=gen)
    ks = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, D // 32).contiguous()
    want = mxfp4.dequantize_mxfp4(kp, ks, torch.float64)
    got = scoring.dequantize_mxfp4_f32(kp, ks, torch.float64)
    assert torch.equal(got.isnan(), want.isnan()) and want[255].isnan().all()
    assert torch.equal(bits(got[:255]), bits(want[:255]))
    got32 = scoring.dequantize_mxfp4_f32(kp, ks)
    assert got32.dtype == torch.float32 and torch.equal(got32[:253].double(), want[:253])
    assert got32[253:255].abs().amax() == float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_picks_torch_topk_choice_over_each_row_masked(gen, dtype):
    """The indices are torch.topk's over the fp64 row with -inf past its length, whichever
    shortcut serves it (no copy when every row is long and full; one masking pass when
    some end early; short rows in order), ties included."""
    logits = torch.randint(0, 40, (6, 300), generator=gen).to(dtype)       # many ties
    before = logits.clone()
    for lengths in ([300] * 6, [300, 250, 300, 299, 260, 300], [300, 5, 250, 0, 16, 17]):
        lengths = torch.tensor(lengths)
        got = reference.topk(logits=logits, lengths=lengths, k=16)["indices"]
        for r in range(6):
            n = int(lengths[r])
            if n <= 16:
                assert got[r].tolist() == list(range(n)) + [-1] * (16 - n)
            else:
                row = logits[r].double().clone()
                row[n:] = float("-inf")
                assert got[r].tolist() == torch.topk(row[None], 16, dim=1).indices[0].tolist()
    assert logits.dtype == dtype and torch.equal(logits, before)            # the input is untouched


def test_cpu_core_shares_name_the_core_that_scores(gen):
    """The bench's 'columns by core' line: realistic scales go to the int8 table core, a key
    spanning 8 binades to the fp64 table core, 12 to a column core, a NaN query scale to the
    column cores; shares sum to 1."""
    qp, qs = rand_entries(gen, 1, h=H)
    kp, ks = rand_entries(gen, 40)
    shares = scoring.cpu_core_shares(qp[0:1], qs[0:1], kp, ks)
    assert abs(sum(shares.values()) - 1) < 1e-12
    assert shares["int8 table"] == (1.0 if scoring._cpu_int_mm_exact() else 0.0)
    ks[3] = torch.tensor([110, 118, 110, 110], dtype=torch.uint8)
    ks[4] = torch.tensor([110, 122, 110, 110], dtype=torch.uint8)
    shares = scoring.cpu_core_shares(qp[0:1], qs[0:1], kp, ks)
    assert shares["fp64 table"] == 1 / 40 and shares["fp64"] == 1 / 40 and abs(sum(shares.values()) - 1) < 1e-12
    qs[0, 0, 0] = 255
    shares = scoring.cpu_core_shares(qp[0:1], qs[0:1], kp, ks)
    assert shares["int8 table"] == shares["fp64 table"] == 0 and shares["generic"] == 1.0


def test_column_cores_in_blocks_of_rows_give_the_same_logits(gen, monkeypatch):
    """On a GPU the column cores run a block of rows at a time (bounded memory), each
    column's core chosen over all the rows: the same logits, to the bit, as one pass."""
    kq, sq = rand_entries(gen, 13, lo=100, hi=126, h=H)
    kk, sk = rand_entries(gen, 300, lo=90, hi=126)
    sk[::7, 2] = 60                                         # spreads past the fp32 and fp64 cores
    sq[3, :, 1] = 40
    w = torch.randn(13, H, generator=gen)
    cores = scoring.column_cores(kq, sq, kk, sk)
    assert len(set(cores.tolist())) >= 2                    # several cores in play (fp64 generic too)
    whole = scoring._column_core_logits(kq, sq, kk, sk, w)
    monkeypatch.setattr(scoring, "_ROWS_IN_BLOCKS", {"cpu": True})
    monkeypatch.setattr(scoring, "_COLUMN_ROWS_BYTES", 4 * H * D * 8)          # 4 rows a block, the last 1
    blocks = scoring._column_core_logits(kq, sq, kk, sk, w)
    assert torch.equal(whole.view(torch.int64), blocks.view(torch.int64))


@pytest.mark.parametrize("k_mode, q_lo_hi, whole", [("spread-3", (118, 4), "int8"), ("spread-11", (118, 8), "fp64"),
                                                    ("mixed", (118, 3), None)])
def test_cpu_group_cores_give_each_sequence_its_own_bits(gen, monkeypatch, k_mode, q_lo_hi, whole):
    """On a CPU a group of sequences is scored with the table cores chosen for the whole
    group at once: each sequence gets the bits of `mxfp4_relu_logits` on its own operands
    (its own keys, rows read up to n), through one table core call where every key it reads
    takes that core, column by column otherwise."""
    g, r, h, j = 3, 2, 16, 150
    cases = [cpu_case(gen, r, h, j, q_lo_hi, k_mode) for _ in range(g)]
    qp, qs, kp, ks, w = (torch.stack(t) for t in zip(*cases))
    n = torch.tensor([j, 97, 1])
    if whole:
        ks[:, 2::5, 1] = ks[:, 2::5, 0]           # no far-off dead block: every key read takes the core
    ks[1, 97:] = 255                              # past a sequence's n: never read (NaN there is fine)
    calls = {"table": [], "per column": 0}
    table, per_seq = scoring._table_core, scoring.mxfp4_relu_logits
    got = scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=False)
    want = [per_seq(qp[i], qs[i], kp[i, :n[i]], ks[i, :n[i]], w[i]) for i in range(g)]
    for i in range(g):
        assert torch.equal(bits(got[i, :, :n[i]]), bits(want[i])), i
    monkeypatch.setattr(scoring, "_table_core", lambda q, *a: calls["table"].append((q.dtype, a[1].shape[0])) or table(q, *a))
    monkeypatch.setattr(scoring, "mxfp4_relu_logits", lambda *a: calls.__setitem__("per column", calls["per column"] + 1)
                        or per_seq(*a))
    scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=False)
    if whole is None:
        assert calls["per column"] == g
    else:
        assert calls["per column"] == 0
        dt = torch.int8 if whole == "int8" and scoring._cpu_int_mm_exact() else torch.float64
        assert calls["table"] == [(dt, int(m)) for m in n]
    # teeth: a choice the operands do not allow (the int8 core for queries spanning 8 binades)
    # changes the bits
    if whole == "fp64" and scoring._cpu_int_mm_exact():
        columns = scoring._cpu_columns
        monkeypatch.setattr(scoring, "_cpu_columns", lambda qs, k: columns(0 * qs, k))
        bad = scoring.grouped_relu_logits(qp, qs, kp, ks, w, n, batched=False)
        assert not torch.equal(bits(bad[0]), bits(want[0]))
