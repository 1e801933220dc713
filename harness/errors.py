"""The one distinction every command's exit status rests on: bad input versus a bug.

`InputError` and its subclasses are the user's to fix (a malformed file, an unknown name,
an argument out of range): exit 2 with one line. Any other exception escaping a command is a
bug in mxval or in a backend: exit 3, with the traceback saved (harness/commands/cli.py).
The exit codes of every command are declared here, once, and the argument parser that
turns argparse's errors into usage errors (every command line of mxval, benchmarks included).
"""
from __future__ import annotations

import argparse
import re
import sys

EXIT_OK = 0           # every budget holds / every upstream target binds
EXIT_FAIL = 1         # a budget is exceeded, a case errs, nothing was checked, upstream drifted
EXIT_USAGE = 2        # bad input: a usage error, a malformed file, an unknown name
EXIT_INTERNAL = 3     # a bug in mxval or a backend
EXIT_INTERRUPTED = 130  # SIGINT/SIGTERM; a partial report is kept


class InputError(ValueError):
    """Bad input; the message is one line naming the file or argument and the problem."""


class UsageError(InputError):
    """A bad argument or input file; the message is the one line printed."""


class ReportError(InputError):
    """A report directory or report.json that cannot be used."""


class StudyConfigError(InputError):
    """A study file, study name or study argument that cannot be used."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line `<option>: <problem>` (argparse says "argument -j/--jobs: ..."; the option's
        long name is what the user typed more often and what every other usage error names)."""
        m = re.match(r"argument (\S+): (.*)", message, re.S)
        if m:
            message = f"{m.group(1).split('/')[-1]}: {m.group(2)}"
        raise UsageError(message)


def count(text: str) -> int:
    """argparse type of a benchmark's counts (steps, repeats, layers, ...): a whole number, at
    least 1."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number, at least 1, got {text!r:.40}")
    return v


def parse_or_exit(ap: Parser, argv, where: str) -> argparse.Namespace:
    """`ap.parse_args(argv)` for a command line outside `mxval`'s own (a benchmark's): a usage
    error is one line `mxval: <where>: <problem>` on stderr and exit EXIT_USAGE."""
    try:
        return ap.parse_args(argv)
    except UsageError as e:
        print(f"mxval: {where}: {e}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
