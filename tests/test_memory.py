"""GPU memory per case: the tensors' bytes of a case, the peak (None on the CPU), the
ratio in every report format, and the per-process cap from the environment."""
import json
import os

import pytest
import torch
from helpers import needs_gpu

from harness.errors import UsageError
from harness.io import report
from harness.run import memory
from harness.run.cases import Catalog
from harness.run.pipeline import Run
from harness.run.record import row
from harness.run.runner import run_case


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10, 4)                                  # 160 bytes
    b = torch.zeros(3, dtype=torch.uint8)
    assert memory.tensor_bytes(a, a[1:], {"x": [a.view(40), (b,)]}) == 160 + 3
    assert memory.tensor_bytes() == 0 and memory.tensor_bytes(None, 3, "s") == 0


def test_a_storage_freed_and_another_at_its_address_count_twice():
    """Over a span of time, a new storage where a freed one was is another tensor of the
    span; a live one seen again through a view is not."""
    s = memory.StorageSet()
    a = torch.zeros(1000)
    s.add(a, {"v": a[10:]})
    assert s.bytes() == 4000
    refs = s._at.pop(next(iter(s._at)))                    # a's entry, soon dead
    del a
    b = torch.zeros(1000)
    s._at[(str(b.device), b.untyped_storage().data_ptr())] = refs      # as if b took a's address
    s.add(b)
    assert s.bytes() == 8000
    s.add(b.view(10, 100))
    assert s.bytes() == 8000


def test_a_cpu_case_has_tensor_bytes_and_no_peak():
    r = run_case(Catalog().case("smoke-chunks-shuffled"), "reference")
    assert r["outcome"] == "ok", r["reason"]
    assert r["gpu_peak_bytes"] is None
    assert r["tensor_bytes"] > 0


def _rows(peak):
    out = []
    for name, p in (("big", peak), ("small", None)):
        r = row(name, "s", "b", gpu_peak_bytes=p, tensor_bytes=2**30)
        r.update(status="pass", ok=True, violations=[])
        out.append(r)
    return out


def test_reports_show_the_peak_and_its_ratio_only_when_measured(tmp_path):
    meta = {"command": "validate", "suite": "s", "backend": "b", "machine": "m", "seconds": 1.0}
    df = report.frame(_rows(3 * 2**30))
    md, html = report.markdown(df, meta), report.html(df, meta)
    assert report.MEMORY_HEAD in md and "3.00 GiB (3.0×)" in md and "3.00 GiB (3.0×)" in html
    assert "at most 3.0× the case's tensors" in md
    s = report.summary(df)
    assert s["gpu_peak_bytes_max"] == 3 * 2**30 and s["gpu_peak_ratio_max"] == 3.0
    report.write_all(df, meta, tmp_path)
    cases = json.loads((tmp_path / "report.json").read_text())["cases"]
    assert cases[0]["gpu_peak_bytes"] == 3 * 2**30 and cases[1]["gpu_peak_bytes"] is None
    cpu = report.frame(_rows(None))
    assert report.MEMORY_HEAD not in report.markdown(cpu, meta) and "gpu_peak_bytes_max" not in report.summary(cpu)


@pytest.mark.parametrize("raw", ["0", "1.5", "half", "-0.2"])
def test_a_bad_memory_cap_is_a_usage_error(monkeypatch, raw):
    monkeypatch.setenv(memory.FRACTION_ENV, raw)
    with pytest.raises(UsageError, match=memory.FRACTION_ENV):
        Run("validate")


def test_the_memory_cap_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(memory.FRACTION_ENV, "0.25")
    assert memory.fraction() == 0.25
    monkeypatch.delenv(memory.FRACTION_ENV)
    assert memory.fraction() is None


def test_peak_is_none_on_the_cpu():
    p = memory.Peak("cpu").start()
    torch.zeros(1000)
    assert p.stop() is None and p.bytes is None and p.own() is None


@pytest.mark.gpu
@needs_gpu
def test_peak_on_the_gpu_counts_what_the_block_allocated():
    p = memory.Peak("cuda").start()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del x
    assert p.stop() >= 64 << 20 and p.bytes >= 64 << 20


