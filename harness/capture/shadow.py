"""Shadow mode: a sampled share of live steps checked against the reference while serving.

The capture hook (harness.capture.hook) chooses the layers and records a sampled step's op
inputs and outputs exactly as it does for a dump (eager calls cloned at the call, graph
replays copied after the replay into a ring allocated outside the graph's pool). In shadow
mode the records are not written: each (layer, step) becomes one item of a bounded queue
(at most RING items; a graph step also holds its ring position until it is checked) that a
checker thread takes off the serving path:

* it waits for the item's copies (a CUDA event recorded on the serving stream after them;
  the wait blocks the checker only) and moves them to the host on a low-priority side stream;
* it replays every op through the reference (harness.run.replay; where: DEVICE_DEFAULT,
  or `MXVAL_SHADOW_DEVICE`), builds the row `mxval diff` builds
  (harness.run.record.dump_row) and judges it with the same budgets (harness.run.budgets,
  suite "diff"), so a dump of the step replayed by `mxval diff` gives the same verdict;
* it appends the verdict to `verdicts.jsonl` (one JSON line, flushed and fsync'd before the
  counters count it: a killed checker loses no verdict it counted), writes a failing step
  as `failures/layer<L>_step<S>.safetensors`, and rewrites `metrics.prom` (Prometheus text
  format, atomically: a scraper never reads half a file; a reporter thread also rewrites it
  at most once a second when the counts change, so skips show while the checker is busy).

Sampling is deterministic: step S is sampled at rate r when a splitmix64 hash of (seed, S)
is below r * 2^64 (the same steps on every rank and every run with the same seed; a halved
rate keeps a subset of them). Bounds: a sampled step that finds the queue full is skipped
(counted) and halves the rate (`rate_halvings`, `rate` in the counters); once RECOVER_AFTER
sampled steps in a row are admitted with the checker keeping up (at most half the ring
waiting), a halved rate doubles back, never above the rate asked for (`rate_raises`): a
burst, such as a warm-up that fills the queue, costs the rate for a while, not for good.
The serving thread never waits for the checker. Any exception inside the shadow path
(recording, copying, checking, writing) is logged once, recorded in the log, and switches
the shadow off; serving goes on untouched. A checker that stops (killed, or `stop()`)
leaves every verdict already counted in the log; later sampled steps are counted as skipped.
A sampled step whose recorded inputs the reference's op checks reject (a block table past
the pool, a position past the RoPE table) is no shadow failure but a finding about the
served inputs: a failing verdict (status `error`, the reason the checks give) with its dump
kept, and the shadow goes on.

Graph captures: a CUDA graph captured in CUDA's global capture mode (torch's default, and
vLLM's) fails when any other thread of the process makes a device call meanwhile. The hook
tells the shadow when a capture begins and ends (`capture_begins`, `capture_ends`, from
torch.cuda.CUDAGraph.capture_begin / capture_end): the capture first waits for the device
work of the item being checked, if any, to finish (one item's copy or reference run: vLLM
captures at start-up, not while serving), and the checker starts no device work until the
capture ends.

Where the checking runs (`checker`, MXVAL_SHADOW_CHECKER). The records are copied to the
host by the checker thread in any case, on its low-priority stream (graph replays' ring
buffers live in the serving process). Then:

* "process": a worker process (spawned once, at start-up) replays them through the
  reference, builds the row and writes a failing dump; the records' host copies are made in
  one shared-memory segment, reused from item to item (Segment), and only its name and the
  fields' offsets travel through the pipe. The serving process's GIL then carries only the
  copies and the log: the reference's Python does not compete with the serving thread's.
  Its reference runs on the host by default (no GPU time at all), or on the serving GPU in
  its own CUDA context (MXVAL_SHADOW_DEVICE=cuda). That context shares the GPU with
  serving: under graphs a GPU-reference check cost the serving loop about twice what a
  host-reference one did (harness.bench.shadow), and it takes about 600 MB of GPU memory.
  At large batches and contexts a host check takes longer, and the rate adapts down
  sooner. A killed worker switches the shadow off.
* "thread": the checker thread does it all, the reference on the serving GPU on the
  low-priority stream. Every Python line of the reference then holds the serving process's
  GIL: a serving thread that launches a kernel waits for the checker's switch interval (5 ms)
  when the checker takes the GIL back first, so each check costs serving several times its
  own GPU time. Kept for debugging and for custom `check` functions.

`make bench-gpu`'s shadow rows measure each.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import threading
import time
import traceback
import warnings
from typing import Optional

import torch

from harness.io import atomic, env

ENV_RATE = "MXVAL_SHADOW"
ENV_DIR = "MXVAL_SHADOW_DIR"
ENV_RING = "MXVAL_SHADOW_RING"
ENV_SEED = "MXVAL_SHADOW_SEED"
ENV_DEVICE = "MXVAL_SHADOW_DEVICE"
ENV_BUDGETS = "MXVAL_SHADOW_BUDGETS"
ENV_CHECKER = "MXVAL_SHADOW_CHECKER"
ENV_THREADS = "MXVAL_SHADOW_THREADS"
ENV_NICE = "MXVAL_SHADOW_NICE"
CHECKERS = ("process", "thread")    # where the reference and the diff run: a worker process, or a thread here
CHECKER_DEFAULT = "process"
# where each checker kind runs the reference unless MXVAL_SHADOW_DEVICE says (None: the
# records' device): the worker on the host, off the serving GPU (see "process" above); the
# thread on the serving GPU's low-priority stream (on the host its reference's Python would
# hold the serving process's GIL for the whole check)
DEVICE_DEFAULT = {"process": "cpu", "thread": None}
WORKER_START_S = 120.0              # the worker's imports (torch, the reference) and CUDA context at most
# The worker competes with serving for the host's cores (the serving thread launches every
# kernel: a step is host-bound under eager and short under graphs) only at the lowest CPU
# priority, with few torch threads (torch's default is one per core). On a host loaded to
# every core the worker then waits: its checks slow down and the rate adapts, serving does not.
WORKER_NICE = 19
WORKER_THREADS = 4
RING_DEFAULT = 4
RECOVER_AFTER = 16                 # sampled steps in a row admitted with half the ring free before a halved rate doubles
PROM_EVERY = 1.0                   # seconds between rewrites of the counters file (when they changed)
LOG, PROM, FAILURES = "verdicts.jsonl", "metrics.prom", "failures"
SUITE = "diff"                     # the budgets scope `mxval diff` judges a dump under
MASK = (1 << 64) - 1

COUNTERS = (
    ("sampled", "counter", "steps sampled for checking"),
    ("checked", "counter", "(layer, step) items checked against the reference"),
    ("passed", "counter", "items within every budget"),
    ("failed", "counter", "items that broke a budget (each kept as a dump)"),
    ("skipped", "counter", "sampled steps or items dropped for lack of budget (queue full)"),
    ("rate_halvings", "counter", "times the sampling rate was halved because the checker fell behind"),
    ("rate_raises", "counter", "times a halved rate was doubled back because the checker kept up"),
    ("queued", "gauge", "items waiting for the checker"),
    ("rate", "gauge", "sampling rate now (steps checked per step served)"),
    ("enabled", "gauge", "1 while the shadow runs, 0 once switched off"),
    ("checker_alive", "gauge", "1 while the checker thread runs"),
)


def mix(seed: int, step: int) -> int:
    """splitmix64's output for state seed ^ (step + 1) * gamma: a 64-bit hash, the same on
    every machine (with step * gamma, step 0 of seed 0 hashed to 0 and was sampled at any rate)."""
    z = (seed ^ ((step + 1) * 0x9E3779B97F4A7C15)) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def chosen(step: Optional[int], rate: float, seed: int = 0) -> bool:
    """Whether step `step` is sampled at `rate` (deterministic)."""
    if step is None or rate <= 0:
        return False
    return rate >= 1 or mix(seed, int(step)) < rate * 2.0 ** 64


def prometheus(counts: dict) -> str:
    """The counters in Prometheus text exposition format."""
    out = []
    for name, kind, help_ in COUNTERS:
        full = f"mxval_shadow_{name}" + ("_total" if kind == "counter" else "")
        v = counts.get(name, 0)
        out += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}",
                f"{full} {float(v):.9g}" if isinstance(v, float) else f"{full} {int(v)}"]
    return "\n".join(out) + "\n"


class Steps:
    """The capture's step selection in shadow mode: a step is chosen when the capture's own
    selection holds it, it is sampled at the current rate, and the checker has room."""

    def __init__(self, shadow: "Shadow", within):
        self.shadow, self.within = shadow, within
        self.text = f"sampled at {shadow.rate:g}"
        self._last: Optional[int] = None
        self._taken = False

    def __contains__(self, step) -> bool:
        sh = self.shadow
        try:
            if not sh.enabled or step not in self.within or not chosen(step, sh.rate, sh.seed):
                return False
            if step != self._last:             # a new step: counted once, admitted when there is room
                self._last = step
                self._taken = sh.admit()
            return self._taken
        except Exception as e:                 # never into the serving path
            sh.fail(f"sampling: {type(e).__name__}: {e}")
            return False


_WAKE = object()                   # put in the queue by a stop: a checker waiting for an item wakes
# An idle checker waits this long between looks at its stop flag: each look takes the serving
# process's GIL from the serving thread, so rarely (a stop wakes it at once through _WAKE)
CHECKER_IDLE_S = 1.0


class _Item:
    __slots__ = ("layer", "step", "calls", "event", "release", "mode")

    def __init__(self, layer, step, calls, event, release, mode):
        self.layer, self.step, self.calls, self.event, self.release, self.mode = \
            layer, step, calls, event, release, mode


class Shadow:
    """The checker and its counters. `directory`: where the log, the counters and the failing
    dumps go; `rate`: the share of steps sampled; `ring`: items in flight at most;
    `device`: where the reference runs (None: where the records are); `threads`, `nice`: the
    worker process's torch threads and the niceness it adds to its own (None:
    MXVAL_SHADOW_THREADS / MXVAL_SHADOW_NICE, else WORKER_THREADS / WORKER_NICE)."""

    def __init__(self, directory, rate: float, *, ring: int = RING_DEFAULT, seed: int = 0,
                 device: Optional[str] = None, budgets=None, model: str = "deepseek-v4-pro",
                 source: str = "mxval shadow", check=None, prom_every: float = PROM_EVERY,
                 checker: Optional[str] = None, threads: Optional[int] = None, nice: Optional[int] = None):
        from harness.run import budgets as B
        if not (isinstance(rate, (int, float)) and 0 < rate <= 1) or not (isinstance(ring, int) and ring >= 1):
            raise ValueError(f"mxval shadow: rate must be in (0, 1] and ring a whole number >= 1 (got rate {rate!r}, "
                             f"ring {ring!r})")
        if threads is None:
            threads = env.integer(ENV_THREADS, WORKER_THREADS, 1, 4097)      # 1..4096
        if nice is None:
            nice = env.integer(ENV_NICE, WORKER_NICE, 0, 20)                 # 0..19
        if not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"mxval shadow: the worker's threads must be a whole number >= 1 (got {threads!r})")
        if not (isinstance(nice, int) and 0 <= nice <= 19):
            raise ValueError(f"mxval shadow: the worker's nice must be a whole number from 0 to 19 (got {nice!r})")
        if checker is None:                    # a check function runs where it was given: in the thread
            checker = "thread" if check is not None else CHECKER_DEFAULT
        if checker not in CHECKERS:
            raise ValueError(f"mxval shadow: the checker is one of {', '.join(CHECKERS)} (got {checker!r})")
        if checker == "process" and check is not None:
            raise ValueError("mxval shadow: a check function runs in the thread checker only")
        if device is None:
            device = DEVICE_DEFAULT[checker]
        self.directory = os.fspath(directory)
        os.makedirs(os.path.join(self.directory, FAILURES), exist_ok=True)
        self.rate, self.ring, self.seed, self.device = float(rate), int(ring), int(seed), device
        self.rate_asked = self.rate
        self._kept_up = 0                     # sampled steps in a row admitted with half the ring free
        self.budgets = budgets if isinstance(budgets, B.Budgets) else B.load(budgets)
        self.model, self.source = model, source
        self.check = check if check is not None else self._check
        self.checker = checker
        self.worker = None                     # the worker process (checker "process"), started by the thread
        self.threads = threads
        self.nice = nice
        self.worker_info: dict = {}            # what the worker reported when ready: its nice value and threads
        self._conn = None
        self.ready = threading.Event()         # set once the checker can take an item (its worker started),
                                               # or once it has stopped
        self.enabled = True
        self.lock = threading.Lock()
        self._log_lock = threading.Lock()
        self._prom_lock = threading.Lock()
        self._prom_text: Optional[str] = None
        self.counts = {name: 0 for name, _, _ in COUNTERS}
        self.counts.update(rate=self.rate, enabled=1)
        self.items: queue.Queue = queue.Queue(maxsize=self.ring)
        self.log_path = os.path.join(self.directory, LOG)
        self.prom_path = os.path.join(self.directory, PROM)
        self._log = open(self.log_path, "a", encoding="utf-8")
        self._stop = threading.Event()
        self._accepting = True                 # the checker takes items (False once it stops)
        self._streams: dict = {}               # device -> the checker's low-priority stream there
        self._gate = threading.Condition()     # graph captures against the checker's device work
        self._captures = 0                     # captures in progress (the serving thread's)
        self._in_device = False                # the checker is in its device work
        self.thread = threading.Thread(target=self._run, name="mxval-shadow", daemon=True)
        self._closed = threading.Event()
        self._prom_every = prom_every
        self._reporter = threading.Thread(target=self._report, name="mxval-shadow-counters", daemon=True)
        self._starting = None
        self._segment = Segment()              # the records' host copies, shared with the worker
        if self.checker == "process":
            self._start_worker()
        self._append({"event": "start", "rate": self.rate, "ring": self.ring, "seed": self.seed,
                      "device": device or "records", "budgets": self.budgets.path, "pid": os.getpid()})
        self.thread.start()
        self.counts["checker_alive"] = 1
        self._write_prom()
        self._reporter.start()

    # --- the serving side: never waits, never raises -------------------------------------

    def admit(self) -> bool:
        """A sampled step: True when the checker has room for it (counted as sampled), else
        counted as skipped and the rate halved. A halved rate doubles back (at most to the rate
        asked for) after RECOVER_AFTER steps in a row admitted with at most half the ring waiting:
        the checker keeps up (a checker that falls behind fills the ring and resets the run)."""
        with self.lock:
            if not self._accepting or self.items.qsize() >= self.ring:
                self._behind_locked()
                return False
            self.counts["sampled"] += 1
            self._kept_up = self._kept_up + 1 if self.items.qsize() <= self.ring // 2 else 0
            if self._kept_up >= RECOVER_AFTER and self.rate < self.rate_asked:
                self.rate = min(self.rate_asked, self.rate * 2)
                self.counts["rate_raises"] += 1
                self.counts["rate"] = self.rate
                self._kept_up = 0
            return True

    def behind(self) -> None:
        """A sampled step with no room (the graph ring is full): skipped, the rate halved."""
        with self.lock:
            self._behind_locked()

    def _behind_locked(self) -> None:
        self.counts["skipped"] += 1
        self._kept_up = 0
        if self._accepting:                    # a stopped checker is not slow: nothing to adapt
            self.rate /= 2
            self.counts["rate_halvings"] += 1
            self.counts["rate"] = self.rate

    def submit(self, layer, step, calls: dict, *, release=None, mode: str = "eager") -> bool:
        """Hand one (layer, step)'s records ({op: (inputs, scalars, outputs)}, device tensors
        the caller no longer writes, or ring views it keeps until `release()`) to the checker.
        False (and counted as skipped) when the queue is full or the shadow is off."""
        try:
            if not self.enabled:
                if release is not None:
                    release()
                return False
            event = None
            devs = {t.device for _, (i, _, o) in calls.items() for t in (*i.values(), *o.values())}
            if any(d.type == "cuda" for d in devs):
                if torch.cuda.is_current_stream_capturing():     # no event can be recorded: let it go
                    self.behind()
                    if release is not None:
                        release()
                    return False
                event = torch.cuda.Event()
                event.record()                   # after the copies, on the serving stream
            with self.lock:
                if self.items.full() or not self._accepting:
                    self._behind_locked()
                    if release is not None:
                        release()
                    return False
                self.items.put_nowait(_Item(layer, step, calls, event, release, mode))
                self.counts["queued"] = self.items.qsize()
            return True
        except Exception as e:
            self.fail(f"submit: {type(e).__name__}: {e}", traceback.format_exc())
            return False

    # --- graph captures ------------------------------------------------------------------

    def capture_begins(self) -> None:
        """A graph capture is about to begin on the serving thread: wait for the checker's
        device work in flight, if any, to end; the checker starts none until `capture_ends`
        (a capture in CUDA's global mode fails on another thread's device call)."""
        with self._gate:
            self._captures += 1
            while self._in_device and self.thread.is_alive():
                self._gate.wait(0.05)

    def capture_ends(self) -> None:
        with self._gate:
            self._captures = max(0, self._captures - 1)
            self._gate.notify_all()

    @contextlib.contextmanager
    def _device_work(self, device: bool = True):
        """The checker's device work (copies, the reference on the GPU): never during a
        capture. Yields False, doing nothing, when the shadow stops while it waits (the item
        is then counted as skipped, as queued items are). `device=False` (the reference on
        the host): no wait, yields True."""
        ok = False
        if device:
            with self._gate:
                while self._captures and not self._stop.is_set():
                    self._gate.wait(0.05)
                ok = not self._captures
                self._in_device = ok
        if device and not ok:
            with self.lock:
                self.counts["skipped"] += 1
        try:
            yield ok or not device
        finally:
            if ok:
                with self._gate:
                    self._in_device = False
                    self._gate.notify_all()

    # --- the checker ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.checker == "process":
                self._worker_conn()                # started before any item: its imports off the first check
            self.ready.set()
            while not self._stop.is_set():
                try:                               # a stop sends _WAKE (a stop that drops the queue
                    item = self.items.get(timeout=CHECKER_IDLE_S)     # may take it first: then the timeout)
                except queue.Empty:
                    continue
                if item is _WAKE:
                    self.items.task_done()
                    continue
                try:
                    self._one(item)
                finally:
                    self.items.task_done()
                    with self.lock:
                        self.counts["queued"] = self.items.qsize()
                    if item.release is not None:
                        item.release()
        except BaseException as e:                # the checker's own failure: the shadow goes off
            self.fail(f"checker: {type(e).__name__}: {e}", traceback.format_exc())
        finally:
            with self.lock:
                self.counts["checker_alive"] = 0
                self._accepting = False            # under the lock: no item comes in after the drop
            self._drop()                           # what it will never check: counted as skipped
            self._close_worker()
            self.ready.set()                       # a waiter for a checker that never started goes on
            self._safe_prom()

    def _on(self, device: str):
        """A context running torch work on `device` and, on a GPU, on the checker's stream
        there (the lowest priority the device offers; made once per device, on that device:
        the checker thread does not inherit the serving thread's current device)."""
        if not device.startswith("cuda"):
            return _null()
        dev = torch.device(device)
        stream = self._streams.get(dev)
        if stream is None:
            with torch.cuda.device(dev):
                try:
                    stream = torch.cuda.Stream(device=dev, priority=torch.cuda.Stream.priority_range()[0])
                except Exception:
                    stream = torch.cuda.Stream(device=dev)
            self._streams[dev] = stream
        return _cuda_on(dev, stream)

    def _host(self, item: _Item) -> tuple[dict, str]:
        """(the item's records on the host, the device they came from): its copies waited for
        (on the checker's stream, never the serving thread), then moved to the host there."""
        from harness.run.replay import record_op
        devs = [t.device for _, (i, _, o) in item.calls.items() for t in (*i.values(), *o.values())]
        device = str(devs[0]) if devs else "cpu"
        with self._on(device) as stream:
            if item.event is not None:
                stream.wait_event(item.event)
            host = self._segment.allocator(item.calls) if self.checker == "process" else None   # read in place
            records = {op: record_op(op, ins, scalars, outs, host) for op, (ins, scalars, outs) in item.calls.items()}
            if stream is not None:
                stream.synchronize()
        item.calls = None                          # the device buffers are free to go
        return records, device

    def _check(self, records: dict, name: str, device: str = "cpu") -> tuple[dict, list]:
        """The verdict row of one (layer, step), the reference run on `device` (on the side
        stream): as `mxval diff` judges its dump."""
        with self._on(device):
            return judge(records, name, device, self.budgets)

    def _judged(self, records: dict, name: str, where: str, layer=None, step=None) -> tuple[dict, Optional[str]]:
        """(the verdict row, the dump written or None): in this thread, or in the worker
        process (checker "process": the reference, the diff and a failing dump's write happen
        there, off this process's GIL)."""
        from harness.io.dumps import DumpError
        if self.checker == "process":
            conn = self._worker_conn()
            conn.send((name, self._segment.skeleton(records), where, self._dump_path(name),
                       dict(source=self.source, model=self.model, layer=layer, step=step)))
            kind, *rest = conn.recv()                  # waits with the GIL released
            if kind == "error":
                raise RuntimeError(f"worker: {rest[0]}")
            return rest[0], rest[1]
        try:
            row, _ = self.check(records, name + ".safetensors", where)
        except DumpError as e:                 # the served inputs break the ops' contract
            row = refused_row(name + ".safetensors", records, str(e), self.budgets)
        return row, None

    def _start_worker(self) -> None:
        """Spawn the worker process (checker "process", `spawned`), at construction, in the
        caller's thread."""
        import multiprocessing as mp

        here, there = mp.get_context("spawn").Pipe()
        warm = torch.cuda.is_available() and (self.device or "cuda").startswith("cuda")
        self.worker = spawned(_worker_main, (there, self.budgets.path, warm, self.threads, self.nice),
                              name="mxval-shadow-worker", daemon=True)
        there.close()
        self._starting = here

    def _worker_conn(self):
        """The pipe to the worker, once it said it is ready (its imports and CUDA context done)."""
        if self._conn is None:
            here, self._starting = self._starting, None
            if here is None:
                raise RuntimeError("the worker process is gone")
            msg = here.recv() if here.poll(WORKER_START_S) else None
            if not (isinstance(msg, tuple) and msg[:1] == ("ready",)):
                raise RuntimeError(f"the worker process did not start within {WORKER_START_S:g} s")
            self.worker_info = msg[1]
            self._conn = here
        return self._conn

    def _close_worker(self) -> None:
        conn, self._conn = self._conn or self._starting, None
        self._starting = None
        if conn is None:
            self._segment.close()
            return
        try:
            conn.send(None)
        except Exception:
            pass
        try:
            self.worker.join(5)
            if self.worker.is_alive():
                self.worker.kill()
            conn.close()
        except Exception:
            pass
        self._segment.close()

    def _dump_path(self, name: str) -> str:
        base = os.path.join(self.directory, FAILURES, name)
        path, n = base + ".safetensors", 1
        while os.path.exists(path):
            path, n = f"{base}_{n}.safetensors", n + 1
        return path

    def _one(self, item: _Item) -> None:
        from harness.io.dumps import write_dump
        tag = lambda v: "x" if v is None else str(v)
        name = f"layer{tag(item.layer)}_step{tag(item.step)}"
        with self._device_work() as ok:
            if not ok:
                return
            records, device = self._host(item)
        if item.release is not None:               # the ring position is free once copied out
            release, item.release = item.release, None
            release()
        where = self.device or device
        with self._device_work(where.startswith("cuda") and self.checker == "thread") as ok:
            if not ok:
                return
            row, dump = self._judged(records, name, where, item.layer, item.step)
        entry = {"event": "verdict", "time": round(time.time(), 3), "layer": item.layer, "step": item.step,
                 "mode": item.mode, "status": row["status"], "ok": bool(row["ok"]), "reason": row.get("reason", ""),
                 "row": jsonable(row)}
        if not row["ok"]:
            entry["dump"] = dump or write_dump(self._dump_path(name), records, source=self.source, model=self.model,
                                               layer=item.layer, step=item.step)
        self._append(entry)                        # durable before it is counted
        with self.lock:
            self.counts["checked"] += 1
            self.counts["passed" if row["ok"] else "failed"] += 1
        self._write_prom()

    # --- records -------------------------------------------------------------------------

    def _append(self, entry: dict) -> None:
        line = json.dumps(entry, sort_keys=True, allow_nan=False, default=str) + "\n"
        with self._log_lock:                 # one whole line at a time, durable before it returns
            self._log.write(line)
            self._log.flush()
            os.fsync(self._log.fileno())

    def _write_prom(self) -> None:
        with self._prom_lock:                # one writer at a time: the newest counts land last
            with self.lock:
                text = prometheus(self.counts)
            if text == self._prom_text:
                return
            atomic.write_text(self.prom_path, text)
            self._prom_text = text

    def _report(self) -> None:
        """The counters file, rewritten every `prom_every` seconds when the counts changed
        (the serving thread only counts; a busy checker does not hold the file back)."""
        while not self._closed.wait(self._prom_every):
            with self.lock:
                self.counts["checker_alive"] = int(self.thread.is_alive())
            self._safe_prom()

    def _safe_prom(self) -> None:
        try:
            self._write_prom()
        except Exception:
            pass

    def _stop_checker(self) -> None:
        """Ask the checker to stop after the item it is checking: a checker waiting for an
        item gets _WAKE (a full queue has a checker at work, which sees the stop next)."""
        self._stop.set()
        try:
            self.items.put_nowait(_WAKE)
        except queue.Full:
            pass

    def fail(self, why: str, trace: str = "") -> None:
        """Switch the shadow off: logged once (a warning and a log entry); never raises."""
        with self.lock:
            was, self.enabled = self.enabled, False
            self.counts["enabled"] = 0
        self._stop_checker()
        if not was:
            return
        try:
            warnings.warn(f"mxval shadow: switched off: {why}", RuntimeWarning, stacklevel=2)
        except Exception:
            pass
        try:
            self._append({"event": "off", "time": round(time.time(), 3), "why": why, "traceback": trace[-4000:]})
        except Exception:
            pass
        self._drop()
        self._safe_prom()

    def _drop(self) -> None:
        while True:
            try:
                item = self.items.get_nowait()
            except queue.Empty:
                return
            self.items.task_done()
            if item is _WAKE:
                continue
            with self.lock:
                self.counts["skipped"] += 1
                self.counts["queued"] = self.items.qsize()
            if item.release is not None:
                try:
                    item.release()
                except Exception:
                    pass

    def join(self, timeout: float = 60.0) -> bool:
        """Wait until every queued item is checked (True), or `timeout` seconds."""
        end = time.time() + timeout
        while time.time() < end:
            if self.items.unfinished_tasks == 0:
                return True
            if not self.thread.is_alive():
                return self.items.empty()
            time.sleep(0.01)
        return False

    def stop(self, *, wait: bool = True) -> None:
        """Stop the checker (after the item it is checking; queued items are dropped and
        released). The log keeps every verdict counted."""
        self._stop_checker()
        if wait and self.thread is not threading.current_thread():
            self.thread.join()
        self._drop()
        with self.lock:
            self.counts["checker_alive"] = int(self.thread.is_alive())
        self._safe_prom()

    def close(self, timeout: float = 30.0) -> None:
        """Check what is queued (for at most `timeout` seconds), stop the checker, close the log."""
        if self.enabled and self.thread.is_alive():
            self.join(timeout)
        self.stop()
        try:
            self._append({"event": "stop", "time": round(time.time(), 3), "counts": dict(self.counts)})
            self._log.close()
        except Exception:
            pass
        self._closed.set()
        try:
            self._write_prom()
        except Exception:
            pass

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.counts)


