"""Shadow mode under a real CUDA graph and eagerly on the GPU (`make test-gpu`): the synthetic
decode loop of harness.bench.capture at a small size, through harness.bench.shadow's own
measurements (the checker's event waits, its low-priority stream, the reference on the GPU):
a correct loop raises no alarm, a faulty K writer is flagged at the first sampled step that
writes K entries and its dump gives the same verdict on the CPU, a stopped checker loses no
counted verdict while serving goes on."""
import pytest
from helpers import needs_gpu

from harness.bench import shadow as bench

pytestmark = pytest.mark.gpu

SHAPE = dict(layers=2, batch=16, context=2048, k=128)


@needs_gpu
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_correct_loop_no_alarm(mode):
    a = bench.alarms(SHAPE, sampled=24, mode=mode, device="cuda")
    c = a["counts"]
    assert c["checked"] >= 24 and c["failed"] == 0 and c["skipped"] == 0, (c, a["reasons"])


@needs_gpu
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_catalogue_fault_flagged_and_reproduced_on_the_cpu(mode):
    f = bench.fault(SHAPE, rate=1 / 4, max_steps=200, mode=mode, device="cuda")
    assert f.get("step") is not None, f
    assert f["sampled_until_flagged"] == f["expected_sampled"] and f["diff_status"] == "fail" and f["diff_same"], f


@needs_gpu
def test_stopped_checker_under_graphs():
    k = bench.killed(SHAPE, steps=48, mode="graph", device="cuda")
    assert k["served"] == 48 and k["stopped_at"] and k["lost"] == 0 and k["logged"] >= 2
