"""The coverage model (reference/coverage.py), its measurement (harness/run/coverage.py), the
case generator (harness/run/generate.py) and `mxval coverage`.

Each fact is checked on a case or tensors whose answer is known from their construction (not
from the engine), and each boundary class on both sides: a case that reaches it and one that
does not."""
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import mxval, needs_gpu, one_line_error

from harness.run import coverage as cov
from harness.run import generate
from harness.run.cases import Case, Catalog, SeqSpec
from reference import layout
from reference.coverage import BOUNDARIES, BY_NAME, FACTS, Boundary
from reference.formats import E8M0_BIAS

ROOT = Path(__file__).resolve().parent.parent


def _case(**kw) -> Case:
    base = dict(name="t", suite="t", file="t.toml", heads=4, topk=8, state_block=16, seed=3)
    base.update(kw)
    return Case(**base)


# --- the table ------------------------------------------------------------------------------------

def test_every_fact_is_measured_and_every_boundary_names_one():
    src = (ROOT / "harness/run/coverage.py").read_text()
    measured = set(re.findall(r'(?<![.\w])add\("(\w+)"', src)) | set(re.findall(r'm\.add\(op, "(\w+)"', src))
    assert set(FACTS) == measured, (set(FACTS) ^ measured)
    assert {b.fact for b in BOUNDARIES} <= set(FACTS)
    assert len(BY_NAME) == len(BOUNDARIES)
    for b in BOUNDARIES:
        assert b.source and b.dim and b.ops, b.name


def test_match_rules():
    has = Boundary("x", ("topk",), "i", "d", "k", ("has", 8), "s")
    ge = Boundary("y", ("topk",), "i", "d", "crowd", ("ge", 2048), "s")
    every = Boundary("z", ("topk",), "i", "d", "codes", ("every", 1, 4), "s")
    assert has.reached_by({8, 9}) and not has.reached_by({7})
    assert ge.reached_by({2048}) and not ge.reached_by({2047, "tag"})
    assert every.reached_by({1, 2, 3}) and not every.reached_by({1, 3})


# --- facts, known from construction ---------------------------------------------------------------

@pytest.fixture(scope="module")
def chain():
    """A chain with rows of 0, k-1, k, k+1 and more entries (decode rows at p = e*r - 1),
    a 9-token chunk and an all-positive history."""
    c = _case(seqs=(SeqSpec(1, (1,), 0), SeqSpec(28, (), 1), SeqSpec(32, (), 1), SeqSpec(36, (), 1), SeqSpec(80, (), 1),
                    SeqSpec(140, (9,), 0)), page_size=32, layout="natural", page_stride_pad=13)
    return c, cov.measure(c, "cpu")


def test_structure_facts_of_a_chain(chain):
    c, m = chain
    sc = m.facts["paged_mxfp4_mqa_logits"]
    tk = m.facts["topk"]
    # one step: a token at position 0, four decode rows and a 9-token chunk
    assert sc["rows"] == tk["rows"] == {14}
    assert {0, 7, 8, 9, 20} <= tk["row_len"]
    assert tk["len_vs_k"] == {"0", "<k", "=k", "=k+1", ">k", ">>k"}
    assert sc["layout"] == {"natural/32"} and sc["stride"] == {"pad-odd"}
    assert "no-context" in sc["seqs"] and "empty" not in sc["seqs"]
    assert sc["seq_rows"] == {1, 9}
    assert 0 in m.facts["compress_pool"]["positions"]
    assert "q.heads.64" not in m.reached()


def test_codes_and_visibility_of_a_chain(chain):
    _, m = chain
    k = m.facts["k_norm_rope_mxfp4_cache"]["codes"]
    assert k and all(100 < c < 140 for c in k)          # RMS-normed rows: about 2^0
    read = m.facts["paged_mxfp4_mqa_logits"]["codes_read"]
    assert read and all(100 < c < 140 for c in read)    # history entries too: normed the same way


def test_boundaries_count_only_for_ops_under_test():
    c = _case(seqs=(SeqSpec(40, (8,), 0),), ops=("topk",), page_size=32)
    m = cov.measure(c, "cpu")
    assert "paged_mxfp4_mqa_logits" not in m.facts        # the scorer ran in the reference only
    assert "topk.k.small" in m.reached() and "scorer.len.=k" not in m.reached()


