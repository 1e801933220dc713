"""Reports: one pandas DataFrame of per-case results, rendered as a rich console table,
report.json (the persisted source; `mxval report DIR` re-renders everything from it),
report.md for pull requests, a self-contained report.html with figures, junit.xml and
metrics.csv.

DataFrame columns: the fixed ones in `COLUMNS`, one column per metric named
`<stage>.<metric>` (stage = an op, or `chain`), and the object columns in `OBJECT_COLUMNS`.
"""
from __future__ import annotations

import base64
import html as _html
import io
import json
import math
import os
import re
from pathlib import Path
from typing import Optional
from xml.etree import ElementTree as ET

import pandas as pd

from harness.errors import ReportError
from harness.io import escape, report_shape, safe_input
from harness.io.escape import wide_console

SCHEMA = "mxval-report"
SCHEMA_VERSION = 1
COLUMNS = ["case", "suite", "backend", "status", "ok", "reason", "seconds", "context", "shape",
           "description", "expect_nonfinite", "gpu_peak_bytes", "tensor_bytes"]
OBJECT_COLUMNS = ["violations", "findings", "summaries", "details", "planted"]
STATUS_STYLE = {"pass": "green", "fail": "bold red", "error": "bold red", "nonfinite_input": "magenta",
                "skipped": "yellow"}
# (heading, metric suffix, how to combine the op stages) for the overview tables
HEADLINE = [("pages≠", "page_bytes_mismatched", "sum"), ("outside", "page_bytes_outside_owned_changed", "sum"),
            ("pool ulp", "pooled_max_ulp", "max"), ("q≠", "q_bytes_mismatched", "sum"),
            ("logits diff", "logits_diff", "max"), ("top-k recall", "topk_recall_min", "min"),
            ("invariants", "invariant_violations", "sum")]
# the whole chain's numbers, beside the stages' (heading, chain metric)
CHAIN_HEADLINE = [("chain recall", "topk_recall_min"), ("chain mass", "topk_mass_kept_min"),
                  ("chain≠", "page_bytes_mismatched_frac")]
# the "does it matter" block: (heading, metric suffix, how the op stages combine)
SELECTION = [("recall", "topk_recall_min", "min"), ("mass kept", "topk_mass_kept_min", "min"),
             ("top-64 kept", "topk_top64_kept_min", "min"), ("top-256 kept", "topk_top256_kept_min", "min"),
             ("best rank lost", "topk_rank_lost_min", "min"), ("tie swaps", "class_tie_swap", "sum"),
             ("rows ≠ ref set", "topk_rows_not_exact_frac", "max")]
SELECTION_WHERE = {"stage": "top-k stage (on the backend's logits)",
                   "chain": "whole chain (against the reference chain)"}
IDENTICAL = "identical to the exact selection"
# failing cases first in the HTML report
STATUS_ORDER = {"error": 0, "fail": 1, "nonfinite_input": 2, "skipped": 3, "pass": 4}


def is_metric(col: str) -> bool:
    return "." in col


def frame(rows: list[dict]) -> pd.DataFrame:
    """Rows (runner rows after `budgets.verdict`) -> the DataFrame."""
    flat = []
    for r in rows:
        d = {c: r.get(c) for c in COLUMNS}
        for c in OBJECT_COLUMNS:
            d[c] = r.get(c) or ({} if c in ("summaries", "details") else [])
        for k, v in (r.get("metrics") or {}).items():
            d[k] = v
        flat.append(d)
    df = pd.DataFrame(flat, columns=None)
    for c in COLUMNS + OBJECT_COLUMNS:
        if c not in df.columns:
            df[c] = None
    return df


def metric_columns(df: pd.DataFrame) -> list[str]:
    return sorted(c for c in df.columns if is_metric(c))


def _num(v) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _chain_frac() -> str:
    """The whole chain's K-byte headline column. The metric table is imported here, not at the
    top: `mxval report DIR` re-renders a report without loading torch."""
    from harness.diff.metrics import chain_key
    return chain_key("page_bytes_mismatched_frac")


def headline(row, suffix: str, how: str) -> Optional[float]:
    from harness.diff.metrics import is_chain  # (see _chain_frac)
    vals = [_num(row[c]) for c in row.index if is_metric(c) and not is_chain(c)
            and c.endswith("." + suffix)]
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return {"sum": sum, "max": max, "min": min}[how](vals)


def chain_value(row, metric: str) -> Optional[float]:
    from harness.diff.metrics import chain_key  # (see _chain_frac)
    key = chain_key(metric)
    return _num(row.get(key))


def _proxy() -> str:
    from harness.diff.scores import MASS_PROXY  # (see _chain_frac)
    return MASS_PROXY


def overview_values(row) -> list[Optional[float]]:
    """The overview tables' metric values: the stages' headline, then the chain's."""
    return ([headline(row, m, how) for _, m, how in HEADLINE]
            + [chain_value(row, m) for _, m in CHAIN_HEADLINE])


def overview_cells(row) -> list[str]:
    return [_fmt(v) for v in overview_values(row)]


OVERVIEW = [h for h, _, _ in HEADLINE] + [h for h, _ in CHAIN_HEADLINE]


def selection(row) -> dict:
    """The "does it matter" block of a case: {"stage": {...}, "chain": {...}} (each only when
    its top-k was compared), each with the SELECTION values (None: not emitted, e.g. top-m
    for m >= k, or no key lost) and a one-line verdict."""
    out = {}
    for where in ("stage", "chain"):
        vals = {}
        for _, m, how in SELECTION:
            vals[m] = chain_value(row, m) if where == "chain" else headline(row, m, how)
        if vals["topk_recall_min"] is None:
            continue
        vals["verdict"] = selection_verdict(vals)
        out[where] = vals
    return out


