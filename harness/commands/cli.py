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

from harness.errors import InputError

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
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


def _run_name(command: str, what: str, backend: str) -> str:
    return f"{command}-{what}-{backend}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


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


def _backend(name: str):
    from optimized import BackendUnavailable, get_backend
    try:
        return get_backend(name)
    except BackendUnavailable as e:
        raise UsageError(f"--backend: {e}") from None


def _finish(rows: list[dict], meta: dict, budgets, suite: str, report_dir: Optional[str], quiet: bool) -> int:
    from harness.io import report
    from harness.run.budgets import verdict
    rows = [verdict(r, budgets, r.get("suite_for_budgets", suite)) for r in rows]
    df = report.frame(rows)
    meta["budget_warnings"] = [f"budget {k!r} in {budgets.path} matched no metric of this run"
                               for k in budgets.unused(report.metric_columns(df), suite, list(df["case"]))]
    meta["budgets"] = budgets.as_dict()
    out = Path(report_dir or Path("reports") / _run_name(meta["command"], suite, meta["backend"]))
    paths = report.write_all(df, meta, out)
    if not quiet:
        report.console_table(df, meta)
    print(f"reports: {out}/ ({', '.join(Path(p).name for p in paths.values())})")
    return EXIT_OK if report.summary(df)["ok"] else EXIT_FAIL


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
    from harness.run.cases import Catalog
    from harness.run.inputs import geometry
    from harness.run.runner import run_cases
    t0 = time.time()
    catalog = Catalog(args.cases_dir)
    suite, cases = catalog.select(args.suite, args.case)
    budgets = B.load(args.budgets)
    for c in cases:
        geometry(c)
    be = _backend(args.backend)
    if args.jobs < 1:
        raise UsageError(f"-j: expected a positive number of jobs, got {args.jobs}")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[last]}"),
                  console=stderr_console(), transient=True, disable=args.quiet) as bar:
        task = bar.add_task(f"{suite} on {be.name}", total=len(cases), last="")
        rows = run_cases(cases, be.name, jobs=args.jobs,
                         progress=lambda r: bar.update(task, advance=1, last=f"{r['case']}: {r['outcome']}"))
    meta = _meta("validate", be, args.backend, t0)
    meta["suite"] = suite
    meta["cases"] = [c.name for c in cases]
    return _finish(rows, meta, budgets, suite, args.report_dir, args.quiet)


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
    from harness.run import budgets as B
    from harness.io.dumps import read_dump
    from harness.run.replay import replay_dump
    t0 = time.time()
    budgets = B.load(args.budgets)
    be = _backend(args.backend) if args.backend else None
    dumps = [read_dump(p) for p in args.files]          # every file is checked before any runs
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
    return _finish(rows, meta, budgets, "diff", args.report_dir, args.quiet)


# --- dump ------------------------------------------------------------------------------------

def cmd_dump(args) -> int:
    from harness.run.cases import Catalog
    from harness.io.dumps import OpRecord, write_dump
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
    out = args.output or str(Path("reports") / "dumps" / f"{case.name}.{be.name.replace(':', '_')}.step{step}.safetensors")
    write_dump(out, records, source=f"mxval dump: case {case.name} (seed {case.seed}), backend {be.name} "
                                    f"({be.description}), step {step} of {n_steps}, {machine(str(be.device))}",
               model=case.preset, step=step)
    print(f"wrote {out}: {', '.join(records)} (step {step} of {n_steps}; case outcome {row['outcome']}"
          f"{': ' + row['reason'] if row['reason'] else ''})")
    return EXIT_OK


# --- cases, backends, report -------------------------------------------------------------------

def cmd_cases(args) -> int:
    from rich.table import Table
    from harness.run.cases import Catalog
    from harness.io.report import wide_console
    catalog = Catalog(args.cases_dir)
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
    if args.suite and args.suite not in catalog.suites:
        raise UsageError(f"--suite: unknown suite {args.suite!r} (known: {', '.join(catalog.suites)})")
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
    from harness.io import report
    df, meta = report.load(args.dir)
    out = args.report_dir or args.dir
    paths = report.write_all(df, meta, out)
    if not args.quiet:
        report.console_table(df, meta)
    print(f"reports: {out}/ ({', '.join(Path(p).name for p in paths.values())})")
    return EXIT_OK if report.summary(df)["ok"] else EXIT_FAIL


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
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or console table")

    p = sub.add_parser("validate", help="run a suite or cases against a backend and apply budgets")
    g = p.add_argument_group("what to run")
    g.add_argument("--suite", default=None, help="suite name (default: default)")
    g.add_argument("--case", action="append", default=None, metavar="NAME", help="a case (repeatable)")
    p.add_argument("--backend", default="auto", help="backend name (see `mxval backends`)")
    p.add_argument("-j", "--jobs", type=int, default=1, help="cases in parallel (processes)")
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

    p = sub.add_parser("report", help="re-render the reports of a run directory")
    p.add_argument("dir")
    p.add_argument("--report-dir", default=None, help="write there instead of DIR")
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


def _one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def main(argv: Optional[list[str]] = None) -> int:
    from optimized import BackendUnavailable
    try:
        ap, run = build_parser()
        args = ap.parse_args(argv)
        if getattr(args, "report_dir", None):
            _check_writable_path("--report-dir", args.report_dir, is_dir=True)
        for attr, flag in (("output", "-o"), ("json", "--json"), ("markdown", "--markdown"), ("readme", "--readme")):
            if isinstance(getattr(args, attr, None), str):
                _check_writable_path(flag, getattr(args, attr), is_dir=False)
        return int(run[args.cmd](args) or 0)
    except (InputError, BackendUnavailable) as e:
        print(f"mxval: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("mxval: interrupted", file=sys.stderr)
        return 130
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
    import tempfile
    import traceback
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    target = getattr(args, "report_dir", None)
    try:
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            path = Path(target) / "internal-error.txt"
            path.write_text(text)
            return str(path)
    except OSError:
        pass
    fd, name = tempfile.mkstemp(prefix="mxval-internal-error-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return name

if __name__ == "__main__":
    sys.exit(main())
