"""Graph mode on the CPU (harness/run/graph.py): vLLM's capture sizes and padding, the capture
and replay machinery under the CPU's stand-in graph (HostGraph: the backends' host reads
answered from the capture's record), the graph ≠ eager comparison, the graph-only faults
(caught when replayed, passing eagerly), and `--graph` refusing the CPU in one line. The real
torch.cuda.CUDAGraph path is tests/test_graph_gpu.py (`-m gpu`)."""
import dataclasses

import pytest
import torch
from helpers import mxval, one_line_error

import reference
from harness.run import budgets
from harness.run import graph as G
from harness.run.cases import MAX_GRAPH_BATCH, CaseError, Catalog, load_suite_file
from harness.run.runner import run_case
from optimized import Backend, register
from optimized.faults import FAULTS

GRAPH_FAULTS = [f.name for f in FAULTS.values() if f.graph]
# the ops each graph-only fault is seen through, cut to what it breaks (fast on the CPU)
FAULT_OPS = {"graph-fits-k-shortcut": ("topk",),
             "graph-split-count": ("paged_mxfp4_mqa_logits",),
             "graph-stale-workspace": ("paged_mxfp4_mqa_logits",),
             "graph-count-item": ("compress_pool", "k_norm_rope_mxfp4_cache")}
register("reference-graphable", lambda: Backend("reference-graphable", "the reference, replayed by HostGraph",
                                                dict(reference.FUNCTIONS)))


@pytest.fixture
def host_graph(monkeypatch):
    monkeypatch.setattr(G, "FACTORY", G.HostGraph)


def _case(**kw):
    c = Catalog().case("graph-decode")
    return dataclasses.replace(c, requires=None, **kw)


def _judged(case, backend):
    return budgets.verdict(run_case(case, backend), budgets.load(None), "selftest")


def _metric(row, name):
    return {k.split(".")[0]: v for k, v in row["metrics"].items() if k.endswith("." + name)}


# --- sizes and padding ------------------------------------------------------------------------

def test_capture_sizes_are_vllms():
    want = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, min(256 * 2, 512) + 1, 16))
    assert list(G.CAPTURE_SIZES) == want and G.MAX_CAPTURE_SIZE == MAX_GRAPH_BATCH == 512
    assert [G.padded_size(n) for n in (1, 3, 4, 5, 9, 37, 255, 257, 512)] == [1, 4, 4, 8, 16, 40, 256, 272, 512]
    assert G.padded_size(513) is None and G.padded_size(0) is None


def test_decode_batches_and_the_graph_key(tmp_path):
    c = _case()
    assert c.decode_batches() == [3, 3, 3, 3, 2, 2, 2, 2]
    assert Catalog().case("graph-decode").requires == "gpu"        # graph = true: a GPU's graphs
    f = tmp_path / "g.toml"
    f.write_text('[[case]]\nname = "prefill-only"\nseqs = [{len = 40, chunks = [20]}]\ngraph = true\n')
    with pytest.raises(CaseError, match="graph: no step is a decode batch"):
        load_suite_file(f)
    f.write_text('[[case]]\nname = "g"\nseqs = [{len = 40, decode = 2}]\ngraph = "yes"\n')
    with pytest.raises(CaseError, match="graph: expected true or false"):
        load_suite_file(f)


def test_replay_pads_rows_and_cuts_them_off(host_graph):
    """A batch of 3 padded to 4: the op sees 4 rows (the padding one: no slot, no entries),
    its replayed outputs have the step's 3 and equal the eager run's."""
    from harness.run.inputs import build
    seen = []

    def topk(*, logits, lengths, k):
        seen.append((tuple(logits.shape), lengths.tolist()))
        return reference.topk(logits=logits, lengths=lengths, k=k)
    be = Backend("spy", "spy", {"topk": topk})
    inp = build(_case(), "cpu")
    ins = dict(logits=torch.randn(3, 64), lengths=torch.tensor([5, 64, 0], dtype=torch.int32))

    class Run:
        col = type("C", (), {"metrics": {}, "findings": []})()
    out = G.Graphs(be, inp).call(Run, "topk", 0, ins, {"k": 8})
    assert out["indices"].shape == (3, 8)
    assert seen[0] == ((3, 64), [5, 64, 0])                        # the eager run
    assert seen[1] == ((4, 64), [1, 1, 1, 1])                      # warm-up: the dummy step
    assert seen[-1] == ((4, 64), [5, 64, 0, 0])                    # the replay: one padding row
    assert Run.col.metrics == {"topk.graph_replays": [1], "topk.graph_eager_bytes_differ": [0]}


# --- the chain in graph mode ------------------------------------------------------------------

