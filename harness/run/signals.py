"""SIGTERM stops a run as Ctrl-C does (a CI job cancelled, `timeout`): a partial report,
which names the signal that stopped it. Light on purpose: the CLI installs it before any
command's modules load."""
from __future__ import annotations

import signal
import threading

_SIGNAL = {"name": "SIGINT"}


def _on_sigterm(signum, frame):
    _SIGNAL["name"] = "SIGTERM"
    raise KeyboardInterrupt


def catch_sigterm():
    """Installed only where nobody else handles SIGTERM, and only in the main thread; the
    handler it replaced (None: nothing installed)."""
    _SIGNAL["name"] = "SIGINT"
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def stopped_by() -> str:
    """The signal that stopped the run: SIGINT (Ctrl-C) or SIGTERM."""
    return _SIGNAL["name"]
