"""Shadow mode (harness.capture.shadow): sampled live steps checked against the reference off
the serving path, at tiny sizes on the CPU (eager calls, and graph replays with the graph
faked as in test_capture)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings

import pytest
import torch
from helpers import FakeNodes, NodeGraph, emit, fake_graphs, make_layer

import optimized
import reference
from harness import capture
from harness.capture import ArgMap, hook, install, set_context, uninstall, wrap
from harness.capture import shadow as S
from harness.commands import cli
from harness.io import env
from harness.io.dumps import OpRecord, read_dump
from harness.run.replay import replay_dump

K_FIELDS = ("k", "positions", "cos_sin_cache", "norm_weight", "slot_mapping", "kv_cache")
K_SCALARS = ("norm_eps", "compress_ratio", "page_size", "shuffle")
K_MAP = ArgMap({f: f for f in K_FIELDS}, {"kv_cache": "kv_cache"}, {s: s for s in K_SCALARS})
TOPK_MAP = ArgMap({"logits": "logits", "lengths": "lengths"}, {"indices": "out"}, {"k": "k"})


@pytest.fixture
def clean(monkeypatch, tmp_path):
    for name in ("MXVAL_CAPTURE_DIR", "MXVAL_CAPTURE_LAYERS", "MXVAL_CAPTURE_STEPS", "MXVAL_CAPTURE_AUTO_LAYERS",
                 "MXVAL_CAPTURE_RING", "MXVAL_CAPTURE_ANCHOR", "RANK", "LOCAL_RANK", S.ENV_RATE, S.ENV_DIR,
                 S.ENV_RING, S.ENV_SEED, S.ENV_DEVICE, S.ENV_BUDGETS, S.ENV_CHECKER):
        monkeypatch.delenv(name, raising=False)
    yield tmp_path / "shadow"
    uninstall()


@pytest.fixture(scope="module")
def layer():
    return make_layer(4, heads=32)


class Serving:
    """A tiny serving loop: per step and layer, a K-writer call (a backend's op writing the
    pool in place, as aiter's does) and a top-k call, both through the capture's wrap()."""

    def __init__(self, layer, backend="reference", layers=1, seed=0):
        be = optimized.get_backend(backend)
        rec = layer["k_norm_rope_mxfp4_cache"]
        self.base, self.scalars = rec.inputs, rec.scalars
        self.pools = [rec.inputs["kv_cache"].clone() for _ in range(layers)]
        self.g = torch.Generator().manual_seed(seed)
        self.layers = layers
        self.topk_rec = layer["topk"]

        def k_store(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache, norm_eps, compress_ratio,
                    page_size, shuffle):
            out = be.k_norm_rope_mxfp4_cache(k=k, positions=positions, cos_sin_cache=cos_sin_cache,
                                             norm_weight=norm_weight, slot_mapping=slot_mapping,
                                             kv_cache=kv_cache.clone(), norm_eps=norm_eps,
                                             compress_ratio=compress_ratio, page_size=page_size, shuffle=shuffle)
            kv_cache.copy_(out["kv_cache"])

        def topk_into(logits, lengths, k, out):
            out.copy_(reference.topk(logits=logits, lengths=lengths, k=k)["indices"])

        self.k_store = wrap(k_store, "k_norm_rope_mxfp4_cache", K_MAP)
        self.topk = wrap(topk_into, "topk", TOPK_MAP)

    def step(self, step, *, k_writer=True):
        results = []
        for layer in range(self.layers):
            set_context(layer=layer, step=step)
            if k_writer:
                k = (torch.randn(self.base["k"].shape, generator=self.g) * 3).to(torch.bfloat16)
                self.k_store(k, self.base["positions"], self.base["cos_sin_cache"], self.base["norm_weight"],
                             self.base["slot_mapping"], self.pools[layer], **self.scalars)
            t = self.topk_rec
            logits = torch.randn(t.inputs["logits"].shape, generator=self.g)
            out = torch.full_like(t.outputs["indices"], -7)
            self.topk(logits, t.inputs["lengths"], t.scalars["k"], out)
            results.append((logits, out))
        set_context(layer=None, step=step + 1)          # the step's records go to the checker
        return results


def _log(d):
    return [json.loads(line) for line in open(d / S.LOG)]


def _verdicts(d):
    return [e for e in _log(d) if e["event"] == "verdict"]


def _prom(d):
    out = {}
    for line in open(d / S.PROM):
        if line.startswith("mxval_shadow_"):
            k, v = line.split()
            out[k] = float(v)
    return out


# --- sampling -------------------------------------------------------------------------------------

def test_sampling_is_deterministic_and_at_the_rate():
    picked = [s for s in range(20000) if S.chosen(s, 0.01, seed=3)]
    assert picked == [s for s in range(20000) if S.chosen(s, 0.01, seed=3)]      # the same steps every time
    assert 150 <= len(picked) <= 250                                                  # about 1 in 100
    other = [s for s in range(20000) if S.chosen(s, 0.01, seed=4)]
    assert other != picked                                                            # the seed moves them
    assert all(S.chosen(s, 1.0) for s in range(50)) and not any(S.chosen(s, 0.0) for s in range(50))
    assert not S.chosen(None, 1.0)
    half = {s for s in range(20000) if S.chosen(s, 0.005, seed=3)}
    assert half <= set(picked)                        # a halved rate keeps a subset: halving only drops steps
    # no step is sampled at every rate: at seed 0, the first steps (a server's warm-up) are
    # sampled about as often as any other (none of 1000 at 1e-6)
    assert not any(S.chosen(s, 1e-6, seed=0) for s in range(1000))


def test_bad_environment_is_one_line(clean, monkeypatch):
    monkeypatch.setenv(S.ENV_RATE, "2")
    monkeypatch.setenv(S.ENV_DIR, str(clean))
    with pytest.raises(ValueError, match="MXVAL_SHADOW=.*expected a number in"):
        install([], quiet=True)
    monkeypatch.setenv(S.ENV_RATE, "0.5")
    monkeypatch.delenv(S.ENV_DIR)
    with pytest.raises(ValueError, match="MXVAL_SHADOW_DIR"):
        install([], quiet=True)


def test_bad_api_arguments_are_refused(tmp_path):
    for rate, ring in ((0, 4), (1.5, 4), (0.1, 0), (float("nan"), 4)):
        with pytest.raises(ValueError, match="rate must be in"):
            S.Shadow(tmp_path, rate, ring=ring)


def test_env_switches_it_on_with_the_capture_layer_selection(clean, monkeypatch, layer):
    monkeypatch.setenv(S.ENV_RATE, "1")
    monkeypatch.setenv(S.ENV_DIR, str(clean))
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "1")
    install([], quiet=True)
    sh = capture.current_shadow()
    assert sh is not None and sh.rate == 1.0
    m = Serving(layer, layers=2)
    for step in range(3):
        m.step(step, k_writer=False)
    assert sh.join(20)
    v = _verdicts(clean)
    assert sorted((e["layer"], e["step"]) for e in v) == [(1, 0), (1, 1), (1, 2)]    # layer 1 only
    assert all(e["ok"] for e in v) and not os.listdir(clean / S.FAILURES)
    uninstall()
    assert _log(clean)[-1]["event"] == "stop"


# --- bounds ---------------------------------------------------------------------------------------

def _blocked_shadow(d, ring, gate, seen):
    def check(records, name, device):
        seen.append(name)
        gate.wait(30)
        return {"status": "pass", "ok": True, "reason": "", "metrics": {}}, []
    return S.Shadow(d, 1.0, ring=ring, check=check, prom_every=0.05)


def test_the_ring_bounds_what_is_held_and_the_rate_halves_when_behind(clean, layer):
    gate, seen = threading.Event(), []
    sh = _blocked_shadow(clean, 3, gate, seen)
    install([], quiet=True, shadow=sh)
    m = Serving(layer)
    live = []
    try:
        t0 = time.perf_counter()
        for step in range(40):
            m.step(step, k_writer=False)
            live.append(sh.items.qsize())
        served = time.perf_counter() - t0
        assert max(live) <= 3                           # never more than the ring in flight
        c = sh.snapshot()
        assert c["sampled"] <= 4                        # 3 queued + the one being checked
        assert c["skipped"] >= 1 and c["rate_halvings"] == c["skipped"] and c["rate"] < 1.0
        assert served < 5                               # the serving loop never waited for the checker
        time.sleep(0.3)                                 # the counters file, while the checker is still stuck
        prom = _prom(clean)
        assert prom["mxval_shadow_rate"] == c["rate"] and prom["mxval_shadow_skipped_total"] == c["skipped"]
        assert prom["mxval_shadow_rate_halvings_total"] == c["rate_halvings"] and prom["mxval_shadow_queued"] >= 2
    finally:
        gate.set()
    assert sh.join(20)
    assert sh.snapshot()["checked"] == c["sampled"]


def test_adaptive_rate_under_a_slow_checker(clean, layer):
    def slow(records, name, device):
        time.sleep(0.2)
        return {"status": "pass", "ok": True, "reason": "", "metrics": {}}, []
    sh = S.Shadow(clean, 1.0, ring=2, check=slow)
    install([], quiet=True, shadow=sh)
    m = Serving(layer)
    rates = []
    for step in range(200):
        m.step(step, k_writer=False)
        rates.append(sh.rate)
    assert rates == sorted(rates, reverse=True) and rates[-1] <= 1 / 8     # only ever halved
    assert sh.join(20)
    c = sh.snapshot()
    assert c["checked"] == c["sampled"] > 0 and c["rate_halvings"] >= 3
    assert len(_verdicts(clean)) == c["checked"]
    assert "mxval_shadow_rate_halvings_total" in open(clean / S.PROM).read()


def test_a_halved_rate_doubles_back_once_the_checker_keeps_up_never_above_the_rate_asked(clean, layer):
    gate, seen = threading.Event(), []
    sh = _blocked_shadow(clean, 2, gate, seen)
    install([], quiet=True, shadow=sh)
    m = Serving(layer)
    step = 0
    while sh.snapshot()["rate_halvings"] < 3:           # a burst: the checker is stuck, the rate halves
        m.step(step, k_writer=False)
        step += 1
    assert sh.rate == 1 / 8 and sh.snapshot()["rate_raises"] == 0
    gate.set()
    assert sh.join(20)
    rates, admitted = [], []
    s0 = sh.snapshot()["sampled"]
    for _ in range(400):                                # the checker keeps up: join after every step
        m.step(step, k_writer=False)
        step += 1
        assert sh.join(20)
        rates.append(sh.rate)
        admitted.append(sh.snapshot()["sampled"] - s0)
    c = sh.snapshot()
    assert c["rate_raises"] == 3 and sh.rate == 1.0 and max(rates) == 1.0     # back to 1, never above
    assert rates == sorted(rates)                                              # only raised, one step at a time
    assert c["rate"] == 1.0
    end = time.time() + 10                          # the counters file: rewritten within a second
    while _prom(clean)["mxval_shadow_rate_raises_total"] != 3 and time.time() < end:
        time.sleep(0.05)
    assert _prom(clean)["mxval_shadow_rate_raises_total"] == 3 and _prom(clean)["mxval_shadow_rate"] == 1.0
    # each raise comes at the RECOVER_AFTER-th step admitted at the rate before it
    firsts = [rates.index(r) for r in (1 / 4, 1 / 2, 1.0)]
    assert [admitted[i] for i in firsts] == [S.RECOVER_AFTER * n for n in (1, 2, 3)]


# --- verdicts -------------------------------------------------------------------------------------

def test_a_catalogue_fault_is_flagged_and_its_dump_reproduces_with_mxval_diff(clean, layer, tmp_path, capsys):
    sh = S.Shadow(clean, 0.5, ring=4, seed=1)
    install([], quiet=True, shadow=sh)
    m = Serving(layer, backend="fault:nibbles-swapped")
    sampled = [s for s in range(6) if S.chosen(s, 0.5, seed=1)]
    assert sampled                                  # the expected number of sampled steps: all of these
    for step in range(6):
        m.step(step)
    assert sh.join(60)
    v = _verdicts(clean)
    assert sorted(e["step"] for e in v) == sampled and all(not e["ok"] for e in v)
    assert all(e["reason"].startswith("k_norm_rope_mxfp4_cache fails") for e in v)
    dump = v[0]["dump"]
    assert os.path.dirname(dump) == str(clean / S.FAILURES)
    assert _prom(clean)["mxval_shadow_failed_total"] == len(sampled)
    # mxval diff gives the same verdict from the dump alone
    out = tmp_path / "diff"
    assert cli.main(["diff", dump, "--report-dir", str(out), "-q"]) == 1
    (row,) = json.load(open(out / "report.json"))["cases"]
    assert row["status"] == "fail" and row["reason"] == v[0]["reason"]
    assert row["metrics"] == v[0]["row"]["metrics"]
    assert not all(r.ok({"page_bytes_mismatched": 0}) for r in replay_dump(read_dump(dump)))
    # mxval shadow report: the log in every format, failing
    rep = tmp_path / "report"
    assert cli.main(["shadow", "report", str(clean), "--report-dir", str(rep), "-q"]) == 1
    doc = json.load(open(rep / "report.json"))
    assert [r["status"] for r in doc["cases"]] == ["fail"] * len(sampled)
    assert {"report.json", "report.md", "report.html"} <= set(os.listdir(rep))


def test_a_correct_backend_gets_no_alarm_over_many_sampled_steps(clean, layer):
    sh = S.Shadow(clean, 1.0, ring=8)
    install([], quiet=True, shadow=sh)
    m = Serving(layer, layers=2)
    m.step(0)                                       # one step with the K writer too
    for step in range(1, 80):
        m.step(step, k_writer=False)
        if step % 2 == 0:
            sh.join(20)                             # keep the checker in step: nothing skipped
    assert sh.join(20)
    c = sh.snapshot()
    assert c["checked"] == 160 and c["skipped"] == 0 and c["failed"] == 0 and c["passed"] == c["checked"]
    assert not os.listdir(clean / S.FAILURES)
    assert all(e["ok"] for e in _verdicts(clean))


# --- the worker process ----------------------------------------------------------------------------

def test_the_worker_process_judges_keeps_dumps_and_a_killed_worker_switches_the_shadow_off(clean, layer,
                                                                                          monkeypatch):
    monkeypatch.setenv(S.ENV_RATE, "1")
    monkeypatch.setenv(S.ENV_DIR, str(clean))
    monkeypatch.setenv(S.ENV_CHECKER, "process")
    monkeypatch.setenv("MXVAL_CAPTURE_LAYERS", "0")
    install([], quiet=True)
    sh = capture.current_shadow()
    assert sh.checker == "process"
    m = Serving(layer, backend="fault:nibbles-swapped")
    m.step(0)
    assert sh.join(120)
    (v,) = _verdicts(clean)
    assert not v["ok"] and os.path.exists(v["dump"])                 # the worker wrote the failing dump
    (r,) = [x for x in replay_dump(read_dump(v["dump"])) if x.op == "k_norm_rope_mxfp4_cache"]
    assert r.metrics["page_bytes_mismatched"] == v["row"]["metrics"]["k_norm_rope_mxfp4_cache.page_bytes_mismatched"]
    assert sh.worker.pid != os.getpid() and sh.worker.is_alive()
    os.kill(sh.worker.pid, signal.SIGKILL)                         # the checker killed mid-run
    sh.worker.join(10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, 6):
            for logits, out in m.step(step, k_writer=False):        # serving goes on, its results untouched
                assert torch.equal(out, reference.topk(logits=logits, lengths=m.topk_rec.inputs["lengths"],
                                                       k=m.topk_rec.scalars["k"])["indices"])
            time.sleep(0.05)
    assert not sh.enabled and [e["event"] for e in _log(clean)].count("off") == 1
    assert len(_verdicts(clean)) == sh.snapshot()["checked"] == 1    # every verdict counted is in the log


def test_the_checker_kind_is_checked(clean, monkeypatch):
    with pytest.raises(ValueError, match="checker is one of"):
        S.Shadow(clean, 0.5, checker="fork")
    with pytest.raises(ValueError, match="thread checker only"):
        S.Shadow(clean, 0.5, checker="process", check=lambda *a: None)
    monkeypatch.setenv(S.ENV_RATE, "0.5")
    monkeypatch.setenv(S.ENV_DIR, str(clean))
    monkeypatch.setenv(S.ENV_CHECKER, "fork")
    with pytest.raises(ValueError, match="MXVAL_SHADOW_CHECKER='?fork'?: expected one of process, thread"):
        install([], quiet=True)


# --- failures of the shadow itself ------------------------------------------------------------------

def test_a_checker_exception_switches_the_shadow_off_and_serving_goes_on(clean, layer):
    def broken(records, name, device):
        raise RuntimeError("checker broke")
    sh = S.Shadow(clean, 1.0, ring=2, check=broken)
    install([], quiet=True, shadow=sh)
    m = Serving(layer)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(10):
            for logits, out in m.step(step, k_writer=False):       # serving's results are untouched
                t = m.topk_rec
                assert torch.equal(out, reference.topk(logits=logits, lengths=t.inputs["lengths"],
                                                       k=t.scalars["k"])["indices"])
            time.sleep(0.01)
    assert not sh.enabled and sh.snapshot()["enabled"] == 0
    assert sum("switched off" in str(x.message) for x in w) == 1             # logged once
    off = [e for e in _log(clean) if e["event"] == "off"]
    assert len(off) == 1 and "checker broke" in off[0]["why"]
    assert _prom(clean)["mxval_shadow_enabled"] == 0


def test_a_recording_failure_switches_the_shadow_off(clean, layer):
    sh = S.Shadow(clean, 1.0, ring=2)
    install([], quiet=True, shadow=sh)
    bad = wrap(lambda logits, lengths, k, out: None, "topk",
               ArgMap({"logits": "logits", "lengths": lambda b: b["nope"]}, {"indices": "out"}, {"k": "k"}))
    set_context(layer=0, step=0)
    out = torch.zeros(2, 3, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert bad(torch.zeros(2, 8), torch.ones(2, dtype=torch.int32), 3, out) is None    # the call still ran
    assert not sh.enabled and [e["event"] for e in _log(clean)][-1] == "off"


def test_a_stopped_checker_loses_no_recorded_verdict_and_serving_goes_on(clean, layer):
    sh = S.Shadow(clean, 1.0, ring=16, checker="thread")      # the worker's kill: test_the_worker_process_...
    install([], quiet=True, shadow=sh)
    m = Serving(layer)
    for step in range(12):
        m.step(step, k_writer=False)
        if step == 5:
            sh.stop(wait=False)                     # the checker goes away mid-run
    sh.thread.join(20)
    for step in range(12, 20):                      # serving goes on, its sampled steps skipped
        m.step(step, k_writer=False)
    c = sh.snapshot()
    assert c["checker_alive"] == 0 and c["skipped"] >= 8 and c["queued"] == 0, c
    assert len(_verdicts(clean)) == c["checked"] > 0             # every counted verdict is in the log
    assert _prom(clean)["mxval_shadow_checked_total"] == c["checked"]


# --- graph replays --------------------------------------------------------------------------------

class FaultyTopk:
    """A captured graph of one top-k call through the capture (wrap) with a fault on long
    rows (a row 0 longer than LONG gets its last index wrong), and its inputs drawn anew
    before each replay: `step()` draws them, notes whether the fault acts, replays."""
    LONG = 30

    def __init__(self):
        def fault_topk(logits, lengths, out, k):
            def work():
                idx = reference.topk(logits=logits, lengths=lengths, k=k)["indices"]
                if int(lengths[0]) > self.LONG:
                    idx[0, -1] = logits[0, :int(lengths[0])].argmin()
                out.copy_(idx)
            emit(work)
        topk = wrap(fault_topk, "topk", capture.VLLM_TOPK)
        self.logits, self.lengths = torch.zeros(3, 40), torch.zeros(3, dtype=torch.int32)
        out = torch.full((3, 7), -1, dtype=torch.int32)
        self.g = torch.cuda.CUDAGraph()
        self.g.capture_begin()
        topk(self.logits, self.lengths, out[:, :5], 5)
        self.g.capture_end()
        self.gen, self.long = torch.Generator().manual_seed(0), []

    def step(self):
        self.logits.copy_(torch.randn(3, 40, generator=self.gen))
        self.lengths.copy_(torch.randint(6, 41, (3,), generator=self.gen))
        self.long.append(int(self.lengths[0]) > self.LONG)
        self.g.replay()


def test_graph_replays_are_checked_and_the_ring_positions_come_back(clean, monkeypatch):
    fake_graphs(monkeypatch, hook)
    monkeypatch.setenv("MXVAL_CAPTURE_AUTO_LAYERS", "1")
    monkeypatch.setenv("MXVAL_CAPTURE_ANCHOR", "topk")
    sh = S.Shadow(clean, 1.0, ring=2)
    install([], quiet=True, shadow=sh)
    f = FaultyTopk()
    g, long = f.g, f.long
    rec = getattr(g, hook.GRAPH_ATTR)
    for step in range(24):
        f.step()
        assert len(rec.busy) <= 2
        if step % 2:
            sh.join(20)
    assert sh.join(20)
    assert not rec.busy                              # every position back once checked
    v = _verdicts(clean)
    assert v and all(e["mode"] == "graph" for e in v)
    for e in v:
        assert e["ok"] == (not long[e["step"]])            # flagged exactly where the fault acts
    bad = [e for e in v if not e["ok"]]
    assert bad
    (r,) = replay_dump(read_dump(bad[0]["dump"]))
    assert not r.ok({"topk_below_threshold": 0, "topk_rows_not_exact_frac": 0})


def _node_graph(monkeypatch, clean, rate, nodes):
    """FaultyTopk on a NodeGraph, the shadow at `rate` with node switching faked by `nodes`;
    (graph, step(): one replay and its checks, fault_acts per step)."""
    fake_graphs(monkeypatch, hook)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", NodeGraph)
    monkeypatch.setattr(NodeGraph, "execs", {})
    monkeypatch.setattr(hook.graph_nodes, "api", lambda: nodes)
    monkeypatch.setenv("MXVAL_CAPTURE_AUTO_LAYERS", "1")
    monkeypatch.setenv("MXVAL_CAPTURE_ANCHOR", "topk")
    install([], quiet=True, shadow=S.Shadow(clean, rate, ring=2))
    f = FaultyTopk()

    def step():
        f.step()
        capture.current_shadow().join(20)
    return f.g, step, f.long


def test_graph_recording_copies_are_switched_off_in_the_graph_except_on_sampled_replays(clean, monkeypatch):
    """The hook keeps the graph (keep_graph) and instantiates it, disables its recording
    copies' nodes, and enables them for a sampled replay only: an unsampled replay launches
    none, and every sampled one records the replay's own fields (the fault flagged exactly
    where it acts; with the copies left off the staging would hold an earlier replay's)."""
    nodes = FakeNodes()
    g, step, long = _node_graph(monkeypatch, clean, 0.5, nodes)
    rec = getattr(g, hook.GRAPH_ATTR)
    assert g.keep and getattr(g, hook.KEPT_ATTR) and g.exec_ is not None
    staged = [i for i in range(len(g.work)) if i != 1]           # 0: inputs, 1: the op, 2: outputs
    assert rec.nodes == staged and g.disabled == set(staged)
    for _ in range(40):
        step()
    sampled = {e["step"] for e in _verdicts(clean)}
    assert 5 < len(sampled) < 35
    assert [not d for d in g.replays] == [s in sampled for s in range(40)]
    assert all(d in (frozenset(), frozenset(staged)) for d in g.replays)
    for e in _verdicts(clean):
        assert e["ok"] == (not long[e["step"]])
    switches = len(nodes.calls)
    assert switches == len(staged) * (1 + sum(a != b for a, b in zip(g.replays, g.replays[1:])) + (not g.replays[0]))


def test_graph_nodes_that_cannot_be_switched_leave_the_copies_on_and_recording_right(clean, monkeypatch):
    """A node switch refused when the capture ends: the copies stay in the graph at every
    replay, their flag deciding; refused when a sampled replay needs them on: that step is
    not recorded and the shadow goes off (serving goes on)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g, step, long = _node_graph(monkeypatch, clean, 0.5, FakeNodes(fail={False}))
    rec = getattr(g, hook.GRAPH_ATTR)
    assert rec.nodes is None and not g.disabled
    assert any("recording copies left on" in str(x.message) for x in w)
    for _ in range(20):
        step()
    v = _verdicts(clean)
    assert v and all(e["ok"] == (not long[e["step"]]) for e in v)
    uninstall()

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        g, step, long = _node_graph(monkeypatch, clean / "on", 1.0, FakeNodes(fail={True}))
        step()
        step()
    assert g.disabled and all(d for d in g.replays)                 # never switched on
    sh = capture.current_shadow()
    assert not sh.enabled and "not armed" in _log(clean / "on")[-1]["why"]
    assert not _verdicts(clean / "on")


def test_graphs_the_hook_does_not_make_keep_are_not_switched(clean, monkeypatch):
    """A graph made before install, or one its caller keeps itself (and so instantiates
    itself), is left as made: its copies stay in the graph, their flag deciding; uninstall
    gives CUDAGraph its own __init__ back."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", NodeGraph)
    before = NodeGraph()
    own = NodeGraph.__dict__["__init__"]
    g, step, long = _node_graph(monkeypatch, clean, 1.0, FakeNodes())
    assert NodeGraph.__init__ is not own
    for mine in (before, NodeGraph(keep_graph=True)):
        assert not getattr(mine, hook.KEPT_ATTR, False)
    theirs = NodeGraph(keep_graph=True)
    theirs.capture_begin()
    theirs.capture_end()
    assert theirs.exec_ is None                          # not instantiated for them
    uninstall()
    assert NodeGraph.__dict__["__init__"] is own
    # on a GPU, a recording graph whose copies cannot be switched says so once, and why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hook.graph_nodes, "reason", lambda: "the driver has no cuGraphNodeSetEnabled")
    hook._S.warned.discard("nodes-kept")
    with pytest.warns(RuntimeWarning, match="stay in the graph at every replay.*no cuGraphNodeSetEnabled"):
        assert hook._switch_off(before, hook._GraphRecord())


