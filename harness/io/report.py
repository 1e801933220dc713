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
from pathlib import Path
from typing import Optional
from xml.etree import ElementTree as ET

import pandas as pd

from harness.errors import ReportError
from harness.io import escape, report_shape, safe_input

SCHEMA = "mxval-report"
SCHEMA_VERSION = 1
COLUMNS = ["case", "suite", "backend", "status", "ok", "reason", "seconds", "context", "shape",
           "description", "expect_nonfinite"]
OBJECT_COLUMNS = ["violations", "findings", "summaries", "details", "planted"]
STATUS_STYLE = {"pass": "green", "fail": "bold red", "error": "bold red", "nonfinite_input": "magenta",
                "skipped": "yellow"}
# (heading, metric suffix, how to combine the op stages) for the overview tables
HEADLINE = [("pages≠", "page_bytes_mismatched", "sum"), ("outside", "page_bytes_outside_owned_changed", "sum"),
            ("pool ulp", "pooled_max_ulp", "max"), ("q≠", "q_bytes_mismatched", "sum"),
            ("logits diff", "logits_diff", "max"), ("top-k recall", "topk_recall_min", "min")]


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


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.3g}"
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


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
        cases.append(d)
    return {"schema": SCHEMA, "version": SCHEMA_VERSION, "run": meta, "summary": summary(df, meta),
            "cases": cases}


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

def wide_console():
    """A terminal's own width; logs and CI get 170 columns instead of 80 folded ones."""
    from rich.console import Console
    c = Console()
    return c if c.is_terminal else Console(width=170)


def console_table(df: pd.DataFrame, meta: dict, console=None) -> None:
    from rich.table import Table
    console = console or wide_console()
    t = Table(title=escape.rich(f"mxval {meta.get('command', '')}: {meta.get('suite', '')} on "
                                f"{meta.get('backend', '')}{part_note(meta)}"),
              caption=escape.rich(meta.get("backend_description")) if meta.get("backend_description") else None,
              show_lines=False)
    for col in ("case", "status", *[h for h, _, _ in HEADLINE], "chain≠", "s", "reason"):
        t.add_column(col, overflow="fold", max_width=60 if col == "reason" else None)
    for _, r in df.iterrows():
        st = r["status"]
        chain = _num(r.get(_chain_frac())) if _chain_frac() in r else None
        t.add_row(escape.rich(r["case"]), f"[{STATUS_STYLE.get(st, '')}]{escape.rich(st)}[/]",
                  *[_fmt(headline(r, m, how)) for _, m, how in HEADLINE], _fmt(chain),
                  f"{_num(r['seconds']) or 0:.1f}", escape.rich(r["reason"] or ""))
    console.print(t)
    s = summary(df, meta)
    verdict = "[green]OK[/]" if s["ok"] else f"[bold red]{verdict_word(s)}[/]"
    if s.get("interrupted"):
        console.print(f"[bold red]{escape.rich(_interrupt_note(meta))}[/]")
    console.print(f"{verdict}: {s['pass']} pass, {s['fail']} fail, {s['error']} error, "
                  f"{s['nonfinite_input']} non-finite input, {s['skipped']} skipped")
    if meta.get("budgets_off"):
        console.print(f"[yellow]checks turned off[/] by {escape.rich((meta.get('budgets') or {}).get('path', ''))}: "
                      + escape.rich("; ".join(map(str, meta["budgets_off"]))))


# --- markdown --------------------------------------------------------------------------------

def _where_lines(r, n: int = 6) -> list[str]:
    out = []
    for f in (r["findings"] or [])[:n]:
        out.append(f"[{f.get('stage')}, step {f.get('step')}] {f.get('class', '')}: {f.get('where', f.get('text', ''))}")
    return out


def markdown(df: pd.DataFrame, meta: dict) -> str:
    s = summary(df, meta)
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
             "| case | status | " + " | ".join(h for h, _, _ in HEADLINE) + " | chain≠ frac | reason |",
             "|---|---|" + "---|" * len(HEADLINE) + "---|---|"]
    for _, r in df.iterrows():
        chain = _num(r[_chain_frac()]) if _chain_frac() in r else None
        reason = str(r["reason"] or "").replace("|", "\\|")
        lines.append(f"| {r['case']} | {r['status']} | "
                     + " | ".join(_fmt(headline(r, m, how)) for _, m, how in HEADLINE)
                     + f" | {_fmt(chain)} | {reason} |")
    bad = df[~df["ok"].astype(bool)]
    if len(bad):
        lines += ["", "#### Failures", ""]
        for _, r in bad.iterrows():
            lines.append(f"**{r['case']}** ({r['status']}): {r['reason']}")
            for v in r["violations"] or []:
                lines.append(f"- `{v['metric']}` = {_fmt(v['value'])} (budget {v['limit']})")
            for w in _where_lines(r):
                lines.append(f"  - {w}")
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    out = []
    for _, r in df.iterrows():
        pts = (r["details"] or {}).get("mismatch_map") or []
        if not pts or len(out) >= 6:
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
        im = ax.imshow(np.ma.masked_equal(img, 0), aspect="auto", interpolation="nearest", cmap="Reds")
        ax.set_yticks(range(len(pages)), [f"page {p}" + (f" (+{int(pad[i])} pad)" if pad[i] else "")
                                           for i, p in enumerate(pages)])
        ax.set_xlabel("entry in page")
        fig.colorbar(im, ax=ax, label="mismatched bytes")
        ax.set_title(escape.mathtext(f"{escape.terminal(r['case'])}: mismatched K-cache bytes by page and entry"))
        out.append((f"Mismatch map of {r['case']} (pages with a mismatch, bytes per entry)", _png(fig)))
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
        out.append(("Error histograms over all cases", _png(fig)))
    rec = []
    for _, r in df.iterrows():
        rec += (r["details"] or {}).get("recall_rows") or []
    if rec:
        arr = np.array(rec, dtype=float)
        fig, ax = plt.subplots(figsize=(8, 3.2))
        ax.scatter(np.maximum(arr[:, 0], 1), arr[:, 1], s=6, alpha=0.5)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("row length (compressed entries visible)")
        ax.set_ylabel("top-k recall")
        ax.set_title("backend chain top-k against the reference chain")
        out.append(("Top-k recall against context length (per query row)", _png(fig)))
    return out