def _topk_facts(logits, lengths, k):
    m = cov.Measured(_case(ops=("topk",)))
    cov._Facts(m, None)._topk(lambda f, v: m.add("topk", f, v), {"logits": logits, "lengths": lengths},
                              {"k": k})
    return m.facts["topk"]


def test_ties_by_size_class():
    k = 8
    rows = [
        torch.tensor([9., 8, 7, 6, 5, 4, 3, 1, 1, 0]),           # ties at 1 cut by k: tie-2
        torch.tensor([9., 8, 7] + [0.0] * 30),                    # 30 zeros, 5 taken: tie-k and tie-zero
        torch.tensor([2.0] * 20),                                 # the whole row
        torch.tensor([9., 8, 7, 6, 5, 4, 3, 2, 1, 1]),            # the tie is past k: not cut
    ]
    width = max(len(r) for r in rows)
    logits = torch.full((len(rows), width), -1e30)
    for i, r in enumerate(rows):
        logits[i, :len(r)] = r
    lengths = torch.tensor([len(r) for r in rows])
    assert _topk_facts(logits, lengths, k)["ties"] == {"tie-2", "tie-k", "tie-zero", "tie-row"}
    assert _topk_facts(logits[3:], lengths[3:], k)["ties"] == set()
    big = torch.zeros(1, 1100)
    big[0, :10] = 1.0
    assert "tie-1024" in _topk_facts(big, torch.tensor([1100]), 1024)["ties"]
    mid = torch.cat([torch.full((40,), 5.0), torch.zeros(30), torch.full((10,), -1.0)])[None]
    assert _topk_facts(mid, torch.tensor([80]), 64)["ties"] == {"tie-16", "tie-zero"}


def test_crowded_bins():
    g = torch.Generator().manual_seed(0)
    band = 1.0 + torch.rand(300, 4096, generator=g) * 0.01            # one first-pass bin
    spread = torch.randn(300, 4096, generator=g).exp()
    f = _topk_facts(band, torch.full((300,), 4096), 8)
    assert max(f["crowd"]) >= 4096 and max(f["crowd_rows"]) >= 257
    f = _topk_facts(spread, torch.full((300,), 4096), 8)
    assert max(f["crowd"]) < 2048 and max(f["crowd_rows"]) == 0