def test_pages_compared_in_chunks_give_the_same_report(monkeypatch):
    """diff_pages walks a pool in CHUNK_BYTES pieces (no pool-sized mask on a GiB pool): chunk
    edges must change no count and no finding, with writes inside and outside owned bytes."""
    from helpers import make_layer

    from harness.diff import pages
    from harness.diff.ops import writer_slots
    r = make_layer(1)["k_norm_rope_mxfp4_cache"]
    slots = writer_slots(r.inputs, r.scalars)
    act = r.outputs["kv_cache"].clone()
    flat = act.view(-1)
    gen = torch.Generator().manual_seed(5)
    flat[torch.randperm(flat.numel(), generator=gen)[:300]] ^= 0x5A     # owned and not owned
    kw = dict(page_size=64, head_dim=128, shuffle=[32, 16, 2], written_slots=slots)
    whole = pages.diff_pages(act, r.outputs["kv_cache"], r.inputs["kv_cache"], **kw)
    monkeypatch.setattr(pages, "CHUNK_BYTES", 1000)
    assert flat.numel() > 10 * pages.CHUNK_BYTES
    chunked = pages.diff_pages(act, r.outputs["kv_cache"], r.inputs["kv_cache"], **kw)
    assert whole.metrics == chunked.metrics and whole.findings == chunked.findings
    assert whole.metrics["page_bytes_outside_owned_changed"] > 0 and whole.metrics["page_value_bytes_mismatched"] > 0


def test_the_mismatch_map_in_chunks_is_the_whole_map(monkeypatch):
    from harness.run import runner
    from harness.run.inputs import build
    inp = build(Catalog().case("smoke-chunks-shuffled"))
    exp = inp.kv_cache
    act = exp.clone()
    gen = torch.Generator().manual_seed(3)
    act.view(-1)[torch.randperm(act.numel(), generator=gen)[:500]] ^= 0x11
    whole = runner._mismatch_map(None, act, exp, inp.geo, "k")
    monkeypatch.setattr(runner, "MAP_CHUNK_BYTES", 1)                # one page at a time
    assert runner._mismatch_map(None, act, exp, inp.geo, "k") == whole and len(whole) > 100
    monkeypatch.setattr(runner, "MAX_MAP_POINTS", 7)
    assert runner._mismatch_map(None, act, exp, inp.geo, "k") == whole[:7]


class _FakeAllocator:
    """torch.cuda's allocator counters, played back: 100 bytes live at the start, a peak of 1100."""

    def __init__(self, monkeypatch):
        self.fractions = []
        for name, fn in {"is_available": lambda: True, "synchronize": lambda d=None: None,
                         "reset_peak_memory_stats": lambda d=None: None, "memory_allocated": lambda d=None: 100,
                         "max_memory_allocated": lambda d=None: 1100, "current_device": lambda: 0,
                         "set_per_process_memory_fraction": lambda f, i=None: self.fractions.append((f, i))}.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        monkeypatch.setattr(memory, "_applied", set())


def test_peak_is_what_the_block_allocated_above_its_start(monkeypatch):
    """The GPU path on any machine: the allocator's counters are played back."""
    fake = _FakeAllocator(monkeypatch)
    monkeypatch.setenv(memory.FRACTION_ENV, "0.2")
    memory.apply_fraction("cpu")                         # the CPU: nothing to cap
    assert fake.fractions == []
    p = memory.Peak("cuda:0").start()
    assert p.stop() == 1000 and p.bytes == 1000
    assert memory.Peak("cuda").start().stop() == 1000
    assert fake.fractions == [(0.2, 0)]                  # the cap is set once per device


def test_run_case_records_the_peak(monkeypatch):
    class Peak(memory.Peak):
        def stop(self):
            self.bytes = 12345
            return self.bytes
    monkeypatch.setattr(memory, "Peak", Peak)
    r = run_case(Catalog().case("smoke-chunks-shuffled"), "reference")
    assert r["gpu_peak_bytes"] == 12345 and r["tensor_bytes"] > 0
    r.update(status="pass", ok=True, violations=[])
    df = report.frame([r])
    assert report.memory_ratio(df.iloc[0]) == pytest.approx(12345 / r["tensor_bytes"])


