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

A budgets file cannot pass by accident (checked before any case runs): an empty file, an
unknown key, a key naming a metric its stage does not report, a limit no value can meet
(`pooled_max_ulp = -1`), a [suite.S] or [case.C] scope naming no suite or case, a key of a
scope in use matching no metric of the run, and a metric the table marks `required` that
the run reports but the file neither bounds nor turns "off" are all errors naming the file
and the key (exit 2). The metrics, their directions and how steps combine are declared once,
in harness/diff/metrics.py; `judge` there decides every verdict. A check turned "off" is
listed in every report of the run.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from harness.diff.metrics import CHAIN, METRICS, OFF, Limit, bare, emitted_by, is_chain, judge, op_emits, required_keys
from harness.errors import InputError
from harness.io import safe_input
from harness.run.cases import BUDGETS_FILE, CASES_DIR
from reference.ops import OPS, STAGES

__all__ = ["BudgetError", "Budgets", "Limit", "OFF", "load", "verdict"]


class BudgetError(InputError):
    """An unreadable or malformed budgets file; the message names the file and the problem."""


def _key_problem(key: str) -> Optional[str]:
    """None when a budget key names a metric some stage emits, else why not."""
    if not isinstance(key, str) or not key:
        return "empty key"
    stage, dot, name = key.rpartition(".")
    if name not in METRICS:
        close = difflib.get_close_matches(name, list(METRICS), n=1)
        return f"unknown metric {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    if not dot:
        if METRICS[name].chain == "only":
            return f"{name} is a whole-chain metric: write \"{CHAIN}.{name}\""
        return None
    if stage == CHAIN:
        return None if emitted_by(name, CHAIN) else f"the whole-chain comparison does not report {name}"
    if stage not in OPS:
        return f"unknown stage {stage!r} (an op name or {CHAIN!r})"
    if not op_emits(name, stage):
        return f"op {stage} does not report {name}"
    return None


def _limit(path, where: str, key: str, v) -> Limit:
    bad = _key_problem(key)
    if bad:
        raise BudgetError(f"{path}: [{where}] {key}: {bad}")
    try:
        return Limit.parse(bare(key), v)
    except ValueError as e:
        raise BudgetError(f"{path}: [{where}] {key}: {e}") from None


def _table(path, where: str, raw) -> dict[str, Limit]:
    if not isinstance(raw, dict):
        raise BudgetError(f"{path}: [{where}] must be a table of metric = limit, got {raw!r}")
    if not raw and where != "default":
        raise BudgetError(f"{path}: [{where}] is empty (it would change nothing)")
    return {k: _limit(path, where, k, v) for k, v in raw.items()}


