"""`mxval` end to end: dumps written by `mxval dump`, replayed by `mxval diff`, with one
flipped byte, a truncated file and a wrong dtype; budgets that pass and fail; usage errors;
a broken backend through `validate`; report re-rendering."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import mxval, one_line_error
from safetensors import safe_open
from safetensors.torch import save_file

import reference
from harness.commands.cli import main
from optimized import Backend, register
from reference import layout
from reference.k_writer import writer_mask

ROOT = Path(__file__).resolve().parent.parent
CASE = "smoke-rowend-k"
KW = "k_norm_rope_mxfp4_cache"






@pytest.fixture(scope="module")
def dump_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("dump")
    path = d / "step.safetensors"
    assert main(["dump", "--case", CASE, "--backend", "reference", "-o", str(path)]) == 0
    return path


def load(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def cases_of(report_dir):
    return {c["case"]: c for c in json.loads((Path(report_dir) / "report.json").read_text())["cases"]}


def flip_one_byte(src, dst, byte=5):
    """Flip the high nibble of value byte `byte` of the first written entry of the K
    writer's recorded output; return (page, entry)."""
    t, meta = load(src)
    sc = json.loads(meta["mxval"])["ops"][KW]
    pos, slots = t[f"{KW}/in/positions"], t[f"{KW}/in/slot_mapping"]
    slot = int(slots[writer_mask(pos, slots, sc["compress_ratio"])][0])
    page, entry = divmod(slot, sc["page_size"])
    off = layout.value_offsets(torch.tensor(entry), sc["page_size"], 128, sc["shuffle"])[byte]
    pool = t[f"{KW}/out/kv_cache"].clone()
    pool[page, off] ^= 0x10
    t[f"{KW}/out/kv_cache"] = pool
    save_file(t, str(dst), metadata=meta)
    return page, entry


def test_dump_then_diff_is_exact(dump_file, tmp_path, capsys):
    t, meta = load(dump_file)
    ops = set(json.loads(meta["mxval"])["ops"])
    assert ops == {"compress_pool", KW, "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"}
    rc, out, err = mxval(capsys, "diff", dump_file, "--report-dir", tmp_path / "r", "-q")
    assert rc == 0, out + err
    row = cases_of(tmp_path / "r")[dump_file.name]
    assert row["status"] == "pass" and row["metrics"][f"{KW}.page_bytes_mismatched"] == 0


def test_flipped_byte_found_and_localized(dump_file, tmp_path, capsys):
    bad = tmp_path / "flipped.safetensors"
    page, entry = flip_one_byte(dump_file, bad)
    rc, out, err = mxval(capsys, "diff", bad, "--report-dir", tmp_path / "r", "-q")
    assert rc == 1
    row = cases_of(tmp_path / "r")[bad.name]
    assert row["status"] == "fail"
    assert row["metrics"][f"{KW}.page_bytes_mismatched"] == 1
    assert [v["metric"] for v in row["violations"]] == [f"{KW}.page_bytes_mismatched"]
    f = [x for x in row["findings"] if x["stage"] == KW]
    assert len(f) == 1 and (f[0]["page"], f[0]["entry"], f[0]["byte"]) == (page, entry, 5)
    md = (tmp_path / "r" / "report.md").read_text()
    assert f"page {page} entry {entry}" in md
    junit = (tmp_path / "r" / "junit.xml").read_text()
    assert "<failure" in junit


def test_budgets_that_pass_and_fail(dump_file, tmp_path, capsys):
    bad = tmp_path / "flipped.safetensors"
    flip_one_byte(dump_file, bad)
    contract = (ROOT / "cases" / "budgets.toml").read_text()
    loose = tmp_path / "loose.toml"
    loose.write_text(contract + "\n[suite.diff]\npage_bytes_mismatched = 4\n")
    rc, *_ = mxval(capsys, "diff", bad, "--budgets", loose, "--report-dir", tmp_path / "a", "-q")
    assert rc == 0
    strict_case = tmp_path / "case.toml"
    strict_case.write_text(contract + f'\n[suite.diff]\npage_bytes_mismatched = 4\n[case."{bad.name}"]\n'
                           'page_bytes_mismatched = 0\n')
    rc, *_ = mxval(capsys, "diff", bad, "--budgets", strict_case, "--report-dir", tmp_path / "b", "-q")
    assert rc == 1


