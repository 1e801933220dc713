"""Softmax-gated overlap pooling (NUMERICS.md §1) against a plain Python loop, across
prefill chunks and decode steps."""
import math

import pytest
import torch

import reference
from reference import pooling

R, D, BS = 4, 32, 8          # small state block and D = 32 (the smallest legal) keep the loop cheap


def model_stream(gen, lengths):
    """Per-request kv/score/ape, a permuted state block table, and token streams."""
    reqs = len(lengths)
    max_blocks = max(-(-n // BS) for n in lengths)
    perm = torch.randperm(reqs * max_blocks + 3, generator=gen)[: reqs * max_blocks]
    table = perm.view(reqs, max_blocks).int()
    ape = torch.randn(R, 2 * D, generator=gen)
    toks = []
    for r, n in enumerate(lengths):
        kv = torch.randn(n, 2 * D, generator=gen) * 3
        score = torch.randn(n, 2 * D, generator=gen) * 2
        toks.append((r, kv, score))
    return table, ape, toks, reqs * max_blocks + 3


def build_state(table, ape, toks, nblocks, upto=None):
    state = torch.zeros(nblocks, BS, 4 * D)
    for r, kv, score in toks:
        n = kv.shape[0] if upto is None else min(upto, kv.shape[0])
        pos = torch.arange(n)
        rows = pooling.state_rows(kv[:n], score[:n], ape, pos)
        state = pooling.write_state(state, table, torch.full((n,), r), pos, rows)
    return state


def loop_pool(table, ape, kv, score, req, p, swap=False):
    """The contract, one channel at a time, in Python floats (fp64)."""
    out = []
    for d in range(D):
        s, v = [], []
        for i in range(2 * R):
            q = p - (2 * R - 1) + i
            if q < 0:
                s.append(-math.inf)
                v.append(0.0)
                continue
            half = (i >= R) != swap               # own group reads _b, the previous one _a
            ch = d + D * half
            s.append(float(score[q, ch] + ape[q % R, ch]))     # the state row holds the fp32 sum
            v.append(float(kv[q, ch]))
        m = max(s)
        e = [math.exp(x - m) for x in s]
        out.append(sum(ei * vi for ei, vi in zip(e, v)) / sum(e))
    return out


def run_pool(state, table, req, pos, rounding="rocm"):
    slots = torch.where((pos + 1) % R == 0, pos // R, -1)
    return reference.compress_pool(state_cache=state, block_table=table, positions=pos, req_index=req,
                                   kv_slot_mapping=slots, compress_ratio=R, rounding=rounding)["pooled"]


def test_pool_matches_python_loop_including_j0(gen):
    table, ape, toks, nb = model_stream(gen, [23, 14])
    state = build_state(table, ape, toks, nb)
    for r, kv, score in toks:
        pos = torch.arange(kv.shape[0])
        req = torch.full_like(pos, r)
        got32 = run_pool(state, table, req, pos, "cuda")
        got16 = run_pool(state, table, req, pos)
        for p in range(kv.shape[0]):
            if (p + 1) % R:
                assert bool(torch.isnan(got32[p]).all())
                continue
            want = torch.tensor(loop_pool(table, ape, kv, score, r, p), dtype=torch.float64)
            assert torch.equal(got32[p], want.float()), p        # exact softmax, one fp32 round
            assert torch.equal(got16[p], want.float().bfloat16()), p
            # teeth: the halves swapped give other rows
            swapped = torch.tensor(loop_pool(table, ape, kv, score, r, p, swap=True), dtype=torch.float64)
            assert not torch.allclose(got32[p].double(), swapped, rtol=1e-3)


def test_chunked_prefill_and_decode_pool_like_one_pass(gen):
    lengths = [45, 30]
    table, ape, toks, nb = model_stream(gen, lengths)
    full_state = build_state(table, ape, toks, nb)
    cuts = [0, 9, 22, 36]                          # three prefill chunks, then decode steps
    steps = [(a, b) for a, b in zip(cuts, cuts[1:])] + [(n, n + 1) for n in range(36, 45)]
    state = torch.zeros(nb, BS, 4 * D)
    for a, b in steps:
        pos_l, req_l = [], []
        for r, kv, score in toks:
            hi = min(b, kv.shape[0])
            if hi <= a:
                continue
            pos = torch.arange(a, hi)
            rows = pooling.state_rows(kv[a:hi], score[a:hi], ape, pos)
            state = pooling.write_state(state, table, torch.full_like(pos, r), pos, rows)
            pos_l.append(pos)
            req_l.append(torch.full_like(pos, r))
        pos, req = torch.cat(pos_l), torch.cat(req_l)
        chunk = run_pool(state, table, req, pos)
        one = run_pool(full_state, table, req, pos)
        assert torch.equal(chunk.view(torch.int16), one.view(torch.int16)), (a, b)
    # teeth: a stale state (the last chunk's rows never written) pools differently
    stale = build_state(table, ape, toks, nb, upto=40)
    pos = torch.arange(40, 45)
    assert not torch.equal(run_pool(stale, table, torch.zeros_like(pos), pos)[-2:].float().nan_to_num(),
                           run_pool(full_state, table, torch.zeros_like(pos), pos)[-2:].float().nan_to_num())


def test_rows_of_non_writers_are_nan_and_inputs_untouched(gen):
    table, ape, toks, nb = model_stream(gen, [16])
    state = build_state(table, ape, toks, nb)
    before = state.clone()
    pos = torch.arange(16)
    slots = torch.where((pos + 1) % R == 0, pos // R, -1)
    slots[7] = -1                                   # a boundary token that writes nothing
    out = reference.compress_pool(state_cache=state, block_table=table, positions=pos,
                                  req_index=torch.zeros_like(pos), kv_slot_mapping=slots,
                                  compress_ratio=R)["pooled"]
    written = ~torch.isnan(out.float()).any(-1)
    assert written.nonzero().flatten().tolist() == [3, 11, 15]
    assert torch.equal(state, before)


@pytest.mark.parametrize("rounding", ["rocm", "deepseek", "cuda"])
def test_rounding_paths_dtype(gen, rounding):
    table, ape, toks, nb = model_stream(gen, [8])
    state = build_state(table, ape, toks, nb)
    pos = torch.arange(8)
    out = run_pool(state, table, torch.zeros_like(pos), pos, rounding)
    assert out.dtype == (torch.float32 if rounding == "cuda" else torch.bfloat16)


def test_a_window_of_negative_zeros_pools_to_negative_zero():
    """IEEE addition keeps -0.0 when every term is -0.0 (a GPU reduction does); torch's
    sum starts from +0.0. One +0.0 term, or cancellation, gives +0.0."""
    from reference.pooling import softmax_pool
    kv = torch.tensor([[[-0.0], [-0.0]], [[-0.0], [0.0]], [[1.0], [-1.0]]])
    out = softmax_pool(kv, torch.zeros(3, 2, 1)).flatten()
    assert torch.signbit(out).tolist() == [True, False, False] and (out == 0).all()
