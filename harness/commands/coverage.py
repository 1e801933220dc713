"""`mxval coverage`: which boundaries of the coverage model (reference/coverage.py) each case
of a suite reaches, and which no case reaches. No backend runs: each case's inputs are
generated and walked through the reference chain (harness/run/coverage.py). This module
parses the arguments and imports nothing heavy, so that help and usage errors stay instant.

    mxval coverage                          # the default suite
    mxval coverage --suite full --json cov.json --markdown cov.md
    mxval coverage --suite default --check  # exit 1 when a boundary this machine can reach is unreached
"""
from __future__ import annotations

from pathlib import Path

from harness.errors import EXIT_FAIL, EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("coverage", help="which boundaries of the coverage model each case of a suite reaches "
                                        "(no backend runs)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--suite", default=None, help="suite name (default: default)")
    g.add_argument("--case", action="append", default=None, metavar="NAME", help="a case (repeatable)")
    p.add_argument("--cases-dir", default=None, metavar="DIR", help="where the suite files are (default: cases/)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every case's boundaries and every "
                                                                "boundary's cases as JSON")
    p.add_argument("--markdown", default=None, metavar="FILE", help="write the per-op table as Markdown "
                                                                    "(the README's coverage section)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a boundary this machine can reach (cpu ones on a CPU, all on a GPU) is "
                        "unreached, or a case could not be measured here")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-case lines")


def run(args) -> int:
    import torch

    from harness.io import atomic, escape
    from harness.run.cases import Catalog
    from harness.run.coverage import suite_coverage
    from harness.run.geometry import geometry

    catalog = Catalog(args.cases_dir)
    suite, cases = catalog.select(args.suite, args.case)
    for c in cases:
        geometry(c)                               # a case that cannot run is an error before any work
    on_gpu = torch.cuda.is_available()

    def progress(c):
        if not args.quiet:
            print(escape.terminal(f"  measured {c.name}"), flush=True)
    cov = suite_coverage(cases, progress=progress)
    from harness.run.record import machine
    doc = coverage_json(cov, suite, machine("cuda" if on_gpu else "cpu"))
    _print(cov, doc, suite)
    if args.json:
        import json
        atomic.write_text(Path(args.json), json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        atomic.write_text(Path(args.markdown), markdown(doc))
    if not args.check:
        return EXIT_OK
    needs = ("cpu", "gpu") if on_gpu else ("cpu",)
    missing = [b for b in doc["boundaries"] if b["needs"] in needs and not b["reached_by"]]
    return EXIT_FAIL if missing or doc["unmeasured"] else EXIT_OK


def coverage_json(cov, suite: str, machine: str = "") -> dict:
    from reference.coverage import BOUNDARIES, FACTS
    by = cov.reached_by()
    return {
        "schema": "mxval-coverage", "version": 1, "suite": suite, "machine": machine,
        "facts": FACTS,
        "boundaries": [{"name": b.name, "ops": list(b.ops), "input": b.input, "dim": b.dim, "fact": b.fact,
                        "point": b.point, "needs": b.needs, "source": b.source, "reached_by": by[b.name]}
                       for b in BOUNDARIES],
        "cases": {m.case.name: m.reached() for m in cov.cases},
        "unmeasured": {m.case.name: m.note for m in cov.unmeasured()},
    }


def _group(b: dict) -> str:
    return b["name"].split(".")[0]


def _print(cov, doc: dict, suite: str) -> None:
    from rich.table import Table

    from harness.io import escape
    from harness.io.escape import wide_console
    con = wide_console()
    t = Table(title=escape.rich(f"coverage of suite {suite}: each boundary and the cases that reach it"))
    for col in ("boundary", "dimension", "point", "needs", "cases"):
        t.add_column(col, overflow="fold")
    for b in doc["boundaries"]:
        who = b["reached_by"]
        cell = f"{len(who)}: {', '.join(who[:3])}{' ...' if len(who) > 3 else ''}" if who else "[bold red]none"
        t.add_row(escape.rich(b["name"]), escape.rich(b["dim"]), escape.rich(b["point"]), b["needs"],
                  cell if not who else escape.rich(cell))
    con.print(t)
    c = Table(title=escape.rich(f"coverage of suite {suite}: each case and the boundaries it reaches"))
    for col in ("case", "boundaries", "of them"):
        c.add_column(col, overflow="fold")
    for name, reached in doc["cases"].items():
        note = doc["unmeasured"].get(name)
        c.add_row(escape.rich(name), str(len(reached)), escape.rich(note or ", ".join(reached)))
    con.print(c)
    for line in summary_lines(doc):
        print(escape.terminal(line))


def summary_lines(doc: dict) -> list[str]:
    out = []
    for need in ("cpu", "gpu"):
        bs = [b for b in doc["boundaries"] if b["needs"] == need]
        miss = [b["name"] for b in bs if not b["reached_by"]]
        out.append(f"{need} boundaries: {len(bs) - len(miss)} of {len(bs)} reached"
                   + (f"; unreached: {', '.join(miss)}" if miss else ""))
    if doc["unmeasured"]:
        out.append(f"measured for their structure only here: {', '.join(doc['unmeasured'])} (their values need a GPU)")
    return out


def markdown(doc: dict) -> str:
    """Per op group: boundaries, how many the suite reaches, and the unreached ones."""
    groups: dict[str, list] = {}
    for b in doc["boundaries"]:
        groups.setdefault(_group(b), []).append(b)
    lines = [f"Suite `{doc['suite']}`: {len(doc['cases'])} cases, measured on {doc.get('machine') or 'this machine'}.", "",
             "| boundaries of | count | reached | unreached |", "|---|---|---|---|"]
    for g, bs in groups.items():
        miss = [f"`{b['name']}`{' (gpu)' if b['needs'] == 'gpu' else ''}" for b in bs if not b["reached_by"]]
        lines.append(f"| {g} | {len(bs)} | {len(bs) - len(miss)} | {', '.join(miss) or '-'} |")
    lines += [""] + [f"- {s}" for s in summary_lines(doc)]
    return "\n".join(lines) + "\n"
