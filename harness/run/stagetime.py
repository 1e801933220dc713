"""Where a case's time goes: seconds per part of the case (inputs: its inputs and the history
written into its pool; reference, backend, backend_repeats, repeat_compare, diff, plots,
row), summed over its steps, recorded in the row's `details.stage_seconds` when
`MXVAL_STAGE_TIMES=1`; on a GPU also `details.stage_peak_bytes`: for each part during which
the GPU memory allocated reached a new high, that high (above the allocation when the clock
was made), so the part holding the case's peak is the one whose value is the peak. Each part
starts and ends with a device synchronize then, so a GPU's queued work is charged to the part
that queued it (and the run is a little slower); unset, nothing is timed or recorded."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from harness.io import env

ENV = "MXVAL_STAGE_TIMES"


def enabled() -> bool:
    """Whether MXVAL_STAGE_TIMES asks for stage times: 1 on, 0 or unset off; ValueError else."""
    return env.flag(ENV)


class StageClock:
    """`with clock("reference"): ...` adds the block's seconds to `clock.seconds["reference"]`;
    a part nested in another is charged to the inner one only."""

    def __init__(self, device, on: bool = None):
        self.on = enabled() if on is None else on
        dev = torch.device(device)
        self.cuda = dev.type == "cuda" and torch.cuda.is_available()
        self.device = dev
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self._base = torch.cuda.memory_allocated(dev) if self.on and self.cuda else 0
        self._stack: list[list] = []

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def __call__(self, part: str):
        if not self.on:
            yield
            return
        t0 = self._now()
        high = torch.cuda.max_memory_allocated(self.device) if self.cuda else 0
        if self._stack:                      # pause the enclosing part
            outer = self._stack[-1]
            self.seconds[outer[0]] = self.seconds.get(outer[0], 0.0) + t0 - outer[1]
        self._stack.append([part, t0])
        try:
            yield
        finally:
            t1 = self._now()
            if self.cuda:
                now = torch.cuda.max_memory_allocated(self.device)
                if now > high:
                    self.peaks[part] = max(self.peaks.get(part, 0), now - self._base)
            _, start = self._stack.pop()
            self.seconds[part] = self.seconds.get(part, 0.0) + t1 - start
            if self._stack:
                self._stack[-1][1] = t1

    def record(self) -> dict:
        """{part: seconds} rounded to the millisecond (empty when not timing)."""
        return {k: round(v, 3) for k, v in self.seconds.items()}
