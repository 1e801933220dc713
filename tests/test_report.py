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
