"""`mxval study`: the arguments; the study lives in harness/study."""
from __future__ import annotations

from harness.study.command import execute
from harness.study.core import STUDY_FILE


def add_parser(sub) -> None:
    ap = sub.add_parser("study", help="what MXFP4's selection keeps against FP8 and exact: attention mass, "
                                      "top-m, miss ranks, recall, over-selection, needles; bootstrap intervals "
                                      "over seeds")
    ap.add_argument("--study", default="default", help="study name in cases/study.toml")
    ap.add_argument("--study-file", default=str(STUDY_FILE))
    ap.add_argument("--dump", action="append", default=[], metavar="FILE",
                    help="study captured activations (a dump from `mxval dump` or the capture hook) "
                         "instead of generated ones; repeatable")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="worker processes on the CPU, one thread each (default: 2, or 1 on one core)")
    ap.add_argument("--report-dir", default=None,
                    help="where the study's reports go (default: a fresh reports/study-<name>-<time>-<pid>/)")
    ap.add_argument("--force", action="store_true",
                    help="replace the report of another run in --report-dir (refused without it)")
    ap.add_argument("--readme", default=None, help="also write the README summary section to this file")
    ap.add_argument("--from-json", default=None, metavar="STUDY_JSON",
                    help="re-render the reports of a saved study.json (its run's numbers and machine) instead of running")


def run(args) -> int:
    return execute(study=args.study, study_file=args.study_file, dumps=args.dump, device=args.device,
                   report_dir=args.report_dir, readme=args.readme, from_json=args.from_json,
                   jobs=args.jobs, force=args.force)
