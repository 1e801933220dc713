"""`mxval`: validate, diff, dump, cases, backends, report (+ selftest and study when present).

Exit status: 0 all budgets hold, 1 a budget is exceeded (or a case errs), 2 a usage or
input error (unknown case, suite or backend, malformed dump or budgets file). Every
error is one line, `mxval: <file or argument>: <problem>`, never a traceback
(MXVAL_DEBUG=1 shows it).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

from harness.errors import EXIT_FAIL, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, InputError, ReportError
from reference.ops import PATHS

# Subcommands other modules add: `add_parser(subparsers)` and `run(args) -> int`.
PLUGIN_COMMANDS = ("selftest", "study", "upstream_cmd")


class UsageError(InputError):
    """A bad argument or input file; the message is the one line printed."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def stderr_console():
    from rich.console import Console
    return Console(stderr=True)


def machine(device: str) -> str:
    import torch
    if device != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (torch {torch.__version__}, CPU)"


def _check_writable_path(arg: str, path, *, is_dir: bool) -> None:
    """Fail before any case runs when an output path can never be written: a file where a
    directory must go (or the reverse), or a file standing where a parent directory is needed."""
    p = Path(path)
    if is_dir and p.exists() and not p.is_dir():
        raise UsageError(f"{arg}: {p} exists and is not a directory")
    if not is_dir and p.is_dir():
        raise UsageError(f"{arg}: {p} is a directory, expected a file name")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{arg}: {parent} is not a directory, cannot write {p}")
            break


def claim_report_dir(args, name: str) -> Path:
    """The run's report directory, before any work: `--report-dir` refused when it holds
    another run's report (unless --force), else a fresh `reports/<name>-<time>-<pid>`;
    either way proven writable. Remembered on `args` for the traceback of a crash."""
    from harness.io import report
    if getattr(args, "report_dir", None):
        fresh = not Path(args.report_dir).exists()
        out = report.claim_dir(args.report_dir, force=getattr(args, "force", False))
    else:
        fresh = True
        out = report.claim_dir(report.default_dir(name))
    args.claimed_report_dir = str(out)
    args.claimed_fresh = fresh
    return out


def _unclaim(args) -> None:
    """Bad input found after the directory was claimed: leave no empty report directory
    behind (a directory that existed before, or holds anything, stays)."""
    d = getattr(args, "claimed_report_dir", None)
    if d and getattr(args, "claimed_fresh", False):
        try:
            Path(d).rmdir()
        except OSError:
            pass


_SIGNAL = {"name": "SIGINT"}


def interrupted_meta(e) -> dict:
    """`run.interrupted` of a partial report (harness.run.runner.RunInterrupted)."""
    return {"signal": _SIGNAL["name"], "cases_done": len(e.rows), "cancelled": list(e.cancelled)}


def _on_sigterm(signum, frame):
    """SIGTERM (a CI job cancelled, `timeout`) stops a run as Ctrl-C does: a partial report."""
    _SIGNAL["name"] = "SIGTERM"
    raise KeyboardInterrupt


