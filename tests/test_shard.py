"""`--shard K/N` and `mxval report --merge`: shards of the smoke suite run separately and
merge into the report of the unsharded run (same verdict per case and per metric, same
exit status); a merge of shards that are not one run is refused with one line."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import mxval
from helpers import one_line_error as one_line

import reference
from harness.commands.cli import main
from harness.run import shard as S
from harness.run.cases import Catalog
from optimized import Backend, register
from reference import layout
from reference.k_writer import writer_mask


def report_of(d):
    return json.loads((Path(d) / "report.json").read_text())


def _flip_first_scale(**a):
    """A K writer one scale byte off in the first written slot of each call: some smoke
    cases fail (those with a boundary token in a step), others pass."""
    out = reference.k_norm_rope_mxfp4_cache(**a)
    slots = a["slot_mapping"][writer_mask(a["positions"], a["slot_mapping"], a["compress_ratio"])]
    pool = out["kv_cache"].clone()
    if slots.numel():
        page, entry = divmod(int(slots[0]), a["page_size"])
        so = layout.scale_offsets(torch.tensor(entry), a["page_size"], a["k"].shape[1], a["shuffle"])
        pool[page, so[0]] += 1
    return {"kv_cache": pool}


register("test-shard-flip", lambda: Backend("test-shard-flip", "test: one scale byte off per call",
                                            dict(reference.FUNCTIONS, k_norm_rope_mxfp4_cache=_flip_first_scale)))


# --- the split ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["0/3", "4/3", "x", "1/0", "", "-1/2", "1/2/3", "2", "1.0/2", "1/99999"])
def test_bad_shard_is_a_usage_error_before_anything_runs(capsys, tmp_path, text):
    rc, out, err = mxval(capsys, "validate", "--suite", "smoke", "--backend", "reference", "--shard", text,
                         "--report-dir", tmp_path / "r", "-q")
    assert rc == 2 and out == ""
    one_line(err, "--shard")
    assert not (tmp_path / "r").exists()


def test_parse():
    assert S.parse("1/1") == (1, 1) and S.parse(" 3 / 4 ") == (3, 4)


@pytest.mark.parametrize("suite, n", [("smoke", 1), ("smoke", 3), ("smoke", 4), ("default", 5), ("smoke", 12)])
def test_split_is_a_deterministic_balanced_partition(suite, n):
    cases = Catalog().suite_cases(suite)
    parts = S.assign(cases, n, S.case_cost, lambda c: c.name)
    names = [sorted(cases[i].name for i in p) for p in parts]
    assert sorted(x for p in names for x in p) == sorted(c.name for c in cases)       # each once
    # independent of the order the cases were listed in (another machine, another file order)
    rev = list(reversed(cases))
    again = [sorted(rev[i].name for i in p) for p in S.assign(rev, n, S.case_cost, lambda c: c.name)]
    assert again == names
    # LPT: no shard is heavier than the lightest by more than the largest single case
    loads = [sum(S.case_cost(cases[i]) for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(S.case_cost(c) for c in cases) + 1e-6
    if n <= len(cases):
        assert all(parts)


def test_cost_follows_geometry():
    cat = Catalog()
    assert S.case_cost(cat.case("pro-topk-edge")) > S.case_cost(cat.case("smoke-rowend-k")) > \
        S.case_cost(cat.case("smoke-inf-q"))


# --- shards of the smoke suite == the unsharded run --------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The smoke suite on a backend that fails some cases: unsharded, and in 3 shards."""
    base = tmp_path_factory.mktemp("shards")
    rcs = {}
    common = ["validate", "--suite", "smoke", "--backend", "test-shard-flip", "-q"]
    rcs["full"] = main(common + ["--report-dir", str(base / "full")])
    for k in (1, 2, 3):
        rcs[k] = main(common + ["--shard", f"{k}/3", "--report-dir", str(base / f"s{k}")])
    return base, rcs


def _verdicts(rep):
    return {c["case"]: (c["status"], c["ok"], sorted((v["metric"], v["limit"], v["value"]) for v in c["violations"]),
                        c["metrics"]) for c in rep["cases"]}


