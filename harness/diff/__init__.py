"""The diff engine: classified, localized differences between two outputs of an indexer op.

A small public API (also for other projects' pytest tests):

    from harness.diff import diff_pages, diff_pooled, diff_q, diff_logits, diff_topk, diff_op
    rep = diff_pages(actual, expected, before, page_size=64, head_dim=128,
                     shuffle=[32, 16, 2], written_slots=slots)
    rep.raise_if_failed({"page_bytes_mismatched": 0})   # AssertionError with the summary

Every function returns a `DiffReport`: `metrics` (name -> float; the class count of each
finding class is a metric too, `class_<name>`), `findings` (the first MAX_FINDINGS, each a
dict with a `class` and a human `where`), `notes`.

Metrics are declared once, in the metric table `harness.diff.metrics.METRICS` (stage, kind,
better side, how steps combine, whether a budgets file must bound it). Budgets: a number
bounds a metric's bad side (`value <= budget`; `value >= budget` for the `*_min` metrics
where larger is better), `{"max": .., "min": ..}` gives both, `"off"` turns a check off. One
judge (`metrics.judge`) decides for `DiffReport.failures` and for mxval's reports alike. A
metric without a budget is not judged, except those in ALWAYS_FAIL (non-finite inputs or
outputs, missing or misshapen outputs), which fail whenever they are non-zero: never a
silent pass. A budget naming a metric the table does not know is a ValueError. Every
function checks its arguments first: a ValueError naming the argument, never a crash.

`harness.diff.invariants.check(op, inputs, scalars, actual)` checks what needs no
reference (top-k structure, -inf past row ends with clean logits, no byte outside the
written slots, scale codes the format defines): metric `invariant_violations`, findings of
class `invariant` naming the check (the runner runs it on every backend output).

Finding classes (the unit each one counts is in brackets):
  pages and Q (MXFP4): signed_zero (0x0 vs 0x8 nibble) [byte], one_step (codes adjacent on the
  e2m1 line, +-0 counting as one point) [byte], nibbles_swapped (actual = expected with its
  nibbles exchanged) [byte], value_other [byte], scale_off_by_k (e8m0 differs by k; `values`
  says whether the block's codes are equal, consistent with the other scale, or not) [scale
  block], scale_interleave (same multiset of scale bytes in an entry, wrong positions) [entry],
  not_written (every owned byte still holds its old value) [entry], outside_owned_write (a
  byte no written slot owns changed) [byte]. A byte with two differing nibbles takes the worse
  class (value_other > one_step > signed_zero). Value bytes of a block whose scale differs
  and whose codes are consistent with that scale are counted in the metrics but filed under
  the scale finding. FP8 pages and Q: the same names; scale_other when a scale is not a
  power-of-two multiple of the expected one.
"""
from .metrics import ALWAYS_FAIL, METRICS, Limit, aggregate, higher_is_better, judge, metric
from .ops import diff_op, writer_slots
from .pages import diff_pages
from .report import MAX_FINDINGS, DiffReport
from .rows import diff_pooled, diff_q
from .scores import diff_logits, diff_topk

__all__ = ["ALWAYS_FAIL", "METRICS", "MAX_FINDINGS", "DiffReport", "Limit", "aggregate", "diff_logits",
           "diff_op", "diff_pages", "diff_pooled", "diff_q", "diff_topk", "higher_is_better", "judge",
           "metric", "writer_slots"]
