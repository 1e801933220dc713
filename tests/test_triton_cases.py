"""The judge of the backend tests (tests/helpers.py: `cases`, `compare`, which is the product's
diff engine under the default budgets) has teeth: each rule fails on the fault it exists for."""
from __future__ import annotations

import torch
from helpers import RATIO, D, cases, compare, k_writer_case, logits_case, pool_case, topk_case

import reference
from reference import layout, scoring

# --- the rules have teeth ----------------------------------------------------------------

def test_byte_rule_catches_a_touched_unowned_byte():
    kw = k_writer_case()
    got = reference.k_norm_rope_mxfp4_cache(**kw)
    assert compare("k_norm_rope_mxfp4_cache", got, kw) == []
    owned = layout.owned_mask(kw["kv_cache"].shape[0], kw["kv_cache"].shape[1],
                              kw["slot_mapping"][kw["slot_mapping"] >= 0], page_size=32, head_dim=D,
                              shuffle=kw["shuffle"])
    got["kv_cache"].view(-1)[(~owned).view(-1).nonzero()[-1]] ^= 1   # the padding's last byte
    assert any("page_bytes_outside_owned_changed 1 > 0" in p for p in compare("k_norm_rope_mxfp4_cache", got, kw))


def test_pool_rule_catches_one_ulp():
    kw = pool_case()
    got = reference.compress_pool(**kw)
    row = (~got["pooled"].isnan().any(1)).nonzero()[0]
    got["pooled"].view(torch.int16)[row, 3] += 1
    assert compare("compress_pool", got, kw)


def test_metric_rule_catches_a_small_error_and_a_missing_mask():
    kw = dict(logits_case(), clean_logits=True)
    ref = scoring.paged_mxfp4_mqa_logits_fp64(**kw).float()
    assert compare("paged_mxfp4_mqa_logits", {"logits": ref.clone()}, kw) == []
    bad = ref.clone()
    bad[bad.isfinite()] *= 1 + 1e-5                 # a 1e-5 relative error: metric ~ 2.5e-11
    assert "scorer.logits_diff" in compare("paged_mxfp4_mqa_logits", {"logits": bad}, kw)[0]
    bad = ref.clone()
    bad[bad.isneginf()] = 0.0
    assert "scorer.logits_inf_pattern_mismatch" in compare("paged_mxfp4_mqa_logits", {"logits": bad}, kw)[-1]


def test_topk_rule_catches_duplicates_padding_and_low_scores():
    kw = topk_case()
    idx = reference.topk(**kw)["indices"]
    assert compare("topk", {"indices": idx}, kw) == []
    for r, fix in ((0, lambda row: row.__setitem__(1, row[0])),          # duplicate
                   (3, lambda row: row.__setitem__(-1, 0)),               # wrong -1 padding
                   (0, lambda row: row.__setitem__(0, int(kw["logits"][0].argmin())))):
        bad = idx.clone()
        fix(bad[r])
        assert compare("topk", {"indices": bad}, kw), r


def test_cases_cover_the_edge_cases():
    ids = [c[0] for c in cases()]
    assert len(ids) == len(set(ids))
    kw = k_writer_case()
    sel = reference.k_writer.writer_mask(kw["positions"], kw["slot_mapping"], RATIO)
    assert bool(sel.any()) and bool((~sel & ((kw["positions"] + 1) % RATIO == 0)).any())  # a skipped boundary
    assert kw["kv_cache"].shape[1] > 32 * layout.entry_bytes(D)                             # padded pages
    assert int(kw["positions"][0]) == 3                                                     # j = 0