def selection_verdict(v: dict) -> str:
    recall, ties = v.get("topk_recall_min"), v.get("class_tie_swap") or 0
    differ = v.get("topk_rows_not_exact_frac") or 0
    if recall is not None and recall < 1:
        parts = [f"recall {_fmt(recall)}"]
        if v.get("topk_mass_kept_min") is not None:
            parts.append(f"mass kept {_fmt(v['topk_mass_kept_min'])}")
        for m in (64, 256):
            if v.get(f"topk_top{m}_kept_min") is not None:
                parts.append(f"top-{m} kept {_fmt(v[f'topk_top{m}_kept_min'])}")
        if v.get("topk_rank_lost_min") is not None:
            parts.append(f"best exact rank lost {_fmt(v['topk_rank_lost_min'])}")
        return "keys lost: " + ", ".join(parts)
    if ties:
        return f"nothing lost: {_fmt(ties)} tie swap(s), sets the tie rule accepts"
    if differ:
        return "nothing lost within the tie rule; some sets differ (see the findings)"
    return IDENTICAL


def _sel_cells(v: dict) -> list[str]:
    cells = []
    for _, m, _ in SELECTION:
        x = v.get(m)
        if m == "topk_rank_lost_min" and x is None:
            cells.append("none")
        elif m.startswith("topk_top") and x is None:
            cells.append("k ≤ m")
        elif m == "class_tie_swap" and x is None:
            cells.append("0")
        else:
            cells.append(_fmt(x))
    return cells


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and not v.is_integer():
        if 0 < v < 1 and f"{v:.3g}" == "1":        # never round a loss away: 0.9996 is not 1
            return f"{v:.6g}" if f"{v:.6g}" != "1" else "<1"
        return f"{v:.3g}"
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


# --- GPU memory (harness.run.memory): the case's peak against its tensors' bytes ----------

MEMORY_HEAD = "GPU peak"


def has_memory(df: pd.DataFrame) -> bool:
    """Whether any case measured its GPU peak (a GPU run): the reports then show it."""
    return "gpu_peak_bytes" in df.columns and bool(df["gpu_peak_bytes"].notna().any())


def memory_ratio(row) -> Optional[float]:
    """The case's GPU peak over its tensors' bytes (None when either is unknown)."""
    peak, tensors = _num(row.get("gpu_peak_bytes")), _num(row.get("tensor_bytes"))
    return peak / tensors if peak is not None and tensors else None


def memory_cell(row) -> str:
    """`1.23 GiB (2.1×)`: the peak and its ratio to the case's tensors; "" when unmeasured."""
    peak = _num(row.get("gpu_peak_bytes"))
    if peak is None:
        return ""
    ratio = memory_ratio(row)
    return f"{peak / 2**30:.2f} GiB" + (f" ({ratio:.1f}×)" if ratio is not None else "")


def memory_ratios(df: pd.DataFrame) -> list[float]:
    """Every case's GPU peak over its tensors' bytes, where both are known."""
    return [x for x in (memory_ratio(r) for _, r in df.iterrows()) if x is not None]


def memory_note(df: pd.DataFrame) -> str:
    """One line for the report heads: the largest peak and the largest ratio; "" on the CPU."""
    if not has_memory(df):
        return ""
    ratios = memory_ratios(df)
    top = float(df["gpu_peak_bytes"].max())
    return (f"GPU peak per case: largest {top / 2**30:.2f} GiB"
            + (f", at most {max(ratios):.1f}× the case's tensors" if ratios else ""))


def summary(df: pd.DataFrame, meta: Optional[dict] = None) -> dict:
    """Counts and the verdict. A run that was interrupted (`meta["interrupted"]`) is never
    ok, whatever its finished cases say; nor is one that checked nothing: every case
    skipped, or no case at all (a merge of zero cases; but a shard that was given none)."""
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    out = {s: int(counts.get(s, 0)) for s in ("pass", "fail", "error", "nonfinite_input", "skipped")}
    out["cases"] = int(len(df))
    out["ok"] = bool(df["ok"].all()) if len(df) else True
    sh = (meta or {}).get("shard")
    empty_shard = isinstance(sh, dict) and not sh.get("cases")
    if (len(df) and out["skipped"] == len(df)) or (not len(df) and not empty_shard):   # never a pass
        out["nothing_checked"] = True
        out["ok"] = False
    if (meta or {}).get("interrupted"):
        out["interrupted"] = True
        out["ok"] = False
    if has_memory(df):
        ratios = memory_ratios(df)
        out["gpu_peak_bytes_max"] = int(df["gpu_peak_bytes"].max())
        out["gpu_peak_ratio_max"] = round(max(ratios), 3) if ratios else None
    return out


def part_note(meta: dict) -> str:
    """' (shard K/N)' or ' (merged from N shards)' for the headings; '' for a whole run."""
    sh = meta.get("shard")
    if isinstance(sh, dict):
        return f" (shard {sh.get('k')}/{sh.get('n')})"
    if meta.get("merged_from"):
        return f" (merged from {len(meta['merged_from'])} shards)"
    return ""


def verdict_word(s: dict) -> str:
    if s.get("interrupted"):
        return "INTERRUPTED"
    if s.get("nothing_checked"):
        return "NOTHING CHECKED (" + ("every case skipped)" if s.get("cases") else "no case)")
    return "OK" if s["ok"] else "FAILED"


def _interrupt_note(meta: dict) -> str:
    i = meta.get("interrupted") or {}
    if not i:
        return ""
    return (f"interrupted ({i.get('signal', 'SIGINT')}): {i.get('cases_done', 0)} case(s) finished, "
            f"{len(i.get('cancelled') or [])} cancelled; this report is partial")


# --- JSON (the persisted form) --------------------------------------------------------------

def _clean(v):
    if isinstance(v, float):
        return None if math.isnan(v) else (v if math.isfinite(v) else str(v))
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    if hasattr(v, "item"):
        return _clean(v.item())
    return v


def to_json(df: pd.DataFrame, meta: dict) -> dict:
    cases = []
    for _, r in df.iterrows():
        d = {c: _clean(r[c]) for c in COLUMNS + OBJECT_COLUMNS}
        d["metrics"] = {c: _clean(r[c]) for c in metric_columns(df) if _num(r[c]) is not None}
        sel = selection(r)
        if sel:
            d["selection"] = _clean(sel)
        cases.append(d)
    return {"schema": SCHEMA, "version": SCHEMA_VERSION, "run": meta, "summary": summary(df, meta),
            "selection_proxy": _proxy(), "cases": cases}


