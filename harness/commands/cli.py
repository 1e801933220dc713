"""`mxval`: validate, diff, dump, cases, backends, report (+ selftest, study and upstream when
present). Each command parses its arguments and hands the work to the run object
(harness/run/pipeline.py).

Exit status (harness/errors.py): 0 all budgets hold, 1 a budget is exceeded (or a case errs),
2 a usage or input error (unknown case, suite or backend, malformed dump or budgets file),
3 an internal error, 130 interrupted. Every error is one line, `mxval: <file or argument>:
<problem>`, never a traceback (MXVAL_DEBUG=1 shows it).

Start-up: this module imports nothing heavy. `mxval --help` and usage errors never load
torch; each command imports what it needs when it runs (the imports inside the `cmd_*`
functions), and a plugin command's module is imported only when it is the one given.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

from harness.commands.args import (
    add_case_timeout,
    add_common,
    add_force,
    add_jobs,
    add_shard,
    add_tree_args,
    check_args,
    repeat_count,
)
from harness.errors import (
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    InputError,
    Parser,
    UsageError,
)
from harness.io import atomic, console, env, escape
from harness.run.signals import HELD, catch_sigterm, hold, release_all, restore_sigterm, stopped_by

__all__ = ["build_parser", "main"]

# Commands other modules add, each `harness.commands.<module>` with `add_parser(subparsers)` and
# `run(args) -> int`: command -> (module, the one-line help `mxval --help` shows).
PLUGIN_COMMANDS = {
    "selftest": ("selftest", "run the fault catalogue (each must be caught) and the correct backends on "
                             "many seeds (none may be flagged)"),
    "study": ("study", "what MXFP4 costs against FP8 and exact: attention mass and exact top-m kept, "
                       "the ranks of the keys lost, over-selection, per distribution, with bootstrap intervals"),
    "upstream": ("upstream_cmd", "fetch upstream sources and check the adapters' targets against them"),
    "coverage": ("coverage", "which boundaries of the coverage model each case of a suite reaches (no backend runs)"),
    "shadow": ("shadow_cmd", "validate while serving: summarise a shadow run's verdict log (`mxval shadow report DIR`)"),
}


def _unclaim(args) -> None:
    """Bad input found after the directory was claimed: leave no empty report directory
    behind (a directory that existed before, or holds anything, stays)."""
    d = getattr(args, "claimed_report_dir", None)
    if d and getattr(args, "claimed_fresh", False):
        try:
            Path(d).rmdir()
        except OSError:
            pass


# --- the commands (heavy modules imported here, when the command runs) -----------------------

def cmd_validate(args) -> int:
    from harness.run.pipeline import Run, backend
    from harness.run.shard import case_digest
    run = Run("validate", budgets=args.budgets, shard=args.shard, report_dir=args.report_dir, force=args.force,
              quiet=args.quiet, owner=args)
    all_cases = run.plan_cases(args.cases_dir, args.suite, args.case, args.path)
    from harness.commands.upstream_cmd import apply_tree_args
    apply_tree_args(args)
    be = backend(args.backend)
    if args.repeat is not None:          # every backend op N times on the same inputs, same bytes
        import dataclasses
        all_cases = [dataclasses.replace(c, repeat=args.repeat) for c in all_cases]
    if args.graph:                       # decode steps replayed from CUDA/HIP graphs
        all_cases = _graph_cases(all_cases, be, quiet=args.quiet)
    cases = run.pick(all_cases)
    jobs = run.cap_jobs(args.jobs, len(cases), str(be.device))
    run.claim(f"validate-{run.suite}-{be.name}" + run.shard_suffix())
    results = run.execute([(be.name, cases)], jobs=jobs, case_timeout=args.case_timeout,
                          title=f"{run.suite} on {be.name}")
    extra = {"path": args.path} if args.path else {}
    if args.graph:
        extra["graph"] = True
    meta = run.meta(backend=be.name, backend_requested=args.backend, backend_description=be.description,
                    device=str(be.device), cases=[c.name for c in cases], **extra)
    shard = run.shard_meta(be.name, [c.name for c in all_cases], case_digest(all_cases), [c.name for c in cases])
    if shard:
        meta["shard"] = shard
        if not cases and not args.quiet:
            print(f"shard {shard['k']}/{shard['n']}: no case of the {len(all_cases)} falls in this shard")
    return run.record([row for _, row in results], meta)


def _graph_cases(cases: list, be, *, quiet: bool) -> list:
    """`--graph`: every case in graph mode (harness/run/graph.py); a GPU is required."""
    import dataclasses

    import torch
    if str(be.device) == "cpu" or not torch.cuda.is_available():
        raise UsageError(f"--graph: needs a GPU (CUDA/HIP graphs); backend {be.name} runs on {be.device} here")
    if be.no_graph:
        raise UsageError(f"--graph: backend {be.name} cannot be replayed from a graph: {be.no_graph}")
    from harness.run.graph import MAX_CAPTURE_SIZE
    eager = [c.name for c in cases if not any(n <= MAX_CAPTURE_SIZE for n in c.decode_batches())]
    if eager and not quiet:
        print(f"note: --graph: {len(eager)} case(s) hold no decode batch of at most {MAX_CAPTURE_SIZE} requests "
              f"and run eagerly, as vLLM runs prefill and mixed batches: {', '.join(eager[:8])}"
              + (" ..." if len(eager) > 8 else ""), file=sys.stderr)
    return [dataclasses.replace(c, graph=True) for c in cases]


def cmd_diff(args) -> int:
    from harness.io.dumps import read_dump
    from harness.run.pipeline import Run, backend
    from harness.run.record import dump_row
    from harness.run.replay import replay_dump
    from optimized import Backend
    run = Run("diff", budgets=args.budgets, suite="diff", report_dir=args.report_dir, force=args.force,
              quiet=args.quiet, owner=args)
    run.load_budgets()
    be = backend(args.backend) if args.backend else None
    seen: dict[str, str] = {}
    for p in args.files:                                # a report row is named by its file name
        name = os.path.basename(p)
        if name in seen:
            raise UsageError(f"{p}: same file name as {seen[name]} (each file is one report row, named by "
                             "its file name: rename one)")
        seen[name] = p
    dumps = [read_dump(p) for p in args.files]          # every file is checked before any runs
    run.check_budgets({os.path.basename(d.path): d.ops for d in dumps}, chain=False, what="file")
    run.claim(f"diff-diff-{be.name if be else 'reference'}")
    rows = []
    try:
        for d in dumps:
            t = time.time()
            reports = replay_dump(d, backend=be)
            rows.append(dump_row(d.path, reports, be.name if be else "reference", time.time() - t))
    except KeyboardInterrupt:                   # Ctrl-C/SIGTERM: the files replayed so far are the report
        run.stopped = {"signal": stopped_by(), "cases_done": len(rows),
                       "cancelled": [os.path.basename(d.path) for d in dumps[len(rows):]]}
    hold()                                       # released by `record`, once the report is whole
    shown = be or Backend("reference", "the reference replays each dump's inputs")
    meta = run.meta(backend=shown.name, backend_requested=args.backend or "reference",
                    backend_description=shown.description, device=str(shown.device), files=list(args.files))
    return run.record(rows, meta)


def cmd_dump(args) -> int:
    from harness.io.dumps import OpRecord, write_dump
    from harness.run.cases import Catalog
    from harness.run.inputs import build
    from harness.run.pipeline import backend
    from harness.run.record import machine
    from harness.run.runner import run_case
    if args.output:                              # a link, a device or a FIFO is refused before any work
        atomic.check_target(args.output, arg="-o")
    case = Catalog(args.cases_dir).case(args.case)
    be = backend(args.backend)
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
    out = args.output or str(Path("reports") / "dumps" / f"{atomic.safe_name(case.name)}.{atomic.safe_name(be.name)}"
                                                         f".step{step}.safetensors")
    write_dump(out, records, within=None if args.output else "reports", source=f"mxval dump: case {case.name} (seed {case.seed}), backend {be.name} "
                                    f"({be.description}), step {step} of {n_steps}, {machine(str(be.device))}",
               model=case.preset, step=step)
    print(f"wrote {out}: {', '.join(records)} (step {step} of {n_steps}; case outcome {row['outcome']}"
          f"{': ' + row['reason'] if row['reason'] else ''})")
    return EXIT_OK


def cmd_cases(args) -> int:
    from rich.table import Table

    from harness.io.escape import wide_console
    from harness.run.cases import Catalog
    from harness.run.geometry import geometry
    from reference.op_table import DECLARED, chain
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
        t = Table(title=escape.rich(f"suite {name} ({len(cases)} cases; {s.file}"
                                    + (f"; includes {', '.join(s.include)}" if s.include else "")
                                    + f") {s.description}"))
        for col in ("case", "from", "ops", "shape", "needs", "description"):
            t.add_column(col, overflow="fold")
        for c in cases:
            ops = "chain" if c.ops == chain(c.fmt, c.path) else ",".join(DECLARED[o].stage for o in c.ops)
            if c.path == "cuda":
                ops += " (cuda)"
            t.add_row(*map(escape.rich, (c.name, c.suite, f"{c.fmt}:{ops}", c.summary(), c.requires or "",
                                         c.description)))
        con.print(t)
    return EXIT_OK


def cmd_backends(args) -> int:
    """What runs here. Without --check nothing heavy is imported: each backend's needs are
    checked as optimized/probe.py can without torch (what only an import tells is said to be
    unchecked); --check builds every backend (torch, triton, the upstream trees)."""
    from rich.table import Table

    from harness.io.escape import wide_console
    t = Table(title="backends" + (" (built)" if args.check else ""))
    for col in ("name", "status", "device", "description / why not"):
        t.add_column(col, overflow="fold")
    for row in (_backends_built(args.faults) if args.check else _backends_probed(args.faults)):
        t.add_row(*row)
    wide_console().print(t)
    return EXIT_OK


_STATUS = {"available": "[green]available[/]", "unavailable": "[red]unavailable[/]",
           "not checked": "[yellow]not checked[/]"}


def _backends_probed(faults: bool) -> list[tuple]:
    import optimized
    from optimized import probe
    status, which = probe.auto()
    rows = [("auto", ("[green]->[/] " if status == "available" else _STATUS[status] + ": ") + which, "",
             "the best available here")]
    for name in optimized.DECLARED:
        p = probe.probe(name)
        rows.append((name, _STATUS[p.status], p.device, p.text))
    if faults:                     # each fault is the reference with one stage broken: it runs where the reference does
        from optimized.fault_table import read_catalogue
        ref = probe.probe("reference")
        rows += [(f.backend_name, _STATUS[ref.status], ref.device, f.describe()) for f in read_catalogue().values()]
    return rows


def _backends_built(faults: bool) -> list[tuple]:
    import optimized
    if faults:
        optimized._load_extra()
    rows = []
    for name in optimized.backend_names(include_extra=faults):
        if name == "auto":
            rows.append(("auto", "[green]->[/] " + optimized.auto_backend_name(), "", "the best available here"))
            continue
        try:
            be = optimized.get_backend(name, require=False)
        except optimized.BackendUnavailable as e:
            rows.append((name, _STATUS["unavailable"], "", str(e)))
            continue
        why = be.available()
        rows.append((name, _STATUS["unavailable" if why else "available"], str(be.device), why or be.description))
    return rows


def cmd_report(args) -> int:
    """Re-render DIR's reports from its report.json, which is never rewritten (copied as it
    is into another --report-dir); `--merge DIR...` combines shard reports."""
    if getattr(args, "merge", False):
        from harness.commands import merge
        return merge.run(args)
    from harness.io import report
    from harness.run import recheck
    if args.dir is None:
        raise UsageError("report: give a report directory DIR (or --merge DIR...)")
    src = Path(args.dir) / "report.json"
    df, meta = report.load(args.dir)
    recheck.check_frame(df, meta, src, budgets=args.budgets)      # the verdict is computed, never read
    out = Path(args.report_dir or args.dir)
    if args.report_dir and not report._same_file(src.parent, out):
        report.claim_dir(out, force=args.force)
    paths = report.write_all(df, meta, out, json_source=src)
    if not args.quiet:
        report.console_table(df, meta)
    print(f"reports: {escape.terminal(str(out))}/ ({', '.join(Path(p).name for p in paths.values())})")
    if meta.get("interrupted"):
        return EXIT_INTERRUPTED
    return EXIT_OK if report.summary(df, meta)["ok"] else EXIT_FAIL


# --- parser and main ---------------------------------------------------------------------------

def _validate_parser(sub) -> None:
    p = sub.add_parser("validate", help="run a suite or cases against a backend and apply budgets")
    g = p.add_argument_group("what to run").add_mutually_exclusive_group()
    g.add_argument("--suite", default=None, help="suite name (default: default)")
    g.add_argument("--case", action="append", default=None, metavar="NAME",
                   help="a case (repeatable; not with --suite)")
    p.add_argument("--backend", default="auto", help="backend name (see `mxval backends`)")
    p.add_argument("--path", default=None, metavar="{rocm,cuda}",
                   help="run every case on this path (cuda: vLLM's fused pool+K op, natural pages; "
                        "default: each case's own)")
    add_jobs(p, "cases")
    p.add_argument("--repeat", type=repeat_count, default=None, metavar="N",
                   help="run each backend op N times on the same inputs; every run must give the same "
                        "bytes (a case's `repeat` key otherwise; the full suite sets it)")
    p.add_argument("--graph", action="store_true",
                   help="replay every backend op of each decode step from a CUDA/HIP graph captured once per "
                        "padded batch size, as vLLM serves decode; each replay is judged and compared with the "
                        "same op run eagerly (GPU only)")
    add_tree_args(p)
    add_shard(p)
    add_case_timeout(p)
    add_common(p)


def _other_parsers(sub) -> None:
    p = sub.add_parser("diff", help="replay captured dumps and diff them (budgets apply)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--backend", default=None,
                   help="replay the dump's inputs through this backend instead of the reference")
    add_common(p, cases=False)

    p = sub.add_parser("dump", help="run a case on a backend and write one dump of its chain")
    p.add_argument("--case", required=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--step", type=int, default=None, help="which step of the case (default: the last)")
    p.add_argument("-o", "--output", default=None, help="dump file (default: reports/dumps/...)")
    p.add_argument("--cases-dir", default=None)

    p = sub.add_parser("cases", help="list suites and cases")
    p.add_argument("--suite", default=None)
    p.add_argument("--cases-dir", default=None)

    p = sub.add_parser("backends", help="which backends run here, and why not")
    p.add_argument("--faults", action="store_true", help="also list the fault catalogue's broken backends")
    p.add_argument("--check", action="store_true",
                   help="build every backend (imports torch, triton and the upstream trees) instead of checking "
                        "what is known without them")

    p = sub.add_parser("report", help="re-render the reports of a run directory (or merge shard reports)")
    p.add_argument("dir", nargs="?", default=None)
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="combine the reports of `--shard K/N` runs into one (every format)")
    p.add_argument("--report-dir", default=None, help="write there instead of DIR")
    p.add_argument("--budgets", default=None,
                   help="judge every row again against this budgets file (default: the file the report names, "
                        "whose limits must be those it recorded)")
    add_force(p)
    p.add_argument("-q", "--quiet", action="store_true")


BUILTIN = {"validate": cmd_validate, "diff": cmd_diff, "dump": cmd_dump, "cases": cmd_cases,
           "backends": cmd_backends, "report": cmd_report}


def _plugin(module: str):
    """harness.commands.<module>, or None when this installation does not have it."""
    name = f"harness.commands.{module}"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


def build_parser(argv: Optional[list[str]] = None) -> tuple[argparse.ArgumentParser, dict]:
    """The parser and {command: run function}. A plugin command's module is imported only when
    `argv` names it (None: every one); the others get a placeholder with their help line."""
    ap = Parser(prog="mxval", description="numerics validation of the DeepSeek-V4 MXFP4 indexer")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    _validate_parser(sub)
    _other_parsers(sub)
    run = dict(BUILTIN)
    given = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    for command, (module, help_line) in PLUGIN_COMMANDS.items():
        if argv is not None and command != given:
            if importlib.util.find_spec(f"harness.commands.{module}") is not None:
                sub.add_parser(command, help=help_line, add_help=False)
            continue
        mod = _plugin(module)
        if mod is None:
            continue
        mod.add_parser(sub)
        run[command] = mod.run
    return ap, run


def _one_line(e: BaseException) -> str:
    """The first line of an error, with no control character for the terminal."""
    s = str(e).strip()
    return escape.terminal(s.splitlines()[0]) if s else type(e).__name__


def _bad_input(e: BaseException) -> bool:
    """The user's to fix: an InputError, or a backend that cannot run here (checked only
    when the backends were loaded: nothing else can raise it)."""
    backends = sys.modules.get("optimized")
    return isinstance(e, InputError) or (backends is not None and isinstance(e, backends.BackendUnavailable))


def _run(args, run: dict) -> int:
    previous = catch_sigterm()
    try:
        return int(run[args.cmd](args) or 0)
    finally:
        report = sys.modules.get("harness.io.report")     # locks exist only once it was loaded
        if report is not None:
            report.release_locks()
        release_all()
        restore_sigterm(previous)


def main(argv: Optional[list[str]] = None) -> int:
    """The command line's exit status. As the program (`argv` None: `mxval`, `python -m
    harness`), a run stopped by Ctrl-C/SIGTERM that left a case on a worker thread (its
    report written without it: harness.run.runner.abandoned) ends the process here; any other
    stopped run ignores further signals while the interpreter exits."""
    code = _main(argv)
    runner = sys.modules.get("harness.run.runner")
    if argv is None and runner is not None and runner.abandoned():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if argv is None and code == EXIT_INTERRUPTED:
        # stopped, its report written, its workers told to stop: the interpreter's exit-time
        # joins (worker pools) are what is left, and a second Ctrl-C there would only print a
        # KeyboardInterrupt traceback from inside them
        for s in HELD:
            signal.signal(s, signal.SIG_IGN)
    return code


def _main(argv: Optional[list[str]]) -> int:
    """The command with its console guarded (harness/io/console.py): an ASCII-only stdout gets
    ASCII, and a stdout that goes away (a closed pipe, /dev/full) stops the console only,
    never the run: its reports are written and its exit status is its verdict's."""
    out = console.guard()
    try:
        code = _command(argv)
    finally:
        why = console.lost(out)
        console.unguard(out)
    if why:
        print(f"mxval: stdout: {why}: the console output stopped there; the run went on (its reports are "
              "written, the exit status is its own)", file=sys.stderr)
    return code


def _command(argv: Optional[list[str]]) -> int:
    args = None
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        env.flag(DEBUG_ENV)                  # a malformed switch is a usage error before any work
        ap, run = build_parser(argv)
        args = ap.parse_args(argv)
        check_args(ap, args)
        return _run(args, run)
    except KeyboardInterrupt:                # before any work finished: no half-made report directory
        _unclaim(args)
        print("mxval: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as e:           # --help
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_USAGE
    except OSError as e:              # a file or directory named on the command line
        print(f"mxval: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if _bad_input(e):
            _unclaim(args)
            print(f"mxval: {_one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
        return _internal_error(e, args)


DEBUG_ENV = "MXVAL_DEBUG"


def _debug() -> bool:
    """MXVAL_DEBUG=1: show the traceback (0 or unset: off; anything else was refused at start)."""
    try:
        return env.flag(DEBUG_ENV)
    except InputError:
        return False


def _internal_error(e: Exception, args) -> int:
    """A bug in mxval or in a backend, never the user's input: one line, the traceback saved."""
    if _debug():
        raise e
    tb = e.__traceback__
    while tb and tb.tb_next:
        tb = tb.tb_next
    where = f" ({os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})" if tb else ""
    saved = _save_traceback(e, args)
    print(f"mxval: internal error {type(e).__name__}: {_one_line(e)}{where}; traceback in {saved} "
          "(MXVAL_DEBUG=1 shows it)", file=sys.stderr)
    return EXIT_INTERNAL


def _save_traceback(e: BaseException, args) -> str:
    """Write the traceback next to the run's report (or to a temporary file): the user gets
    one line, the developer who gets the bug report gets the whole story."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    target = getattr(args, "claimed_report_dir", None) or getattr(args, "report_dir", None)
    try:
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            return atomic.write_text(Path(target) / "internal-error.txt", text)
    except (OSError, InputError):
        pass
    return atomic.write_new_temp("mxval-internal-error-", ".txt", text)


if __name__ == "__main__":
    sys.exit(main())
