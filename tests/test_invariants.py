"""The invariants that need no reference (harness/diff/invariants.py), on hand-built outputs:
a correct output passes at every edge (rows of length 0, shorter than k, exactly k, longer),
and each broken invariant is counted and named."""
import pytest
import torch
from test_faults import PS, RATIO, SHUFFLE, make_case

import reference
from harness.diff import invariants as I
from harness.diff.metrics import METRICS, default_limit
from reference import layout
from reference.k_writer import writer_mask

K = 8


def _topk(idx, lengths, k=K, **kw):
    return I.check("topk", {"logits": torch.zeros(len(lengths), 32), "lengths": torch.tensor(lengths)},
                   {"k": k}, {"indices": torch.tensor(idx, dtype=torch.int32)}, **kw)


def _checks(rep) -> dict:
    out: dict = {}
    for f in rep.findings:
        out[f["invariant"]] = out.get(f["invariant"], 0) + 1
    return out


def _row(valid, k=K):
    return list(valid) + [-1] * (k - len(valid))


def test_a_correct_topk_passes_at_every_edge():
    lengths = [0, 1, 3, K - 1, K, K + 1, 20, 32]
    rows = [_row([]), _row([0]), _row([2, 0, 1]), _row(list(range(K - 1))[::-1]),
            list(range(K))[::-1], [8, 0, 1, 2, 3, 4, 5, 7], [19, 3, 11, 0, 5, 7, 13, 2],
            [31, 30, 29, 28, 0, 1, 2, 3]]
    rep = _topk(rows, lengths)
    assert rep.metrics["invariant_violations"] == 0 and not rep.findings, rep.summary()
    # k wider than every row: all padding, still exact
    rep = _topk([_row([0, 1], 64), _row([], 64)], [2, 0], k=64)
    assert rep.metrics["invariant_violations"] == 0, rep.summary()
    # no rows at all
    rep = I.check("topk", {"logits": torch.zeros(0, 4), "lengths": torch.zeros(0, dtype=torch.int32)},
                  {"k": K}, {"indices": torch.zeros(0, K, dtype=torch.int32)})
    assert rep.metrics["invariant_violations"] == 0


@pytest.mark.parametrize("row,length,check,n", [
    ([20, 1, 2, 3, 4, 5, 6, 7], 20, "topk_range", 1),              # index == length
    ([-2, 1, 2, 3, 4, 5, 6, 7], 20, "topk_range", 1),              # below -1
    (_row([0, 1, 3]), 3, "topk_range", 1),                         # 3 in a row of 3
    ([5, 5, 2, 3, 4, 0, 6, 7], 20, "topk_duplicates", 1),
    ([0, -1, 1, 2, -1, -1, -1, -1], 3, "topk_padding", 1),        # -1 before an index
    ([0, 1, 2, 3, 4, 5, 6, -1], 20, "topk_count", 1),              # a long row padded
    (_row([0, 1]), 3, "topk_count", 1),                            # a short row missing one
    (list(range(K)), K - 1, "topk_range", 1),                      # one past a row of k - 1
])
def test_each_broken_topk_invariant_is_named(row, length, check, n):
    rep = _topk([row], [length])
    assert _checks(rep).get(check) == n, rep.summary()
    assert rep.metrics["invariant_violations"] >= n and rep.metrics["class_invariant"] >= n
    f = next(x for x in rep.findings if x["invariant"] == check)
    assert f["class"] == "invariant" and f["row"] == 0 and f["where"].startswith(check)
    if check in ("topk_range", "topk_duplicates"):                # the offending column and index named
        assert row[f["col"]] == f["index"] and f["length"] == length
    assert any(n.startswith("invariants broken: ") and check in n for n in rep.notes)


def test_topk_shape_and_dtype():
    lengths = torch.tensor([3, 20])
    ins = {"logits": torch.zeros(2, 32), "lengths": lengths}
    for bad in (torch.zeros(2, K, dtype=torch.int64), torch.zeros(2, K - 1, dtype=torch.int32),
                torch.zeros(3, K, dtype=torch.int32), torch.zeros(2 * K, dtype=torch.int32)):
        rep = I.check("topk", ins, {"k": K}, {"indices": bad})
        assert _checks(rep) == {"topk_shape": 1}, rep.summary()
    rep = I.check("topk", ins, {"k": K}, {})
    assert _checks(rep) == {"topk_shape": 1}


