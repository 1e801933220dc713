"""The value boundaries of harness/run/inputs.py, proven through the reference's stages:
relu_zero and duplicate_keys plateaus (pooled and direct history, through pooling), coarse
ties, every e8m0 code of the ceil rule in written keys and quantized queries (scale_codes),
and raw history holding every code the format can hold, each visible in the logits."""
import collections

import pytest
import torch

import reference
from harness.run.cases import CaseError, load_suite_file
from harness.run.geometry import geometry
from harness.run.inputs import QUERY_CODES, build, key_codes, query_codes, share_mask, value_context
from reference import layout, mxfp4

HEAD = '[suite]\nname = "t"\n[[case]]\nname = "c"\nheads = 4\ntopk = 8\n'
TWO_SEQS = 'seqs = [{len = 72, chunks = [30, 42]}, {len = 52, chunks = [40], decode = 2}]\n'


def case_of(tmp_path, body):
    p = tmp_path / "s.toml"
    p.write_text(HEAD + body)
    return load_suite_file(p).cases[0]


def record(case):
    """The case's chain through the reference's stages, as the runner feeds them (history
    first, then each step): {op: [(inputs, scalars, outputs)]}."""
    inp, rec = build(case), collections.defaultdict(list)

    def op(name, **ins):
        sc = inp.scalars(name)
        out = reference.OPS[name].fn(**ins, **sc)
        rec[name].append((ins, sc, out))
        return out

    def write(t, pool, k=None):
        if k is None:
            k = op("compress_pool", state_cache=inp.state_cache, block_table=inp.state_block_table,
                   positions=t.positions, req_index=t.req_index, kv_slot_mapping=t.slot_mapping)["pooled"]
        return op("k_norm_rope_mxfp4_cache", k=k, positions=t.positions, cos_sin_cache=inp.cos_sin_cache,
                  norm_weight=inp.norm_weight, slot_mapping=t.slot_mapping, kv_cache=pool)["kv_cache"]

    pool = inp.kv_cache
    if inp.history is not None:
        pool = write(inp.history, pool, inp.history.k)
        rec.clear()                                     # the history's stages: not the steps'
    for st in inp.steps:
        pool = write(st, pool, None if "compress_pool" in case.ops else st.k)
        q = op("q_rope_mxfp4_quant", q=st.q, positions=st.positions, cos_sin_cache=inp.cos_sin_cache,
               weights=st.weights)
        op("paged_mxfp4_mqa_logits", q_fp4=q["q_fp4"], q_scale=q["q_scale"], weights=q["weights"], kv_cache=pool,
           query_start_loc=st.query_start_loc, context_lens=st.context_lens, block_table=st.block_table,
           row_ends=st.row_ends)
    return None, rec


def rows_of(rec):
    """(valid fp32 logits of a row, its length) for every scored row."""
    for ins, _, outs in rec["paged_mxfp4_mqa_logits"]:
        for r, n in enumerate(ins["row_ends"].tolist()):
            if n:
                yield outs["logits"][r, :n], n


def live_codes(packed, scales):
    """The scale codes of blocks holding a non-zero nibble (0x8, -0, counts as zero)."""
    nib = mxfp4.unpack_nibbles(packed).view(*scales.shape, 32) & 7
    return set(scales[(nib != 0).any(-1)].tolist())


@pytest.mark.parametrize("history", ["pooled", "direct"])
def test_relu_zero_keys_score_exactly_zero_and_the_plateau_is_cut(tmp_path, history):
    c = case_of(tmp_path, TWO_SEQS + f'dist = ["relu_zero"]\nhistory = "{history}"\n')
    ctx = value_context(c, geometry(c))
    _, rec = record(c)
    cut = 0
    for x, n in rows_of(rec):
        zero = share_mask(torch.arange(n), ctx.share, ctx.offset)
        assert torch.equal(x == 0, zero) and bool((x[~zero] > 0).all())
        cut += int((~zero).sum()) < c.topk < n
    assert cut >= 10


