"""The metric table and the judge: every metric the diff engine emits, declared once.

Each `Metric` says which stage emits it, its kind, which side is bad, how a case's steps
combine, the values it can take, and whether a budgets file must bound it:

    kind    steps combine   better   values
    count   summed          lower    0, 1, 2, ...        (bytes, rows, indices, findings)
    max     maximum         lower    >= 0                (ulps, errors: the worst step)
    ratio   maximum         lower    [0, hi]             (fractions, logits_diff)
    min     minimum         higher   [0, 1]              (recall, Jaccard: the worst step)
    info    summed          neither  >= 0                (how much was compared)

`required`: every budgets file must give the metric a limit (or say "off") for each stage
of the run that emits it. `always_fail`: non-finite or missing outputs; without a budget
such a metric fails whenever it is non-zero (never a silent pass). `chain`: whether the
whole-chain comparison (`chain.<metric>`) emits it, and whether its budget is required there.

`judge()` is the one place a verdict is decided: `harness.run.budgets.Budgets.check`
(mxval's reports) and `DiffReport.failures` (the public API) both call it, so a limit, a
missing limit and "off" mean the same everywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from reference.ops import OPS, STAGES

ANY = "any"                      # emitted by whatever stage meets the condition
CHAIN = "chain"                  # the whole-chain comparison's stage, the prefix of its keys
CHAIN_PREFIX = CHAIN + "."
KINDS = ("count", "max", "ratio", "min", "info")


@dataclass(frozen=True)
class Metric:
    name: str
    stage: str                   # one of STAGES, or ANY
    kind: str                    # one of KINDS
    doc: str
    required: bool = False       # a budgets file must bound it (per-stage key or bare name)
    always_fail: bool = False    # fails when non-zero unless a budget says otherwise
    chain: Optional[str] = None  # None: not in the chain; "allowed"; "required"; "only"
    hi: float = math.inf         # largest value the metric can take
    conditional: bool = False    # reported only when the op is asked for it (clean_logits), not on every run

    @property
    def higher_is_better(self) -> bool:
        return self.kind == "min"

    @property
    def lo(self) -> float:
        return 0.0


def _m(name, stage, kind, doc, **kw) -> Metric:
    if kind in ("min",):
        kw.setdefault("hi", 1.0)
    return Metric(name, stage, kind, doc, **kw)


_TABLE = (
    # pooling (diff_pooled)
    _m("pooled_max_ulp", "pooling", "max", "bf16 ulps between pooled values (+0/-0 are 0 apart)", required=True),
    _m("pooled_values_differing", "pooling", "count", "pooled values whose bits differ"),
    _m("pooled_rows_differing", "pooling", "count", "pooled rows with a differing or non-finite value"),
    _m("pooled_rows_compared", "pooling", "info", "pooled rows compared"),
    _m("pooled_nonfinite", "pooling", "count", "NaN/inf in a compared pooled row", always_fail=True),
    # K writer (diff_pages)
    _m("page_bytes_mismatched", "k_writer", "count", "pool bytes that differ", required=True, chain="allowed"),
    _m("page_value_bytes_mismatched", "k_writer", "count", "owned value bytes that differ", chain="allowed"),
    _m("page_scale_bytes_mismatched", "k_writer", "count", "owned scale bytes that differ", chain="allowed"),
    _m("page_bytes_outside_owned_changed", "k_writer", "count", "bytes no written slot owns that changed",
       required=True, chain="required"),
    _m("page_entries_mismatched", "k_writer", "count", "written entries with a differing byte", chain="allowed"),
    _m("page_dequant_max_abs_err", "k_writer", "max", "max |dequantized actual - expected|", chain="allowed"),
    _m("page_dequant_max_rel_err", "k_writer", "max", "the same, relative to the entry's max |expected|",
       chain="allowed"),
    _m("page_bytes_mismatched_frac", "k_writer", "ratio", "whole chain: mismatched share of the owned K bytes",
       chain="only", hi=1.0),
    # the fused pool+K stage (CUDA path): its pages are diffed as a writer's (its op's
    # `diffed_as`, reference/ops.py), plus
    _m("pool_k_bytes_mismatched_frac", "pool_k", "ratio", "owned K bytes of the fused stage that differ, "
       "as a fraction (it pools too: the kernel's fp32 pooling may move a few)", required=True, chain="allowed",
       hi=1.0),
    # Q quant (diff_q)
    _m("q_bytes_mismatched", "q_quant", "count", "Q value bytes that differ", required=True),
    _m("q_scale_bytes_mismatched", "q_quant", "count", "Q scale bytes that differ", required=True),
    _m("weights_max_ulp", "q_quant", "max", "fp32 ulps between folded head weights", required=True),
    _m("weights_differing", "q_quant", "count", "folded head weights whose bits differ"),
    # scorer (diff_logits)
    _m("logits_diff", "scorer", "ratio", "sum((x-y)^2)/sum(x^2+y^2) over the valid region", required=True,
       chain="allowed", hi=2.0),
    _m("logits_max_abs_err", "scorer", "max", "max |x - y| over the valid region", chain="allowed"),
    _m("logits_max_rel_err", "scorer", "max", "max |x - y| / |y| over the valid region", chain="allowed"),
    _m("logits_nonfinite", "scorer", "count", "NaN/inf logits in the valid region", always_fail=True,
       chain="allowed"),
    _m("logits_inf_pattern_mismatch", "scorer", "count", "columns past a row's end that are not -inf (clean)",
       required=True, chain="allowed", conditional=True),
    _m("logits_rows_differing", "scorer", "count", "rows whose own difference exceeds the row threshold",
       chain="allowed"),
    # top-k (diff_topk)
    _m("topk_rows_not_exact_frac", "topk", "ratio", "rows whose set differs from the reference's own",
       chain="allowed", hi=1.0),
    _m("topk_recall_min", "topk", "min", "min over rows of acceptable indices / min(len, k)", chain="allowed"),
    _m("topk_jaccard_min", "topk", "min", "min over rows of the Jaccard index within the tie rule",
       chain="allowed"),
    _m("topk_padding_errors", "topk", "count", "rows with wrong -1 padding", required=True, chain="required"),
    _m("topk_duplicates", "topk", "count", "repeated indices", required=True, chain="required"),
    _m("topk_out_of_range", "topk", "count", "indices < -1 or past the row's length", required=True,
       chain="required"),
    _m("topk_below_threshold", "topk", "count", "indices failing the tie rule", required=True, chain="allowed"),
    # top-k: what the selection keeps of the exact top-k (diff_topk -> selection_metrics)
    _m("topk_mass_kept_min", "topk", "min", "min over rows of the proxy attention mass kept (softmax of the "
       "exact logits, harness/diff/scores.py score_weights)", chain="allowed"),
    _m("topk_top64_kept_min", "topk", "min", "min over rows of the exact top-64 kept (k > 64)", chain="allowed"),
    _m("topk_top256_kept_min", "topk", "min", "min over rows of the exact top-256 kept (k > 256)", chain="allowed"),
    _m("topk_rank_lost_min", "topk", "min", "the best exact rank among keys lost beyond the tie rule (emitted "
       "only by a step that lost one)", chain="allowed", hi=math.inf),
    # any stage
    _m("nonfinite_inputs", ANY, "count", "non-finite inputs (outside the contract)", always_fail=True,
       chain="allowed"),
    _m("outputs_missing", ANY, "count", "outputs the backend did not return", always_fail=True, chain="allowed"),
    _m("outputs_bad_shape", ANY, "count", "outputs of the wrong shape", always_fail=True, chain="allowed"),
    _m("op_unsupported", ANY, "count", "a replayed op the backend does not implement", always_fail=True),
    # any backend output, without the reference (harness/diff/invariants.py): impossible outputs
    _m("invariant_violations", ANY, "count", "broken invariants of a backend's output (top-k structure, "
       "-inf past row ends, bytes outside the written slots, scale codes), checked without the reference, "
       "also on inputs the reference refuses", always_fail=True),
    # graph mode (harness/run/graph.py): each replayed step against the same op run eagerly
    _m("graph_eager_bytes_differ", ANY, "count", "output bytes of a graph replay that differ from the same op "
       "run eagerly on the same step (graph ≠ eager)", always_fail=True),
    _m("graph_replays", ANY, "info", "steps replayed from a graph"),
)

# Finding classes, each counted as the metric `class_<name>` by the stage(s) that file it.
FINDING_CLASSES: dict[str, tuple[str, ...]] = {
    "signed_zero": ("k_writer", "q_quant", "pooling"), "one_step": ("k_writer", "q_quant"),
    "nibbles_swapped": ("k_writer", "q_quant"), "value_other": ("k_writer", "q_quant"),
    "scale_off_by_k": ("k_writer", "q_quant"), "scale_interleave": ("k_writer", "q_quant"),
    "scale_other": ("k_writer",), "not_written": ("k_writer",), "outside_owned_write": ("k_writer",),
    "weights_differ": ("q_quant",), "nonfinite": ("pooling", "scorer"), "one_ulp": ("pooling",),
    "multi_ulp": ("pooling",), "inf_pattern": ("scorer",), "row_differs": ("scorer",),
    "padding": ("topk",), "duplicates": ("topk",), "out_of_range": ("topk",),
    "below_threshold": ("topk",), "tie_swap": ("topk",), "nonfinite_input": STAGES,
    "invariant": STAGES,
}

METRICS: dict[str, Metric] = {m.name: m for m in _TABLE}
for _cls, _stages in FINDING_CLASSES.items():
    METRICS[f"class_{_cls}"] = Metric(f"class_{_cls}", ANY if len(_stages) > 1 else _stages[0], "count",
                                      f"findings of class {_cls}", chain="allowed")
_CLASS_STAGES = {f"class_{c}": s for c, s in FINDING_CLASSES.items()}

ALWAYS_FAIL: tuple[str, ...] = tuple(m.name for m in _TABLE if m.always_fail)
REQUIRED: tuple[str, ...] = tuple(m.name for m in _TABLE if m.required)


def metric(name: str) -> Metric:
    """The table's entry for a bare metric name; KeyError naming it when unknown."""
    try:
        return METRICS[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not in the metric table (harness/diff/metrics.py)") from None


def chain_key(name: str) -> str:
    """The whole-chain comparison's key of a metric: `chain.<metric>`."""
    return CHAIN_PREFIX + name


def is_chain(key: str) -> bool:
    return key.startswith(CHAIN_PREFIX)


def bare(key: str) -> str:
    """`<stage>.<metric>` or `chain.<metric>` -> metric; a bare name stays as it is."""
    return key.rpartition(".")[2]


def higher_is_better(name: str) -> bool:
    return metric(bare(name)).higher_is_better


def emitted_by(name: str, stage: str) -> bool:
    """Whether a metric can come out of `stage` (one of STAGES, or CHAIN)."""
    m = METRICS.get(name)
    if m is None:
        return False
    if stage == CHAIN:
        return m.chain is not None
    if m.chain == "only":
        return False
    if m.stage == stage:
        return True
    if name in _CLASS_STAGES:
        return stage in _CLASS_STAGES[name]
    return m.stage in (stage, ANY)


def op_emits(name: str, op: str) -> bool:
    """Whether a metric can come out of op `op` (of its own stage, or the stage it is diffed as)."""
    return any(emitted_by(name, s) for s in OPS[op].stages)


def run_keys(ops: Iterable[str], *, chain: bool = True) -> set[str]:
    """Every `<op>.<metric>` and `chain.<metric>` key a run of `ops` can report (the
    harness's chain: the whole-chain comparison covers its K writer, scorer and top-k)."""
    stages = {s for op in ops for s in OPS[op].stages}
    out = {f"{op}.{n}" for op in ops for n in METRICS if op_emits(n, op)}
    in_chain = stages & {"k_writer", "pool_k", "scorer", "topk"}
    if chain and in_chain:
        for n, m in METRICS.items():
            if m.chain is None:
                continue
            src = _CLASS_STAGES.get(n) or ((m.stage,) if m.stage != ANY else tuple(in_chain))
            if set(src) & in_chain:
                out.add(chain_key(n))
    return out


def required_keys(keys: Iterable[str]) -> list[str]:
    """The keys among `keys` whose metric a budgets file must bound."""
    out = []
    for k in keys:
        m = METRICS.get(bare(k))
        if m is None:
            continue
        if is_chain(k):
            if m.chain in ("required", "only"):
                out.append(k)
        elif m.required:
            out.append(k)
    return sorted(out)


def reported_keys(ops: Iterable[str], *, chain: bool = True) -> list[str]:
    """The keys every run of `ops` reports: the required ones, less those reported only when
    the op is asked for them (`conditional`). A stored row that lacks one was edited."""
    return [k for k in required_keys(run_keys(ops, chain=chain)) if not METRICS[bare(k)].conditional]


# --- limits and the judge ------------------------------------------------------------

def fmt(v: float) -> str:
    return f"{v:.6g}" if isinstance(v, float) and not float(v).is_integer() else f"{v:g}"


def _exact(v: float) -> str:
    """`fmt(v)` when it reads back as `v`, else the shortest text that does."""
    s = fmt(v)
    return s if float(s) == float(v) else repr(float(v))


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Limit:
    """Bounds of one metric: `max` and/or `min`. Both None: "off" (explicitly not judged)."""
    max: Optional[float] = None
    min: Optional[float] = None

    @property
    def off(self) -> bool:
        return self.max is None and self.min is None

    def violated(self, value) -> Optional[str]:
        """None when `value` holds, else why not. NaN never holds a limit."""
        if value is None or self.off:
            return None
        v = float(value)
        if math.isnan(v):
            return "is NaN"
        if self.max is not None and v > self.max:
            return f"{fmt(v)} > {fmt(self.max)}"
        if self.min is not None and v < self.min:
            return f"{fmt(v)} < {fmt(self.min)}"
        return None

    def text(self) -> str:
        """"<= 1", ">= 0.99", "<= 1 and >= 0" or "off"; each number round-trips exactly
        (a report's recorded budgets are parsed back to recompute its verdicts)."""
        parts = ([f"<= {_exact(self.max)}"] if self.max is not None else []) + \
                ([f">= {_exact(self.min)}"] if self.min is not None else [])
        return " and ".join(parts) or "off"

    @classmethod
    def from_text(cls, text) -> "Limit":
        """The Limit `text()` wrote ("<= 1", ">= 0.99", "<= 1 and >= 0", "off"); ValueError
        when it is no such text (or names a bound that is not a finite number)."""
        if text == "off":
            return OFF
        bad = ValueError(f"expected a limit text such as \"<= 0\", got {text!r:.60}")
        if not isinstance(text, str):
            raise bad
        bounds: dict = {}
        for part in text.split(" and "):
            op, _, num = part.strip().partition(" ")
            try:
                v = float(num) if op in ("<=", ">=") and num.strip() == num and num else math.nan
            except ValueError:
                v = math.nan
            if not math.isfinite(v) or op in bounds:
                raise bad
            bounds[op] = v
        return cls(max=bounds.get("<="), min=bounds.get(">="))

    @classmethod
    def parse(cls, name: str, v) -> "Limit":
        """A budget value for metric `name`: a number (bounds the bad side), {max, min}, "off"
        or a Limit. ValueError (without file context) when malformed or impossible to meet."""
        m = metric(name)
        if isinstance(v, Limit):
            lim = v
        elif isinstance(v, str) and v == "off":
            return OFF
        elif _num(v):
            if math.isnan(v):
                raise ValueError("NaN is no limit (it would pass any value)")
            if m.kind == "info":
                raise ValueError(f"{name} has no bad side; give {{max = .., min = ..}}")
            lim = cls(min=float(v)) if m.higher_is_better else cls(max=float(v))
        elif isinstance(v, dict) and v and not set(v) - {"max", "min"}:
            if not all(_num(x) for x in v.values()):
                raise ValueError(f"max and min must be numbers, got {v!r}")
            if any(math.isnan(x) for x in v.values()):
                raise ValueError("NaN is no limit (it would pass any value)")
            lim = cls(max=float(v["max"]) if "max" in v else None, min=float(v["min"]) if "min" in v else None)
        else:
            raise ValueError(f"expected a number, {{max = .., min = ..}} or \"off\", got {v!r}")
        if any(x is not None and math.isinf(x) for x in (lim.max, lim.min)):
            raise ValueError("an infinite limit checks nothing: say \"off\" (every report shows it)")
        if lim.max is not None and lim.min is not None and lim.min > lim.max:
            raise ValueError(f"min {fmt(lim.min)} > max {fmt(lim.max)}, no value can pass")
        for bound, v, useless in (("max", lim.max, lim.max is not None and lim.max > m.hi),
                                  ("min", lim.min, lim.min is not None and lim.min < m.lo)):
            if useless:                       # past the metric's range: every value it can take passes
                raise ValueError(f"{bound} {fmt(v)} is outside {name}'s range [{fmt(m.lo)}, {fmt(m.hi)}]: it checks "
                                 "nothing (say \"off\" to drop the check, and every report shows it)")
        if lim.max is not None and lim.max < m.lo:
            raise ValueError(f"max {fmt(lim.max)} is below {fmt(m.lo)}, the least {name} can be: no value can pass")
        if lim.min is not None and lim.min > m.hi:
            raise ValueError(f"min {fmt(lim.min)} is above {fmt(m.hi)}, the most {name} can be: no value can pass")
        return lim


OFF = Limit()
_ZERO = Limit(max=0.0)


def default_limit(name: str) -> Optional[Limit]:
    """The limit of a metric no budget names: <= 0 for always-fail metrics, else none."""
    m = METRICS.get(name)
    return _ZERO if m is not None and m.always_fail else None


def _jsonable(v):
    f = float(v)
    return None if math.isnan(f) else (int(f) if f.is_integer() and abs(f) < 2 ** 53 else f)


def judge(metrics: dict, limit_of: Callable[[str], Optional[Limit]]) -> list[dict]:
    """Every metric that breaks its limit: [{metric, value, limit, why}], op stages first,
    then `chain.*`. `limit_of(key)` gives the budget of a key (None: no budget; OFF: turned
    off). Without a budget, always-fail metrics must be 0; others are not judged."""
    out = []
    for key, value in sorted(metrics.items(), key=lambda kv: (is_chain(kv[0]), kv[0])):
        lim = limit_of(key)
        if lim is None:
            lim = default_limit(bare(key))
        why = lim.violated(value) if lim is not None else None
        if why:
            out.append({"metric": key, "value": _jsonable(value), "limit": lim.text(), "why": why})
    return out


REPRO_REL = 1e-9      # ratio and min metrics are fp64 sums: another device sums in another order


def not_reproduced(logged: dict, again: dict) -> dict:
    """{key: (logged, again)} for the metrics of a replay that differ from a logged row's
    beyond what another device may change: counts and maxima exactly (elementwise, the
    same on every device); the ratio and min kinds (fp64 sums over rows and entries, which
    a GPU and a CPU add in different orders) to REPRO_REL relative. A key on one side only
    differs; NaN equals NaN."""
    out = {}
    for key in sorted({*logged, *again}):
        a, b = logged.get(key), again.get(key)
        if a == b or (_num(a) and _num(b) and a != a and b != b):
            continue
        m = METRICS.get(bare(key))
        if (m is not None and m.kind in ("ratio", "min") and _num(a) and _num(b)
                and abs(a - b) <= REPRO_REL * max(abs(a), abs(b))):
            continue
        out[key] = (a, b)
    return out


def aggregate(name: str, values: list) -> float:
    """One case value from the per-step values of metric `name` (bare or `<stage>.<name>`):
    counts summed, max/ratio maxima, min minima. NaN in any step is NaN."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return float("nan")
    if any(math.isnan(v) for v in vals):
        return float("nan")
    kind = metric(bare(name)).kind
    if kind in ("count", "info"):
        return sum(vals)
    if kind == "min":
        return min(vals)
    return max(vals)
