"""The shape of a report.json, checked before anything renders or merges it.

A report.json passes through other hands (a CI artefact, a shard from another machine):
every field the renderers, `mxval report` and `report --merge` read is checked here for its
type and bounds, so a hand-edited or foreign file is one line naming the field (exit 2),
never an internal error deep in a renderer. Whether the rows' verdicts are true is a
separate question (recomputed from the metrics and the budgets).
"""
from __future__ import annotations

import math
from typing import Optional, Type

from harness.errors import InputError, ReportError

STATUSES = ("pass", "fail", "error", "nonfinite_input", "skipped")
MAX_TEXT = 1 << 20                 # characters of one text field
MAX_ITEMS = 1 << 20                # entries of one list or object
MAX_CASES = 1 << 14                # rows of one report (re-rendered in minutes, not hours)
MAX_SECONDS = 1e9                  # a run's or a case's seconds (about 31 years)
MAX_INT = 2 ** 63                  # an integer field (counts, context, k, n)
NUMBER_WORDS = ("inf", "-inf", "nan", "Infinity", "-Infinity", "NaN")


class _Bad(Exception):
    pass


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (not isinstance(v, int) or abs(v) < MAX_INT))


def _text(where: str, v, *, none: bool = True) -> None:
    if v is None and none:
        return
    if not isinstance(v, str):
        raise _Bad(f"{where}: expected a string, got {_kind(v)}")
    if len(v) > MAX_TEXT:
        raise _Bad(f"{where}: {len(v)} characters, at most {MAX_TEXT}")


def _kind(v) -> str:
    if isinstance(v, bool):
        return f"a bool ({v!r})"
    if isinstance(v, (int, float)):
        return f"a number ({v!r:.40})"
    if isinstance(v, str):
        return f"a string ({v!r:.40})"
    return {dict: "an object", list: "a list", type(None): "null"}.get(type(v), type(v).__name__)


def _number(where: str, v, *, none: bool = True, lo: float = -math.inf, hi: float = math.inf,
            words: bool = False) -> None:
    if v is None and none:
        return
    if words and isinstance(v, str) and v in NUMBER_WORDS:
        return
    if not _is_num(v):
        raise _Bad(f"{where}: expected a number, got {_kind(v)}")
    if isinstance(v, float) and math.isnan(v):
        return
    if not lo <= v < hi:
        raise _Bad(f"{where}: {v!r:.40} is out of range [{lo:g}, {hi:g})")


def _list(where: str, v, *, none: bool = True) -> list:
    if v is None and none:
        return []
    if not isinstance(v, list):
        raise _Bad(f"{where}: expected a list, got {_kind(v)}")
    if len(v) > MAX_ITEMS:
        raise _Bad(f"{where}: {len(v)} entries, at most {MAX_ITEMS}")
    return v


def _obj(where: str, v, *, none: bool = True) -> dict:
    if v is None and none:
        return {}
    if not isinstance(v, dict):
        raise _Bad(f"{where}: expected an object, got {_kind(v)}")
    if len(v) > MAX_ITEMS:
        raise _Bad(f"{where}: {len(v)} entries, at most {MAX_ITEMS}")
    return v


def _scalar(where: str, v) -> None:
    """A finding's value: text, a number, a bool, null, or a flat list of those."""
    if isinstance(v, list):
        for i, x in enumerate(_list(where, v)):
            if isinstance(x, list):
                for j, y in enumerate(x):
                    if not (y is None or isinstance(y, (str, bool)) or _is_num(y)):
                        raise _Bad(f"{where}[{i}][{j}]: expected a number or a string, got {_kind(y)}")
            elif not (x is None or isinstance(x, (str, bool)) or _is_num(x)):
                raise _Bad(f"{where}[{i}]: expected a number or a string, got {_kind(x)}")
        return
    if isinstance(v, str):
        _text(where, v)
    elif not (v is None or isinstance(v, bool) or _is_num(v)):
        raise _Bad(f"{where}: expected a number, a string or a list of them, got {_kind(v)}")


def _rows(where: str, v, width: int, most: Optional[int] = None) -> None:
    most = most or width
    for i, r in enumerate(_list(where, v)):
        if not (isinstance(r, list) and width <= len(r) <= most and all(_is_num(x) and math.isfinite(x) for x in r)):
            n = str(width) if most == width else f"{width} to {most}"
            raise _Bad(f"{where}[{i}]: expected {n} finite numbers, got {_kind(r)}")


def _details(where: str, v) -> None:
    d = _obj(where, v)
    _rows(f"{where}.mismatch_map", d.get("mismatch_map"), 3)
    for i, r in enumerate(_list(f"{where}.mismatch_map", d.get("mismatch_map"))):
        if not all(isinstance(x, int) and abs(x) < 2 ** 40 for x in r):
            raise _Bad(f"{where}.mismatch_map[{i}]: expected [page, entry, count] integers")
    _rows(f"{where}.recall_rows", d.get("recall_rows"), 2, 8)
    for i, x in enumerate(_list(f"{where}.logit_log10_err", d.get("logit_log10_err"))):
        _number(f"{where}.logit_log10_err[{i}]", x, none=False, lo=-1e6, hi=1e6)
    for k, x in _obj(f"{where}.pooled_ulp", d.get("pooled_ulp")).items():
        _number(f"{where}.pooled_ulp.{k}", x, none=False, lo=0, hi=2 ** 53)