KILLED = r"""
import sys, time
sys.path[:0] = [sys.argv[2], sys.argv[3]]
import torch, reference
from helpers import make_layer
from harness.capture import install, set_context, wrap
from harness.capture.shadow import Shadow
from test_shadow import TOPK_MAP
install([], quiet=True, shadow=Shadow(sys.argv[1], 1.0, ring=64, prom_every=0.05))
rec = make_layer(4, heads=32)["topk"]
topk = wrap(lambda logits, lengths, k, out: out.copy_(reference.topk(logits=logits, lengths=lengths, k=k)["indices"]),
            "topk", TOPK_MAP)
g = torch.Generator().manual_seed(0)
step = 0
while True:
    set_context(layer=0, step=step)
    topk(torch.randn(rec.inputs["logits"].shape, generator=g), rec.inputs["lengths"], rec.scalars["k"],
         torch.empty_like(rec.outputs["indices"]))
    step += 1
    time.sleep(0.002)
"""


def test_a_killed_checker_loses_no_recorded_verdict(clean, tmp_path):
    """The serving process killed (SIGKILL) with its checker mid-run: every verdict the
    counters counted is in the log, whole, and `mxval shadow report` reads it."""
    import signal
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(clean), os.path.dirname(here), here],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.time() + 60
        while time.time() < end and p.poll() is None:
            if (clean / S.LOG).exists() and sum(1 for _ in open(clean / S.LOG)) >= 8:
                break
            time.sleep(0.05)
        assert p.poll() is None, p.stderr.read().decode()[-2000:]
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
    entries, problems = S.read_log(clean / S.LOG)
    assert len(problems) <= 1                       # at most the line the kill cut short
    verdicts = [e for e in entries if e["event"] == "verdict"]
    assert len(verdicts) >= 7 and all(e["ok"] for e in verdicts)
    assert _prom(clean)["mxval_shadow_checked_total"] <= len(verdicts)     # nothing counted is missing
    out = tmp_path / "report"
    assert cli.main(["shadow", "report", str(clean), "--report-dir", str(out), "-q"]) == 0
    assert len(json.load(open(out / "report.json"))["cases"]) == len(verdicts)


