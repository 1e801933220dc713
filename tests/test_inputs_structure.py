"""The batch's structure a case can ask for: page orders (reversed, shared pages), sequences
with no rows in a step, contexts of no entries, and non-finite plants in every op input."""
import re

import pytest
import torch

from harness.run.cases import CaseError, Catalog
from harness.run.coverage import measure
from harness.run.geometry import geometry, shared_pages
from harness.run.inputs import build
from harness.run.runner import run_case

HEAD = '[defaults]\nheads = 4\ntopk = 8\npage_size = 32\nlayout = "natural"\n'


def _cat(tmp_path, body):
    (tmp_path / "s.toml").write_text(HEAD + body)
    return Catalog(tmp_path)


def _writers(t, r=4):
    return ((t.positions + 1) % r == 0) & (t.slot_mapping >= 0)


def test_reversed_pages_run_down_from_the_top_of_the_pool(tmp_path):
    case = _cat(tmp_path, '[[case]]\nname = "r"\npage_order = "reversed"\n'
                          'seqs = [{len = 400, chunks = [20]}, {len = 200, chunks = [8]}]\n').case("r")
    inp = build(case)
    bt, pool = inp.k_block_table, inp.kv_cache.shape[0]
    assert bt[0, :4].tolist() == [pool - 1, pool - 2, pool - 3, pool - 4]
    assert bt[1, :2].tolist() == [pool - 5, pool - 6]
    f = measure(case, "cpu").facts["paged_mxfp4_mqa_logits"]
    assert "descending" in f["pages"] and "repeated" not in f["pages"]
    assert max(f["page_bytes"]) == (pool - 1) * inp.kv_cache.shape[1]