@pytest.mark.parametrize("content, needle", [
    ("[default]\npage_bytes_mismatched = \"lots\"\n", "page_bytes_mismatched"),
    ("[default\n", "malformed TOML"),
    ("[defaults]\nx = 1\n", "unknown top-level"),
    ("[default]\nlogits_diff = nan\n", "logits_diff"),            # NaN would pass any value
    ("[default]\nlogits_diff = {max = nan}\n", "logits_diff"),
    ("[default]\nlogits_diff = {max = 1, min = 2}\n", "min 2 > max 1"),
])
def test_malformed_budgets_file(dump_file, tmp_path, capsys, content, needle):
    b = tmp_path / "b.toml"
    b.write_text(content)
    rc, out, err = mxval(capsys, "diff", dump_file, "--budgets", b, "--report-dir", tmp_path / "r")
    assert rc == 2
    one_line_error(err, str(b), needle)
    rc, out, err = mxval(capsys, "diff", dump_file, "--budgets", tmp_path / "missing.toml")
    assert rc == 2
    one_line_error(err, "missing.toml", "cannot read")


def test_truncated_dump_exits_2_without_traceback(dump_file, tmp_path):
    cut = tmp_path / "cut.safetensors"
    data = dump_file.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    p = subprocess.run([sys.executable, "-m", "harness", "diff", str(cut), "--report-dir", str(tmp_path / "r")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2
    one_line_error(p.stderr, str(cut), "truncated")
    assert not (tmp_path / "r").exists()


def test_wrong_dtype_exits_2(dump_file, tmp_path, capsys):
    t, meta = load(dump_file)
    t[f"{KW}/in/positions"] = t[f"{KW}/in/positions"].float()
    bad = tmp_path / "dtype.safetensors"
    save_file(t, str(bad), metadata=meta)
    rc, out, err = mxval(capsys, "diff", dump_file, bad)
    assert rc == 2
    one_line_error(err, str(bad), f"{KW}/in/positions", "dtype float32")


def test_diff_through_a_backend(dump_file, tmp_path, capsys):
    rc, out, err = mxval(capsys, "diff", dump_file, "--backend", "reference", "--report-dir", tmp_path / "r", "-q")
    assert rc == 0, err
    assert cases_of(tmp_path / "r")[dump_file.name]["backend"] == "reference"


@pytest.mark.parametrize("argv, needle", [
    (["validate", "--case", "no-such-case", "--backend", "reference"], "no-such-case"),
    (["validate", "--suite", "no-such-suite", "--backend", "reference"], "no-such-suite"),
    (["validate", "--case", CASE, "--backend", "no-such-backend"], "no-such-backend"),
    (["dump", "--case", CASE, "--backend", "no-such-backend"], "no-such-backend"),
    (["dump", "--case", CASE, "--backend", "reference", "--step", "9"], "--step"),
    (["validate", "--frobnicate"], "unrecognized"),
    (["diff", "/no/such/file.safetensors"], "/no/such/file.safetensors"),
    (["report", "/no/such/dir"], "/no/such/dir"),
])
def test_usage_errors_exit_2(capsys, argv, needle):
    rc, out, err = mxval(capsys, *argv)
    assert rc == 2
    one_line_error(err, needle)


def test_unwritable_output_paths_exit_2_before_running(dump_file, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, needle in [
        (["diff", dump_file, "--report-dir", afile], "--report-dir"),
        (["diff", dump_file, "--report-dir", afile / "sub"], "--report-dir"),
        (["validate", "--case", CASE, "--backend", "reference", "--report-dir", afile], "--report-dir"),
        (["report", tmp_path, "--report-dir", afile], "--report-dir"),
        (["dump", "--case", CASE, "--backend", "reference", "-o", tmp_path], "-o"),
        (["dump", "--case", CASE, "--backend", "reference", "-o", afile / "x.safetensors"], "-o"),
    ]:
        rc, out, err = mxval(capsys, *argv)
        assert rc == 2, argv
        one_line_error(err, needle, str(afile) if "afile" in str(argv[-1]) else str(tmp_path))
        assert out == "", argv          # refused before anything ran


def test_unwritable_side_outputs_and_bad_study_device_exit_2(tmp_path, capsys):
    """Caught before a long selftest or study runs, not as an errno line at its end."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, needle in [
        (["selftest", "--fault", "nibbles-swapped", "--json", tmp_path], "--json"),
        (["selftest", "--fault", "nibbles-swapped", "--markdown", afile / "m.md"], "--markdown"),
        (["study", "--study", "quick", "--readme", tmp_path], "--readme"),
        (["study", "--study", "quick", "--device", "nope"], "--device"),
    ]:
        rc, out, err = mxval(capsys, *argv)
        assert rc == 2, argv
        one_line_error(err, needle)
        assert out == "", argv


@pytest.mark.parametrize("content, needle", [
    ('{"schema": "mxval-report", "version": 1, "run": {}, "cases": [1]}', "cases[0]"),
    ('{"schema": "mxval-report", "version": 1, "run": [], "cases": []}', "'run'"),
    ('{"cases": []}', "not an mxval report"),
    ("garbage", "not valid JSON"),
])
def test_report_on_a_malformed_report_json(tmp_path, capsys, content, needle):
    (tmp_path / "report.json").write_text(content)
    rc, out, err = mxval(capsys, "report", tmp_path, "--report-dir", tmp_path / "out")
    assert rc == 2
    one_line_error(err, str(tmp_path / "report.json"), needle)


def test_malformed_case_file_exits_2(tmp_path, capsys):
    (tmp_path / "s.toml").write_text('[suite]\nname = "s"\n[[case]]\nname = "c"\nheds = 4\n')
    rc, out, err = mxval(capsys, "validate", "--suite", "s", "--cases-dir", tmp_path, "--backend", "reference")
    assert rc == 2
    one_line_error(err, "s.toml", "'c'", "heds")


def _register_flipper(name: str, hits: list):
    def kw(**a):
        out = reference.k_norm_rope_mxfp4_cache(**a)
        slots = a["slot_mapping"][writer_mask(a["positions"], a["slot_mapping"], a["compress_ratio"])]
        pool = out["kv_cache"].clone()
        if slots.numel():
            page, entry = divmod(int(slots[-1]), a["page_size"])
            so = layout.scale_offsets(torch.tensor(entry), a["page_size"], a["k"].shape[1], a["shuffle"])
            pool[page, so[1]] += 1
            hits.append((page, entry))
        return {"kv_cache": pool}
    ops = dict(reference.FUNCTIONS, k_norm_rope_mxfp4_cache=kw)
    register(name, lambda: Backend(name, "test: bumps one scale byte per call", ops))


def test_validate_reference_passes_and_broken_backend_fails(tmp_path, capsys):
    rc, out, err = mxval(capsys, "validate", "--case", CASE, "--case", "smoke-nan-state", "--backend", "reference",
                         "--report-dir", tmp_path / "ok")
    assert rc == 0, out + err
    assert "smoke-nan-state" in out and "nonfinite_input" in out
    hits = []
    _register_flipper("test-bump-scale", hits)
    rc, out, err = mxval(capsys, "validate", "--case", CASE, "--backend", "test-bump-scale",
                         "--report-dir", tmp_path / "bad", "-q")
    assert rc == 1
    row = cases_of(tmp_path / "bad")[CASE]
    assert row["metrics"][f"{KW}.page_scale_bytes_mismatched"] == 1
    f = [x for x in row["findings"] if x["stage"] == KW]
    assert (f[0]["page"], f[0]["entry"], f[0]["class"]) == (*hits[0], "scale_off_by_k")
    # downstream stages compare on the backend's own pool: the scorer is not blamed
    assert row["metrics"]["paged_mxfp4_mqa_logits.logits_diff"] <= 1e-12
    assert row["metrics"]["chain.page_bytes_mismatched_frac"] > 0


def test_report_rerenders(tmp_path, capsys):
    d = tmp_path / "r"
    assert mxval(capsys, "validate", "--case", CASE, "--backend", "reference", "--report-dir", d, "-q")[0] == 0
    md = (d / "report.md").read_text()
    for name in ("report.md", "report.html", "junit.xml", "metrics.csv"):
        (d / name).unlink()
    rc, out, err = mxval(capsys, "report", d, "-q")
    assert rc == 0, err
    assert (d / "report.md").read_text() == md
    assert all((d / n).exists() for n in ("report.html", "junit.xml", "metrics.csv"))
    (d / "report.json").write_text("{not json")
    rc, out, err = mxval(capsys, "report", d)
    assert rc == 2
    one_line_error(err, "report.json")


def test_listing_commands(capsys):
    rc, out, err = mxval(capsys, "cases")
    assert rc == 0 and "smoke-rowend-k" in out and "full-pool-2gib" in out
    rc, out, err = mxval(capsys, "backends")
    assert rc == 0 and "reference" in out and "auto" in out


def test_a_bug_is_exit_3_not_a_usage_error(tmp_path, monkeypatch, capsys):
    """An unexpected exception inside a command is an internal error (exit 3, one line naming
    it), its traceback saved in the report directory; bad input stays exit 2."""
    from harness.commands import cli

    def broken(*a, **k):
        raise ValueError("boom from deep inside")
    monkeypatch.setattr("harness.run.runner.run_cases", broken)
    rc = cli.main(["validate", "--case", "smoke-chunk-edges", "--backend", "reference",
                   "--report-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3 and len(err) == 1 and "internal error ValueError: boom from deep inside" in err[0]
    assert "boom from deep inside" in (tmp_path / "r" / "internal-error.txt").read_text()


def test_path_option_runs_every_case_on_the_cuda_path(tmp_path, capsys):
    """`--path cuda` swaps the rocm path's pooling + K writer for the fused pool+K op (natural
    pages) and back; the reference then diffs the fused op's pages."""
    import json

    from harness.commands.cli import main
    from harness.run.cases import Catalog, on_path
    case = Catalog().case("smoke-chunks-shuffled")
    cuda = on_path(case, "cuda")
    assert cuda.path == "cuda" and cuda.layout == "natural"
    assert "compress_norm_rope_mxfp4_cache" in cuda.ops and "compress_pool" not in cuda.ops
    back = on_path(cuda, "rocm")
    assert back.ops == case.ops and back.path == "rocm"
    rc = main(["validate", "--case", "smoke-rowend-k", "--path", "cuda", "--backend", "reference",
               "--report-dir", str(tmp_path / "r"), "-q"])
    assert rc == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["run"]["path"] == "cuda"
    assert "compress_norm_rope_mxfp4_cache.page_bytes_mismatched" in rep["cases"][0]["metrics"]


def test_a_run_that_skips_every_case_is_not_a_pass(tmp_path, capsys):
    """A backend that can run none of the cases checked nothing: exit 1, never 0."""
    from harness.commands.cli import main
    rc = main(["validate", "--case", "smoke-rowend-k", "--path", "cuda", "--backend", "triton-interpret",
               "--report-dir", str(tmp_path / "r"), "-q"])
    capsys.readouterr()
    assert rc == 1
    assert "NOTHING CHECKED" in (tmp_path / "r" / "report.md").read_text()


def test_case_timeout_must_be_positive(capsys, tmp_path):
    for cmd in (["validate", "--case", "smoke-rowend-k"], ["selftest", "--quick"]):
        rc, out, err = mxval(capsys, *cmd, "--case-timeout", "0", "--report-dir", tmp_path / "r")
        assert rc == 2
        one_line_error(err, "--case-timeout")
        assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv,want_rc", [(["--help"], 0), (["validate", "--bogus"], 2), (["validate", "--help"], 0),
                                          (["selftest", "--seeds"], 2), (["nonsense"], 2)])
