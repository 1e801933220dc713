"""The selftest (`mxval selftest`, harness/commands/selftest.py): prove that every check has teeth.

1. Every fault of the catalogue (optimized/faults.py: one §10 bug class each) runs through
   the ordinary runner on the cases that can expose it; each run must break at least one
   budget. The fault x metric matrix shows the measured values against the budgets.
2. The correct backends (the reference, and compiled Triton or the Triton interpreter
   when they run here) run every selftest case on many seeds and must break none.

Exit 0 only when both hold. `--quick` (CI) runs every fault that fits in memory, the
reference on a few seeds and the interpreter on two; the > 2 GiB pool case runs in the
full selftest on a GPU or with `--large`. `--fault NAME` runs what that fault needs: the
fault on its cases, and the correct backends on those cases only (the summary names them).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
from rich.table import Table

from harness.diff import higher_is_better
from harness.diff.metrics import CHAIN_PREFIX, is_chain
from harness.diff.ops import label as op_label
from harness.errors import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, UsageError
from harness.io import atomic, escape, report
from harness.io.console import rich_console
from harness.run import recheck
from harness.run import shard as S
from harness.run.pipeline import Run
from harness.run.signals import deferred, release
from optimized import BackendUnavailable, get_backend
from optimized import faults as F

SUITE = "selftest"
QUICK_INTERPRET_CASES = ("chain",)
FULL_FAULT_SEEDS = 3           # each fault must be caught on every one of these seeds
SEED_STRIDE = 1000             # seed i of a case is its own seed + i * SEED_STRIDE
# Column order of the matrix: the metrics as the diff engine names them.
METRIC_ORDER = (
    "pooled_max_ulp", "page_bytes_mismatched", "page_bytes_outside_owned_changed",
    "q_bytes_mismatched", "q_scale_bytes_mismatched", "weights_max_ulp", "logits_diff",
    "logits_nonfinite", "logits_inf_pattern_mismatch", "topk_rows_not_exact_frac",
    "topk_recall_min", "topk_padding_errors", "topk_duplicates", "topk_below_threshold",
    "topk_out_of_range", "invariant_violations",
)


# --- what runs -----------------------------------------------------------------------------

def with_seed(case, i: int):
    return case if i == 0 else dataclasses.replace(case, seed=case.seed + i * SEED_STRIDE)


def correct_backends(requested: Optional[list[str]]) -> tuple[list[str], list[str]]:
    """(backends to run, notes on those left out). Default: the reference, plus compiled
    Triton when it runs here, else the Triton interpreter when it does."""
    if requested:
        for name in requested:
            if name.startswith("fault:"):
                raise UsageError(f"--backend: {name} is a fault, not a correct backend")
            get_backend(name)                      # one line naming what is missing
        return list(dict.fromkeys(requested)), []
    names, notes = ["reference"], []
    for name in ("triton", "triton-interpret"):
        try:
            why = get_backend(name, require=False).available()
        except BackendUnavailable as e:
            why = str(e)
        if why is None:
            names.append(name)
            break
        notes.append(f"{name}: {why}")
    return names, notes


def _metric_name(key: str) -> str:
    """`<op>.<metric>` -> metric; the whole-chain comparison keeps its `chain.` prefix."""
    return key if is_chain(key) else key.partition(".")[2]


@dataclasses.dataclass
class FaultResult:
    fault: object                                  # optimized.faults.Fault
    rows: list = dataclasses.field(default_factory=list)
    skipped: str = ""
    eager_rows: list = dataclasses.field(default_factory=list)    # a graph-only fault run eagerly

    @property
    def eager_clean(self) -> Optional[bool]:
        """A graph-only fault's eager runs broke no budget (it is graph-only indeed); None when
        none ran."""
        if not self.eager_rows:
            return None
        return all(r["outcome"] == "ok" and not r["violations"] for r in self.eager_rows)

    @property
    def runs_caught(self) -> list[bool]:
        return [bool(r["violations"]) for r in self.rows]

    @property
    def caught(self) -> Optional[bool]:
        """Every run of the fault broke a budget; None when it did not run."""
        if self.skipped or not self.rows:
            return None
        return all(self.runs_caught)

    @property
    def caught_by(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.rows:
            for v in r["violations"]:
                seen.setdefault(_metric_name(v["metric"]), None)
        return _ordered(seen)

    def worst(self) -> dict[str, dict]:
        """metric -> the violation {metric, value, limit, why, case} furthest on the bad
        side over the fault's runs (NaN counts as the worst)."""
        out: dict[str, dict] = {}
        for r in self.rows:
            for v in r["violations"]:
                name = _metric_name(v["metric"])
                sign = -1.0 if higher_is_better(name.removeprefix(CHAIN_PREFIX)) else 1.0
                bad = float("inf") if v["value"] is None else sign * float(v["value"])
                if name not in out or bad > out[name]["_bad"]:
                    out[name] = {**v, "case": r["selftest_case"], "_bad": bad}
        return out


