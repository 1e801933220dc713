"""The smoke suite through the best backend this machine has (the Triton interpreter on
a CPU): CI's end-to-end check that `mxval validate` passes and writes every report."""
import json

from harness.commands.cli import main
from optimized import auto_backend_name, get_backend


def test_smoke_suite_passes_on_the_auto_backend(tmp_path, capsys):
    name = auto_backend_name()
    why = get_backend(name, require=False).available()
    assert why is None, f"the auto backend {name} must run everywhere make test runs: {why}"
    rc = main(["validate", "--suite", "smoke", "--backend", "auto", "-j", "2", "--report-dir", str(tmp_path), "-q"])
    out, err = capsys.readouterr()
    data = json.loads((tmp_path / "report.json").read_text())
    bad = [(c["case"], c["status"], c["reason"]) for c in data["cases"] if not c["ok"]]
    assert rc == 0 and not bad, bad
    s = data["summary"]
    # the cuda-path cases run vLLM's fused K stage, which only the reference and the vLLM CUDA
    # backends have: skipped (with the reason) on our Triton port
    skipped = {c["case"]: c["reason"] for c in data["cases"] if c["status"] == "skipped"}
    assert set(skipped) == {"smoke-cuda-path", "smoke-cuda-path-fp8"}
    assert all("compress_norm_rope" in r for r in skipped.values()), skipped
    assert (s["pass"], s["nonfinite_input"], s["skipped"]) == (8, 2, 2)
    for f in ("report.md", "report.html", "junit.xml", "metrics.csv"):
        assert (tmp_path / f).stat().st_size > 0