def test_merged_shards_equal_the_unsharded_run(runs, capsys, tmp_path):
    base, rcs = runs
    rc, out, err = mxval(capsys, "report", "--merge", base / "s3", base / "s1", base / "s2",
                         "--report-dir", tmp_path / "m", "-q")
    full, merged = report_of(base / "full"), report_of(tmp_path / "m")
    assert rcs["full"] == 1 and rc == rcs["full"], err           # some smoke cases fail on this backend
    statuses = {c["status"] for c in full["cases"]}
    assert "fail" in statuses and "pass" in statuses              # the comparison has both sides
    assert [c["case"] for c in merged["cases"]] == [c["case"] for c in full["cases"]]   # the run's order
    assert _verdicts(merged) == _verdicts(full)                   # per case, per metric verdict
    assert merged["summary"] == full["summary"]
    assert sum(len(report_of(base / f"s{k}")["cases"]) for k in (1, 2, 3)) == len(full["cases"])
    for name in ("report.md", "report.html", "junit.xml", "metrics.csv"):
        assert (tmp_path / "m" / name).stat().st_size > 0
    import pandas as pd
    a, b = (pd.read_csv(d / "metrics.csv").drop(columns="seconds") for d in (tmp_path / "m", base / "full"))
    pd.testing.assert_frame_equal(a, b)                            # every metric, timings aside
    assert [m["k"] for m in merged["run"]["merged_from"]] == [1, 2, 3]
    assert "shard" not in merged["run"]


def test_shard_identity_is_recorded(runs):
    base, _ = runs
    sh = report_of(base / "s2")["run"]["shard"]
    assert (sh["k"], sh["n"], sh["suite"], sh["command"]) == (2, 3, "smoke", "validate")
    assert sh["mxval_version"] and len(sh["budgets_digest"]) == 16 and len(sh["cases_digest"]) == 16
    from harness.run.cases import Catalog
    smoke = [c.name for c in Catalog().select("smoke", None)[1]]
    assert sh["all_cases"] == smoke and set(sh["cases"]) <= set(sh["all_cases"])


def _copy(base, name, dest, edit=None):
    shutil.copytree(base / name, dest)
    if edit:
        p = dest / "report.json"
        data = json.loads(p.read_text())
        edit(data)
        p.write_text(json.dumps(data))
    return dest


@pytest.mark.parametrize("what, needle", [
    ("missing", "shard(s) 2/3 missing"),
    ("twice", "shard 1/3 given twice"),
    ("case-overlap", "shards overlap: case"),
    ("suite", "different suites"),
    ("version", "different mxval versions"),
    ("budgets-edit", "different budgets"),
    ("cases", "different case lists"),
    ("plain", "not a shard report"),
    ("interrupted", "was interrupted"),
])
def test_merge_refuses_shards_that_are_not_one_run(runs, capsys, tmp_path, what, needle):
    base, _ = runs
    dirs = [base / "s1", base / "s2", base / "s3"]

    def set_shard(key, value):
        return lambda d: d["run"]["shard"].__setitem__(key, value)
    if what == "missing":
        dirs = [base / "s1", base / "s3"]
    elif what == "twice":
        dirs = [base / "s1", _copy(base, "s1", tmp_path / "again"), base / "s2", base / "s3"]
    elif what == "case-overlap":
        def steal(d):
            other = report_of(base / "s1")["cases"][0]
            d["cases"].append(other)
            d["run"]["shard"]["cases"].append(other["case"])
        dirs = [base / "s1", _copy(base, "s2", tmp_path / "x", steal), base / "s3"]
    elif what == "plain":
        dirs[1] = base / "full"
    else:
        edit = {"suite": set_shard("suite", "default"), "version": set_shard("mxval_version", "0.0.0"),
                "budgets-edit": set_shard("budgets_digest", "0" * 16), "cases": set_shard("cases_digest", "1" * 16),
                "interrupted": lambda d: d["run"].__setitem__("interrupted", {"cancelled": ["a"]})}[what]
        dirs[2] = _copy(base, "s3", tmp_path / "x", edit)
    before = {d: (d / "report.json").read_bytes() for d in dirs}
    rc, out, err = mxval(capsys, "report", "--merge", *dirs, "--report-dir", tmp_path / "m", "-q")
    assert rc == 2
    one_line(err, needle)
    assert not (tmp_path / "m" / "report.json").exists()
    assert all((d / "report.json").read_bytes() == b for d, b in before.items())        # inputs untouched


def test_shards_run_with_other_budgets_do_not_merge(runs, capsys, tmp_path):
    base, _ = runs
    loose = tmp_path / "loose.toml"
    loose.write_text(Path("cases/budgets.toml").read_text().replace("\npage_bytes_mismatched = 0",
                                                                    "\npage_bytes_mismatched = 5"))
    assert loose.read_text() != Path("cases/budgets.toml").read_text()
    rc, *_ = mxval(capsys, "validate", "--suite", "smoke", "--backend", "test-shard-flip", "--shard", "3/3",
                   "--budgets", loose, "--report-dir", tmp_path / "s3", "-q")
    rc, out, err = mxval(capsys, "report", "--merge", base / "s1", base / "s2", tmp_path / "s3",
                         "--report-dir", tmp_path / "m", "-q")
    assert rc == 2
    one_line(err, "different budgets")


