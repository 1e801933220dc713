"""Reports: one DataFrame, every format rendered from it, and re-rendered from report.json."""
import json
import re
from xml.etree import ElementTree as ET

import pandas as pd
import pytest
import torch
from rich.console import Console

import reference
from harness.io import report
from harness.run.budgets import load, verdict
from harness.run.cases import Catalog
from harness.run.runner import run_case
from optimized import Backend, register
from reference import layout
from reference.k_writer import writer_mask


def _flip(**a):
    out = reference.k_norm_rope_mxfp4_cache(**a)
    slots = a["slot_mapping"][writer_mask(a["positions"], a["slot_mapping"], a["compress_ratio"])]
    pool = out["kv_cache"].clone()
    for s in slots[:3].tolist():
        page, entry = divmod(s, a["page_size"])
        pool[page, layout.value_offsets(torch.tensor(entry), a["page_size"], 128, a["shuffle"])[0]] ^= 0x11
    return {"kv_cache": pool}


@pytest.fixture(scope="module")
def frame():
    register("test-report-flip", lambda: Backend("test-report-flip", "t", dict(reference.FUNCTIONS, k_norm_rope_mxfp4_cache=_flip)))
    cat, b = Catalog(), load()
    rows = [run_case(cat.case("smoke-rowend-k"), "reference"),
            run_case(cat.case("smoke-chunk-edges"), "test-report-flip"),
            run_case(cat.case("smoke-nan-state"), "reference"),
            run_case(cat.case("full-pool-2gib"), "reference")]
    return report.frame([verdict(r, b, "smoke") for r in rows])


META = {"command": "validate", "suite": "smoke", "backend": "mixed", "machine": "test", "seconds": 1.5,
        "budgets": {"path": "cases/budgets.toml"}}