def _catch_sigterm():
    """Installed only where nobody else handles SIGTERM, and only in the main thread."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def _backend(name: str):
    from optimized import BackendUnavailable, get_backend
    try:
        return get_backend(name)
    except BackendUnavailable as e:
        raise UsageError(f"--backend: {e}") from None


def _finish(rows: list[dict], meta: dict, budgets, suite: str, report_dir: str, quiet: bool,
            run_keys: dict) -> int:
    from harness.io import report
    from harness.run.budgets import verdict
    rows = [verdict(r, budgets, suite) for r in rows]
    df = report.frame(rows)
    meta["budgets"] = budgets.as_dict()
    meta["budgets_off"] = budgets.disabled(run_keys, suite)
    out = Path(report_dir)                  # claimed before the run (claim_report_dir)
    try:
        paths = report.write_all(df, meta, out)
    except OSError as e:           # checked writable before the run; a full disk still can't hide the verdict
        s = report.summary(df, meta)
        raise ReportError(f"{out}: cannot write the reports: {e.strerror or e} (verdict: {report.verdict_word(s)}, "
                          f"{s['pass']} pass, {s['fail']} fail, {s['error']} error)") from None
    if not quiet:
        report.console_table(df, meta)
    print(f"reports: {out}/ ({', '.join(Path(p).name for p in paths.values())})")
    if meta.get("interrupted"):
        print(f"mxval: interrupted: partial report ({len(rows)} case(s) finished, "
              f"{len(meta['interrupted']['cancelled'])} cancelled)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK if report.summary(df)["ok"] else EXIT_FAIL


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cap_jobs(requested: int, items: int, device: str) -> tuple[int, dict]:
    """-j N capped at the number of items to run and of CPUs (GPUs for a GPU backend):
    (jobs, {requested, used, cap}); the cap is printed by the caller and kept in the report."""
    import torch
    if requested < 1:
        raise UsageError(f"-j: expected a positive number of jobs, got {requested}")
    gpu = device != "cpu" and torch.cuda.is_available()
    units, what = (torch.cuda.device_count(), "GPU(s)") if gpu else (_cpus(), "CPU(s)")
    jobs = max(1, min(requested, items, units))
    cap = ""
    if jobs < requested:
        cap = f"{items} case(s)" if items <= units else f"{units} {what}"
    return jobs, {"requested": requested, "used": jobs, "cap": cap}


def say_cap(info: dict) -> None:
    if info["cap"]:
        print(f"note: -j {info['requested']} capped at {info['used']} ({info['cap']})", file=sys.stderr)


def _meta(command: str, be, requested: str, started: float) -> dict:
    import torch
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = None
    return {"command": command, "backend": be.name, "backend_requested": requested,
            "backend_description": be.description, "device": str(be.device), "machine": machine(str(be.device)),
            "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "seconds": round(time.time() - started, 3), "argv": sys.argv[1:],
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": tv}}


# --- validate --------------------------------------------------------------------------------

def cmd_validate(args) -> int:
    from harness.run import budgets as B
    from harness.run import shard as S
    from harness.run.cases import Catalog
    from harness.run.inputs import geometry
    from harness.run.runner import RunInterrupted, run_cases
    t0 = time.time()
    part = S.parse(args.shard) if getattr(args, "shard", None) is not None else None
    from harness.diff.metrics import run_keys
    catalog = Catalog(args.cases_dir)
    suite, cases = catalog.select(args.suite, args.case)
    if args.path:
        from harness.run.cases import on_path
        cases = [on_path(c, args.path) for c in cases]
    budgets = B.load(args.budgets)
    keys = {c.name: run_keys(c.ops) for c in cases}
    budgets.check_run(keys, suite, known_cases=catalog.by_name, known_suites=set(catalog.suites) | {"diff", "cases"})
    for c in cases:
        geometry(c)
    be = _backend(args.backend)
    all_cases = cases
    if part:
        cases = S.pick(all_cases, *part, S.case_cost, lambda c: c.name)
    jobs, jobs_info = cap_jobs(args.jobs, len(cases), str(be.device))
    say_cap(jobs_info)
    out = claim_report_dir(args, f"validate-{suite}-{be.name}" + (f"-shard{part[0]}of{part[1]}" if part else ""))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harness.io.escape import rich as rich_text
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[last]}"),
                  console=stderr_console(), transient=True, disable=args.quiet) as bar:
        task = bar.add_task(rich_text(f"{suite} on {be.name}"), total=len(cases), last="")
        try:
            rows = run_cases(cases, be.name, jobs=jobs, case_timeout=args.case_timeout,
                             progress=lambda r: bar.update(task, advance=1, last=rich_text(f"{r['case']}: {r['outcome']}")))
            stopped = None
        except RunInterrupted as e:
            rows, stopped = e.rows, interrupted_meta(e)
    meta = _meta("validate", be, args.backend, t0)
    meta["suite"] = suite
    meta["cases"] = [c.name for c in cases]
    meta["jobs"] = jobs_info
    if args.path:
        meta["path"] = args.path
    if stopped:
        meta["interrupted"] = stopped
    if part:
        meta["shard"] = S.identity(*part, command="validate", suite=suite, backend=be.name, budgets=budgets,
                                   all_names=[c.name for c in all_cases], all_digest=S.case_digest(all_cases),
                                   shard_names=[c.name for c in cases])
        if not cases and not args.quiet:
            print(f"shard {part[0]}/{part[1]}: no case of the {len(all_cases)} falls in this shard")
    return _finish(rows, meta, budgets, suite, str(out), args.quiet, keys)


# --- diff ------------------------------------------------------------------------------------

def _dump_row(path: str, reports, backend: str, seconds: float) -> dict:
    from harness.run.runner import MAX_FINDINGS, jsonable
    metrics, findings, summaries = {}, [], {}
    for rep in reports:
        for k, v in rep.metrics.items():
            metrics[f"{rep.op}.{k}"] = float(v)
        findings += [{"stage": rep.op, "step": 0, **jsonable(f)} for f in rep.findings[:MAX_FINDINGS]]
        summaries[rep.op] = [rep.summary()]
    nonfinite = [r for r in reports if r.metrics.get("nonfinite_inputs")]
    outcome = "nonfinite_input" if nonfinite else "ok"
    reason = "; ".join(f["where"] for r in nonfinite for f in r.findings[:1]) if nonfinite else ""
    return {"case": os.path.basename(path), "suite": "diff", "backend": backend, "outcome": outcome, "reason": reason,
            "seconds": round(seconds, 3), "context": None, "shape": ", ".join(r.op for r in reports),
            "description": path, "expect_nonfinite": False, "metrics": metrics, "findings": findings,
            "summaries": summaries, "details": {}, "planted": []}


def cmd_diff(args) -> int:
    from harness.diff.metrics import run_keys
    from harness.io.dumps import read_dump
    from harness.run import budgets as B
    from harness.run.cases import Catalog
    from harness.run.replay import replay_dump
    t0 = time.time()
    budgets = B.load(args.budgets)
    be = _backend(args.backend) if args.backend else None
    seen: dict[str, str] = {}
    for p in args.files:                                # a report row is named by its file name
        name = os.path.basename(p)
        if name in seen:
            raise UsageError(f"{p}: same file name as {seen[name]} (each file is one report row, named by "
                             "its file name: rename one)")
        seen[name] = p
    dumps = [read_dump(p) for p in args.files]          # every file is checked before any runs
    keys = {os.path.basename(d.path): run_keys(d.ops, chain=False) for d in dumps}
    try:
        catalog = Catalog()
        known_cases, known_suites = set(catalog.by_name), set(catalog.suites)
    except InputError:
        known_cases, known_suites = set(), set()
    budgets.check_run(keys, "diff", known_cases=known_cases, known_suites=known_suites | {"cases"},
                      what="file")
    out = claim_report_dir(args, f"diff-diff-{be.name if be else 'reference'}")
    rows = []
    for d in dumps:
        t = time.time()
        reports = replay_dump(d, backend=be)
        rows.append(_dump_row(d.path, reports, be.name if be else "reference", time.time() - t))
    from optimized import Backend
    shown = be or Backend("reference", "the reference replays each dump's inputs")
    meta = _meta("diff", shown, args.backend or "reference", t0)
    meta["suite"] = "diff"
    meta["files"] = list(args.files)
    return _finish(rows, meta, budgets, "diff", str(out), args.quiet, keys)


# --- dump ------------------------------------------------------------------------------------

def cmd_dump(args) -> int:
    from harness.io.dumps import OpRecord, write_dump
    from harness.run.cases import Catalog
    from harness.run.inputs import build
    from harness.run.runner import run_case
    catalog = Catalog(args.cases_dir)
    case = catalog.case(args.case)
    be = _backend(args.backend)
    inputs = build(case, be.device)
    n_steps = len(inputs.steps)
    step = n_steps - 1 if args.step is None else args.step
    if not 0 <= step < n_steps:
        raise UsageError(f"--step: case {case.name!r} has steps 0..{n_steps - 1}, got {step}")
    records: dict = {}

    def recorder(i, op, ins, scalars, outputs):
        if i == step:
            records[op] = OpRecord(op, dict(scalars), dict(ins), dict(outputs))

    row = run_case(case, be.name, recorder=recorder, inputs=inputs)
    if not records:
        print(f"mxval: case {case.name}: no op of step {step} ran on the backend ({row['outcome']}: "
              f"{row['reason']})", file=sys.stderr)
        return EXIT_FAIL
    from harness.io.atomic import safe_name
    out = args.output or str(Path("reports") / "dumps" / f"{safe_name(case.name)}.{safe_name(be.name)}.step{step}.safetensors")
    write_dump(out, records, within=None if args.output else "reports", source=f"mxval dump: case {case.name} (seed {case.seed}), backend {be.name} "
                                    f"({be.description}), step {step} of {n_steps}, {machine(str(be.device))}",
               model=case.preset, step=step)
    print(f"wrote {out}: {', '.join(records)} (step {step} of {n_steps}; case outcome {row['outcome']}"
          f"{': ' + row['reason'] if row['reason'] else ''})")
    return EXIT_OK


# --- cases, backends, report -------------------------------------------------------------------

def cmd_cases(args) -> int:
    from rich.table import Table

    from harness.io.report import wide_console
    from harness.run.cases import Catalog
    from harness.run.inputs import geometry
    catalog = Catalog(args.cases_dir)
    if args.suite and args.suite not in catalog.suites:
        raise UsageError(f"--suite: unknown suite {args.suite!r} (known: {', '.join(catalog.suites)})")
    for c in catalog.by_name.values():        # shapes too: a case that cannot run is an error here
        geometry(c)
    con = wide_console()
    for name, s in catalog.suites.items():
        if args.suite and name != args.suite:
            continue
        cases = catalog.suite_cases(name)
        t = Table(title=f"suite {name} ({len(cases)} cases; {s.file}"
                        + (f"; includes {', '.join(s.include)}" if s.include else "") + f") {s.description}")
        for col in ("case", "from", "ops", "shape", "needs", "description"):
            t.add_column(col, overflow="fold")
        for c in cases:
            from reference.ops import chain as _chain
            ops = ("chain" if c.ops == _chain(c.fmt, c.path) else
                   ",".join("pool+k" if o.startswith("compress_norm") else o.split("_")[0] for o in c.ops))
            if c.path == "cuda":
                ops += " (cuda)"
            t.add_row(c.name, c.suite, f"{c.fmt}:{ops}", c.summary(), c.requires or "",
                      c.description)
        con.print(t)
    return EXIT_OK


def cmd_backends(args) -> int:
    from rich.table import Table

    import optimized
    if args.faults:
        optimized._load_extra()
    t = Table(title="backends")
    for col in ("name", "status", "device", "description / why not"):
        t.add_column(col, overflow="fold")
    for name in optimized.backend_names(include_extra=args.faults):
        if name == "auto":
            t.add_row("auto", "[green]->[/] " + optimized.auto_backend_name(), "", "the best available here")
            continue
        try:
            be = optimized.get_backend(name, require=False)
        except optimized.BackendUnavailable as e:
            t.add_row(name, "[red]unavailable[/]", "", str(e))
            continue
        why = be.available()
        t.add_row(name, "[red]unavailable[/]" if why else "[green]available[/]", str(be.device),
                  why or be.description)
    from harness.io.report import wide_console
    wide_console().print(t)
    return EXIT_OK


def cmd_report(args) -> int:
    """Re-render DIR's reports from its report.json, which is never rewritten (copied as it
    is into another --report-dir); `--merge DIR...` combines shard reports."""
    from harness.io import report
    if getattr(args, "merge", False):
        from harness.io.merge import merge_command
        return merge_command(args)
    if args.dir is None:
        raise UsageError("report: give a report directory DIR (or --merge DIR...)")
    src = Path(args.dir) / "report.json"
    df, meta = report.load(args.dir)
    out = Path(args.report_dir or args.dir)
    if args.report_dir and not report._same_file(src.parent, out):
        report.claim_dir(out, force=args.force)
    paths = report.write_all(df, meta, out, json_source=src)
    if not args.quiet:
        report.console_table(df, meta)
    print(f"reports: {out}/ ({', '.join(Path(p).name for p in paths.values())})")
    if meta.get("interrupted"):
        return EXIT_INTERRUPTED
    return EXIT_OK if report.summary(df, meta)["ok"] else EXIT_FAIL


# --- parser and main ---------------------------------------------------------------------------

def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    ap = _Parser(prog="mxval", description="numerics validation of the DeepSeek-V4 MXFP4 indexer")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    run = {}

    def common(p, *, cases=True, budgets=True, report_dir=True):
        if cases:
            p.add_argument("--cases-dir", default=None, help="directory of suite TOML files (default: cases/)")
        if budgets:
            p.add_argument("--budgets", default=None, help="budgets TOML (default: cases/budgets.toml)")
        if report_dir:
            p.add_argument("--report-dir", default=None, help="where reports go (default: reports/<run>/)")
            add_force(p)
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or console table")

    p = sub.add_parser("validate", help="run a suite or cases against a backend and apply budgets")
    g = p.add_argument_group("what to run").add_mutually_exclusive_group()
    g.add_argument("--suite", default=None, help="suite name (default: default)")
    g.add_argument("--case", action="append", default=None, metavar="NAME",
                   help="a case (repeatable; not with --suite)")
    p.add_argument("--backend", default="auto", help="backend name (see `mxval backends`)")
    p.add_argument("--path", default=None, choices=PATHS,
                   help="run every case on this path (cuda: vLLM's fused pool+K op, natural pages; "
                        "default: each case's own)")
    p.add_argument("-j", "--jobs", type=int, default=1, help="cases in parallel (processes)")
    add_shard(p)
    add_case_timeout(p)
    common(p)
    run["validate"] = cmd_validate

    p = sub.add_parser("diff", help="replay captured dumps and diff them (budgets apply)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--backend", default=None,
                   help="replay the dump's inputs through this backend instead of the reference")
    common(p, cases=False)
    run["diff"] = cmd_diff

    p = sub.add_parser("dump", help="run a case on a backend and write one dump of its chain")
    p.add_argument("--case", required=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--step", type=int, default=None, help="which step of the case (default: the last)")
    p.add_argument("-o", "--output", default=None, help="dump file (default: reports/dumps/...)")
    p.add_argument("--cases-dir", default=None)
    run["dump"] = cmd_dump

    p = sub.add_parser("cases", help="list suites and cases")
    p.add_argument("--suite", default=None)
    p.add_argument("--cases-dir", default=None)
    run["cases"] = cmd_cases

    p = sub.add_parser("backends", help="which backends run here, and why not")
    p.add_argument("--faults", action="store_true", help="also list the fault catalogue's broken backends")
    run["backends"] = cmd_backends

    p = sub.add_parser("report", help="re-render the reports of a run directory (or merge shard reports)")
    p.add_argument("dir", nargs="?", default=None)
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="combine the reports of `--shard K/N` runs into one (every format)")
    p.add_argument("--report-dir", default=None, help="write there instead of DIR")
    add_force(p)
    p.add_argument("-q", "--quiet", action="store_true")
    run["report"] = cmd_report

    for name in PLUGIN_COMMANDS:
        try:
            mod = importlib.import_module(f"harness.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"harness.{name}":
                raise
            continue
        mod.add_parser(sub)
        run[getattr(mod, "COMMAND", name)] = mod.run
    return ap, run


def add_force(p) -> None:
    p.add_argument("--force", action="store_true",
                   help="replace the report of another run in --report-dir (refused without it)")


MAX_CASE_TIMEOUT = 7 * 24 * 3600.0


def _seconds(text: str) -> float:
    """argparse type of --case-timeout: a positive number of seconds."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= MAX_CASE_TIMEOUT:
        raise argparse.ArgumentTypeError(f"expected a number of seconds in (0, {MAX_CASE_TIMEOUT}], got {text!r:.40}")
    return v


