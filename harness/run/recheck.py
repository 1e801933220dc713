"""A verdict is computed, never read: the rows of a stored report.json judged again.

`mxval report DIR` and `mxval report --merge DIR...` never take a row's `status` or `ok`
as written. The budgets the run recorded (`run.budgets`, the limits as texts) are parsed
back, each row's status is computed again from its metrics (`budgets.verdict`, the judge
every run uses), and a row whose stored status, `ok` or violations disagree with the
recomputed ones is refused with one line naming it (exit 2): a report.json passes
through other hands (a CI artefact, a shard from another machine), and an edited
`ok = true` must not turn a failure into a pass.

A selftest report's rows judge the judge: a fault run passes when a budget breaks (its
stored pass needs violations its metrics give), a correct run passes when none does; a
row stored as failing is never more favourable than the truth and stands as written.

The limits are not taken from the report either: the recorded `run.budgets` must be those
of the budgets file the run names (`run.budgets.path`; a checkout's default file is this
checkout's), else the report is refused (`mxval report --budgets FILE` judges against a file
the user names instead).

What the metrics cannot say is checked against the case definitions instead:
  error            never ok;
  skipped          ok, and no metrics (a skipped case ran nothing);
  nonfinite_input  ok exactly when the case, as its suite file defines it (the run's
                   --cases-dir, else cases/), declares `expect_nonfinite` and plants
                   something; never for a dump (`mxval diff`); and its metrics break no
                   budget (else its status is fail).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from harness.diff.metrics import Limit, reported_keys
from harness.errors import InputError, ReportError
from harness.io import safe_input
from harness.run import budgets as B
from harness.run import shard as S


def _limit(where: str, key: str, text) -> Limit:
    """A limit from its recorded text (`Limit.text()`: "<= 1", ">= 0.99", "<= 1 and >= 0", "off")."""
    try:
        return Limit.from_text(text)
    except ValueError as e:
        raise ReportError(f"{where}: {key}: {e}") from None


def recorded_budgets(meta: dict, where: str) -> B.Budgets:
    """The budgets a report recorded (`run.budgets`), as the judge uses them."""
    d = meta.get("budgets")
    if not isinstance(d, dict) or not isinstance(d.get("default"), dict):
        raise ReportError(f"{where}: run.budgets: no budgets recorded, so no verdict can be computed")

    def table(scope: str, t) -> dict:
        if not isinstance(t, dict):
            raise ReportError(f"{where}: run.budgets.{scope}: expected an object of limits")
        return {k: _limit(f"{where}: run.budgets.{scope}", k, v) for k, v in t.items()}

    def scopes(name: str) -> dict:
        t = d.get(name) or {}
        if not isinstance(t, dict):
            raise ReportError(f"{where}: run.budgets.{name}: expected an object of scopes")
        return {s: table(f"{name}.{s}", v) for s, v in t.items()}

    return B.Budgets(str(d.get("path", "")), table("default", d["default"]), scopes("suite"), scopes("case"))


def declared_budgets(recorded: B.Budgets, where: str) -> B.Budgets:
    """The budgets file a report names (`run.budgets.path`), loaded: the limits its rows are
    judged by. A run's default file (`.../cases/budgets.toml`) is this checkout's when the
    report comes from another checkout."""
    p = Path(recorded.path) if recorded.path else None
    if p is not None and not p.is_file() and p.name == B.BUDGETS_FILE and p.parent.name == B.CASES_DIR.name:
        p = B.default_path()
    if p is None or not p.is_file():
        raise ReportError(f"{where}: run.budgets.path {recorded.path!r:.120} is no file here, so the recorded "
                          "limits cannot be confirmed; judge the rows with `--budgets FILE` (refused)")
    try:
        return B.load(p)
    except InputError as e:
        raise ReportError(f"{where}: run.budgets.path: {e}") from None


def check_declared(recorded: B.Budgets, where: str) -> None:
    """The recorded limits are exactly those of the budgets file the report names."""
    declared = declared_budgets(recorded, where)
    rec, dec = _flat(recorded), _flat(declared)
    for key in sorted(set(rec) | set(dec)):
        if rec.get(key) != dec.get(key):
            scope, metric = key
            raise ReportError(f"{where}: run.budgets: {scope} {metric} is {rec.get(key, 'absent')!r} in the report "
                              f"but {dec.get(key, 'absent')!r} in {declared.path}, the budgets file it names; "
                              "limits are read from the file, never from the report (refused)")


def _flat(b: B.Budgets) -> dict:
    """{(scope, metric): limit text} over every table of `b`."""
    d = b.as_dict()
    out = {("[default]", k): v for k, v in d["default"].items()}
    for kind in ("suite", "case"):
        out.update({(f"[{kind}.{name}]", k): v for name, t in d[kind].items() for k, v in t.items()})
    return out


def _cases_dir(meta: dict) -> Optional[str]:
    argv = [str(a) for a in meta.get("argv") or []]
    cases_dir = None
    for i, a in enumerate(argv):
        if a == "--cases-dir" and i + 1 < len(argv):
            cases_dir = argv[i + 1]
        elif a.startswith("--cases-dir="):
            cases_dir = a.split("=", 1)[1]
    return cases_dir


def _dump_ops(path: str) -> Optional[tuple]:
    """The ops a dump holds, from its metadata alone (None when it cannot be read)."""
    try:
        from safetensors import safe_open

        from harness.io.dumps import META_KEY
        with safe_open(path, "pt") as f:
            ops = safe_input.loads_json((f.metadata() or {})[META_KEY], path).get("ops")
        return tuple(ops) if isinstance(ops, dict) else None
    except Exception:                  # a file gone or unreadable: the row's own keys decide
        return None


def row_ops(rows: list, meta: dict) -> dict:
    """case name -> the ops its run had, from outside the row: the case definition (the run's
    cases directory and --path) or, for `mxval diff`, the dump's own metadata; absent where
    neither is found."""
    names = {str(r.get("case")) for r in rows if r.get("status") == "pass"}
    if not names:
        return {}
    out: dict = {}
    if meta.get("command") == "diff":
        files = {Path(str(f)).name: str(f) for f in meta.get("files") or [] if isinstance(f, str)}
        for n in names:
            ops = _dump_ops(files[n]) if n in files else None
            if ops:
                out[n] = ops
        return out
    from harness.run.cases import Catalog, on_path
    try:
        by_name = Catalog(_cases_dir(meta)).by_name
    except (InputError, OSError):
        return {}
    path = meta.get("path")
    for n in names:
        c = by_name.get(n.split(" [seed ")[0])
        if c is not None:
            try:
                out[n] = tuple((on_path(c, path) if path in ("rocm", "cuda") else c).ops)
            except (InputError, ValueError):
                pass
    return out


def missing_metric(row: dict, ops, budgets: B.Budgets, suite: str, *, chain: bool) -> Optional[str]:
    """A pass row must carry every metric its ops always report that the budgets bound: one
    deleted from report.json (its violation with it) is never a pass. `ops` None: the ops its
    own keys name, and at least one metric."""
    metrics = row.get("metrics") or {}
    if ops is None:
        ops = tuple(sorted({k.split(".")[0] for k in metrics if not k.startswith("chain.")}))
        if not ops:
            return "stored as pass with no metric at all (a pass needs the metrics its budgets bound)"
    from reference.ops import OPS
    ops = [o for o in ops if o in OPS]
    case = str(row.get("case")).split(" [seed ")[0]
    for k in reported_keys(ops, chain=chain):
        lim = budgets.limit(k, suite, case)
        if k not in metrics and lim is not None and (lim.max is not None or lim.min is not None):
            return f"stored as pass without {k}, which its ops always report and the budgets bound"
    return None


def case_expectations(rows: list, meta: dict, where: str) -> dict:
    """case name -> whether its definition declares non-finite inputs (expect_nonfinite and a
    plant), for the rows stored as nonfinite_input; None where no definition is found."""
    names = {str(r.get("case")) for r in rows if r.get("status") == "nonfinite_input"}
    if not names:
        return {}
    if meta.get("command") == "diff":                    # a dump declares nothing
        return {n: False for n in names}
    from harness.run.cases import Catalog
    try:
        by_name = Catalog(_cases_dir(meta)).by_name
    except (InputError, OSError):
        by_name = {}
    return {n: (bool(by_name[n].expect_nonfinite and by_name[n].plant) if n in by_name else None) for n in names}


def _violated(row: dict) -> set:
    return {v.get("metric") for v in row.get("violations") or [] if isinstance(v, dict)}


def _selftest_disagreement(row: dict, budgets: B.Budgets, suite: str) -> Optional[str]:
    status, ok = row.get("status"), row.get("ok")
    if status in ("fail", "error"):
        return None if ok is False else f"status {status} with ok = {ok!r}"
    if status == "skipped":
        return None if ok is True and not row.get("metrics") else f"status skipped with ok = {ok!r} or metrics"
    if status != "pass" or ok is not True:
        return f"status {status!r} with ok = {ok!r} in a selftest report"
    case = str(row.get("case")).split(" [seed ")[0]          # "<case> [seed N] on <backend>"
    broke = budgets.check({k: _value(v) for k, v in (row.get("metrics") or {}).items()}, suite, case)
    if str(row.get("backend", "")).startswith("fault:"):
        return None if broke else "a fault run stored as caught, but no budget breaks on its metrics"
    return None if not broke else (f"a correct run stored as pass, but its metrics break "
                                   f"{', '.join(v['metric'] for v in broke[:3])}")


def _nonfinite_disagreement(row: dict, ok, expects: Optional[dict]) -> Optional[str]:
    """What disagrees in a row stored as nonfinite_input, by the case definitions' word."""
    want = (expects or {}).get(str(row.get("case")))
    if want is None:
        if ok is False:                              # never more favourable than the truth: stands
            return None
        return ("status nonfinite_input with ok = true, but no case definition says it expects non-finite "
                "inputs (not in the run's cases directory)")
    if row.get("expect_nonfinite") and not want:
        return "the row says expect_nonfinite, but the case definition does not declare it (with a plant)"
    return None if ok is want else (f"status nonfinite_input with ok = {ok!r}, but the case "
                                    f"{'declares' if want else 'does not declare (with a plant)'} "
                                    f"expect_nonfinite")


