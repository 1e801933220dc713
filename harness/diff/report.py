"""DiffReport and the finding collector every stage's differ fills."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .metrics import METRICS, Limit, bare, judge

# Findings a DiffReport keeps, per comparison (each one is counted in the metrics either way).
# A report row keeps fewer per stage: harness.run.record.ROW_FINDINGS_PER_STAGE.
MAX_FINDINGS = 50


def _limits(budgets) -> dict[str, Limit]:
    """{metric: number | {max, min} | "off" | Limit} -> {metric: Limit}, checked against the
    metric table: ValueError naming the key when unknown, malformed or impossible to meet."""
    if budgets is None:
        return {}
    if not isinstance(budgets, dict):
        raise ValueError(f"budgets: expected a dict of metric -> limit, got {type(budgets).__name__}")
    out = {}
    for k, v in budgets.items():
        if not isinstance(k, str) or bare(k) not in METRICS:
            raise ValueError(f"budgets: unknown metric {k!r} (see harness/diff/metrics.py)")
        try:
            out[bare(k)] = Limit.parse(bare(k), v)
        except ValueError as e:
            raise ValueError(f"budgets[{k!r}]: {e}") from None
    return out


@dataclass
class DiffReport:
    op: str
    metrics: dict[str, float] = field(default_factory=dict)
    findings: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # top-k diffs only (harness/diff/scores.py): the per-row selection the recall plot reads
    # (`recall_points`): {recall, exact, mass, lengths} tensors over the rows; None elsewhere
    rows: Optional[dict] = None

    def failures(self, budgets: Optional[dict] = None) -> list[dict]:
        """Every metric that breaks its budget, judged by `metrics.judge` (the judge mxval's
        reports use): [{metric, value, limit, why}]. `budgets`: metric -> a number (bounds the
        bad side), {max, min} or "off". Always-fail metrics (non-finite or missing outputs)
        fail when non-zero unless a budget names them."""
        limits = _limits(budgets)
        return judge(self.metrics, lambda k: limits.get(bare(k)))

    def ok(self, budgets: Optional[dict] = None) -> bool:
        return not self.failures(budgets)

    def summary(self, budgets: Optional[dict] = None, max_findings: int = 8) -> str:
        lines = []
        if budgets is not None:
            bad = self.failures(budgets)
            lines.append(f"{self.op}: {'OK' if not bad else 'FAIL'}")
            for v in bad:
                lines.append(f"  {v['metric']} = {fmt_num(v['value']) if v['value'] is not None else 'NaN'} "
                             f"(must be {v['limit']})")
        else:
            lines.append(f"{self.op}:")
        shown = {k: v for k, v in self.metrics.items() if v != 0 or (k in METRICS and METRICS[k].higher_is_better)}
        if shown:
            lines.append("  " + ", ".join(f"{k}={fmt_num(v)}" for k, v in shown.items()))
        for f in self.findings[:max_findings]:
            lines.append(f"  [{f['class']}] {f['where']}")
        if len(self.findings) > max_findings:
            lines.append(f"  ... {len(self.findings) - max_findings} more findings listed")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def raise_if_failed(self, budgets: Optional[dict] = None) -> None:
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

    def keep_rows(self, rows, finding) -> None:
        """`keep(finding(r))` for each row r of `rows` (a 1-D tensor) in order, each finding
        made only while there is room (the rest are counted in the total)."""
        room = max(0, MAX_FINDINGS - len(self.kept))
        for r in rows[:room].tolist():
            self.keep(finding(r))
        self.total += max(0, rows.numel() - room)

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