def _ordered(names) -> list[str]:
    rank = {m: i for i, m in enumerate(METRIC_ORDER)}
    return sorted(names, key=lambda m: (is_chain(m), rank.get(m.removeprefix(CHAIN_PREFIX), 99), m))


# --- the command ---------------------------------------------------------------------------

def run(args, *, seeds: int, interpret_seeds: int) -> int:
    """The selftest of `mxval selftest`'s arguments: `seeds` per case for the correct backends,
    `interpret_seeds` for the Triton interpreter under --quick. The exit status."""
    quick = args.quick
    run = Run("selftest", budgets=args.budgets, shard=args.shard, report_dir=args.report_dir, force=args.force,
              quiet=args.quiet, owner=args)
    cases = {c.name: c for c in run.plan_cases(args.cases_dir, SUITE)}
    faults = _faults(args.fault, cases)
    try:
        backends, notes = correct_backends(args.backend)
    except Exception as e:
        raise UsageError(str(e).splitlines()[0]) from None
    results = {f.name: FaultResult(f) for f in faults}
    # --fault: the correct backends' false-alarm seeds on the named faults' cases only
    correct_cases = [c for c in cases if any(c in f.cases for f in faults)] if args.fault else None
    all_plan = plan(faults, backends, cases, results, seeds=seeds, quick=quick, interpret_seeds=interpret_seeds,
                    large_ok=not quick and (args.large or torch.cuda.is_available()), correct_cases=correct_cases)
    items = run.pick(all_plan, lambda it: S.case_cost(it[2]), _label)
    jobs = run.cap_jobs(args.jobs, max(1, len(items)), "cuda" if torch.cuda.is_available() else "cpu")
    out = run.claim("selftest" + run.shard_suffix())
    groups: dict[str, list] = {}          # backend name -> [(kind, who, case)], run together
    for item in items:
        groups.setdefault(_group(item), []).append(item)
    correct_rows: list[dict] = []
    for item, row in run.execute(list(groups.items()), jobs=jobs, case_timeout=args.case_timeout,
                                 title="selftest", case_of=lambda it: it[2], label=_label):
        kind, who, case = item
        row.update(selftest_case=case.name, seed=case.seed, label=_label(item),
                   violations=run.budgets.check(row.get("metrics") or {}, SUITE, case.name))
        if kind == "fault-eager":
            results[who.name].eager_rows.append(row)
        else:
            (results[who.name].rows if kind == "fault" else correct_rows).append(row)
    verdict = _verdict(results, correct_rows, backends, notes, seeds=seeds, quick=quick, run=run,
                       correct_cases=correct_cases)
    meta = run.meta(backend="faults + " + ", ".join(backends), backend_requested=None,
                    backend_description="fault catalogue (a run passes when a budget catches it) and the "
                                        "correct backends (a run passes when no budget breaks)",
                    device="cuda" if torch.cuda.is_available() else "cpu", seeds=seeds, quick=quick)
    verdict["machine"] = meta["machine"]
    if run.stopped:
        verdict["interrupted"] = True
    shard = run.shard_meta(meta["backend"], [_label(x) for x in all_plan],
                           S.digest([[_label(x) for x in all_plan], S.case_digest(list(cases.values()))]),
                           [_label(x) for x in items])
    if shard:
        meta["shard"] = shard
        verdict["shard"] = {"k": shard["k"], "n": shard["n"]}
    if not args.quiet:
        print_matrix(results, run.budgets, verdict, backends, correct_rows)
    md = markdown(results, run.budgets, verdict, meta)
    late = write_report(out, results, correct_rows, verdict, meta, md, run)
    for path, text in ((args.json, json.dumps(verdict, indent=1, default=str) + "\n"), (args.markdown, md)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(path, text)
    late += release()                         # the hold `run.execute` took: the report is whole now
    print(_summary_line(results, verdict, correct_rows, backends, len(items), len(all_plan), run)
          + f"; reports: {escape.terminal(str(out))}/")
    run.note_moved()
    if late and not run.stopped:
        print(f"mxval: {late[0]} once the reports were written: the run had finished", file=sys.stderr)
    if run.stopped:
        print(f"mxval: interrupted: partial selftest report ({run.stopped['cases_done']} run(s) finished, "
              f"{len(run.stopped['cancelled'])} cancelled)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK if verdict["ok"] else EXIT_FAIL


def _faults(names: Optional[list[str]], cases: dict) -> list:
    """The faults to run (all, or those named), each with its cases in the selftest suite."""
    faults = list(F.FAULTS.values())
    if names:
        unknown = [n for n in names if n not in F.FAULTS]
        if unknown:
            raise UsageError(f"--fault: unknown fault(s) {', '.join(unknown)} (known: {', '.join(F.FAULTS)})")
        faults = [F.FAULTS[n] for n in names]
    for f in faults:
        missing = [c for c in f.cases if c not in cases]
        if missing:
            raise UsageError(f"fault {f.name}: case(s) {', '.join(missing)} not in the {SUITE} suite")
    return faults


def plan(faults, backends, cases: dict, results: dict, *, seeds: int, quick: bool, interpret_seeds: int,
         large_ok: bool, correct_cases: Optional[list] = None) -> list:
    """[(kind, fault or backend name, case)]: every fault on the cases that expose it, then
    each correct backend on every case (or only on `correct_cases`) and seed. A large fault
    left out is noted in `results`."""
    large_cases = {c for f in F.FAULTS.values() if f.large for c in f.cases}
    fault_seeds = 1 if quick else FULL_FAULT_SEEDS
    out: list[tuple[str, object, object]] = []
    for f in faults:
        if f.large and not large_ok:
            results[f.name].skipped = ("needs a pool or logits buffer past 2 GiB: runs in the full selftest "
                                       "on a GPU, or with --large" + (" (not with --quick)" if quick else ""))
            continue
        if f.graph and not torch.cuda.is_available():
            results[f.name].skipped = "graph-only: caught when replayed from a CUDA/HIP graph, on a GPU"
            continue
        for name in f.cases:
            for i in range(1 if name in large_cases else fault_seeds):
                out.append(("fault", f, with_seed(cases[name], i)))
            if f.graph:              # graph-only: the same case run eagerly must pass
                out.append(("fault-eager", f, dataclasses.replace(cases[name], graph=False)))
    scale = scale_cases()
    for be in backends:
        interp = be == "triton-interpret" and quick
        n = min(seeds, interpret_seeds) if interp else seeds
        for name, c in cases.items():
            if correct_cases is not None and name not in correct_cases:
                continue
            if name in large_cases:
                if large_ok:
                    out.append(("correct", be, c))       # one seed: 2 GiB per run
                continue
            if interp and name not in QUICK_INTERPRET_CASES:
                continue
            # --quick: the scale cases (thousands of rows) once each, the others on every seed
            out += [("correct", be, with_seed(c, i)) for i in range(1 if quick and name in scale else n)]
    return out


def scale_cases() -> set:
    """Cases only the field's faults use (their sizes: thousands of rows, rows of 16k entries)."""
    field = {c for f in F.FAULTS.values() if f.source for c in f.cases}
    return field - {c for f in F.FAULTS.values() if not f.source for c in f.cases}


def _verdict(results: dict, correct_rows: list, backends, notes, *, seeds: int, quick: bool, run: Run,
             correct_cases: Optional[list] = None) -> dict:
    false_alarms = [r for r in correct_rows if _alarm(r)]
    skipped_correct = [r for r in correct_rows if r["outcome"] == "skipped"]
    uncaught = [res.fault.name for res in results.values() if res.caught is False]
    uncaught += [res.fault.name for res in results.values() if res.eager_clean is False]
    return {
        "faults": [_fault_json(res) for res in results.values()],
        "seeds": seeds,
        "false_alarms": len(false_alarms),
        "correct_runs": {be: sum(1 for r in correct_rows if r["backend"] == be and r["outcome"] != "skipped")
                         for be in backends},
        "false_alarm_runs": [{"backend": r["backend"], "case": r["selftest_case"], "seed": r["seed"],
                              "outcome": r["outcome"], "reason": r.get("reason", ""),
                              "violations": r["violations"]} for r in false_alarms],
        "left_out": notes + [f"{r['backend']} on {r['selftest_case']}: {r['reason']}" for r in skipped_correct],
        "quick": quick,
        "correct_cases": correct_cases,          # None: every case of the suite
        "correct_rows": len(correct_rows),
        "budgets_off": run.budgets.disabled(run.keys, SUITE),
        # a shard may hold no correct run; the merge asks for one over the whole run
        "ok": not uncaught and not false_alarms and (bool(correct_rows) or run.part is not None)
              and not run.stopped,
    }


def _summary_line(results: dict, verdict: dict, correct_rows, backends, n_items: int, n_all: int, run: Run) -> str:
    uncaught = [res.fault.name for res in results.values() if res.caught is False]
    not_run = sum(1 for r in results.values() if r.caught is None)
    runs = len(correct_rows) - sum(1 for r in correct_rows if r["outcome"] == "skipped")
    return (f"selftest: {sum(1 for r in results.values() if r.caught)}/{len(results)} faults caught"
            + (f", {not_run} not run" if not_run else "")
            + (f" (NOT caught: {', '.join(uncaught)})" if uncaught else "")
            + "".join(f"; {r.fault.name} caught EAGERLY too (not graph-only)" for r in results.values()
                      if r.eager_clean is False)
            + f"; {verdict['false_alarms']} false alarm(s) in {runs} correct runs "
            f"({', '.join(backends)}; {verdict['seeds']} seeds"
            + (f"; on the faults' cases only: {', '.join(verdict['correct_cases'])}"
               if verdict.get("correct_cases") is not None else "") + ")"
            + (f"; shard {run.part[0]}/{run.part[1]}: {n_items} of {n_all} runs" if run.part else ""))


def _label(item) -> str:
    """A plan item's name in the report (unique within a run: case, seed, and fault or backend)."""
    kind, who, case = item
    return f"{case.name} [seed {case.seed}] " + (f"x {who.name}" if kind == "fault" else f"x {who.name} (eager)"
                                                 if kind == "fault-eager" else f"on {who}")


def _group(item) -> str:
    kind, who, _ = item
    return who if kind == "correct" else who.backend_name


def _alarm(row: dict) -> bool:
    """A correct run that breaks a budget or does not finish (skips are listed, not alarms).
    A case that plants non-finite inputs finishes as `nonfinite_input`: an alarm only when a
    budget breaks (an invariant on those inputs) or the case does not declare them."""
    if row["outcome"] == "nonfinite_input":
        return not row.get("expect_nonfinite") or bool(row["violations"])
    return row["outcome"] != "skipped" and (row["outcome"] != "ok" or bool(row["violations"]))


def _fault_json(res: FaultResult) -> dict:
    f = res.fault
    worst = res.worst()
    return {"name": f.name, "bug_class": f.bug_class, "source": f.source,
            "caught": res.caught, "caught_by": res.caught_by,
            "ops": list(f.ops), "cases": list(f.cases), "description": f.description,
            "runs": len(res.rows), "runs_caught": sum(res.runs_caught),
            "values": {m: {"value": w["value"], "limit": w["limit"], "metric": w["metric"], "case": w["case"]}
                       for m, w in worst.items()},
            "outcomes": sorted({r["outcome"] for r in res.rows}),
            **({"graph": True, "eager_runs": len(res.eager_rows), "eager_clean": res.eager_clean} if f.graph else {}),
            **({"skipped": res.skipped} if res.skipped else {})}


# --- the matrix ------------------------------------------------------------------------------

def matrix_columns(results: dict[str, FaultResult]) -> list[str]:
    """Metrics that caught a fault. A whole-chain metric gets a column only where it caught
    a fault that its per-stage twin did not (it mostly repeats the stage's verdict)."""
    cols: dict[str, None] = {}
    for res in results.values():
        by = set(res.caught_by)
        for m in res.caught_by:
            if not is_chain(m) or m.removeprefix(CHAIN_PREFIX) not in by:
                cols.setdefault(m, None)
    return _ordered(cols)




def _limit_text(budgets, metric: str, case: str = "") -> str:
    key = metric if is_chain(metric) else f"x.{metric}"
    lim = budgets.limit(key, SUITE, case)
    return lim.text() if lim else "none"


def _short(metric: str) -> str:
    """Console column heads: narrow enough for one screen."""
    return (metric.replace("page_bytes_", "page ").replace("outside_owned_changed", "outside")
            .replace("_bytes_mismatched", "≠").replace("_mismatched", "≠").replace("_", " ")
            .replace(CHAIN_PREFIX, "chain "))


def _val(v) -> str:
    if v is None:
        return "nan"
    if isinstance(v, (int, float)) and (abs(v) >= 1e6 or not float(v).is_integer()):
        return f"{v:.3g}"
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def _status(res: FaultResult) -> str:
    if res.caught is None:
        return "not run"
    if getattr(res, "eager_clean", None) is False:
        return "caught EAGERLY too (not graph-only)"
    if res.caught and getattr(res.fault, "graph", False):
        return "caught when replayed; passes eagerly"
    return "caught" if res.caught else f"NOT caught ({sum(res.runs_caught)}/{len(res.rows)} runs)"


def print_matrix(results, budgets, verdict, backends, correct_rows, console=None) -> None:
    con = console or rich_console()
    if not con.is_terminal:
        con = rich_console(width=max(con.width, 200))        # CI logs: keep the matrix on one line per fault
    cols = matrix_columns(results)
    t = Table(title="mxval selftest: fault x metric (worst value over the fault's runs; "
                    "red = past its budget)", show_lines=False)
    t.add_column("fault", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    for m in cols:
        t.add_column(f"{_short(m)}\n{_limit_text(budgets, m)}", justify="right", overflow="fold")
    t.add_column("op", no_wrap=True)
    for res in results.values():
        worst = res.worst()
        style = {"caught": "green", "not run": "yellow"}.get(_status(res), "bold red")
        cells = [f"[bold red]{_val(worst[m]['value'])}[/]" if m in worst else "[dim]·[/]" for m in cols]
        t.add_row(res.fault.name, f"[{style}]{_status(res)}[/]", *cells,
                  ", ".join(op_label(o) for o in res.fault.ops))
    con.print(t)
    for res in results.values():
        if res.skipped:
            con.print(f"[yellow]not run:[/] {res.fault.name}: {res.skipped}")
        for r in res.rows:
            if r["outcome"] != "ok":
                con.print(f"[dim]{res.fault.name} on {r['selftest_case']}: {r['outcome']}: {r['reason']}[/]")
    c = Table(title=f"correct backends: {verdict['seeds']} seeds per case")
    for col in ("backend", "runs", "false alarms", "seconds", "first alarm"):
        c.add_column(col, overflow="fold")
    for be in backends:
        rows = [r for r in correct_rows if r["backend"] == be and r["outcome"] != "skipped"]
        bad = [r for r in rows if _alarm(r)]
        first = ""
        if bad:
            b = bad[0]
            first = f"{b['selftest_case']} seed {b['seed']}: " + (b["reason"] or "; ".join(
                f"{v['metric']} {v['why']}" for v in b["violations"][:3]))
        c.add_row(be, str(len(rows)), f"[{'bold red' if bad else 'green'}]{len(bad)}[/]",
                  f"{sum(r.get('seconds', 0) for r in rows):.1f}", first)
    con.print(c)
    for n in verdict["left_out"]:
        con.print(f"[yellow]left out:[/] {n}")


def markdown(results, budgets, verdict, meta) -> str:
    """The matrix for README.md (`make readme-matrix`) and the report directory."""
    cols = matrix_columns(results)
    n_faults = len(results)
    n_caught = sum(1 for r in results.values() if r.caught)
    lines = ["Every fault below is a backend built from the reference with one bug in it "
             "(`optimized/faults.py`): bugs invented here, and bugs that shipped, each modelled at the "
             "size where it appeared and named with its source; `mxval selftest` runs each on the cases that can expose it "
             "and reports the worst value of every metric that broke its budget "
             "(`cases/budgets.toml`; `·` = within budget).",
             "",
             f"**{n_caught}/{n_faults} faults caught; {verdict['false_alarms']} false alarms** in "
             + ", ".join(f"{n} runs of `{be}`" for be, n in verdict["correct_runs"].items())
             + f" ({verdict['seeds']} seeds per case{', --quick' if verdict['quick'] else ''}"
             + (f"; on the faults' cases only: {', '.join(verdict['correct_cases'])}"
                if verdict.get("correct_cases") is not None else "") + ") "
             f"on {meta['machine']}.",
             "",
             ]
    graph = [r for r in results.values() if getattr(r.fault, "graph", False)]
    field = [r for r in results.values() if r.fault.source and r not in graph]
    invented = [r for r in results.values() if not r.fault.source and r not in graph]
    for title, group, source in (("Faults invented here (NUMERICS.md §10)", invented, False),
                                 ("Bugs that shipped, each modelled on its source (NUMERICS.md §10)", field, True),
                                 ("Graph-only faults: correct eagerly, wrong only when replayed from a CUDA/HIP graph "
                                  "(`mxval validate --graph`; each is also run eagerly, which must pass)", graph,
                                  False)):
        if not group:
            continue
        lines += [f"#### {title}", "",
                  "| fault | " + ("source | " if source else "") + "bug class | op | verdict | " + " | ".join(
                      f"`{m}` ({_limit_text(budgets, m)})" for m in cols) + " |",
                  "|---|" + ("---|" if source else "") + "---|---|---|" + "---:|" * len(cols)]
        for res in group:
            worst = res.worst()
            ops = ", ".join(op_label(o) for o in res.fault.ops)
            src = f"{_source_link(res.fault.source)} | " if source else ""
            lines.append(f"| `{res.fault.name}` | {src}{res.fault.bug_class} | {ops} | {_status(res)} | "
                         + " | ".join(f"**{_val(worst[m]['value'])}**" if m in worst else "·" for m in cols)
                         + " |")
        lines.append("")
    lines += [f"- Not modelled: {_source_link(src)}: {why}." for src, why in F.NOT_MODELLED.items()]
    if verdict.get("budgets_off"):
        lines += ["", "Checks turned off by the budgets file: " + "; ".join(f"`{x}`" for x in verdict["budgets_off"])
                  + "."]
    skipped = [r for r in results.values() if r.skipped]
    if skipped:
        lines.append("")
        lines += [f"- `{r.fault.name}` not run here: {r.skipped}." for r in skipped]
    lines += ["", "Regenerate with `make readme-matrix`."]
    return "\n".join(lines) + "\n"


def _source_link(source: str) -> str:
    """`owner/repo#N` -> a Markdown link to the issue or pull request (GitHub redirects)."""
    repo, _, num = source.partition("#")
    return f"[{source}](https://github.com/{repo}/issues/{num})" if num else source


def write_report(out: Path, results, correct_rows, verdict, meta, md, run: Run) -> None:
    """The usual report files (report.json/.md/.html, junit.xml, metrics.csv) over every run,
    plus selftest.md and selftest.json. A fault run passes when a budget catches it."""
    rows = []
    for res in results.values():
        for r in res.rows:
            rr = dict(r)
            rr["case"] = r.get("label") or f"{r['selftest_case']} [seed {r['seed']}] x {res.fault.name}"
            rr["description"] = f"fault {res.fault.name}: {res.fault.description}"
            caught = bool(r["violations"])
            rr["ok"] = caught
            rr["status"] = "pass" if caught else "fail"
            rr["reason"] = ("caught by " + ", ".join(sorted({v['metric'] for v in r["violations"]}))
                            if caught else "NOT caught: no budget broke")
            rows.append(rr)
        for r in res.eager_rows:             # a graph-only fault run eagerly: passes when nothing breaks
            rr = dict(r)
            rr["case"] = r.get("label") or f"{r['selftest_case']} x {res.fault.name} (eager)"
            rr["description"] = f"graph-only fault {res.fault.name}, run eagerly: {res.fault.description}"
            clean = r["outcome"] == "ok" and not r["violations"]
            rr["ok"], rr["status"] = clean, "pass" if clean else "fail"
            rr["reason"] = "eager run clean: the fault shows only when replayed" if clean else \
                "caught eagerly: not a graph-only fault (" + (r.get("reason") or ", ".join(
                    sorted({v['metric'] for v in r["violations"]}))) + ")"
            rows.append(rr)
    for r in correct_rows:
        rr = dict(r)
        rr["case"] = r.get("label") or f"{r['selftest_case']} [seed {r['seed']}] on {r['backend']}"
        alarm = _alarm(r)
        rr["ok"] = not alarm
        rr["status"] = "skipped" if r["outcome"] == "skipped" else (
            ("error" if r["outcome"] == "error" else "fail") if alarm else "pass")
        if r["violations"] and not rr.get("reason"):
            rr["reason"] = "; ".join(f"{v['metric']} {v['why']}" for v in r["violations"][:3])
        rows.append(rr)
    df = report.frame(rows)
    meta = dict(meta, budgets=run.budgets.as_dict(), budgets_off=verdict.get("budgets_off", []), selftest=verdict)

    def on_signal(m: dict) -> None:          # a signal before the set was written: it says so
        verdict["interrupted"] = True
        extra["selftest.json"] = json.dumps(verdict, indent=1, default=str) + "\n"
        run.stopped = m["interrupted"]
    extra = {"selftest.md": md, "selftest.json": json.dumps(verdict, indent=1, default=str) + "\n"}
    with deferred() as late:                  # a Ctrl-C now waits until the report is whole
        run.write(df, meta, extra=extra, on_signal=on_signal, console=False)
    return late


# --- merging the verdicts of `--shard K/N` runs (mxval report --merge) ----------------------

def merge_verdicts(verdicts: list[dict]) -> dict:
    """One selftest verdict from the shards' selftest.json verdicts: a fault is caught when
    every one of its runs, in whichever shard, broke a budget; the worst value per metric
    over all of them; false alarms and correct runs summed."""
    faults: dict[str, dict] = {}
    for v in verdicts:
        for f in v.get("faults") or []:
            m = faults.setdefault(f["name"], {**f, "runs": 0, "runs_caught": 0, "caught_by": [],
                                              "values": {}, "outcomes": []})
            m["runs"] += int(f.get("runs") or 0)
            m["runs_caught"] += int(f.get("runs_caught") or 0)
            m["caught_by"] = _ordered(set(m["caught_by"]) | set(f.get("caught_by") or []))
            m["outcomes"] = sorted(set(m["outcomes"]) | set(f.get("outcomes") or []))
            if f.get("graph") and f.get("eager_clean") is not None:      # False in any shard wins
                m["eager_clean"] = f["eager_clean"] and m.get("eager_clean") is not False
            for metric, w in (f.get("values") or {}).items():
                sign = -1.0 if higher_is_better(metric.removeprefix(CHAIN_PREFIX)) else 1.0

                def bad(x):
                    return float("inf") if x["value"] is None else sign * float(x["value"])
                if metric not in m["values"] or bad(w) > bad(m["values"][metric]):
                    m["values"][metric] = w
    for m in faults.values():
        m["caught"] = None if m["runs"] == 0 else m["runs_caught"] == m["runs"]
        if m["runs"]:
            m.pop("skipped", None)
    first = verdicts[0] if verdicts else {}
    correct: dict[str, int] = {}
    for v in verdicts:
        for be, n in (v.get("correct_runs") or {}).items():
            correct[be] = correct.get(be, 0) + int(n)
    left_out = list(dict.fromkeys(x for v in verdicts for x in v.get("left_out") or []))
    out = {"faults": list(faults.values()), "seeds": first.get("seeds"),
           "false_alarms": sum(int(v.get("false_alarms") or 0) for v in verdicts),
           "correct_runs": correct,
           "false_alarm_runs": [r for v in verdicts for r in v.get("false_alarm_runs") or []],
           "left_out": left_out, "quick": first.get("quick"), "budgets_off": first.get("budgets_off", []),
           "correct_cases": first.get("correct_cases"),
           "correct_rows": sum(int(v.get("correct_rows") or 0) for v in verdicts),
           "machine": "; ".join(sorted({str(v.get("machine")) for v in verdicts})),
           "merged_shards": len(verdicts)}
    out["ok"] = (not any(f["caught"] is False or f.get("eager_clean") is False for f in faults.values())
                 and out["false_alarms"] == 0
                 and out["correct_rows"] > 0)
    return out


class _MergedResult:
    """A merged fault verdict with the face `markdown` reads (a FaultResult's)."""

    def __init__(self, f: dict):
        self.fault = SimpleNamespace(name=f["name"], bug_class=f.get("bug_class", ""), ops=f.get("ops") or [],
                                     source=f.get("source", ""), graph=f.get("graph", False),
                                     description=f.get("description", ""))
        self.eager_clean = f.get("eager_clean")
        self.caught = f["caught"]
        self.caught_by = list(f.get("caught_by") or [])
        self.rows = [None] * int(f.get("runs") or 0)
        self.runs_caught = [True] * int(f.get("runs_caught") or 0) + [False] * (len(self.rows) - int(f.get("runs_caught") or 0))
        self.skipped = f.get("skipped", "")
        self._values = f.get("values") or {}

    def worst(self) -> dict:
        return self._values


def merged_extras(out: Path, df, meta: dict) -> dict[str, str]:
    """selftest.json and selftest.md of a merged selftest report (written with its set)."""
    verdict = meta["selftest"]
    budgets = recheck.recorded_budgets(meta, str(out / "report.json"))     # the limits the run judged by
    results = {f["name"]: _MergedResult(f) for f in verdict["faults"]}
    md = markdown(results, budgets, verdict, {"machine": verdict.get("machine", "")})
    return {"selftest.md": md, "selftest.json": json.dumps(verdict, indent=1, default=str) + "\n"}
