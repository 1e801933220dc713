"""`mxval study`: what the quantized indexer's selection keeps against the exact one.

inputs (generated distributions, needles) < metrics < variants < core (the runs) < report
< command (one call: run, render, write)."""
from harness.study.core import STUDY_FILE, StudyConfig, load_config, row_entries, run_study, study_dump
from harness.study.inputs import Distribution, draw, input_stats, make_inputs, make_needles
from harness.study.metrics import (
    ExactTopK,
    SparseAttention,
    bootstrap,
    head_scores,
    indexer_logits,
    needles_kept,
    noise_metrics,
    row_metrics,
    select,
)
from harness.study.report import render, summary_markdown
from harness.study.variants import VARIANTS, Variant, key_side, ordered, query_side

__all__ = ["STUDY_FILE", "StudyConfig", "load_config", "row_entries", "run_study", "study_dump", "Distribution",
           "draw", "input_stats", "make_inputs", "make_needles", "ExactTopK", "SparseAttention", "bootstrap",
           "head_scores", "indexer_logits", "needles_kept", "noise_metrics", "row_metrics", "select", "render",
           "summary_markdown", "VARIANTS", "Variant", "key_side", "ordered", "query_side"]
