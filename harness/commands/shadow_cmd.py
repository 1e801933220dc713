"""`mxval shadow report DIR`: the verdicts a shadow run logged (DIR/verdicts.jsonl, written
by harness.capture.shadow while serving), as a report in every format: one row per checked
(layer, step), judged again by the budgets (the run's own file by default, as `mxval diff`
judges a dump), each failing row naming the dump it was kept as. The counters of
DIR/metrics.prom and the log's events (start, off, stop) are printed and kept in the
report's metadata. Exit status as `mxval diff`: 0 every verdict passes, 1 one fails (or
nothing was checked), 2 bad input.

    mxval shadow report /data/mxval-shadow --report-dir reports/shadow
"""
from __future__ import annotations

import os

from harness.errors import InputError, UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("shadow", help="validate while serving: summarise a shadow run's verdict log "
                                      "(`mxval shadow report DIR`)")
    ss = p.add_subparsers(dest="shadow_command", metavar="{report}")
    r = ss.add_parser("report", help="the verdict log of DIR as a report in every format")
    r.add_argument("dir", metavar="DIR", help="the shadow directory (MXVAL_SHADOW_DIR): verdicts.jsonl, metrics.prom")
    from harness.commands.args import add_common
    add_common(r, cases=False)


def _rows(entries: list[dict]) -> tuple[list[dict], list[dict]]:
    """(rows, events): each verdict's row, named uniquely; the other entries."""
    rows, events, seen = [], [], {}
    for e in entries:
        if e.get("event") != "verdict":
            events.append({k: v for k, v in e.items() if k != "traceback"})
            continue
        row = e.get("row")
        if not isinstance(row, dict) or not isinstance(row.get("metrics"), dict):
            raise InputError(f"verdict of layer {e.get('layer')} step {e.get('step')}: no row of metrics")
        row = dict(row)
        base = f"layer{'x' if e.get('layer') is None else e['layer']}_step{'x' if e.get('step') is None else e['step']}"
        n = seen.get(base, 0)
        seen[base] = n + 1
        row["case"] = base if n == 0 else f"{base}_{n}"
        row["suite"] = "diff"
        if e.get("dump"):
            row["description"] = f"kept as {e['dump']}"
        for k in ("status", "ok", "violations"):
            row.pop(k, None)
        row["metrics"] = {k: _number(v) for k, v in row["metrics"].items()}
        rows.append(row)
    return rows, events


def _number(v) -> float:
    """A logged metric back to a float: the log writes NaN as null and ±inf as "inf"/"-inf"."""
    if v is None:
        return float("nan")
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise InputError(f"a metric value {str(v)[:40]!r} is not a number")
    try:
        return float(v)
    except ValueError:
        raise InputError(f"a metric value {v[:40]!r} is not a number") from None


def _counters(path: str) -> dict:
    out = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("mxval_shadow_"):
                    name, _, value = line.strip().partition(" ")
                    try:
                        out[name] = float(value)
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def run(args) -> int:
    from harness.capture import shadow
    from harness.run.pipeline import Run
    if args.shadow_command != "report":
        raise UsageError("mxval shadow: expected `mxval shadow report DIR`")
    log = os.path.join(args.dir, shadow.LOG)
    if not os.path.isfile(log):
        raise InputError(f"{args.dir}: no {shadow.LOG} (not a shadow directory: MXVAL_SHADOW_DIR)")
    entries, problems = shadow.read_log(log)
    try:
        rows, events = _rows(entries)
    except InputError as e:
        raise InputError(f"{log}: {e}") from None
    budgets = args.budgets
    if budgets is None:                     # the run's own budgets file, as the log's start names it
        start = next((e for e in events if e.get("event") == "start"), {})
        b = start.get("budgets")
        budgets = b if isinstance(b, str) and os.path.isfile(b) else None
    run_ = Run("shadow", budgets=budgets, suite="diff", report_dir=args.report_dir, force=args.force,
               quiet=args.quiet, owner=args)
    run_.load_budgets()
    ops = {r["case"]: sorted({k.split(".", 1)[0] for k in r["metrics"]}) for r in rows}
    run_.check_budgets(ops, chain=False, what="file")
    run_.claim("shadow-report")
    counters = _counters(os.path.join(args.dir, shadow.PROM))
    if not args.quiet:
        print(f"shadow {args.dir}: {len(rows)} verdict(s), "
              f"{sum(1 for e in entries if e.get('event') == 'verdict' and not e.get('ok'))} failing as logged; "
              + ", ".join(f"{k[len('mxval_shadow_'):]} {v:g}" for k, v in counters.items()))
        for e in events:
            if e.get("event") == "off":
                print(f"shadow switched off: {e.get('why', '?')}")
        for p in problems[:3]:
            print(f"mxval: {log}: {p} (left out)")
    meta = run_.meta(backend="reference", backend_requested="reference",
                     backend_description=f"verdicts of a shadow run ({args.dir})", device="cpu",
                     files=[log], shadow={"counters": counters, "events": events, "log_problems": problems})
    return run_.record(rows, meta)