def test_shared_pages_repeat_the_first_sequences_history_pages(tmp_path):
    cat = _cat(tmp_path, '[[case]]\nname = "s"\npage_order = "shared"\n'
                         'seqs = [{len = 300, chunks = [20]}, {len = 290, chunks = [12], decode = 1}, '
                         '{len = 200, chunks = [5]}]\n'
                         '[[case]]\nname = "none"\npage_order = "shared"\nseqs = [{len = 300, chunks = [20]}, 100]\n')
    c = cat.case("s")
    assert shared_pages(c, 4, 32) == [0, 2, 1]
    inp = build(c)
    bt = inp.k_block_table
    assert bt[1, :2].tolist() == bt[0, :2].tolist() and bt[2, 0] == bt[0, 0]
    assert bt[1, 2] not in bt[0, :3].tolist() and bt[2, 1] not in bt[0, :3].tolist()
    # the sharers' history writes nothing into the shared pages (read-only, written once) ...
    h = inp.history
    j = h.positions // 4
    sharer = torch.tensor([0, 2, 1])[h.req_index]
    assert bool((h.slot_mapping[_writers(h) & (j < sharer * 32)] == -1).all())
    assert int((h.slot_mapping >= 0).sum()) == 70 + (69 - 64) + (48 - 32)
    # ... nor does any step, and a step's block tables hold the repeated ids
    shared = set(bt[0, :2].tolist())
    for t in inp.steps:
        assert not ({int(s) // 32 for s in t.slot_mapping[t.slot_mapping >= 0]} & shared)
    assert inp.steps[0].block_table[1, 0] == inp.steps[0].block_table[0, 0]
    assert run_case(c, "reference")["outcome"] == "ok"
    with pytest.raises(CaseError, match="shares no page"):
        geometry(cat.case("none"))


def test_a_sequence_with_no_rows_stays_in_its_steps_batch(tmp_path):
    cat = _cat(tmp_path, '[[case]]\nname = "e"\n'
                         'seqs = [{len = 300, chunks = [0, 20]}, {len = 100, chunks = [12, 0]}, '
                         '{len = 3, chunks = [3]}, {len = 50, chunks = [0]}]\n')
    inp = build(cat.case("e"))
    s0, s1 = inp.steps
    assert s0.seqs == [0, 1, 2, 3] and s0.query_start_loc.tolist() == [0, 0, 12, 15, 15]
    assert s0.context_lens.tolist() == [70, 25, 0, 12]
    assert s0.row_ends[12:].tolist() == [0, 0, 0]                 # a context of no entries
    assert s1.seqs == [0, 1] and s1.query_start_loc.tolist() == [0, 20, 20]
    row = run_case(cat.case("e"), "reference")
    assert row["outcome"] == "ok", row["reason"]


def test_zero_chunks_are_steps_but_a_sequence_needs_a_step(tmp_path):
    (tmp_path / "s.toml").write_text('[[case]]\nname = "c"\nseqs = [{len = 4, chunks = [-1]}]\n')
    with pytest.raises(CaseError, match="chunks"):
        Catalog(tmp_path)


PLANTS = [
    ("k", '{tensor = "k", value = "-inf", row = true}',
     'ops = ["k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"]',
     "k_norm_rope_mxfp4_cache (step 0): k: 128 non-finite"),
    ("norm_weight", '{tensor = "norm_weight", value = "nan", count = 3}', "",
     "k_norm_rope_mxfp4_cache (step 0): norm_weight: 3 non-finite"),
    ("cos_sin_cache", '{tensor = "cos_sin_cache", value = "inf"}', 'ops = ["q_rope_mxfp4_quant"]',
     "q_rope_mxfp4_quant (step 0): cos_sin_cache (rows used)"),
    ("cos_sin_cache", '{tensor = "cos_sin_cache", value = "nan", row = true}', "",
     "k_norm_rope_mxfp4_cache (step 0): cos_sin_cache (rows used): 64 non-finite"),
    ("logits", '{tensor = "logits", value = "nan", row = true, count = 2}', 'ops = ["topk"]',
     "topk (step 0): logits: 40 non-finite"),
    ("logits", '{tensor = "logits", value = "-inf", count = 5}', 'ops = ["topk"]',
     "topk (step 0): logits: 5 non-finite"),
    ("kv_scale", '{tensor = "kv_scale", value = "nan", count = 2}', "",
     "paged_mxfp4_mqa_logits (step 0): kv_cache (scale bytes"),
    ("kv_scale", '{tensor = "kv_scale", value = "inf"}',
     'ops = ["compress_pool", "k_norm_rope_fp8_cache", "q_rope_fp8_quant", "paged_fp8_mqa_logits", "topk"]',
     "paged_fp8_mqa_logits (step 0): kv_cache (entries read, decoded)"),
    ("q", '{tensor = "q", value = "nan", row = true, count = 3}', "",
     "q_rope_mxfp4_quant (step 0): q: 1536 non-finite"),
    ("weights", '{tensor = "weights", value = "inf", row = true}', "",
     "q_rope_mxfp4_quant (step 0): weights: 4 non-finite"),
    ("state_score", '{tensor = "state_score", value = "nan", row = true, count = 2}', "",
     "compress_pool (step 0): state_cache (window rows)"),
]


@pytest.mark.parametrize("tensor, plant, ops, reason", PLANTS)
def test_every_plant_reaches_the_op_that_reads_it(tmp_path, tensor, plant, ops, reason):
    """Each plant lands where the first step reads it and the case is `nonfinite_input` at that
    op; the history (written before the step, through the same norm weight, RoPE table and
    pool) never sees it."""
    cat = _cat(tmp_path, f'[[case]]\nname = "p"\nseqs = [{{len = 100, chunks = [20]}}]\n{ops}\n'
                         f'plant = [{plant}]\nexpect_nonfinite = true\n')
    a, b = build(cat.case("p")), build(cat.case("p"))
    assert a.planted == b.planted and len(a.planted) == 1 and a.planted[0].startswith(f"{tensor}[")
    assert a.plant_facts[0]["tensor"] == tensor
    row = run_case(cat.case("p"), "reference")
    assert row["outcome"] == "nonfinite_input" and row["reason"].startswith(reason), row["reason"]


@pytest.mark.parametrize("plant, ops, needle", [
    ('{tensor = "k", value = "nan"}', "", "pooling is not run"),
    ('{tensor = "logits", value = "nan"}', "", "no scorer"),
    ('{tensor = "kv_scale", value = "nan"}', 'ops = ["q_rope_mxfp4_quant"]', "needs a scorer or topk"),
    ('{tensor = "kv_scale", value = "inf"}', "", "no infinity"),
    ('{tensor = "norm_weight", value = "nan", row = true, count = 2}', "", "one row"),
    ('{tensor = "q", value = "nan", row = 1}', "", "true or false"),
])
def test_a_plant_no_op_reads_is_a_case_error(tmp_path, plant, ops, needle):
    with pytest.raises(CaseError, match=needle):
        _cat(tmp_path, f'[[case]]\nname = "p"\nseqs = [{{len = 100, chunks = [20]}}]\n{ops}\nplant = [{plant}]\n')


@pytest.mark.parametrize("plant, needle", [
    ('{tensor = "kv_scale", value = "nan"}', "history entr"),            # no history: nothing to read
    ('{tensor = "logits", value = "nan", row = true, count = 30}', "row(s) with a valid column"),
    ('{tensor = "q", value = "nan", row = true, count = 30}', "token(s) in the first step"),
])
def test_a_plant_past_what_the_first_step_holds_is_a_case_error(tmp_path, plant, needle):
    cat = _cat(tmp_path, f'[[case]]\nname = "p"\nops = ["topk"]\nseqs = [{{len = 20, chunks = [20]}}]\n'
                         f'plant = [{plant}]\n')
    with pytest.raises(CaseError, match=re.escape(needle)):
        build(cat.case("p"))


def test_coverage_facts_name_what_the_selftest_cases_reach():
    cat = Catalog()
    sc = "paged_mxfp4_mqa_logits"
    facts = {n: measure(cat.case(n), "cpu") for n in ("shared-pages", "wide-table", "empty-seq-decode", "chain")}
    pages = {n: m.facts[sc]["pages"] for n, m in facts.items()}
    seqs = {n: m.facts[sc]["seqs"] for n, m in facts.items()}
    assert "repeated" in pages["shared-pages"] and "repeated" not in pages["chain"]
    assert "wide-table" in pages["wide-table"] and "wide-table" not in pages["chain"]
    assert {"empty", "no-context"} <= seqs["empty-seq-decode"]
    assert "empty" not in seqs["chain"]
    # the default suite's K writer and scorer both meet the pool's last page
    c = cat.case("pool-top-pages")
    inp, m = build(c), measure(c, "cpu")
    top = (inp.kv_cache.shape[0] - 1) * inp.kv_cache.shape[1]
    assert max(m.facts[sc]["page_bytes"]) == top == max(m.facts["k_norm_rope_mxfp4_cache"]["page_bytes"])


def test_a_plant_only_its_own_path_reads_keeps_the_case_on_that_path():
    """`--path cuda` turns the K writer into the fused pool+K op, which takes no K row: a case
    planting one stays on its path (a backend without that op skips it, saying so), while a
    plant both paths read moves with the case."""
    from harness.run.cases import on_path
    cat = Catalog()
    k_plant = cat.case("gen-nonfinite-k-nan")
    assert on_path(k_plant, "cuda") is k_plant
    moved = on_path(cat.case("gen-nonfinite-normweight-inf"), "cuda")
    assert moved.path == "cuda" and "compress_norm_rope_mxfp4_cache" in moved.ops


def test_downstream_of_a_refused_stage_only_the_invariants_judge():
    """A planted NaN in q: the Q quant's reference refuses it, so the scorer and top-k after it
    run on the backend's outputs and are judged by the invariants alone. A scorer whose finite
    logits differ from the reference's is then no failure, but one whose top-k breaks an
    invariant is."""
    import reference
    from optimized import Backend, register

    def quant(**kw):                # a kernel that reads NaN as 0 (the reference would refuse it)
        return reference.q_rope_mxfp4_quant(**{**kw, "q": torch.nan_to_num(kw["q"], nan=0.0)})

    def make(scorer=None, topk=None):
        ops = dict(reference.FUNCTIONS, q_rope_mxfp4_quant=quant)
        if scorer:
            ops["paged_mxfp4_mqa_logits"] = scorer
        if topk:
            ops["topk"] = topk
        return Backend("t-downstream", "test", ops)

    def shifted(**kw):
        out = reference.paged_mxfp4_mqa_logits(**{**kw, "weights": torch.nan_to_num(kw["weights"])})
        return {"logits": out["logits"] + 1.0}

    def past_end(**kw):
        idx = reference.topk(logits=torch.nan_to_num(kw["logits"]), lengths=kw["lengths"], k=kw["k"])["indices"]
        return {"indices": torch.where(idx >= 0, idx, kw["lengths"][:, None].to(idx.dtype))}

    case = Catalog().case("gen-nonfinite-q-nan")
    register("t-downstream", lambda: make(scorer=shifted))
    assert run_case(case, "t-downstream")["outcome"] == "nonfinite_input"
    register("t-downstream", lambda: make(scorer=shifted, topk=past_end))
    row = run_case(case, "t-downstream")
    assert row["metrics"]["topk.invariant_violations"] > 0