def check_case(where: str, c) -> None:
    if not isinstance(c, dict):
        raise _Bad(f"{where}: expected an object, got {_kind(c)}")
    _text(f"{where}.case", c.get("case"), none=False)
    if not c["case"].strip():
        raise _Bad(f"{where}.case: empty name")
    where = f"case {c['case']!r:.80}"
    for key in ("suite", "backend", "reason", "shape", "description"):
        _text(f"{where}: {key}", c.get(key))
    if c.get("status") not in STATUSES:
        raise _Bad(f"{where}: status: expected one of {', '.join(STATUSES)}, got {_kind(c.get('status'))}")
    for key in ("ok", "expect_nonfinite"):
        if c.get(key) is not None and not isinstance(c[key], bool):
            raise _Bad(f"{where}: {key}: expected true or false, got {_kind(c[key])}")
    if not isinstance(c.get("ok"), bool):
        raise _Bad(f"{where}: ok: expected true or false, got {_kind(c.get('ok'))}")
    _number(f"{where}: seconds", c.get("seconds"), lo=0, hi=MAX_SECONDS)
    for key in ("gpu_peak_bytes", "tensor_bytes"):
        _number(f"{where}: {key}", c.get(key), lo=0, hi=2.0 ** 64)
    ctx = c.get("context")
    if not (ctx is None or isinstance(ctx, str) or (_is_num(ctx) and not isinstance(ctx, float))):
        raise _Bad(f"{where}: context: expected an integer, a string or null, got {_kind(ctx)}")
    for k, v in _obj(f"{where}: metrics", c.get("metrics")).items():
        _number(f"{where}: metrics.{k}", v, words=True)
    for i, v in enumerate(_list(f"{where}: violations", c.get("violations"))):
        vw = f"{where}: violations[{i}]"
        for k, x in _obj(vw, v, none=False).items():
            _scalar(f"{vw}.{k}", x)
        _text(f"{vw}.metric", v.get("metric"), none=False)
        for k in ("value", "limit"):
            if k not in v:
                raise _Bad(f"{vw}: no {k!r}")
    for i, f in enumerate(_list(f"{where}: findings", c.get("findings"))):
        for k, x in _obj(f"{where}: findings[{i}]", f, none=False).items():
            _scalar(f"{where}: findings[{i}].{k}", x)
    for k, v in _obj(f"{where}: summaries", c.get("summaries")).items():
        for i, s in enumerate(_list(f"{where}: summaries.{k}", v, none=False)):
            _text(f"{where}: summaries.{k}[{i}]", s, none=False)
    for i, s in enumerate(_list(f"{where}: planted", c.get("planted"))):
        _text(f"{where}: planted[{i}]", s, none=False)
    _details(f"{where}: details", c.get("details"))
    for k, v in _obj(f"{where}: selection", c.get("selection")).items():
        for kk, x in _obj(f"{where}: selection.{k}", v, none=False).items():
            if kk != "verdict":
                _number(f"{where}: selection.{k}.{kk}", x)
        _text(f"{where}: selection.{k}.verdict", v.get("verdict"), none=False)


def check_run(run) -> None:
    run = _obj("run", run, none=False)
    for key in ("command", "suite", "backend", "backend_description", "machine", "started", "device"):
        if not (run.get(key) is None or isinstance(run[key], (str, int, float))):
            raise _Bad(f"run.{key}: expected a string, got {_kind(run[key])}")
        _text(f"run.{key}", run.get(key) if isinstance(run.get(key), str) else None)
    _number("run.seconds", run.get("seconds"), lo=0, hi=MAX_SECONDS)
    for i, s in enumerate(_list("run.budgets_off", run.get("budgets_off"))):
        _text(f"run.budgets_off[{i}]", s, none=False)
    for i, s in enumerate(_list("run.cases", run.get("cases"))):
        _text(f"run.cases[{i}]", s, none=False)
    for key in ("interrupted", "shard", "budgets", "jobs", "selftest"):
        _obj(f"run.{key}", run.get(key))
    i = _obj("run.interrupted", run.get("interrupted"))
    _number("run.interrupted.cases_done", i.get("cases_done"), lo=0, hi=MAX_INT)
    for j, s in enumerate(_list("run.interrupted.cancelled", i.get("cancelled"))):
        _text(f"run.interrupted.cancelled[{j}]", s, none=False)
    _text("run.interrupted.signal", i.get("signal"))
    b = _obj("run.budgets", run.get("budgets"))
    _text("run.budgets.path", b.get("path"))
    for j, m in enumerate(_list("run.merged_from", run.get("merged_from"))):
        _obj(f"run.merged_from[{j}]", m, none=False)


