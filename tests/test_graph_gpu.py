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