SEGMENT_ALIGN = 64                 # bytes: each field's copy starts on a cache line
SEGMENT_GROWTH = 1.25              # a segment outgrown is made this much larger than the item that outgrew it


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SEGMENT_ALIGN) * SEGMENT_ALIGN


def _field_view(buf, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over `buf`'s bytes from `offset` (no copy)."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8, count=n * dtype.itemsize, offset=offset).view(dtype).view(shape)


class Segment:
    """The host copies of one item's records, in one shared-memory segment that the worker
    process maps by name (checker "process"). One item is in the worker at a time, so one
    segment serves every item: made at the first, made larger when an item outgrows it,
    reused otherwise (its pages are touched once, not at every item). What travels through
    the pipe is the segment's name and each field's (offset, shape, dtype): a few hundred
    bytes, where pickling each copy as its own shared storage passed one file descriptor
    per field through the serving process's resource-sharer thread (on the serving
    process's GIL; on a 2-core host, sending a 32-field 30 MB item took 1.4 s that way
    against 6 ms, though a whole check's cost to a busy serving thread there was not
    measurably less)."""

    def __init__(self):
        self.shm = None
        self._fields: dict = {}           # id(tensor) -> (offset, shape, dtype name) of the current item

    def allocator(self, calls: dict):
        """record_op's `host(shape, dtype)` for the item `calls` ({op: (inputs, scalars,
        outputs)}): each copy a view of the segment, in the order record_op asks."""
        from multiprocessing import shared_memory
        need = sum(_aligned(t.numel() * t.element_size())
                   for ins, _, outs in calls.values() for t in (*ins.values(), *outs.values()))
        if self.shm is None or self.shm.size < need:
            self.close()
            self.shm = shared_memory.SharedMemory(create=True, size=max(SEGMENT_ALIGN, int(need * SEGMENT_GROWTH)))
        self._fields = {}
        at = [0]

        def host(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            end = at[0] + _aligned(math.prod(shape) * dtype.itemsize)
            if end > self.shm.size:
                raise RuntimeError("shadow: an item's fields outgrew their segment")
            v = _field_view(self.shm.buf, at[0], shape, dtype)
            self._fields[id(v)] = (at[0], tuple(shape), str(dtype).removeprefix("torch."))
            at[0] = end
            return v
        return host

    def skeleton(self, records: dict) -> tuple:
        """(segment name, records with each tensor replaced by its (offset, shape, dtype))."""
        from harness.io.dumps import OpRecord
        spec = lambda d: {k: self._fields[id(v)] for k, v in d.items()}
        return self.shm.name, {op: OpRecord(r.op, r.scalars, spec(r.inputs), spec(r.outputs))
                               for op, r in records.items()}

    def close(self) -> None:
        shm, self.shm = self.shm, None
        self._fields = {}
        if shm is None:
            return
        try:
            shm.close()
        except BufferError:                # a view still held: the mapping goes with the last one
            pass
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


class _Attached:
    """The worker's side of Segment: the segment mapped by name (kept while the name stays),
    the records rebuilt as views of it."""

    def __init__(self):
        self.shm = None

    def records(self, skeleton: tuple) -> dict:
        from multiprocessing import shared_memory

        from harness.io.dumps import OpRecord
        name, recs = skeleton
        if self.shm is None or self.shm.name != name:
            self.close()
            try:
                self.shm = shared_memory.SharedMemory(name=name, track=False)    # Python 3.13+
            except TypeError:
                # before 3.13 attaching registers the name with the resource tracker, which
                # this spawned process shares with the serving one: the same entry, which the
                # serving process's unlink removes (unregistering it here would make that
                # unlink a KeyError in the tracker)
                self.shm = shared_memory.SharedMemory(name=name)
        view = lambda d: {k: _field_view(self.shm.buf, o, shape, getattr(torch, dt)) for k, (o, shape, dt) in d.items()}
        return {op: OpRecord(r.op, r.scalars, view(r.inputs), view(r.outputs)) for op, r in recs.items()}

    def close(self) -> None:
        shm, self.shm = self.shm, None
        if shm is not None:
            try:
                shm.close()
            except BufferError:
                pass


def judge(records: dict, name: str, device: str, budgets) -> tuple[dict, list]:
    """(the verdict row, the op reports) of one (layer, step)'s records, the reference run on
    `device`: the row `mxval diff` builds for its dump, judged with the same budgets."""
    from harness.run.budgets import verdict
    from harness.run.record import dump_row
    from harness.run.replay import replay_op
    t = time.time()
    reports = [replay_op(rec, None, path=name, device=device) for rec in records.values()]
    row = dump_row(name, reports, "reference", time.time() - t)
    return verdict(row, budgets, SUITE), reports


def refused_row(name: str, records: dict, why: str, budgets) -> dict:
    """The verdict row of an item whose inputs the ops' own checks reject: an `error` row
    (what `mxval diff` calls a broken dump), judged and reported like any other."""
    from harness.run.budgets import verdict
    from harness.run.record import row
    return verdict(row(name, SUITE, "reference", outcome="error", shape=", ".join(records),
                       reason=f"the recorded inputs are outside the ops' contract: {why}"), budgets, SUITE)


def _worker_main(conn, budgets_path, warm_cuda: bool = False, threads: int = WORKER_THREADS,
                 nice: int = WORKER_NICE) -> None:
    """The worker process (checker "process"): `nice` added to its niceness, `threads` torch
    threads; per message (name, records as Segment.skeleton gives them, device, dump path,
    dump meta) the verdict row, a
    failing item written as its dump, sent back as ("row", row, dump or None), or ("error",
    why) for a failure of the worker's own."""
    try:
        os.nice(nice)                          # capped at the system's lowest priority
    except OSError:
        pass
    torch.set_num_threads(threads)
    from harness.io.dumps import DumpError, write_dump
    from harness.run import budgets as B
    from harness.run import replay  # noqa: F401  (the reference and the diff engine, imported before the first item)
    budgets = B.load(budgets_path)
    segment = _Attached()
    if warm_cuda:
        torch.zeros(1, device="cuda")          # the worker's CUDA context, made before the first item
    conn.send(("ready", {"nice": os.nice(0), "threads": torch.get_num_threads()}))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        name, skeleton, device, path, meta = msg
        try:
            records = segment.records(skeleton)
            try:
                row, _ = judge(records, name + ".safetensors", device, budgets)
            except DumpError as e:
                row = refused_row(name + ".safetensors", records, str(e), budgets)
            dump = None if row["ok"] else write_dump(path, records, **meta)
            records = None                     # no view of the segment outlives its item
            conn.send(("row", row, dump))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def spawned(target, args: tuple, *, name: str, daemon: bool = False):
    """A started process (the spawn method: a fresh interpreter, no CUDA state inherited)
    running target(*args). The child would import the parent's `__main__` (a script without
    a `__name__` guard would run again there): it is given an empty one, for the moment of
    the start only."""
    import multiprocessing as mp
    import sys
    import types
    p = mp.get_context("spawn").Process(target=target, args=args, name=name, daemon=daemon)
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        p.start()
    finally:
        sys.modules["__main__"] = main
    return p


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


class _cuda_on:
    """torch.cuda.device(dev) and torch.cuda.stream(stream) together; yields the stream."""

    def __init__(self, dev, stream):
        self.dev, self.stream = torch.cuda.device(dev), torch.cuda.stream(stream)
        self.s = stream

    def __enter__(self):
        self.dev.__enter__()
        self.stream.__enter__()
        return self.s

    def __exit__(self, *a):
        self.stream.__exit__(*a)
        self.dev.__exit__(*a)
        return False


def jsonable(v):
    """v as JSON takes it (NaN as null, infinities as strings, other objects as their str)."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return str(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def from_env(*, model: str = "deepseek-v4-pro", source: str = "mxval shadow") -> Optional[Shadow]:
    """A Shadow configured from MXVAL_SHADOW* (None when MXVAL_SHADOW is unset or 0)."""
    raw = env.text(ENV_RATE)
    if raw in ("", "0"):
        return None
    rate = env.number(ENV_RATE, 0.0, 1.0)
    directory = env.text(ENV_DIR) or env.text("MXVAL_CAPTURE_DIR")
    if not directory:
        raise env.EnvError(f"{ENV_RATE}={env.show(raw)}: set {ENV_DIR} (the verdict log, counters and failing dumps)")
    env.directory(ENV_DIR if env.text(ENV_DIR) else "MXVAL_CAPTURE_DIR", directory)
    ring = env.integer(ENV_RING, RING_DEFAULT, 1, 2 ** 16)
    seed = env.integer(ENV_SEED, 0, 0, 2 ** 63)
    device = env.text(ENV_DEVICE) or None
    checker = env.text(ENV_CHECKER) or CHECKER_DEFAULT
    if checker not in CHECKERS:
        raise env.EnvError(f"{ENV_CHECKER}={env.show(checker)}: expected one of {', '.join(CHECKERS)}")
    return Shadow(directory, rate, ring=ring, seed=seed, device=device, budgets=env.text(ENV_BUDGETS) or None,
                  model=model, source=source, checker=checker)


def read_log(path) -> tuple[list[dict], list[str]]:
    """(entries, problems) of a verdict log; a torn last line (a write cut short by a kill)
    is a problem, never an error."""
    entries, problems = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            if not isinstance(e, dict):
                raise ValueError("not an object")
            entries.append(e)
        except ValueError as ex:
            problems.append(f"line {n}: not a JSON object ({ex})"[:200])
    return entries, problems
