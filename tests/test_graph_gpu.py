"""Graph mode under real CUDA/HIP graphs (`make test-gpu`): the Triton backend's decode steps
replayed from torch.cuda.CUDAGraph give the eager run's bytes and pass; every graph-only fault
is caught when replayed and passes when run eagerly; the reference (boolean masks) is refused."""
import dataclasses

import pytest
import torch
from helpers import needs_gpu

from harness.run import budgets
from harness.run import graph as G
from harness.run.cases import Catalog
from harness.run.runner import run_case
from optimized.faults import FAULTS

pytestmark = pytest.mark.gpu
GRAPH_FAULTS = [f.name for f in FAULTS.values() if f.graph]


def _judged(case, backend):
    row = run_case(case, backend)
    return budgets.verdict(row, budgets.load(None), case.suite)


def _replays(row) -> int:
    return int(sum(v for k, v in row["metrics"].items() if k.endswith("." + G.REPLAYS)))


@needs_gpu
def test_triton_replays_every_decode_step_with_the_eager_bytes():
    assert G.FACTORY is None                       # the real torch.cuda.CUDAGraph
    case = Catalog().case("graph-decode")
    row = _judged(case, "triton")
    assert row["status"] == "pass", row["reason"]
    assert _replays(row) == 8 * len(case.ops)      # 8 decode steps, every op
    assert all(v == 0 for k, v in row["metrics"].items() if k.endswith("." + G.METRIC))


@needs_gpu
@pytest.mark.parametrize("fault", GRAPH_FAULTS)
def test_graph_only_fault_caught_when_replayed_and_passes_eagerly(fault):
    case = Catalog().case("graph-decode")
    caught = _judged(case, f"fault:{fault}")
    assert caught["status"] == "fail", caught["reason"]
    assert any(v["metric"].endswith("." + G.METRIC) for v in caught["violations"])
    eager = _judged(dataclasses.replace(case, graph=False), f"fault:{fault}")
    assert eager["status"] == "pass", eager["reason"]


@needs_gpu
def test_reference_cannot_be_replayed_from_a_graph():
    row = _judged(Catalog().case("graph-decode"), "reference")
    assert row["status"] == "skipped" and "cannot be replayed from a graph" in row["reason"]


@needs_gpu
def test_padding_rows_stay_out_of_the_outputs():
    """A batch of 3 padded to 4: the replayed outputs have 3 rows and equal the eager run's."""
    from harness.run.inputs import build
    from optimized import get_backend
    be = get_backend("triton")
    case = Catalog().case("graph-decode")
    inp = build(case, be.device)
    st = inp.steps[0]
    assert st.n == 3 and G.padded_size(st.n) == 4
    ins = dict(logits=torch.randn(3, 64, device=be.device), lengths=torch.tensor([5, 64, 0], device=be.device,
                                                                                 dtype=torch.int32))

    class Run:
        col = type("C", (), {"metrics": {}, "findings": []})()
    out = G.Graphs(be, inp).call(Run, "topk", 0, ins, {"k": 8})
    assert out["indices"].shape == (3, 8)
    assert Run.col.metrics["topk." + G.METRIC] == [0]


# --- the capture hook, end to end -------------------------------------------------------------

def _hooked_topk_run(tmp_path, monkeypatch, name: str, shortcut: bool):
    """graph-decode's top-k in graph mode through an upstream-shaped top-k (harness.bench.capture's
    wrapper at vLLM's module path, so the capture hook wraps it), the hook recording layer 0 of
    every replayed step: (the live row, the dumps written)."""
    import harness.capture as capture
    from harness.bench.capture import _fn, capture_env, make_wrappers, upstream_modules
    from optimized import Backend, get_backend, register
    plain = make_wrappers()["vllm.ops.topk"]

    def upstream_topk(logits, lengths, out, k):
        if shortcut and int(lengths.max()) <= k:        # graph-fits-k-shortcut, upstream-shaped
            idx = torch.arange(k, dtype=out.dtype, device=out.device).expand_as(out)
            out.copy_(torch.where(idx < lengths[:, None], idx, torch.full_like(idx, -1)))
        else:
            plain(logits, lengths, out, k)

    steps = iter(range(10 ** 6))
    replay, cap = G._Captured.replay, G.CudaGraph.capture

    def replay_at_step(self, *a):
        capture.set_context(layer=0, step=next(steps))     # vLLM's runner: the step before each replay
        try:
            return replay(self, *a)
        finally:
            capture.set_context(None, None)                # eager calls are not recorded

    def capture_layer(self, fn):
        capture.set_context(layer=0, step=None)            # the layer while the graph is captured
        try:
            return cap(self, fn)
        finally:
            capture.set_context(None, None)
    monkeypatch.setattr(G._Captured, "replay", replay_at_step)
    monkeypatch.setattr(G.CudaGraph, "capture", capture_layer)
    with upstream_modules({"vllm.ops.topk": upstream_topk}):
        with capture_env(str(tmp_path), layers="0", steps="0-100000", ring=4):
            hooked = _fn("vllm.ops.topk")

            def topk(*, logits, lengths, k):
                out = torch.full((logits.shape[0], k), -1, dtype=torch.int32, device=logits.device)
                hooked(logits, lengths, out, k)
                return {"indices": out}
            base = get_backend("triton")
            register(name, lambda: Backend(name, "triton with an upstream-shaped top-k",
                                           dict(base.ops, topk=topk), device=base.device))
            row = _judged(dataclasses.replace(Catalog().case("graph-decode"), ops=("topk",)), name)
    return row, capture.written()                      # uninstalling drained the ring's last steps


@needs_gpu
@pytest.mark.parametrize("shortcut", [False, True])
def test_capture_hook_records_graph_mode_replays_and_diff_agrees(tmp_path, monkeypatch, capsys, shortcut):
    from helpers import mxval

    from harness.io.dumps import read_dump
    row, dumps = _hooked_topk_run(tmp_path / "dumps", monkeypatch, f"hooked-topk-{shortcut}", shortcut)
    assert row["status"] == ("fail" if shortcut else "pass"), row["reason"]
    assert len(dumps) == 8                                  # every replayed decode step, one dump each
    assert all(set(read_dump(p).ops) == {"topk"} for p in dumps)
    rc, out, err = mxval(capsys, "diff", *dumps, "--report-dir", tmp_path / "report", "-q")
    assert rc == (1 if shortcut else 0), out + err          # the live run's verdict, from the dumps
