"""Case files and generated inputs: strict parsing, the spec's edge cases present in the
suites, and inputs that exercise what they claim to."""
import pytest
import torch

import reference
from harness.run.cases import CaseError, Catalog, SeqSpec
from harness.run.geometry import geometry
from harness.run.inputs import build
from reference import layout
from reference.checks import NonFiniteInput


@pytest.fixture(scope="module")
def catalog():
    return Catalog()


def test_repo_suites_load_and_every_case_has_a_valid_geometry(catalog):
    assert {"smoke", "default", "full"} <= set(catalog.suites)
    default = {c.name for c in catalog.suite_cases("default")}
    assert {c.name for c in catalog.suite_cases("smoke")} <= default
    assert default <= {c.name for c in catalog.suite_cases("full")}
    for c in catalog.by_name.values():
        geometry(c)
    assert all(c.requires == "gpu" for c in catalog.suites["full"].cases)


def test_seq_steps_and_history():
    s = SeqSpec(40, (8, 12), 3)
    assert s.history == 17
    assert s.steps() == [(17, 25), (25, 37), (37, 38), (38, 39), (39, 40)]


@pytest.mark.parametrize("body, needle", [
    ('name = "c"\nheds = 4', "heds"),
    ('name = "c"\nseqs = [{len = 4, chunks = [5]}]', "exceed len"),
    ('name = "c"\ndist = ["gaussian"]', "gaussian"),
    ('name = "c"\nops = ["k_norm_rope_mxfp4_cache", "q_rope_fp8_quant"]', "mix"),
    ('name = "c"\nplant = [{tensor = "q", value = "nan"}]\nexpect_nonfinite = "yes"', "expect_nonfinite"),
    ('name = "c"\nexpect_nonfinite = true', "plant"),
    ('name = "c"\nlayout = "zigzag"', "layout"),
])
def test_bad_case_is_one_error_naming_file_and_case(tmp_path, body, needle):
    (tmp_path / "s.toml").write_text(f'[suite]\nname = "s"\n[[case]]\n{body}\n')
    with pytest.raises(CaseError) as e:
        Catalog(tmp_path)
    assert "s.toml" in str(e.value) and needle in str(e.value)


def test_layout_must_fit_page_size(tmp_path):
    (tmp_path / "s.toml").write_text('[[case]]\nname = "c"\npage_size = 40\nlayout = [32, 16, 2]\n')
    with pytest.raises(CaseError, match="multiple of the shuffle group"):
        geometry(Catalog(tmp_path).case("c"))


def _writers(t, r):
    return t.slot_mapping[((t.positions + 1) % r == 0) & (t.slot_mapping >= 0)]


