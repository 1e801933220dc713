"""Cases and comparison rules for the Triton backend tests (CPU interpreter and GPU).

`cases(scale)` builds every op's keyword arguments with the spec's edge cases in them;
`compare(op, got, ref, kwargs)` applies the op's contract and returns a list of
problems (empty = pass). The tests at the bottom show that each rule fails on the fault
it exists for."""
from __future__ import annotations

import math

import pytest
import torch

import reference
from reference import layout, mxfp4, pooling, rope, scoring
from reference.formats import preset

D, R, RATIO = 128, 64, 4
METRIC_MAX = 1e-12


# --- builders ----------------------------------------------------------------------

def special_rows(n: int, g: torch.Generator) -> torch.Tensor:
    """bf16 rows [n, D] with the encoder's edge cases: a zero row, signed zeros in the
    NoPE and rope dims, amax exactly at and next to 6 * 2**k, tiny and huge magnitudes,
    bf16 subnormals, e2m1 midpoints after scaling."""
    x = torch.randn(n, D, generator=g) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=g).float())
    if n > 8:
        x[0] = 0.0
        x[1, :40] = -0.0
        x[1, 100:110] = -0.0
        x[2, :32] = torch.tensor([6.0, 3.0, -1.5, 0.75, 0.25, 1.25, 2.5, 5.0] * 4)
        x[3, 32:64] = torch.linspace(-6.03125, 6.03125, 32)
        x[4] *= 2.0 ** -120                        # scale exponents near e8m0's low end
        x[5, :16] = 1e-39                          # bf16 subnormals
        x[6] *= 2.0 ** 60
        x[7, 64:96] = 96.0 * torch.tensor([1, -1] * 16).float()
    return x.to(torch.bfloat16)


def k_writer_case(seed=0, tokens=48, page_size=32, pages=4, pad=12, shuffle=(32, 16, 2),
                  weight_dtype=torch.bfloat16, fp8=False, max_pos=256):
    g = torch.Generator().manual_seed(seed)
    k = special_rows(tokens, g)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    pos[:4] = torch.tensor([3, 0, 2, 7])           # j = 0 boundary, non-boundaries, j = 1
    ebytes = (D + 4) if fp8 else layout.entry_bytes(D)
    slots = torch.randperm(pages * page_size, generator=g)[:tokens]
    slots[5] = -1                                   # a skipped boundary-or-not token
    boundary = (pos + 1) % RATIO == 0
    slots[boundary.nonzero()[-1]] = -1 if boundary.any() else slots[0]
    kv = torch.randint(0, 256, (pages, page_size * ebytes + pad), generator=g, dtype=torch.uint8)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(weight_dtype)
    kw = dict(k=k, positions=pos, cos_sin_cache=rope.cos_sin_cache(max_pos, R, 160000.0, yarn_factor=16.0),
              norm_weight=w, slot_mapping=slots, kv_cache=kv, norm_eps=1e-6, compress_ratio=RATIO,
              page_size=page_size)
    if not fp8:
        kw["shuffle"] = list(shuffle) if shuffle else None
    return kw


def q_case(seed=0, tokens=6, heads=8, max_pos=256):
    g = torch.Generator().manual_seed(seed)
    q = special_rows(tokens * heads, g).view(tokens, heads, D)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    pos[0] = 0
    w = torch.randn(tokens, heads, generator=g).to(torch.bfloat16)
    return dict(q=q, positions=pos, cos_sin_cache=rope.cos_sin_cache(max_pos, R, 160000.0),
                weights=w, weights_scale=preset().weights_scale)


