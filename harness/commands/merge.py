"""`mxval report --merge DIR... [--report-dir OUT]`: the reports of the shards of one run
(`--shard K/N` on several machines) combined into the report the unsharded run writes,
in every format, with the same verdict and exit status.

Refused with one line (exit 2) when the shards do not make up one run: a directory that
is not a shard report, an interrupted shard, shards of different commands, suites,
backends, budgets, case lists, shard counts or mxval versions, a shard given twice or two
shards sharing a case (overlap), a shard or a case missing.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.errors import EXIT_FAIL, EXIT_OK, ReportError, UsageError
from harness.io import escape, report
from harness.run import recheck, selftest
from harness.run.pipeline import Run

# run.shard fields every shard must agree on, and what to call them in the message
AGREE = (("command", "commands"), ("suite", "suites"), ("backend", "backends"),
         ("budgets_digest", "budgets"), ("mxval_version", "mxval versions"),
         ("cases_digest", "case lists"), ("n", "shard counts"))


class MergeError(ReportError):
    """Shard reports that do not make up one run."""


def load_shards(dirs: list, budgets=None) -> list[tuple[Path, object, dict]]:
    out = []
    for d in dirs:
        df, meta = report.load(d)
        recheck.check_frame(df, meta, Path(d) / "report.json",       # each shard's verdicts recomputed
                            budgets=budgets)
        sh = meta.get("shard")
        if not isinstance(sh, dict):
            raise MergeError(f"{Path(d) / 'report.json'}: not a shard report (run with --shard K/N to merge it)")
        _check_identity(Path(d) / "report.json", sh)
        if meta.get("interrupted"):
            raise MergeError(f"{Path(d) / 'report.json'}: shard {sh.get('k')}/{sh.get('n')} was interrupted "
                             f"(a partial report cannot be merged)")
        out.append((Path(d), df, meta))
    return out


def _check_identity(where: Path, sh: dict) -> None:
    """A hand-edited or foreign run.shard block is one line, not an internal error."""
    k, n = sh.get("k"), sh.get("n")
    if not (type(k) is int and type(n) is int and 1 <= k <= n):
        raise MergeError(f"{where}: run.shard: k and n must be integers with 1 <= k <= n, got k={k!r}, n={n!r}")
    for key in ("all_cases", "cases"):
        v = sh.get(key)
        if not (isinstance(v, list) and all(isinstance(c, str) for c in v)):
            raise MergeError(f"{where}: run.shard.{key}: expected a list of case names, got {type(v).__name__}")


def check(shards: list[tuple[Path, object, dict]]) -> None:
    """MergeError unless the shards are exactly the N shards of one run."""
    first_dir, _, first = shards[0]
    f = first["shard"]
    for key, what in AGREE:
        for d, _, meta in shards[1:]:
            if meta["shard"].get(key) != f.get(key):
                raise MergeError(f"--merge: shards from different {what}: {first_dir} has "
                                 f"{f.get(key)!r}, {d} has {meta['shard'].get(key)!r}")
    for d, _, meta in shards:                  # a list naming a case twice is no run's list
        for key in ("all_cases", "cases"):
            names = meta["shard"].get(key) or []
            if not (isinstance(names, list) and all(isinstance(c, str) for c in names)):
                raise MergeError(f"{d / 'report.json'}: run.shard.{key}: expected a list of case names")
            seen_names: set = set()
            twice = next((c for c in names if c in seen_names or seen_names.add(c)), None)
            if twice is not None:
                raise MergeError(f"{d / 'report.json'}: run.shard.{key} lists case {twice!r} twice")
    n = int(f["n"])
    seen: dict[int, Path] = {}
    for d, _, meta in shards:
        k = int(meta["shard"]["k"])
        if k in seen:
            raise MergeError(f"--merge: shards overlap: shard {k}/{n} given twice ({seen[k]} and {d})")
        seen[k] = d
    owner: dict[str, Path] = {}
    for d, df, meta in shards:
        for name in df["case"]:
            if name in owner:
                raise MergeError(f"--merge: shards overlap: case {name!r} is in {owner[name]} and {d}")
            owner[name] = d
        listed = set(meta["shard"].get("cases") or [])
        if set(df["case"]) != listed:
            extra = sorted(set(df["case"]) ^ listed)
            raise MergeError(f"{d / 'report.json'}: its rows differ from its shard's case list ({extra[0]!r})")
    missing_k = [k for k in range(1, n + 1) if k not in seen]
    if missing_k:
        raise MergeError(f"--merge: shard(s) {', '.join(f'{k}/{n}' for k in missing_k)} missing "
                         f"(given: {', '.join(f'{k}/{n}' for k in sorted(seen))})")
    all_cases = list(f.get("all_cases") or [])
    lost = [c for c in all_cases if c not in owner]
    if lost:
        raise MergeError(f"--merge: {len(lost)} case(s) of the run in no shard, e.g. {lost[0]!r}")
    stray = [c for c in owner if c not in set(all_cases)]
    if stray:
        raise MergeError(f"--merge: case {stray[0]!r} ({owner[stray[0]]}) is not in the run's case list")


def merge(shards: list[tuple[Path, object, dict]]):
    """(DataFrame in the unsharded run's case order, run meta) of checked shards."""
    check(shards)
    shards = sorted(shards, key=lambda s: int(s[2]["shard"]["k"]))
    order = {c: i for i, c in enumerate(shards[0][2]["shard"]["all_cases"])}
    df = pd.concat([s[1] for s in shards], ignore_index=True, sort=False)
    df = df.iloc[df["case"].map(order).argsort(kind="stable")].reset_index(drop=True)
    first = shards[0][2]
    meta = {k: v for k, v in first.items() if k not in ("shard", "cases", "seconds", "machine", "started", "argv")}
    if first.get("command") != "selftest":
        meta["cases"] = list(first["shard"]["all_cases"])
    meta["started"] = min(str(m.get("started", "")) for _, _, m in shards)
    meta["seconds"] = max(float(m.get("seconds") or 0) for _, _, m in shards)      # wall: shards in parallel
    machines = sorted({str(m.get("machine", "")) for _, _, m in shards})
    meta["machine"] = machines[0] if len(machines) == 1 else "; ".join(machines)
    meta["merged_from"] = [{"dir": str(d), "k": m["shard"]["k"], "n": m["shard"]["n"],
                            "machine": m.get("machine"), "started": m.get("started"),
                            "seconds": m.get("seconds"), "cases": len(df_)} for d, df_, m in shards]
    # budgets_off comes from the first shard: each shard derives it from the whole run's cases
    if first.get("command") == "selftest":
        meta["selftest"] = selftest.merge_verdicts([m.get("selftest") or {} for _, _, m in shards])
    return df, meta


def run(args) -> int:
    """`mxval report --merge DIR...`: the checked shards written as one run's report."""
    if args.dir is not None:
        raise UsageError(f"report: give either DIR or --merge DIR..., not both ({args.dir!r})")
    shards = load_shards(args.merge, getattr(args, "budgets", None))
    df, meta = merge(shards)
    out = Run("merge", report_dir=args.report_dir, force=args.force, quiet=args.quiet, owner=args)
    out.claim(f"merged-{meta.get('command', 'run')}-{meta.get('suite', '')}")
    extra = selftest.merged_extras(out.out, df, meta) if meta.get("command") == "selftest" else None
    paths = out.write(df, meta, extra=extra)
    ok = report.summary(df, meta)["ok"]
    if meta.get("command") == "selftest":
        ok = ok and bool(meta["selftest"].get("ok"))
    print(f"merged {len(shards)} shard(s), {len(df)} case(s): reports: {escape.terminal(str(out.out))}/ "
          f"({', '.join(Path(p).name for p in paths.values())})")
    return EXIT_OK if ok else EXIT_FAIL
