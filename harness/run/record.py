"""What a run records, built in one place: the report row of a case (or of a replayed
dump) and the run's metadata (`run` in report.json).

A row holds the raw results of one case: outcome (ok | error | nonfinite_input |
skipped), reason, the seconds, the GPU memory (peak and tensor bytes), the metrics (`<op>.<metric>`, `chain.<metric>`), the first findings of
each stage, the per-step summaries and the plot details. `budgets.verdict` adds the verdict.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import sys
import time
from typing import Optional

import torch

# Findings kept per stage and case in a report row (a DiffReport keeps up to
# harness.diff.MAX_FINDINGS per comparison; every finding is counted in the metrics).
ROW_FINDINGS_PER_STAGE = 12


def jsonable(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def row(name: str, suite: str, backend: str, *, outcome: str = "ok", reason: str = "",
        description: str = "", shape: str = "", context: Optional[int] = None,
        expect_nonfinite: bool = False, seconds: float = 0.0, gpu_peak_bytes: Optional[int] = None,
        tensor_bytes: Optional[int] = None, **results) -> dict:
    """A report row; `results` may set metrics, findings, summaries, details, planted.
    `gpu_peak_bytes` and `tensor_bytes`: harness.run.memory (None where not measured)."""
    out = {"case": name, "suite": suite, "backend": backend, "outcome": outcome, "reason": reason,
           "description": description, "shape": shape, "context": context,
           "expect_nonfinite": expect_nonfinite, "planted": [], "metrics": {}, "findings": [],
           "summaries": {}, "details": {}, "seconds": seconds,
           "gpu_peak_bytes": gpu_peak_bytes, "tensor_bytes": tensor_bytes}
    unknown = set(results) - {"planted", "metrics", "findings", "summaries", "details"}
    if unknown:
        raise TypeError(f"row: unknown field(s) {sorted(unknown)}")
    out.update(results)
    return out


def case_row(case, backend: str, **kw) -> dict:
    """The row of a validation case (harness.run.cases.Case), before it runs."""
    return row(case.name, case.suite, backend, description=case.description, shape=case.summary(),
               context=max(s.len for s in case.seqs), expect_nonfinite=case.expect_nonfinite, **kw)


def dump_row(path: str, reports, backend: str, seconds: float) -> dict:
    """The row of a replayed dump: one DiffReport per op of the file."""
    metrics, findings, summaries = {}, [], {}
    for rep in reports:
        for k, v in rep.metrics.items():
            metrics[f"{rep.op}.{k}"] = float(v)
        findings += [{"stage": rep.op, "step": 0, **jsonable(f)} for f in rep.findings[:ROW_FINDINGS_PER_STAGE]]
        summaries[rep.op] = [rep.summary()]
    nonfinite = [r for r in reports if r.metrics.get("nonfinite_inputs")]
    reason = "; ".join(f["where"] for r in nonfinite for f in r.findings[:1]) if nonfinite else ""
    return row(os.path.basename(path), "diff", backend, outcome="nonfinite_input" if nonfinite else "ok",
               reason=reason, description=path, shape=", ".join(r.op for r in reports),
               seconds=round(seconds, 3), metrics=metrics, findings=findings, summaries=summaries)


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")      # the CPU extensions the benchmarks name


def cpu_name(isa: bool = False, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (from /proc/cpuinfo; else the platform's word for it); with `isa`,
    followed by the extensions of ISA_FLAGS it has, "(avx2, avx512f)"."""
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    cpu = value.strip()
                elif key.strip() == "flags":
                    flags = value.split()
                    break
    except OSError:
        pass
    have = [f for f in ISA_FLAGS if f in flags]
    return cpu + (f" ({', '.join(have)})" if isa and have else "")


def machine(device: str) -> str:
    """The machine a run used, as every report, dump, study and benchmark names it."""
    if device != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} (torch {torch.__version__})"
    return f"{cpu_name()}, {os.cpu_count()} cores (torch {torch.__version__}, CPU)"


def _triton_version() -> Optional[str]:
    try:
        import triton  # optional: absent on some machines
        return triton.__version__
    except Exception:
        return None


def run_meta(command: str, *, backend: str, backend_requested: Optional[str], backend_description: str,
             device: str, started: float, **extra) -> dict:
    """The run's metadata (`run` in report.json); `extra` adds command-specific fields."""
    meta = {"command": command, "backend": backend}
    if backend_requested is not None:
        meta["backend_requested"] = backend_requested
    meta.update({"backend_description": backend_description, "device": device, "machine": machine(device)})
    meta.update({"started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
                 "seconds": round(time.time() - started, 3), "argv": sys.argv[1:],
                 "versions": {"python": platform.python_version(), "torch": torch.__version__,
                              "triton": _triton_version()}})
    meta.update(extra)
    return meta