# --- make bench-gpu's shadow part, its logic at tiny sizes (Triton interpreter, eager) -------------

BENCH_SHAPE = dict(layers=1, batch=2, context=64, heads=16, k=16)


@pytest.fixture
def interpreted(clean):
    optimized.get_backend("triton-interpret")       # the kernel modules in interpreter mode
    from harness.bench import shadow as bench
    return bench


def test_bench_flags_the_catalogue_fault_and_its_dump_reproduces(interpreted):
    # 8 sequences: a step that writes entries writes enough 32-value blocks that the fault
    # (a scale rule that agrees with the right one on some amax ranges) changes one of them
    f = interpreted.fault(dict(BENCH_SHAPE, batch=8), rate=0.5, max_steps=40, mode="eager", device="cpu")
    assert f["step"] is not None and f["sampled_until_flagged"] == f["expected_sampled"]
    assert f["diff_status"] == "fail" and f["diff_same"] and "k_norm_rope_mxfp4_cache" in f["reason"]


def test_bench_correct_loop_gets_no_alarm(interpreted, monkeypatch):
    from harness.bench.capture import D, DecodeLoop
    loop = DecodeLoop(**BENCH_SHAPE, device="cpu")
    before = (loop.q.clone(), loop.state.clone(), loop.weights.clone())
    loop.refill(torch.Generator().manual_seed(1))
    assert not any(torch.equal(a, b) for a, b in zip(before, (loop.q, loop.state, loop.weights)))
    assert loop.state[..., 2 * D:].std() > 1.5 * loop.state[..., :2 * D].std()     # scores spread wider, as built
    refills = []
    real = DecodeLoop.refill
    monkeypatch.setattr(DecodeLoop, "refill", lambda self, g: (refills.append(1), real(self, g)))
    a = interpreted.alarms(BENCH_SHAPE, sampled=4, mode="eager", device="cpu", ring=2)
    assert len(refills) == a["ran"] == 4                   # new inputs for every checked step
    c = a["counts"]
    assert c["checked"] == c["sampled"] == 4 + 1 and c["failed"] == 0 and c["skipped"] == 0    # and the warm-up
    text = "\n".join(interpreted.table([], None, a, None, shape=BENCH_SHAPE, machine="CPU"))
    assert f"{a['counts']['checked']} sampled steps checked, 0 alarms" in text


