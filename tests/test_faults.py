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


# Faults that only show at a value boundary no normal draw reaches: proven at it below.
VALUE_BOUNDARY = {"topk-tie-drop", "topk-zero-as-masked", "e8m0-code0-flush", "e8m0-fp32-dequant-overflow",
                  "subnormal-flush"}
# Faults that only show past a size (the field's bugs): proven at their edge below.
SCALED = VALUE_BOUNDARY | {"aiter-4244-row-offset-sim", "aiter-4028-schedule-truncation", "aiter-2901-row-start-ignored",
          "aiter-3087-row-start-twice", "sglang-36807-radix-overflow", "flaggems-831-narrow-band",
          "sglang-12583-chunk-offset-ke", "mlx-lm-1189-chunk-rows-only", "vllm-41136-nan-decode"}
# Faults that only show on a batch's structure (shared pages, a wide table, an empty sequence):
# proven on their geometry below.
STRUCTURAL = {"scorer-page-owner", "scorer-table-stride", "empty-seq-row-shift"}


# Faults that show only on non-finite inputs the reference refuses: proven below, through the
# invariants, on the case that plants them.
NONFINITE = {"topk-nan-row-garbage", "scorer-nan-mask-add", "q-nan-guard-per-token"}


# Faults that need a pool past 2 GiB are proven by test_int32_wrap_on_a_2gib_pool.
@pytest.mark.parametrize("name", sorted(n for n, f in F.FAULTS.items()
                                        if not f.large and not f.graph and n not in SCALED | STRUCTURAL | NONFINITE))
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


# --- value boundaries: inert off their boundary, wrong on it --------------------------------

def _topk_kw(rows, k):
    x = torch.tensor(rows, dtype=torch.float32)
    return dict(logits=x, lengths=torch.full((x.shape[0],), x.shape[1]), k=k)


def test_tie_drop_pads_only_a_plateau_cut_at_the_kth_value():
    op = _post("topk-tie-drop")
    off = _topk_kw([[5, 4, 3, 2, 1, 0], [3, 3, 3, 1, 0, 0]], 3)         # ties that all fit, or below the k-th
    assert torch.equal(op(**off)["indices"], reference.topk(**off)["indices"])
    on = _topk_kw([[5, 4, 0, 0, 0, -1], [2, 2, 2, 2, 1, 0]], 3)         # 3 zeros for 1 place; 4 twos for 3
    got = op(**on)["indices"]
    assert got[0, :2].tolist() == [0, 1] and got[0, 2] == -1 and bool((got[1] == -1).all())


def test_zero_as_masked_pads_rows_with_fewer_positives_than_k():
    op = _post("topk-zero-as-masked")
    off = _topk_kw([[5, 4, 3, 0, 0, 0], [0, 7, 0, 6, 5, 1]], 3)         # zeros below the k-th: never selected
    assert torch.equal(op(**off)["indices"], reference.topk(**off)["indices"])
    on = _topk_kw([[5, 0, 4, 0, 0, 0], [0, 0, 0, 0, -1, -2]], 3)
    got = op(**on)["indices"]
    assert got[0].tolist() == [0, 2, -1] and got[1].tolist() == [4, 5, -1]


def _with_scale_bytes(sc, codes, nibble=None, q_code=None):
    """The scorer's inputs with entry 2's scale bytes set to `codes` (its first element at e2m1
    code `nibble`) and every query's block 0 at scale `q_code`: bytes only raw history writes."""
    kv = sc["kv_cache"].clone()
    slot = sc["block_table"][0, 0].long() * PS + 2
    vo, so = layout.slot_byte_offsets(slot.view(1), PS, D, sc["shuffle"], kv.shape[1])
    flat = kv.view(-1)
    flat[so[0, :len(codes)]] = torch.tensor(codes, dtype=torch.uint8)
    if nibble is not None:
        flat[vo[0, 0]] = (flat[vo[0, 0]] & 0xF0) | nibble
    out = dict(sc, kv_cache=kv)
    if q_code is not None:
        out["q_scale"] = sc["q_scale"].clone()
        out["q_scale"][..., 0] = q_code
    return out


