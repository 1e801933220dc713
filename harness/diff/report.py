"""DiffReport and the finding collector every stage's differ fills."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

MAX_FINDINGS = 50
HIGHER_IS_BETTER = frozenset({"topk_recall_min", "topk_jaccard_min"})
ALWAYS_FAIL = ("nonfinite_inputs", "pooled_nonfinite", "logits_nonfinite", "outputs_missing",
               "outputs_bad_shape", "op_unsupported")


def higher_is_better(metric: str) -> bool:
    return metric.endswith("_min") or metric in HIGHER_IS_BETTER


@dataclass
class DiffReport:
    op: str
    metrics: dict[str, float] = field(default_factory=dict)
    findings: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def failures(self, budgets: dict[str, float]) -> list[tuple[str, float, Optional[float]]]:
        """(metric, value, budget) of every metric that fails; budget None for ALWAYS_FAIL."""
        out = []
        for m in ALWAYS_FAIL:
            v = self.metrics.get(m, 0)
            if v != 0:
                out.append((m, v, None))
        for m, b in budgets.items():
            if m not in self.metrics or m in ALWAYS_FAIL:
                continue
            v = float(self.metrics[m])
            good = (v >= b) if higher_is_better(m) else (v <= b)
            if not good or math.isnan(v):
                out.append((m, v, b))
        return out

    def ok(self, budgets: dict[str, float]) -> bool:
        return not self.failures(budgets)

    def summary(self, budgets: Optional[dict[str, float]] = None, max_findings: int = 8) -> str:
        lines = []
        if budgets is not None:
            bad = self.failures(budgets)
            lines.append(f"{self.op}: {'OK' if not bad else 'FAIL'}")
            for m, v, b in bad:
                rule = "must be 0" if b is None else (f">= {b:g}" if higher_is_better(m) else f"<= {b:g}")
                lines.append(f"  {m} = {v:g} ({rule})")
        else:
            lines.append(f"{self.op}:")
        shown = {k: v for k, v in self.metrics.items() if v != 0 or higher_is_better(k)}
        if shown:
            lines.append("  " + ", ".join(f"{k}={fmt_num(v)}" for k, v in shown.items()))
        for f in self.findings[:max_findings]:
            lines.append(f"  [{f['class']}] {f['where']}")
        if len(self.findings) > max_findings:
            lines.append(f"  ... {len(self.findings) - max_findings} more findings listed")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def raise_if_failed(self, budgets: dict[str, float]) -> None:
        if not self.ok(budgets):
            raise AssertionError(self.summary(budgets))


def fmt_num(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) and not float(v).is_integer() else f"{v:g}"


class Collector:
    """Findings in order, the first MAX_FINDINGS kept, every class counted."""

    def __init__(self):
        self.kept: list[dict] = []
        self.counts: dict[str, int] = {}
        self.total = 0

    def count(self, cls: str, n: int = 1) -> None:
        if n:
            self.counts[cls] = self.counts.get(cls, 0) + int(n)

    def keep(self, finding: dict) -> bool:
        self.total += 1
        if len(self.kept) < MAX_FINDINGS:
            self.kept.append(finding)
            return True
        return False

    def report(self, op: str, metrics: dict, notes: Optional[list] = None) -> DiffReport:
        notes = list(notes or [])
        for cls, n in sorted(self.counts.items()):
            metrics[f"class_{cls}"] = float(n)
        self.total = max(self.total, sum(self.counts.values()))
        if self.total > len(self.kept):
            notes.append(f"{self.total} findings, the first {len(self.kept)} listed")
        return DiffReport(op, {k: float(v) for k, v in metrics.items()}, self.kept, notes)



def hex_byte(v: int) -> str:
    return f"0x{int(v):02x}"