def test_bench_alarms_share_their_steps_among_jobs_with_their_own_seeds(interpreted):
    """Jobs > 1: each job a loop in its own process on its own inputs (seed + j), the steps
    shared out, the counters summed (a gauge: the lowest)."""
    a = interpreted.alarms(BENCH_SHAPE, sampled=3, mode="eager", device="cpu", ring=2, seed=5, jobs=2)
    c = a["counts"]
    assert a["jobs"] == 2 and a["seeds"] == [5, 6] and a["ran"] == 3
    assert c["failed"] == 0 and c["skipped"] == 0 and c["rate"] == 1.0 and c["enabled"] == 1
    assert c["checked"] == c["sampled"] >= 3          # each job's warm-up step is sampled too
    text = "\n".join(interpreted.table([], None, a, None, shape=BENCH_SHAPE, machine="CPU"))
    assert "2 loops at once, input seeds 5, 6" in text and f"{c['checked']} sampled steps checked, 0 alarms" in text
    with pytest.raises(RuntimeError, match="2 of 2 alarm jobs failed"):
        interpreted.alarms(BENCH_SHAPE, sampled=2, mode="no-such-mode", device="cpu", jobs=2)
    with pytest.raises(ValueError, match="jobs must be"):
        interpreted.alarms(BENCH_SHAPE, sampled=2, device="cpu", jobs=0)


