"""Validation cases and suites, read from TOML (`cases/<suite>.toml`).

A suite file holds a `[suite]` table, optional `[defaults]` shared by its cases, and
`[[case]]` tables. `include = ["smoke"]` in `[suite]` runs another suite's cases too (a
cycle of includes is an error; a case reached by two paths runs once). Every key is
checked against one declarative schema (`CASE_SCHEMA`, `SUITE_SCHEMA` below: types, ranges
with stated upper bounds, lists where lists belong); an error is one line naming the file,
the case (or `[suite]`, `[defaults]`) and the key, never ignored. What a case may allocate
(pool, queries, logits) is bounded in harness/run/inputs.py `geometry`.

    [[case]]
    name = "prefill-chunks-shuffled"
    heads = 4                      # fewer heads than the preset keeps the interpreter fast
    topk = 8
    seqs = [{len = 40, chunks = [13, 27]}, {len = 21, decode = 2}]
    layout = "shuffled"            # "natural", "shuffled" (aiter's pick) or [N, Dt, L]
    page_stride_pad = 64
    dist = ["normal", "outlier_channels"]
    seed = 1
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from harness.errors import InputError
from harness.io import safe_input
from harness.run import generate
from reference import values as checks
from reference.op_table import DECLARED as OPS
from reference.op_table import OP_NAMES, PATHS, chain, format_of

CASES_DIR = Path(__file__).resolve().parents[2] / "cases"
BUDGETS_FILE = "budgets.toml"

MXFP4_CHAIN = chain("mxfp4")
DISTRIBUTIONS = ("normal", "outlier_channels", "heavy_tails", "zero_rows", "neg_zero", "tiny",
                 "e2m1_midpoints", "pow2_boundary", "narrow_band", "score_extremes",
                 "relu_zero", "duplicate_keys", "coarse", "scale_codes")
# Value boundaries (harness/run/inputs.py, "value boundaries"): each builds every key and query
# itself, so it takes at most one of these and only the modifiers listed with it (the ones that
# keep its guarantee: a zero window still scores exactly 0).
STRUCTURED_DISTS = {"relu_zero": ("normal", "zero_rows", "neg_zero"),
                    "duplicate_keys": ("normal",),
                    "coarse": ("normal", "zero_rows", "neg_zero"),
                    "scale_codes": ("normal",)}
TIE_SHARE_DISTS = ("relu_zero", "duplicate_keys")    # the dists `tie_share` sizes
HISTORY_MODES = ("pooled", "direct", "raw")
# Where a non-finite value can be planted (harness/run/inputs.py plants it; NUMERICS.md §4, §6:
# the reference refuses each as NonFiniteInput): the state cache's kv and score rows, the K
# writer's input rows (`k`: only where pooling is not run), its norm weight, the RoPE table,
# q, the head weights, the logits top-k ranks (only where the scorer is not under test) and a
# key's e8m0 scale byte in the pool (`kv_scale`: byte 255, NaN; an FP8 pool: its fp32 scale).
PLANT_TENSORS = ("state_kv", "state_score", "k", "norm_weight", "cos_sin_cache", "q", "weights",
                 "logits", "kv_scale")
PLANT_VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
# Block-table orders (inputs.py `_pages`): "permuted" pages at random; "sequential" 0, 1, ..;
# "top" the pool's last pages, ascending; "reversed" the pool's last pages, descending (each
# table row runs downwards); "shared" permuted, and every sequence's whole pages of history
# entries (as many as the first sequence has) are the first sequence's pages: repeated page
# ids across the block tables, read-only (as vLLM's prefix cache shares them).
PAGE_ORDERS = ("permuted", "sequential", "top", "reversed", "shared")


class CaseError(InputError):
    """A case or suite file is malformed; the message names the file and the problem."""


@dataclass(frozen=True)
class SeqSpec:
    """One sequence: `len` tokens; the last `sum(chunks)` are prefill chunks and the last
    `decode` are decode steps, each run as a step; tokens before them are history, written
    by the reference before the first step. A chunk of 0 tokens is a step in which the
    sequence is in the batch with no rows (query_start_loc[b] == query_start_loc[b + 1])."""
    len: int
    chunks: tuple[int, ...] = ()
    decode: int = 0

    @property
    def history(self) -> int:
        return self.len - sum(self.chunks) - self.decode

    def steps(self) -> list[tuple[int, int]]:
        """[start, end) positions of each step of this sequence."""
        out, p = [], self.history
        for n in (*self.chunks, *([1] * self.decode)):
            out.append((p, p + n))
            p += n
        return out


@dataclass(frozen=True)
class Plant:
    """`count` non-finite values in `tensor`, where the first step reads them; with `row`,
    `count` whole rows (a token's q or head weights, a K row, a state row's half, a RoPE
    table row, a row's valid logits, an entry's scale bytes; the norm weight is one row)."""
    tensor: str
    value: str
    count: int = 1
    row: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    suite: str
    file: str
    description: str = ""
    preset: str = "deepseek-v4-pro"
    path: str = "rocm"                   # "rocm": pool, then write K; "cuda": vLLM's fused K stage
    ops: tuple[str, ...] = MXFP4_CHAIN
    heads: Optional[int] = None          # None: the preset's
    topk: Optional[int] = None           # None: the preset's
    seqs: tuple[SeqSpec, ...] = (SeqSpec(16, (16,)),)
    page_size: Optional[int] = None      # None: the preset's kv_block // r
    layout: object = "shuffled"          # "natural" | "shuffled" | [N, Dt, L]
    page_stride_pad: int = 0
    skip_writes: int = 0                 # per call, the first N tokens at a pooling boundary get slot
                                         # -1 (vLLM's PAD_SLOT_ID: a padded token writes nothing)
    page_order: str = "permuted"         # PAGE_ORDERS: "permuted" | "sequential" | "top" (last pool
                                         # pages) | "reversed" (last pages, descending) | "shared"
    spare_pages: int = 2
    pool_pages: Optional[int] = None     # None: what the sequences need + spare_pages
    state_block: int = 16                # positions per state-cache block
    history: str = "pooled"              # "direct": history entries written from random K rows
                                         # (no pooling); state rows only where steps read them;
                                         # "raw": history entries written as raw MXFP4 bytes
                                         # (every e8m0 code 0..254, any nibble; dist scale_codes)
    table_pages: Optional[int] = None    # block-table width in pages (the logits width / page
                                         # size); None: what the longest sequence needs
    repeat: int = 1                      # runs of each backend op on the same inputs; every run
                                         # must give the first run's bytes (`--repeat N` overrides)
    graph: bool = False                  # decode steps replayed from CUDA/HIP graphs (harness/run/graph.py;
                                         # `--graph` sets it); needs a GPU
    fp8_dtype: str = "e4m3fn"
    clean_logits: bool = False
    weights_dtype: str = "bfloat16"
    dist: tuple[str, ...] = ("normal",)
    tie_share: float = 0.5               # relu_zero / duplicate_keys: the share of each
                                         # sequence's entries in the plateau, in (0, 1]
    scale: float = 1.0
    plant: tuple[Plant, ...] = ()
    expect_nonfinite: bool = False
    requires: Optional[str] = None       # "gpu": skipped with a reason elsewhere
    seed: int = 0

    @property
    def fmt(self) -> str:
        return "fp8" if any("fp8" in op for op in self.ops) else "mxfp4"

    def summary(self) -> str:
        lens = ",".join(str(s.len) for s in self.seqs)
        return f"H={self.heads or '-'} k={self.topk or '-'} lens=[{lens}] {self.layout} " \
               f"{'+'.join(self.dist)}{' plant' if self.plant else ''}{' graph' if self.graph else ''}"

    def decode_batches(self) -> list[int]:
        """The requests of each step that is a uniform decode batch (one token per request):
        the steps graph mode replays (when at most harness/run/graph.py's largest capture size)."""
        out = []
        for i in range(max(len(s.steps()) for s in self.seqs)):
            live = [s for s in self.seqs if i < len(s.steps())]
            if all(i >= len(s.chunks) for s in live):
                out.append(len(live))
        return out


# --- the schema ---------------------------------------------------------------------------
#
# Every key of a suite file, declared once: its type, its range (every number has a stated
# upper bound, so a typo of 1e12 tokens is refused here, not by the allocator), lists where
# lists belong. Ranges are half-open as everywhere (reference/checks.py): `MAX_HEADS` is the
# largest value allowed, so its range is `Int(1, MAX_HEADS + 1)`; a list's length range too.
# `_check` walks a value against its spec; an error is one line naming the
# file, the case (or [suite] / [defaults]) and the key path.

MAX_TOKENS = 2 ** 21             # tokens of one case, summed over its sequences
MAX_SEQS = 1024
MAX_STEPS = 4096                 # chunks + decode steps of one sequence
MAX_HEADS = 256
MAX_TOPK = 2 ** 16
MAX_PAGE_SIZE = 4096
MAX_POOL_PAGES = 2 ** 21
MAX_PAD = 2 ** 16
MAX_PLANT = 2 ** 20
MAX_PLANTS = 64
MAX_INCLUDES = 64
MAX_TEXT = 4096                  # characters of a name or description
MAX_SCALE = 2.0 ** 64
MAX_SEED = 2 ** 63 - 1
MAX_REPEAT = 100
MAX_GRAPH_BATCH = 512            # vLLM's largest default capture size (harness/run/graph.py)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class _Bad(Exception):
    def __init__(self, key: str, msg: str):
        self.key, self.msg = key, msg


@dataclass(frozen=True)
class _Range:
    """A value `convert` (reference/checks.py: half-open ranges, a bool is no number) takes in [lo, hi)."""
    lo: float
    hi: float

    def check(self, key, v):
        try:
            return self.convert(key, v, self.lo, self.hi)
        except ValueError as e:
            raise _Bad(key, str(e).split(": ", 1)[1]) from None


class Int(_Range):
    """An integer in [lo, hi)."""
    convert = staticmethod(checks.integer)


class Float(_Range):
    """A finite number in [lo, hi)."""
    convert = staticmethod(checks.number)


@dataclass(frozen=True)
class Share:
    """A number in (0, 1]: a share that cannot be empty and may be everything."""

    def check(self, key, v):
        x = Float(0.0, 2.0).check(key, v)
        if not 0.0 < x <= 1.0:
            raise _Bad(key, f"{_show(v)} is out of range (0, 1]")
        return x


@dataclass(frozen=True)
class Bool:
    def check(self, key, v):
        if not isinstance(v, bool):
            raise _Bad(key, f"expected true or false, got {_show(v)}")
        return v


@dataclass(frozen=True)
class Str:
    empty_ok: bool = True

    def check(self, key, v):
        if not isinstance(v, str):
            raise _Bad(key, f"expected a string, got {_show(v)}")
        if len(v) > MAX_TEXT:
            raise _Bad(key, f"{len(v)} characters, at most {MAX_TEXT}")
        if not self.empty_ok and not v.strip():
            raise _Bad(key, "must not be empty")
        if "\n" in v and not self.empty_ok:
            raise _Bad(key, "must be one line")
        if not self.empty_ok and _CONTROL.search(v):     # a name: printed, and part of file names
            raise _Bad(key, f"control character {_CONTROL.search(v).group()!r} in a name")
        return v


@dataclass(frozen=True)
class Choice:
    options: tuple

    def check(self, key, v):
        if isinstance(v, bool) or v not in self.options:
            raise _Bad(key, f"expected one of {', '.join(map(repr, self.options))}, got {_show(v)}")
        return v


@dataclass(frozen=True)
class List:
    """A list whose length is in [lo, hi)."""
    item: object
    lo: int
    hi: int
    unique: bool = False

    def check(self, key, v):
        if not isinstance(v, list):
            raise _Bad(key, f"expected a list ({self.lo} to {self.hi - 1} items), got {_show(v)}")
        if not self.lo <= len(v) < self.hi:
            raise _Bad(key, f"expected {self.lo} to {self.hi - 1} items, got {len(v)}")
        out = [self.item.check(f"{key}[{i}]", x) for i, x in enumerate(v)]
        if self.unique:
            dup = [x for i, x in enumerate(out) if x in out[:i]]
            if dup:
                raise _Bad(key, f"{dup[0]!r} is listed twice")
        return out


@dataclass(frozen=True)
class Table:
    keys: dict
    required: tuple = ()

    def check(self, key, v):
        if not isinstance(v, dict):
            raise _Bad(key, f"expected a table {{{', '.join(self.keys)}}}, got {_show(v)}")
        extra = sorted(set(v) - set(self.keys))
        if extra:
            raise _Bad(key, f"unknown key(s) {extra} (known: {', '.join(self.keys)})")
        for r in self.required:
            if r not in v:
                raise _Bad(f"{key}.{r}" if key else r, "is required")
        return {k: self.keys[k].check(f"{key}.{k}" if key else k, x) for k, x in v.items()}


@dataclass(frozen=True)
class Either:
    options: tuple
    text: str

    def check(self, key, v):
        errors = []
        for o in self.options:
            try:
                return o.check(key, v)
            except _Bad as e:
                errors.append(e)
        inner = [e for e in errors if e.key != key or "out of range" in e.msg or " items, got " in e.msg
                 or e.msg.startswith("unknown key")]
        if len(inner) == 1:             # the value has one option's shape: say what is wrong inside it
            raise inner[0]
        raise _Bad(key, f"expected {self.text}, got {_show(v)}")


def _show(v) -> str:
    r = repr(v)
    return (r if len(r) <= 60 else r[:57] + "...") + ("" if isinstance(v, (int, float, str, bool))
                                                       else f" ({type(v).__name__})")


def _presets() -> tuple:
    from reference.formats import PRESETS
    return tuple(PRESETS)


SEQ_SCHEMA = Table({"len": Int(1, MAX_TOKENS + 1), "chunks": List(Int(0, MAX_TOKENS + 1), 0, MAX_STEPS + 1),
                    "decode": Int(0, MAX_STEPS + 1)}, required=("len",))
PLANT_SCHEMA = Table({"tensor": Choice(PLANT_TENSORS), "value": Choice(tuple(PLANT_VALUES)),
                      "count": Int(1, MAX_PLANT + 1), "row": Bool()}, required=("tensor", "value"))
CASE_SCHEMA = Table({
    "name": Str(empty_ok=False),
    "description": Str(),
    "preset": Choice(_presets()),
    "path": Choice(PATHS),
    "ops": List(Choice(OP_NAMES), 1, len(OP_NAMES) + 1, unique=True),
    "heads": Int(1, MAX_HEADS + 1),
    "topk": Int(1, MAX_TOPK + 1),
    "seqs": List(Either((Int(1, MAX_TOKENS + 1), SEQ_SCHEMA), "a length or {len, chunks, decode}"), 1, MAX_SEQS + 1),
    "page_size": Int(1, MAX_PAGE_SIZE + 1),
    "layout": Either((Choice(("natural", "shuffled")), List(Int(1, MAX_PAGE_SIZE + 1), 3, 4)),
                     '"natural", "shuffled" or [N, Dt, L]'),
    "page_stride_pad": Int(0, MAX_PAD + 1),
    "skip_writes": Int(0, MAX_TOKENS + 1),
    "page_order": Choice(PAGE_ORDERS),
    "spare_pages": Int(0, MAX_POOL_PAGES + 1),
    "pool_pages": Int(1, MAX_POOL_PAGES + 1),
    "state_block": Int(1, MAX_PAGE_SIZE + 1),
    "history": Choice(HISTORY_MODES),
    "table_pages": Int(1, MAX_POOL_PAGES + 1),
    "repeat": Int(1, MAX_REPEAT + 1),
    "graph": Bool(),
    "fp8_dtype": Choice(("e4m3fn", "e4m3fnuz")),
    "clean_logits": Bool(),
    "weights_dtype": Choice(("bfloat16", "float32")),
    "dist": List(Choice(DISTRIBUTIONS), 1, len(DISTRIBUTIONS) + 1, unique=True),
    "tie_share": Share(),
    "scale": Float(-MAX_SCALE, MAX_SCALE),
    "plant": List(PLANT_SCHEMA, 0, MAX_PLANTS + 1),
    "expect_nonfinite": Bool(),
    "requires": Choice(("gpu",)),
    "seed": Int(0, MAX_SEED + 1),
})
DEFAULTS_SCHEMA = Table({k: v for k, v in CASE_SCHEMA.keys.items() if k != "name"})
SUITE_SCHEMA = Table({"name": Str(empty_ok=False), "description": Str(),
                      "include": List(Str(empty_ok=False), 0, MAX_INCLUDES + 1, unique=True)})
# [generate]: cases from the coverage model (harness/run/generate.py), after the written ones
GENERATE_SCHEMA = Table({"seed": Int(0, MAX_SEED + 1), "tier": Choice(generate.TIERS)}, required=("seed", "tier"))
FILE_SCHEMA_KEYS = ("suite", "defaults", "case", "generate")

assert set(CASE_SCHEMA.keys) == {f.name for f in dataclasses.fields(Case)} - {"suite", "file"}


def _checked(where: str, spec, raw, key: str = ""):
    try:
        return spec.check(key, raw)
    except _Bad as e:
        raise CaseError(f"{where}: {e.key + ': ' if e.key else ''}{e.msg}") from None


def _seq(where: str, key: str, raw) -> SeqSpec:
    if isinstance(raw, int):
        raw = {"len": raw, "chunks": [raw]}
    n, decode = raw["len"], raw.get("decode", 0)
    chunks = tuple(raw.get("chunks", [] if decode else [n]))
    s = SeqSpec(n, chunks, decode)
    if s.history < 0:
        raise CaseError(f"{where}: {key}: chunks {list(chunks)} + decode {decode} exceed len {n}")
    if not s.steps():
        raise CaseError(f"{where}: {key}: a sequence of len {n} has no chunk or decode step to run")
    return s


def _case(raw, defaults: dict, suite: str, file: Path, index: int) -> Case:
    if not isinstance(raw, dict):
        raise CaseError(f"{file}: case #{index + 1}: expected a [[case]] table, got {_show(raw)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise CaseError(f"{file}: case #{index + 1}: name: every [[case]] needs a non-empty name, got "
                        f"{_show(name) if 'name' in raw else 'none'}")
    where = f"{file}: case {name!r}"
    kw = _checked(where, CASE_SCHEMA, {**defaults, **raw})
    path = kw.get("path", "rocm")
    ops = tuple(kw.get("ops", chain("mxfp4", path)))
    fmt = format_of(ops)
    off = [o for o in ops if o not in chain("mxfp4", path) + chain("fp8", path)]
    if off:
        raise CaseError(f"{where}: ops: {off} are not on the {path} path (its chains: "
                        f"{', '.join(chain('mxfp4', path))}; {', '.join(chain('fp8', path))})")
    ops_chain = chain(fmt, path)
    if any(o not in ops_chain for o in ops):
        raise CaseError(f"{where}: ops: {list(ops)} mix the MXFP4 and FP8 chains")
    kw["ops"] = tuple(o for o in ops_chain if o in ops)
    if path == "cuda":
        if kw.get("layout", "natural") != "natural":
            raise CaseError(f"{where}: layout: the cuda path writes natural pages (vLLM's fused K kernel); "
                            f"expected \"natural\", got {kw['layout']!r}")
        kw["layout"] = "natural"
    kw["seqs"] = tuple(_seq(where, f"seqs[{i}]", s) for i, s in enumerate(kw.get("seqs", [16])))
    total = sum(s.len for s in kw["seqs"])
    if total > MAX_TOKENS:
        raise CaseError(f"{where}: seqs: {total} tokens in all, more than the {MAX_TOKENS} a case may hold")
    kw["dist"] = tuple(kw.get("dist", ["normal"]))
    _check_dists(where, kw["dist"], kw.get("history", "pooled"), fmt)
    if "tie_share" in kw and not set(kw["dist"]) & set(TIE_SHARE_DISTS):
        raise CaseError(f"{where}: tie_share: sizes the plateau of {' or '.join(TIE_SHARE_DISTS)}; "
                        f"dist {list(kw['dist'])} has none")
    kw["plant"] = tuple(Plant(p["tensor"], p["value"], p.get("count", 1), p.get("row", False))
                        for p in kw.get("plant", []))
    for i, p in enumerate(kw["plant"]):
        if p.tensor == "kv_scale" and p.value != "nan" and format_of(kw["ops"]) == "mxfp4":
            raise CaseError(f"{where}: plant[{i}].value: an e8m0 scale byte holds no infinity; "
                            f"\"nan\" plants the byte 255")
        if p.tensor == "norm_weight" and p.row and p.count != 1:
            raise CaseError(f"{where}: plant[{i}].count: the norm weight is one row, got {p.count} rows")
        why = _plant_unread(p.tensor, kw["ops"], path)
        if why:
            raise CaseError(f"{where}: plant[{i}].tensor: {p.tensor!r} {why}")
    lay = kw.get("layout", "shuffled")
    kw["layout"] = tuple(lay) if isinstance(lay, list) else lay
    if kw.get("graph"):
        if not any(n <= MAX_GRAPH_BATCH for n in Case(name="", suite="", file="", seqs=kw["seqs"]).decode_batches()):
            raise CaseError(f"{where}: graph: no step is a decode batch of at most {MAX_GRAPH_BATCH} requests "
                            "(only those are replayed from a graph): add `decode = n` to a sequence")
        kw["requires"] = "gpu"               # a CUDA/HIP graph
    if kw.get("expect_nonfinite") and not kw["plant"]:
        raise CaseError(f"{where}: expect_nonfinite: needs a plant = [...] entry")
    return Case(suite=suite, file=str(file), **kw)


def _check_dists(where: str, dist: tuple, history: str, fmt: str) -> None:
    """At most one value-boundary dist, with the modifiers it keeps its guarantee under;
    raw history (MXFP4 bytes whose codes the scale_codes queries are built against) only
    with dist = ["scale_codes"] on the MXFP4 chain."""
    structured = [d for d in dist if d in STRUCTURED_DISTS]
    if len(structured) > 1:
        raise CaseError(f"{where}: dist: {structured[0]!r} and {structured[1]!r} each build every key "
                        f"and query: at most one of {', '.join(STRUCTURED_DISTS)}")
    if structured:
        extra = [d for d in dist if d != structured[0] and d not in STRUCTURED_DISTS[structured[0]]]
        if extra:
            allowed = [d for d in STRUCTURED_DISTS[structured[0]] if d != "normal"]
            raise CaseError(f"{where}: dist: {structured[0]!r} does not combine with {extra[0]!r} "
                            f"(it does with: {', '.join(allowed) or 'nothing else'})")
    if history == "raw" and (structured != ["scale_codes"] or fmt != "mxfp4"):
        raise CaseError(f"{where}: history: \"raw\" writes MXFP4 bytes scored against scale_codes "
                        f"queries: it needs dist = [\"scale_codes\"] and the MXFP4 chain")


def _plant_unread(tensor: str, ops: tuple, path: str) -> str:
    """Why no op of the chain reads a plant in `tensor` ("" when one does)."""
    scorer = any(OPS[o].stage == "scorer" for o in ops)
    if tensor == "k" and (path != "rocm" or "compress_pool" in ops):
        return ("is read only where pooling is not run (the K writer then takes generated rows); "
                "here it takes pooled rows: plant state_kv")
    if tensor == "logits" and (scorer or "topk" not in ops):
        return "is top-k's input from the reference scorer: only in a case with topk and no scorer in ops"
    if tensor == "kv_scale" and not (scorer or "topk" in ops):
        return "is read by the scorer: the case needs a scorer or topk in ops"
    return ""


@dataclass
class Suite:
    name: str
    file: str
    description: str = ""
    include: tuple[str, ...] = ()
    cases: list[Case] = field(default_factory=list)


def _read_toml(path: Path) -> dict:
    """A regular file, bounded in size, nesting and integer digits (harness/io/safe_input.py)."""
    return safe_input.load_toml(path, error=CaseError)


def load_suite_file(path: Path) -> Suite:
    data = _read_toml(path)
    extra = set(data) - set(FILE_SCHEMA_KEYS)
    if extra:
        raise CaseError(f"{path}: unknown top-level key(s) {sorted(extra)} (known: {', '.join(FILE_SCHEMA_KEYS)})")
    head = _checked(f"{path}: [suite]", SUITE_SCHEMA, data.get("suite", {}))
    name = head.get("name", path.stem)
    raw_defaults = data.get("defaults", {})
    if isinstance(raw_defaults, dict) and "name" in raw_defaults:
        raise CaseError(f"{path}: [defaults]: name: a default cannot set a case's name")
    defaults = _checked(f"{path}: [defaults]", DEFAULTS_SCHEMA, raw_defaults)
    defaults = {k: raw_defaults[k] for k in defaults}         # re-checked, merged, in each case
    raw_cases = data.get("case", [])
    if not isinstance(raw_cases, list):
        raise CaseError(f"{path}: case: use [[case]] tables for cases, got {_show(raw_cases)}")
    if "generate" in data:
        gen = _checked(f"{path}: [generate]", GENERATE_SCHEMA, data["generate"])
        raw_cases = raw_cases + generate.generate(gen["seed"], gen["tier"])
    suite = Suite(name, str(path), head.get("description", ""), tuple(head.get("include", ())))
    suite.cases = [_case(c, defaults, name, path, i) for i, c in enumerate(raw_cases)]
    seen = set()
    for c in suite.cases:
        if c.name in seen:
            raise CaseError(f"{path}: case {c.name!r}: name: defined twice")
        seen.add(c.name)
    return suite


def _is_suite_file(path: Path) -> bool:
    data = _read_toml(path)
    return any(k in data for k in FILE_SCHEMA_KEYS)


class Catalog:
    """Every suite under a cases directory; case names are unique across suites."""

    def __init__(self, cases_dir: Path | str | None = None):
        self.dir = Path(cases_dir) if cases_dir else CASES_DIR
        if not self.dir.is_dir():
            raise CaseError(f"{self.dir}: cases directory not found")
        self.suites: dict[str, Suite] = {}
        self.by_name: dict[str, Case] = {}
        for path in sorted(self.dir.glob("*.toml")):
            if path.name == BUDGETS_FILE or not _is_suite_file(path):
                continue           # other tools keep their TOML here too (study.toml)
            s = load_suite_file(path)
            if s.name in self.suites:
                raise CaseError(f"{path}: suite {s.name!r} is also defined in {self.suites[s.name].file}")
            self.suites[s.name] = s
            for c in s.cases:
                if c.name in self.by_name:
                    raise CaseError(f"{path}: case {c.name!r} is also defined in {self.by_name[c.name].file}")
                self.by_name[c.name] = c
        for s in self.suites.values():
            for inc in s.include:
                if inc not in self.suites:
                    raise CaseError(f"{s.file}: [suite] include: unknown suite {inc!r} "
                                    f"(known: {', '.join(self.suites)})")
        for s in self.suites.values():
            self._no_cycle(s.name, ())

    def _no_cycle(self, name: str, path: tuple) -> None:
        if name in path:
            loop = " -> ".join((*path[path.index(name):], name))
            raise CaseError(f"{self.suites[path[-1]].file}: [suite] include: suite {name!r} includes itself ({loop})")
        for inc in self.suites[name].include:
            self._no_cycle(inc, (*path, name))

    def suite_cases(self, name: str) -> list[Case]:
        """The suite's cases after those of the suites it includes; a case reached by two
        include paths runs once."""
        if name not in self.suites:
            raise CaseError(f"--suite: unknown suite {name!r} (known: {', '.join(self.suites)})")
        out: dict[str, Case] = {}
        for inc in self.suites[name].include:
            for c in self.suite_cases(inc):
                out.setdefault(c.name, c)
        for c in self.suites[name].cases:
            out.setdefault(c.name, c)
        return list(out.values())

    def case(self, name: str) -> Case:
        try:
            return self.by_name[name]
        except KeyError:
            raise CaseError(f"--case: unknown case {name!r} (see `mxval cases`)") from None

    def select(self, suite: str | None, names: list[str] | None) -> tuple[str, list[Case]]:
        """(suite name used for budgets, cases to run)."""
        if names:
            dup = [n for i, n in enumerate(names) if n in names[:i]]
            if dup:
                raise CaseError(f"--case: {dup[0]!r} is given twice")
            cases = [self.case(n) for n in names]
            return (suite or (cases[0].suite if len({c.suite for c in cases}) == 1 else "cases")), cases
        suite = suite or "default"
        return suite, self.suite_cases(suite)


def on_path(case: Case, path: str) -> Case:
    """The same case on another path (`mxval validate --path`): each op replaced by the op
    of its stage on that path (the rocm path's pooling and K writer <-> the cuda path's fused
    pool+K op), and natural pages on the cuda path (vLLM's fused K kernel writes no other
    layout). Inputs are drawn from the same seed, so a case compares the two paths' bytes. A
    case whose plant no op of the other path reads (a K row, where pooling is not run) stays
    on its own path."""
    if path not in PATHS:
        raise CaseError(f"--path: expected one of {', '.join(PATHS)}, got {path!r}")
    if case.path == path:
        return case
    fmt = format_of(case.ops)
    stages = {OPS[o].stage for o in case.ops}
    if path == "cuda" and stages & {"pooling", "k_writer"}:
        stages = (stages - {"pooling", "k_writer"}) | {"pool_k"}
    elif path == "rocm" and "pool_k" in stages:
        stages = (stages - {"pool_k"}) | {"pooling", "k_writer"}
    ops = tuple(o for o in chain(fmt, path) if OPS[o].stage in stages)
    if any(_plant_unread(p.tensor, ops, path) for p in case.plant):
        return case           # its plant exists on its own path only (a K row where pooling is not run)
    layout = "natural" if path == "cuda" else case.layout
    return dataclasses.replace(case, path=path, ops=ops, layout=layout)

