"""Budgets: a threshold per metric, with per-suite and per-case overrides.

`cases/budgets.toml` (or `--budgets FILE`):

    [default]                        # the exact contract
    page_bytes_mismatched = 0        # a number is an upper bound
    topk_recall_min = 1.0            # ... except for higher-is-better metrics (*_min): a lower bound
    page_dequant_max_rel_err = {max = 0.1, min = 0}   # a table may give max and/or min
    "chain.page_bytes_mismatched_frac" = 1e-3

    [suite.full]
    "chain.page_bytes_mismatched_frac" = 5e-3

    [case.some-case]
    pooled_max_ulp = "off"           # drop an inherited limit

Metrics are keyed `<stage>.<metric>` (stage = an op name, or `chain` for the whole-chain
comparison). A budget key is either such a full key or a bare metric name; a bare name
applies to every op stage but never to `chain.*` (the whole chain has its own budget).
The most specific scope wins (case, then suite, then default); within a scope the full
key beats the bare name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from harness.errors import InputError
from harness.run.cases import BUDGETS_FILE, CASES_DIR, tomllib

CHAIN_PREFIX = "chain"


class BudgetError(InputError):
    """An unreadable or malformed budgets file; the message names the file and the problem."""


@dataclass(frozen=True)
class Limit:
    max: Optional[float] = None
    min: Optional[float] = None

    def violated(self, value) -> Optional[str]:
        """None when `value` holds, else why not. NaN never holds."""
        if value is None:
            return None
        v = float(value)
        if math.isnan(v):
            return "is NaN"
        if self.max is not None and v > self.max:
            return f"{_fmt(v)} > {_fmt(self.max)}"
        if self.min is not None and v < self.min:
            return f"{_fmt(v)} < {_fmt(self.min)}"
        return None

    def text(self) -> str:
        parts = ([f"<= {_fmt(self.max)}"] if self.max is not None else []) + \
                ([f">= {_fmt(self.min)}"] if self.min is not None else [])
        return " and ".join(parts) or "off"


OFF = Limit()


def _fmt(v: float) -> str:
    return f"{v:.6g}" if isinstance(v, float) and not float(v).is_integer() else f"{v:g}"


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _limit(path, where: str, key: str, v) -> Limit:
    from harness.diff import higher_is_better
    if v == "off":
        return OFF
    # A NaN limit compares False with everything, so it would pass any value.
    if _num(v) and not math.isnan(v):      # a bare number bounds the bad side: *_min from below
        return Limit(min=float(v)) if higher_is_better(key.rpartition(".")[2]) else Limit(max=float(v))
    if isinstance(v, dict) and v and not set(v) - {"max", "min"} \
            and all(_num(x) and not math.isnan(x) for x in v.values()):
        lim = Limit(max=float(v["max"]) if "max" in v else None, min=float(v["min"]) if "min" in v else None)
        if lim.max is not None and lim.min is not None and lim.min > lim.max:
            raise BudgetError(f"{path}: [{where}] {key}: min {_fmt(lim.min)} > max {_fmt(lim.max)}, no value can pass")
        return lim
    raise BudgetError(f"{path}: [{where}] {key}: expected a number, {{max = .., min = ..}} or \"off\", got {v!r}")


def _table(path, where: str, raw) -> dict[str, Limit]:
    if not isinstance(raw, dict):
        raise BudgetError(f"{path}: [{where}] must be a table of metric = limit")
    return {k: _limit(path, where, k, v) for k, v in raw.items()}


@dataclass
class Budgets:
    path: str
    default: dict[str, Limit]
    suites: dict[str, dict[str, Limit]]
    cases: dict[str, dict[str, Limit]]

    def limit(self, key: str, suite: str, case: str) -> Optional[Limit]:
        stage, _, metric = key.partition(".")
        names = (key,) if stage == CHAIN_PREFIX else (key, metric)
        for table in (self.cases.get(case), self.suites.get(suite), self.default):
            for name in names:
                if table and name in table:
                    return table[name]
        return None

    def check(self, metrics: dict, suite: str, case: str) -> list[dict]:
        """Every exceeded limit: {metric, value, limit, why}."""
        from harness.diff import ALWAYS_FAIL
        out = []
        for key, value in sorted(metrics.items(), key=lambda kv: (kv[0].startswith(CHAIN_PREFIX + "."), kv[0])):
            lim = self.limit(key, suite, case)
            if lim is None and key.partition(".")[2] in ALWAYS_FAIL:
                lim = Limit(max=0.0)     # non-finite or missing outputs: never a silent pass
            why = lim.violated(value) if lim else None
            if why:
                out.append({"metric": key, "value": _jsonable(value), "limit": lim.text(), "why": why})
        return out

    def keys(self) -> set[str]:
        out = set(self.default)
        for t in (*self.suites.values(), *self.cases.values()):
            out |= set(t)
        return out

    def unused(self, metric_keys, suite: str, cases) -> list[str]:
        """Keys of the [suite.S] and [case.C] scopes in use that matched no metric of the
        run: an override with a typo would silently check nothing. ([default] keys are
        checked against the metric names by the test suite; some only appear on failure.)"""
        full = set(metric_keys)
        bare = {k.partition(".")[2] for k in full if not k.startswith(CHAIN_PREFIX + ".")}
        keys = set(self.suites.get(suite, {}))
        for c in cases:
            keys |= set(self.cases.get(c, {}))
        return sorted(k for k in keys if k not in full and k not in bare)

    def as_dict(self) -> dict:
        def t(tab):
            return {k: v.text() for k, v in tab.items()}
        return {"path": self.path, "default": t(self.default),
                "suite": {s: t(v) for s, v in self.suites.items()},
                "case": {c: t(v) for c, v in self.cases.items()}}


def _jsonable(v):
    f = float(v)
    return None if math.isnan(f) else (int(f) if f.is_integer() and abs(f) < 2 ** 53 else f)


def default_path() -> Path:
    return CASES_DIR / BUDGETS_FILE


def load(path: Path | str | None = None) -> Budgets:
    path = Path(path) if path else default_path()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise BudgetError(f"{path}: cannot read budgets file: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise BudgetError(f"{path}: malformed TOML: {e}") from None
    extra = set(data) - {"default", "suite", "case"}
    if extra:
        raise BudgetError(f"{path}: unknown top-level key(s) {sorted(extra)} (known: default, suite, case)")
    for scope in ("suite", "case"):
        if not isinstance(data.get(scope, {}), dict):
            raise BudgetError(f"{path}: [{scope}.<name>] tables expected")
    return Budgets(str(path), _table(path, "default", data.get("default", {})),
                   {s: _table(path, f"suite.{s}", t) for s, t in data.get("suite", {}).items()},
                   {c: _table(path, f"case.{c}", t) for c, t in data.get("case", {}).items()})


STATUSES = ("pass", "fail", "error", "nonfinite_input", "skipped")


def verdict(row: dict, budgets: Budgets, suite: str) -> dict:
    """The row with `status` (pass | fail | error | nonfinite_input | skipped), `ok` and
    `violations`. Non-finite inputs are their own class, never a pass; they are ok only
    in a case that declares `expect_nonfinite = true` (and such a case that reports no
    non-finite input fails: the harness missed what was planted)."""
    row = dict(row)
    outcome = row.get("outcome", "error")
    row["violations"] = []
    if outcome == "skipped":
        row.update(status="skipped", ok=True)
    elif outcome == "error":
        row.update(status="error", ok=False)
    elif outcome == "nonfinite_input":
        expected = bool(row.get("expect_nonfinite"))
        row.update(status="nonfinite_input", ok=expected)
        if not expected:
            row["reason"] += " (the case does not declare expect_nonfinite = true)"
    else:
        row["violations"] = budgets.check(row.get("metrics", {}), suite, row["case"])
        if row.get("expect_nonfinite"):
            row.update(status="fail", ok=False,
                       reason="planted non-finite inputs were not reported as non-finite "
                              f"({'; '.join(row.get('planted') or []) or 'nothing planted'})")
        elif row["violations"]:
            v = row["violations"]
            row.update(status="fail", ok=False,
                       reason="; ".join(f"{x['metric']} {x['why']}" for x in v[:3])
                       + (f" (+{len(v) - 3} more)" if len(v) > 3 else ""))
        else:
            row.update(status="pass", ok=True)
    return row