def pool_case(seed=0, tokens=40, block_size=8, reqs=2):
    g = torch.Generator().manual_seed(seed)
    per = tokens // reqs
    nblk = -(-per // block_size)
    table = torch.randperm(reqs * nblk + 3, generator=g)[:reqs * nblk].view(reqs, nblk)
    state = torch.full((reqs * nblk + 3, block_size, 4 * D), float("nan"))   # unread rows: NaN
    pos, req = [], []
    for r in range(reqs):
        p = torch.arange(per)
        rows = pooling.state_rows(torch.randn(per, 2 * D, generator=g) * 2,
                                  torch.randn(per, 2 * D, generator=g) * 3,
                                  torch.randn(RATIO, 2 * D, generator=g) * 0.1, p)
        state = pooling.write_state(state, table, torch.full((per,), r), p, rows)
        pos.append(p)
        req.append(torch.full((per,), r))
    pos, req = torch.cat(pos), torch.cat(req)
    slots = torch.arange(tokens)
    slots[7] = -1                                   # boundary token that writes nothing
    return dict(state_cache=state, block_table=table, positions=pos, req_index=req,
                kv_slot_mapping=slots, compress_ratio=RATIO)


def logits_case(seed=0, heads=16, page_size=32, shuffle=(32, 16, 2), fp8=None, pad=4,
                seqs=((3, 70), (4, 100), (1, 0))):
    """Sequences of (query rows, context entries); pools hold encoded random keys with
    random bytes in the slack and padding; row ends include 0, 1, a page edge and full."""
    g = torch.Generator().manual_seed(seed)
    maxp = max(-(-c // page_size) for _, c in seqs) + 1
    pages = len(seqs) * maxp + 2
    ebytes = (D + 4) if fp8 else layout.entry_bytes(D)
    kv = torch.randint(0, 256, (pages, page_size * ebytes + pad), generator=g, dtype=torch.uint8)
    table = torch.randperm(pages, generator=g)[:len(seqs) * maxp].view(len(seqs), maxp)
    y = torch.randn(pages * page_size, D, generator=g) * torch.exp2(
        torch.randint(-4, 4, (pages * page_size, 1), generator=g).float())
    slots = torch.arange(pages * page_size)
    if fp8:
        v, s = reference.fp8.quantize_fp8(y, fp8)
        vo, so = reference.fp8.fp8_slot_offsets(slots, page_size, D, kv.shape[1])
        flat = kv.view(-1)
        flat[vo.flatten()] = v.reshape(-1)
        flat[so.flatten()] = s.contiguous().view(torch.uint8).reshape(-1)
    else:
        packed, sc = mxfp4.quantize_mxfp4(y)
        kv = layout.write_entries(kv, slots, packed, sc, page_size=page_size,
                                  shuffle=list(shuffle) if shuffle else None)
    rows = sum(n for n, _ in seqs)
    qy = torch.randn(rows, heads, D, generator=g)
    ends, qsl = [], [0]
    for n, c in seqs:
        e = torch.randint(0, c + 1, (n,), generator=g)
        e[-1] = c
        if n > 1:
            e[0] = min(1, c)
        if n > 2:
            e[1] = min(page_size, c)
        ends.append(e)
        qsl.append(qsl[-1] + n)
    kw = dict(weights=torch.randn(rows, heads, generator=g), kv_cache=kv,
              query_start_loc=torch.tensor(qsl), context_lens=torch.tensor([c for _, c in seqs]),
              block_table=table, row_ends=torch.cat(ends).to(torch.int32), page_size=page_size)
    if fp8:
        v, s = reference.fp8.quantize_fp8(qy, fp8)
        kw.update(q_fp8=v, fp8_dtype=fp8)
    else:
        kw["q_fp4"], kw["q_scale"] = mxfp4.quantize_mxfp4(qy)
        kw["shuffle"] = list(shuffle) if shuffle else None
    return kw


def topk_case(seed=0, rows=5, width=3000, k=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    x[1, :200] = 1.0                                 # ties across the k-th value
    x[2, 10] = -3e38                                 # the most negative finite logits
    x[2, 12] = -3.4e38
    x[2, 11] = -0.0
    lens = torch.tensor([width, 2000, 1500, k, 0][:rows])
    return dict(logits=x, lengths=lens, k=k)


# --- comparison rules ------------------------------------------------------------------

def metric(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2*sum(xy)/sum(x^2+y^2) in fp64 (0 when both are empty or zero)."""
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum()
    return 0.0 if float(den) == 0 else float(1 - 2 * (x * y).sum() / den)


def compare(op: str, got: dict, kw: dict) -> list[str]:
    """Problems of `got` (the backend's outputs) against the reference on `kw`."""
    if op in ("paged_mxfp4_mqa_logits", "paged_fp8_mqa_logits"):
        f64 = (scoring.paged_mxfp4_mqa_logits_fp64 if op == "paged_mxfp4_mqa_logits"
               else reference.fp8.paged_fp8_mqa_logits_fp64)
        ref = f64(**kw)
        out = got["logits"].cpu()
        if out.shape != ref.shape or out.dtype != torch.float32:
            return [f"logits: {out.dtype} {list(out.shape)} vs float32 {list(ref.shape)}"]
        valid = torch.arange(ref.shape[1])[None, :] < kw["row_ends"].long()[:, None]
        probs = []
        m = metric(out[valid], ref[valid])
        if not m <= METRIC_MAX:
            probs.append(f"logits: metric {m:.3e} > {METRIC_MAX}")
        if kw.get("clean_logits") and not bool(torch.isneginf(out[~valid]).all()):
            probs.append(f"logits: {int((~torch.isneginf(out[~valid])).sum())} columns past the row end are not -inf")
        return probs
    if op == "topk":
        return topk_problems(got["indices"].cpu(), kw["logits"], kw["lengths"], kw["k"])
    ref = reference.OPS[op](**kw)
    probs = []
    for name, r in ref.items():
        o = got[name].cpu()
        if o.dtype != r.dtype or o.shape != r.shape:
            probs.append(f"{name}: {o.dtype} {list(o.shape)} vs {r.dtype} {list(r.shape)}")
            continue
        if op == "compress_pool":
            same = (o == r) | (o.isnan() & r.isnan())
        else:
            same = o.view(torch.uint8) == r.view(torch.uint8) if o.dtype == torch.uint8 else (
                o.contiguous().view(torch.int32 if o.element_size() == 4 else torch.int16)
                == r.contiguous().view(torch.int32 if r.element_size() == 4 else torch.int16))
        if not bool(same.all()):
            first = (~same).nonzero()[0].tolist()
            probs.append(f"{name}: {int((~same).sum())} of {same.numel()} differ, first at {first}")
    return probs


def topk_problems(idx: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor, k: int) -> list[str]:
    probs = []
    if idx.dtype != torch.int32 or list(idx.shape) != [logits.shape[0], k]:
        return [f"indices: {idx.dtype} {list(idx.shape)}, want int32 {[logits.shape[0], k]}"]
    for r in range(logits.shape[0]):
        n = int(lengths[r])
        row = idx[r]
        if n <= k:
            want = torch.where(torch.arange(k) < n, torch.arange(k), -1).to(torch.int32)
            if not torch.equal(row, want):
                probs.append(f"row {r}: short row (len {n}) is not 0..len-1 then -1")
            continue
        vals = row.tolist()
        if len(set(vals)) != k or min(vals) < 0 or max(vals) >= n:
            probs.append(f"row {r}: indices not {k} unique columns of [0, {n})")
            continue
        kth = logits[r, :n].double().topk(k).values[-1]
        if not bool((logits[r, row.long()].double() >= kth).all()):
            probs.append(f"row {r}: an index scores below the k-th value")
    return probs


def cases(scale: int = 1) -> list[tuple[str, str, dict]]:
    """(id, op, kwargs) for every op and edge case; `scale` multiplies the sizes (GPU)."""
    s = scale
    out = []
    for shuffle in ((32, 16, 2), (16, 16, 4), None):
        for rounding in ("rocm", "deepseek", "cuda"):
            kw = k_writer_case(tokens=48 * s, pages=4 * s, shuffle=shuffle)
            if rounding == "cuda":
                kw["k"] = kw["k"].float() * 1.001       # the CUDA fused path takes fp32 rows
            out.append((f"k-{shuffle and shuffle[0]}-{rounding}", "k_norm_rope_mxfp4_cache",
                        dict(kw, rounding=rounding)))
    out.append(("k-f32w-unpadded", "k_norm_rope_mxfp4_cache",
                k_writer_case(seed=1, tokens=40 * s, pages=4 * s, pad=0, weight_dtype=torch.float32)))
    for rule in ("ocp-floor", "even"):
        out.append((f"k-{rule}", "k_norm_rope_mxfp4_cache", dict(k_writer_case(seed=2), scale_rule=rule)))
        out.append((f"q-{rule}", "q_rope_mxfp4_quant", dict(q_case(seed=2), scale_rule=rule)))
    out.append(("q", "q_rope_mxfp4_quant", q_case(tokens=6 * s, heads=8 * s)))
    out.append(("pool", "compress_pool", pool_case(tokens=40 * s)))
    out.append(("pool-cuda", "compress_pool", dict(pool_case(seed=1, tokens=24 * s), rounding="cuda")))
    for shuffle in ((32, 16, 2), None):
        for clean in (True, False):
            out.append((f"logits-{shuffle and shuffle[0]}-{clean}", "paged_mxfp4_mqa_logits",
                        dict(logits_case(shuffle=shuffle, seqs=((3 * s, 70 * s), (4, 100 * s), (1, 0))),
                             clean_logits=clean)))
    out.append(("logits-decode", "paged_mxfp4_mqa_logits",
                dict(logits_case(seed=5, seqs=((1, 50 * s), (1, 33), (1, 64))), clean_logits=True)))
    out.append(("logits-h8", "paged_mxfp4_mqa_logits", dict(logits_case(heads=8, seqs=((2, 40),)), clean_logits=True)))
    for fl in ("e4m3fn", "e4m3fnuz"):
        kw = k_writer_case(seed=3, tokens=40 * s, pages=4 * s, fp8=True)
        out.append((f"k-fp8-{fl}", "k_norm_rope_fp8_cache", dict(kw, fp8_dtype=fl)))
        out.append((f"q-fp8-{fl}", "q_rope_fp8_quant", dict(q_case(seed=3), fp8_dtype=fl)))
        out.append((f"logits-fp8-{fl}", "paged_fp8_mqa_logits",
                    dict(logits_case(fp8=fl, seqs=((3, 70 * s), (2, 33))), clean_logits=True)))
    out.append(("k-fp8-cuda-f32", "k_norm_rope_fp8_cache",
                dict(k_writer_case(seed=4, fp8=True), k=k_writer_case(seed=4, fp8=True)["k"].float() * 1.01,
                     rounding="cuda")))
    out.append(("topk-64", "topk", topk_case(k=64)))
    out.append(("topk-1024", "topk", topk_case(k=1024, width=3000 * s)))
    return out


# --- the rules have teeth ----------------------------------------------------------------

def test_byte_rule_catches_a_touched_unowned_byte():
    kw = k_writer_case()
    got = reference.k_norm_rope_mxfp4_cache(**kw)
    assert compare("k_norm_rope_mxfp4_cache", got, kw) == []
    owned = layout.owned_mask(kw["kv_cache"].shape[0], kw["kv_cache"].shape[1],
                              kw["slot_mapping"][kw["slot_mapping"] >= 0], page_size=32, head_dim=D,
                              shuffle=kw["shuffle"])
    got["kv_cache"].view(-1)[(~owned).view(-1).nonzero()[-1]] ^= 1   # the padding's last byte
    assert "kv_cache: 1 of" in compare("k_norm_rope_mxfp4_cache", got, kw)[0]


def test_pool_rule_catches_one_ulp():
    kw = pool_case()
    got = reference.compress_pool(**kw)
    row = (~got["pooled"].isnan().any(1)).nonzero()[0]
    got["pooled"].view(torch.int16)[row, 3] += 1
    assert compare("compress_pool", got, kw)


def test_metric_rule_catches_a_small_error_and_a_missing_mask():
    kw = dict(logits_case(), clean_logits=True)
    ref = scoring.paged_mxfp4_mqa_logits_fp64(**kw).float()
    assert compare("paged_mxfp4_mqa_logits", {"logits": ref.clone()}, kw) == []
    bad = ref.clone()
    bad[bad.isfinite()] *= 1 + 1e-5                 # a 1e-5 relative error: metric ~ 2.5e-11
    assert "metric" in compare("paged_mxfp4_mqa_logits", {"logits": bad}, kw)[0]
    bad = ref.clone()
    bad[bad.isneginf()] = 0.0
    assert "not -inf" in compare("paged_mxfp4_mqa_logits", {"logits": bad}, kw)[-1]


def test_topk_rule_catches_duplicates_padding_and_low_scores():
    kw = topk_case()
    idx = reference.topk(**kw)["indices"]
    assert topk_problems(idx, kw["logits"], kw["lengths"], kw["k"]) == []
    for r, fix in ((0, lambda row: row.__setitem__(1, row[0])),          # duplicate
                   (3, lambda row: row.__setitem__(-1, 0)),               # wrong -1 padding
                   (0, lambda row: row.__setitem__(0, int(kw["logits"][0].argmin())))):
        bad = idx.clone()
        fix(bad[r])
        assert topk_problems(bad, kw["logits"], kw["lengths"], kw["k"]), r


def test_cases_cover_the_edge_cases():
    ids = [c[0] for c in cases()]
    assert len(ids) == len(set(ids))
    kw = k_writer_case()
    sel = reference.k_writer.writer_mask(kw["positions"], kw["slot_mapping"], RATIO)
    assert bool(sel.any()) and bool((~sel & ((kw["positions"] + 1) % RATIO == 0)).any())  # a skipped boundary
    assert kw["kv_cache"].shape[1] > 32 * layout.entry_bytes(D)                             # padded pages
    assert int(kw["positions"][0]) == 3                                                     # j = 0