@pytest.mark.parametrize("name, codes, nibble, q_code", [
    ("e8m0-code0-flush", [0, 0, 0, 0], None, None),              # the whole key at 2^-127
    ("e8m0-fp32-dequant-overflow", [254], 7, 1),                 # 6 * 2^127 against q at 2^-126
    ("e8m0-fp32-dequant-overflow", [253], 6, 1),                 # 4 * 2^126 = 2^128
])
def test_e8m0_faults_show_only_on_codes_past_what_fp32_holds(case, name, codes, nibble, q_code):
    op = _post(name)
    sc = case["paged_mxfp4_mqa_logits"]
    assert same(op(**sc), reference.paged_mxfp4_mqa_logits(**sc))          # codes as the writer wrote them
    raw = _with_scale_bytes(sc, codes, nibble, q_code)
    got, want = op(**raw)["logits"], reference.paged_mxfp4_mqa_logits(**raw)["logits"]
    valid = torch.arange(got.shape[1])[None, :] < raw["row_ends"][:, None]
    assert bool(torch.isfinite(want[valid]).all())
    assert not torch.equal(got[valid], want[valid])
    if name == "e8m0-fp32-dequant-overflow":
        assert not bool(torch.isfinite(got[valid]).all())
    else:
        assert bool((want[:, 2][valid[:, 2]] != 0).any()) and bool((got[:, 2][valid[:, 2]] == 0).all())


K_OP, Q_OP = "k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant"


def test_subnormal_flush_shows_only_on_subnormal_inputs(case):
    f = F.FAULTS["subnormal-flush"]
    be = get_backend(f.backend_name)
    kw, qw = case["k_norm_rope_mxfp4_cache"], case["q_rope_mxfp4_quant"]
    assert same(be.ops[K_OP](**kw), reference.k_norm_rope_mxfp4_cache(**kw))
    assert same(be.ops[Q_OP](**qw), reference.q_rope_mxfp4_quant(**qw))
    tiny = torch.finfo(torch.float32).tiny
    k, q = kw["k"].clone(), qw["q"].clone()
    k[:, 32:64] = tiny * 0.75                  # a NoPE block of bf16 subnormals (1.5 * 2^-127)
    q[:, :, :32] = tiny * 0.75
    assert not same(be.ops[K_OP](**dict(kw, k=k)), reference.k_norm_rope_mxfp4_cache(**dict(kw, k=k)))
    assert not same(be.ops[Q_OP](**dict(qw, q=q)), reference.q_rope_mxfp4_quant(**dict(qw, q=q)))
# --- structural boundaries: each fault is exact until its geometry appears -------------------

def _scorer_pair(name, exact: dict, exposed: dict):
    """(fault's logits, reference's) on the call where the boundary is absent, then present."""
    op = _post(name)
    out = []
    for kw in (exact, exposed):
        out.append((op(**kw)["logits"], reference.paged_mxfp4_mqa_logits(**kw)["logits"]))
    return out


def _two_seqs(sc, table, rows=(slice(0, 48), slice(48, 96))):
    """The one-sequence scorer call of make_case split into two sequences reading `table`."""
    return dict(sc, block_table=torch.tensor(table), query_start_loc=torch.tensor([0, 48, 96]),
                context_lens=torch.tensor([24, 24]))


def test_page_owner_fault_needs_a_page_shared_by_two_sequences(case):
    sc = case["paged_mxfp4_mqa_logits"]
    pt = sc["block_table"][0].tolist()
    other = next(p for p in range(6) if p != pt[0])
    (a, b), (c, d) = _scorer_pair("scorer-page-owner", _two_seqs(sc, [pt, [other] + pt[1:]]),
                                  _two_seqs(sc, [pt, pt]))
    assert same({"l": a}, {"l": b})                              # distinct pages: exact
    valid = torch.arange(c.shape[1])[None, :] < sc["row_ends"][:, None]
    assert bool(torch.isinf(c[:48][valid[:48]]).all()) and torch.equal(c[48:], d[48:])