def _logits(rows, ends, clean, **kw):
    return I.check("paged_mxfp4_mqa_logits", {"row_ends": torch.tensor(ends)}, {"clean_logits": clean},
                   {"logits": torch.tensor(rows, dtype=torch.float32)}, **kw)


NINF, NAN, INF = float("-inf"), float("nan"), float("inf")


def test_correct_logits_pass_clean_and_not():
    rows = [[NINF] * 4, [1.0, NINF, NINF, NINF], [0.0, -2.0, 3.0, 4.0]]      # ends 0, 1, 4 (full)
    assert _logits(rows, [0, 1, 4], True).metrics["invariant_violations"] == 0
    # without clean_logits the columns past the end are unspecified: anything goes there
    rows = [[NAN, 7.0, INF, 0.0], [1.0, NAN, 3.0, 5.0], [0.0, -2.0, 3.0, 4.0]]
    assert _logits(rows, [0, 1, 4], False).metrics["invariant_violations"] == 0


def test_logits_past_end_and_nonfinite_before_it():
    rep = _logits([[1.0, 0.0, NINF], [2.0, NAN, NINF]], [1, 1], True)
    assert _checks(rep) == {"logits_past_end": 2}, rep.summary()         # one a row, both named
    assert rep.metrics["invariant_violations"] == 2
    f = rep.findings[0]
    assert (f["row"], f["col"]) == (0, 1)
    rep = _logits([[1.0, NAN, NINF], [INF, 2.0, NINF]], [2, 2], True)
    assert _checks(rep) == {"logits_finite": 2}
    # a case that declares non-finite inputs: NaN before the end is allowed, past it not
    rep = _logits([[1.0, NAN, NAN], [INF, 2.0, NINF]], [2, 2], True, declared_nonfinite=True)
    assert _checks(rep) == {"logits_past_end": 1}, rep.summary()


def test_logits_shape():
    rep = _logits([[1.0, NINF]], [3], True)                  # a row end past the width
    assert _checks(rep) == {"logits_shape": 1}


@pytest.fixture(scope="module")
def case():
    return make_case(seed=5)


def _pages(kw, out, op="k_norm_rope_mxfp4_cache", **extra):
    scalars = {"compress_ratio": RATIO, "page_size": PS, "shuffle": kw.get("shuffle"), **extra}
    return I.check(op, kw, scalars, {"kv_cache": out}, declared_nonfinite=extra.pop("nf", False))


def _owned_scale(kw):
    sel = writer_mask(kw["positions"], kw["slot_mapping"], RATIO)
    slots = kw["slot_mapping"][sel]
    _, so = layout.slot_byte_offsets(slots, PS, kw["k"].shape[1], layout.as_shuffle(SHUFFLE), kw["kv_cache"].shape[1])
    return slots, so


def test_a_written_page_passes_and_outside_bytes_are_caught(case):
    kw = case["k_norm_rope_mxfp4_cache"]
    out = reference.k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    assert _pages(kw, out).metrics["invariant_violations"] == 0
    owned = layout.owned_mask(*out.shape, _owned_scale(kw)[0], page_size=PS, head_dim=kw["k"].shape[1],
                              shuffle=SHUFFLE)
    bad = out.clone()
    off = int((~owned).flatten().nonzero()[3])
    bad.view(-1)[off] ^= 0x10
    rep = _pages(kw, bad)
    assert _checks(rep) == {"page_outside_owned": 1} and rep.findings[0]["offset"] == off, rep.summary()
    rep = _pages(kw, out[:-1])
    assert _checks(rep) == {"page_shape": 1}


