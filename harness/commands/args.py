"""Arguments every command shares, declared once: the parser that turns argparse's errors
into usage errors, the common flags (`--force`, `--shard`, `--case-timeout`, reports and
budgets), and the checks argparse lets through (empty values, unwritable output paths).

Imports nothing heavy: `mxval --help` and usage errors must not wait for torch.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from harness.errors import UsageError


def add_force(p) -> None:
    p.add_argument("--force", action="store_true",
                   help="replace the report of another run in --report-dir (refused without it)")


MAX_CASE_TIMEOUT = 7 * 24 * 3600.0        # --case-timeout: at most a week


def seconds(text: str) -> float:
    """argparse type of --case-timeout: a positive number of seconds."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= MAX_CASE_TIMEOUT:
        raise argparse.ArgumentTypeError(f"expected a number of seconds in (0, {MAX_CASE_TIMEOUT:g}], "
                                         f"got {text!r:.40}")
    return v


def add_case_timeout(p) -> None:
    p.add_argument("--case-timeout", type=seconds, default=None, metavar="SECONDS",
                   help="an error row for a case still running after SECONDS (its worker is killed: a hung "
                        "kernel costs one case, not the run)")


MAX_JOBS = 256


def jobs_count(text: str):
    """argparse type of -j/--jobs: "auto" (returned as is) or a whole number of worker
    processes from 1 to MAX_JOBS (`harness.run.pipeline.cap_jobs` says what each means)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 1 <= v <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number of processes from 1 to {MAX_JOBS}, "
                                         f"got {text!r:.40}")
    return v


def add_jobs(p, what: str) -> None:
    p.add_argument("-j", "--jobs", type=jobs_count, default="auto", metavar="N",
                   help=f"{what} in parallel (worker processes), or 'auto' (the default): one process on a "
                        "CPU; on a GPU, worker processes for the small cases (Triton compiles in parallel) "
                        "while this process runs the large ones")


def repeat_count(text: str) -> int:
    """argparse type of --repeat: runs of each backend op, 1 to 100."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 1 <= v <= 100:
        raise argparse.ArgumentTypeError(f"expected a whole number of runs from 1 to 100, got {text!r}")
    return v


def add_shard(p) -> None:
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="run only shard K of N (1-based; a deterministic, balanced slice) and "
                        "record it for `mxval report --merge`")


def add_tree_args(p) -> None:
    """`--aiter DIR` and `--trust-upstream` for commands that load upstream kernels (validate)."""
    p.add_argument("--aiter", default=None, metavar="DIR",
                   help="aiter source tree for the aiter-triton backends (default: $MXVAL_AITER_SRC, "
                        "else the tree `mxval upstream fetch --aiter` cached)")
    p.add_argument("--trust-upstream", action="store_true",
                   help="load the upstream trees named here (--aiter, $MXVAL_AITER_SRC, $MXVAL_VLLM_SRC) even "
                        "where a file is not the one optimized/upstream.py pins")


def add_common(p, *, cases=True, budgets=True, report_dir=True) -> None:
    if cases:
        p.add_argument("--cases-dir", default=None, help="directory of suite TOML files (default: cases/)")
    if budgets:
        p.add_argument("--budgets", default=None, help="budgets TOML (default: cases/budgets.toml)")
    if report_dir:
        p.add_argument("--report-dir", default=None, help="where reports go (default: reports/<run>/)")
        add_force(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or console table")


def check_writable_path(arg: str, path, *, is_dir: bool) -> None:
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


OUTPUT_FILES = (("output", "-o"), ("json", "--json"), ("markdown", "--markdown"), ("readme", "--readme"))


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Arguments argparse lets through but that would mean something else: an empty value
    (`--suite ""` would run the default suite) is a usage error naming the flag; an output
    path that can never be written is one too, before any work."""
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
    if getattr(args, "report_dir", None):
        check_writable_path("--report-dir", args.report_dir, is_dir=True)
    for attr, flag in OUTPUT_FILES:
        if isinstance(getattr(args, attr, None), str):
            check_writable_path(flag, getattr(args, attr), is_dir=False)