def test_correct_backend_replays_every_decode_step(host_graph):
    row = _judged(_case(ops=("paged_mxfp4_mqa_logits", "topk")), "reference-graphable")
    assert row["status"] == "pass", row["reason"]
    assert _metric(row, G.REPLAYS) == {"paged_mxfp4_mqa_logits": 8, "topk": 8}
    assert set(_metric(row, G.METRIC).values()) == {0}


def test_prefill_steps_run_eagerly(host_graph):
    c = _case(ops=("topk",), seqs=(Catalog().case("chain").seqs))       # chunks, then a mixed step
    row = _judged(c, "reference-graphable")
    assert row["status"] == "pass" and _metric(row, G.REPLAYS) == {"topk": 1}     # the one decode-only step


def test_a_path_that_depends_on_data_cannot_be_captured(host_graph, monkeypatch):
    """The stand-in graph holds its backend to one host path: Python that takes another path at
    replay than at capture (here: as many host reads as a data-dependent shape has rows) is an
    error naming the op, not a silent pass."""
    def topk(*, logits, lengths, k):
        for i in range(len(logits[lengths > 2])):          # a data-dependent shape: live
            assert bool(lengths[i] >= 0)                    # host reads, as many as its rows
        return reference.topk(logits=logits, lengths=lengths, k=k)
    register("wobbly", lambda: Backend("wobbly", "", {"topk": topk}))
    monkeypatch.setattr(G.HostGraph, "SCOPE", (__file__,))            # this file's reads are the backend's
    row = _judged(_case(ops=("topk",)), "wobbly")
    assert row["status"] == "error" and "cannot be captured in a graph: topk" in row["reason"]


@pytest.mark.parametrize("fault", GRAPH_FAULTS)
def test_graph_only_fault_is_caught_only_when_replayed(host_graph, fault):
    c = _case(ops=FAULT_OPS[fault])
    caught = _judged(c, f"fault:{fault}")
    assert caught["status"] == "fail", caught["reason"]
    assert _metric(caught, G.METRIC)[FAULTS[fault].ops[0]] > 0
    eager = _judged(dataclasses.replace(c, graph=False), f"fault:{fault}")
    assert eager["status"] == "pass", eager["reason"]


def test_graph_only_faults_are_in_the_catalogue_with_their_case():
    assert len(GRAPH_FAULTS) >= 4
    sel = Catalog().suite_cases("selftest")
    graph_cases = {c.name for c in sel if c.graph}
    for name in GRAPH_FAULTS:
        assert set(FAULTS[name].cases) <= graph_cases
    assert all(not f.graph for f in FAULTS.values() if set(f.cases) - graph_cases)


def test_graph_ne_eager_is_its_own_failing_stage():
    v = [{"metric": "topk.graph_eager_bytes_differ", "value": 3, "limit": None, "why": "3 > 0"}]
    assert budgets.first_failing_stage(v) == "graph ≠ eager (topk)"
    v.append({"metric": "topk.topk_below_threshold", "value": 1, "limit": 0, "why": "1 > 0"})
    assert budgets.first_failing_stage(v) == "topk"
    row = budgets.verdict({"case": "x", "outcome": "ok", "metrics": {"topk.graph_eager_bytes_differ": 3}},
                          budgets.load(None), "default")
    assert row["status"] == "fail" and row["reason"].startswith("graph ≠ eager (topk) fails")


def test_compare_counts_bytes_in_the_valid_region():
    a = {"logits": torch.zeros(2, 4)}
    b = {"logits": torch.tensor([[0.0, 0, 9, 9], [0, 0, 0, 0]])}
    ins = {"row_ends": torch.tensor([2, 4])}
    assert G.compare(a, b, ins, {"clean_logits": False})[0] == 0            # past the row end: unspecified
    assert G.compare(a, b, ins, {"clean_logits": True})[0] == 4           # 9.0 = 0x41100000: two bytes each
    n, where = G.compare({"indices": torch.zeros(2, dtype=torch.int32)}, {"indices": torch.ones(2, dtype=torch.int32)},
                         {}, {})
    assert n == 2 and "first at byte 0: 0x01 replayed, 0x00 eagerly" in where


# --- the command line -------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_graph_needs_a_gpu(capsys):
    rc, out, err = mxval(capsys, "validate", "--graph", "--case", "chain", "--backend", "reference")
    assert rc == 2
    one_line_error(err, "--graph", "needs a GPU")


def test_no_graph_backend_is_skipped_with_its_reason():
    row = run_case(_case(), "reference")
    assert row["outcome"] == "skipped" and "cannot be replayed from a graph: the reference selects rows" \
        in row["reason"]