def disagreement(row: dict, budgets: B.Budgets, suite: str, *, selftest: bool = False,
                 expects: Optional[dict] = None) -> Optional[str]:
    """None when the stored verdict of `row` is the one its metrics and the budgets give,
    else what disagrees. `expects`: case name -> whether its definition declares non-finite
    inputs (`case_expectations`; None: the row's own word, for a row with no definition)."""
    if selftest:
        return _selftest_disagreement(row, budgets, suite)
    status, ok = row.get("status"), row.get("ok")
    metrics = row.get("metrics") or {}
    if status == "error":
        return None if ok is False else f"status error with ok = {ok!r} (an error is never ok)"
    if status == "skipped":
        if metrics:
            return f"status skipped but it reports {len(metrics)} metric(s) (a skipped case runs nothing)"
        return None if ok is True else f"status skipped with ok = {ok!r}"
    if status == "nonfinite_input":
        why = _nonfinite_disagreement(row, ok, expects)
        broken = budgets.check({k: _value(v) for k, v in metrics.items()}, suite, str(row.get("case")))
        if why is None and ok is True and broken:     # an invariant broken on non-finite inputs: a failure
            return (f"stored status 'nonfinite_input' with ok = true, but its metrics break "
                    f"{broken[0]['metric']} ({broken[0]['why']}): a failure")
        return why
    values = {k: _value(v) for k, v in metrics.items()}
    for v in row.get("violations") or []:            # a NaN metric: report.json keeps its violation, not its value
        if isinstance(v, dict) and v.get("metric") not in values and v.get("why") == "is NaN":
            values[v["metric"]] = math.nan
    judged = B.verdict({**row, "outcome": "ok", "reason": row.get("reason") or "", "metrics": values},
                       budgets, suite)
    if judged["status"] != status or judged["ok"] is not ok:
        why = judged["reason"] if judged["status"] != "pass" else "every budget holds"
        return f"stored status {status!r} (ok = {ok!r}), but its metrics give {judged['status']!r}: {why}"
    if _violated(judged) != _violated(row):
        return (f"its violations {sorted(map(str, _violated(row)))} differ from those its metrics give "
                f"{sorted(_violated(judged))}")
    return None