def load(report_dir) -> tuple[pd.DataFrame, dict]:
    """(DataFrame, run meta) from DIR/report.json. ReportError (one line) on a bad file."""
    path = Path(report_dir) / "report.json"
    data = safe_input.load_json(path, error=ReportError)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ReportError(f"{path}: not an mxval report (schema {data.get('schema') if isinstance(data, dict) else None!r})")
    if data.get("version") != SCHEMA_VERSION:
        raise ReportError(f"{path}: unknown report version {data.get('version')!r}")
    if not isinstance(data.get("cases"), list):
        raise ReportError(f"{path}: 'cases' must be a list")
    bad = next((i for i, c in enumerate(data["cases"]) if not isinstance(c, dict)), None)
    if bad is not None:
        raise ReportError(f"{path}: cases[{bad}] must be an object, got {data['cases'][bad]!r}")
    run = data.get("run", {})
    if not isinstance(run, dict):
        raise ReportError(f"{path}: 'run' must be an object")
    for key in ("interrupted", "shard", "budgets", "jobs"):      # read with .get by the renderers
        if run.get(key) is not None and not isinstance(run[key], dict):
            raise ReportError(f"{path}: run.{key} must be an object, got {type(run[key]).__name__}")
    report_shape.check(data, path)                  # every field the renderers read: type and bounds
    return frame(data["cases"]), run


# --- console ---------------------------------------------------------------------------------

def console_table(df: pd.DataFrame, meta: dict, console=None) -> None:
    from rich.table import Table
    console = console or wide_console()
    t = Table(title=escape.rich(f"mxval {meta.get('command', '')}: {meta.get('suite', '')} on "
                                f"{meta.get('backend', '')}{part_note(meta)}"),
              caption=escape.rich(meta.get("backend_description")) if meta.get("backend_description") else None,
              show_lines=False)
    mem = has_memory(df)
    for col in ("case", "status", *OVERVIEW, *([MEMORY_HEAD] if mem else []), "s", "reason"):
        t.add_column(col, overflow="fold", max_width=60 if col == "reason" else None)
    for _, r in df.iterrows():
        st = r["status"]
        t.add_row(escape.rich(r["case"]), f"[{STATUS_STYLE.get(st, '')}]{escape.rich(st)}[/]", *overview_cells(r),
                  *([memory_cell(r)] if mem else []), f"{_num(r['seconds']) or 0:.1f}", escape.rich(r["reason"] or ""))
    console.print(t)
    console_selection(df, console)
    s = summary(df, meta)
    verdict = "[green]OK[/]" if s["ok"] else f"[bold red]{verdict_word(s)}[/]"
    if s.get("interrupted"):
        console.print(f"[bold red]{escape.rich(_interrupt_note(meta))}[/]")
    console.print(f"{verdict}: {s['pass']} pass, {s['fail']} fail, {s['error']} error, "
                  f"{s['nonfinite_input']} non-finite input, {s['skipped']} skipped")
    note = memory_note(df)
    if note:
        console.print(note)
    if meta.get("budgets_off"):
        console.print(f"[yellow]checks turned off[/] by {escape.rich((meta.get('budgets') or {}).get('path', ''))}: "
                      + escape.rich("; ".join(map(str, meta["budgets_off"]))))


def _selection_rows(df: pd.DataFrame) -> list[tuple[str, str, dict]]:
    """(case, where, values) of every case with a top-k comparison; a case whose stage and
    chain both select exactly the reference's set is one row ("stage and chain")."""
    out = []
    for _, r in df.iterrows():
        sel = selection(r)
        if not sel:
            continue
        same = all(v["verdict"] == IDENTICAL for v in sel.values())
        if same:
            out.append((str(r["case"]), "stage and chain", next(iter(sel.values()))))
            continue
        for where, v in sel.items():
            out.append((str(r["case"]), where, v))
    return out


def console_selection(df: pd.DataFrame, console) -> None:
    """The "does it matter" table; cases whose stage and chain both select exactly the
    reference's set are counted in one line below it (every other format lists them)."""
    from rich.table import Table
    rows = _selection_rows(df)
    if not rows:
        return
    same = [c for c, where, _ in rows if where == "stage and chain"]
    rows = [x for x in rows if x[1] != "stage and chain"]
    note = (f"{len(same)} case(s) select exactly the reference's top-k at the stage and across the chain"
            + (f": {', '.join(same)}" if len(same) <= 8 else ""))
    if not rows:
        console.print(f"does the difference matter? no: {escape.rich(note)}")
        return
    t = Table(title="does the difference matter? the top-k selection against the exact one",
              caption=_proxy(), show_lines=False)
    for col in ("case", "where", *[h for h, _, _ in SELECTION], "verdict"):
        t.add_column(col, overflow="fold", max_width=70 if col == "verdict" else None)
    for case, where, v in rows:
        lost = (v.get("topk_recall_min") or 1) < 1
        t.add_row(escape.rich(case), where, *_sel_cells(v), "[bold red]keys lost[/]" if lost else escape.rich(v["verdict"]))
    console.print(t)
    if same:
        console.print(escape.rich(note))


class CaseLines:
    """Progress for logs: one line per finished case, `[n/N] case: status (seconds) reason`,
    flushed at once, when `stream` (stdout) is not a terminal; silent on a terminal, where
    the progress bar shows. `judge(row)` turns a runner row into a verdicted one (status)."""

    def __init__(self, total: int, judge=None, stream=None, *, enabled: bool = True):
        import sys
        self.total, self.judge, self.n = total, judge, 0
        self.stream = stream if stream is not None else sys.stdout
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.on = enabled and not tty

    def __call__(self, row: dict) -> None:
        if not self.on:
            return
        self.n += 1
        try:
            r = self.judge(row) if self.judge else row
        except Exception:                      # a line must never stop the run
            r = row
        status = r.get("status") or r.get("outcome", "")
        reason = str(r.get("reason") or "").splitlines()[0] if r.get("reason") else ""
        if len(reason) > 140:
            reason = reason[:139] + "…"
        print(escape.terminal(f"[{self.n}/{self.total}] {r.get('case')}: {status} "
                              f"({_num(r.get('seconds')) or 0:.1f} s)" + (f": {reason}" if reason else "")),
              file=self.stream, flush=True)