def test_in_turns_cancels_a_linear_drift_and_counts_a_sampled_steps_cost_in_full():
    from harness.bench import shadow as bench
    calls = []

    def timer(loop, fn, n, device):              # s/step: the host slows by 1 % a block; "on" costs 2 % more
        calls.append(fn)
        spike = 0.5 / n if fn == "on" and calls.count("on") == 3 else 0.0     # one sampled step: 0.5 s
        return (1.0 + 0.01 * len(calls)) * (1.02 if fn == "on" else 1.0) + spike
    t = bench.in_turns(None, "off", "on", steps=20, repeats=3, device="cpu", timer=timer)
    off, on = t.off, t.on
    n = 20 // bench.BLOCKS                       # steps a block
    blocks = 20 * 3 // n
    assert calls.count("on") == calls.count("off") == blocks and calls[:4] == ["off", "on", "on", "off"]
    assert on / off - 1 == pytest.approx(0.02 + 0.5 / (off * n * blocks), rel=1e-9)
    assert t.added_pct == pytest.approx((on / off - 1) * 100, rel=1e-12)


def test_in_turns_spread_is_two_standard_errors_of_the_block_differences():
    from harness.bench import shadow as bench
    diffs = [0.01, 0.03, 0.02, 0.04, 0.00, 0.02]           # on - off, block by block
    seq = []
    for i, dd in enumerate(diffs):
        seq += [("off", 1.0), ("on", 1.0 + dd)] if i % 2 == 0 else [("on", 1.0 + dd), ("off", 1.0)]
    it = iter(seq)

    def timer(loop, fn, n, device):
        side, v = next(it)
        assert side == fn
        return v
    t = bench.in_turns(None, "off", "on", steps=1, repeats=len(diffs), device="cpu", timer=timer)
    mean = sum(diffs) / 6
    se = (sum((x - mean) ** 2 for x in diffs) / 5 / 6) ** 0.5
    assert t.added_pct == pytest.approx(mean * 100) and t.spread_pct == pytest.approx(2 * se * 100)
    same = bench.in_turns(None, "a", "a", steps=1, repeats=4, device="cpu",
                          timer=lambda loop, fn, n, device: 2.0)
    assert same.added_pct == 0 and same.spread_pct == 0               # nothing added, no noise: 0 +- 0
    one = bench.in_turns(None, "a", "a", steps=1, repeats=1, device="cpu",
                         timer=lambda loop, fn, n, device: 2.0)
    assert one.spread_pct == float("inf")                             # one pair says nothing of the noise


def test_overhead_verdict_reads_the_spread():
    from harness.bench import shadow as bench

    def line(added, spread):
        row = {"mode": "eager", "checker": "process, reference on the host", "rate": 1 / 1000, "s_per_step": 1.0,
               "base_s": 1.0, "added_pct": added, "spread_pct": spread, "counts": {}}
        return [x for x in bench.table([row], None, None, None, shape=BENCH_SHAPE, machine="CPU")
                if x.startswith("* eager")][0]
    assert line(2.5, 1.0).endswith("(target <= 3 %: met, the target within the spread)")
    assert line(2.5, 0.2).endswith("(target <= 3 %: met)")
    assert line(5.0, 0.5).endswith("(target <= 3 %: NOT met)") and "+5.00 % ± 0.50 per step" in line(5.0, 0.5)
    assert line(3.5, 1.0).endswith("(target <= 3 %: NOT met, the target within the spread)")


def test_hook_cost_is_measured_without_the_device_and_is_not_zero():
    """The installed hook's own cost per eager step, on the CPU with ops that do nothing:
    positive beyond its spread (the step's calls through the wrappers' idle path), nothing
    sampled, and a raw step's time beside it."""
    from helpers import fresh_json
    # in a fresh interpreter: the stubs' signatures come with the kernels imported compiled,
    # which would keep this process's later tests from the interpreter
    r = fresh_json("import json; from harness.bench import shadow as b; "
                   "print(json.dumps(b.hook_cost(dict(layers=2, batch=4, context=64))))")
    assert r["sampled"] == 0 and r["raw_us"] > 0
    assert r["us"] > 2 * r["spread_us"] > 0, r         # beyond four standard errors of its noise


