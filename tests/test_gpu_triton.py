"""Compiled Triton on a GPU against the reference (`make test-gpu`).

The same cases as the interpreter suite at larger sizes, plus what only a GPU run can
show: the whole chain pool -> pages byte-exact at a prefill-chunk size, a million random
entries through the fused writer, outputs on the inputs' device, pools past 2 GiB
(32-bit offset overflow), and the decode-shape scorer and top-k."""
import pytest
import torch
from helpers import RATIO, D, R, cases, compare, logits_case, needs_gpu, pool_case

import reference
from reference import layout, mxfp4, rope
from reference.formats import preset

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def be():
    from optimized import get_backend
    return get_backend("triton")


CASES = cases(scale=4)


@needs_gpu
@pytest.mark.parametrize("op,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_reference(be, op, kw):
    assert compare(op, getattr(be, op)(**kw), kw) == []


@needs_gpu
def test_outputs_stay_on_the_inputs_device(be):
    from helpers import q_case
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in q_case().items()}
    out = be.q_rope_mxfp4_quant(**kw)
    assert all(v.is_cuda for v in out.values())
    ref = reference.q_rope_mxfp4_quant(**kw)
    assert all(torch.equal(out[k], ref[k]) for k in ref)


@needs_gpu
def test_chain_pool_to_pages_is_byte_exact(be):
    """Reference pooling -> reference writer vs Triton pooling -> Triton writer: no byte
    budget needed, since the pooled rows are exact too."""
    kw = pool_case(seed=7, tokens=4096, block_size=64, reqs=2)
    pooled_t = be.compress_pool(**kw)["pooled"]
    pooled_r = reference.compress_pool(**kw)["pooled"]
    same = (pooled_t == pooled_r) | (pooled_t.isnan() & pooled_r.isnan())
    assert bool(same.all()), f"{int((~same).sum())} pooled values differ"
    t = kw["positions"].shape[0]
    p = preset()
    slots = torch.where(reference.k_writer.writer_mask(kw["positions"], kw["kv_slot_mapping"], RATIO),
                        torch.arange(t), -1)
    pages = -(-t // p.page_size)
    pool = torch.randint(0, 256, (pages, p.page_size * layout.entry_bytes(D) + 64), dtype=torch.uint8)
    wk = dict(positions=kw["positions"], cos_sin_cache=rope.cos_sin_cache(t, R, 160000.0, yarn_factor=16.0),
              norm_weight=torch.randn(D).to(torch.bfloat16), slot_mapping=slots, kv_cache=pool,
              page_size=p.page_size, shuffle=[32, 16, 2])
    pooled_t = torch.nan_to_num(pooled_t)
    a = be.k_norm_rope_mxfp4_cache(k=pooled_t, **wk)["kv_cache"]
    b = reference.k_norm_rope_mxfp4_cache(k=torch.nan_to_num(pooled_r), **wk)["kv_cache"]
    assert torch.equal(a, b), f"{int((a != b).sum())} page bytes differ"


@needs_gpu
def test_a_million_random_entries_are_byte_exact(be):
    g = torch.Generator().manual_seed(11)
    t, ps = 1 << 20, 64
    k = (torch.randn(t, D, generator=g) * torch.exp2(torch.randn(t, 1, generator=g) * 4)).to(torch.bfloat16)
    pos = (torch.arange(t) % 4096) * RATIO + RATIO - 1   # every token a boundary
    cs = rope.cos_sin_cache(4096 * RATIO, R, 160000.0, yarn_factor=16.0)
    pool = torch.zeros(t // ps, ps * layout.entry_bytes(D), dtype=torch.uint8)
    kw = dict(k=k, positions=pos, cos_sin_cache=cs, norm_weight=(1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16),
              slot_mapping=torch.randperm(t, generator=g), kv_cache=pool, page_size=ps, shuffle=[32, 16, 2])
    kw_gpu = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in kw.items()}
    a = be.k_norm_rope_mxfp4_cache(**kw_gpu)["kv_cache"].cpu()
    b = reference.k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    assert torch.equal(a, b), f"{int((a != b).sum())} bytes differ in {t} entries"


@needs_gpu
def test_pools_past_2_gib(be):
    """Entries written and read at byte offsets beyond 2**31 (the 32-bit overflow bug class)."""
    ps, stride = 64, 64 * layout.entry_bytes(D)
    pages = (2 ** 31 + 2 ** 26) // stride + 2
    pool = torch.zeros(pages, stride, dtype=torch.uint8, device="cuda")
    n = 2 * ps
    g = torch.Generator().manual_seed(5)
    k = torch.randn(n, D, generator=g).to(torch.bfloat16)
    pos = torch.arange(n) * RATIO + RATIO - 1
    cs = rope.cos_sin_cache(int(pos.max()) + 1, R, 160000.0)
    w = torch.ones(D, dtype=torch.bfloat16)
    slots = (pages - 2) * ps + torch.arange(n)
    out = be.k_norm_rope_mxfp4_cache(k=k.cuda(), positions=pos.cuda(), cos_sin_cache=cs.cuda(), norm_weight=w.cuda(),
                                     slot_mapping=slots.cuda(), kv_cache=pool, page_size=ps,
                                     shuffle=[32, 16, 2])["kv_cache"]
    tail = out[-2:].cpu()
    small = reference.k_norm_rope_mxfp4_cache(k=k, positions=pos, cos_sin_cache=cs, norm_weight=w,
                                              slot_mapping=torch.arange(n), kv_cache=torch.zeros(2, stride, dtype=torch.uint8),
                                              page_size=ps, shuffle=[32, 16, 2])["kv_cache"]
    assert torch.equal(tail, small)
    assert int(out[:-2].count_nonzero()) == 0
    # the scorer reading those pages
    qp, qs = mxfp4.quantize_mxfp4(torch.randn(2, 64, D, generator=g))
    common = dict(q_fp4=qp, q_scale=qs, weights=torch.randn(2, 64, generator=g),
                  query_start_loc=torch.tensor([0, 2]), context_lens=torch.tensor([n]),
                  row_ends=torch.tensor([n - 1, n]), page_size=ps, shuffle=[32, 16, 2], clean_logits=True)
    got = be.paged_mxfp4_mqa_logits(kv_cache=out, block_table=torch.tensor([[pages - 2, pages - 1]]).cuda(),
                                     **{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in common.items()})
    kw = dict(common, kv_cache=small, block_table=torch.tensor([[0, 1]]))
    assert compare("paged_mxfp4_mqa_logits", got, kw) == []
    del pool, out


@needs_gpu
def test_decode_shape_scorer_and_topk(be):
    """64 heads, 8192 entries per sequence, 8 decode rows; then top-1024 of their logits."""
    kw = dict(logits_case(seed=3, heads=64, page_size=64, seqs=tuple((1, 8192 - 37 * i) for i in range(8))),
              clean_logits=True)
    got = be.paged_mxfp4_mqa_logits(**kw)["logits"]
    assert compare("paged_mxfp4_mqa_logits", {"logits": got}, kw) == []
    lens = kw["row_ends"]
    idx = be.topk(logits=got, lengths=lens, k=1024)["indices"]
    assert compare("topk", {"indices": idx}, dict(logits=got.cpu(), lengths=lens, k=1024)) == []


# --- the fast paths, compiled --------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("decode", [0, 1, 2])
def test_scorer_decoders_are_exact_compiled(be, decode):
    """Every byte under every finite scale byte, subnormal operands included (the inline
    PTX path multiplies packed bf16 pairs; a flush to zero would show here)."""
    from helpers import all_bytes_and_scales, expected

    from optimized.triton_kernels import scoring
    b, e = all_bytes_and_scales("cuda")
    got = scoring.decode_probe(b, e, decode).cpu()
    want = expected(b, e)
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} decoded values differ"


