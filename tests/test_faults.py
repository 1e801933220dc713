"""The fault catalogue: each fault changes exactly the ops it declares, and only them.

The composed stages with nothing replaced must give the reference's bytes, otherwise a
fault would differ from the reference for a reason other than its bug."""
import pytest
import torch

import reference
from optimized import OP_NAMES, get_backend
from optimized import faults as F
from reference import layout, pooling, rope

D, H, R, RATIO, PS = 128, 8, 64, 4, 32
SHUFFLE = [32, 16, 2]


def make_case(seed=0, tokens=96, pages=6, shuffle=SHUFFLE, k=8, pool_pages=None, clean=False,
              fp8_dtype="e4m3fn", neg_zero_window=False, cuda_q=False):
    """One sequence at positions 0..tokens-1 through the whole indexer chain, every stage
    fed the reference's upstream output. Returns {op: kwargs}."""
    g = torch.Generator().manual_seed(seed)
    T, bs = tokens, 16
    pos = torch.arange(T)
    blocks = -(-T // bs)
    state_table = torch.randperm(blocks + 2, generator=g)[:blocks].view(1, -1)
    kv = torch.randn(T, 2 * D, generator=g)
    if neg_zero_window:
        kv[4:12] = -0.0                   # the window of position 11 pools to -0.0
    score = torch.randn(T, 2 * D, generator=g)
    ape = torch.randn(RATIO, 2 * D, generator=g) * 0.1
    state = torch.full((blocks + 2, bs, 4 * D), float("nan"))
    state = pooling.write_state(state, state_table, torch.zeros(T, dtype=torch.long), pos,
                                pooling.state_rows(kv, score, ape, pos))
    entries = T // RATIO
    pool_pages = pool_pages or pages
    page_table = torch.randperm(pages, generator=g) + (pool_pages - pages)   # the top of the pool
    slot = page_table[(pos // RATIO) // PS] * PS + (pos // RATIO) % PS
    stride = PS * layout.entry_bytes(D) + 32           # padded pages
    kv_cache = torch.randint(0, 256, (pool_pages, stride), dtype=torch.uint8, generator=g)
    cs = rope.cos_sin_cache(T + 8, R, 160000.0, yarn_factor=16.0)
    ops = {"compress_pool": dict(state_cache=state, block_table=state_table, positions=pos,
                                 req_index=torch.zeros(T, dtype=torch.long), kv_slot_mapping=slot,
                                 compress_ratio=RATIO)}
    pooled = reference.compress_pool(**ops["compress_pool"])["pooled"]
    k_in = torch.where(torch.isnan(pooled), torch.randn(T, D, generator=g).bfloat16(), pooled)
    norm_w = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16()
    ops["k_norm_rope_mxfp4_cache"] = dict(k=k_in, positions=pos, cos_sin_cache=cs, norm_weight=norm_w,
                                          slot_mapping=slot, kv_cache=kv_cache, norm_eps=1e-6,
                                          compress_ratio=RATIO, page_size=PS, shuffle=shuffle)
    kv_after = reference.k_norm_rope_mxfp4_cache(**ops["k_norm_rope_mxfp4_cache"])["kv_cache"]
    q = torch.randn(T, H, D, generator=g).bfloat16()
    w = torch.randn(T, H, generator=g)
    ops["q_rope_mxfp4_quant"] = dict(q=q, positions=pos, cos_sin_cache=cs, weights=w,
                                     weights_scale=D ** -0.5 * H ** -0.5)
    qo = reference.q_rope_mxfp4_quant(**ops["q_rope_mxfp4_quant"])
    if cuda_q:                            # the CUDA Q kernels' pair of scales (H = 8: 2^-1.5)
        ops["q_rope_mxfp4_quant"].update(softmax_scale=D ** -0.5, head_scale=H ** -0.5)
    row_ends = (pos + 1) // RATIO
    sc = dict(q_fp4=qo["q_fp4"], q_scale=qo["q_scale"], weights=qo["weights"], kv_cache=kv_after,
              query_start_loc=torch.tensor([0, T]), context_lens=torch.tensor([entries]),
              block_table=page_table.view(1, -1), row_ends=row_ends, page_size=PS, shuffle=shuffle,
              clean_logits=clean)
    ops["paged_mxfp4_mqa_logits"] = sc
    logits = reference.paged_mxfp4_mqa_logits(**sc)["logits"]
    ops["topk"] = dict(logits=logits, lengths=row_ends, k=k)
    ops["compress_norm_rope_mxfp4_cache"] = dict(
        {n: ops["compress_pool"][n] for n in ("state_cache", "block_table", "positions", "req_index",
                                              "kv_slot_mapping", "compress_ratio")},
        cos_sin_cache=cs, norm_weight=norm_w, kv_cache=kv_cache, norm_eps=1e-6, page_size=PS)
    fk = dict(ops["k_norm_rope_mxfp4_cache"], fp8_dtype=fp8_dtype)
    fk.pop("shuffle")
    fk["kv_cache"] = torch.randint(0, 256, (pages, PS * (D + 4)), dtype=torch.uint8, generator=g)
    fk["slot_mapping"] = (pos // RATIO // PS) * PS + (pos // RATIO) % PS
    kv8 = reference.k_norm_rope_fp8_cache(**fk)["kv_cache"]
    q8 = reference.q_rope_fp8_quant(**ops["q_rope_mxfp4_quant"], fp8_dtype=fp8_dtype)
    ops["paged_fp8_mqa_logits"] = dict(q_fp8=q8["q_fp8"], weights=q8["weights"], kv_cache=kv8,
                                       query_start_loc=sc["query_start_loc"],
                                       context_lens=sc["context_lens"],
                                       block_table=torch.arange(pages).view(1, -1), row_ends=row_ends,
                                       page_size=PS, fp8_dtype=fp8_dtype, clean_logits=clean)
    return ops


@pytest.fixture(scope="module")
def case():
    return make_case()


# Per fault, the case that exposes it (mirrors the `cases` each fault declares).
EXPOSING = {
    "scale-interleave-writer": dict(),
    "mask-missing": dict(clean=True),
    "offset-wrap-sim": dict(pages=6, pool_pages=300),
    "cuda-nope-untouched": dict(neg_zero_window=True),
    "cuda-weights-one-multiply": dict(cuda_q=True),
}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and bool(torch.equal(a[n].view(torch.uint8) if a[n].dtype == torch.bfloat16 else a[n],
                             b[n].view(torch.uint8) if b[n].dtype == torch.bfloat16 else b[n])
                 or torch.equal(torch.nan_to_num(a[n].float(), 7.0), torch.nan_to_num(b[n].float(), 7.0)))
        for n in a)


def test_catalogue_declares_every_fault():
    assert len(F.FAULTS) >= 16
    for f in F.FAULTS.values():
        assert f.bug_class and f.description and f.cases, f.name
        assert set(f.ops) <= set(OP_NAMES), f.name
        be = get_backend(f.backend_name)
        assert be.name == f.backend_name
        for op in OP_NAMES:
            # every op the fault does not declare is the reference's own function
            assert (be.ops[op] is reference.FUNCTIONS[op]) == (op not in f.ops), (f.name, op)


def test_every_faulty_op_takes_the_reference_ops_arguments():
    """A faulty op accepts every argument its reference op does (the CUDA path's too), so a
    fault is caught or passes on every case, never an error for a keyword it lacks."""
    import inspect
    for f in F.FAULTS.values():
        be = get_backend(f.backend_name)
        for op in f.ops:
            want = inspect.signature(reference.FUNCTIONS[op]).parameters
            got = inspect.signature(be.ops[op]).parameters
            if any(p.kind is p.VAR_KEYWORD for p in got.values()):
                continue
            missing = [n for n, p in want.items() if p.kind is not p.VAR_KEYWORD and n not in got]
            assert not missing, (f.name, op, missing)


@pytest.mark.parametrize("shuffle", [SHUFFLE, None])
def test_composed_stages_give_the_reference(shuffle):
    c = make_case(seed=3, shuffle=shuffle, clean=True)
    assert same(F.pool_op()(**c["compress_pool"]), reference.compress_pool(**c["compress_pool"]))
    kw = c["k_norm_rope_mxfp4_cache"]
    assert same(F.k_writer_op()(**kw), reference.k_norm_rope_mxfp4_cache(**kw))
    for rounding in ("cuda", "deepseek"):
        kw2 = dict(kw, rounding=rounding, hadamard=True)
        assert same(F.k_writer_op()(**kw2), reference.k_norm_rope_mxfp4_cache(**kw2))
    qw = c["q_rope_mxfp4_quant"]
    assert same(F.q_quant_op()(**qw), reference.q_rope_mxfp4_quant(**qw))
    sc = c["paged_mxfp4_mqa_logits"]
    assert same(F.scorer_op()(**sc), reference.paged_mxfp4_mqa_logits(**sc))
    f8 = c["paged_fp8_mqa_logits"]
    assert same(F.fp8_scorer_op()(**f8), reference.paged_fp8_mqa_logits(**f8))
    tk = c["topk"]
    assert same(F.topk_op(lambda i, n, k: i)(**tk), reference.topk(**tk))
    # the identity and wrap-free permutations/writes are exact too
    assert same(F.k_writer_op(values=F._permuted_values(lambda d, r: torch.arange(d)))(**kw),
                reference.k_norm_rope_mxfp4_cache(**kw))
    assert same(F.k_writer_op(write=F.wrapping_write(F.INT32_BITS))(**kw),
                reference.k_norm_rope_mxfp4_cache(**kw))


# Faults that only show past a size (the field's bugs): proven at their edge below.
SCALED = {"aiter-4244-row-offset-sim", "aiter-4028-schedule-truncation", "aiter-2901-row-start-ignored",
          "aiter-3087-row-start-twice", "sglang-36807-radix-overflow", "flaggems-831-narrow-band",
          "sglang-12583-chunk-offset-ke", "mlx-lm-1189-chunk-rows-only", "vllm-41136-nan-decode"}


# Faults that need a pool past 2 GiB are proven by test_int32_wrap_on_a_2gib_pool.
@pytest.mark.parametrize("name", sorted(n for n, f in F.FAULTS.items()
                                         if not f.large and not f.graph and n not in SCALED))
def test_fault_changes_its_ops_output(name, case):
    f = F.FAULTS[name]
    c = make_case(**EXPOSING[name]) if name in EXPOSING else case
    be = get_backend(f.backend_name)
    for op in f.ops:
        assert not same(be.ops[op](**c[op]), reference.OPS[op].fn(**c[op])), (name, op)


# Graph-only faults are caught when replayed from a graph (tests/test_graph.py); run eagerly
# they give the reference's bytes.
@pytest.mark.parametrize("name", sorted(n for n, f in F.FAULTS.items() if f.graph))
def test_graph_only_fault_is_the_reference_eagerly(name, case):
    be = get_backend(F.FAULTS[name].backend_name)
    for op in F.FAULTS[name].ops:
        assert same(be.ops[op](**case[op]), reference.OPS[op].fn(**case[op])), (name, op)


def test_faults_are_inert_where_they_cannot_show(case):
    """The case restrictions are real: off their cases these faults are invisible, which
    is why each declares where it can be exposed."""
    sc = case["paged_mxfp4_mqa_logits"]
    got = F.FAULTS["mask-missing"].backend().paged_mxfp4_mqa_logits(**sc)["logits"]
    want = reference.paged_mxfp4_mqa_logits(**sc)["logits"]
    valid = torch.arange(got.shape[1])[None, :] < sc["row_ends"][:, None]
    assert torch.equal(got[valid], want[valid])                  # only past-the-end columns move
    kw = case["k_norm_rope_mxfp4_cache"]
    assert same(F.FAULTS["offset-wrap-sim"].backend().k_norm_rope_mxfp4_cache(**kw),
                reference.k_norm_rope_mxfp4_cache(**kw))          # pool under 512 KiB


def test_writer_unowned_fault_leaves_owned_bytes_right(case):
    kw = case["k_norm_rope_mxfp4_cache"]
    got = F.FAULTS["writer-unowned-bytes"].backend().k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    want = reference.k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    sel = reference.k_writer.writer_mask(kw["positions"], kw["slot_mapping"], RATIO)
    owned = layout.owned_mask(*want.shape, kw["slot_mapping"][sel], page_size=PS, head_dim=D,
                              shuffle=SHUFFLE)
    assert torch.equal(got[owned], want[owned]) and not torch.equal(got[~owned], want[~owned])


def test_int32_wrap_emulation_wraps_at_the_width():
    """The width-parametrised write drops exactly the bytes whose offset passes 2**(bits-1)."""
    c = make_case(pages=6, pool_pages=300)
    kw = c["k_norm_rope_mxfp4_cache"]
    want = reference.k_norm_rope_mxfp4_cache(**kw)["kv_cache"].view(-1)
    got = F.k_writer_op(write=F.wrapping_write(F.SIM_WRAP_BITS))(**kw)["kv_cache"].view(-1)
    before = kw["kv_cache"].view(-1)
    lim = 1 << (F.SIM_WRAP_BITS - 1)
    assert torch.equal(got[:lim][want[:lim] == before[:lim]], before[:lim][want[:lim] == before[:lim]])
    changed_high = (want[lim:] != before[lim:]).nonzero().flatten()
    assert changed_high.numel() > 0 and torch.equal(got[lim:][changed_high], before[lim:][changed_high])


@pytest.mark.slow
def test_int32_wrap_on_a_2gib_pool():
    """The real fault on a real pool past 2 GiB (about 6.5 GB of RAM, 10 s on 2 cores): over
    the CI memory budget, so `make test-slow`. CI proves the same write path at a 20-bit
    width: test_int32_wrap_emulation_wraps_at_the_width and the quick selftest's
    offset-wrap-sim fault."""
    stride = PS * layout.entry_bytes(D)
    pages = (1 << 31) // stride + 2
    kv_cache = torch.zeros(pages, stride, dtype=torch.uint8)
    c = make_case(pages=6)
    kw = dict(c["k_norm_rope_mxfp4_cache"], kv_cache=kv_cache)
    kw["slot_mapping"] = kw["slot_mapping"] % PS + (pages - 1) * PS        # the last page
    got = F.FAULTS["offset-int32-wrap"].backend().k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    want = reference.k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    assert not torch.equal(got[-1], want[-1])


# --- the field's bugs, at the size where each appears ----------------------------------------

def test_field_faults_name_their_source():
    field = [f for f in F.FAULTS.values() if f.source]
    assert len(field) >= 15
    for f in field:
        repo, _, number = f.source.partition("#")
        assert "/" in repo and number.isdigit(), f.source
    assert all(f.source.split("#")[1] in f.name for f in field
               if f.name not in ("scale-ocp-floor", "scale-interleave-writer", "fp8-ocp-read-fnuz"))
    assert set(F.NOT_MODELLED) == {"vllm-project/vllm#52644"}


def _post(name):
    """The faulty op of a one-op field fault."""
    f = F.FAULTS[name]
    return get_backend(f.backend_name).ops[f.ops[0]]


def test_logits_rows_past_the_offset_edge_are_not_stored():
    post = F._rows_past_offset(F.LOGITS_ROW_SIM_BITS)
    width = 2304                                      # 9216 bytes a row: row 228 starts past 2 MiB
    x = torch.randn(300, width)
    got = post(x.clone(), {})
    first = -(-(1 << (F.LOGITS_ROW_SIM_BITS - 1)) // (width * 4))
    assert first == 228
    assert torch.equal(got[:first], x[:first]) and bool((got[first:] == 0).all())
    assert torch.equal(post(x[:first].clone(), {}), x[:first])        # below the edge: inert
    real = F._rows_past_offset(F.INT32_BITS)
    assert -(-(1 << 31) // (2 ** 20 * 4)) == 512                      # row 512 of [1024, 2^20]
    assert torch.equal(real(x.clone(), {}), x)


def test_schedule_truncation_starts_past_16384_entries():
    cap = F.SCHEDULE_TILE * F.SCHEDULE_TILES_PER_ROW
    assert cap == 16384
    x = torch.randn(2, cap + 3)
    got = F._schedule_truncated(x.clone(), {})
    assert torch.equal(got[:, :cap], x[:, :cap]) and bool(torch.isinf(got[:, cap:]).all())
    assert torch.equal(F._schedule_truncated(x[:, :cap].clone(), {}), x[:, :cap])


def _prefill_call(rows_a=4000, rows_b=97, end_b=2250, width=2304, seed=0):
    """Rows of a sequence A from position 0 (ends 0..1000), then long rows of a sequence B
    deep in its context: B's packed row start is A's last end."""
    g = torch.Generator().manual_seed(seed)
    ends_a = (torch.arange(rows_a) + 1) // 4
    ends_b = end_b - rows_b // 4 + (torch.arange(rows_b) + 1) // 4
    lengths = torch.cat((ends_a, ends_b))
    logits = torch.randn(lengths.numel(), width, generator=g)
    return logits, lengths


def test_packed_row_starts_recover_the_sequences():
    _, lengths = _prefill_call(rows_a=40, rows_b=9)
    starts = F.packed_row_starts(lengths)
    assert bool((starts[:40] == 0).all()) and bool((starts[40:] == 10).all())
    assert F.packed_row_starts(torch.tensor([5, 9, 3])).tolist() == [0, 5, 14]       # decode rows


def _packed_starts_by_rows(lengths):
    starts, start, prev = [], 0, None
    for i, n in enumerate(lengths):
        if prev is not None and not 0 <= n - prev <= 1:
            start += prev                                  # the previous sequence's last end
        starts.append(start)
        prev = n
    return starts


def test_packed_row_starts_take_each_sequences_last_end():
    for lengths in ([7], [3, 3, 4, 4, 5, 2, 2, 3, 9], [0, 1, 1, 2, 8, 8, 9, 4, 5, 6, 6, 0]):
        got = F.packed_row_starts(torch.tensor(lengths)).tolist()
        assert got == _packed_starts_by_rows(lengths), lengths
    assert F.packed_row_starts(torch.tensor([], dtype=torch.long)).numel() == 0


@pytest.mark.parametrize("name", ["aiter-2901-row-start-ignored", "aiter-3087-row-start-twice"])
def test_prefill_topk_row_start_bugs_need_more_than_4096_rows(name):
    op = _post(name)
    logits, lengths = _prefill_call()
    assert lengths.numel() == 4097
    kw = dict(logits=logits, lengths=lengths, k=1024)
    got, want = op(**kw)["indices"], reference.topk(**kw)["indices"]
    assert torch.equal(got[:4000], want[:4000]) and not torch.equal(got[4000:], want[4000:])
    small = dict(logits=logits[1:], lengths=lengths[1:], k=1024)          # 4096 rows: inert
    assert torch.equal(op(**small)["indices"], reference.topk(**small)["indices"])


def _band(n, rows=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 10.0 + torch.rand(rows, n, generator=g) * 0.02               # one fp16 bin, distinct


@pytest.mark.parametrize("name,edge", [("sglang-36807-radix-overflow", 4096), ("flaggems-831-narrow-band", 2048)])
def test_radix_topk_overflow_past_its_candidate_buffer(name, edge):
    op = _post(name)
    inside = dict(logits=_band(edge), lengths=torch.full((3,), edge), k=8)
    assert torch.equal(op(**inside)["indices"], reference.topk(**inside)["indices"])
    past = dict(logits=_band(3 * edge), lengths=torch.full((3,), 3 * edge), k=8)
    got, want = op(**past)["indices"], reference.topk(**past)["indices"]
    assert not torch.equal(got.sort(1).values, want.sort(1).values)
    for r in range(3):
        assert got[r].unique().numel() == 8


def _scorer_kw(qsl, ends):
    return dict(query_start_loc=torch.tensor(qsl), row_ends=torch.tensor(ends))


def test_chunk_offset_and_chunk_rows_faults_spare_first_chunks():
    width = 40
    x = torch.randn(8, width)
    first = _scorer_kw([0, 8], [0, 0, 0, 1, 1, 1, 1, 2])                   # a chunk from position 0
    assert torch.equal(F._window_from_chunk_offset(x.clone(), first), x)
    assert torch.equal(F._chunk_rows_only(x.clone(), first), x)
    deep = _scorer_kw([0, 8], [25, 25, 25, 26, 26, 26, 26, 27])            # a chunk deep in context
    assert bool(torch.isinf(F._window_from_chunk_offset(x.clone(), deep)[:, 2:25]).all())
    assert bool(torch.isinf(F._chunk_rows_only(x.clone(), deep)[:, 2:25]).all())


def test_nan_only_in_decode_calls():
    x = torch.randn(3, 20)
    assert torch.equal(F._nan_in_decode(x.clone(), _scorer_kw([0, 3], [1, 2, 3])), x)
    got = F._nan_in_decode(x.clone(), _scorer_kw([0, 1, 2, 3], [5, 9, 20]))
    assert bool(torch.isnan(got[0, :5]).all()) and torch.equal(got[0, 5:], x[0, 5:])
