"""The capture hook under a real CUDA graph (`make test-gpu`): a synthetic decode loop whose
indexer ops are vLLM-shaped wrappers over mxval's Triton kernels (harness.bench.capture),
captured once and replayed many times. The dumps drained from the graph's ring are the
eager loop's, byte for byte; `mxval diff` replays them against the reference with no
differing byte; a faulty K writer inside the graph is caught from its dumps."""
import os

import pytest
import torch
from helpers import mxval

from harness.bench.capture import DecodeLoop, capture_env, make_wrappers, upstream_modules
from harness.capture import written
from harness.io.dumps import read_dump
from harness.run.replay import replay_dump
from reference.k_writer import writer_mask

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

LAYERS, STEPS, RING = 3, 10, 4
OPS = {"compress_pool", "k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"}
BYTES = ("page_bytes_mismatched", "page_bytes_outside_owned_changed", "pooled_max_ulp", "q_bytes_mismatched",
         "q_scale_bytes_mismatched", "weights_max_ulp", "topk_below_threshold", "topk_padding_errors",
         "topk_duplicates", "topk_out_of_range")


def _loop_dumps(directory, *, graph: bool, scale_rule="ceil", steps=STEPS):
    """Run the loop (steps 1..steps after one warm-up step 0) recording indexer layer 1 of
    every step from 1 on; -> {step: dump path}."""
    with upstream_modules(make_wrappers(scale_rule=scale_rule)):
        loop = DecodeLoop(layers=LAYERS, batch=16, context=2048, k=128)
        with capture_env(str(directory), layers="1", steps=f"1-{steps}", auto=LAYERS, ring=RING):
            if graph:
                g = loop.capture()             # its warm-up step is step 0
                for _ in range(steps):
                    g.replay()
            else:
                for _ in range(steps + 1):
                    loop.step()
    return {read_dump(p).meta["step"]: p for p in written()}        # uninstall drained the rest


@needs_gpu
def test_graph_replays_yield_the_eager_dumps_and_diff_clean(tmp_path, capsys):
    graph = _loop_dumps(tmp_path / "graph", graph=True)
    eager = _loop_dumps(tmp_path / "eager", graph=False)
    assert sorted(graph) == sorted(eager) == list(range(1, STEPS + 1))
    pools = set()
    for step, p in graph.items():
        g, e = read_dump(p), read_dump(eager[step])
        assert set(g.ops) == OPS and g.meta["layer"] == 1
        for op, rec in g.ops.items():
            for side in ("inputs", "outputs"):
                for name, t in getattr(rec, side).items():
                    want = getattr(e.ops[op], side)[name]
                    assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8), want.view(torch.uint8)), \
                        (step, op, side, name)
            assert rec.scalars == e.ops[op].scalars
        pools.add(g.ops["k_norm_rope_mxfp4_cache"].outputs["kv_cache"].sum().item())
        for r in replay_dump(g):
            assert all(r.metrics.get(m, 0) == 0 for m in BYTES), (step, r.op, r.summary())
    assert len(pools) > 1                      # the steps differ: the pool grows
    rc, out, err = mxval(capsys, "diff", *graph.values(), "--report-dir", tmp_path / "report", "-q")
    assert rc == 0, out + err


@needs_gpu
def test_a_faulty_k_writer_inside_the_graph_is_caught_from_the_dumps(tmp_path, capsys):
    dumps = _loop_dumps(tmp_path / "fault", graph=True, scale_rule="ocp-floor", steps=RING + 2)
    assert sorted(dumps) == list(range(1, RING + 3))
    caught, writing = [], []
    for step, p in sorted(dumps.items()):
        d = read_dump(p)
        rec = d.ops["k_norm_rope_mxfp4_cache"]
        ratio = rec.scalars.get("compress_ratio", 4)
        if bool(writer_mask(rec.inputs["positions"], rec.inputs["slot_mapping"], ratio).any()):
            writing.append(step)             # a step that writes entries: floor and ceil differ there
        (k,) = [r for r in replay_dump(d) if r.op == "k_norm_rope_mxfp4_cache"]
        if k.metrics["page_bytes_mismatched"] > 0:
            caught.append(step)
    assert writing and caught == writing, (caught, writing)
    rc, out, err = mxval(capsys, "diff", *dumps.values(), "--report-dir", tmp_path / "report", "-q")
    assert rc == 1, out + err
    assert os.path.isdir(tmp_path / "report")