# --- markdown --------------------------------------------------------------------------------

def _where_lines(r, n: int = 6) -> list[str]:
    out = []
    for f in (r["findings"] or [])[:n]:
        out.append(f"[{f.get('stage')}, step {f.get('step')}] {f.get('class', '')}: {f.get('where', f.get('text', ''))}")
    return out


def markdown(df: pd.DataFrame, meta: dict) -> str:
    s = summary(df, meta)
    mem = has_memory(df)
    heads = OVERVIEW + ([MEMORY_HEAD] if mem else [])
    lines = [f"### mxval {meta.get('command', '')}: `{meta.get('suite', '')}` on `{meta.get('backend', '')}`"
             f"{part_note(meta)} "
             f"— {'✅ OK' if s['ok'] else '❌ ' + verdict_word(s)}", "",
             *([f"**{_interrupt_note(meta)}**", ""] if s.get("interrupted") else []),
             f"{s['pass']} pass · {s['fail']} fail · {s['error']} error · {s['nonfinite_input']} non-finite input "
             f"· {s['skipped']} skipped · {meta.get('machine', '')} · {meta.get('seconds', 0):.1f} s · "
             f"budgets `{(meta.get('budgets') or {}).get('path', '')}`", "",
             *([f"backend: {meta['backend_description']}", ""] if meta.get("backend_description") else []),
             *([f"> **checks turned off** by the budgets file: {'; '.join(f'`{x}`' for x in meta['budgets_off'])}", ""]
               if meta.get("budgets_off") else []),
             *([memory_note(df), ""] if mem else []),
             "| case | status | " + " | ".join(heads) + " | reason |",
             "|---|---|" + "---|" * len(heads) + "---|"]
    for _, r in df.iterrows():
        reason = str(r["reason"] or "").replace("|", "\\|")
        cells = overview_cells(r) + ([memory_cell(r)] if mem else [])
        lines.append(f"| {r['case']} | {r['status']} | " + " | ".join(cells) + f" | {reason} |")
    sel = _selection_rows(df)
    if sel:
        lines += ["", "#### Does the difference matter? The top-k selection against the exact one", "",
                  f"_{_proxy()}._ Tie swaps: rows holding another set whose every index the tie rule "
                  "accepts (nothing lost).", "",
                  "| case | where | " + " | ".join(h for h, _, _ in SELECTION) + " | verdict |",
                  "|---|---|" + "---|" * len(SELECTION) + "---|"]
        for case, where, v in sel:
            lines.append(f"| {case} | {where} | " + " | ".join(_sel_cells(v)) + f" | {v['verdict']} |")
    bad = df[~df["ok"].astype(bool)]
    if len(bad):
        lines += ["", "#### Failures", ""]
        for _, r in bad.iterrows():
            lines.append(f"**{r['case']}** ({r['status']}): {r['reason']}")
            for v in r["violations"] or []:
                lines.append(f"- `{v['metric']}` = {_fmt(v['value'])} (budget {v['limit']})")
            for w in _where_lines(r):
                lines.append(f"  - {w}")
            more = len(r["findings"] or []) - len(_where_lines(r))
            if more > 0:
                lines.append(f"  - … {more} more findings listed in report.html (this case's section) and report.json")
            lines.append("")
    return "\n".join(lines) + "\n"


# --- HTML with figures ---------------------------------------------------------------------

def _png(fig) -> str:
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def figures(df: pd.DataFrame) -> list[tuple[str, str]]:
    """(caption, data URI) of every figure the data supports."""
    return [(cap, uri) for _, cap, uri in _figures(df)]


MAX_MAPS = 12             # mismatch maps drawn (each in its case's section)


def _figures(df: pd.DataFrame) -> list[tuple[Optional[str], str, str]]:
    """(case or None for the run's, caption, data URI) of every figure the data supports."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return _mismatch_maps(df, plt) + _error_histograms(df, plt) + _recall_plot(df, plt)


def _mismatch_maps(df: pd.DataFrame, plt) -> list:
    """A mismatch map per case with K-cache mismatches (at most MAX_MAPS)."""
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap, Normalize
    out = []
    # the scale starts at 0 and a single mismatched byte is already a clear red; clean
    # entries (0) are drawn white
    reds = LinearSegmentedColormap.from_list("mismatch", ["#f7a08a", "#d7301f", "#67000d"]).with_extremes(bad="white")
    for _, r in df.iterrows():
        pts = (r["details"] or {}).get("mismatch_map") or []
        if not pts or len(out) >= MAX_MAPS:
            continue
        arr = np.array(pts)
        pages = sorted(set(arr[:, 0].tolist()))
        ent = int(max(arr[:, 1].max(), 0)) + 1
        img = np.zeros((len(pages), max(ent, 1)))
        pad = np.zeros(len(pages))
        row_of = {p: i for i, p in enumerate(pages)}
        for p, e, c in pts:
            if e >= 0:
                img[row_of[p], e] += c
            else:
                pad[row_of[p]] += c
        fig, ax = plt.subplots(figsize=(8, 0.6 + 0.35 * len(pages)))
        im = ax.imshow(np.ma.masked_equal(img, 0), aspect="auto", interpolation="nearest", cmap=reds,
                       norm=Normalize(vmin=0, vmax=max(float(img.max()), 1.0)))
        ax.set_yticks(range(len(pages)), [f"page {p}" + (f" (+{int(pad[i])} pad)" if pad[i] else "")
                                           for i, p in enumerate(pages)])
        ax.set_xlabel("entry in page")
        fig.colorbar(im, ax=ax, label="mismatched bytes (white: none)")
        ax.set_title(escape.mathtext(f"{escape.terminal(r['case'])}: mismatched K-cache bytes by page and entry"))
        out.append((str(r["case"]), f"Mismatch map of {r['case']} (pages with a mismatch, bytes per entry)",
                    _png(fig)))
    return out


def _error_histograms(df: pd.DataFrame, plt) -> list:
    """The pooled ulp distances and the scorer's relative errors over all cases."""
    out = []
    ulp: dict[str, int] = {}
    errs = []
    for _, r in df.iterrows():
        d = r["details"] or {}
        for k, v in (d.get("pooled_ulp") or {}).items():
            ulp[k] = ulp.get(k, 0) + int(v)
        errs += d.get("logit_log10_err") or []
    if ulp or errs:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
        if ulp:
            keys = list(ulp)
            axes[0].bar([escape.mathtext(k) for k in keys], [ulp[k] for k in keys], color="tab:blue")
            axes[0].set_yscale("log")
            axes[0].set_xlabel("bf16 ulps from the reference")
            axes[0].set_ylabel("pooled values")
            axes[0].set_title("pooled rows: ulp distance")
        if errs:
            axes[1].hist(errs, bins=40, color="tab:orange")
            axes[1].set_xlabel("log10(|logit - reference| / max|reference|); -20 = exact")
            axes[1].set_ylabel("logits")
            axes[1].set_title("scorer: relative error")
        out.append((None, "Error histograms over all cases", _png(fig)))
    return out