def test_table_stride_fault_needs_a_table_wider_than_the_contexts(case):
    sc = case["paged_mxfp4_mqa_logits"]
    pt = sc["block_table"][0].tolist()                           # 24 entries: one page of 32 read
    (a, b), (c, d) = _scorer_pair("scorer-table-stride", _two_seqs(sc, [pt[:1], pt[:1]]),
                                  _two_seqs(sc, [pt, pt[:1] + pt[2:] + pt[1:2]]))
    assert same({"l": a}, {"l": b})
    assert torch.equal(c[:48], d[:48]) and not same({"l": c[48:]}, {"l": d[48:]})


def test_empty_sequence_fault_needs_a_decode_call_with_an_empty_sequence(case):
    sc = case["paged_mxfp4_mqa_logits"]
    pt = sc["block_table"][0].tolist()
    other = next(p for p in range(6) if p != pt[0])
    sel = torch.tensor([40, 95])
    rows = dict(sc, q_fp4=sc["q_fp4"][sel], q_scale=sc["q_scale"][sel], weights=sc["weights"][sel],
                row_ends=sc["row_ends"][sel])
    full = dict(rows, query_start_loc=torch.tensor([0, 1, 2]), context_lens=torch.tensor([24, 24]),
                block_table=torch.tensor([pt, pt]))
    gap = dict(rows, query_start_loc=torch.tensor([0, 1, 1, 2]), context_lens=torch.tensor([24, 24, 24]),
               block_table=torch.tensor([pt, [other] + pt[1:], pt]))
    (a, b), (c, d) = _scorer_pair("empty-seq-row-shift", full, gap)
    assert same({"l": a}, {"l": b})
    assert torch.equal(c[0], d[0]) and not same({"l": c[1:]}, {"l": d[1:]})
    prefill = dict(gap, query_start_loc=torch.tensor([0, 2, 2, 2]))      # two rows of one sequence
    assert same(_post("empty-seq-row-shift")(**prefill), reference.paged_mxfp4_mqa_logits(**prefill))
# --- faults on non-finite inputs, caught by the invariants (harness/diff/invariants.py)

def test_nonfinite_faults_are_the_reference_on_finite_inputs():
    c = make_case(seed=4, clean=True)
    for name in sorted(NONFINITE):
        be = get_backend(F.FAULTS[name].backend_name)
        for op in F.FAULTS[name].ops:
            assert same(be.ops[op](**c[op]), reference.OPS[op].fn(**c[op])), (name, op)


def test_nan_carrying_ops_and_the_nan_topk_bug():
    c = make_case(seed=4, clean=True)
    qw = dict(c["q_rope_mxfp4_quant"])
    qw["weights"] = qw["weights"].clone()
    qw["weights"][40, 3] = float("nan")
    q = F.nan_weights_q_op()(**qw)
    assert bool(torch.isnan(q["weights"][40, 3])) and int(torch.isnan(q["weights"]).sum()) == 1
    sc = dict(c["paged_mxfp4_mqa_logits"], weights=q["weights"])
    for mask_add in (False, True):
        lg = F.nan_weights_scorer_op(mask_add)(**sc)["logits"]
        end = int(sc["row_ends"][40])
        assert bool(torch.isnan(lg[40, :end]).all()) and int(torch.isnan(lg).any(1).sum()) == 1
        assert bool(torch.isnan(lg[40, end:]).all()) == mask_add
        assert bool(torch.isneginf(lg[40, end:]).all()) != mask_add
    lg = F.nan_weights_scorer_op()(**sc)["logits"]
    tk = dict(logits=lg, lengths=sc["row_ends"], k=4)
    good = F.nan_ranking_topk_op()(**tk)["indices"]
    bad = F.FAULTS["topk-nan-row-garbage"].backend().topk(**tk)["indices"]
    end = int(sc["row_ends"][40])
    assert len(set(good[40].tolist())) == 4 and all(0 <= i < end for i in good[40].tolist())
    assert set(bad[40].tolist()) == {end}                    # every NaN taken, written one past the row
    rows = torch.arange(bad.shape[0]) != 40
    assert torch.equal(good[rows], bad[rows])