def add_case_timeout(p) -> None:
    p.add_argument("--case-timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="an error row for a case still running after SECONDS (its worker is killed: a hung "
                        "kernel costs one case, not the run)")


def add_shard(p) -> None:
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="run only shard K of N (1-based; a deterministic, balanced slice) and "
                        "record it for `mxval report --merge`")
def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Arguments argparse lets through but that would mean something else: an empty value
    (`--suite ""` would run the default suite) is a usage error naming the flag."""
    parsers = [ap]
    for act in ap._actions:
        if isinstance(act, argparse._SubParsersAction) and getattr(args, act.dest, None) in act.choices:
            parsers.append(act.choices[getattr(args, act.dest)])
    for parser in parsers:
        for act in parser._actions:
            v = getattr(args, act.dest, None)
            vals = v if isinstance(v, list) else [v]
            if any(isinstance(x, str) and not x.strip() for x in vals):
                flag = act.option_strings[-1] if act.option_strings else act.metavar or act.dest
                raise UsageError(f"{flag}: empty value")


def _one_line(e: BaseException) -> str:
    """The first line of an error, with no control character for the terminal."""
    from harness.io.escape import terminal
    s = str(e).strip()
    return terminal(s.splitlines()[0]) if s else type(e).__name__


def main(argv: Optional[list[str]] = None) -> int:
    from optimized import BackendUnavailable
    try:
        ap, run = build_parser()
        args = ap.parse_args(argv)
        check_args(ap, args)
        if getattr(args, "report_dir", None):
            _check_writable_path("--report-dir", args.report_dir, is_dir=True)
        for attr, flag in (("output", "-o"), ("json", "--json"), ("markdown", "--markdown"), ("readme", "--readme")):
            if isinstance(getattr(args, attr, None), str):
                _check_writable_path(flag, getattr(args, attr), is_dir=False)
        previous = _catch_sigterm()
        _SIGNAL["name"] = "SIGINT"
        try:
            return int(run[args.cmd](args) or 0)
        finally:
            from harness.io.report import release_locks
            release_locks()
            if previous is not None:
                import signal
                signal.signal(signal.SIGTERM, previous)
    except (InputError, BackendUnavailable) as e:
        _unclaim(locals().get("args"))
        print(f"mxval: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("mxval: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as e:           # --help
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_USAGE
    except OSError as e:              # a file or directory named on the command line
        print(f"mxval: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:            # a bug in mxval or in a backend, never the user's input
        if os.environ.get("MXVAL_DEBUG"):
            raise
        tb = e.__traceback__
        while tb and tb.tb_next:
            tb = tb.tb_next
        where = f" ({os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})" if tb else ""
        saved = _save_traceback(e, locals().get("args"))
        print(f"mxval: internal error {type(e).__name__}: {_one_line(e)}{where}; traceback in {saved} "
              "(MXVAL_DEBUG=1 shows it)", file=sys.stderr)
        return EXIT_INTERNAL


def _save_traceback(e: BaseException, args) -> str:
    """Write the traceback next to the run's report (or to a temporary file): the user gets
    one line, the developer who gets the bug report gets the whole story."""
    import traceback
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    target = getattr(args, "claimed_report_dir", None) or getattr(args, "report_dir", None)
    from harness.io import atomic
    try:
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            return atomic.write_text(Path(target) / "internal-error.txt", text)
    except (OSError, InputError):
        pass
    return atomic.write_new_temp("mxval-internal-error-", ".txt", text)

if __name__ == "__main__":
    sys.exit(main())