def test_inputs_are_deterministic_and_consistent(catalog):
    c = catalog.case("smoke-chunks-shuffled")
    a, b = build(c), build(c)
    assert torch.equal(a.state_cache, b.state_cache) and torch.equal(a.kv_cache, b.kv_cache)
    assert torch.equal(a.steps[0].q.view(torch.int16), b.steps[0].q.view(torch.int16))
    g = a.geo
    for t in [a.history, *a.steps]:
        boundary = (t.positions + 1) % g.ratio == 0
        assert bool((t.slot_mapping[~boundary] == -1).all())
        assert bool((t.slot_mapping[boundary] >= 0).all())
        assert torch.equal(t.row_ends.long(), (t.positions + 1) // g.ratio)
        # slots follow the block table: entry j of sequence b lives in table[b, j // ps]
        j = t.positions[boundary] // g.ratio
        pages = a.k_block_table[t.req_index[boundary], j // g.page_size]
        assert torch.equal(t.slot_mapping[boundary], pages.long() * g.page_size + j % g.page_size)
    # the block table is permuted, pool bytes are random (so untouched-byte checks bite)
    perm = build(catalog.case("batch-mixed")).k_block_table
    used = torch.cat([perm[0, :2], perm[1:, 0]])
    assert not torch.equal(used.sort().values, used)
    assert a.kv_cache.float().std() > 50
    assert a.kv_cache.shape[1] == layout.page_bytes(g.page_size, 128) + 64


def test_the_suites_hold_the_spec_edge_cases(catalog):
    """Boundary tokens at chunk edges, j = 0, row ends of exactly k and k+1, entries
    straddling a 32-entry shuffle group, padded strides: each in some smoke case."""
    seen = set()
    for c in catalog.suite_cases("smoke"):
        inp = build(c)
        g = inp.geo
        if c.page_stride_pad:
            seen.add("padded stride")
        for t in inp.steps:
            ends = t.row_ends.long()
            if bool((ends == g.topk).any()) and bool((ends == g.topk + 1).any()):
                seen.add("row ends k and k+1")
            if bool((t.positions[_writers_mask(t, g)] == g.ratio - 1).any()):
                seen.add("j = 0")
            qsl = t.query_start_loc.long()
            for b in range(len(t.seqs)):
                first, last = t.positions[qsl[b]], t.positions[qsl[b + 1] - 1]
                if (last + 1) % g.ratio == 0 and first > 0 and first % g.ratio == 0:
                    seen.add("boundary tokens at chunk edges")
            if g.shuffle and g.shuffle[0] == 32:
                e = _writers(t, g.ratio) % g.page_size
                if bool((e == 31).any()) and bool((e == 32).any()):
                    seen.add("straddles a 32-entry group")
    assert seen == {"padded stride", "row ends k and k+1", "j = 0", "boundary tokens at chunk edges",
                    "straddles a 32-entry group"}


def _writers_mask(t, g):
    return ((t.positions + 1) % g.ratio == 0) & (t.slot_mapping >= 0)


def test_edge_value_distribution_reaches_the_quantizer(catalog):
    inp = build(catalog.case("smoke-edge-values"))
    q = inp.steps[0].q.float()
    assert bool((torch.signbit(q) & (q == 0)).any()), "-0.0 planted"
    assert bool(((q.abs() > 0) & (q.abs() < 2.0 ** -126)).any()), "subnormals planted"
    blocks = q[..., :32].reshape(-1, 32)
    amax = blocks.abs().amax(-1)
    mant = amax / torch.exp2(torch.floor(torch.log2(amax.clamp_min(1e-30))) - 2)
    assert bool((mant == 6.0).any()), "block amax at 6 * 2**k"
    y = blocks / (amax / 6.0)[:, None]
    assert bool(((y.abs() == 2.5) | (y.abs() == 0.25)).any()), "e2m1 midpoints"


def test_planted_nonfinite_lands_where_the_first_step_reads(catalog):
    for name, op in (("smoke-nan-state", "compress_pool"), ("smoke-inf-q", "q_rope_mxfp4_quant")):
        inp = build(catalog.case(name))
        assert inp.planted
        t = inp.steps[0]
        args = (dict(state_cache=inp.state_cache, block_table=inp.state_block_table, positions=t.positions,
                     req_index=t.req_index, kv_slot_mapping=t.slot_mapping)
                if op == "compress_pool" else
                dict(q=t.q, positions=t.positions, cos_sin_cache=inp.cos_sin_cache, weights=t.weights))
        with pytest.raises(NonFiniteInput):
            reference.OPS[op].fn(**args, **inp.scalars(op))


# --- scale edges ---------------------------------------------------------------------------

def _scale_facts(case):
    """(positions, row ends, rows per step, logits bytes per step) of a case from its
    sequences alone (nothing is built)."""
    r = 4
    pos, ends, rows, nbytes = set(), set(), [], []
    steps = max(len(s.steps()) for s in case.seqs)
    width = max(max(s.len for s in case.seqs) // r + 1, (case.table_pages or 0) * 64)
    for i in range(steps):
        n = 0
        for s in case.seqs:
            for b, e in s.steps()[i:i + 1]:
                pos.update((b, e - 1))
                ends.update(((b + 1) // r, e // r))
                n += e - b
        rows.append(n)
        nbytes.append(n * width * 4)
    return pos, ends, rows, nbytes


def _straddles(values, edge):
    return any(v < edge for v in values) and any(v >= edge for v in values)


def _edges(cases):
    pos, ends, rows, nbytes, narrow, deep = set(), set(), set(), set(), False, False
    for c in cases:
        p, e, r, b = _scale_facts(c)
        pos |= p
        ends |= e
        rows |= set(r)
        nbytes |= set(b)
        narrow |= "narrow_band" in c.dist and "topk" in c.ops
        deep |= len({s.steps()[0][0] > 0 for s in c.seqs}) == 2 and max(r) > 4096
    out = {f"positions {x}" for x in (2 ** 15, 2 ** 16, 2 ** 17) if _straddles(pos, x)}
    out |= {f"entries {x}" for x in (2048, 4096, 16384, 32768) if x in ends and x + 1 in ends}
    out |= {f"rows {x}" for x in (256, 512, 1024, 4096, 65536) if x in rows and x + 1 in rows}
    out |= {"logits 2^31 bytes"} if _straddles(nbytes, 2 ** 31) else set()
    out |= {"narrow band"} if narrow else set()
    out |= {"packed row start past 4096 rows"} if deep else set()
    return out


CPU_EDGES = {"positions 32768", "positions 65536", "positions 131072", "entries 2048", "entries 4096",
             "entries 16384", "entries 32768", "rows 256", "rows 512", "rows 1024", "rows 4096",
             "narrow band", "packed row start past 4096 rows"}


def test_the_default_suite_reaches_every_scale_edge_a_cpu_affords(catalog):
    cpu = [c for c in catalog.suite_cases("default") if c.requires != "gpu"]
    assert _edges(cpu) >= CPU_EDGES, CPU_EDGES - _edges(cpu)


def test_the_full_suite_reaches_every_scale_edge(catalog):
    assert _edges(catalog.suite_cases("full")) >= CPU_EDGES | {"rows 65536", "logits 2^31 bytes"}
    wide = [c for c in catalog.suite_cases("full") if c.table_pages and c.table_pages * 64 >= 2 ** 20]
    assert wide and all(c.requires == "gpu" for c in wide)


def test_direct_history_materializes_only_what_the_steps_read(tmp_path):
    (tmp_path / "s.toml").write_text(
        '[[case]]\nname = "d"\nheads = 4\ntopk = 8\nhistory = "direct"\nstate_block = 16\n'
        'seqs = [{len = 4100, decode = 2}, {len = 300, chunks = [40]}]\n'
        '[[case]]\nname = "p"\nheads = 4\ntopk = 8\nstate_block = 16\n'
        'seqs = [{len = 4100, decode = 2}, {len = 300, chunks = [40]}]\n')
    cat = Catalog(tmp_path)
    d, p = build(cat.case("d")), build(cat.case("p"))
    assert d.state_cache.shape[0] < p.state_cache.shape[0] // 10
    assert d.history.k is not None and d.history.k.shape == (d.history.n, 128) and p.history.k is None
    from harness.run.runner import run_case
    row = run_case(cat.case("d"), "reference")
    assert row["outcome"] == "ok" and row["metrics"]["topk.topk_below_threshold"] == 0


def test_narrow_band_rows_sit_in_one_radix_bin(tmp_path):
    (tmp_path / "s.toml").write_text('[[case]]\nname = "n"\nheads = 4\ntopk = 8\nhistory = "direct"\n'
                                     'dist = ["narrow_band"]\nseqs = [{len = 4000, decode = 1}]\n')
    inp = build(Catalog(tmp_path).case("n"))
    assert bool((inp.steps[0].weights.float() > 0).all())
    from optimized.faults import _fp16_radix_key
    row = _row_logits(inp)        # a band of about 1 %, away from 0, distinct beyond the tolerance
    lo, hi = float(row.min()), float(row.max())
    assert lo > 0 and 1e-3 < (hi - lo) / hi < 0.02
    assert _fp16_radix_key(row.float(), 8).unique().numel() == 1


def _row_logits(inp):
    from harness.run.runner import ChainRun
    seen = {}

    def rec(step, op, ins, scalars, out):
        if op == "paged_mxfp4_mqa_logits":
            seen["l"] = out["logits"][0, :int(ins["row_ends"][0])]
    case = inp.case.__class__(**{**inp.case.__dict__, "ops": ("paged_mxfp4_mqa_logits", "topk")})
    ChainRun(case, __import__("optimized").get_backend("reference"), inp, rec).run()
    return seen["l"]


def test_table_pages_widen_the_logits_without_pages(tmp_path):
    (tmp_path / "s.toml").write_text('[[case]]\nname = "w"\nheads = 4\ntopk = 8\ntable_pages = 40\n'
                                     'seqs = [{len = 300, chunks = [20]}]\n'
                                     '[[case]]\nname = "bad"\nheads = 4\ntable_pages = 1\n'
                                     'seqs = [{len = 300, chunks = [20]}]\n')
    cat = Catalog(tmp_path)
    inp = build(cat.case("w"))
    assert inp.steps[0].block_table.shape[1] == 40 and inp.kv_cache.shape[0] < 10
    with pytest.raises(CaseError, match="table_pages"):
        geometry(cat.case("bad"))