def html(df: pd.DataFrame, meta: dict) -> str:
    s = summary(df, meta)
    e = _html.escape
    cols = ["case", "status", *[h for h, _, _ in HEADLINE], "seconds", "reason"]
    rows = []
    for _, r in df.iterrows():
        cells = [e(str(r["case"])), f"<span class='{e(str(r['status']))}'>{e(str(r['status']))}</span>",
                 *[_fmt(headline(r, m, how)) for _, m, how in HEADLINE], f"{_num(r['seconds']) or 0:.1f}",
                 e(str(r["reason"] or ""))]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    figs = "".join(f"<figure><img src='{uri}'><figcaption>{e(cap)}</figcaption></figure>"
                   for cap, uri in figures(df))
    details = []
    for _, r in df.iterrows():
        if r["ok"] and r["status"] != "nonfinite_input":
            continue
        viol = "".join(f"<li><code>{e(v['metric'])}</code> = {e(_fmt(v['value']))} (budget {e(v['limit'])})</li>"
                       for v in r["violations"] or [])
        summ = "\n".join("\n".join(v) for v in (r["summaries"] or {}).values())
        details.append(f"<h3>{e(str(r['case']))} — {e(str(r['status']))}</h3><p>{e(str(r['reason'] or ''))}</p>"
                       f"<ul>{viol}</ul><pre>{e(summ)}</pre>")
    metrics = df[["case", *metric_columns(df)]].to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>mxval report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:left}}.pass{{color:green}}.fail,.error{{color:#c00;font-weight:bold}}
.nonfinite_input{{color:#a0a}}.skipped{{color:#b80}}pre{{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px}}
figure{{margin:1em 0}}details{{margin-top:2em}}</style></head><body>
<h1>mxval {e(str(meta.get('command', '')))}: {e(str(meta.get('suite', '')))} on {e(str(meta.get('backend', '')))}{e(part_note(meta))}
— {verdict_word(s)}</h1>
{f"<p class='fail'>{e(_interrupt_note(meta))}</p>" if s.get("interrupted") else ""}
<p>{s['pass']} pass, {s['fail']} fail, {s['error']} error, {s['nonfinite_input']} non-finite input, {s['skipped']} skipped ·
{e(str(meta.get('machine', '')))} · {e(str(meta.get('started', '')))} · budgets {e(str((meta.get('budgets') or {}).get('path', '')))}</p>
<p>backend: {e(str(meta.get('backend_description', '')))}</p>
{f"<p><b>checks turned off</b> by the budgets file: {e('; '.join(meta['budgets_off']))}</p>" if meta.get('budgets_off') else ''}
<table><tr>{''.join(f'<th>{e(c)}</th>' for c in cols)}</tr>{''.join(rows)}</table>
{figs}
{''.join(details)}
<details><summary>all metrics</summary>{metrics}</details>
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
RUN_MARKERS = ("report.json", "selftest.json")


def write_all(df: pd.DataFrame, meta: dict, out_dir, *, json_source: Optional[Path] = None) -> dict[str, str]:
    """Every format into `out_dir`, each file written to a temporary name and renamed;
    report.json last, so a report.json is only ever next to the files rendered from it.
    `json_source`: the report.json these rows were read from (`mxval report`): it is
    never rewritten, and copied byte for byte when `out_dir` is another directory."""
    from harness.io import atomic
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / v for k, v in REPORT_FILES.items()}
    atomic.write_text(paths["md"], markdown(df, meta))
    atomic.write_text(paths["html"], html(df, meta))
    atomic.write_text(paths["junit"], junit(df, meta))
    atomic.write_text(paths["csv"], escape.csv_frame(df[[c for c in COLUMNS if c in df.columns]
                                                       + metric_columns(df)]).to_csv(index=False))
    if json_source is None:
        atomic.write_text(paths["json"], json.dumps(to_json(df, meta), indent=1, default=str))
    elif not _same_file(json_source, paths["json"]):
        atomic.write_bytes(paths["json"], Path(json_source).read_bytes())
    return {k: str(v) for k, v in paths.items()}


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


def _lock(d: Path, arg: str) -> None:
    """One running mxval per report directory: a second run started into it while the first
    runs is refused even with --force (it would overwrite the first's report when it ends).
    The lock is the file `.mxval-run.lock` holding the pid, removed when the process ends;
    one left by a process that died is taken over."""
    import atexit
    path = d / LOCK
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            try:
                pid = int(path.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid == os.getpid():
                return
            if pid and _pid_alive(pid):
                raise ReportError(f"{arg}: {d} is in use by a running mxval (pid {pid})") from None
            try:
                path.unlink()                 # a dead run's lock
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        if not _held:
            atexit.register(release_locks)
        _held.append(path)
        return
    raise ReportError(f"{arg}: {d}: cannot take its lock {LOCK}")


def release_locks() -> None:
    while _held:
        p = _held.pop()
        try:
            if p.read_text().strip() == str(os.getpid()):
                p.unlink()
        except OSError:
            pass