def _recall_plot(df: pd.DataFrame, plt) -> list:
    """Top-k recall per query row against its length."""
    import numpy as np
    out = []
    rec = []
    for _, r in df.iterrows():
        rec += [p for p in (r["details"] or {}).get("recall_rows") or [] if len(p) >= 3]
    if rec:
        arr = np.array([p[:3] for p in rec], dtype=float)
        x = np.maximum(arr[:, 0], 1)
        exact, lost = arr[:, 2] == 1, arr[:, 1] < 1
        swap = ~exact & ~lost
        fig, ax = plt.subplots(figsize=(8, 3.2))
        for sel, label, kw in ((exact, "the exact set", dict(c="tab:green", marker="o", s=8, alpha=0.4)),
                               (swap, "tie swap (another set the tie rule accepts)",
                                dict(c="tab:blue", marker="^", s=40, alpha=0.9, zorder=3)),
                               (lost, "keys lost", dict(c="tab:red", marker="x", s=30, alpha=0.9, zorder=4))):
            if sel.any():
                ax.scatter(x[sel], arr[sel, 1], label=f"{label}: {int(sel.sum())} rows", **kw)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.05)
        ax.set_xlabel("row length (compressed entries visible)")
        ax.set_ylabel("top-k recall (tie rule)")
        ax.set_title("backend chain top-k against the reference chain's scores")
        ax.legend(loc="lower left", fontsize=8)
        out.append((None, "Top-k recall within the tie rule against context length (per query row); a tie swap "
                    "holds another set whose every index the rule accepts: recall 1", _png(fig)))
    return out


def _slug(name) -> str:
    """A case's HTML id: its name reduced to `[A-Za-z0-9_-]`, and, when that changed it, a
    digest of the exact name after a `.` (which no reduced name holds): `x y`, `x_y`, `x.y`
    and `x/y` get four ids."""
    import hashlib
    text = str(name)
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", text)
    if safe != text:
        safe += "." + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return "case-" + safe


def _slugs(df: pd.DataFrame) -> list[str]:
    """Every row's id, unique within the page (a name given twice gets `.2`, `.3`, ...)."""
    seen: dict[str, int] = {}
    out = []
    for name in df["case"]:
        slug = _slug(name)
        seen[slug] = seen.get(slug, 0) + 1
        out.append(slug if seen[slug] == 1 else f"{slug}.{seen[slug]}")
    return out


def case_order(df: pd.DataFrame) -> list[int]:
    """Row positions, failing cases (not ok) first, errors before failures before the
    rest of them; then the others; the run's order within each group."""
    def key(i):
        r = df.iloc[i]
        if bool(r["ok"]):
            return (1, 0, i)
        return (0, STATUS_ORDER.get(str(r["status"]), 5), i)
    return sorted(range(len(df)), key=key)


_MORE = re.compile(r"^\s*\.\.\. (\d+) more findings listed$")
_KEPT_NOTE = re.compile(r"^\s*note: \d+ findings, the first \d+ listed$")


def _stage_blocks(r, slug: str) -> str:
    """One labelled block per stage (the op stages, then the whole chain): its per-step
    metric lines, and every finding report.json keeps, collapsed."""
    e = _html.escape
    findings: dict[str, list] = {}
    for f in r["findings"] or []:
        findings.setdefault(str(f.get("stage")), []).append(f)
    stages = list((r["summaries"] or {}).keys())
    stages += [s for s in findings if s not in stages]
    stages.sort(key=lambda s: s == "chain")
    out = []
    for st in stages:
        sid = f"{slug}-{re.sub(r'[^A-Za-z0-9_-]', '_', st)}"
        fs = findings.get(st, [])
        counted = sum(int(_num(r[c]) or 0) for c in r.index
                      if is_metric(c) and c.startswith(st + ".class_"))
        lines = []
        for line in "\n".join(r["summaries"].get(st, []) if r["summaries"] else []).splitlines():
            if line.startswith("  [") or _MORE.match(line) or _KEPT_NOTE.match(line):
                continue                        # the findings are listed below, each once
            lines.append(e(line))
        label = ("whole chain: the backend's chain against the reference chain" if st == "chain"
                 else f"stage {st}: the backend against the reference on the backend's upstream outputs")
        items = "".join(f"<li><code>[{e(str(f.get('class', '')))}, step {e(str(f.get('step')))}]</code> "
                        f"{e(str(f.get('where', f.get('text', ''))))}</li>" for f in fs)
        more = (f" ({counted} counted in the class_* metrics; report.json keeps the first {len(fs)})"
                if counted > len(fs) else "")
        fblock = (f"<details class='findings' id='{sid}-findings'><summary>{len(fs)} finding(s) listed{e(more)}"
                  f"</summary><ol>{items}</ol></details>" if fs else "")
        out.append(f"<div class='stage{' chain' if st == 'chain' else ''}' id='{sid}'><h4>{e(label)}</h4>"
                   f"<pre>{chr(10).join(lines)}</pre>{fblock}</div>")
    return "".join(out)


