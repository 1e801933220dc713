"""SIGTERM and SIGHUP stop a run as Ctrl-C does (a CI job cancelled, `timeout`, a closed
terminal): a partial report,
which names the signal that stopped it. Light on purpose: the CLI installs it before any
command's modules load."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_SIGNAL = {"name": "SIGINT"}
# Signals that stop a run as Ctrl-C does: SIGTERM (a cancelled CI job, `timeout`) and SIGHUP
# (a closed terminal, a dropped ssh session).
STOPS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
HELD = (signal.SIGINT, *STOPS)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _on_stop(signum, frame):
    _SIGNAL["name"] = _name(signum)
    raise KeyboardInterrupt


def catch_sigterm():
    """SIGTERM and SIGHUP turned into Ctrl-C, each installed only where nobody else handles it,
    and only in the main thread; the handlers they replaced (None: nothing installed)."""
    _SIGNAL["name"] = "SIGINT"
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = {s: signal.signal(s, _on_stop) for s in STOPS if signal.getsignal(s) is signal.SIG_DFL}
    return previous or None


def restore_sigterm(previous) -> None:
    for s, h in (previous or {}).items():
        signal.signal(s, h)


def stopped_by() -> str:
    """The signal that stopped the run: SIGINT (Ctrl-C), SIGTERM or SIGHUP."""
    return _SIGNAL["name"]


_HOLD = {"depth": 0, "old": {}, "got": []}


def hold() -> None:
    """From now until `release`, SIGINT, SIGTERM and SIGHUP are held, not raised: once a run's work
    is done (or stopped), a Ctrl-C must not cut the writing of its report in half (report.json
    is written last). Nested holds count; outside the main thread nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        return
    _HOLD["depth"] += 1
    if _HOLD["depth"] > 1:
        return
    old = {s: signal.getsignal(s) for s in HELD}
    _HOLD["old"], _HOLD["got"] = old, []

    def held(signum, frame):
        if old.get(signum) is not signal.SIG_IGN:          # an ignored signal stays ignored
            _HOLD["got"].append(_name(signum))

    for s in old:
        signal.signal(s, held)


def pending() -> list[str]:
    """The signals held so far (still held: `release` returns them)."""
    return list(_HOLD["got"])


def release() -> list[str]:
    """End a `hold`: the handlers restored; the signals that came while held (for the
    caller to honour: exit 130 with the report whole), from the outermost release."""
    if threading.current_thread() is not threading.main_thread() or _HOLD["depth"] == 0:
        return []
    _HOLD["depth"] -= 1
    if _HOLD["depth"]:
        return []
    for s, h in _HOLD["old"].items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)
    got, _HOLD["got"] = _HOLD["got"], []
    if got:
        _SIGNAL["name"] = got[0]
    return got


def release_all() -> None:
    """Whatever is still held, released (a command ended by an error while holding)."""
    while _HOLD["depth"]:
        release()


@contextmanager
def deferred():
    """`hold` for the duration of a block; yields the list of signals that came (filled
    when the block ends)."""
    got: list[str] = []
    hold()
    try:
        yield got
    finally:
        got += release()