def test_prefetched_inputs_give_the_same_rows():
    """One case at a time on a GPU, the next case's inputs are built in a thread meanwhile:
    the rows must not change (forced on here, on the CPU)."""
    from harness.run.runner import run_cases
    cases = Catalog().suite_cases("smoke")[:4]
    plain = run_cases(cases, "reference", prefetch=False)
    fetched = run_cases(cases, "reference", prefetch=True)
    for a, b in zip(plain, fetched):
        assert a["outcome"] == b["outcome"] == "ok", (a["reason"], b["reason"])
        assert a["metrics"] == b["metrics"] and a["findings"] == b["findings"]
        assert a["tensor_bytes"] == b["tensor_bytes"]


def test_only_cpu_filled_pools_are_prebuilt():
    from harness.run.inputs import filled_on_device
    from harness.run.runner import _prebuild
    from optimized import get_backend
    cat = Catalog()
    big, small = cat.case("full-pool-2gib"), cat.case("smoke-rowend-k")
    assert filled_on_device(big) and not filled_on_device(small)
    ref = get_backend("reference")
    assert _prebuild(big, ref) is None                     # its pool's bytes come from the device
    assert _prebuild(small, ref) is not None


def _scores(rows=37, width=700, k=64, seed=11, ties=True):
    """fp64 scores with ties (unless not `ties`), zeros, NaN/inf, short and empty rows; fp32
    logits off by a few ulps in some rows and wrong in one; a top-k with every kind of fault
    in a few rows."""
    import math
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(rows, width, generator=g, dtype=torch.float64) * 4
    e[0, :200] = 0.0
    if ties:
        e[5, 1::3] = e[5, 0]
    e[6, 7] = float("-inf")
    ends = torch.randint(0, width + 1, (rows,), generator=g)
    ends[:3] = torch.tensor([width, 0, k // 2])
    ends[11:14] = width
    a = e.float()
    a[9, :50] += 0.5
    a[10, 3] = float("nan")
    clean = a.clone()
    for r in range(rows):
        clean[r, int(ends[r]):] = -math.inf
    clean[4, -1] = 1.0
    masked = torch.where(torch.arange(width)[None] < ends[:, None], e, -math.inf)
    idx = torch.topk(masked, k, 1).indices
    idx = torch.where(torch.arange(k)[None] < torch.minimum(ends, torch.tensor(k))[:, None], idx, -1)
    idx[ends <= k] = torch.where(torch.arange(k)[None] < ends[ends <= k, None], torch.arange(k)[None], -1)
    idx[11, 0] = idx[11, 1]                       # duplicate
    idx[12, -1] = int(ends[12]) + 1 if ends[12] < width - 1 else -2      # out of range
    idx[13, 5] = int(e[13].argmin())         # below the tie rule
    idx[2, 0], idx[2, 1] = idx[2, 1], idx[2, 0]   # a short row out of order
    return a, e, clean, ends, idx.int(), k


def test_scores_compared_in_row_blocks_give_the_same_reports(monkeypatch):
    """diff_logits, diff_topk and the logit-error plot walk the rows a block at a time (no
    buffer-sized mask, no host copy of a 2^20-wide buffer): block edges must change no count,
    no finding and no plotted value, down to a block of one row."""
    from harness.diff import scores
    from harness.run import runner
    a, e, clean, ends, idx, k = _scores()

    def reports():
        lg = [scores.diff_logits(x, e, ends, clean=c) for x, c in ((a, False), (clean, True))]
        tk = [scores.diff_topk(idx, e, ends, k, tol=t) for t in (None, 0.25)]
        return ([(r.metrics, r.findings, r.notes) for r in lg],
                [(r.metrics, r.findings, r.notes, scores.recall_points(r.rows)) for r in tk],
                runner._logit_errors(a, e, ends), runner._logit_errors(a[:, :90], e[:, :90], ends.clamp(max=90)))
    whole = reports()
    lg, tk, errs, few = whole
    assert lg[0][0]["logits_nonfinite"] > 0 and lg[0][0]["logits_rows_differing"] > 0
    assert 0 < len(few) < 4000                                      # every finite error, not a subsample
    assert lg[1][0]["logits_inf_pattern_mismatch"] > 0
    assert {"duplicates", "out_of_range", "below_threshold", "padding"} <= {f["class"] for f in tk[0][1]}
    assert len(errs) == 4000
    for chunk in (8 * 700 * 3, 8 * 700, 1):                        # three rows, one row, one row (floor)
        monkeypatch.setattr(scores, "CHUNK_BYTES", chunk)
        assert len(scores.row_blocks(37, 700)) == (13 if chunk > 8 * 700 else 37)
        got = reports()
        assert repr(got) == repr(whole)


def test_stage_seconds_are_recorded_only_when_asked(monkeypatch):
    from harness.run import stagetime
    case = Catalog().case("smoke-rowend-k")
    monkeypatch.delenv(stagetime.ENV, raising=False)
    assert "stage_seconds" not in run_case(case, "reference")["details"]
    monkeypatch.setenv(stagetime.ENV, "1")
    r = run_case(case, "reference")
    st = r["details"]["stage_seconds"]
    assert {"inputs", "reference", "backend", "diff", "row"} <= set(st)
    assert sum(st.values()) <= r["seconds"] + 0.01 and all(v >= 0 for v in st.values())


@pytest.mark.gpu
@needs_gpu
def test_the_part_holding_the_peak_is_named():
    from harness.run.stagetime import StageClock
    torch.cuda.reset_peak_memory_stats()     # as a case's Peak.start does: earlier highs are not this clock's
    clock = StageClock("cuda", on=True)
    with clock("big"):
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del x
    with clock("small"):                     # under the high so far: no new high, no entry
        y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        del y
    assert set(clock.peaks) == {"big"} and clock.peaks["big"] >= 64 << 20


def test_a_nested_part_is_charged_to_itself_only(monkeypatch):
    from types import SimpleNamespace

    from harness.run import stagetime
    ticks = iter([0.0, 1.0, 4.0, 4.5])            # outer starts, inner starts, inner ends, outer ends
    monkeypatch.setattr(stagetime, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    clock = stagetime.StageClock("cpu", on=True)
    with clock("outer"):
        with clock("inner"):
            pass
    assert clock.seconds == {"inner": 3.0, "outer": 1.5}      # outer holds none of inner's 3 s


def test_jobs_on_a_gpu_fit_the_memory_shares(monkeypatch):
    from harness.run import pipeline, runner
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(runner, "cpus", lambda: 16)
    monkeypatch.delenv(memory.FRACTION_ENV, raising=False)
    assert pipeline.cap_jobs(4, 37, "cuda")[0] == 4                       # workers share the GPU (small cases)
    assert pipeline.cap_jobs(12, 37, "cuda") == (8, {"requested": 12, "used": 8, "cap": "8 worker(s): half the CPUs"})
    assert pipeline.cap_jobs("auto", 37, "cuda")[0] == pipeline.AUTO_GPU_WORKERS
    assert pipeline.cap_jobs("auto", 3, "cuda")[0] == 3
    assert pipeline.cap_jobs("auto", 37, "cpu")[0] == 1                   # a CPU run stays in this process
    monkeypatch.setenv(memory.FRACTION_ENV, "0.3")
    jobs, info = pipeline.cap_jobs(4, 37, "cuda")
    assert jobs == 3 and "0.3" in info["cap"]                            # three 30 % shares fit
    assert pipeline.cap_jobs("auto", 37, "cuda")[0] == 1                  # a share: processes side by side
    monkeypatch.setenv(memory.FRACTION_ENV, "0.5")
    assert pipeline.cap_jobs(2, 37, "cuda")[0] == 2


def test_repeat_bytes_compared_in_blocks_name_the_same_first_byte(monkeypatch):
    """A repeat whose bytes changed: counted and located a block at a time, the same count
    and first byte as over the whole valid region (here computed whole, by hand)."""
    from types import SimpleNamespace

    from harness.diff import scores
    from harness.run import runner
    g = torch.Generator().manual_seed(2)
    a = torch.randn(9, 300, generator=g)
    ends = torch.tensor([300, 0, 17, 299, 5, 300, 1, 250, 64])
    b = a.clone()
    b[3, 298] += 1.0
    b[7, 200:240] *= 3.0
    b[1, 5] = 7.0                                   # past row 1's end (0): not compared
    valid = torch.arange(300)[None] < ends[:, None]
    x, y = a[valid].view(torch.uint8), b[valid].view(torch.uint8)
    diff = (x != y).nonzero().flatten()
    want = (f"{diff.numel()} of {x.numel()} bytes changed, first at byte {int(diff[0])}: "
            f"0x{int(x[diff[0]]):02x} in run 1, 0x{int(y[diff[0]]):02x} in run 2")

    def where(**scalars):
        fake = SimpleNamespace(nondeterministic=[])
        runner.ChainRun._same_bytes(fake, "paged_mxfp4_mqa_logits", 0, 2, {"logits": a}, {"logits": b},
                                    {"row_ends": ends}, scalars)
        return [f["where"].split(": ", 1)[1] for f in fake.nondeterministic]
    assert where() == [want]
    for chunk in (300 * 4 * 2, 1):
        monkeypatch.setattr(scores, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(runner, "MAP_CHUNK_BYTES", 7)
        assert where() == [want]
        whole = (a.view(torch.uint8) != b.view(torch.uint8)).flatten().nonzero().flatten()
        assert where(clean_logits=True) == [f"{whole.numel()} of {a.numel() * 4} bytes changed, first at byte "
                                            f"{int(whole[0])}: 0x{int(a.view(torch.uint8).flatten()[whole[0]]):02x} "
                                            f"in run 1, 0x{int(b.view(torch.uint8).flatten()[whole[0]]):02x} in run 2"]


@pytest.mark.gpu
@needs_gpu
def test_scores_diffed_on_the_gpu_match_the_cpu():
    """The same reports where the tensors live: every count, finding and plotted value; the
    fp64 sums of logits_diff to within their last bits (another device sums in another order).
    No tied scores: which of them is "the reference's own set" is torch.topk's choice on each
    device (reference/topk.py leaves ties open)."""
    from harness.diff import scores
    from harness.run import runner
    a, e, clean, ends, idx, k = _scores(ties=False)

    def reports(dev):
        lg = [scores.diff_logits(x.to(dev), e.to(dev), ends.to(dev), clean=c) for x, c in ((a, False), (clean, True))]
        tk = scores.diff_topk(idx.to(dev), e.to(dev), ends.to(dev), k)
        return lg, tk, runner._logit_errors(a.to(dev), e.to(dev), ends.to(dev))
    (lc, tc, ec), (lg, tg, eg) = reports("cpu"), reports("cuda")
    sums = ("logits_diff", "topk_mass_kept_min")              # fp64 sums (and exp) in the device's order

    def exact(m):
        return {k: v for k, v in m.items() if k not in sums}

    def no_sums(fs):
        return [{k: v for k, v in f.items() if k != "row_diff"} for f in fs]
    for c, g in [*zip(lc, lg), (tc, tg)]:
        assert exact(c.metrics) == exact(g.metrics) and repr(no_sums(c.findings)) == repr(no_sums(g.findings))
        for k in sums:
            assert g.metrics.get(k, 0.0) == pytest.approx(c.metrics.get(k, 0.0), rel=1e-12)
        assert [f.get("row_diff", 0.0) for f in g.findings] == pytest.approx([f.get("row_diff", 0.0) for f in c.findings],
                                                                        rel=1e-9)
    pc, pg = scores.recall_points(tc.rows), scores.recall_points(tg.rows)
    assert [p[:3] for p in pc] == [p[:3] for p in pg] and [p[3] for p in pg] == pytest.approx([p[3] for p in pc])
    assert max(abs(x - y) for x, y in zip(ec, eg)) <= 0.001 and len(ec) == len(eg)


@pytest.mark.gpu
@needs_gpu
def test_the_peak_leaves_out_what_outlives_the_block():
    keep = []
    p = memory.Peak("cuda").start()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")          # the block's own, released
    keep.append(torch.empty(32 << 20, dtype=torch.uint8, device="cuda"))  # a cache that stays
    del x
    p.stop()
    assert p.bytes >= 96 << 20
    assert p.own() == p.bytes - (32 << 20) and p.kept == 32 << 20
    assert memory.tensor_bytes(torch.empty(3, device="cuda")) == memory.BLOCK


@pytest.mark.parametrize("value", ["abc", "yes", "2"])
def test_a_bad_stage_times_switch_is_one_line(value, tmp_path):
    import subprocess
    import sys
    env = dict(os.environ, MXVAL_STAGE_TIMES=value)
    r = subprocess.run([sys.executable, "-m", "harness", "validate", "--case", "smoke-edge-values", "--backend",
                        "reference", "--report-dir", str(tmp_path / "r"), "--force"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2 and r.stderr.strip() == f"mxval: MXVAL_STAGE_TIMES={value!r}: expected 1 or 0"
    assert not (tmp_path / "r").exists()