def _selection_html(r) -> str:
    e = _html.escape
    sel = selection(r)
    if not sel:
        return ""
    head = "".join(f"<th>{e(h)}</th>" for h, _, _ in SELECTION)
    body = "".join(f"<tr class='{'lost' if (v.get('topk_recall_min') or 1) < 1 else ''}'>"
                   f"<th>{e(SELECTION_WHERE[w])}</th>" + "".join(f"<td>{e(c)}</td>" for c in _sel_cells(v))
                   + f"<td>{e(v['verdict'])}</td></tr>" for w, v in sel.items())
    return (f"<div class='matter'><h4>Does the difference matter? The top-k selection against the exact one</h4>"
            f"<table><tr><th></th>{head}<th>verdict</th></tr>{body}</table></div>")


_SCRIPT = """
(function () {
  var table = document.getElementById('cases');
  var body = table.tBodies[0];
  var filter = document.getElementById('filter');
  var status = document.getElementById('status-filter');
  function apply() {
    var q = filter.value.toLowerCase(), s = status.value, shown = 0;
    Array.prototype.forEach.call(body.rows, function (tr) {
      var ok = (!q || tr.textContent.toLowerCase().indexOf(q) >= 0) &&
               (!s || tr.getAttribute('data-status') === s || (s === 'failing' && tr.getAttribute('data-ok') === '0'));
      tr.style.display = ok ? '' : 'none';
      if (ok) shown++;
    });
    document.getElementById('shown').textContent = shown + ' of ' + body.rows.length + ' cases shown';
  }
  filter.addEventListener('input', apply);
  status.addEventListener('change', apply);
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
    th.addEventListener('click', function () {
      var asc = th.getAttribute('data-dir') !== 'asc';
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (o) { o.removeAttribute('data-dir'); });
      th.setAttribute('data-dir', asc ? 'asc' : 'desc');
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (a, b) {
        var ca = a.cells[col], cb = b.cells[col], c;
        var x = ca.getAttribute('data-v'), y = cb.getAttribute('data-v');
        if (x === '' || y === '') return x === y ? 0 : (x === '' ? 1 : -1);    /* empty cells last */
        if (ca.hasAttribute('data-n') && cb.hasAttribute('data-n'))
          c = parseFloat(ca.getAttribute('data-n')) - parseFloat(cb.getAttribute('data-n'));
        else c = x < y ? -1 : x > y ? 1 : 0;
        return asc ? c : -c;
      });
      rows.forEach(function (tr) { body.appendChild(tr); });
    });
  });
  function openTarget() {
    var id = decodeURIComponent(location.hash.slice(1));
    var el = id && document.getElementById(id);
    for (var n = el; n; n = n.parentElement) { if (n.tagName === 'DETAILS') n.open = true; }
    if (el) el.scrollIntoView();
  }
  window.addEventListener('hashchange', openTarget);
  openTarget();
  apply();
})();
"""