def test_by_parts_takes_the_sampled_steps_cost_from_the_row_that_sampled_most():
    from harness.bench import shadow as bench
    ck = "process, reference on the host"
    row = lambda rate, added, spread, sampled, checker=ck: {
        "mode": "eager", "checker": checker, "rate": rate, "s_per_step": 2e-3, "base_s": 2e-3, "added_pct": added,
        "spread_pct": spread, "steps": 6000, "counts": {"sampled": sampled}}
    rows = [row(bench.IDLE_RATE, 0.5, 1.0, 0), row(1 / 1000, 9.0, 8.0, 5), row(1 / 100, 11.0, 6.0, 60),
            row(1 / 100, 90.0, 6.0, 600, "thread, reference on the serving GPU")]
    p = bench.by_parts(rows, 10.0, ck)
    # the 1/100 row: 11 % of 2 ms over 6000 steps, less the hook's 10 us a step, over 60 samples
    sample = (0.11 * 2e-3 * 6000 - 10e-6 * 6000) / 60
    assert p["from_rate"] == 1 / 100 and p["sample_ms"] == pytest.approx(sample * 1e3)
    assert p["pct"] == pytest.approx((10e-6 + sample / 1000) / 2e-3 * 100)
    assert p["sample_lo_ms"] == pytest.approx((0.05 * 2e-3 * 6000 - 10e-6 * 6000) / 60 * 1e3)
    assert p["lo_pct"] < p["pct"] < p["hi_pct"]
    assert bench.by_parts(rows[:1], 10.0, ck) is None and bench.by_parts(rows, 10.0, "nobody") is None
    text = "\n".join(bench.table(rows, None, None, None, shape=BENCH_SHAPE, machine="CPU",
                                 hook={"us": 10.0, "spread_us": 1.0}))
    assert "own cost, nothing sampled, measured without the device" in text and "10.0 µs ± 1.0 a step" in text
    assert f"{ck}, at 1/1000 by parts: the hook's 10.0 µs + 1/1000 of a sampled step's {sample * 1e3:.1f} ms" in text
    assert "target <= 3 %: met)" in text.split("by parts")[1].splitlines()[0]


def test_bench_stopped_checker_and_overhead_rows(interpreted):
    k = interpreted.killed(BENCH_SHAPE, steps=8, mode="eager", device="cpu")
    assert k["served"] == 8 and k["stopped_at"] and k["lost"] == 0 and k["logged"] >= 2
    rows = interpreted.overhead(BENCH_SHAPE, steps=2, rates=(1 / 1000,), modes=("eager",), device="cpu", repeats=1,
                                checkers=(("thread", None), ("process", "cpu")))
    idle = interpreted.IDLE_RATE
    assert [(r["rate"], r["checker"]) for r in rows] == [(None, None), (None, interpreted.CONTROL),
                                                         (idle, "thread, reference on the serving GPU"),
                                                         (1 / 1000, "thread, reference on the serving GPU"),
                                                         (idle, "process, reference on the host"),
                                                         (1 / 1000, "process, reference on the host")]
    assert all(r["counts"]["sampled"] == 0 for r in rows if r["rate"] == idle)     # the hook's own cost
    assert all(r["base_s"] > 0 for r in rows)
    text = "\n".join(interpreted.table(rows, None, None, k, shape=BENCH_SHAPE, machine="CPU"))
    assert "eager, process, reference on the host, at 1/1000" in text and "(0 lost)" in text
    assert "| eager | process, reference on the host | none sampled |" in text
    assert f"| eager | {interpreted.CONTROL} | off |" in text and all(r["spread_pct"] >= 0 for r in rows[1:])


def test_bench_overhead_times_its_baseline_in_turns_with_the_shadow_unrecorded(interpreted):
    """A row's baseline timings run the same loop beside the installed shadow but through
    the ops found before install: at rate 1 only the shadow's own steps are sampled (its
    warm-up step and `steps` per timing), none of the baseline's."""
    rows = interpreted.overhead(BENCH_SHAPE, steps=2, rates=(1.0,), modes=("eager",), device="cpu", repeats=2,
                                checkers=(("thread", None),))
    c = rows[-1]["counts"]
    assert rows[-1]["rate"] == 1.0 and c["sampled"] + c["skipped"] == 1 + 2 * 2


