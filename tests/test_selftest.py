"""`mxval selftest`: the CI part of the proof that every check has teeth, and the proof
that the selftest itself fails when a fault slips through or a correct run is flagged."""
import json

import pytest

from harness.commands.cli import main
from harness.diff.metrics import METRICS, REQUIRED
from harness.run.cases import Catalog
from harness.run.selftest import scale_cases
from optimized.faults import FAULTS


def selftest(tmp_path, *args, budgets=None):
    out = tmp_path / "st.json"
    argv = ["selftest", "-q", "--report-dir", str(tmp_path / "rep"), "--json", str(out), *args]
    if budgets is not None:
        path = tmp_path / "budgets.toml"
        path.write_text(budgets)
        argv += ["--budgets", str(path)]
    rc = main(argv)
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_quick_selftest_catches_every_fault_without_false_alarms(tmp_path):
    """What CI runs: every fault that fits in memory is caught, at the stage it breaks;
    the reference on 4 seeds and the Triton interpreter on 2 raise no alarm."""
    rc, v = selftest(tmp_path, "--quick")
    faults = {f["name"]: f for f in v["faults"]}
    assert set(faults) == set(FAULTS)
    for name, f in faults.items():
        if FAULTS[name].large:
            assert f["caught"] is None and "2 GiB" in f["skipped"]
            continue
        if FAULTS[name].graph:           # replayed from CUDA/HIP graphs: on a GPU (tests/test_graph.py here)
            assert f["caught"] is None and "graph" in f["skipped"]
            continue
        assert f["caught"] is True, (name, f)
        # caught where the bug is, not only through its consequences downstream
        assert any(w["metric"].split(".")[0] in FAULTS[name].ops for w in f["values"].values()), (name, f)
    assert v["seeds"] == 4 and v["false_alarms"] == 0, v["false_alarm_runs"]
    large = {c for f in FAULTS.values() if f.large for c in f.cases}
    scale = scale_cases() - large
    assert scale >= {"rows-4097", "scorer-rows", "long-rows", "narrow-band"}
    graph = {c.name for c in Catalog().suite_cases("selftest") if c.graph}      # a GPU's: skipped here
    assert graph and all(any(x.startswith(f"reference on {c}:") for x in v["left_out"]) for c in graph)
    assert v["correct_runs"]["reference"] == 4 * (len(Catalog().suite_cases("selftest")) - len(large)
                                                  - len(scale) - len(graph)) + len(scale)
    assert rc == 0
    rep = tmp_path / "rep"
    assert (rep / "report.json").exists() and "window-shift" in (rep / "selftest.md").read_text()


# Budgets that only bound pooling (every other check of the contract explicitly "off"):
# every K-writer fault slips through.
POOLING_ONLY = "[default]\npooled_max_ulp = 1\n" + "".join(
    f'{m} = "off"\n' for m in REQUIRED if m != "pooled_max_ulp") + "".join(
    f'"chain.{m}" = "off"\n' for m, spec in METRICS.items() if spec.chain in ("required", "only"))


def test_a_fault_no_budget_catches_fails_the_selftest(tmp_path):
    rc, v = selftest(tmp_path, "--fault", "rope-neox", "--fault", "window-shift", "--backend", "reference",
                     "--seeds", "1", budgets=POOLING_ONLY)
    faults = {f["name"]: f for f in v["faults"]}
    assert faults["window-shift"]["caught"] is True
    assert faults["window-shift"]["caught_by"] == ["pooled_max_ulp"]
    assert faults["rope-neox"]["caught"] is False and faults["rope-neox"]["caught_by"] == []
    assert '[default] page_bytes_mismatched = "off"' in v["budgets_off"]      # shown, never silent
    assert rc == 1


def test_a_correct_run_that_breaks_a_budget_is_a_false_alarm(tmp_path):
    """A budget the correct backend cannot meet (no pooled row compared at all) must fail
    the selftest even though every fault is still caught."""
    rc, v = selftest(tmp_path, "--fault", "window-shift", "--backend", "reference", "--seeds", "1",
                     budgets=POOLING_ONLY + "pooled_rows_compared = {max = 0}\n")
    assert v["faults"][0]["caught"] is True
    assert v["false_alarms"] > 0 and v["false_alarm_runs"][0]["violations"]
    assert rc == 1


def test_one_fault_runs_what_it_needs(tmp_path, capsys):
    """`--fault F`: the fault on its cases, and the correct backends' seeds on those cases only,
    said in the summary (not every case of the suite on every seed)."""
    fault = FAULTS["window-shift"]
    rc, v = selftest(tmp_path, "--fault", fault.name, "--backend", "reference", "--seeds", "2")
    out = capsys.readouterr().out
    assert rc == 0 and v["faults"][0]["caught"] is True
    assert v["correct_cases"] == list(fault.cases) == ["chain"]
    assert v["correct_runs"] == {"reference": 2 * len(fault.cases)} and v["correct_rows"] == 2
    assert "2 correct runs (reference; 2 seeds; on the faults' cases only: chain)" in out
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())["cases"]
    assert sorted(r["case"] for r in rows if r["backend"] == "reference") == ["chain [seed 0] on reference",
                                                                             "chain [seed 1000] on reference"]


@pytest.mark.parametrize("args, msg", [
    (["--seeds", "0"], "--seeds"),
    (["--fault", "no-such-fault"], "no-such-fault"),
    (["--backend", "fault:window-shift"], "is a fault"),
    (["--backend", "no-such-backend"], "no-such-backend"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, args, msg):
    rc, _ = selftest(tmp_path, *args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and msg in err and len(err.splitlines()) == 1 and err.startswith("mxval:")


def test_every_fault_names_selftest_cases():
    names = {c.name for c in Catalog().suite_cases("selftest")}
    for f in FAULTS.values():
        assert f.cases and set(f.cases) <= names, f.name