@dataclass
class Budgets:
    path: str
    default: dict[str, Limit]
    suites: dict[str, dict[str, Limit]]
    cases: dict[str, dict[str, Limit]]

    def _find(self, key: str, suite: str, case: str) -> tuple[Optional[Limit], str, str]:
        """(limit, scope, budget key) of the most specific budget of `key`."""
        stage, _, name = key.partition(".")
        names = (key,) if stage == CHAIN else (key, name)
        for scope, table in ((f"case.{case}", self.cases.get(case)), (f"suite.{suite}", self.suites.get(suite)),
                             ("default", self.default)):
            for n in names:
                if table and n in table:
                    return table[n], scope, n
        return None, "", ""

    def limit(self, key: str, suite: str, case: str) -> Optional[Limit]:
        return self._find(key, suite, case)[0]

    def check(self, metrics: dict, suite: str, case: str) -> list[dict]:
        """Every exceeded limit: {metric, value, limit, why} (harness.diff.metrics.judge)."""
        return judge(metrics, lambda k: self.limit(k, suite, case))

    def keys(self) -> set[str]:
        out = set(self.default)
        for t in (*self.suites.values(), *self.cases.values()):
            out |= set(t)
        return out

    def check_run(self, run: dict[str, Iterable[str]], suite: str, *, known_cases: Iterable[str] = (),
                  known_suites: Iterable[str] = (), what: str = "case") -> None:
        """Before any work: the budgets fit this run. `run`: case name -> the metric keys its
        ops can report (metrics.run_keys). BudgetError naming the file and key when a
        [suite.S] or [case.C] scope names nothing known, when a key of a scope in use matches
        no metric of the run, or when a metric class a budgets file must bound (the metric
        table's `required`) has neither a limit nor "off"."""
        run = {c: set(k) for c, k in run.items()}
        known_cases = set(known_cases) | set(run)
        for c in self.cases:
            if c not in known_cases:
                raise BudgetError(f"{self.path}: [case.{c}]: no {what} named {c!r}"
                                  + (" in this run" if what != "case" else " (see `mxval cases`)"))
        known_suites = set(known_suites) | {suite}
        for s in self.suites:
            if s not in known_suites:
                raise BudgetError(f"{self.path}: [suite.{s}]: no suite named {s!r} (known: "
                                  f"{', '.join(sorted(known_suites))})")
        every = set().union(*run.values()) if run else set()
        scoped = [(f"suite.{suite}", self.suites.get(suite, {}), every)]
        scoped += [(f"case.{c}", self.cases.get(c, {}), keys) for c, keys in run.items()]
        for where, table, keys in scoped:
            bare_keys = {bare(k) for k in keys if not is_chain(k)}
            for k in table:
                if k not in keys and k not in bare_keys:
                    raise BudgetError(f"{self.path}: [{where}] {k}: matches no metric of this run "
                                      f"(its ops do not report it)")
        missing: dict[str, list[str]] = {}
        for c, keys in run.items():
            for k in required_keys(keys):
                if self.limit(k, suite, c) is None:
                    shown = k if is_chain(k) else bare(k)
                    missing.setdefault(shown, []).append(c)
        if missing:
            names = sorted(missing)
            cs = sorted({c for v in missing.values() for c in v})
            raise BudgetError(f"{self.path}: no limit for {', '.join(names)} ({what} {cs[0]!r}"
                              f"{f' and {len(cs) - 1} more' if len(cs) > 1 else ''}): a budgets file must "
                              "bound every metric class the run reports, or say \"off\" for it")

    def disabled(self, run: dict[str, Iterable[str]], suite: str) -> list[str]:
        """The contract's checks (required or always-fail metrics) that "off" turns off for
        this run, each as `[scope] key = "off"`: every report shows them."""
        out: set[str] = set()
        for c, keys in run.items():
            for k in keys:
                m = METRICS.get(bare(k))
                if m is None or not (m.always_fail or k in required_keys([k])):
                    continue
                lim, scope, used = self._find(k, suite, c)
                if lim is not None and lim.off:
                    out.add(f'[{scope}] {used} = "off"')
        return sorted(out)

    def as_dict(self) -> dict:
        def t(tab):
            return {k: v.text() for k, v in tab.items()}
        return {"path": self.path, "default": t(self.default),
                "suite": {s: t(v) for s, v in self.suites.items()},
                "case": {c: t(v) for c, v in self.cases.items()}}


def default_path() -> Path:
    return CASES_DIR / BUDGETS_FILE


def load(path: Path | str | None = None) -> Budgets:
    """Read and check a budgets file: every key must name a metric of the metric table that
    its stage reports, every limit must be one some value can meet. BudgetError otherwise
    (one line naming the file, the scope and the key). Whether the file fits a run (every
    required metric bounded) is `Budgets.check_run`."""
    path = Path(path) if path is not None else default_path()
    data = safe_input.load_toml(path, error=BudgetError)
    extra = set(data) - {"default", "suite", "case"}
    if extra:
        raise BudgetError(f"{path}: unknown top-level key(s) {sorted(extra)} (known: default, suite, case)")
    for scope in ("suite", "case"):
        if not isinstance(data.get(scope, {}), dict):
            raise BudgetError(f"{path}: [{scope}.<name>] tables expected")
        for name, t in data.get(scope, {}).items():
            if not isinstance(t, dict):
                raise BudgetError(f"{path}: [{scope}] {name}: expected a [{scope}.{name}] table of metric = limit")
    b = Budgets(str(path), _table(path, "default", data.get("default", {})),
                {s: _table(path, f"suite.{s}", t) for s, t in data.get("suite", {}).items()},
                {c: _table(path, f"case.{c}", t) for c, t in data.get("case", {}).items()})
    if not b.keys():
        raise BudgetError(f"{path}: empty budgets file: it bounds no metric (start from {default_path()})")
    return b


