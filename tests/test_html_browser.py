"""report.html in a real browser: headless Chromium (Debian's package), driven over its
DevTools protocol (tools/chromium.py). Every failing case's section and findings are
reachable from the overview table and visible, the table sorts and filters, and the page
raises no script error. Without chromium these tests skip, except in CI (CI=true), where
they fail: .ci/run installs it."""
import json
import os
import sys
from pathlib import Path

import pytest

from harness.io import report
from harness.run.budgets import load, verdict
from harness.run.cases import Catalog
from harness.run.runner import run_case

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import chromium  # noqa: E402

META = {"command": "validate", "suite": "smoke", "backend": "fault:nibbles-swapped", "machine": "test",
        "seconds": 1.0, "budgets": {"path": "cases/budgets.toml"}}


def _need_chromium():
    if chromium.find():
        return
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail("chromium is not installed, and CI=true: the browser tests must run in CI "
                    "(.ci/run installs Debian's chromium)")
    pytest.skip("chromium is not installed (Debian: apt-get install chromium); CI runs these tests")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    _need_chromium()
    cat, b = Catalog(), load()
    rows = [run_case(cat.case(n), "fault:nibbles-swapped")
            for n in ("smoke-fp8", "smoke-rowend-k", "smoke-chunk-edges", "smoke-nan-state")]
    df = report.frame([verdict(r, b, "smoke") for r in rows])
    d = tmp_path_factory.mktemp("html")
    report.write_all(df, META, d)
    with chromium.Browser(width=1300, height=800) as br:
        br.open(d / "report.html")
        yield br, df, json.loads((d / "report.json").read_text())


VISIBLE = """(sel) => { const el = typeof sel === 'string' ? document.querySelector(sel) : sel;
  if (!el) return false; const r = el.getBoundingClientRect();
  return el.checkVisibility() && r.width > 0 && r.height > 0; }"""


def in_view(br, css: str) -> bool:
    return br.js(f"""(() => {{ const el = document.querySelector({json.dumps(css)}); if (!el) return false;
        const r = el.getBoundingClientRect(); return el.checkVisibility() && r.height > 0 &&
        r.top >= -1 && r.top < window.innerHeight; }})()""")


def test_no_script_errors_and_self_contained(page):
    br, df, _ = page
    assert br.errors == []
    assert br.js("document.querySelectorAll('#cases tbody tr').length") == len(df)
    # every image decoded, nothing loaded from elsewhere
    assert br.js("Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)")
    assert br.js("performance.getEntriesByType('resource').filter(e => !e.name.startsWith('data:')).length") == 0


def test_every_failing_case_and_its_findings_are_reachable(page):
    br, df, data = page
    failing = [c for c in data["cases"] if not c["ok"]]
    assert len(failing) >= 2
    first_rows = br.js("Array.from(document.querySelectorAll('#cases tbody tr')).map(r => r.dataset.ok)")
    assert first_rows[:len(failing)] == ["0"] * len(failing)          # failing cases first
    for c in failing:
        slug = report._slug(c["case"])
        br.js("window.scrollTo(0, 0)")
        br.click(f"#cases a[href='#{slug}']")                         # a real click on the table's link
        br.js("new Promise(r => requestAnimationFrame(() => r(1)))")
        assert br.js("location.hash") == f"#{slug}"
        assert in_view(br, f"#{slug} h3"), c["case"]
        details = br.js(f"Array.from(document.querySelectorAll('#{slug} details.findings')).map(d => d.id)")
        kept = [f for f in c["findings"]]
        assert (len(details) > 0) == (len(kept) > 0), c["case"]
        listed = 0
        for did in details:
            assert br.js(f"document.getElementById('{did}').open") is False      # collapsed by default
            assert not br.js(f"({VISIBLE})(document.querySelector('#{did} li'))")
            br.click(f"#{did} > summary")
            assert br.js(f"document.getElementById('{did}').open") is True
            n = br.js(f"document.querySelectorAll('#{did} li').length")
            assert br.js(f"Array.from(document.querySelectorAll('#{did} li')).every(li => ({VISIBLE})(li))")
            listed += n
        assert listed == len(kept), c["case"]                          # every finding report.json keeps
        # the labelled blocks and the "does it matter" block are visible in the section
        assert br.js(f"({VISIBLE})(document.querySelector('#{slug} .stage.chain h4'))") or c["status"] != "fail"
        if c.get("selection"):
            assert br.js(f"({VISIBLE})(document.querySelector('#{slug} .matter table'))")
    assert br.errors == []


def test_table_sorts_and_filters(page):
    br, df, _ = page
    col = br.js("Array.from(document.querySelectorAll('#cases thead th')).findIndex(th => th.textContent === 'chain recall')")
    assert col > 0
    br.click(f"#cases thead th:nth-child({col + 1})")

    def column():
        return br.js(f"Array.from(document.querySelectorAll('#cases tbody tr')).map(r => r.cells[{col}].dataset.v)")
    vals = [v for v in column() if v != ""]
    assert vals == sorted(vals, key=float) and column()[-1] == ""     # ascending, empty cells last
    br.click(f"#cases thead th:nth-child({col + 1})")
    vals = [v for v in column() if v != ""]
    assert vals == sorted(vals, key=float, reverse=True)
    br.type_text("#filter", "rowend")
    shown = br.js("Array.from(document.querySelectorAll('#cases tbody tr')).filter(r => r.style.display !== 'none')"
                  ".map(r => r.cells[0].textContent)")
    assert shown == ["smoke-rowend-k"] and "1 of" in br.js("document.getElementById('shown').textContent")
    br.js("document.getElementById('filter').value = ''; document.getElementById('filter').dispatchEvent(new Event('input'))")
    br.js("const s = document.getElementById('status-filter'); s.value = 'failing'; s.dispatchEvent(new Event('change'))")
    shown = br.js("Array.from(document.querySelectorAll('#cases tbody tr')).filter(r => r.style.display !== 'none')"
                  ".map(r => r.dataset.ok)")
    assert shown and set(shown) == {"0"}
    assert br.errors == []


def test_a_link_to_a_finding_opens_it(page):
    """A URL naming a findings list (report.html#<case>-<stage>-findings) opens it."""
    br, _, data = page
    c = next(c for c in data["cases"] if c["findings"])
    did = f"{report._slug(c['case'])}-{c['findings'][0]['stage']}-findings"
    br.js(f"document.getElementById('{did}').open = false; location.hash = '#{did}'")
    br.js("new Promise(r => setTimeout(r, 50))")
    assert br.js(f"document.getElementById('{did}').open") is True
    assert in_view(br, f"#{did} li")
