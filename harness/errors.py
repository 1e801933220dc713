"""The one distinction every command's exit status rests on: bad input versus a bug.

`InputError` and its subclasses are the user's to fix (a malformed file, an unknown name,
an argument out of range): exit 2 with one line. Any other exception escaping a command is a
bug in mxval or in a backend: exit 3, with the traceback saved (harness/commands/cli.py).
The exit codes of every command are declared here, once.
"""

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