def test_scale_codes_of_written_entries(case):
    kw = case["k_norm_rope_mxfp4_cache"]
    out = reference.k_norm_rope_mxfp4_cache(**kw)["kv_cache"]
    _, so = _owned_scale(kw)
    for code, ceil_bad, other_bad in ((255, 1, 1), (254, 1, 0), (0, 1, 0), (253, 0, 0), (1, 0, 0)):
        bad = out.clone()
        bad.view(-1)[int(so[-1, 2])] = code
        assert _checks(_pages(kw, bad)).get("scale_code", 0) == ceil_bad, code
        assert _checks(_pages(kw, bad, scale_rule="ocp-floor")).get("scale_code", 0) == other_bad, code
    # an entry whose input row is NaN may store any scale where the case declares non-finite inputs
    sel = writer_mask(kw["positions"], kw["slot_mapping"], RATIO).nonzero().flatten()
    k_nan = kw["k"].clone()
    k_nan[int(sel[-1])] = float("nan")
    bad = out.clone()
    bad.view(-1)[int(so[-1, 2])] = 255
    assert _checks(_pages(dict(kw, k=k_nan), bad, nf=True)) == {}
    bad.view(-1)[int(so[0, 0])] = 255                      # a finite row's scale is still checked
    assert _checks(_pages(dict(kw, k=k_nan), bad, nf=True)) == {"scale_code": 1}


def test_fp8_scales_finite_and_positive():
    c = make_case(seed=2)
    kw = dict(c["k_norm_rope_mxfp4_cache"])
    kw.pop("shuffle")
    d = kw["k"].shape[1]
    pages = 6
    kw["kv_cache"] = torch.randint(0, 256, (pages, PS * (d + 4)), dtype=torch.uint8)
    pos = kw["positions"]
    kw["slot_mapping"] = (pos // RATIO // PS) * PS + (pos // RATIO) % PS
    out = reference.k_norm_rope_fp8_cache(**kw)["kv_cache"]
    sc = {"compress_ratio": RATIO, "page_size": PS}
    assert I.check("k_norm_rope_fp8_cache", kw, sc, {"kv_cache": out}).metrics["invariant_violations"] == 0
    slot = int(kw["slot_mapping"][writer_mask(pos, kw["slot_mapping"], RATIO)][0])
    at = (slot // PS) * out.shape[1] + PS * d + (slot % PS) * 4
    for v in (0.0, -1.0, float("nan"), float("inf")):
        bad = out.clone()
        bad.view(-1)[at:at + 4] = torch.tensor([v], dtype=torch.float32).view(torch.uint8)
        rep = I.check("k_norm_rope_fp8_cache", kw, sc, {"kv_cache": bad})
        assert _checks(rep) == {"scale_code": 1}, (v, rep.summary())


def test_q_scale_codes(case):
    qw = case["q_rope_mxfp4_quant"]
    out = reference.q_rope_mxfp4_quant(**qw)
    assert I.check("q_rope_mxfp4_quant", qw, {}, out).metrics["invariant_violations"] == 0
    bad = dict(out, q_scale=out["q_scale"].clone())
    bad["q_scale"][1, 2, 0] = 255
    rep = I.check("q_rope_mxfp4_quant", qw, {}, bad)
    assert _checks(rep) == {"scale_code": 1} and rep.findings[0]["index"] == [1, 2, 0]
    q = qw["q"].clone()
    q[1, 2, 5] = float("inf")                               # that (token, head) is declared non-finite
    assert _checks(I.check("q_rope_mxfp4_quant", dict(qw, q=q), {}, bad, declared_nonfinite=True)) == {}
    assert _checks(I.check("q_rope_mxfp4_quant", dict(qw, q=q), {}, bad)) == {"scale_code": 1}


def test_the_table_and_the_metric():
    assert METRICS["invariant_violations"].always_fail and default_limit("invariant_violations").max == 0
    assert "class_invariant" in METRICS
    assert {i.name for i in I.applies("topk")} == {"topk"}
    assert I.applies("compress_pool") == ()
    assert "invariant_violations" not in I.check("compress_pool", {}, {}, {}).metrics
    for inv in I.INVARIANTS:                                   # every check an invariant files is declared
        assert inv.doc and all(c in I.CHECKS for c in I.CHECKS if c in inv.doc)
    assert all(any(c in inv.doc for inv in I.INVARIANTS) for c in I.CHECKS)