def test_help_and_usage_errors_load_no_torch(argv, want_rc):
    """`mxval --help` and usage errors stay instant: nothing heavy is imported before the
    command runs (the start-up ratio is measured by `make bench`, harness/bench/startup.py)."""
    import subprocess
    import sys
    code = ("import sys; from harness.commands.cli import main; rc = main(%r); "
            "print(rc, sorted(m for m in ('torch', 'pandas', 'numpy', 'rich') if m in sys.modules))" % (argv,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    rc, loaded = out.strip().splitlines()[-1].split(" ", 1)
    assert int(rc) == want_rc and loaded == "[]", (argv, out)


@pytest.mark.parametrize("argv, start", [
    (["validate", "--case-timeout", "0"], "mxval: --case-timeout: expected a number of seconds in (0, "),
    (["selftest", "--case-timeout", "nan"], "mxval: --case-timeout: expected a number of seconds"),
    (["validate", "--case-timeout"], "mxval: --case-timeout: expected one argument"),
    (["validate", "-j", "x"], "mxval: --jobs: expected 'auto' or a whole number of processes from 1 to 256"),
    (["selftest", "-j", "0"], "mxval: --jobs: expected 'auto' or a whole number"),
    (["validate", "--repeat", "0"], "mxval: --repeat: expected a whole number"),
])
def test_an_option_error_names_the_option_in_one_line(capsys, argv, start):
    """argparse's own errors ("argument -j/--jobs: ...") read like every other usage error."""
    rc, out, err = mxval(capsys, *argv)
    assert rc == 2 and one_line_error(err).startswith(start) and "argument -" not in err, err