def _scorer_variant(kw, config, decode, words=False):
    from optimized.triton_kernels import scoring
    from reference.scoring import check_mxfp4_scorer
    shuf, _, width, _ = check_mxfp4_scorer(kw["q_fp4"], kw["q_scale"], kw["weights"], kw["kv_cache"],
                                        kw["query_start_loc"], kw["context_lens"], kw["block_table"],
                                        kw["row_ends"], kw["page_size"], kw["shuffle"], None)
    cu = {k: v.cuda() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    tiles = scoring.row_tiles(kw["query_start_loc"], config[0]).cuda()
    return scoring.launch(cu["q_fp4"], cu["q_scale"], cu["weights"], cu["kv_cache"], cu["block_table"], tiles,
                          cu["row_ends"], width=width, page_size=kw["page_size"], shuffle=shuf,
                          clean_logits=True, config=config, decode=decode, words=words).cpu()


@needs_gpu
@pytest.mark.parametrize("config,decode,words", [((1, 64, 4, 3), 2, False), ((1, 64, 4, 3), 2, True),
                                                 ((1, 64, 4, 3), 1, True), ((2, 64, 4, 3), 2, True),
                                                 ((4, 128, 8, 2), 2, False), ((1, 64, 4, 3, 96), 2, False)])
def test_scorer_tilings_and_decoders(be, config, decode, words):
    kw = dict(logits_case(seed=9, heads=64, page_size=64, pad=8, seqs=((5, 700), (1, 333), (3, 64))),
              clean_logits=True)
    assert compare("paged_mxfp4_mqa_logits", {"logits": _scorer_variant(kw, config, decode, words)}, kw) == []


@needs_gpu
@pytest.mark.parametrize("scales", ["tiny", "wide"])
def test_scorer_extreme_scale_bytes(be, scales):
    """K blocks at scale bytes 0..4 (bf16 subnormal operands) or spread over 1..252, random
    codes, normal queries: the tensor cores must keep every operand exactly."""
    g = torch.Generator().manual_seed(21)
    kw = dict(logits_case(seed=10, heads=64, page_size=64, pad=8, seqs=((3, 300), (1, 200))), clean_logits=True)
    pool = kw["kv_cache"]
    entries = pool.shape[0] * 64
    packed = torch.randint(0, 256, (entries, D // 2), dtype=torch.uint8, generator=g)
    lo, hi = (0, 5) if scales == "tiny" else (1, 253)
    sc = torch.randint(lo, hi, (entries, D // 32), dtype=torch.uint8, generator=g)
    kw["kv_cache"] = layout.write_entries(pool, torch.arange(entries), packed, sc, page_size=64,
                                          shuffle=kw["shuffle"])
    if scales == "wide":   # keep every product and logit inside fp32's range
        kw["q_scale"] = torch.full_like(kw["q_scale"], 127 - 60)
        kw["kv_cache"] = layout.write_entries(kw["kv_cache"], torch.arange(entries), packed,
                                              (sc.int() // 2 + 63).to(torch.uint8), page_size=64,
                                              shuffle=kw["shuffle"])
    else:
        kw["q_scale"] = torch.full_like(kw["q_scale"], 127 + 100)
    for decode, words in ((1, False), (2, False), (2, True)):
        got = _scorer_variant(kw, (1, 64, 4, 3), decode, words)
        assert compare("paged_mxfp4_mqa_logits", {"logits": got}, kw) == [], (decode, words)


@needs_gpu
@pytest.mark.parametrize("resident", [True, False])
def test_topk_kernels_compiled(be, resident):
    from helpers import tie_case, topk_case

    from optimized.triton_kernels import topk
    for kw in (tie_case(), topk_case(k=1024, width=12000)):
        idx = topk.launch(kw["logits"].cuda(), kw["lengths"].cuda(), kw["k"], resident=resident).cpu()
        assert compare("topk", {"indices": idx}, kw) == []


@needs_gpu
@pytest.mark.parametrize("tile", [(16, 2, 2, 64), (16, 2, 2, 128), (16, 1, 1, 32)])
def test_pooling_tilings_compiled(be, tile):
    from optimized.triton_kernels import pooling
    for bs in (4, 64):
        kw = pool_case(seed=bs, tokens=1024, block_size=bs, reqs=4)
        args = [kw[n].cuda() for n in ("state_cache", "block_table", "positions", "req_index", "kv_slot_mapping")]
        got = pooling.launch(*args, compress_ratio=4, tile=tile).cpu()
        assert compare("compress_pool", {"pooled": got}, kw) == []


@needs_gpu
@pytest.mark.parametrize("tile", [(32, 8, 4), (128, 32, 8)])
def test_k_writer_tilings_compiled(be, tile):
    from helpers import k_writer_case

    from optimized.triton_kernels import k_writer
    kw = k_writer_case(tokens=384, pages=16)
    want = reference.k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    out = kw["kv_cache"].cuda()
    k_writer.launch(kw["k"].cuda(), kw["positions"].cuda(), kw["cos_sin_cache"].cuda(), kw["norm_weight"].cuda(),
                    kw["slot_mapping"].cuda(), out, norm_eps=kw["norm_eps"], compress_ratio=4,
                    page_size=kw["page_size"], shuffle=kw["shuffle"], tile=tile)
    assert torch.equal(out.cpu(), want)
