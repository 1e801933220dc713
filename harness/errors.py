"""The one distinction every command's exit status rests on: bad input versus a bug.

`InputError` and its subclasses are the user's to fix (a malformed file, an unknown name,
an argument out of range): exit 2 with one line. Any other exception escaping a command is a
bug in mxval or in a backend: exit 3, with the traceback saved (harness/commands/cli.py).
"""


class InputError(ValueError):
    """Bad input; the message is one line naming the file or argument and the problem."""


class ReportError(InputError):
    """A report directory or report.json that cannot be used."""


class StudyConfigError(InputError):
    """A study file, study name or study argument that cannot be used."""