@pytest.mark.parametrize("history", ["pooled", "direct"])
def test_duplicate_keys_tie_above_every_other_key(tmp_path, history):
    c = case_of(tmp_path, TWO_SEQS + f'dist = ["duplicate_keys"]\ntie_share = 0.75\nhistory = "{history}"\n')
    ctx = value_context(c, geometry(c))
    _, rec = record(c)
    cut = 0
    for x, n in rows_of(rec):
        dup = share_mask(torch.arange(n), ctx.share, ctx.offset)
        if dup.any():
            assert bool((x[dup] == x[dup][0]).all()) and bool((x[~dup] < x[dup][0]).all())
        cut += int(dup.sum()) > c.topk and n > c.topk
    assert cut >= 10
    # the written duplicates: one set of scale bytes and nibble magnitudes (RoPE zeros keep a sign)
    ins, sc, outs = rec["k_norm_rope_mxfp4_cache"][0]
    sel = (ins["slot_mapping"] >= 0) & ((ins["positions"] + 1) % 4 == 0)
    dup = share_mask(ins["positions"][sel] // 4, ctx.share, ctx.offset)
    packed, scales = layout.read_entries(outs["kv_cache"], ins["slot_mapping"][sel][dup], page_size=sc["page_size"],
                                         head_dim=128, shuffle=sc["shuffle"])
    mag = mxfp4.unpack_nibbles(packed) & 7
    assert dup.sum() > 3 and bool((scales == scales[0]).all()) and bool((mag == mag[0]).all())


def test_coarse_scores_tie_at_random_ranks(tmp_path):
    c = case_of(tmp_path, TWO_SEQS + 'dist = ["coarse"]\n')
    _, rec = record(c)
    long_rows = [(x, n) for x, n in rows_of(rec) if n >= 12]
    assert long_rows
    for x, n in long_rows:
        assert x.unique().numel() <= n * 3 // 4
    tied_inside = sum(bool((x == x.sort(descending=True).values[c.topk - 1]).sum() > 1) for x, n in long_rows)
    assert tied_inside >= 5                            # ties at the k-th value itself


def test_scale_codes_carry_every_ceil_code_in_keys_and_queries(tmp_path):
    """Every code 1..253 the ceil rule can give, in non-zero blocks of the written K entries
    and of the quantized q, with bf16 subnormal inputs among them (and their blocks non-zero)."""
    c = case_of(tmp_path, 'ops = ["k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant"]\n'
                          'seqs = [{len = 1024, chunks = [600]}]\ndist = ["scale_codes"]\n')
    _, rec = record(c)
    ins, sc, outs = rec["k_norm_rope_mxfp4_cache"][0]
    sel = (ins["slot_mapping"] >= 0) & ((ins["positions"] + 1) % 4 == 0)
    packed, scales = layout.read_entries(outs["kv_cache"], ins["slot_mapping"][sel], page_size=sc["page_size"],
                                         head_dim=128, shuffle=sc["shuffle"])
    assert live_codes(packed, scales) == set(range(1, 254))
    ctx = value_context(c, geometry(c))
    assert torch.equal(scales.long(), key_codes(ctx, ins["positions"][sel] // 4))     # the plan, exactly
    qins, _, q = rec["q_rope_mxfp4_quant"][0]
    assert live_codes(q["q_fp4"], q["q_scale"]) == set(range(1, 254))
    focus, code = query_codes(ctx, qins["positions"])
    got = q["q_scale"].long()[torch.arange(code.numel()), :, focus]                    # [T, H]
    assert bool((got == code[:, None]).all())
    tiny = torch.finfo(torch.float32).tiny
    for x in (ins["k"][sel].float(), qins["q"].float()):
        assert bool(((x != 0) & (x.abs() < tiny)).any())


def test_scale_codes_blocks_are_visible_and_logits_finite(tmp_path):
    """Each query row holds values in its focus block only, so every logit is that block's
    contribution: non-zero and finite in fp32 for every pair, every key block seen by a row
    focusing it."""
    c = case_of(tmp_path, 'ops = ["paged_mxfp4_mqa_logits"]\nseqs = [{len = 640, chunks = [64]}]\ndist = ["scale_codes"]\n')
    _, rec = record(c)
    (ins, sc, outs), = rec["paged_mxfp4_mqa_logits"]
    q = mxfp4.dequantize_mxfp4(ins["q_fp4"], ins["q_scale"]).view(*ins["q_fp4"].shape[:2], 4, 32)
    live = (q != 0).any(-1).any(1)                      # [rows, blocks]
    assert bool((live.sum(1) == 1).all())
    focus = live.int().argmax(1)
    seen = torch.zeros(int(ins["row_ends"].max()), 4, dtype=torch.bool)
    for r, n in enumerate(ins["row_ends"].tolist()):
        x = outs["logits"][r, :n]
        assert bool(torch.isfinite(x).all())
        seen[:n, focus[r]] |= x != 0
    # every entry but the chunk's last (only its own boundary row, focus 0, sees it) in every
    # swept block; block 3 is the norm's anchor
    assert bool(seen[:-1, :3].all()) and bool(seen[-1, 0])


@pytest.mark.parametrize("page_layout", ["shuffled", "natural"])
def test_raw_history_holds_every_code_each_visible_and_finite(tmp_path, page_layout):
    c = case_of(tmp_path, f'ops = ["paged_mxfp4_mqa_logits"]\nseqs = [{{len = 1027, decode = 3}}]\n'
                          f'dist = ["scale_codes"]\nhistory = "raw"\nlayout = "{page_layout}"\n')
    _, rec = record(c)
    (ins, sc, outs) = rec["paged_mxfp4_mqa_logits"][-1]
    n = int(ins["context_lens"][0])
    pages = ins["block_table"][0].long()
    slots = (pages[:, None] * sc["page_size"] + torch.arange(sc["page_size"])).flatten()[:n]
    packed, scales = layout.read_entries(ins["kv_cache"], slots, page_size=sc["page_size"], head_dim=128,
                                         shuffle=sc["shuffle"])
    assert live_codes(packed, scales) == set(range(255))
    ctx = value_context(c, geometry(c))
    assert torch.equal(scales.long(), key_codes(ctx, torch.arange(n), raw=True))
    assert bool((mxfp4.unpack_nibbles(packed) == 8).any())                   # -0 among the nibbles
    for k, (ins, _, outs) in enumerate(rec["paged_mxfp4_mqa_logits"]):
        x = outs["logits"][0, :int(ins["row_ends"][0])]
        assert bool(torch.isfinite(x).all()) and bool((x != 0).all())
    # the last decode query (p = 1026) focuses block 3: every key's code there is 0
    assert (1026 + 1) % 4 == 3 and QUERY_CODES[3][0] > 0


def test_value_boundaries_are_deterministic(tmp_path):
    for dist, extra in (("relu_zero", ""), ("duplicate_keys", ""), ("coarse", ""), ("scale_codes", 'history = "raw"\n')):
        c = case_of(tmp_path, TWO_SEQS + f'dist = ["{dist}"]\n' + extra)
        a, b = build(c), build(c)
        assert torch.equal(a.kv_cache, b.kv_cache) and torch.equal(a.state_cache, b.state_cache)
        assert all(torch.equal(x.q.view(torch.int16), y.q.view(torch.int16)) and torch.equal(x.k.view(torch.int16), y.k.view(torch.int16))
                   for x, y in zip(a.steps, b.steps))


@pytest.mark.parametrize("body, needle", [
    ('tie_share = 0\n', "tie_share: 0 is out of range (0, 1]"),
    ('tie_share = 1.5\n', "tie_share: 1.5 is out of range (0, 1]"),
    ('tie_share = "half"\n', "tie_share: expected a number"),
    ('dist = ["relu_zero", "coarse"]\n', "at most one of"),
    ('dist = ["duplicate_keys", "zero_rows"]\n', "'duplicate_keys' does not combine with 'zero_rows'"),
    ('dist = ["scale_codes", "tiny"]\n', "'scale_codes' does not combine with 'tiny'"),
    ('history = "raw"\n', 'it needs dist = ["scale_codes"]'),
    ('tie_share = 0.5\ndist = ["coarse"]\n', "tie_share: sizes the plateau of relu_zero or duplicate_keys"),
    ('history = "raw"\ndist = ["scale_codes"]\nops = ["k_norm_rope_fp8_cache"]\n', "the MXFP4 chain"),
])
def test_bad_value_keys_are_one_error(tmp_path, body, needle):
    with pytest.raises(CaseError) as e:
        case_of(tmp_path, body)
    assert needle in str(e.value) and "case 'c'" in str(e.value) and "\n" not in str(e.value)


def test_tie_share_one_is_the_whole_row(tmp_path):
    c = case_of(tmp_path, 'tie_share = 1\ndist = ["relu_zero", "zero_rows"]\n')
    assert c.tie_share == 1.0 and bool(share_mask(torch.arange(1000), 1.0, 0.3).all())
