"""Shared fixtures. Additive only: other test files rely on these names.

Also says what a run deselects and why: `-m "not gpu and not slow and not upstream"` (`make
test`) leaves out the tests of the marks below, and the summary counts them per mark with
the reason and the target that runs them (with xdist, the workers' counts reach the
controller through `workeroutput`)."""
from __future__ import annotations

import os

import pytest
import torch

from harness.run import memory

# mark -> why `make test` leaves it out, and where it runs (pyproject's markers say the same)
DESELECT_REASONS = {
    "gpu": "needs a CUDA/ROCm GPU; `make test-gpu`",
    "upstream": "runs vLLM's fetched kernels or an aiter tree; `make test-upstream`, `make test-aiter AITER=DIR`",
    "slow": "over the CI time or memory budget; `make test-slow`",
}
_KEY = "mxval_deselected"


def _count(config) -> dict:
    if not hasattr(config, "_mxval_deselected"):
        config._mxval_deselected = {}
    return config._mxval_deselected


def pytest_deselected(items):
    if not items:
        return
    config = items[0].config
    counts = _count(config)
    for item in items:
        mark = next((m for m in DESELECT_REASONS if item.get_closest_marker(m)), "other")
        counts[mark] = counts.get(mark, 0) + 1
    if hasattr(config, "workeroutput"):                     # an xdist worker: tell the controller
        config.workeroutput[_KEY] = dict(counts)


def pytest_testnodedown(node, error):
    """xdist controller: every worker collects the whole suite, so one worker's count is the run's."""
    got = getattr(node, "workeroutput", {}).get(_KEY)
    if got:
        node.config._mxval_deselected = dict(got)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = _count(config)
    if not counts:
        return
    parts = [f"{n} {m} ({DESELECT_REASONS.get(m, 'by -m or -k')})" for m, n in sorted(counts.items())]
    terminalreporter.write_line(f"deselected: {'; '.join(parts)}")


def pytest_configure(config):
    """MXVAL_GPU_MEMORY_FRACTION caps the test process too (tools/gpu_validate.sh runs the GPU
    tests beside other mxval processes on one GPU)."""
    if os.environ.get(memory.FRACTION_ENV) and torch.cuda.is_available():
        memory.apply_fraction("cuda")
    # The shadow's worker process runs at nice 19 by default: beside pytest-xdist workers that
    # keep every core busy it would wait for CPU, and a test's bounded wait for its verdicts
    # would measure the host's load. Tests run it at the serving process's priority
    # (tests/test_shadow.py checks the default).
    os.environ.setdefault("MXVAL_SHADOW_NICE", "0")


@pytest.fixture
def gen():
    """A seeded torch generator: every test draws the same data on every run."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def pro_cos_sin():
    """V4-Pro cos/sin cache (YaRN), 4096 positions."""
    from reference import preset, rope
    p = preset("deepseek-v4-pro")
    return rope.cos_sin_cache(4096, p.rope_dim, p.rope_base, yarn_factor=p.yarn_factor,
                              yarn_original_max_pos=p.yarn_original_max_pos)
