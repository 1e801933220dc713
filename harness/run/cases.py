"""Validation cases and suites, read from TOML (`cases/<suite>.toml`).

A suite file holds a `[suite]` table, optional `[defaults]` shared by its cases, and
`[[case]]` tables. `include = ["smoke"]` in `[suite]` runs another suite's cases too.
Every key is checked: a typo is an error naming the file and the case, never ignored.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import tomllib

from harness.errors import InputError
from reference.ops import OP_NAMES, PATHS, chain, format_of

CASES_DIR = Path(__file__).resolve().parents[2] / "cases"
BUDGETS_FILE = "budgets.toml"

MXFP4_CHAIN = chain("mxfp4")
DISTRIBUTIONS = ("normal", "outlier_channels", "heavy_tails", "zero_rows", "neg_zero", "tiny",
                 "e2m1_midpoints", "pow2_boundary")
PLANT_TENSORS = ("state_kv", "state_score", "q", "weights")
PLANT_VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


class CaseError(InputError):
    """A case or suite file is malformed; the message names the file and the problem."""


@dataclass(frozen=True)
class SeqSpec:
    """One sequence: `len` tokens; the last `sum(chunks)` are prefill chunks and the last
    `decode` are decode steps, each run as a step; tokens before them are history, written
    by the reference before the first step."""
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
    tensor: str
    value: str
    count: int = 1


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
    page_order: str = "permuted"         # "permuted" | "sequential" | "top" (last pool pages)
    spare_pages: int = 2
    pool_pages: Optional[int] = None     # None: what the sequences need + spare_pages
    state_block: int = 16                # positions per state-cache block
    fp8_dtype: str = "e4m3fn"
    clean_logits: bool = False
    weights_dtype: str = "bfloat16"
    dist: tuple[str, ...] = ("normal",)
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
               f"{'+'.join(self.dist)}{' plant' if self.plant else ''}"


_FIELDS = {f.name for f in dataclasses.fields(Case)} - {"suite", "file"}
_SEQ_KEYS = {"len", "chunks", "decode"}


def _int(where: str, key: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CaseError(f"{where}: {key} must be an integer >= {lo}, got {v!r}")
    return v


def _seq(where: str, raw) -> SeqSpec:
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = {"len": raw, "chunks": [raw]}
    if not isinstance(raw, dict):
        raise CaseError(f"{where}: seqs entries must be tables like {{len = 40, chunks = [16, 24]}}")
    extra = set(raw) - _SEQ_KEYS
    if extra:
        raise CaseError(f"{where}: unknown sequence key(s) {sorted(extra)} (known: {sorted(_SEQ_KEYS)})")
    n = _int(where, "len", raw.get("len"), 1)
    decode = _int(where, "decode", raw.get("decode", 0))
    chunks = raw.get("chunks", [] if decode else [n])
    if not isinstance(chunks, list):
        raise CaseError(f"{where}: chunks must be a list of sizes")
    chunks = tuple(_int(where, "chunks[]", c, 1) for c in chunks)
    s = SeqSpec(n, chunks, decode)
    if s.history < 0:
        raise CaseError(f"{where}: chunks {list(chunks)} + decode {decode} exceed len {n}")
    if not s.steps():
        raise CaseError(f"{where}: a sequence of len {n} has no chunk or decode step to run")
    return s


def _case(raw: dict, defaults: dict, suite: str, file: Path) -> Case:
    merged = {**defaults, **raw}
    name = merged.get("name")
    if not isinstance(name, str) or not name:
        raise CaseError(f"{file}: every [[case]] needs a name")
    where = f"{file}: case {name!r}"
    extra = set(merged) - _FIELDS
    if extra:
        raise CaseError(f"{where}: unknown key(s) {sorted(extra)}")
    kw = dict(merged)
    from reference.formats import PRESETS
    if kw.get("preset", "deepseek-v4-pro") not in PRESETS:
        raise CaseError(f"{where}: unknown preset {kw['preset']!r} (known: {', '.join(PRESETS)})")
    path = kw.get("path", "rocm")
    if path not in PATHS:
        raise CaseError(f"{where}: path must be one of {PATHS}, got {path!r}")
    ops = tuple(kw.get("ops", chain("mxfp4", path)))
    bad = [o for o in ops if o not in OP_NAMES]
    if bad or not ops:
        raise CaseError(f"{where}: unknown op(s) {bad} (known: {', '.join(OP_NAMES)})")
    fmt = format_of(ops)
    if any(o not in chain("mxfp4", p) + chain("fp8", p) for o in ops for p in (path,)):
        off = [o for o in ops if o not in chain("mxfp4", path) + chain("fp8", path)]
        raise CaseError(f"{where}: op(s) {off} are not on the {path} path (its chains: "
                        f"{', '.join(chain('mxfp4', path))}; {', '.join(chain('fp8', path))})")
    ops_chain = chain(fmt, path)
    if any(o not in ops_chain for o in ops):
        raise CaseError(f"{where}: ops {list(ops)} mix the MXFP4 and FP8 chains")
    kw["ops"] = tuple(o for o in ops_chain if o in ops)
    if path == "cuda":
        if kw.get("layout", "natural") != "natural":
            raise CaseError(f"{where}: the cuda path writes natural pages (vLLM's fused K kernel); "
                            f"layout must be \"natural\", got {kw['layout']!r}")
        kw["layout"] = "natural"
    seqs = kw.get("seqs", [16])
    if not isinstance(seqs, list) or not seqs:
        raise CaseError(f"{where}: seqs must be a non-empty list")
    kw["seqs"] = tuple(_seq(where, s) for s in seqs)
    dist = kw.get("dist", ["normal"])
    dist = [dist] if isinstance(dist, str) else dist
    bad = [d for d in dist if d not in DISTRIBUTIONS]
    if bad:
        raise CaseError(f"{where}: unknown distribution(s) {bad} (known: {', '.join(DISTRIBUTIONS)})")
    kw["dist"] = tuple(dist)
    plants = []
    for p in kw.get("plant", []):
        if not isinstance(p, dict) or set(p) - {"tensor", "value", "count"}:
            raise CaseError(f"{where}: plant entries are tables {{tensor, value, count}}")
        if p.get("tensor") not in PLANT_TENSORS or p.get("value") not in PLANT_VALUES:
            raise CaseError(f"{where}: plant tensor must be one of {PLANT_TENSORS} and value one of "
                            f"{tuple(PLANT_VALUES)}, got {p}")
        plants.append(Plant(p["tensor"], p["value"], _int(where, "plant.count", p.get("count", 1), 1)))
    kw["plant"] = tuple(plants)
    for key in ("heads", "topk", "page_size", "pool_pages"):
        if kw.get(key) is not None:
            _int(where, key, kw[key], 1)
    for key in ("page_stride_pad", "spare_pages", "seed"):
        _int(where, key, kw.get(key, 0))
    _int(where, "state_block", kw.get("state_block", 16), 1)
    lay = kw.get("layout", "shuffled")
    if not (lay in ("natural", "shuffled") or (isinstance(lay, list) and len(lay) == 3
                                                and all(isinstance(v, int) for v in lay))):
        raise CaseError(f"{where}: layout must be \"natural\", \"shuffled\" or [N, Dt, L], got {lay!r}")
    kw["layout"] = tuple(lay) if isinstance(lay, list) else lay
    choices = {"page_order": ("permuted", "sequential", "top"), "requires": (None, "gpu"),
               "weights_dtype": ("bfloat16", "float32"), "fp8_dtype": ("e4m3fn", "e4m3fnuz")}
    for key, opts in choices.items():
        if kw.get(key, opts[0]) not in opts:
            raise CaseError(f"{where}: {key} must be one of {opts}, got {kw[key]!r}")
    for key in ("clean_logits", "expect_nonfinite"):
        if not isinstance(kw.get(key, False), bool):
            raise CaseError(f"{where}: {key} must be true or false")
    if kw.get("expect_nonfinite") and not plants:
        raise CaseError(f"{where}: expect_nonfinite needs a plant = [...] entry")
    if not isinstance(kw.get("scale", 1.0), (int, float)):
        raise CaseError(f"{where}: scale must be a number")
    return Case(suite=suite, file=str(file), **kw)


@dataclass
class Suite:
    name: str
    file: str
    description: str = ""
    include: tuple[str, ...] = ()
    cases: list[Case] = field(default_factory=list)


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise CaseError(f"{path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise CaseError(f"{path}: malformed TOML: {e}") from None


def load_suite_file(path: Path) -> Suite:
    data = _read_toml(path)
    extra = set(data) - {"suite", "defaults", "case"}
    if extra:
        raise CaseError(f"{path}: unknown top-level key(s) {sorted(extra)} (known: suite, defaults, case)")
    head = data.get("suite", {})
    name = head.get("name", path.stem)
    if set(head) - {"name", "description", "include"}:
        raise CaseError(f"{path}: [suite] keys are name, description, include")
    defaults = data.get("defaults", {})
    if "name" in defaults:
        raise CaseError(f"{path}: [defaults] cannot set a name")
    raw_cases = data.get("case", [])
    if not isinstance(raw_cases, list):
        raise CaseError(f"{path}: use [[case]] tables for cases")
    suite = Suite(name, str(path), head.get("description", ""), tuple(head.get("include", ())))
    suite.cases = [_case(c, defaults, name, path) for c in raw_cases]
    seen = set()
    for c in suite.cases:
        if c.name in seen:
            raise CaseError(f"{path}: case {c.name!r} is defined twice")
        seen.add(c.name)
    return suite


def _is_suite_file(path: Path) -> bool:
    data = _read_toml(path)
    return "suite" in data or "case" in data


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
                    raise CaseError(f"{s.file}: include names unknown suite {inc!r}")

    def suite_cases(self, name: str, _seen=()) -> list[Case]:
        if name not in self.suites:
            raise CaseError(f"--suite: unknown suite {name!r} (known: {', '.join(self.suites)})")
        s = self.suites[name]
        out: list[Case] = []
        for inc in s.include:
            if inc not in _seen:
                out += self.suite_cases(inc, (*_seen, name))
        return out + s.cases

    def case(self, name: str) -> Case:
        try:
            return self.by_name[name]
        except KeyError:
            raise CaseError(f"--case: unknown case {name!r} (see `mxval cases`)") from None

    def select(self, suite: str | None, names: list[str] | None) -> tuple[str, list[Case]]:
        """(suite name used for budgets, cases to run)."""
        if names:
            cases = [self.case(n) for n in names]
            return (suite or (cases[0].suite if len({c.suite for c in cases}) == 1 else "cases")), cases
        suite = suite or "default"
        return suite, self.suite_cases(suite)