def test_one_frame_every_format(frame, tmp_path):
    assert list(frame["status"]) == ["pass", "fail", "nonfinite_input",
                                     "skipped" if not torch.cuda.is_available() else frame["status"][3]]
    paths = report.write_all(frame, META, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert (data["schema"], data["version"]) == ("mxval-report", 1)
    assert data["summary"]["fail"] == 1 and data["summary"]["ok"] is False
    bad = data["cases"][1]
    assert bad["metrics"]["k_norm_rope_mxfp4_cache.page_bytes_mismatched"] > 0
    assert {"case", "status", "ok", "reason", "violations", "findings", "metrics", "details"} <= set(bad)
    md = (tmp_path / "report.md").read_text()
    assert "FAILED" in md and "smoke-chunk-edges" in md and "page_bytes_mismatched" in md
    page_entry = [f for f in bad["findings"] if f["stage"] == "k_norm_rope_mxfp4_cache"][0]
    assert f"page {page_entry['page']} entry {page_entry['entry']}" in md
    html = (tmp_path / "report.html").read_text()
    assert not re.search(r"(src|href)=['\"]https?:", html)
    assert html.count("data:image/png;base64,") >= 1 and "Mismatch map of smoke-chunk-edges" in html
    suite = ET.fromstring((tmp_path / "junit.xml").read_text())
    assert suite.get("tests") == "4" and suite.get("failures") == "1"
    assert len(suite.findall("testcase/failure")) == 1
    csv = pd.read_csv(paths["csv"])
    assert "k_norm_rope_mxfp4_cache.page_bytes_mismatched" in csv.columns and len(csv) == 4


def test_rerender_from_json_is_identical(frame, tmp_path):
    report.write_all(frame, META, tmp_path / "a")
    df, meta = report.load(tmp_path / "a")
    assert meta == json.loads((tmp_path / "a" / "report.json").read_text())["run"]
    report.write_all(df, meta, tmp_path / "b")
    for name in ("report.md", "junit.xml", "report.json"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text(), name


def test_console_table(frame):
    con = Console(record=True, width=200)
    report.console_table(frame, META, con)
    text = con.export_text()
    assert "smoke-chunk-edges" in text and "FAILED" in text and "nonfinite_input" in text


def test_load_rejects_foreign_json(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="not an mxval report"):
        report.load(tmp_path)


# --- what a selection keeps: the "does it matter" block --------------------------------------

def test_selection_metrics_lost_key_tie_swap_and_exact():
    from harness.diff.scores import diff_topk, mass_kept, score_weights
    g = torch.Generator().manual_seed(5)
    s = torch.randn(3, 600, generator=g, dtype=torch.float64)
    lens = torch.tensor([600, 600, 40])
    k = 300
    exact = reference.topk(logits=s, lengths=lens, k=k)["indices"]
    rep = diff_topk(exact, s, lens, k)
    m = rep.metrics
    assert (m["topk_recall_min"], m["topk_mass_kept_min"], m["topk_top64_kept_min"],
            m["topk_top256_kept_min"]) == (1, 1, 1, 1)
    assert "topk_rank_lost_min" not in m                     # nothing lost
    # drop the row's best key for the worst one: one key lost, at exact rank 1
    lost = exact.clone()
    order = s[0].argsort(descending=True)
    lost[0][lost[0] == order[0]] = int(order[-1])
    m = diff_topk(lost, s, lens, k).metrics
    w = score_weights(s[:1], torch.ones(1, 600, dtype=torch.bool))
    want = 1 - float(w[0, order[0]] - w[0, order[-1]]) / float(w[0, order[:k]].sum())   # the worst key weighs too
    assert m["topk_recall_min"] == pytest.approx(1 - 1 / k) and m["topk_rank_lost_min"] == 1
    assert m["topk_mass_kept_min"] == pytest.approx(want, rel=1e-6) and m["topk_mass_kept_min"] < 1
    assert m["topk_top64_kept_min"] == pytest.approx(63 / 64) and m["topk_top256_kept_min"] == pytest.approx(255 / 256)
    # the 200th key lost instead: the top-64 is whole, the top-256 is not, rank 200
    lost = exact.clone()
    lost[0][lost[0] == order[199]] = int(order[-1])
    m = diff_topk(lost, s, lens, k).metrics
    assert m["topk_rank_lost_min"] == 200 and m["topk_top64_kept_min"] == 1
    assert m["topk_top256_kept_min"] == pytest.approx(255 / 256)
    # a tie swap: the k-th and (k+1)-th score equal, the selection holds the other one
    t = s.clone()
    t[1, order_1 := s[1].argsort(descending=True)[k]] = s[1, s[1].argsort(descending=True)[k - 1]]
    idx = reference.topk(logits=t, lengths=lens, k=k)["indices"].clone()
    kth = s[1].argsort(descending=True)[k - 1]
    idx[1][idx[1] == kth] = int(order_1)
    rep = diff_topk(idx, t, lens, k)
    assert rep.metrics["class_tie_swap"] == 1 and rep.metrics["topk_recall_min"] == 1
    assert "topk_rank_lost_min" not in rep.metrics and rep.metrics["topk_mass_kept_min"] == pytest.approx(1)
    # top-m is only emitted below k
    assert "topk_top64_kept_min" not in diff_topk(exact[:, :8].contiguous(), s, lens.clamp(max=8), 8).metrics
    # mass_kept with heads: the study's formula (selection mass over the exact selection's, summed over heads)
    p = torch.softmax(torch.randn(2, 4, 50, generator=g, dtype=torch.float64), -1)
    sel, ex = torch.arange(10).expand(2, 10), p.sum(1).topk(10, dim=1).indices
    want = p.gather(2, sel[:, None, :].expand(2, 4, 10)).sum((1, 2)) / p.gather(2, ex[:, None, :].expand(2, 4, 10)).sum((1, 2))
    assert torch.allclose(mass_kept(p, sel, ex), want.clamp(max=1))


@pytest.fixture(scope="module")
def fault_frame():
    """A K-writer fault: every stage's selection is the reference's on the backend's logits,
    while the whole chain loses keys."""
    cat, b = Catalog(), load()
    rows = [run_case(cat.case(n), "fault:nibbles-swapped") for n in ("smoke-fp8", "smoke-rowend-k", "smoke-chunk-edges")]
    return report.frame([verdict(r, b, "smoke") for r in rows])


def test_the_chain_loss_is_in_every_table(fault_frame, tmp_path):
    df = fault_frame
    lost = df[df["case"] == "smoke-rowend-k"].iloc[0]
    assert lost["topk.topk_recall_min"] == 1 and lost["chain.topk_recall_min"] < 1
    chain_recall = report._fmt(lost["chain.topk_recall_min"])
    chain_mass = report._fmt(lost["chain.topk_mass_kept_min"])
    con = Console(record=True, width=250)
    report.console_table(df, META, con)
    text = con.export_text()
    row = next(ln for ln in text.splitlines() if "smoke-rowend-k" in ln and "fail" in ln)
    assert "chain recall" in text and "chain mass" in text
    assert f" {chain_recall} " in row and f" {chain_mass} " in row
    assert "does the difference matter?" in text and "keys lost" in text and "mass kept: the softmax" in text
    report.write_all(df, META, tmp_path)
    md = (tmp_path / "report.md").read_text()
    head = next(ln for ln in md.splitlines() if ln.startswith("| case | status"))
    row = next(ln for ln in md.splitlines() if ln.startswith("| smoke-rowend-k | fail"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert cells[cols.index("chain recall")] == chain_recall and cells[cols.index("chain mass")] == chain_mass
    assert cells[cols.index("top-k recall")] == "1"
    assert "Does the difference matter?" in md and "| smoke-rowend-k | chain |" in md
    html = (tmp_path / "report.html").read_text()
    for h in ("chain recall", "chain mass", "chain≠"):
        assert f"<th>{h}</th>" in html
    assert f">{chain_recall}</td>" in html
    data = json.loads((tmp_path / "report.json").read_text())
    case = next(c for c in data["cases"] if c["case"] == "smoke-rowend-k")
    assert case["selection"]["stage"]["verdict"] == report.IDENTICAL
    assert case["selection"]["chain"]["verdict"].startswith("keys lost: recall " + chain_recall)
    assert case["selection"]["chain"]["topk_rank_lost_min"] >= 1 and "mass kept" in data["selection_proxy"]


def _tie_row():
    return {"case": "tie", "suite": "s", "backend": "b", "status": "pass", "ok": True, "reason": "", "seconds": 0.1,
            "metrics": {"topk.topk_recall_min": 1.0, "topk.topk_mass_kept_min": 1.0,
                        "chain.topk_recall_min": 1.0, "chain.topk_mass_kept_min": 0.99999, "chain.class_tie_swap": 4.0,
                        "chain.topk_rows_not_exact_frac": 0.1},
            "details": {"recall_rows": [[40, 1.0, 1, 1.0]] * 5 + [[44, 1.0, 0, 0.99999]] * 4}}


def test_tie_swaps_are_shown_as_such(tmp_path):
    df = report.frame([_tie_row()])
    sel = report.selection(df.iloc[0])
    assert sel["stage"]["verdict"] == report.IDENTICAL
    assert sel["chain"]["verdict"].startswith("nothing lost: 4 tie swap(s)")
    con = Console(record=True, width=250)
    report.console_table(df, META, con)
    assert "4 tie swap(s)" in con.export_text()
    report.write_all(df, META, tmp_path)
    assert "4 tie swap(s)" in (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    assert "4 tie swap(s)" in html and "tie swap (another set the tie rule accepts): 4 rows" not in html  # in the PNG
    assert "a tie swap holds another set whose every index the rule accepts" in html
    # 0.99999 is not drawn as 1
    assert report._fmt(0.99999) == "0.99999" and report._fmt(1 - 1e-9) == "<1"


def test_html_structure(fault_frame, tmp_path):
    report.write_all(fault_frame, META, tmp_path)
    html = (tmp_path / "report.html").read_text()
    body = html[html.index("<tbody>"):html.index("</tbody>")]
    order = re.findall(r"<a href='#(case-[^']+)'>", body)
    assert order[:2] == ["case-smoke-rowend-k", "case-smoke-chunk-edges"] and order[-1] == "case-smoke-fp8"
    for slug in order:                               # every row links to its section
        assert html.count(f"id='{slug}'") == 1
    sec = html[html.index("id='case-smoke-rowend-k'"):html.index("id='case-smoke-chunk-edges'")]
    assert "whole chain: the backend&#x27;s chain against the reference chain" in sec
    assert "stage paged_mxfp4_mqa_logits: the backend against the reference" in sec
    assert "more findings listed" not in html and "<details class='findings'" in sec
    assert "<details open" not in html               # collapsed by default
    assert not re.search(r"(src|href)=['\"]https?:", html) and "<script src" not in html
    assert html.count("<section class='case") == len(fault_frame)


def test_heat_map_scale_starts_at_zero():
    """One mismatched byte beside 57 is visibly coloured (the scale starts at 0, not at the
    smallest count)."""
    import base64 as b64
    import io as _io

    import matplotlib.image as mpimg
    df = report.frame([{**_tie_row(), "case": "map", "details": {"mismatch_map": [[0, 0, 1], [0, 1, 57], [1, 2, 3]]}}])
    (case, cap, uri), = [f for f in report._figures(df) if f[0] == "map"]
    img = mpimg.imread(_io.BytesIO(b64.b64decode(uri.split(",", 1)[1])), format="png")[..., :3]
    pink = (abs(img[..., 0] - 0xf7 / 255) < 0.03) & (abs(img[..., 1] - 0xa0 / 255) < 0.06) & \
        (abs(img[..., 2] - 0x8a / 255) < 0.06)
    assert pink.sum() > 100, "a cell with 1 mismatched byte is not coloured"


def test_case_lines_for_logs(tmp_path, capsys):
    """One line per finished case when stdout is not a terminal; none on a terminal or -q."""
    import io as _io

    class Tty(_io.StringIO):
        def isatty(self):
            return True
    rows = [{"case": "a", "outcome": "ok", "seconds": 0.25, "reason": ""},
            {"case": "b", "outcome": "error", "seconds": 1.0, "reason": "boom\nsecond line"}]
    log, tty = _io.StringIO(), Tty()
    for stream, on in ((log, True), (tty, True), (_io.StringIO(), False)):
        lines = report.CaseLines(2, lambda r: {**r, "status": "pass" if r["outcome"] == "ok" else "error"},
                                 stream, enabled=on)
        for r in rows:
            lines(r)
        if stream is not log:
            assert stream.getvalue() == ""
    assert log.getvalue().splitlines() == ["[1/2] a: pass (0.2 s)", "[2/2] b: error (1.0 s): boom"]
    from helpers import mxval
    rc, out, _ = mxval(capsys, "validate", "--case", "smoke-fp8", "--backend", "reference",
                       "--report-dir", tmp_path / "r")
    assert rc == 0 and out.splitlines()[0].startswith("[1/1] smoke-fp8: pass (")
    rc, out, _ = mxval(capsys, "validate", "--case", "smoke-fp8", "--backend", "reference",
                       "--report-dir", tmp_path / "q", "-q")
    assert rc == 0 and "[1/1]" not in out
