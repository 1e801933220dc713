"""`mxval study` as one call: run (or re-render) a study and write its reports."""
from __future__ import annotations

import datetime
import os
import resource
import sys
import time
from pathlib import Path

import torch
from rich.progress import Progress

from harness.errors import EXIT_INTERRUPTED, EXIT_OK, StudyConfigError
from harness.io import atomic, escape, report_shape, safe_input
from harness.run.record import machine
from harness.run.signals import hold, pending, release, stopped_by
from harness.study import report
from harness.study.core import STUDY_FILE, load_config, run_study, study_dump
from reference.formats import preset


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children: the study's workers."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _partial(meta: dict) -> str:
    """The title's mark of a study stopped by Ctrl-C/SIGTERM (its finished contexts only)."""
    i = meta.get("interrupted") if isinstance(meta, dict) else None
    if not isinstance(i, dict):
        return ""
    return f" (interrupted by {i.get('signal', 'SIGINT')}: partial, {i.get('cases_done', 0)} context(s) finished)"


def _claim(report_dir, name: str, force: bool) -> Path:
    """The study's report directory, claimed before any work as validate's is (harness/io/report.py
    `claim_dir`): one holding another run's report (a report.json, selftest.json or study.json)
    is refused without --force; none given: a fresh reports/study-<name>-<time>-<pid>."""
    from harness.io import report as run_report
    if report_dir:
        return run_report.claim_dir(report_dir, force=force)
    return run_report.claim_dir(run_report.default_dir(f"study-{name}"))


def _write(result: dict, meta: dict, out: Path, readme: str | None, *, stopped=None) -> int:
    """The study's reports as one set. A signal held since the work ended is recorded in them
    before they are written (or, come during the writing, they are written again, marked): the
    files and the exit status agree."""
    def late_signal() -> bool:
        got = pending()
        if not got or meta.get("interrupted"):
            return False
        done = len({(r.get("distribution"), r.get("seed"), r.get("context_tokens")) for r in result["rows"]})
        meta["interrupted"] = {"signal": got[0], "cases_done": done, "cancelled": []}
        return True

    def render() -> dict:
        title = f"mxval study: {meta.get('study', '?')}{_partial(meta)}"
        try:
            return report.render(result, out, title=title, meta=meta)
        except OSError as e:
            raise StudyConfigError(f"{escape.terminal(str(out))}: cannot write the study's reports: "
                                   f"{e.strerror or e}; nothing replaced") from None
    recorded = late_signal()
    paths = render()
    if late_signal():
        recorded, paths = True, render()
    md = report.summary_markdown(result, meta)
    late = release()
    print(escape.terminal(md, lines=True))
    print(f"\nreports: {escape.terminal(', '.join(paths.values()))}")
    if stopped or recorded:
        print(f"mxval: interrupted: partial study report ({len(result['rows'])} row(s) kept; re-render with "
              f"`mxval study --from-json {escape.terminal(str(out / 'study.json'))}`)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if late:
        print(f"mxval: {late[0]} once the reports were written: the study had finished", file=sys.stderr)
    if readme:
        atomic.write_text(readme, md + "\n")
    return EXIT_OK


def execute(*, study: str = "default", study_file: str | Path = STUDY_FILE, dumps=(), device: str | None = None,
            report_dir: str | None = None, readme: str | None = None, from_json: str | None = None,
            jobs: int | None = None, force: bool = False) -> int:
    """Run the named study (or study captured dumps, or re-render a saved study.json), write
    study.{json,md,html,csv} and study-needles.csv, print the summary; -> the exit status."""
    if from_json:
        given = [f for f, v in (("--dump", dumps), ("--device", device)) if v]
        if given:
            raise StudyConfigError(f"{given[0]}: not with --from-json (it re-renders a saved study, running nothing)")
        return rerender(from_json, report_dir=report_dir, readme=readme, force=force)
    cfg = load_config(study, Path(study_file))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.partition(":")[0] not in ("cpu", "cuda"):
        raise StudyConfigError(f"--device: expected cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StudyConfigError(f"--device: {device} requested but torch sees no CUDA/ROCm GPU")
    jobs = min(2, os.cpu_count() or 1) if jobs is None else jobs
    if jobs < 1:
        raise StudyConfigError(f"--jobs: expected a positive count, got {jobs}")
    out = _claim(report_dir, cfg.name, force)
    t0, c0, c0_children, load0 = time.time(), time.process_time(), _children_cpu(), _load()
    if dumps:
        parts = []
        try:
            for path in dumps:
                parts.append(study_dump(path, cfg, device=device))
            stopped = None
        except KeyboardInterrupt:               # the dumps studied so far are the report
            stopped = {"signal": stopped_by(), "cases_done": len(parts), "cancelled": list(dumps[len(parts):])}
        result = {k: sum((p[k] for p in parts), []) for k in ("rows", "needles", "inputs")}
        result["merges"] = {}
        if stopped:
            result["interrupted"] = stopped
    else:
        total = len(cfg.distributions) * len(cfg.seed_list)
        with Progress(transient=True) as bar:
            task = bar.add_task(f"study {cfg.name}", total=total)
            result = run_study(cfg, device=device, progress=lambda: bar.advance(task), jobs=jobs)
    hold()                                    # from here a Ctrl-C waits until the report is whole
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    stopped = result.pop("interrupted", None)
    p = preset(cfg.model)
    meta = {"study": cfg.name, "machine": machine(device), "device": device,
            "seconds": time.time() - t0,
            "cpu_seconds": time.process_time() - c0 + _children_cpu() - c0_children,
            "threads": torch.get_num_threads(), "jobs": jobs if device == "cpu" and not dumps else 1, "when": datetime.date.today().isoformat(),
            "load_before": load0, "load_after": _load(),
            "topk": p.topk, "rows": cfg.rows, "seeds": cfg.seed_list, "heads": cfg.heads or p.index_heads,
            "contexts": sorted(set(cfg.context_tokens)), "compress_ratio": p.compress_ratio,
            "query_spread": cfg.query_spread,
            "distributions": [d.name for d in cfg.distributions] if not dumps else list(dumps),
            "distribution_fields": {d.name: report.distribution_fields(d) for d in cfg.distributions},
            "needle_depths": cfg.needle_depths, "needle_margins": cfg.needle_margins,
            "tolerance": cfg.tolerance, "dump": bool(dumps)}
    if stopped:
        meta["interrupted"] = stopped
    return _write(result, meta, out, readme, stopped=stopped)


def rerender(from_json: str, *, report_dir: str | None = None, readme: str | None = None, force: bool = False) -> int:
    """A saved study.json re-rendered: read through the bounds of every input file and checked
    for study.json's shape (harness/io/report_shape.py) before anything renders it."""
    try:
        saved = safe_input.load_json(from_json, error=StudyConfigError)
    except StudyConfigError as e:
        raise StudyConfigError(f"--from-json: not a study.json ({e})") from None
    report_shape.check_study(saved, f"--from-json: {from_json}", error=StudyConfigError)
    meta = saved["meta"]
    result = {k: saved[k] for k in ("rows", "needles", "inputs", "merges")}
    src = Path(from_json).parent
    same = report_dir is None or (Path(report_dir).exists() and os.path.samefile(report_dir, src))
    out = src if same else _claim(report_dir, str(meta.get("study", "study")), force)   # in place: its own
    return _write(result, meta, out, readme)