def _value(v):
    """A stored metric value as the judge reads it ("inf" and "nan" were written as text)."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return math.nan
    return v


def check_frame(df, meta: dict, where, *, budgets=None) -> None:
    """`check_rows` on the rows of the report.json at `where` (already loaded and shape-checked
    by harness.io.report.load into `df`; read again raw, so that a value the DataFrame cannot
    tell from a missing one, a NaN metric, is judged as written)."""
    data = safe_input.load_json(where, error=ReportError)
    check_rows(data["cases"], meta, str(where), budgets=B.load(budgets) if budgets else None)


def check_budgets(rows: list, meta: dict, budgets: B.Budgets, where: str) -> None:
    """The recorded budgets agree with what the report says of them: a shard's budgets
    digest (`run.shard.budgets_digest`, what --merge compares) is theirs, and every
    required or always-fail check they turn "off" for a metric the rows report is listed in
    `run.budgets_off` (which every format shows)."""
    sh = meta.get("shard")
    if isinstance(sh, dict) and "budgets_digest" in sh and sh["budgets_digest"] != S.budgets_digest(budgets):
        raise ReportError(f"{where}: run.budgets: different budgets from those the shard was run with "
                          "(run.shard.budgets_digest); refused")
    keys = {str(r.get("case")): [k for k in (r.get("metrics") or {})] for r in rows}
    off = set(budgets.disabled(keys, str(meta.get("suite") or "")))
    listed = set(map(str, meta.get("budgets_off") or []))
    if off - listed:
        raise ReportError(f"{where}: run.budgets turns off {sorted(off - listed)[0]}, which run.budgets_off "
                          "does not list (every report shows a check turned off); refused")


def check_rows(rows: list, meta: dict, where: str, *, budgets: Optional[B.Budgets] = None) -> None:
    """ReportError naming the first row whose stored verdict is not the computed one, judged
    by `budgets` (a trusted file, `mxval report --budgets`) or else by the limits the report
    recorded (checked against what the report says of them)."""
    if budgets is None:
        budgets = recorded_budgets(meta, where)
        check_budgets(rows, meta, budgets, where)
        check_declared(budgets, where)
    suite = str(meta.get("suite") or "")
    selftest = meta.get("command") == "selftest"
    expects = case_expectations(rows, meta, where)
    ops_of = row_ops(rows, meta)
    chain = meta.get("command") != "diff"
    for r in rows:
        why = disagreement(r, budgets, suite, selftest=selftest, expects=expects)
        if why is None and r.get("status") == "pass" and not (selftest and str(r.get("backend", "")).startswith("fault:")):
            why = missing_metric(r, ops_of.get(str(r.get("case"))), budgets, suite, chain=chain)
        if why:
            raise ReportError(f"{where}: case {str(r.get('case'))!r:.80}: {why}; the verdict is computed, "
                              "never read (refused)")
