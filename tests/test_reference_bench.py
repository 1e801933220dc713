"""The benchmark's inputs and table (its timings run under `make bench`, never here)."""
import torch

from harness.bench import reference as bench
from reference import layout


def test_bench_inputs_have_per_entry_scale_levels():
    kw = bench._scoring_inputs(torch.device("cpu"), seqs=2, entries=256, heads=4)
    packed, scales = layout.read_pages(kw["kv_cache"], kw["block_table"][0], page_size=64, head_dim=128,
                                       shuffle=kw["shuffle"])
    spread = scales.int().amax(-1) - scales.int().amin(-1)
    assert int(spread.max()) <= 1 and int(scales.min()) >= 118      # the intended per-vector levels
    assert sorted(kw["block_table"].flatten().tolist()) == list(range(kw["kv_cache"].shape[0]))


def test_table_names_the_machine_and_judges_targets():
    info = {"cpu": "Some CPU", "cores": 2, "torch_threads": 2, "torch": "2.x", "python": "3.x", "load": 0.5}
    res = {"cpu": {"k_path": {"k_path_s": 0.6, "entries": 4096, "peak_rss_gib": 0.4},
                   "scoring": {"score_s": 1.0, "ratio": 3.0, "peak_score_gib": 0.5, "max_rel_err_vs_fp64": 0.0,
                               "topk_valid": True, "mm_loop_s": 0.3, "mm_bmm_s": 0.4, "mm_same_s": 0.2,
                               "ratio_same": 5.0, "fast_fraction": 1.0, "gflop": 34.4, "import_rss_gib": 0.2}}}
    text = bench.table(info, res)
    assert "Some CPU, 2 cores" in text and "2.x" in text
    rows = [line for line in text.splitlines() if line.startswith("| cpu")]
    assert rows[0].endswith("| no |") and rows[1].endswith("| yes |")
    res["cpu"]["scoring"]["max_rel_err_vs_fp64"] = 1e-9                  # inaccurate scores fail
    scoring_row = next(l for l in bench.table(info, res).splitlines() if l.startswith("| cpu | scoring"))
    assert scoring_row.endswith("| no |")