def test_shadow_report_bad_input_is_one_line(tmp_path, capsys):
    assert cli.main(["shadow", "report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mxval: ") and "verdicts.jsonl" in err[0]
    assert cli.main(["shadow"]) == 2
    d = tmp_path / "torn"
    d.mkdir()
    (d / S.LOG).write_text('{"event": "verdict", "layer": 1, "step": 2, "row": "nonsense"}\n')
    assert cli.main(["shadow", "report", str(d), "--report-dir", str(tmp_path / "r")]) == 2
    assert "no row of metrics" in capsys.readouterr().err


def test_logged_non_finite_metrics_come_back_as_numbers():
    from harness.commands.shadow_cmd import _rows
    row = {"case": "x", "metrics": {"topk.a": float("inf"), "topk.b": float("nan"), "topk.c": 1.5}}
    entry = json.loads(json.dumps({"event": "verdict", "layer": 3, "step": 9, "row": S.jsonable(row)}))
    (back,), _ = _rows([entry])
    m = back["metrics"]
    assert m["topk.a"] == float("inf") and m["topk.b"] != m["topk.b"] and m["topk.c"] == 1.5
    assert back["case"] == "layer3_step9"


# --- graph captures, inputs outside the contract, the bench's loop ------------------------------

def test_no_checker_device_work_during_a_graph_capture(clean, monkeypatch):
    """CUDA's global capture mode fails on any other thread's device call: a capture begun
    through torch.cuda.CUDAGraph first waits for the checker's device work in flight, and the
    checker starts none until the capture ends (the copies out of the item are device work)."""
    fake_graphs(monkeypatch, hook)
    sh = S.Shadow(clean, 1.0, ring=4, check=lambda r, n, d: ({"status": "pass", "ok": True, "reason": "",
                                                                 "metrics": {}}, []))
    install([], quiet=True, shadow=sh)
    spans, entered, hold = [], threading.Event(), [0.3]

    def host(item):
        t0 = time.perf_counter()
        entered.set()
        time.sleep(hold[0])
        spans.append((t0, time.perf_counter()))
        return {}, "cpu"
    monkeypatch.setattr(sh, "_host", host)
    x = torch.zeros(1)
    assert sh.submit(0, 0, {"topk": ({"x": x}, {}, {"y": x})})
    assert entered.wait(10)
    g = torch.cuda.CUDAGraph()
    g.capture_begin()                                   # waits for the item's copies to end
    began = time.perf_counter()
    assert len(spans) == 1 and spans[0][1] <= began
    hold[0] = 0.0
    assert sh.submit(0, 1, {"topk": ({"x": x}, {}, {"y": x})})
    time.sleep(0.3)
    assert len(spans) == 1                              # nothing started while capturing
    g.capture_end()
    ended = time.perf_counter()
    assert sh.join(10) and len(spans) == 2 and spans[1][0] >= ended
    assert sh.snapshot()["checked"] == 2 and sh.enabled
    uninstall()


def test_inputs_outside_the_contract_are_a_failing_verdict_not_a_shadow_failure(clean):
    """A sampled step whose recorded inputs the ops' checks reject (a block table past the
    pool: a serving bug, or a loop run past its pool) is flagged, with its dump kept; the
    shadow stays on."""
    from harness.io.dumps import DumpError

    def refuses(records, name, device):
        raise DumpError(f"{name}: compress_pool: block_table (window blocks): value 158 out of range [0, 145)")
    sh = S.Shadow(clean, 1.0, ring=2, check=refuses)
    layer = make_layer(2)
    calls = {op: (r.inputs, r.scalars, r.outputs) for op, r in layer.items()}
    assert sh.submit(0, 7, calls) and sh.join(20)
    c = sh.snapshot()
    assert c["checked"] == 1 and c["failed"] == 1 and sh.enabled
    (v,) = _verdicts(clean)
    assert v["status"] == "error" and not v["ok"] and "out of range" in v["reason"] and os.path.exists(v["dump"])
    sh.close()
    # the log renders: the row is an error row, and the report fails as `mxval diff` would
    out = clean.parent / "report"
    assert cli.main(["shadow", "report", str(clean), "--report-dir", str(out), "-q"]) == 1
    rep = json.loads((out / "report.json").read_text())
    assert [(r["case"], r["status"]) for r in rep["cases"]] == [("layer0_step7", "error")]


def test_bench_loop_stays_in_its_pool_over_many_timings():
    """The decode loop is rewound by the steps it ran, not per timing: timed three times
    for 1,000 steps, its positions never pass REWIND steps from the start."""
    from harness.bench import shadow as bench

    class Loop:
        positions = torch.zeros(2, dtype=torch.long)
        start, taken = torch.zeros(2, dtype=torch.long), 0
    loop, seen = Loop(), []

    def run():
        loop.positions += 1
        seen.append(int(loop.positions.max()))
    for _ in range(3):
        bench._time(loop, run, 1000, "cpu")
    assert max(seen) <= bench.REWIND and len(seen) == 3000


def test_a_checker_stopped_during_a_capture_drops_its_item(clean):
    """The checker waiting for a capture to end, then stopped: its item is counted as skipped
    (as queued items are), no device work starts, nothing is logged as checked."""
    sh = S.Shadow(clean, 1.0, ring=2, check=lambda r, n, d: ({"status": "pass", "ok": True, "reason": "",
                                                                 "metrics": {}}, []))
    hosts = []
    sh._host = lambda item: hosts.append(item) or ({}, "cpu")
    sh.capture_begins()
    x = torch.zeros(1)
    assert sh.submit(0, 0, {"topk": ({"x": x}, {}, {"y": x})})
    time.sleep(0.2)                                    # the checker holds the item, waiting
    sh.stop()
    c = sh.snapshot()
    assert hosts == [] and c["checked"] == 0 and c["skipped"] == 1
    sh.capture_ends()
    sh.close()


def test_the_worker_runs_at_the_lowest_cpu_priority_with_few_threads(clean, monkeypatch):
    # the worker competes with the serving thread for the host's cores only at nice 19, with
    # the threads asked for (torch's default is one per core)
    monkeypatch.setenv(S.ENV_RATE, "0.5")
    monkeypatch.setenv(S.ENV_DIR, str(clean))
    monkeypatch.setenv(S.ENV_THREADS, "3")
    monkeypatch.delenv(S.ENV_NICE)                  # the default (the tests' conftest sets 0)
    for want in (S.WORKER_NICE, 7):
        sh = S.from_env()
        try:
            assert sh.ready.wait(120) and sh.checker == "process"
            assert sh.worker_info == {"nice": min(19, os.nice(0) + want), "threads": 3}
        finally:
            sh.stop()
        monkeypatch.setenv(S.ENV_NICE, "7")
    monkeypatch.setenv(S.ENV_CHECKER, "thread")            # no worker: the values' check alone
    for name, low, top in ((S.ENV_THREADS, "1", "4096"), (S.ENV_NICE, "0", "19")):
        for good in (low, top):                           # both ends of the documented range
            monkeypatch.setenv(name, good)
            S.from_env().stop()
        for bad in (str(int(low) - 1), str(int(top) + 1)):
            monkeypatch.setenv(name, bad)
            with pytest.raises(env.EnvError, match=name):
                S.from_env()
        monkeypatch.setenv(name, "3")


def test_a_spawned_process_does_not_run_the_parent_script_again(tmp_path):
    """`shadow.spawned` (the worker, the bench's alarm jobs) from a script without a
    `__name__` guard: the child does not import the script as its `__main__`."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text("import time\nfrom harness.capture import shadow\nprint('parent runs', flush=True)\n"
                      "p = shadow.spawned(time.sleep, (0,), name='child')\np.join(60)\nprint('exit', p.exitcode)\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=os.getcwd(),
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("parent runs") == 1 and "exit 0" in p.stdout, p.stdout + p.stderr[-2000:]


def test_the_worker_does_not_run_the_serving_script_again(tmp_path):
    """A spawned child imports its parent's __main__; a serving script without a
    `__name__` guard must not start serving a second time inside the worker."""
    import subprocess
    import sys
    script = tmp_path / "serve.py"
    script.write_text("import sys\nprint('serving starts', flush=True)\n"
                      "from harness.capture import shadow as S\n"
                      "sh = S.Shadow(sys.argv[1], 0.5, checker='process')\n"
                      "assert sh.ready.wait(60) and sh.worker.is_alive()\n"
                      "sh.close()\nprint('serving ends', flush=True)\n")
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "shadow")], capture_output=True, text=True,
                       timeout=120, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("serving starts") == 1 and p.stdout.count("serving ends") == 1, p.stdout


def test_bench_alarms_under_graphs_check_every_step(interpreted, monkeypatch):
    """The alarm loop under (host) graphs: the warm-up's items are checked before the loop
    starts, so no sampled step finds the queue full, the rate never halves, and every
    replay is checked (a halved rate silently checks half the steps)."""
    from harness.bench.capture import DecodeLoop
    fake_graphs(monkeypatch, hook)

    def capture_on_the_host(self):              # the loop's warm-up step, then one captured step
        self.step()
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        self.step()
        g.capture_end()
        return g
    monkeypatch.setattr(DecodeLoop, "capture", capture_on_the_host)
    a = interpreted.alarms(dict(BENCH_SHAPE, layers=2), sampled=8, mode="graph", device="cpu", ring=4,
                           checker="thread")
    c = a["counts"]
    # the host graph replays only the recording copies (its kernels ran at capture), so the
    # verdicts themselves say nothing here: the counts are what this checks
    assert c["skipped"] == 0 and c["rate"] == 1.0 and c["sampled"] == c["checked"] == 8 + 2, c


def test_an_idle_checker_waits_without_waking_and_a_stop_wakes_it(clean):
    """The checker thread waits on its queue, looking at its stop flag once a second (each
    look takes the serving process's GIL); a stop wakes it at once."""
    sh = S.Shadow(clean, 0.5, checker="thread")
    assert sh.ready.wait(20)
    gets = []
    real = sh.items.get
    sh.items.get = lambda *a, **k: (gets.append(time.perf_counter()), real(*a, **k))[1]
    end = time.perf_counter() + 5
    while not gets and time.perf_counter() < end:     # the checker's next wait has begun
        time.sleep(0.005)
    assert gets
    time.sleep(0.5)
    assert len(gets) == 1                              # no look at the flag for half a second
    t = time.perf_counter()
    sh.stop()                                          # in the middle of a wait
    assert time.perf_counter() - t < 0.25 and not sh.thread.is_alive()
    assert sh.items.unfinished_tasks == 0
    sh.close()


def test_a_worker_that_never_starts_switches_the_shadow_off_and_releases_its_waiters(clean, monkeypatch):
    monkeypatch.setattr(S, "WORKER_START_S", 0.01)             # no worker is ready that fast
    sh = S.Shadow(clean, 0.5, checker="process")
    assert sh.ready.wait(20)                                    # a waiter is not left hanging
    sh.thread.join(30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not sh.enabled and "did not start" in [e for e in _log(clean) if e["event"] == "off"][0]["why"]
    sh.worker.join(10)
    assert not sh.worker.is_alive()                             # closed (or killed) with the checker
    sh.close()


def test_worker_records_travel_as_one_reused_shared_segment_and_come_back_exact():
    """Segment/_Attached: every field (any dtype, empty ones too) rebuilt on the worker's
    side is the recorded bytes; the pipe carries only names and offsets (a few hundred
    bytes for megabytes of fields); an item that fits reuses the segment, a larger one
    gets a new segment and the old one is gone."""
    import pickle

    g = torch.Generator().manual_seed(0)
    ins = {"k": torch.randn(300, 128, generator=g).to(torch.bfloat16),
           "positions": torch.randint(0, 9000, (300,), generator=g),
           "cos_sin_cache": torch.randn(9000, 64, generator=g),
           "norm_weight": torch.randn(0),                                  # empty: no bytes
           "slot_mapping": torch.randint(-1, 50, (300,), generator=g, dtype=torch.int32),
           "kv_cache": torch.randint(0, 256, (64, 68 * 8), generator=g, dtype=torch.uint8)}
    outs = {"kv_cache": torch.randint(0, 256, (64, 68 * 8), generator=g, dtype=torch.uint8),
            "mask": torch.rand(33, generator=g) > 0.5}
    calls = {"k_norm_rope_mxfp4_cache": (ins, {"norm_eps": 1e-6}, outs)}
    seg, att = S.Segment(), S._Attached()
    try:
        host = seg.allocator(calls)
        rec = {op: OpRecord(op, sc, {k: host(tuple(v.shape), v.dtype) for k, v in i.items()},
                              {k: host(tuple(v.shape), v.dtype) for k, v in o.items()})
               for op, (i, sc, o) in calls.items()}
        for op, (i, _, o) in calls.items():
            for d, src in ((rec[op].inputs, i), (rec[op].outputs, o)):
                for k, v in d.items():
                    v.copy_(src[k])
        msg = seg.skeleton(rec)
        assert len(pickle.dumps(msg)) < 2048
        back = att.records(msg)["k_norm_rope_mxfp4_cache"]
        for d, src in ((back.inputs, ins), (back.outputs, outs)):
            assert d.keys() == src.keys()
            for k, v in src.items():
                assert d[k].dtype == v.dtype and d[k].shape == v.shape and torch.equal(d[k], v), k
        name = seg.shm.name
        seg.allocator(calls)
        assert seg.shm.name == name                                      # fits: reused
        big = {"topk": ({"logits": torch.zeros(4096, 1024)}, {}, {})}
        seg.allocator(big)
        assert seg.shm.name != name and not os.path.exists(f"/dev/shm/{name.lstrip('/')}")
        del back, d
    finally:
        att.close()
        seg.close()


@pytest.mark.parametrize("bad, line", [
    ({S.ENV_RATE: "2"}, "mxval: MXVAL_SHADOW='2': "),
    ({S.ENV_RATE: "0.01", S.ENV_NICE: "99"}, "mxval: MXVAL_SHADOW_NICE='99': "),
    ({S.ENV_RATE: "0.01", S.ENV_CHECKER: "bogus"}, "mxval: MXVAL_SHADOW_CHECKER='bogus': "),
    ({"MXVAL_CAPTURE_LAYERS": "bogus"}, "mxval: MXVAL_CAPTURE_LAYERS"),
    ({"MXVAL_CAPTURE_DIR": "/proc/mxval/dumps"}, "mxval: MXVAL_CAPTURE_DIR='/proc/mxval/dumps': cannot make"),
    ({S.ENV_RATE: "0.01", S.ENV_DIR: "/proc/mxval/shadow"}, "mxval: MXVAL_SHADOW_DIR='/proc/mxval/shadow': cannot"),
])
def test_a_bad_variable_at_start_up_is_one_line_and_exit_2_before_serving(tmp_path, bad, line):
    """boot() from a sitecustomize.py, as the serving recipe installs it: the process ends
    with status 2 and one `mxval:` line naming the variable, no traceback, and the server's
    own code (here a print) never runs."""
    import subprocess
    import sys
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import harness.capture; harness.capture.boot()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    e = {k: v for k, v in os.environ.items() if not k.startswith("MXVAL_")}
    e.update({"PYTHONPATH": os.pathsep.join([str(site), root]), S.ENV_DIR: str(tmp_path / "shadow"),
              "MXVAL_CAPTURE_DIR": str(tmp_path / "dumps"), **bad})
    p = subprocess.run([sys.executable, "-c", "print('serving')"], env=e, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "serving" not in p.stdout, (p.returncode, p.stdout, p.stderr)
    assert len(lines) == 1 and lines[0].startswith(line) and "Traceback" not in p.stderr, p.stderr
    e.pop(next(iter(bad)))                              # the first variable put right
    e.pop(S.ENV_RATE, None)
    p = subprocess.run([sys.executable, "-c", "print('serving')"], env=e, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "serving", p.stderr


def test_uninstall_disarms_a_recording_graph_armed_for_a_sampled_replay(clean, monkeypatch):
    """Uninstalled right after a sampled replay (its copies switched on, their flag set), a
    recording graph replayed afterwards launches none of its copies and copies nothing."""
    g, step, long = _node_graph(monkeypatch, clean, 1.0, FakeNodes())
    rec = getattr(g, hook.GRAPH_ATTR)
    step()
    assert not g.disabled and rec.flag_on                  # armed for the sampled replay just run
    uninstall()
    g.replay()
    assert g.replays[-1] == frozenset(rec.nodes) and int(rec.flag) == 0


TRACKED = r"""
import sys, tempfile
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from helpers import make_layer
from harness.capture.shadow import Shadow
small, big = make_layer(4, heads=32), make_layer(5, heads=32, page_size=128)
calls = lambda layer: {op: (dict(r.inputs), dict(r.scalars), dict(r.outputs)) for op, r in layer.items()}
with tempfile.TemporaryDirectory() as d:
    sh = Shadow(d, 1.0, ring=8, checker="process", device="cpu")
    for step, layer in enumerate((small, small, big, small)):   # reused, outgrown, reused
        sh.submit(0, step, calls(layer))
        assert sh.join(120)
    assert sh.snapshot()["checked"] == 4, sh.snapshot()
    sh.close()
print("done")
"""


def test_the_worker_segment_leaves_no_resource_tracker_noise(tmp_path):
    """Items through the worker's shared segment (reused, then outgrown and replaced), then
    the shadow closed, in a process of its own: the resource tracker, which the worker
    shares, says nothing at exit (no KeyError, no leaked segment)."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    e = {k: v for k, v in os.environ.items() if not k.startswith("MXVAL_")}
    e["MXVAL_SHADOW_NICE"] = "0"
    p = subprocess.run([sys.executable, "-c", TRACKED, here, os.path.dirname(here)], env=e, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "done", p.stderr[-2000:]
    assert not any(w in p.stderr for w in ("KeyError", "Traceback", "leaked")), p.stderr[-2000:]