def _nan_weights_ops():
    return dict(q_rope_mxfp4_quant=F.nan_weights_q_op(), paged_mxfp4_mqa_logits=F.nan_weights_scorer_op(),
                topk=F.nan_ranking_topk_op())


@pytest.mark.parametrize("name,stage,check,correct,refused", [
    ("topk-nan-row-garbage", "topk", "topk_range", _nan_weights_ops,
     ["q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"]),
    ("scorer-nan-mask-add", "paged_mxfp4_mqa_logits", "logits_past_end", _nan_weights_ops,
     ["q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"]),
    ("q-nan-guard-per-token", "q_rope_mxfp4_quant", "scale_code",
     lambda: dict(q_rope_mxfp4_quant=F.nonfinite_q_op()), ["q_rope_mxfp4_quant"]),
])
def test_invariants_catch_the_nonfinite_faults(name, stage, check, correct, refused):
    """On the planted case the reference refuses the non-finite input at the Q quant: only
    the invariants judge what follows, and they catch each fault where it lives."""
    from harness.run.budgets import load, verdict
    from harness.run.cases import Catalog
    from harness.run.runner import run_case
    from optimized import Backend, register
    case = Catalog().case(F.FAULTS[name].cases[0])
    v = verdict(run_case(case, F.FAULTS[name].backend_name), load(), "selftest")
    assert v["status"] == "fail" and v["ok"] is False, v["reason"]
    assert [x["metric"] for x in v["violations"]] == [f"{stage}.invariant_violations"], v["violations"]
    assert v["reason"].startswith(f"{stage} fails: ") and "on non-finite inputs: q_rope_mxfp4_quant" in v["reason"]
    f = next(x for x in v["findings"] if x["class"] == "invariant")
    assert f["stage"] == stage and f["invariant"] == check
    # a backend that carries the non-finite input through correctly is no alarm: the case stays
    # nonfinite_input, every stage after the refusal judged by the invariants
    register("test-nonfinite-carried", lambda: Backend("test-nonfinite-carried", "carried as kernels do",
                                                       dict(reference.FUNCTIONS, **correct())))
    row = run_case(case, "test-nonfinite-carried")
    ok = verdict(row, load(), "selftest")
    assert (ok["status"], ok["ok"], ok["violations"]) == ("nonfinite_input", True, []), ok["reason"]
    assert row["metrics"][f"{stage}.invariant_violations"] == 0
    assert [s.split(" ")[0] for s in row["details"]["refused"]] == refused


def test_the_page_invariant_catches_a_writer_touching_unowned_bytes(case):
    """writer-unowned-bytes, caught without the reference: the bytes after each entry's last
    scale byte are no written slot's."""
    from harness.diff import invariants
    kw = case["k_norm_rope_mxfp4_cache"]
    sc = dict(compress_ratio=RATIO, page_size=PS, shuffle=SHUFFLE)
    good = reference.k_norm_rope_mxfp4_cache(**kw)
    assert invariants.check("k_norm_rope_mxfp4_cache", kw, sc, good).metrics["invariant_violations"] == 0
    bad = F.FAULTS["writer-unowned-bytes"].backend().k_norm_rope_mxfp4_cache(**kw)
    rep = invariants.check("k_norm_rope_mxfp4_cache", kw, sc, bad)
    assert rep.metrics["invariant_violations"] > 0
    assert {f["invariant"] for f in rep.findings} == {"page_outside_owned"}
