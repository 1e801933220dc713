"""`mxval selftest`: the fault catalogue must be caught, the correct backends must not be
flagged (harness/run/selftest.py). This module parses the arguments; it imports nothing
heavy, so that help and usage errors stay instant."""
from __future__ import annotations

from harness.commands.args import add_case_timeout, add_common, add_jobs, add_shard
from harness.errors import UsageError

DEFAULT_SEEDS = 20
QUICK_SEEDS = 4
QUICK_INTERPRET_SEEDS = 2
MAX_SEEDS = 1000               # --seeds: at most this many seeds per case


def add_parser(sub) -> None:
    p = sub.add_parser("selftest", help="run the fault catalogue (each must be caught) and the "
                                        "correct backends on many seeds (none may be flagged)")
    p.add_argument("--quick", action="store_true",
                   help=f"CI size: reference on {QUICK_SEEDS} seeds, the interpreter on "
                        f"{QUICK_INTERPRET_SEEDS}, no > 2 GiB pool")
    p.add_argument("--seeds", type=int, default=None,
                   help=f"seeds per case for the correct backends (default {DEFAULT_SEEDS}; "
                        f"--quick {QUICK_SEEDS})")
    p.add_argument("--fault", action="append", default=None, metavar="NAME",
                   help="run only this fault (repeatable; see `mxval backends --faults`)")
    p.add_argument("--backend", action="append", default=None, metavar="NAME",
                   help="correct backend for the false-alarm runs (repeatable; default: reference "
                        "and triton, or triton-interpret, when available)")
    p.add_argument("--large", action="store_true",
                   help="run the > 2 GiB pool case even without a GPU (the harness peaks near 30 GB of RAM on it)")
    add_jobs(p, "runs")
    p.add_argument("--json", default=None, metavar="FILE", help="write the verdict as JSON")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="write the matrix as Markdown (`make readme-matrix`)")
    add_shard(p)
    add_case_timeout(p)
    add_common(p)


def run(args) -> int:
    if args.quick and args.large:
        raise UsageError("--large: not with --quick (the quick selftest never runs the > 2 GiB pool case)")
    seeds = args.seeds if args.seeds is not None else (QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    if not 1 <= seeds <= MAX_SEEDS:
        raise UsageError(f"--seeds: expected an integer in [1, {MAX_SEEDS + 1}), got {seeds}")
    from harness.run import selftest  # here: torch loads only once the selftest runs
    return selftest.run(args, seeds=seeds, interpret_seeds=QUICK_INTERPRET_SEEDS)
