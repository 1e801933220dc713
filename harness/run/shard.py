"""`--shard K/N`: a deterministic, balanced slice of a run's cases, for CI systems that
already spread work over machines (Buildkite parallelism, GitHub Actions matrices).

Every machine computes the same split from the case list alone: each case gets a cost
estimated from its geometry (tokens, steps, heads, compressed entries scored, pool bytes;
nothing measured, nothing that depends on the machine), the cases are sorted by cost
(largest first, ties by name) and each goes to the least loaded shard (greedy LPT; ties to
the lowest shard). K is 1-based. The shard's identity (K, N, suite, the budgets' digest,
mxval's version, the digest of the whole case list and the list itself) goes into
report.json under `run.shard`; `mxval report --merge` checks it (harness/commands/merge.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from harness.errors import InputError
from harness.run.geometry import geometry

T = TypeVar("T")
_SHARD = re.compile(r"^\s*(\d{1,9})\s*/\s*(\d{1,9})\s*$")       # bounded before int()
MAX_SHARDS = 4096


class ShardError(InputError):
    """A bad --shard argument."""


def parse(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), 1 <= K <= N."""
    m = _SHARD.match(text or "")
    if not m:
        raise ShardError(f"--shard: expected K/N with 1 <= K <= N (e.g. 2/4), got {text!r}")
    k, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 1 <= k <= n:
        raise ShardError(f"--shard: expected K/N with 1 <= K <= N (K is 1-based), got {text!r}")
    if n > MAX_SHARDS:
        raise ShardError(f"--shard: at most {MAX_SHARDS} shards, got {n}")
    return k, n


def case_cost(case) -> float:
    """Work of one case, in arbitrary units, from its geometry only (stable everywhere)."""
    g = geometry(case)
    heads, d = g.heads, g.head_dim
    cost = 0.0
    for s in case.seqs:
        steps = s.steps()
        tokens = s.len
        cost += 2.0 * tokens * d                                   # state rows, pooling, history write
        for start, end in steps:
            n = end - start
            entries = max(1, end // g.ratio)                         # compressed entries visible
            cost += 50.0 * d                                         # a step's launches and diffs
            cost += n * heads * d                                    # Q quant
            cost += n * heads * entries * d / 8.0                    # scoring (fp64 reference)
            cost += n * entries * 4.0                                # top-k
    pool_pages = case.pool_pages or 0
    cost += pool_pages * g.page_stride / 64.0                        # pool fill, clones, byte diffs
    return cost


def assign(items: Sequence[T], n: int, cost: Callable[[T], float], name: Callable[[T], str]) -> list[list[int]]:
    """Indices of `items` per shard (each list in the items' order). Greedy LPT over the
    costs sorted largest first with ties broken by name; each goes to the least loaded
    shard, ties to the lowest."""
    order = sorted(range(len(items)), key=lambda i: (-round(float(cost(items[i])), 6), name(items[i]), i))
    load = [0.0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    for i in order:
        s = min(range(n), key=lambda j: (load[j], j))
        out[s].append(i)
        load[s] += max(float(cost(items[i])), 1e-9)
    return [sorted(x) for x in out]


def pick(items: Sequence[T], k: int, n: int, cost: Callable[[T], float], name: Callable[[T], str]) -> list[T]:
    return [items[i] for i in assign(items, n, cost, name)[k - 1]]


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def case_digest(cases) -> str:
    """The whole case list, definitions included (not the files' paths): two machines on
    different case files get different digests."""
    return digest([{k: v for k, v in dataclasses.asdict(c).items() if k != "file"} for c in cases])


def budgets_digest(budgets) -> str:
    """The limits, not where the file lies (the same budgets on two machines agree)."""
    d = dict(budgets.as_dict())
    d.pop("path", None)
    return digest(d)


def mxval_version() -> str:
    try:
        return version("mxval")
    except PackageNotFoundError:                # a checkout that was never installed
        pass
    try:
        data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
        return str(data["project"]["version"])
    except Exception:
        return "unknown"


def identity(k: int, n: int, *, command: str, suite: str, backend: str, budgets, all_names: list[str],
             all_digest: str, shard_names: list[str]) -> dict:
    """What `run.shard` holds: enough for a merge to prove its shards belong together."""
    return {"k": k, "n": n, "command": command, "suite": suite, "backend": backend,
            "budgets_digest": budgets_digest(budgets),
            "mxval_version": mxval_version(), "cases_digest": all_digest,
            "all_cases": list(all_names), "cases": list(shard_names)}