def verdict(row: dict, budgets: Budgets, suite: str) -> dict:
    """The row with `status` (pass | fail | error | nonfinite_input | skipped), `ok` and
    `violations`. Non-finite inputs are their own class, never a pass; they are ok only
    in a case that declares `expect_nonfinite = true` (and such a case that reports no
    non-finite input fails: the harness missed what was planted). A non-finite-input row
    is judged on what was measured all the same (the invariants of every backend output,
    the stages the reference could judge): a broken budget makes it a failure."""
    row = dict(row)
    outcome = row.get("outcome", "error")
    row["violations"] = []
    if outcome == "skipped":
        row.update(status="skipped", ok=True)
    elif outcome == "error":
        row.update(status="error", ok=False)
    elif outcome == "nonfinite_input":
        expected = bool(row.get("expect_nonfinite"))
        row["violations"] = v = budgets.check(row.get("metrics", {}), suite, row["case"])
        if v:
            first = first_failing_stage(v)
            row.update(status="fail", ok=False,
                       reason=(f"{first} fails: " if first else "")
                       + "; ".join(f"{x['metric']} {x['why']}" for x in v[:3])
                       + (f" (+{len(v) - 3} more)" if len(v) > 3 else "")
                       + f"; on non-finite inputs: {row.get('reason', '')}")
        else:
            row.update(status="nonfinite_input", ok=expected)
            if not expected:
                row["reason"] += " (the case does not declare expect_nonfinite = true)"
    else:
        row["violations"] = budgets.check(row.get("metrics", {}), suite, row["case"])
        not_judged = row.get("not_judged")
        nondet = row.get("nondeterministic")
        if nondet:                # its own failure class: the same inputs gave other bytes
            row.update(status="fail", ok=False,
                       reason=f"nondeterministic: {nondet[0]}" + (f" (+{len(nondet) - 1} more)" if len(nondet) > 1 else "")
                       + (f"; {first_failing_stage(row['violations'])} fails too" if row["violations"] else ""))
        elif row.get("expect_nonfinite"):
            row.update(status="fail", ok=False,
                       reason="planted non-finite inputs were not reported as non-finite "
                              f"({'; '.join(row.get('planted') or []) or 'nothing planted'})")
        elif row["violations"]:
            v = row["violations"]
            first = first_failing_stage(v)
            row.update(status="fail", ok=False,
                       reason=(f"{first} fails: " if first else "")
                       + "; ".join(f"{x['metric']} {x['why']}" for x in v[:3])
                       + (f" (+{len(v) - 3} more)" if len(v) > 3 else "")
                       + (f"; {not_judged}" if not_judged else ""))
        elif not_judged:          # a stage the reference could not judge is never a pass
            row.update(status="fail", ok=False, reason=not_judged)
        else:
            row.update(status="pass", ok=True)
    return row


GRAPH_NE_EAGER = ".graph_eager_bytes_differ"     # harness/run/graph.py METRIC


def first_failing_stage(violations: list[dict]) -> str:
    """The op, in chain order, of the first violated `<op>.<metric>` (`chain.*` only when no
    stage broke a budget); "" when none names an op."""
    ops = [v["metric"].split(".")[0] for v in violations]
    staged = [o for o in ops if o in OPS]
    if staged:
        # graph mode's replay-against-eager comparison is a stage of its own, named after the op
        judged = [o for o, v in zip(ops, violations) if o in OPS and not v["metric"].endswith(GRAPH_NE_EAGER)]
        if judged:
            return min(judged, key=lambda o: STAGES.index(OPS[o].stage))
        return f"graph ≠ eager ({min(staged, key=lambda o: STAGES.index(OPS[o].stage))})"
    return CHAIN if CHAIN in ops else ""