def check(data, path, *, error: Type[InputError] = ReportError) -> Optional[dict]:
    """`error` (one line: the file and the field) unless `data` has report.json's shape."""
    try:
        if not isinstance(data, dict):
            raise _Bad(f"expected a JSON object, got {_kind(data)}")
        check_run(data.get("run", {}))
        cases = _list("cases", data.get("cases"), none=False)
        if len(cases) > MAX_CASES:
            raise _Bad(f"cases: {len(cases)} rows, at most {MAX_CASES}")
        for i, c in enumerate(cases):
            check_case(f"cases[{i}]", c)
    except _Bad as e:
        raise error(f"{path}: {e}") from None
    return data


# --- a study's study.json (`mxval study --from-json`) -------------------------------------------

STUDY_TABLES = ("rows", "needles", "inputs")
# Every row of a study's table carries these (the keys the renderers select and group by).
STUDY_ROW_KEYS = {"rows": ("distribution", "seed", "context_tokens", "variant", "kind", "recall", "mass_kept"),
                  "needles": ("distribution", "seed", "context_tokens", "variant"),
                  "inputs": ("distribution", "seed")}
_STUDY_TEXT = ("study", "machine", "device", "when")
_STUDY_NUMBERS = ("seconds", "cpu_seconds", "threads", "jobs", "load_before", "load_after", "topk", "rows", "heads",
                  "compress_ratio", "query_spread", "tolerance")
_STUDY_LISTS = ("seeds", "contexts", "distributions", "needle_depths", "needle_margins")


def _flat_value(where: str, v) -> None:
    """A study table's cell: text, a number, a bool, null, or a flat list of those."""
    _scalar(where, v)


def check_study(data, path, *, error: Type[InputError] = ReportError) -> dict:
    """`error` (one line: the file and the field) unless `data` has study.json's shape: an
    object `meta`, the tables `rows`, `needles`, `inputs` (lists of flat objects, each with
    its table's keys) and `merges` (an object of objects)."""
    try:
        if not isinstance(data, dict):
            raise _Bad(f"expected a JSON object, got {_kind(data)}")
        for key in ("meta", *STUDY_TABLES, "merges"):
            if key not in data:
                raise _Bad(f"no {key!r}")
        meta = _obj("meta", data["meta"], none=False)
        for key in _STUDY_TEXT:
            _text(f"meta.{key}", meta.get(key))
        for key in _STUDY_NUMBERS:
            _number(f"meta.{key}", meta.get(key), lo=-MAX_INT, hi=MAX_INT)
        for key in _STUDY_LISTS:
            for i, x in enumerate(_list(f"meta.{key}", meta.get(key))):
                if not (isinstance(x, str) or _is_num(x)):
                    raise _Bad(f"meta.{key}[{i}]: expected a number or a string, got {_kind(x)}")
        for k, v in _obj("meta.distribution_fields", meta.get("distribution_fields")).items():
            for kk, x in _obj(f"meta.distribution_fields.{k}", v, none=False).items():
                _flat_value(f"meta.distribution_fields.{k}.{kk}", x)
        i = _obj("meta.interrupted", meta.get("interrupted"))
        _number("meta.interrupted.cases_done", i.get("cases_done"), lo=0, hi=MAX_INT)
        _text("meta.interrupted.signal", i.get("signal"))
        for table in STUDY_TABLES:
            for j, r in enumerate(_list(table, data[table], none=False)):
                row = _obj(f"{table}[{j}]", r, none=False)
                missing = [k for k in STUDY_ROW_KEYS[table] if k not in row]
                if missing:
                    raise _Bad(f"{table}[{j}]: no {missing[0]!r}")
                for k, x in row.items():
                    _flat_value(f"{table}[{j}].{k}", x)
                    if k in ("seed", "context_tokens") and not (isinstance(x, int) and not isinstance(x, bool)):
                        raise _Bad(f"{table}[{j}].{k}: expected an integer, got {_kind(x)}")
                    if k in ("distribution", "variant", "kind"):
                        if not isinstance(x, str):
                            raise _Bad(f"{table}[{j}].{k}: expected a string, got {_kind(x)}")
                    elif table != "inputs" and not (x is None or isinstance(x, bool) or _is_num(x)):
                        raise _Bad(f"{table}[{j}].{k}: expected a number, got {_kind(x)}")
        for k, m in _obj("merges", data["merges"], none=False).items():
            m = _obj(f"merges.{k}", m, none=False)
            _text(f"merges.{k}.into", m.get("into"), none=False)
            _number(f"merges.{k}.values", m.get("values"), none=False, lo=0, hi=MAX_INT)
            _number(f"merges.{k}.differ", m.get("differ"), none=False, lo=0, hi=MAX_INT)
    except _Bad as e:
        raise error(f"{path}: {e}") from None
    return data