_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1500px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}#cases thead th{cursor:pointer;background:#f0f0f0;
position:sticky;top:0}#cases thead th[data-dir=asc]::after{content:' \\25B2'}#cases thead th[data-dir=desc]::after{
content:' \\25BC'}.pass{color:green}.fail,.error{color:#c00;font-weight:bold}.nonfinite_input{color:#a0a}
.skipped{color:#b80}pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px;white-space:pre-wrap}
figure{margin:1em 0}section.case{border-top:2px solid #ddd;margin-top:1.5em;padding-top:.5em}
section.case.bad{border-top-color:#c00}.stage{margin:.8em 0 .8em 1em}.stage.chain h4{color:#036}
.matter tr.lost td,.matter tr.lost th{background:#fde8e8}details.findings summary{cursor:pointer;color:#036}
.toolbar{margin:.6em 0}#cases td:first-child{white-space:nowrap}.toolbar input{width:24em}.top{font-size:12px;margin-left:1em}"""


def _memory_td(r) -> str:
    peak = _num(r.get("gpu_peak_bytes"))
    if peak is None:
        return "<td data-v=''></td>"
    return f"<td data-v='{peak!r}' data-n='{peak!r}'>{_html.escape(memory_cell(r))}</td>"


def html(df: pd.DataFrame, meta: dict) -> str:
    """One self-contained page: the overview table (sortable by any column, filtered by a text
    box and a status menu, failing cases first, each case linked to its section), the figures,
    one section per case (violations, the "does it matter" block, a labelled block per stage and
    one for the whole chain, findings collapsed), and every metric. Inline CSS, script and PNGs."""
    s = summary(df, meta)
    e = _html.escape
    order = case_order(df)
    slugs = _slugs(df)
    mem = has_memory(df)
    cols = ["case", "status", *OVERVIEW, *([MEMORY_HEAD] if mem else []), "seconds", "reason"]
    rows = []
    for i in order:
        r = df.iloc[i]
        slug = slugs[i]
        st = str(r["status"])
        nums = [*overview_values(r), _num(r["seconds"]) or 0.0]
        cells = [f"<td data-v='{e(str(r['case']))}'><a href='#{slug}'>{e(str(r['case']))}</a></td>",
                 f"<td data-v='{STATUS_ORDER.get(st, 5)}{e(st)}'><span class='{e(st)}'>{e(st)}</span></td>",
                 *["<td data-v=''></td>" if v is None else f"<td data-v='{v!r}' data-n='{v!r}'>{e(_fmt(v))}</td>"
                   for v in nums[:-1]],
                 *([_memory_td(r)] if mem else []),
                 f"<td data-v='{nums[-1]!r}' data-n='{nums[-1]!r}'>{nums[-1]:.1f}</td>",
                 f"<td data-v='{e(str(r['reason'] or ''))}'>{e(str(r['reason'] or ''))}</td>"]
        rows.append(f"<tr data-status='{e(st)}' data-ok='{int(bool(r['ok']))}'>" + "".join(cells) + "</tr>")
    allfigs = _figures(df)

    def fig(cap, uri):
        return f"<figure><img src='{uri}' alt='{e(cap)}'><figcaption>{e(cap)}</figcaption></figure>"
    figs = "".join(fig(cap, uri) for case, cap, uri in allfigs if case is None)
    case_figs: dict[str, str] = {}
    for case, cap, uri in allfigs:
        if case is not None:
            case_figs[case] = case_figs.get(case, "") + fig(cap, uri)
    sections = []
    for i in order:
        r = df.iloc[i]
        slug = slugs[i]
        bad = not bool(r["ok"])
        viol = "".join(f"<li><code>{e(v['metric'])}</code> = {e(_fmt(v['value']))} (budget {e(v['limit'])})</li>"
                       for v in r["violations"] or [])
        sections.append(
            f"<section class='case{' bad' if bad else ''}' id='{slug}'><h3>{e(str(r['case']))} — "
            f"<span class='{e(str(r['status']))}'>{e(str(r['status']))}</span>"
            f"<a class='top' href='#overview'>↑ overview</a></h3>"
            f"<p>{e(str(r['description'] or ''))}</p>"
            + (f"<p><b>{e(str(r['reason']))}</b></p>" if r["reason"] else "")
            + (f"<ul class='violations'>{viol}</ul>" if viol else "")
            + _selection_html(r) + case_figs.get(str(r["case"]), "") + _stage_blocks(r, slug) + "</section>")
    metrics = df[["case", *metric_columns(df)]].to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}")
    statuses = "".join(f"<option value='{st}'>{st}</option>" for st in STATUS_ORDER)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>mxval report</title>
<style>{_STYLE}</style></head><body>
<h1>mxval {e(str(meta.get('command', '')))}: {e(str(meta.get('suite', '')))} on {e(str(meta.get('backend', '')))}{e(part_note(meta))}
— {verdict_word(s)}</h1>
{f"<p class='fail'>{e(_interrupt_note(meta))}</p>" if s.get("interrupted") else ""}
<p>{s['pass']} pass, {s['fail']} fail, {s['error']} error, {s['nonfinite_input']} non-finite input, {s['skipped']} skipped ·
{e(str(meta.get('machine', '')))} · {e(str(meta.get('started', '')))} · budgets {e(str((meta.get('budgets') or {}).get('path', '')))}</p>
<p>backend: {e(str(meta.get('backend_description', '')))}</p>
{f"<p>{e(memory_note(df))}</p>" if mem else ""}
{f"<p><b>checks turned off</b> by the budgets file: {e('; '.join(meta['budgets_off']))}</p>" if meta.get('budgets_off') else ''}
<h2 id="overview">Cases</h2>
<p>Failing cases first; click a column to sort, a case to open its section. The chain columns compare
the backend's whole chain with the reference chain; {e(_proxy())}.</p>
<div class="toolbar"><input id="filter" type="search" placeholder="filter: case, status, reason…">
<select id="status-filter"><option value="">every status</option><option value="failing">failing (not ok)</option>{statuses}</select>
<span id="shown"></span></div>
<table id="cases"><thead><tr>{''.join(f'<th>{e(c)}</th>' for c in cols)}</tr></thead><tbody>{''.join(rows)}</tbody></table>
{figs}
<h2>Each case</h2>
{''.join(sections)}
<details id="all-metrics"><summary>all metrics</summary>{metrics}</details>
<script>{_SCRIPT}</script>
</body></html>
"""


# --- JUnit -------------------------------------------------------------------------------------

def junit(df: pd.DataFrame, meta: dict) -> str:
    s = summary(df, meta)
    suite = ET.Element("testsuite", name=f"mxval.{meta.get('suite', '')}", tests=str(s["cases"]),
                       failures=str(s["fail"] + sum(1 for _, r in df.iterrows()
                                                     if r["status"] == "nonfinite_input" and not r["ok"])),
                       errors=str(s["error"]), skipped=str(s["skipped"]),
                       time=f"{float(meta.get('seconds', 0)):.3f}")
    if meta.get("budgets_off"):
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="budgets_off", value="; ".join(meta["budgets_off"]))
    for _, r in df.iterrows():
        tc = ET.SubElement(suite, "testcase", classname=f"mxval.{r['suite']}.{r['backend']}", name=str(r["case"]),
                           time=f"{_num(r['seconds']) or 0:.3f}")
        st = r["status"]
        if st == "skipped":
            ET.SubElement(tc, "skipped", message=str(r["reason"] or ""))
        elif st == "error":
            ET.SubElement(tc, "error", message=str(r["reason"] or "")).text = "\n".join(_where_lines(r))
        elif not r["ok"]:
            body = [f"{v['metric']} = {_fmt(v['value'])} (budget {v['limit']})" for v in r["violations"] or []]
            ET.SubElement(tc, "failure", message=f"{st}: {r['reason']}").text = "\n".join(body + _where_lines(r))
        elif st == "nonfinite_input":
            ET.SubElement(tc, "system-out").text = f"expected non-finite input: {r['reason']}"
    if s.get("interrupted"):
        for name in (meta.get("interrupted") or {}).get("cancelled") or []:
            tc = ET.SubElement(suite, "testcase", classname=f"mxval.{meta.get('suite', '')}", name=str(name))
            ET.SubElement(tc, "error", message="cancelled: the run was interrupted")
        suite.set("errors", str(s["error"] + len((meta.get("interrupted") or {}).get("cancelled") or [])))
        suite.set("tests", str(s["cases"] + len((meta.get("interrupted") or {}).get("cancelled") or [])))
    return ET.tostring(escape.xml_tree(suite), encoding="unicode")


# --- all of them -------------------------------------------------------------------------------

REPORT_FILES = {"md": "report.md", "html": "report.html", "junit": "junit.xml", "csv": "metrics.csv",
                "json": "report.json"}
# A directory holding one of these holds another run's report.
RUN_MARKERS = ("report.json", "selftest.json", "study.json")
# Files of an earlier run's set that a new set replacing it removes when it has none of its own.
STALE = ("selftest.md", "selftest.json")


def render_all(df: pd.DataFrame, meta: dict, *, json_source: Optional[Path] = None, same_json: bool = False,
               extra: Optional[dict] = None) -> dict[str, str | bytes]:
    """{file name: content} of every format, report.json last (it vouches for the rest).
    `json_source`: the report.json these rows were read from (`mxval report`), copied byte for
    byte (left out when `same_json`: it is never rewritten). `extra`: more files of the set
    (selftest.md, selftest.json), written before report.json."""
    files: dict[str, str | bytes] = {
        REPORT_FILES["md"]: markdown(df, meta), REPORT_FILES["html"]: html(df, meta),
        REPORT_FILES["junit"]: junit(df, meta),
        REPORT_FILES["csv"]: escape.csv_frame(df[[c for c in COLUMNS if c in df.columns]
                                                 + metric_columns(df)]).to_csv(index=False)}
    files.update(extra or {})
    if json_source is None:
        files[REPORT_FILES["json"]] = json.dumps(to_json(df, meta), indent=1, default=str)
    elif not same_json:
        files[REPORT_FILES["json"]] = safe_input.read_bytes(json_source, safe_input.MAX_JSON_BYTES, error=ReportError)
    return files


def write_all(df: pd.DataFrame, meta: dict, out_dir, *, json_source: Optional[Path] = None,
              extra: Optional[dict] = None, again=None) -> dict[str, str]:
    """Every format into `out_dir`, replaced as one set (harness/io/atomic.py `write_set`):
    all are written beside the old ones and swapped in only once every one is whole, so the
    formats a run leaves always agree; a full disk leaves the old set as it was (OSError).
    `again()`: asked once the set is rendered; True (the run's metadata changed: a signal
    came) renders it again before it is written. {format: path}."""
    from harness.io import atomic
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    same = json_source is not None and _same_file(json_source, out / REPORT_FILES["json"])
    files = render_all(df, meta, json_source=json_source, same_json=same, extra=extra)
    if again is not None and again():
        files = render_all(df, meta, json_source=json_source, same_json=same, extra=extra)
    atomic.write_set(out, files, remove=STALE if json_source is None else ())
    paths = {k: str(out / v) for k, v in REPORT_FILES.items()}
    return paths


def _same_file(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve() or os.path.samefile(a, b)
    except OSError:
        return False


# --- report directories ----------------------------------------------------------------------

def default_dir(name: str, root="reports") -> Path:
    """A fresh directory `<root>/<name>-<YYYYmmdd-HHMMSS>-<pid>[-n]`, created here: two runs
    started in the same second (or one pid reused) never share one."""
    import datetime

    from harness.io.atomic import safe_name
    name = safe_name(name)                            # suite and backend names become one path part
    base = f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        p = Path(root) / (base if n == 0 else f"{base}-{n}")
        try:
            p.mkdir()
        except FileExistsError:
            continue
        return p
    raise ReportError(f"{root}: no free report directory name for {base}")


def claim_dir(path, *, force: bool = False, arg: str = "--report-dir") -> Path:
    """Before any work: refuse a directory that holds another run's report (unless `force`),
    create it and prove a file can be written there. ReportError (one line, exit 2)."""
    from harness.io import atomic
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ReportError(f"{arg}: {p} exists and is not a directory")
    if p.is_dir() and not force:
        held = [m for m in RUN_MARKERS if (p / m).exists()]
        if held:
            raise ReportError(f"{arg}: {p} holds another run's report ({held[0]}); pass --force to "
                              f"replace it, or choose another directory")
    try:
        atomic.check_writable_dir(p)
    except OSError as e:
        raise ReportError(f"{arg}: {p}: cannot write there: {e.strerror or e}") from None
    _lock(p, arg)
    atomic.hold_dir(p)                    # written through this descriptor from now on
    return p


LOCK = ".mxval-run.lock"
_held: list[Path] = []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _started(pid: int) -> Optional[str]:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat), None where unknown:
    with the pid it names one process, never a later one given the same pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _lock(d: Path, arg: str) -> None:
    """One running mxval per report directory: a second run started into it while the first
    runs is refused even with --force (it would overwrite the first's report when it ends).
    The lock is the file `.mxval-run.lock` holding the pid and the process's start time,
    removed when the process ends; one left by a process that died (or whose pid now belongs
    to a later process) is taken over; a refusal names the lock file and how to clear it."""
    import atexit
    path = d / LOCK
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            try:
                held = path.read_text().split()
                pid, started = int(held[0]) if held else 0, (held[1] if len(held) > 1 else None)
            except (OSError, ValueError):
                pid, started = 0, None
            if pid == os.getpid():
                return
            now = _started(pid) if pid else None
            if pid and _pid_alive(pid) and (started is None or now is None or now == started):
                raise ReportError(f"{arg}: {d} is in use by a running mxval (pid {pid}, its lock {path}); if no "
                                  f"mxval runs there any more, delete {path}") from None
            try:
                path.unlink()                 # a dead run's lock
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {_started(os.getpid()) or ''}".strip())
        if not _held:
            atexit.register(release_locks)
        _held.append(path)
        return
    raise ReportError(f"{arg}: {d}: cannot take its lock {LOCK}")


def release_locks() -> None:
    from harness.io import atomic
    atomic.release_dirs()
    while _held:
        p = _held.pop()
        try:
            if p.read_text().split()[:1] == [str(os.getpid())]:
                p.unlink()
        except OSError:
            pass
