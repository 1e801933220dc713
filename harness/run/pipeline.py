"""The run object: one mxval run, assembled once. `validate`, `diff`, `selftest` and
`report --merge` each parse their arguments and hand the rest to a `Run`:

    plan     `Run.plan_cases` (a suite or named cases, checked before any work), the
             budgets checked against every case's metric keys, `--shard K/N` (`Run.pick`),
             `-j N` capped (`Run.cap_jobs`), the report directory claimed (`Run.claim`);
    run      `Run.execute`: the cases through `harness.run.runner.run_cases`, a progress bar,
             Ctrl-C/SIGTERM turned into a partial run (`Run.stopped`);
    judge    `Run.judge`: the budgets' verdict on each row;
    record   `Run.meta` (the run metadata, harness.run.record.run_meta), `Run.record`
             (every report format, the console table, the exit status).

Report rows are built in harness/run/record.py.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness.diff.metrics import run_keys
from harness.errors import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, InputError, ReportError, UsageError
from harness.io import atomic, escape, report
from harness.run import budgets as B
from harness.run import memory, runner, stagetime
from harness.run import shard as S
from harness.run.cases import Catalog, on_path
from harness.run.geometry import geometry
from harness.run.record import run_meta
from harness.run.signals import deferred, hold, pending, release, stopped_by
from optimized import BackendUnavailable, get_backend

# --- helpers: what a command resolves before its run, and what a stopped run records ------------

def interrupted_meta(e: runner.RunInterrupted) -> dict:
    """`run.interrupted` of a partial report."""
    return {"signal": stopped_by(), "cases_done": len(e.rows), "cancelled": list(e.cancelled)}


def backend(name: str):
    """The backend named on the command line; UsageError naming --backend when it cannot run."""
    try:
        return get_backend(name)
    except BackendUnavailable as e:
        raise UsageError(f"--backend: {e}") from None


AUTO_GPU_WORKERS = 8        # -j auto on a GPU: worker processes beside this one


def cap_jobs(requested, items: int, device: str) -> tuple[int, dict]:
    """-j (a positive int, or "auto") as worker processes: (jobs, {requested, used, cap}).

    * CPU backend: N capped at the items and the CPUs; auto is 1 (this process).
    * GPU backend with MXVAL_GPU_MEMORY_FRACTION=f: every case in a worker capped at f of
      its GPU, at most 1/f workers per GPU; auto is 1 (this process: the share says
      several mxval processes are sharing the GPU).
    * GPU backend without it: N workers share the GPUs for the small cases (`runner`'s
      `SMALL_CASE_BYTES`) while this process runs the large ones one at a time; capped at
      the items and at half the CPUs (Triton compiles on the CPU). auto is that cap, at most
      `AUTO_GPU_WORKERS`: a fresh machine compiles every kernel specialization the run
      needs, in parallel."""
    gpu = device != "cpu" and torch.cuda.is_available()
    share = memory.fraction() if gpu else None
    if gpu and share:
        per_gpu = max(1, int(1.0 / share + 1e-9))
        units = torch.cuda.device_count() * per_gpu
        what = f"GPU share(s) of {memory.FRACTION_ENV}={share:g}"
    elif gpu:
        units, what = max(1, runner.cpus() // 2), "worker(s): half the CPUs"
    else:
        units, what = runner.cpus(), "CPU(s)"
    if requested == "auto":
        jobs = min(AUTO_GPU_WORKERS, units, items) if gpu and not share else 1
        return max(1, jobs), {"requested": "auto", "used": max(1, jobs), "cap": ""}
    if not isinstance(requested, int) or requested < 1:
        raise UsageError(f"--jobs: expected 'auto' or a positive whole number, got {requested!r}")
    jobs = max(1, min(requested, items, units))
    cap = ""
    if jobs < requested:
        cap = f"{items} case(s)" if items <= units else f"{units} {what}"
    return jobs, {"requested": requested, "used": jobs, "cap": cap}


def known_names(cases_dir=None) -> tuple[set, set]:
    """(case names, suite names) of the catalogue, empty when it cannot be read."""
    try:
        catalog = Catalog(cases_dir)
    except InputError:                       # no catalogue here: nothing to check the budgets against
        return set(), set()
    return set(catalog.by_name), set(catalog.suites)


# --- the run object ------------------------------------------------------------------------

class Run:
    """One run: `command` over `suite`, judged by `budgets` (a file path or None for the
    default), its reports in `report_dir` (None: a fresh reports/<name>-<time>-<pid>).
    `owner` (the parsed arguments) is told the claimed directory, for the traceback of a
    crash and for removing a fresh directory on bad input."""

    def __init__(self, command: str, *, budgets=None, suite: str = "", shard: Optional[str] = None,
                 report_dir=None, force: bool = False, quiet: bool = False, owner=None):
        self.command, self.suite, self.quiet = command, suite, quiet
        try:
            memory.fraction()                  # a bad cap or switch is a usage error before any work
            stagetime.enabled()
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.started = time.time()
        self.part = S.parse(shard) if shard is not None else None
        self.budgets_path = budgets
        self.budgets: Optional[B.Budgets] = None
        self.keys: dict[str, set] = {}
        self.report_dir, self.force, self.owner = report_dir, force, owner
        self.out: Optional[Path] = None
        self.jobs_info: Optional[dict] = None
        self.stopped: Optional[dict] = None

    # plan
    def load_budgets(self) -> B.Budgets:
        if self.budgets is None:
            self.budgets = B.load(self.budgets_path)
        return self.budgets

    def plan_cases(self, cases_dir=None, suite=None, names=None, path=None) -> list:
        """The cases of a suite (or the named cases), on `path` when given, each with a
        geometry that can run; the budgets checked against their metric keys."""
        catalog = Catalog(cases_dir)
        self.suite, cases = catalog.select(suite, names)
        if path:
            cases = [on_path(c, path) for c in cases]
        self.load_budgets()
        self.check_budgets({c.name: c.ops for c in cases}, catalog)
        for c in cases:
            geometry(c)
        return cases

    def check_budgets(self, ops_of: dict, catalog: Optional[Catalog] = None, *, chain: bool = True,
                      what: str = "case") -> None:
        """`ops_of`: item name -> its ops. The budgets must fit every item's metric keys."""
        self.load_budgets()
        self.keys = {name: run_keys(ops, chain=chain) for name, ops in ops_of.items()}
        if catalog is not None:
            cases, suites = set(catalog.by_name), set(catalog.suites) | {"diff", "cases"}
        else:
            cases, suites = known_names()
            suites |= {"cases"}
        self.budgets.check_run(self.keys, self.suite, known_cases=cases, known_suites=suites, what=what)

    def pick(self, items: Sequence, cost: Callable = S.case_cost, name: Callable = lambda c: c.name) -> list:
        """This run's shard of `items` (all of them when unsharded)."""
        return list(items) if self.part is None else S.pick(items, *self.part, cost, name)

    def shard_suffix(self) -> str:
        return f"-shard{self.part[0]}of{self.part[1]}" if self.part else ""

    def cap_jobs(self, requested: int, items: int, device: str) -> int:
        jobs, self.jobs_info = cap_jobs(requested, items, device)
        if self.jobs_info["cap"]:
            print(f"note: -j {requested} capped at {jobs} ({self.jobs_info['cap']})", file=sys.stderr)
        return jobs

    def claim(self, name: str) -> Path:
        """The report directory, before any work: `report_dir` refused when it holds another
        run's report (unless `force`), else a fresh reports/<name>-<time>-<pid>."""
        if self.report_dir:
            fresh = not Path(self.report_dir).exists()
            self.out = report.claim_dir(self.report_dir, force=self.force)
        else:
            fresh = True
            self.out = report.claim_dir(report.default_dir(name))
        if self.owner is not None:
            self.owner.claimed_report_dir, self.owner.claimed_fresh = str(self.out), fresh
        return self.out

    # run
    def execute(self, groups: Sequence[tuple[str, Sequence]], *, jobs: int = 1,
                case_timeout: Optional[float] = None, title: str = "",
                case_of: Callable = lambda item: item, label: Callable = lambda item: item.name) -> list[tuple]:
        """[(item, row)] of each group `(backend name, items)` run in order; `case_of(item)` is
        the case an item runs. Ctrl-C or SIGTERM stops it: what finished is returned and
        `self.stopped` says what did not (`label(item)` names the cancelled)."""
        total = sum(len(items) for _, items in groups)
        results: list[tuple] = []
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.fields[last]}"), console=Console(stderr=True),
                      transient=True, disable=self.quiet) as bar:
            task = bar.add_task(escape.rich(title), total=total, last="")
            lines = report.CaseLines(total, lambda r: self.judge([r])[0], enabled=not self.quiet)  # CI logs
            for name, items in groups:
                try:
                    rows = runner.run_cases([case_of(x) for x in items], name, jobs=jobs, case_timeout=case_timeout,
                                            progress=lambda r: (bar.update(task, advance=1,
                                                                           last=escape.rich(f"{r['case']}: {r['outcome']}")),
                                                                lines(r)))
                    done = list(items)
                except runner.RunInterrupted as e:
                    hold()                       # at once: a second signal must not lose these rows
                    rows, done = e.rows, [items[i] for i in e.done]
                    self.stopped = interrupted_meta(e)
                results += zip(done, rows)
                if self.stopped:
                    finished = {id(x) for x, _ in results}
                    self.stopped["cases_done"] = len(results)
                    self.stopped["cancelled"] = [label(x) for _, its in groups for x in its if id(x) not in finished]
                    break
        if not self.stopped:
            hold()                               # released by `record`, once the report is whole
        return results

    # judge and record
    def judge(self, rows: list[dict]) -> list[dict]:
        return [B.verdict(r, self.budgets, self.suite) for r in rows]

    def meta(self, *, backend: str, backend_requested: Optional[str], backend_description: str, device: str,
             **extra) -> dict:
        """The run metadata: the machine and versions, the suite, -j, an interruption."""
        meta = run_meta(self.command, backend=backend, backend_requested=backend_requested,
                        backend_description=backend_description, device=device, started=self.started,
                        suite=self.suite, **extra)
        if self.jobs_info is not None:
            meta["jobs"] = self.jobs_info
        if self.stopped:
            meta["interrupted"] = self.stopped
        return meta

    def shard_meta(self, backend: str, all_names: list[str], all_digest: str, names: list[str]) -> Optional[dict]:
        """`run.shard`: what `mxval report --merge` checks (None when unsharded)."""
        if self.part is None:
            return None
        return S.identity(*self.part, command=self.command, suite=self.suite, backend=backend,
                          budgets=self.budgets, all_names=all_names, all_digest=all_digest, shard_names=names)

    def budgets_meta(self) -> dict:
        return {"budgets": self.budgets.as_dict(), "budgets_off": self.budgets.disabled(self.keys, self.suite)}

    def record(self, rows: list[dict], meta: dict) -> int:
        """Judge the rows, write every report format, show the console table: the exit status.
        A signal that comes before the set is written is recorded in it (`run.interrupted`,
        every case finished, none cancelled): the formats and the exit status agree."""
        meta.update(self.budgets_meta())
        df = report.frame(self.judge(rows))
        with deferred() as late:                 # a Ctrl-C now waits until the report is whole
            paths = self.write(df, meta)
            late += release()                    # the hold `execute` (or the command) took
        print(f"reports: {escape.terminal(str(self.out))}/ ({', '.join(Path(p).name for p in paths.values())})")
        self.note_moved()
        if late and not meta.get("interrupted"):
            print(f"mxval: {late[0]} once the reports were written: the run had finished", file=sys.stderr)
        if meta.get("interrupted"):
            done = meta["interrupted"].get("cancelled")
            print(f"mxval: interrupted ({meta['interrupted'].get('signal')}): "
                  + (f"partial report ({len(rows)} case(s) finished, {len(done)} cancelled)" if done
                     else f"every case had finished; the report says so ({len(rows)} case(s))"), file=sys.stderr)
            return EXIT_INTERRUPTED
        return EXIT_OK if report.summary(df, meta)["ok"] else EXIT_FAIL

    def note_moved(self) -> None:
        if self.out is not None and atomic.moved(self.out):
            print(f"mxval: {escape.terminal(str(self.out))}: replaced while the run ran; its reports went into "
                  "the directory it claimed, wherever that is now", file=sys.stderr)

    def write(self, df, meta: dict, *, extra: Optional[dict] = None, on_signal: Optional[Callable] = None,
              console: bool = True) -> dict:
        """Every report format into the claimed directory as one set, and the console table:
        {format: path}. A signal held since the work ended marks `meta` interrupted before the
        set is written (or, when it came during the writing, the set is written again, marked);
        `on_signal(meta)` updates `extra` then."""
        def again() -> bool:
            got = pending()
            if not got or meta.get("interrupted"):
                return False
            meta["interrupted"] = {"signal": got[0], "cases_done": len(df), "cancelled": []}
            if on_signal is not None:
                on_signal(meta)
            return True
        paths = write_reports(df, meta, self.out, extra=extra, again=again)
        if again():                              # a signal during the swap: the set again, marked
            paths = write_reports(df, meta, self.out, extra=extra)
        if console and not self.quiet:
            report.console_table(df, meta)
        return paths


def write_reports(df, meta: dict, out: Path, **kw) -> dict:
    """Every format into `out` as one set, checked writable before the run: a full disk leaves
    the old set whole and still shows the verdict in the one-line error."""
    try:
        return report.write_all(df, meta, out, **kw)
    except OSError as e:
        s = report.summary(df, meta)
        raise ReportError(f"{escape.terminal(str(out))}: cannot write the reports: {e.strerror or e}; nothing "
                          f"replaced (verdict: {report.verdict_word(s)}, {s['pass']} pass, {s['fail']} fail, "
                          f"{s['error']} error)") from None
