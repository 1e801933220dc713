"""What shadow mode costs a serving loop, and whether it catches what it should (`make bench-gpu`).

The synthetic decode loop of harness.bench.capture (vLLM-shaped wrappers over mxval's Triton
kernels, eager and under a CUDA graph) with the capture hook in shadow mode: one chosen
indexer layer, its sampled steps checked against the reference by the checker thread. Four
measurements, each a function that also runs on the CPU at tiny sizes (eager only, through
the Triton interpreter: the logic, not the figures):

* `overhead`: steps/s with the shadow at each rate (1/1000 and 1/100 by default) against
  the same loop unrecorded, run in alternating blocks with it (`in_turns`: the host's speed
  drifts by more than the target over a minute), the added time per step in %, and the
  counters at the end (a checker that fell behind halves the rate: the row says so).
  Target: at most 3 % at 1/1000. Eager, where the host's noise is as large as the target,
  also by parts (`hook_cost`, measured without the device, plus the rate times a sampled
  step's cost from the row that sampled most: `by_parts`).
* `fault`: the K writer with the OCP floor scale rule (the catalogue's `scale-ocp-floor`)
  put into the serving ops: the steps and sampled steps until the first failing verdict
  (expected: the first sampled step, since every step writes K entries), and its kept dump
  replayed through the reference on the CPU (`mxval diff`'s verdict) against the logged one.
* `alarms`: a correct loop checked on N sampled steps (rate 1, the loop waiting for the
  checker every ring's worth of steps, so none is skipped): failing verdicts (target 0);
  several loops at once, each in its own process (`jobs`).
* `killed`: the checker stopped mid-run: serving goes on, every counted verdict is in the
  log, later sampled steps are counted as skipped.

    python -m harness.bench.shadow [--steps N] [--alarm-steps N] [--alarm-jobs J] [--layers L] [--batch B] [--context T]
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from typing import NamedTuple, Optional

import torch

import harness.capture as capture
from harness.bench.capture import RATIO, DecodeLoop, environ, make_wrappers, ops, upstream_modules
from harness.capture import shadow as S
from harness.capture.shadow import jsonable
from harness.diff.metrics import not_reproduced
from harness.errors import Parser, count, parse_or_exit

RATES = (1 / 1000, 1 / 100)
OVERHEAD_TARGET = 3.0                     # % added per serving step at 1/1000
CHOSEN_LAYER = "0"
ENV_KEYS = (capture.ENV_DIR, capture.ENV_LAYERS, capture.ENV_STEPS, capture.ENV_AUTO, capture.ENV_ANCHOR,
            capture.ENV_RING, S.ENV_RATE, S.ENV_DIR, S.ENV_CHECKER, S.ENV_DEVICE)
# the checkers measured: (kind, where the reference runs; None: the kind's default, S.DEVICE_DEFAULT)
CHECKERS = (("process", None), ("process", "cuda"), ("thread", None))
# the control row's checker column: the loop timed in turns against itself, nothing installed
CONTROL = "- (A/A: the loop against itself)"


def checker_text(checker: str, ref_device: Optional[str]) -> str:
    where = S.DEVICE_DEFAULT[checker] if ref_device is None else ref_device
    return f"{checker}, reference on {'the host' if where == 'cpu' else 'the serving GPU'}"


@contextlib.contextmanager
def shadowed(directory: str, rate: float, *, layers: int, ring: int = 4, seed: int = 0, check=None,
             checker: Optional[str] = None, ref_device: Optional[str] = None):
    """The hook installed in shadow mode on CHOSEN_LAYER (auto layer counting over `layers`
    indexer layers); yields the Shadow; uninstalled (the queue checked first) afterwards."""
    env = {capture.ENV_LAYERS: CHOSEN_LAYER, capture.ENV_AUTO: str(layers), capture.ENV_ANCHOR: "compress_pool"}
    with environ(env, clear=ENV_KEYS):
        sh = S.Shadow(directory, rate, ring=ring, seed=seed, check=check, checker=checker, device=ref_device)
        try:
            capture.install(quiet=True, shadow=sh)
            yield sh
        finally:
            capture.uninstall()


REWIND = 1024                            # steps before the positions go back to the start


# A rate at which no step is sampled (a step's hash would have to be 0): the installed hook's
# own cost, the row that separates it from the checks' cost
IDLE_RATE = 2.0 ** -64


def _label(rate) -> str:
    return "off" if rate is None else "none sampled" if rate == IDLE_RATE else f"1/{round(1 / rate)}"


def _loop(shape: dict, device: str) -> DecodeLoop:
    """A decode loop with room for REWIND steps (and a few warm-up steps); `_step` takes it
    back to its start every REWIND steps it ran (the static position buffer a graph reads),
    so a run of any length, in any number of timings, stays in its pool."""
    loop = DecodeLoop(**{"headroom": REWIND + 8, **shape}, device=device)
    loop.start = loop.positions.clone()
    loop.taken = 0
    return loop


def _rewind(loop: DecodeLoop) -> None:
    loop.positions.copy_(loop.start)
    loop.taken = 0


def _step(loop: DecodeLoop, run) -> None:
    """One step of a long run, the loop rewound first when it has run REWIND steps since its
    start (outside the timed work's graph). Counted on the loop, not per timing: a loop timed
    several times would otherwise run past its pool (block tables past the pool's pages)."""
    if loop.taken >= REWIND:
        _rewind(loop)
    run()
    loop.taken += 1


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _runner(loop: DecodeLoop, mode: str, device: str, fns: Optional[tuple] = None):
    """The step function of `mode` (compiled and warmed up). `fns`: the ops an eager step
    calls (default: as found at each step); a graph calls what was found at its capture."""
    if mode == "eager":
        run = loop.step if fns is None else (lambda: loop.step(fns))
        run()
        _rewind(loop)
        return run
    g = loop.capture()
    g.replay()
    _rewind(loop)
    return g.replay


def _time(loop, run, n: int, device: str) -> float:
    """Seconds per step over `n` steps."""
    _sync(device)
    t = time.perf_counter()
    for _ in range(n):
        _step(loop, run)
    _sync(device)
    return (time.perf_counter() - t) / n


BLOCKS = 10          # a timing of N steps runs as blocks of N // BLOCKS, alternating with the baseline's


class Turns(NamedTuple):
    """`in_turns`' answer: s/step of each side, the added time in %, and its spread: two
    standard errors of the per-block differences (on - off, a pair of adjacent blocks each),
    in % of the baseline. An added time within its spread of 0 is not told apart from noise."""
    off: float
    on: float
    added_pct: float
    spread_pct: float
    steps: int = 0                        # steps timed on each side


def in_turns(loop, off, on, *, steps: int, repeats: int, device: str, timer=None) -> Turns:
    """`repeats` x `steps` steps of each side, run in blocks of `steps // BLOCKS` that
    alternate off-on, on-off, off-on... (a drift of the host's speed that is linear over four
    blocks cancels; the eager loop is bound by its host thread, whose speed drifts by several %
    over seconds), each side's time summed: a sampled step's cost counts in full, as in a
    mean, not dropped as by a median. The spread comes from the blocks' own differences, so
    a host that wanders on the scale of a block widens it."""
    timer = timer or _time
    n = max(1, steps // BLOCKS)
    blocks = max(1, round(steps * repeats / n))
    per = {"off": [], "on": []}
    for i in range(blocks):
        for side in (("off", "on") if i % 2 == 0 else ("on", "off")):
            per[side].append(timer(loop, off if side == "off" else on, n, device))
    t_off, t_on = sum(per["off"]) / blocks, sum(per["on"]) / blocks
    diffs = [b - a for a, b in zip(per["off"], per["on"])]
    if blocks > 1:
        mean = sum(diffs) / blocks
        se = (sum((d - mean) ** 2 for d in diffs) / (blocks - 1) / blocks) ** 0.5
    else:
        se = float("inf")
    return Turns(t_off, t_on, (t_on - t_off) / t_off * 100, 2 * se / t_off * 100, n * blocks)


def _stubs() -> dict:
    """The decode loop's five ops as functions that do nothing, with the upstream signatures
    (the hook binds and wraps them as it does the real ones)."""
    import functools
    done = {"aiter.q_quant": (None, None, None)}
    return {key: functools.wraps(fn)(lambda *a, _r=done.get(key), **k: _r) for key, fn in make_wrappers().items()}


def hook_cost(shape: dict, *, steps: int = 20000, blocks: int = 40) -> dict:
    """The installed shadow's own cost per eager step, nothing sampled, without the device:
    the decode loop's step on the CPU with ops that do nothing (`_stubs`), raw against found
    through the installed hook, as `overhead`'s eager rows call them, `steps` of each in
    `blocks` alternating blocks (`in_turns`). What is left is host work alone (a step's calls
    through the wrappers' idle path, the anchor op's step count, the ops looked up at each
    step), which an eager serving step, bound by its host thread, pays in full. {us:
    microseconds per step, spread_us: two standard errors of the blocks' differences,
    raw_us: a step with raw stubs, sampled}."""
    with upstream_modules(_stubs()), tempfile.TemporaryDirectory(prefix="mxval-hook-") as tmp:
        loop = _loop(shape, "cpu")
        raw = ops()
        off = (lambda: loop.step(raw))
        with shadowed(tmp, IDLE_RATE, layers=shape["layers"], checker="thread") as sh:
            sh.ready.wait(120)
            on = loop.step
            for run in (off, on):                              # warm: first calls bind and cache
                for _ in range(64):
                    _step(loop, run)
            per_block = max(1, steps // blocks)
            tt = in_turns(loop, off, on, steps=per_block * BLOCKS, repeats=max(1, blocks // BLOCKS), device="cpu")
            counts = sh.snapshot()
    return {"us": (tt.on - tt.off) * 1e6, "spread_us": tt.spread_pct / 100 * tt.off * 1e6, "raw_us": tt.off * 1e6,
            "sampled": counts.get("sampled", 0)}


def by_parts(rows: list[dict], hook_us: float, checker: str, rate: float = 1 / 1000) -> Optional[dict]:
    """The added time of an eager step at `rate` by its parts: the hook's own cost
    (`hook_cost`, measured without the device) plus `rate` times a sampled step's cost, the
    latter from the eager row that sampled most (its added time beyond the hook, over its
    sampled steps). A sampled step costs milliseconds, so that row's spread bounds it within
    a factor of two or so, where an A/B reading at 1/1000 has the host's whole noise on a
    few %. {pct, lo_pct, hi_pct (the same with the row's added time at the ends of its
    spread), sample_ms, sample_lo_ms, sample_hi_ms, step_ms, from_rate}, or None without a
    sampled eager row of that checker."""
    eager = [r for r in rows if r["mode"] == "eager" and r.get("checker") == checker
             and r["rate"] not in (None, IDLE_RATE) and r["counts"].get("sampled") and r.get("steps")]
    if not eager:
        return None
    r = max(eager, key=lambda r: r["counts"]["sampled"])
    n_steps = r["steps"]
    per = lambda pct: max(0.0, (pct / 100 * r["base_s"] * n_steps - hook_us * 1e-6 * n_steps)
                          / r["counts"]["sampled"])
    sample = per(r["added_pct"])
    lo, hi = per(r["added_pct"] - r["spread_pct"]), per(r["added_pct"] + r["spread_pct"])
    step = r["base_s"]
    pct = lambda smp: (hook_us * 1e-6 + rate * smp) / step * 100
    return {"pct": pct(sample), "lo_pct": pct(lo), "hi_pct": pct(hi), "sample_ms": sample * 1e3,
            "sample_lo_ms": lo * 1e3, "sample_hi_ms": hi * 1e3, "step_ms": step * 1e3, "from_rate": r["rate"]}


def overhead(shape: dict, *, steps: int, rates=RATES, modes=("eager", "graph"), device: str = "cuda",
             repeats: int = 3, checkers=CHECKERS, control: bool = True) -> list[dict]:
    """[{mode, checker, rate, s_per_step, base_s, added_pct, spread_pct, counts}]. Per mode
    one row with nothing installed (rate None: the median of `repeats` timings of `steps`
    steps), with `control` one row (checker CONTROL) timing that loop in turns against itself
    (what the method reads where nothing is added: its bias and noise on this host), then per
    checker (kind, reference device) and rate a row with the shadow on (its worker started
    and ready before the timings, as a serving process starts it once). A shadow row runs
    `repeats` x `steps` steps in turns with as many of the same loop unrecorded
    (`in_turns`): its steps with the ops found before install (eager) or its graph captured
    before install (graph; a replay of a graph that records nothing passes the hook
    untouched). `added_pct` compares the two, so drift of the host's speed between rows and
    within a row (more than the target on a shared host) cancels. Each checker's first row
    is IDLE_RATE: installed, no step sampled, the cost of the hook itself (and, under
    graphs, of its switched-off copies)."""
    rows = []
    with upstream_modules(make_wrappers()), tempfile.TemporaryDirectory(prefix="mxval-shadow-") as tmp:
        for mode in modes:
            loop = _loop(shape, device)
            run = _runner(loop, mode, device)
            base = sorted(_time(loop, run, steps, device) for _ in range(repeats))[repeats // 2]
            rows.append({"mode": mode, "checker": None, "rate": None, "s_per_step": base, "base_s": base,
                         "added_pct": None, "spread_pct": None, "counts": {}})
            print(f"shadow overhead: {mode:5s} off {base * 1e3:9.3f} ms/step", flush=True)
            if control:
                # the loop against itself, nothing installed: what the method reads where
                # nothing was added (its bias and noise on this host)
                tt = in_turns(loop, run, run, steps=steps, repeats=repeats, device=device)
                rows.append({"mode": mode, "checker": CONTROL, "rate": None, "s_per_step": tt.on, "base_s": tt.off,
                             "added_pct": tt.added_pct, "spread_pct": tt.spread_pct, "counts": {}})
                print(f"shadow overhead: {mode:5s} {CONTROL}: {tt.added_pct:+.2f} % (+- {tt.spread_pct:.2f})",
                      flush=True)
            del run, loop
            for kind, ref_device in checkers:
                for rate in (IDLE_RATE, *rates):
                    loop = _loop(shape, device)
                    raw = ops()
                    off = _runner(loop, mode, device, raw)          # before install: records nothing
                    d = os.path.join(tmp, f"{mode}-{kind}-{ref_device}-{rate}")
                    with shadowed(d, rate, layers=shape["layers"], checker=kind, ref_device=ref_device) as sh:
                        sh.ready.wait(120)
                        run = _runner(loop, mode, device)
                        tt = in_turns(loop, off, run, steps=steps, repeats=repeats, device=device)
                        counts = sh.snapshot()        # before the queue is checked at uninstall
                    rows.append({"mode": mode, "checker": checker_text(kind, ref_device), "rate": rate,
                                 "s_per_step": tt.on, "base_s": tt.off, "added_pct": tt.added_pct,
                                 "spread_pct": tt.spread_pct, "steps": tt.steps, "counts": counts})
                    print(f"shadow overhead: {mode:5s} {checker_text(kind, ref_device):36s} rate {_label(rate)} "
                          f"{tt.on * 1e3:9.3f} ms/step against {tt.off * 1e3:.3f} ({tt.added_pct:+.2f} % +- "
                          f"{tt.spread_pct:.2f}, {counts.get('sampled', 0)} sampled, {counts.get('skipped', 0)} "
                          f"skipped)", flush=True)
                    del run, off, loop
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
    return rows


def fault(shape: dict, *, rate: float = 1 / 100, max_steps: int = 2000, mode: str = "graph",
          device: str = "cuda", seed: int = 0, checker: str = "process") -> dict:
    """The catalogue's `scale-ocp-floor` K writer in the serving loop: when the first failing
    verdict came, and whether its dump gives the same verdict through the reference on the CPU."""
    from harness.io.dumps import read_dump
    from harness.run.budgets import verdict
    from harness.run.record import dump_row
    from harness.run.replay import replay_dump
    out = {"mode": mode, "rate": rate}
    with upstream_modules(make_wrappers(scale_rule="ocp-floor")), \
            tempfile.TemporaryDirectory(prefix="mxval-shadow-fault-") as tmp:
        loop = _loop(shape, device)
        with shadowed(tmp, rate, layers=shape["layers"], seed=seed, ring=4, checker=checker) as sh:
            sh.ready.wait(120)
            run = _runner(loop, mode, device)
            steps, writes = 0, {}
            while steps < max_steps:
                if loop.taken >= REWIND:
                    _rewind(loop)
                pos = loop.positions.to("cpu", copy=True)     # before the step (a sync: not timed here)
                run()
                loop.taken += 1
                writes[capture.context()[1]] = bool(((pos + 1) % RATIO == 0).any())
                steps += 1
                if sh.snapshot()["sampled"] and steps % 8 == 0:
                    _sync(device)
                    sh.join(300)
                    if sh.snapshot()["failed"]:
                        break
            _sync(device)
            sh.join(300)
            counts = sh.snapshot()
        verdicts = [e for e in S.read_log(os.path.join(tmp, S.LOG))[0] if e.get("event") == "verdict"]
        first = next((e for e in verdicts if not e["ok"]), None)
        before = [e for e in verdicts if first is not None and e["step"] < first["step"]]
        # the expected count: the first sampled step that writes a K entry (a sequence at a
        # pooling boundary); steps that write none cannot show a K-writer fault. It assumes a
        # writing step writes a block the fault changes: `scale-ocp-floor` agrees with `ceil`
        # on some amax ranges, so a step writing a handful of blocks (2 sequences) may not
        # show it; with 8 sequences and more it does
        out.update(steps=steps, counts=counts, sampled_until_flagged=None if first is None else 1 + len(before),
                   expected_sampled=None if first is None else
                   1 + sum(1 for e in before if not writes.get(e["step"], _writes(loop, e["step"]))))
        if first is not None:
            d = read_dump(first["dump"])
            row = verdict(dump_row(first["dump"], replay_dump(d), "reference", 0.0), sh.budgets, S.SUITE)
            logged, again = first["row"]["metrics"], jsonable(row["metrics"])
            differ = not_reproduced(logged, again)       # sums to 1e-9 relative, all else exactly
            out.update(step=first["step"], reason=first["reason"], diff_status=row["status"],
                       diff_same=row["status"] == first["status"] and not differ, diff_metrics=differ,
                       dump_bytes=os.path.getsize(first["dump"]))
    return out


def _writes(loop: DecodeLoop, step: int) -> bool:
    """Whether the loop's step `step` writes a K entry, for the steps before any rewind (the
    warm-up steps: the hook's step s runs at the start positions + s)."""
    pos = loop.start.cpu() + step
    return bool(((pos + 1) % RATIO == 0).any())


def alarms(shape: dict, *, sampled: int, mode: str = "graph", device: str = "cuda", ring: int = 4,
           checker: str = "process", seconds: Optional[float] = None, seed: int = 1, jobs: int = 1) -> dict:
    """A correct loop, `sampled` steps each checked (rate 1; the loop waits for the checker
    every `ring` steps, so nothing is skipped), each step on new queries, head weights and
    compressor state drawn from `seed` (`DecodeLoop.refill`; the positions repeat every
    REWIND steps): the failing verdicts (target 0). `seconds`: a time limit (the result
    says how many steps ran before it). `jobs` > 1: that many loops at once, each in its own
    process with its own checker and seed (seed + j), the steps shared out and the counts
    summed (one check takes about 0.1 s of a worker's 4 threads; a many-core host checks
    several at once)."""
    if not (isinstance(jobs, int) and jobs >= 1):
        raise ValueError(f"alarms: jobs must be a whole number >= 1 (got {jobs!r})")
    if jobs > 1:
        return _alarms_in_jobs(shape, sampled=sampled, mode=mode, device=device, ring=ring, checker=checker,
                               seconds=seconds, seed=seed, jobs=jobs)
    with upstream_modules(make_wrappers()), tempfile.TemporaryDirectory(prefix="mxval-shadow-alarms-") as tmp:
        loop = _loop(shape, device)
        t = time.perf_counter()
        with shadowed(tmp, 1.0, layers=shape["layers"], ring=ring, checker=checker) as sh:
            sh.ready.wait(120)
            run = _runner(loop, mode, device)
            _sync(device)
            sh.join(600)          # the warm-up's items checked first: a full queue would halve the rate
            ran = 0
            fresh = torch.Generator(device=device).manual_seed(seed)
            for i in range(sampled):
                loop.refill(fresh)           # after the last step's recording copies, in stream order
                _step(loop, run)
                ran += 1
                if (i + 1) % ring == 0:
                    _sync(device)
                    sh.join(600)
                    if seconds is not None and time.perf_counter() - t > seconds:
                        break
            _sync(device)
            capture.flush()       # eager: the last step's records, pending until the next anchor call
            sh.join(600)
            counts = sh.snapshot()
        reasons = [e["reason"] for e in S.read_log(os.path.join(tmp, S.LOG))[0]
                   if e.get("event") == "verdict" and not e["ok"]]
    return {"mode": mode, "checker": checker, "sampled": sampled, "ran": ran, "counts": counts, "reasons": reasons[:3],
            "seconds": time.perf_counter() - t, "jobs": 1, "seeds": [seed]}


def _alarm_job(conn, shape: dict, kw: dict) -> None:
    """One of `alarms`' jobs, in a spawned process: its result (or its failure) through `conn`."""
    try:
        if kw["device"] == "cpu":
            import optimized
            optimized.get_backend("triton-interpret")     # the kernel modules as the parent had them
        conn.send(("ok", alarms(shape, **kw)))
    except BaseException as e:                            # reported by the parent, which goes on
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _alarms_in_jobs(shape: dict, *, sampled: int, jobs: int, seed: int, **kw) -> dict:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    t = time.perf_counter()
    shares = [sampled // jobs + (j < sampled % jobs) for j in range(jobs)]
    procs = []
    for j, share in enumerate(shares):
        here, there = ctx.Pipe(duplex=False)
        p = S.spawned(_alarm_job, (there, shape, dict(kw, sampled=share, seed=seed + j)),
                      name=f"mxval-shadow-alarms-{j}")
        there.close()
        procs.append((p, here))
    results, errors = [], []
    for p, here in procs:
        try:
            kind, value = here.recv()
        except EOFError:                   # died without a word (killed, out of memory)
            p.join(30)
            kind, value = "error", f"job {p.name} ended with exit code {p.exitcode}"
        p.join(60)
        (results if kind == "ok" else errors).append(value)
    if errors:
        raise RuntimeError(f"{len(errors)} of {jobs} alarm jobs failed: {errors[0]}")
    kinds = {name: kind for name, kind, _ in S.COUNTERS}
    counts = {name: (sum if kind == "counter" else min)(r["counts"][name] for r in results)
              for name, kind in kinds.items()}          # a gauge: its lowest (rate, enabled, alive)
    return {"mode": kw["mode"], "checker": kw["checker"], "sampled": sampled, "ran": sum(r["ran"] for r in results),
            "counts": counts, "reasons": [x for r in results for x in r["reasons"]][:3],
            "seconds": time.perf_counter() - t, "jobs": jobs, "seeds": [s for r in results for s in r["seeds"]]}


def default_alarm_jobs() -> int:
    """One alarm loop per S.WORKER_THREADS host cores (each checker's worker uses that many), at most 4."""
    return max(1, min(4, (os.cpu_count() or 1) // S.WORKER_THREADS))


KILL_AFTER = 2                 # verdicts counted before the checker is killed
KILL_WAIT_S = 300.0            # at most this long for them (a loaded host starves a niced worker)


def killed(shape: dict, *, steps: int = 64, mode: str = "graph", device: str = "cuda",
           checker: str = "process") -> dict:
    """The checker killed mid-run (checker "process": its worker gets SIGKILL; "thread": it is
    stopped) once KILL_AFTER verdicts are counted, in the first half of the run: the loop
    waits for them there at the latest. Serving goes on; every verdict counted is in the log."""
    import signal
    with upstream_modules(make_wrappers()), tempfile.TemporaryDirectory(prefix="mxval-shadow-kill-") as tmp:
        loop = _loop(shape, device)
        with shadowed(tmp, 1.0, layers=shape["layers"], ring=4, checker=checker) as sh:
            sh.ready.wait(120)
            run = _runner(loop, mode, device)
            served = stopped_at = 0
            for i in range(steps):
                _step(loop, run)
                served += 1
                if stopped_at == 0 and (sh.snapshot()["checked"] >= KILL_AFTER or i + 1 >= steps // 2):
                    _sync(device)
                    end = time.perf_counter() + KILL_WAIT_S
                    while (sh.snapshot()["checked"] < KILL_AFTER and sh.thread.is_alive()
                           and time.perf_counter() < end):
                        time.sleep(0.01)
                    if checker == "process":       # mid-run: the serving loop goes on at once
                        os.kill(sh.worker.pid, signal.SIGKILL)
                    else:
                        sh.stop(wait=False)
                    stopped_at = i + 1
            _sync(device)
            sh.thread.join(300)
            counts = sh.snapshot()
        logged = sum(1 for e in S.read_log(os.path.join(tmp, S.LOG))[0] if e.get("event") == "verdict")
    return {"mode": mode, "checker": checker, "served": served, "stopped_at": stopped_at, "counts": counts,
            "logged": logged, "lost": counts["checked"] - logged}


def table(rows: list[dict], fault_r: Optional[dict], alarm_r: Optional[dict], kill_r: Optional[dict], *,
          shape: dict, machine: str, hook: Optional[dict] = None) -> list[str]:
    out = ["", "## Shadow mode (synthetic decode loop)", "",
           f"Machine: {machine}. {shape['layers']} indexer layers, {shape['batch']} sequences decoding from "
           f"{shape['context']} tokens; layer {CHOSEN_LAYER} chosen, ring of 4. Checker `process`: a worker process "
           f"judges each sampled step (reference on the host, or on the serving GPU where the row says so); "
           f"`thread`: a thread of the serving process (reference on the serving GPU, low-priority stream). "
           f"A shadow row's steps run in blocks alternating with as many of the same loop unrecorded "
           f"(`off, same run`); its added time compares the two totals, ± two standard errors of the "
           f"blocks' differences. The A/A row times the loop against itself with nothing installed: what "
           f"the method reads where nothing is added. Target: at most {OVERHEAD_TARGET:g} % added per step "
           f"at 1/1000.", "",
           "| mode | checker | rate | ms/step | off, same run | added per step | sampled | checked | skipped | "
           "rate at the end |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["counts"]
        added = "-" if r.get("added_pct") is None else f"{r['added_pct']:+.2f} % ± {r['spread_pct']:.2f}"
        label = "off" if r.get("checker") == CONTROL else _label(r["rate"])
        out.append(f"| {r['mode']} | {r.get('checker') or '-'} | {label} | "
                   f"{r['s_per_step'] * 1e3:.3f} | {r.get('base_s', r['s_per_step']) * 1e3:.3f} | {added} | "
                   f"{c.get('sampled', '-')} | {c.get('checked', '-')} | "
                   f"{c.get('skipped', '-')} | {format(c['rate'], '.3g') if c.get('rate') is not None else '-'} |")
    for r in rows:
        if r["rate"] is not None and abs(r["rate"] - 1 / 1000) < 1e-12:
            added, spread = r["added_pct"], r["spread_pct"]
            said = "met" if added <= OVERHEAD_TARGET else "NOT met"
            if added - spread <= OVERHEAD_TARGET < added + spread:
                said += ", the target within the spread"
            out.append(f"* {r['mode']}, {r.get('checker')}, at 1/1000: {added:+.2f} % ± {spread:.2f} per step "
                       f"(target <= {OVERHEAD_TARGET:g} %: {said})")
    if hook is not None:
        eager_off = [r["s_per_step"] for r in rows if r["mode"] == "eager" and r["rate"] is None
                     and r.get("checker") is None]
        share = f" ({hook['us'] / (eager_off[0] * 1e6) * 100:.2f} % of the eager step)" if eager_off else ""
        out.append(f"* eager, the installed shadow's own cost, nothing sampled, measured without the device "
                   f"(`hook_cost`: the step's host work with ops that do nothing, raw against through the hook): "
                   f"{hook['us']:.1f} µs ± {hook['spread_us']:.1f} a step{share}")
        for checker in dict.fromkeys(r.get("checker") for r in rows if r["mode"] == "eager" and r["rate"]):
            p = by_parts(rows, hook["us"], checker)
            if p is None:
                continue
            said = "met" if p["hi_pct"] <= OVERHEAD_TARGET else "NOT met" if p["lo_pct"] > OVERHEAD_TARGET else \
                "not told apart"
            out.append(f"* eager, {checker}, at 1/1000 by parts: the hook's {hook['us']:.1f} µs + 1/1000 of a sampled "
                       f"step's {p['sample_ms']:.1f} ms ({p['sample_lo_ms']:.1f} to {p['sample_hi_ms']:.1f}, from the "
                       f"{_label(p['from_rate'])} row) = {p['pct']:.2f} % of the {p['step_ms']:.3f} ms step "
                       f"({p['lo_pct']:.2f} to {p['hi_pct']:.2f} %; target <= {OVERHEAD_TARGET:g} %: {said})")
    if fault_r is not None:
        f = fault_r
        out.append(f"* fault `scale-ocp-floor` ({f['mode']}, rate 1/{round(1 / f['rate'])}): "
                   + (f"flagged at step {f['step']}, sampled step {f['sampled_until_flagged']} (expected "
                      f"{f['expected_sampled']}: the first sampled step that writes a K entry); its dump ({f['dump_bytes']} bytes) through the reference on "
                      f"the CPU: {f['diff_status']} ({'the same verdict and metrics' if f['diff_same'] else 'NOT the same: ' + str(f['diff_metrics'])[:300]})"
                      if f.get("step") is not None else f"NOT flagged in {f['steps']} steps ({f['counts']})"))
    if alarm_r is not None:
        a = alarm_r
        jobs = a.get("jobs", 1)
        how = "" if jobs == 1 else f", {jobs} loops at once, input seeds {', '.join(map(str, a['seeds']))}"
        out.append(f"* correct loop ({a['mode']}, {a.get('checker')} checker{how}): {a['counts']['checked']} sampled steps checked"
                   + ("" if a.get("ran", a["sampled"]) >= a["sampled"] else
                      f" (stopped at the time limit after {a['ran']} of {a['sampled']} steps)") + ", "
                   f"{a['counts']['failed']} alarms (target 0), {a['counts']['skipped']} skipped, "
                   f"{a['seconds']:.0f} s" + (f"; first: {a['reasons'][0]}" if a["reasons"] else ""))
    if kill_r is not None:
        k = kill_r
        how = "worker process killed (SIGKILL)" if k.get("checker") == "process" else "checker thread stopped"
        out.append(f"* {how} after step {k['stopped_at']} ({k['mode']}): serving ran {k['served']} "
                   f"steps; {k['counts']['checked']} verdicts counted, {k['logged']} in the log ({k['lost']} lost), "
                   f"{k['counts']['skipped']} sampled steps skipped afterwards")
    return out


def section_for(lines: list, **kw):
    """For harness.bench.gpu: a part that appends the shadow rows to `lines`."""
    def shadow_mode():
        lines.extend(run_all(**kw))
    return shadow_mode


def run_all(*, layers=4, batch=32, context=8192, steps=5000, alarm_steps=10000, device="cuda",
            modes=("eager", "graph"), repeats=3, alarm_jobs: Optional[int] = None) -> list[str]:
    shape = dict(layers=layers, batch=batch, context=context)
    graph = "graph" if "graph" in modes else modes[0]
    rows = overhead(shape, steps=steps, modes=modes, device=device, repeats=repeats)
    hook = hook_cost(shape) if "eager" in modes else None
    f = fault(shape, mode=graph, device=device)
    a = alarms(shape, sampled=alarm_steps, mode=graph, device=device,
               jobs=alarm_jobs if alarm_jobs is not None else default_alarm_jobs())
    k = killed(shape, mode=graph, device=device)
    machine = (f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}" if device.startswith("cuda")
               else f"CPU (Triton interpreter); torch {torch.__version__}")
    return table(rows, f, a, k, shape=shape, machine=machine, hook=hook)


def main(argv=None) -> int:
    ap = Parser(prog="python -m harness.bench.shadow", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=count, default=5000, help="steps per timing (1/1000 samples about 5 of 5000)")
    ap.add_argument("--alarm-steps", type=count, default=10000, help="sampled steps of the correct loop")
    ap.add_argument("--alarm-jobs", type=count, default=None,
                    help="correct loops checked at once, one process each (default: one per 4 host cores, at most 4)")
    ap.add_argument("--layers", type=count, default=4)
    ap.add_argument("--batch", type=count, default=32)
    ap.add_argument("--context", type=count, default=8192)
    ap.add_argument("--out", default=None, help="append the table to this Markdown file")
    a = parse_or_exit(ap, argv, "bench shadow")
    if not torch.cuda.is_available():
        print("mxval: bench shadow: no CUDA/ROCm GPU visible to torch", file=sys.stderr)
        return 2
    lines = run_all(layers=a.layers, batch=a.batch, context=a.context, steps=a.steps, alarm_steps=a.alarm_steps,
                    alarm_jobs=a.alarm_jobs)
    print("\n".join(lines))
    if a.out:
        from harness.io import atomic
        old = open(a.out).read() if os.path.exists(a.out) else ""
        atomic.write_text(a.out, old + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