def _entries(codes_k: list[list[int]], codes_q: list[int], value: int = 0x22):
    """A one-sequence scorer call: key j's 4 blocks carry the codes `codes_k[j]`, one query
    whose blocks carry `codes_q`; every element 1.0 (nibble 2)."""
    n, d, ps = len(codes_k), 128, 32
    pool = torch.zeros(2, layout.page_bytes(ps, d), dtype=torch.uint8)
    packed = torch.full((n, d // 2), value, dtype=torch.uint8)
    scales = torch.tensor(codes_k, dtype=torch.uint8)
    pool = layout.write_entries(pool, torch.arange(n), packed, scales, page_size=ps, shuffle=None)
    ins = dict(q_fp4=torch.full((1, 1, d // 2), value, dtype=torch.uint8),
               q_scale=torch.tensor(codes_q, dtype=torch.uint8).view(1, 1, -1), weights=torch.ones(1, 1),
               kv_cache=pool, query_start_loc=torch.tensor([0, 1]), context_lens=torch.tensor([n]),
               block_table=torch.tensor([[0, 1]]), row_ends=torch.tensor([n]))
    return ins


class _Geo:
    page_size, head_dim, topk = 32, 128, 8


def _bare_facts(stage: str):
    """(the facts' measurer without a case walk, what it measured, its `add` for `stage`)."""
    m = cov.Measured(_case())
    f = cov._Facts.__new__(cov._Facts)
    f.m, f.geo = m, _Geo()
    return f, m, lambda fact, v: m.add(stage, fact, v)


def _visible(ins):
    import reference
    f, m, _ = _bare_facts("s")
    logits = reference.paged_mxfp4_mqa_logits(**ins, page_size=32, shuffle=None)["logits"]
    f._visible(lambda fact, v: m.add("s", fact, v), ins, {"shuffle": None}, cov._valid_norm(logits, ins["row_ends"]))
    return m.facts["s"]


def test_visibility_of_scale_codes():
    n = E8M0_BIAS
    # a tiny block beside normal ones of its key, under a normal query: below the logit's ulp
    f = _visible(_entries([[n, n, n, 20]], [n] * 4))
    assert f["codes_read"] == {n} and f["q_codes_read"] == {n}
    # a whole key that small is its own logit; a huge query block lifts the tiny one
    assert _visible(_entries([[20] * 4], [n] * 4))["codes_read"] == {20}
    f = _visible(_entries([[n, n, n, 20]], [n, n, n, 234]))
    assert f["codes_read"] == {n, 20} and f["q_codes_read"] == {n, 234}
    f = _visible(_entries([[254, 0, 0, 0]], [n - 100] * 4))
    assert f["codes_read"] == {254} and f["dots"] == set()     # 2^-127 is lost beside 2^127
    f = _visible(_entries([[254] * 4], [254] * 4))
    assert f["dots"] == {"overflow-any"}                        # 128 * 2^254 is past fp32's range


def test_codes_judged_by_the_calls_logits_diff():
    n = E8M0_BIAS
    # a key of code 20 alone: its logit is the call's, a wrong decode of 20 moves logits_diff
    assert _visible(_entries([[20] * 4], [n] * 4))["codes_judged"] == {20}
    # beside a key of code n in the same call: 20 changes its own logit, not the call's diff
    f = _visible(_entries([[20] * 4, [n] * 4], [n] * 4))
    assert f["codes_read"] == {20, n} and f["codes_judged"] == {n}
    # the extremes: code 0 judged alone, not beside code 254
    assert _visible(_entries([[0] * 4], [n + 100] * 4))["codes_judged"] == {0}
    assert _visible(_entries([[0] * 4, [254] * 4], [n - 100] * 4))["codes_judged"] == {254}


def test_elements_and_codes_of_a_quantized_block():
    f, m, add = _bare_facts("q")
    from reference import mxfp4
    x = torch.zeros(3, 64)
    x[0, :32] = torch.tensor([6.0, -0.1] + [1.0] * 30)        # saturated, a negative that rounds to -0
    x[1, 32:] = 2.0 ** -127                                    # a bf16 subnormal block (y = 0.5)
    packed, scales = mxfp4.quantize_mxfp4(x)
    f._codes(add, packed, scales)
    f._subnormal(add, x.bfloat16().float(), packed)
    assert m.facts["q"]["elements"] == {"zero-block", "neg-zero", "saturated", "subnormal"}
    # amax 6 stores 2^0 (127); the subnormal block's amax is under 6 * 2^-126, so it stores 1;
    # the all-zero blocks also store 1 but are not counted (a code only counts in a live block)
    assert m.facts["q"]["codes"] == {E8M0_BIAS, 1}
    assert scales[2].tolist() == [1, 1]


def test_norm_rows_against_eps():
    f, m, add = _bare_facts("k")
    rows = torch.randn(4, 128)
    f._norm(add, rows, 1e-6)
    assert "norm" not in m.facts.get("k", {})                # unit rows: eps is far below their mean square
    f._norm(add, torch.cat((rows[:1] * 2.0 ** -12, torch.zeros(1, 128))), 1e-6)
    assert m.facts["k"]["norm"] == {"eps-dominant"}          # mean 2^-24 < eps; an all-zero row counts for neither
    f._norm(add, rows[:1] * 2.0 ** -120, 1e-6)               # squares 2^-240: fp32's sum is 0
    assert m.facts["k"]["norm"] == {"eps-dominant", "sum-underflow"}
    m2 = cov.Measured(_case())
    f.m = m2
    f._norm(lambda fact, v: m2.add("k", fact, v), rows * 2.0 ** -12, 1e-30)   # a smaller eps: a normal scale
    assert "norm" not in m2.facts.get("k", {})


def test_pooling_scores_past_exp_range_and_the_pool_end():
    seqs = (SeqSpec(40, (40,), 0), SeqSpec(90, (), 2))
    plain = cov.measure(_case(seqs=seqs, page_size=16, layout="natural"), "cpu").reached()
    extreme = cov.measure(_case(seqs=seqs, page_size=16, layout="natural", dist=("normal", "score_extremes")),
                          "cpu").reached()
    for tag in ("exp-overflow", "exp-underflow"):
        assert f"pool.scores.{tag}" in extreme and f"pool.scores.{tag}" not in plain
    # two pages, both written to their end, and no spare page: the chunk writes the pool's last slot
    one = (SeqSpec(128, (64,), 0),)
    end = cov.measure(_case(seqs=one, page_size=16, layout="natural", page_order="sequential", spare_pages=0), "cpu")
    spare = cov.measure(_case(seqs=one, page_size=16, layout="natural", page_order="sequential", spare_pages=1), "cpu")
    assert "k.entries.pool-end" in end.reached() and "k.entries.pool-end" not in spare.reached()
    # page ids across 2^16: the decode entry's page is 65536 + 3, the chunk's pages below 2^16
    two = (SeqSpec(120, (24,), 0), SeqSpec(60, (), 1))

    def top_of(pages):                       # the pool's last pages, 4-entry pages
        return cov.measure(_case(seqs=two, page_size=4, layout="natural", pool_pages=pages, page_order="top"),
                           "cpu").reached()
    # ids 32764 .. 32771 straddle int16's sign bit; 32767 pages stop under it
    for bits in (16, 15):
        above, below = top_of((1 << bits) + 4), top_of((1 << bits) - 1)
        for name in (f"k.entries.high-2^{bits}", f"scorer.pages.high-2^{bits}"):
            assert name in above and name not in below
    assert "k.entries.high-2^15" in top_of((1 << 16) - 1)      # ids 65523 .. 65534


def test_heads_width_and_fp8_rows():
    def reached(**kw):
        return cov.measure(_case(**kw), "cpu").reached()
    q_ops = ("q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk")
    seqs = (SeqSpec(40, (5,), 0),)
    assert "q.heads.non-pow2" in reached(heads=6, ops=q_ops, seqs=seqs, history="direct")
    assert "q.heads.non-pow2" not in reached(heads=8, ops=q_ops, seqs=seqs, history="direct")
    # rows of 32 entries in a table of two 16-entry pages fill the logits width; rows of 31 do not
    dec = lambda ends: tuple(SeqSpec(e * 4 if e else 2, (), 1) for e in ends)   # noqa: E731
    full = dict(ops=("topk",), history="direct", page_size=16, layout="natural")
    assert "topk.width.fills-width" in reached(seqs=dec([32, 0, 5]), **full)
    assert "topk.width.fills-width" not in reached(seqs=dec([31, 0, 5]), **full)
    assert "topk.width.fills-width" not in reached(seqs=dec([32, 0, 5]), topk=32, **full)   # not longer than k
    # the FP8 writer's norm and both FP8 scales' floor: rows 2^-12 small (mean square under eps) and
    # tiny ones (a sum of squares that underflows, amax under 1e-4)
    fp8 = dict(ops=("k_norm_rope_fp8_cache", "q_rope_fp8_quant", "paged_fp8_mqa_logits", "topk"),
               history="direct", seqs=(SeqSpec(60, (12,), 0),))
    names = ("fp8_k.norm.eps-dominant", "fp8_k.norm.sum-underflow", "fp8_k.amax.under-floor",
             "fp8_q.amax.under-floor")
    small = reached(scale=2.0 ** -12, dist=("normal", "tiny"), **fp8)
    plain = reached(**fp8)
    for name in names:
        assert name in small and name not in plain


def test_planted_inputs_count_for_the_ops_that_take_them():
    from harness.run.cases import Plant
    c = _case(ops=("q_rope_mxfp4_quant",), plant=(Plant("q", "inf", 2),), expect_nonfinite=True,
              seqs=(SeqSpec(8, (8,), 0),))
    m = cov.measure(c, "cpu")
    assert "nonfinite.q.inf" in m.reached() and "nonfinite.q.nan" not in m.reached()
    c2 = _case(ops=("topk",), plant=(Plant("q", "inf", 2),), expect_nonfinite=True, seqs=(SeqSpec(8, (8,), 0),))
    assert "nonfinite.q.inf" not in cov.measure(c2, "cpu").reached()     # the q quant is not under test


# --- the generator ------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", generate.TIERS)
def test_generated_cases_are_reproducible_and_named_uniquely(tier):
    a, b = generate.generate(29, tier), generate.generate(29, tier)
    assert a == b
    names = [c["name"] for c in a]
    assert len(names) == len(set(names)) and all(n.startswith("gen-") for n in names)
    other = generate.generate(30, tier)
    assert [c["name"] for c in other] != names or [c["seed"] for c in other] != [c["seed"] for c in a]


def test_layout_family_pairs_every_layout_with_a_writer_and_a_reader():
    for tier in generate.TIERS:
        cases = [c for c in generate.generate(29, tier) if c["name"].startswith(("gen-layout", "gen-gpu-layout"))]
        seen = {(tuple(c["layout"]) if isinstance(c["layout"], list) else c["layout"], c["page_size"]) for c in cases}
        assert seen == {(lay, ps) for lay, ps in generate.LAYOUTS}
        for dim, values in (("page_order", generate.PAGE_ORDERS), ("history", generate.HISTORIES),
                            ("page_stride_pad", generate.PADS)):
            assert {c[dim] for c in cases} == set(values), dim


def test_generated_cases_load_through_the_schema():
    from harness.run.geometry import geometry
    cat = Catalog()
    gen = [c for c in cat.suite_cases("full") if c.name.startswith("gen-")]
    assert any(c.requires == "gpu" for c in gen) and any(c.requires is None for c in gen)
    for c in gen:
        geometry(c)
    cpu = [c for c in cat.suite_cases("default") if c.name.startswith("gen-")]
    assert cpu and all(c.requires is None for c in cpu)


def test_bad_generate_table(tmp_path, capsys):
    (tmp_path / "x.toml").write_text('[suite]\nname = "x"\n[generate]\nseed = 1\ntier = "tpu"\n')
    rc, _, err = mxval(capsys, "cases", "--cases-dir", tmp_path)
    assert rc == 2
    one_line_error(err, "x.toml", "[generate]", "tier")


# --- the command ------------------------------------------------------------------------------------

def test_coverage_command_json_and_check(tmp_path, capsys):
    out = tmp_path / "c.json"
    rc, stdout, _ = mxval(capsys, "coverage", "--case", "smoke-rowend-k", "--case", "smoke-inf-q", "-q",
                          "--json", out, "--markdown", tmp_path / "c.md", "--check")
    assert rc == 1                                          # two cases reach few boundaries
    doc = json.loads(out.read_text())
    assert doc["schema"] == "mxval-coverage" and set(doc["cases"]) == {"smoke-rowend-k", "smoke-inf-q"}
    assert doc["cases"]["smoke-inf-q"] == ["nonfinite.q.inf"]
    b = {x["name"]: x for x in doc["boundaries"]}
    assert b["nonfinite.q.inf"]["reached_by"] == ["smoke-inf-q"]
    assert "topk.len.=k" in doc["cases"]["smoke-rowend-k"]
    assert "cpu boundaries:" in stdout and "| topk |" in (tmp_path / "c.md").read_text()


def test_coverage_command_bad_input(capsys):
    rc, _, err = mxval(capsys, "coverage", "--suite", "nope")
    assert rc == 2
    one_line_error(err, "nope")


# --- the suites against the model -------------------------------------------------------------------

def _unreached(c: cov.Coverage, needs) -> list[str]:
    return [b.name for b in c.unreached(needs)]


def test_default_suite_reaches_every_cpu_boundary():
    c = cov.suite_coverage(Catalog().suite_cases("default"), "cpu")
    assert not c.unmeasured() and _unreached(c, ("cpu",)) == []


def test_a_case_past_the_cpu_footprint_is_measured_for_its_structure(monkeypatch):
    c = Catalog().case("pool-top-pages")
    full = cov.measure(c, "cpu")
    monkeypatch.setattr(cov, "CPU_FOOTPRINT", 1 << 20)          # as if the case needed a GPU
    m = cov.measure(c, "cpu")
    assert full.values and not m.values and "structure only" in m.note
    sc, kw = "paged_mxfp4_mqa_logits", "k_norm_rope_mxfp4_cache"
    assert m.facts[sc]["pages"] == full.facts[sc]["pages"] and m.facts[sc]["row_len"] == full.facts[sc]["row_len"]
    assert "codes" in full.facts[kw] and "codes" not in m.facts[kw] and "ties" not in m.facts["topk"]
    assert set(m.reached()) < set(full.reached())


@pytest.mark.gpu
@needs_gpu
def test_full_suite_reaches_every_boundary():
    c = cov.suite_coverage(Catalog().suite_cases("full"), "cuda")
    assert not c.unmeasured() and _unreached(c, ("cpu", "gpu")) == []