def test_report_dir_and_merge_together_is_a_usage_error(runs, capsys):
    base, _ = runs
    rc, out, err = mxval(capsys, "report", base / "s1", "--merge", base / "s2")
    assert rc == 2
    one_line(err, "not both")


def test_sharded_selftest_merges_into_the_unsharded_verdict(capsys, tmp_path):
    args = ["selftest", "--fault", "nibbles-swapped", "--backend", "reference", "--seeds", "1", "-q"]
    rc_full, *_ = mxval(capsys, *args, "--report-dir", tmp_path / "full")
    for k in (1, 2):
        assert mxval(capsys, *args, "--shard", f"{k}/2", "--report-dir", tmp_path / f"s{k}")[0] == 0
    rc, out, err = mxval(capsys, "report", "--merge", tmp_path / "s1", tmp_path / "s2", "--report-dir", tmp_path / "m",
                         "-q")
    assert rc == rc_full == 0, err
    full, merged = report_of(tmp_path / "full"), report_of(tmp_path / "m")
    assert _verdicts(merged) == _verdicts(full)
    a = json.loads((tmp_path / "full" / "selftest.json").read_text())
    b = json.loads((tmp_path / "m" / "selftest.json").read_text())
    for key in ("faults", "false_alarms", "correct_runs", "ok", "seeds"):
        assert a[key] == b[key], key
    assert (tmp_path / "m" / "selftest.md").read_text() == (tmp_path / "full" / "selftest.md").read_text()


def test_budgets_of_a_sharded_run_are_judged_on_the_whole_run(capsys, tmp_path):
    """A [case.C] key is checked against the whole run's cases, not the shard's: a check
    turned off for one case is listed the same by every shard and by the merge, and a
    misspelt key is refused by every shard, also the one that does not hold C."""
    b = tmp_path / "b.toml"
    b.write_text(Path("cases/budgets.toml").read_text() + '\n[case.smoke-rowend-k]\npage_bytes_mismatched = "off"\n')
    common = ["validate", "--suite", "smoke", "--backend", "reference", "--budgets", b, "-q"]
    mxval(capsys, *common, "--report-dir", tmp_path / "full")
    for k in (1, 2):
        mxval(capsys, *common, "--shard", f"{k}/2", "--report-dir", tmp_path / f"s{k}")
    rc, out, err = mxval(capsys, "report", "--merge", tmp_path / "s1", tmp_path / "s2", "--report-dir", tmp_path / "m",
                         "-q")
    want = report_of(tmp_path / "full")["run"]["budgets_off"]
    assert any("page_bytes_mismatched" in w for w in want)
    assert report_of(tmp_path / "m")["run"]["budgets_off"] == want
    assert all(report_of(tmp_path / f"s{k}")["run"]["budgets_off"] == want for k in (1, 2))
    bad = tmp_path / "bad.toml"
    bad.write_text(Path("cases/budgets.toml").read_text() + '\n[case.smoke-rowend-k]\npage_bytes_mismatchd = 0\n')
    for k in (1, 2):
        rc, out, err = mxval(capsys, "validate", "--suite", "smoke", "--backend", "reference", "--budgets", bad,
                             "-q", "--shard", f"{k}/2", "--report-dir", tmp_path / f"bad{k}")
        assert rc == 2
        one_line(err, "page_bytes_mismatchd")


def test_hand_edited_shard_blocks_are_one_line(capsys, tmp_path):
    """A foreign or hand-edited run.shard / run.interrupted is bad input (exit 2), not a bug."""
    import json
    common = ["validate", "--suite", "smoke", "--backend", "reference", "-q"]
    for k in (1, 2):
        mxval(capsys, *common, "--shard", f"{k}/2", "--report-dir", tmp_path / f"s{k}")
    p = tmp_path / "s2" / "report.json"
    good = json.loads(p.read_text())
    for edit, needle in ((("k", "two"), "run.shard"), (("all_cases", "x"), "run.shard.all_cases")):
        bad = json.loads(json.dumps(good))
        bad["run"]["shard"][edit[0]] = edit[1]
        p.write_text(json.dumps(bad))
        rc, out, err = mxval(capsys, "report", "--merge", tmp_path / "s1", tmp_path / "s2",
                             "--report-dir", tmp_path / "m")
        assert rc == 2
        one_line(err, needle)
    bad = json.loads(json.dumps(good))
    bad["run"]["interrupted"] = True
    p.write_text(json.dumps(bad))
    rc, out, err = mxval(capsys, "report", tmp_path / "s2", "-q")
    assert rc == 2
    one_line(err, "run.interrupted")
