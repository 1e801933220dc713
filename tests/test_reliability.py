"""One test per class of hostile input that used to crash or pass silently (each failed
before the fix): a gate that checks nothing, empty and contradictory arguments, half-validated
case files, degenerate dumps, a diff API that trusts its caller, a reference that encodes a
NaN or negative eps, counts maxed over steps and two judges disagreeing on "off"."""
import json
from pathlib import Path

import pytest
import torch
from helpers import one_line_error as one_line
from safetensors import safe_open
from safetensors.torch import save_file
from test_upstream import fake_index  # noqa: F401  (a fixture)

import reference
from harness.commands.cli import main
from harness.diff import DiffReport, diff_logits, diff_op, diff_pages, diff_pooled, diff_q, diff_topk
from harness.run import budgets as B
from harness.run.cases import Catalog
from harness.run.inputs import build
from harness.run.runner import ChainRun
from optimized import get_backend
from reference import layout
from reference.k_writer import writer_mask

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = (ROOT / "cases" / "budgets.toml").read_text()
KW = "k_norm_rope_mxfp4_cache"


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err




@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("dumps")
    good = d / "step.safetensors"
    assert main(["dump", "--case", "smoke-rowend-k", "--backend", "reference", "-o", str(good)]) == 0
    with safe_open(str(good), "pt") as f:
        t, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    sc = json.loads(meta["mxval"])["ops"][KW]
    pos, slots = t[f"{KW}/in/positions"], t[f"{KW}/in/slot_mapping"]
    page, entry = divmod(int(slots[writer_mask(pos, slots, sc["compress_ratio"])][0]), sc["page_size"])
    off = layout.value_offsets(torch.tensor(entry), sc["page_size"], 128, sc["shuffle"])[3]
    pool = t[f"{KW}/out/kv_cache"].clone()
    pool[page, off] ^= 0x10
    bad = d / "flipped.safetensors"
    save_file({**t, f"{KW}/out/kv_cache": pool}, str(bad), metadata=meta)
    return {"good": good, "flipped": bad, "tensors": t, "meta": json.loads(meta["mxval"]), "dir": d}


# --- 1. a gate that checks nothing passes ---------------------------------------------------

@pytest.mark.parametrize("text, needle", [
    ("", "empty budgets file"),
    (CONTRACT.replace("page_bytes_mismatched = 0", "page_bytes_mismatchd = 0", 1), "page_bytes_mismatchd"),
    ("[default]\npooled_max_ulp = 1\n", "no limit for"),                  # incomplete: the damage passed
    (CONTRACT.replace("pooled_max_ulp = 1", "pooled_max_ulp = -1", 1), "no value can pass"),
    (CONTRACT + '\n[case."other.safetensors"]\npage_bytes_mismatched = 0\n', "[case.other.safetensors]"),
])
def test_a_budgets_file_that_cannot_pass_by_accident(tmp_path, capsys, dumps, text, needle):
    b = tmp_path / "b.toml"
    b.write_text(text)
    rc, out, err = run(capsys, "diff", dumps["flipped"], "--budgets", b, "--report-dir", tmp_path / "r", "-q")
    assert rc == 2, (out, err)
    one_line(err, b, needle)
    assert not (tmp_path / "r").exists()


def test_a_byte_check_turned_off_shows_in_every_report(tmp_path, capsys, dumps):
    b = tmp_path / "b.toml"
    b.write_text(CONTRACT.replace("page_bytes_mismatched = 0", 'page_bytes_mismatched = "off"', 1))
    rc, out, err = run(capsys, "diff", dumps["flipped"], "--budgets", b, "--report-dir", tmp_path / "r")
    assert rc == 0, err
    off = '[default] page_bytes_mismatched = "off"'
    assert json.loads((tmp_path / "r" / "report.json").read_text())["run"]["budgets_off"] == [off]
    assert "checks turned off" in (tmp_path / "r" / "report.md").read_text()
    assert "checks turned off" in (tmp_path / "r" / "report.html").read_text()
    assert "budgets_off" in (tmp_path / "r" / "junit.xml").read_text()
    assert "checks turned off" in out


# --- 3. empty and contradictory arguments -----------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["validate", "--suite", "", "--backend", "no-such-backend"], "--suite: empty value"),
    (["validate", "--suite", "no-such-suite", "--case", "smoke-rowend-k", "--backend", "reference", "-q"],
     "not allowed with"),
    (["diff", "", "--backend", "no-such-backend"], "empty value"),
])
def test_empty_and_contradictory_arguments_are_usage_errors(tmp_path, capsys, argv, needle):
    rc, out, err = run(capsys, *argv, "--report-dir", tmp_path / "r")
    assert rc == 2, (out, err)
    one_line(err, needle)


def test_jobs_are_capped_and_the_cap_reported(tmp_path, capsys):
    rc, out, err = run(capsys, "validate", "--case", "smoke-rowend-k", "--backend", "reference", "-j", "30",
                       "--report-dir", tmp_path / "r", "-q")
    assert rc == 0, err
    jobs = json.loads((tmp_path / "r" / "report.json").read_text())["run"]["jobs"]
    assert jobs == {"requested": 30, "used": 1, "cap": "1 case(s)"} and "capped at 1" in err


# --- 4. case files validated by one schema ----------------------------------------------------

@pytest.mark.parametrize("body, needle", [
    ('[suite]\nname = "s"\n[[case]]\nname = "c"\nops = "topk"\n', "ops: expected a list"),
    ('[suite]\nname = 3\n[[case]]\nname = "c"\n', "[suite]: name"),
    ('suite = "x"\n[[case]]\nname = "c"\n', "[suite]"),
    ('[suite]\nname = "s"\n[[case]]\nname = "c"\ndescription = 5\n', "description"),
    ('defaults = 3\n[suite]\nname = "s"\n[[case]]\nname = "c"\n', "[defaults]"),
    ('[suite]\nname = "s"\ninclude = ["s"]\n[[case]]\nname = "c"\n', "includes itself"),
    ('[suite]\nname = "s"\n[[case]]\nname = "c"\nseqs = [{len = 1000000000000}]\n', "seqs[0].len"),
    ('[suite]\nname = "s"\n[[case]]\nname = "c"\nscale = nan\n', "scale"),
    ('[suite]\nname = "s"\n[[case]]\nname = "c"\nplant = "q"\n', "plant: expected a list"),
])
def test_case_files_are_validated_by_one_schema(tmp_path, capsys, body, needle):
    (tmp_path / "s.toml").write_text(body)
    rc, out, err = run(capsys, "cases", "--cases-dir", tmp_path)
    assert rc == 2, (out, err)
    one_line(err, tmp_path / "s.toml", needle)


# --- 5. degenerate dumps -------------------------------------------------------------------

def _variant(dumps, name, tensors=None, scalars=None, ops=None):
    meta = json.loads(json.dumps(dumps["meta"]))
    for op, kv in (scalars or {}).items():
        meta["ops"][op].update(kv)
    t = {**dumps["tensors"], **(tensors or {})}
    if ops:
        meta["ops"] = {o: meta["ops"][o] for o in ops}
        t = {k: v for k, v in t.items() if k.split("/")[0] in ops}
    path = dumps["dir"] / name
    save_file(t, str(path), metadata={"mxval": json.dumps(meta)})
    return path


def test_degenerate_dumps_are_refused_or_judged_never_a_crash(tmp_path, capsys, dumps):
    # a negative norm_eps would encode garbage: refused by the reader
    neg = _variant(dumps, "neg-eps.safetensors", scalars={KW: {"norm_eps": -1e-6}})
    rc, out, err = run(capsys, "diff", neg, "--report-dir", tmp_path / "a", "-q")
    assert rc == 2
    one_line(err, neg, "norm_eps")
    # a top-k of width 0 (rows of length 0): a verdict, not an internal IndexError
    t = dumps["tensors"]
    rows, k = t["topk/in/logits"].shape[0], dumps["meta"]["ops"]["topk"]["k"]
    w0 = _variant(dumps, "topk-w0.safetensors", ops=["topk"],
                  tensors={"topk/in/logits": torch.zeros(rows, 0), "topk/in/lengths": torch.zeros(rows, dtype=torch.int32),
                           "topk/out/indices": torch.full((rows, k), -1, dtype=torch.int32)})
    rc, out, err = run(capsys, "diff", w0, "--report-dir", tmp_path / "b", "-q")
    assert rc == 0, err
    # two files of one basename would be two report rows of one name
    (tmp_path / "x").mkdir()
    twin = tmp_path / "x" / dumps["good"].name
    twin.write_bytes(dumps["good"].read_bytes())
    rc, out, err = run(capsys, "diff", dumps["good"], twin, "--report-dir", tmp_path / "c", "-q")
    assert rc == 2
    one_line(err, "same file name")


# --- 5. the public diff API checks its arguments -----------------------------------------------

U8 = torch.zeros(2, 4352, dtype=torch.uint8)
BF = torch.zeros(2, 128, dtype=torch.bfloat16)
API = [
    ("fp32 actual vs bf16 expected", lambda: diff_pooled(torch.full((2, 128), 1.0001), BF, torch.ones(2, dtype=torch.bool)),
     "actual"),
    ("lists instead of tensors", lambda: diff_pooled([[0.0] * 4], [[0.0] * 4], [True]), "expected"),
    ("wrong rank", lambda: diff_pooled(BF[0], BF[0], torch.ones(128, dtype=torch.bool)), "expected"),
    ("rows out of range", lambda: diff_pooled(BF, BF, torch.tensor([5])), "rows"),
    ("head_dim 0", lambda: diff_pages(U8, U8, None, page_size=64, head_dim=0, shuffle=None,
                                      written_slots=torch.tensor([0])), "head_dim"),
    ("stride too small", lambda: diff_pages(torch.zeros(2, 100, dtype=torch.uint8), torch.zeros(2, 100, dtype=torch.uint8),
                                            None, page_size=64, head_dim=128, shuffle=None,
                                            written_slots=torch.tensor([0])), "page stride"),
    ("slots a list of floats", lambda: diff_pages(U8, U8, None, page_size=64, head_dim=128, shuffle=None,
                                                  written_slots=[0.5]), "written_slots"),
    ("negative row_ends", lambda: diff_logits(torch.ones(2, 8), torch.zeros(2, 8, dtype=torch.float64),
                                              torch.tensor([-1, -5]), clean=False), "row_ends"),
    ("bf16 logits", lambda: diff_logits(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(2, 8, dtype=torch.float64),
                                        torch.tensor([8, 8]), clean=False), "actual"),
    ("top-k of width 0 and k 0", lambda: diff_topk(torch.zeros(2, 0, dtype=torch.int32),
                                                   torch.zeros(2, 8, dtype=torch.float64), torch.tensor([8, 8]), 0), "k"),
    ("top-k float indices", lambda: diff_topk(torch.zeros(2, 4), torch.zeros(2, 8, dtype=torch.float64),
                                              torch.tensor([8, 8]), 4), "indices"),
    ("top-k negative lengths", lambda: diff_topk(torch.full((2, 4), -1), torch.zeros(2, 8, dtype=torch.float64),
                                                 torch.tensor([-3, -3]), 4), "lengths"),
    ("top-k NaN tol", lambda: diff_topk(torch.tensor([[0, 1, 2, 3]]), torch.randn(1, 8, dtype=torch.float64),
                                        torch.tensor([8]), 4, tol=float("nan")), "tol"),
    ("Q wrong rank", lambda: diff_q({"q_fp4": torch.zeros(2, 64, dtype=torch.uint8), "q_scale": torch.zeros(2, 4, dtype=torch.uint8),
                                     "weights": torch.ones(2)},
                                    {"q_fp4": torch.zeros(2, 64, dtype=torch.uint8), "q_scale": torch.zeros(2, 4, dtype=torch.uint8),
                                     "weights": torch.ones(2)}), "q_fp4"),
    ("diff_op without its inputs", lambda: diff_op("compress_pool", {}, {}, {"pooled": BF}, {"pooled": BF}), "inputs"),
    ("budget of an unknown metric", lambda: DiffReport("x", {"logits_diff": 0.0}).ok({"logits_dif": 1}), "logits_dif"),
]


@pytest.mark.parametrize("label, call, arg", API, ids=[a[0] for a in API])
def test_the_diff_api_names_the_bad_argument(label, call, arg):
    with pytest.raises(ValueError) as e:
        call()
    assert arg in str(e.value).splitlines()[0]


# --- the reference refuses a NaN or negative eps ---------------------------------------------

def test_the_reference_refuses_nan_or_negative_eps_and_scales():
    from reference.rope import cos_sin_cache
    kw = dict(k=torch.randn(8, 128).bfloat16(), positions=torch.arange(8), cos_sin_cache=cos_sin_cache(64, 64),
              norm_weight=torch.ones(128).bfloat16(), slot_mapping=torch.arange(8),
              kv_cache=torch.zeros(1, 4352, dtype=torch.uint8), compress_ratio=4, page_size=64, shuffle=[32, 16, 2])
    for eps in (-1e-6, 0.0, float("nan")):
        with pytest.raises(ValueError, match="norm_eps"):
            reference.k_norm_rope_mxfp4_cache(**kw, norm_eps=eps)
    q = dict(q=torch.randn(3, 4, 128).bfloat16(), positions=torch.arange(3), cos_sin_cache=cos_sin_cache(64, 64),
             weights=torch.randn(3, 4))
    for ws in (-1.0, 0.0):
        with pytest.raises(ValueError, match="weights_scale"):
            reference.q_rope_mxfp4_quant(**q, weights_scale=ws)


# --- counts summed over steps, one judge for "off" ----------------------------------------------

def test_counts_are_summed_over_steps():
    case = Catalog().case("smoke-chunks-shuffled")
    run_ = ChainRun(case, get_backend("reference"), build(case, "cpu"))
    for name in ("topk.topk_padding_errors", "compress_pool.pooled_values_differing",
                 "paged_mxfp4_mqa_logits.logits_rows_differing"):
        run_.col.metrics[name] = [3, 4]
    m = run_.col.case_metrics()
    assert m["topk.topk_padding_errors"] == 7 and m["compress_pool.pooled_values_differing"] == 7
    assert m["paged_mxfp4_mqa_logits.logits_rows_differing"] == 7


def test_off_means_the_same_to_both_judges(tmp_path):
    p = tmp_path / "b.toml"
    p.write_text(CONTRACT.replace("logits_nonfinite = 0\n", 'logits_nonfinite = "off"\n', 1))
    assert B.load(p).check({"paged_mxfp4_mqa_logits.logits_nonfinite": 2.0}, "s", "c") == []
    assert DiffReport("paged_mxfp4_mqa_logits", {"logits_nonfinite": 2.0}).ok({"logits_nonfinite": "off"})


# === hostile inputs: paths, escaping, hangs, bombs, shapes (each failed before its fix) =========

SMALL_CASE = ('[suite]\nname = "s"\n[[case]]\nname = {name}\nops = ["topk"]\nheads = 4\ntopk = 8\n'
              'seqs = [{{len = 16, chunks = [16]}}]\n')


def _tree(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_case_name_never_leads_a_dump_out_of_reports(tmp_path, capsys, monkeypatch):
    """`name = "../../../escaped/x"`: the default dump path stays under reports/dumps."""
    work = tmp_path / "a" / "b" / "c"
    (work / "cases").mkdir(parents=True)
    (work / "cases" / "s.toml").write_text(SMALL_CASE.format(name=json.dumps("../../../escaped/x")))
    monkeypatch.chdir(work)
    rc, out, err = run(capsys, "dump", "--case", "../../../escaped/x", "--backend", "reference",
                       "--cases-dir", work / "cases")
    assert rc == 0, err
    assert not (tmp_path / "a" / "escaped").exists() and not (work.parent / "escaped").exists()
    written = list((work / "reports" / "dumps").iterdir())
    assert len(written) == 1 and written[0].name.startswith("_._.._.._escaped_x.reference.step")


def test_a_default_output_never_follows_a_link_out_of_reports(tmp_path, capsys, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "dumps").symlink_to(outside)
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "dump", "--case", "smoke-rowend-k", "--backend", "reference")
    assert rc == 2, (out, err)
    one_line(err, "outside")
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_an_output_that_is_not_a_regular_file_is_refused_never_replaced(tmp_path, capsys, kind):
    """`mxval dump -o /dev/null` must not replace /dev/null: a link, a FIFO, a device or a
    directory at the output path is refused (exit 2) and left as it was."""
    import os
    import stat
    target = tmp_path / "out.safetensors"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    if kind == "symlink":
        target.symlink_to(victim)
    else:
        os.mkfifo(target)
    before = os.lstat(target).st_mode
    rc, out, err = run(capsys, "dump", "--case", "smoke-rowend-k", "--backend", "reference", "-o", target)
    assert rc == 2, (out, err)
    one_line(err, target)
    assert stat.S_IFMT(os.lstat(target).st_mode) == stat.S_IFMT(before) and victim.read_text() == "keep"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []     # no temporary left


@pytest.mark.parametrize("kind, name", [("study", "../../../x"), ("distribution", '=HYPERLINK(1)$\\macro$[/]')])
def test_a_study_or_distribution_name_is_a_plain_name(tmp_path, capsys, monkeypatch, kind, name):
    """A study name becomes part of a path (`reports/study-<name>`), a distribution name a
    CSV cell and a figure title: one that is not letters, digits and `._-` is refused."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    study, dist = (name, "normal") if kind == "study" else ("s", name)
    (work / "study.toml").write_text(f'[distribution.{json.dumps(dist)}]\n[study.{json.dumps(study)}]\n'
                                     f'distributions = [{json.dumps(dist)}]\nvariants = ["exact"]\n'
                                     'context_tokens = [512]\nrows = 1\nseeds = 1\nneedle_depths = []\n'
                                     'needle_margins = []\nheads = 2\n')
    monkeypatch.chdir(work)
    rc, out, err = run(capsys, "study", "--study", study, "--study-file", work / "study.toml", "--device", "cpu")
    assert rc == 2, (out, err)
    one_line(err, "study.toml", kind)
    assert _tree(tmp_path) == {"a", "a/b", "a/b/study.toml"}


def test_every_write_goes_through_atomic_with_fsync(tmp_path, monkeypatch):
    """dumps.py and the crash traceback write through harness/io/atomic.py: synced, renamed."""
    import os

    from harness.commands import cli
    from harness.io import atomic
    from harness.io.dumps import read_dump, write_dump
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    d = read_dump(sample_path_("k_natural"))
    write_dump(tmp_path / "d.safetensors", d.ops, source="t")
    assert synced, "write_dump wrote without fsync"
    synced.clear()
    path = cli._save_traceback(RuntimeError("x"), None)
    assert synced, "the crash traceback was written without fsync"
    assert Path(path).read_text().startswith("RuntimeError"), Path(path).read_text()[:200]
    os.unlink(path)
    assert atomic.safe_name("../../x") == "_._.._x" and atomic.safe_name("..") == "_." and atomic.safe_name("") == "_"


def sample_path_(name):
    from helpers import sample_path
    return sample_path(name)


# --- escaping: what a case name can do to the files and the terminal ----------------------------

@pytest.fixture(scope="module")
def a_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("rep") / "r"
    assert main(["validate", "--case", "smoke-rowend-k", "--backend", "reference", "--report-dir", str(d), "-q"]) == 0
    return json.loads((d / "report.json").read_text())


def _report_dir(tmp_path, data, name="r"):
    d = tmp_path / name
    d.mkdir()
    (d / "report.json").write_text(json.dumps(data))
    return d


def _renamed(a_report, name, **row):
    data = json.loads(json.dumps(a_report))
    data["cases"][0]["case"] = name
    data["cases"][0].update(row)
    return data


@pytest.mark.parametrize("name", ['=HYPERLINK("http://x","y")', "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"])
def test_csv_cells_are_never_formulas(tmp_path, capsys, a_report, name):
    import csv
    d = _report_dir(tmp_path, _renamed(a_report, name))
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 0, err
    rows = list(csv.DictReader((d / "metrics.csv").open(newline="")))
    assert len(rows) == 1 and rows[0]["case"] == "'" + name.replace("\r", "?")


def test_no_control_character_reaches_the_terminal(tmp_path, capsys, a_report):
    d = _report_dir(tmp_path, _renamed(a_report, "x\x1b]0;owned\x07y\x9b31m"))
    rc, out, err = run(capsys, "report", d)
    assert rc == 0, err
    assert "\x1b]0;" not in out + err and "\x07" not in out + err and "\x9b" not in out + err
    bad = tmp_path / "evil\x1b]0;t\x07.safetensors"
    rc, out, err = run(capsys, "diff", bad, "--report-dir", tmp_path / "r2", "-q")
    assert rc == 2 and "\x1b" not in err and "\x07" not in err
    one_line(err)


@pytest.mark.parametrize("name", ["nul\x00name", "bell\x07", "ffff\uffff", "vt\x0bx"])
def test_junit_stays_well_formed(tmp_path, capsys, a_report, name):
    from xml.etree import ElementTree as ET
    d = _report_dir(tmp_path, _renamed(a_report, name, reason="r\x00\x01"))
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 0, err
    ET.parse(d / "junit.xml")


@pytest.mark.parametrize("name", ["[/]", "x[/]y", "$\\macro$", "$\\frac{$"])
def test_markup_and_mathtext_in_a_name_are_text(tmp_path, capsys, a_report, name):
    """Shown as written in the console table, drawn as written in the figures: never parsed."""
    d = _report_dir(tmp_path, _renamed(a_report, name, details={"mismatch_map": [[0, 1, 2]]}))
    rc, out, err = run(capsys, "report", d)
    assert rc == 0, err
    assert name in out
    assert (d / "report.html").read_text().count("<figure>") >= 1


# --- hangs: a FIFO or /dev/zero given as any input file --------------------------------------------

def _fifo_guard(path: Path):
    """A FIFO at `path` and a thread that, if a reader ever blocks on it, unblocks it after a
    moment (so a regression fails instead of hanging) and records that it had to."""
    import os
    import threading
    import time
    os.mkfifo(path)
    state = {"blocked": False, "stop": False}

    def watch():
        t0 = time.time()
        while not state["stop"] and time.time() - t0 < 30:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:          # ENXIO: nobody is reading
                time.sleep(0.05)
                continue
            state["blocked"] = True
            os.close(fd)
            return
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    return state


@pytest.mark.parametrize("what", ["budgets", "case file", "dump", "report.json", "study file", "study json"])
def test_a_fifo_as_an_input_file_is_refused_without_blocking(tmp_path, capsys, what):
    d = tmp_path / "in"
    d.mkdir()
    fifo = {"case file": d / "s.toml", "report.json": d / "report.json"}.get(what, tmp_path / "f")
    state = _fifo_guard(fifo)
    argv = {"budgets": ["validate", "--case", "smoke-rowend-k", "--backend", "reference", "--budgets", fifo],
            "case file": ["cases", "--cases-dir", d],
            "dump": ["diff", fifo],
            "report.json": ["report", d],
            "study file": ["study", "--study-file", fifo, "--device", "cpu"],
            "study json": ["study", "--from-json", fifo]}[what]
    try:
        rc, out, err = run(capsys, *argv, *(["--report-dir", tmp_path / "r"] if what in ("budgets", "dump") else []))
    finally:
        state["stop"] = True
    assert not state["blocked"], f"{what}: mxval blocked reading a FIFO"
    assert rc == 2, (out, err)
    one_line(err, fifo, "not a regular file")


@pytest.mark.parametrize("what", ["budgets", "case file", "dump", "report.json"])
def test_dev_zero_as_an_input_file_is_refused(tmp_path, capsys, what):
    d = tmp_path / "in"
    d.mkdir()
    link = {"case file": d / "s.toml", "report.json": d / "report.json"}.get(what, tmp_path / "f")
    link.symlink_to("/dev/zero")
    argv = {"budgets": ["validate", "--case", "smoke-rowend-k", "--backend", "reference", "--budgets", link,
                        "--report-dir", tmp_path / "r"],
            "case file": ["cases", "--cases-dir", d], "dump": ["diff", link, "--report-dir", tmp_path / "r"],
            "report.json": ["report", d]}[what]
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (out, err)
    one_line(err, "character device")


# --- bounds: numbers and nesting ---------------------------------------------------------------------

BIG = "9" * 5000


@pytest.mark.parametrize("label", ["selftest seeds", "shard digits", "case-timeout"])
def test_numeric_arguments_have_upper_bounds(tmp_path, capsys, label):
    argv = {"selftest seeds": ["selftest", "--seeds", "100000000"],
            "shard digits": ["validate", "--case", "smoke-rowend-k", "--shard", f"1/{BIG}"],
            "case-timeout": ["validate", "--case", "smoke-rowend-k", "--case-timeout", "1e300"]}[label]
    rc, out, err = run(capsys, *argv, "--report-dir", tmp_path / "r")
    assert rc == 2, (out, err)
    one_line(err, argv[-2])
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("label", ["budgets int", "case int", "budgets deep", "case deep", "case deep array",
                                   "study context", "study deep"])
def test_toml_numbers_and_nesting_are_bounded(tmp_path, capsys, label):
    body = {"budgets int": CONTRACT.replace("pooled_max_ulp = 1", f"pooled_max_ulp = {BIG}", 1),
            "case int": SMALL_CASE.format(name='"c"') + f"seed = {BIG}\n",
            "budgets deep": "[default]\nx = " + "[" * 100000 + "]" * 100000 + "\n",
            "case deep": SMALL_CASE.format(name='"c"') + "description = " + "{a = " * 100000 + "1" + "}" * 100000,
            "case deep array": SMALL_CASE.format(name='"c"') + "seqs = " + "[" * 100000 + "]" * 100000,
            "study context": '[distribution.normal]\n[study.s]\ncontext_tokens = [1099511627776]\n',
            "study deep": '[distribution.normal]\n[study.s]\nrows = ' + "[" * 100000 + "]" * 100000}[label]
    d = tmp_path / "in"
    d.mkdir()
    f = d / ("s.toml" if label.startswith("case") else "f.toml")
    f.write_text(body)
    argv = {"budgets": ["diff", sample_path_("k_natural"), "--budgets", f, "--report-dir", tmp_path / "r"],
            "case": ["cases", "--cases-dir", d],
            "study": ["study", "--study", "s", "--study-file", f, "--device", "cpu", "--report-dir", tmp_path / "r"]
            }[label.split()[0]]
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (out, err[-2000:])
    one_line(err, f, "context_tokens" if label == "study context" else "digits" if "int" in label else "64 levels")
    assert not (tmp_path / "r").exists()


def test_a_dump_field_out_of_bounds_is_one_line(tmp_path, capsys, dumps):
    path = _variant(dumps, "ratio.safetensors", scalars={KW: {"compress_ratio": 2 ** 20}})
    rc, out, err = run(capsys, "diff", path, "--report-dir", tmp_path / "r", "-q")
    assert rc == 2, (out, err)
    one_line(err, path, "compress_ratio")
    meta = json.loads(json.dumps(dumps["meta"]))
    deep = dumps["dir"] / "deep.safetensors"
    save_file(dict(dumps["tensors"]), str(deep), metadata={"mxval": "[" * 100000 + "]" * 100000})
    rc, out, err = run(capsys, "diff", deep, "--report-dir", tmp_path / "r", "-q")
    assert rc == 2, (out, err)
    one_line(err, deep, "deep")
    meta["step"] = int(BIG[:400])
    big = dumps["dir"] / "bigstep.safetensors"
    save_file(dict(dumps["tensors"]), str(big), metadata={"mxval": json.dumps(meta).replace(BIG[:400], BIG)})
    rc, out, err = run(capsys, "diff", big, "--report-dir", tmp_path / "r", "-q")
    assert rc == 2, (out, err)
    one_line(err, big)


# --- report.json of the wrong shape -----------------------------------------------------------------

SHAPES = [
    ("metrics a list", lambda c: c.update(metrics=[1, 2]), "metrics"),
    ("a metric a string", lambda c: c["metrics"].update({"topk.topk_duplicates": "many"}), "metrics.topk.topk_duplicates"),
    ("findings ints", lambda c: c.update(findings=[1, 2, 3]), "findings[0]"),
    ("details nested", lambda c: c.update(details={"mismatch_map": [[[0, 1], 2, 3]]}), "mismatch_map"),
    ("details a list", lambda c: c.update(details=[1]), "details"),
    ("case name a list", lambda c: c.update(case=["a"]), "case"),
    ("status unknown", lambda c: c.update(status="great"), "status"),
    ("seconds huge", lambda c: c.update(seconds=1e300), "seconds"),
    ("violations strings", lambda c: c.update(violations=["x"]), "violations[0]"),
    ("summaries strings", lambda c: c.update(summaries={"x": "y"}), "summaries.x"),
    ("planted ints", lambda c: c.update(planted=[3]), "planted[0]"),
]


@pytest.mark.parametrize("label, damage, needle", SHAPES, ids=[s[0] for s in SHAPES])
def test_a_report_json_of_the_wrong_shape_is_one_line(tmp_path, capsys, a_report, label, damage, needle):
    data = json.loads(json.dumps(a_report))
    damage(data["cases"][0])
    d = _report_dir(tmp_path, data)
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (out, err[-2000:])
    one_line(err, d / "report.json", needle)


@pytest.mark.parametrize("label, text", [
    ("5000-digit seconds", None), ("nested 100k deep", "[" * 100000 + "]" * 100000),
    ("run seconds a list", None)])
def test_report_json_numbers_and_nesting_are_bounded(tmp_path, capsys, a_report, label, text):
    d = tmp_path / "r"
    d.mkdir()
    if label == "5000-digit seconds":
        text = json.dumps(a_report).replace('"seconds": ', f'"seconds": {BIG}, "x": ', 1)
    elif label == "run seconds a list":
        data = json.loads(json.dumps(a_report))
        data["run"]["seconds"] = [1]
        text = json.dumps(data)
    (d / "report.json").write_text(text)
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (out, err[-2000:])
    one_line(err, d / "report.json")


# --- one argument-check vocabulary ---------------------------------------------------------------

def test_one_argument_check_vocabulary():
    from harness.diff import args as A
    from harness.io import dumps as D
    from harness.run import cases as C
    from reference import checks
    from reference.ops import OPS
    assert A.INT_DTYPES is checks.INT_DTYPES == (torch.int32, torch.int64)
    int_fields = {f.dtypes for op in OPS.values() for f in (*op.fields.inputs.values(), *op.fields.outputs.values())
                  if "int32" in f.dtypes}                  # the op table names dtypes as torch does
    assert int_fields <= {tuple(str(d).removeprefix("torch.") for d in checks.INT_DTYPES), ("int32",)}
    # bool is never an integer, anywhere
    for call in (lambda: checks.integer("x", True, 0, 2), lambda: A.pos_int("x", True),
                 lambda: A.index("x", [True, False]), lambda: checks.choice("x", True, (1, 2))):
        with pytest.raises(ValueError, match="x"):
            call()
    assert D._check_scalar("int+", True) is not None and D._check_scalar("int+", 1) is None
    with pytest.raises(C._Bad):
        C.Int(0, 2).check("k", True)
    # one range convention: [lo, hi), the upper end excluded
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        checks.integer("x", 4, 0, 4)
    assert checks.integer("x", 3, 0, 4) == 3
    with pytest.raises(C._Bad, match=r"\[1, 257\)"):
        C.CASE_SCHEMA.keys["heads"].check("heads", 257)
    assert C.CASE_SCHEMA.keys["heads"].check("heads", 256) == 256
    bf = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        diff_pooled(bf, bf, torch.tensor([4]))
    assert diff_pooled(bf, bf, torch.tensor([3])).metrics["pooled_max_ulp"] == 0
    # integer tensors are int32/int64 everywhere: a uint8 index is refused by the diff API too
    with pytest.raises(ValueError, match="written_slots"):
        diff_pages(U8, U8, None, page_size=64, head_dim=128, shuffle=None, written_slots=torch.tensor([0], dtype=torch.uint8))


META_TENSORS = {
    "meta": lambda: torch.zeros(2, 128, dtype=torch.bfloat16, device="meta"),
    "sparse": lambda: torch.zeros(2, 128, dtype=torch.bfloat16).to_sparse(),
    "nested": lambda: torch.nested.nested_tensor([torch.zeros(3), torch.zeros(2)]),
    "csr": lambda: torch.zeros(2, 128).to_sparse_csr(),
}
REFUSAL = {"meta": "a meta tensor", "sparse": "layout sparse_coo", "nested": "a nested tensor",
           "csr": "layout sparse_csr"}     # reference/checks.plain's words for each


@pytest.mark.parametrize("kind", list(META_TENSORS))
@pytest.mark.parametrize("where", ["pooled actual", "pooled rows", "pages actual", "logits actual", "topk indices",
                                   "q actual", "op inputs"])
def test_the_diff_api_refuses_meta_sparse_and_nested_tensors(kind, where):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = META_TENSORS[kind]()
    f64 = torch.zeros(2, 8, dtype=torch.float64)
    call, arg = {
        "pooled actual": (lambda: diff_pooled(b, BF, torch.tensor([0])), "actual"),
        "pooled rows": (lambda: diff_pooled(BF, BF, b), "rows"),
        "pages actual": (lambda: diff_pages(b, U8, None, page_size=64, head_dim=128, shuffle=None,
                                            written_slots=torch.tensor([0])), "actual"),
        "logits actual": (lambda: diff_logits(b, f64, torch.tensor([1, 1]), clean=False), "actual"),
        "topk indices": (lambda: diff_topk(b, f64, torch.tensor([1, 1]), 4), "indices"),
        "q actual": (lambda: diff_q({"q_fp4": b, "q_scale": b, "weights": b}, {"q_fp4": b, "q_scale": b, "weights": b}),
                     "q_fp4"),
        "op inputs": (lambda: diff_op("topk", {"logits": b, "lengths": b}, {"k": 4}, {}, {}), "inputs"),
    }[where]
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value).splitlines()[0]
    assert arg in msg and REFUSAL[kind] in msg, msg


def test_a_link_inside_a_report_directory_is_refused_not_written_through(tmp_path, capsys, a_report):
    outside = tmp_path / "outside.md"
    outside.write_text("keep")
    d = _report_dir(tmp_path, a_report)
    (d / "report.md").symlink_to(outside)
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (out, err)
    one_line(err, d / "report.md", "symbolic link")
    assert outside.read_text() == "keep" and (d / "report.md").is_symlink()


# --- a verdict is computed, never read ---------------------------------------------------------------

def _failing(a_report):
    data = json.loads(json.dumps(a_report))
    c = data["cases"][0]
    c["metrics"]["k_norm_rope_mxfp4_cache.page_bytes_mismatched"] = 3
    c.update(status="fail", ok=False, reason="k_norm_rope_mxfp4_cache.page_bytes_mismatched 3 > 0",
             violations=[{"metric": "k_norm_rope_mxfp4_cache.page_bytes_mismatched", "value": 3, "limit": "<= 0",
                          "why": "3 > 0"}])
    return data


def test_an_honest_failing_report_re_renders_as_failing(tmp_path, capsys, a_report):
    rc, out, err = run(capsys, "report", _report_dir(tmp_path, _failing(a_report)), "-q")
    assert rc == 1, err


VERDICT_EDITS = [
    ("ok = true on a failing row", lambda c: c.update(ok=True)),
    ("status pass, ok true, violations kept", lambda c: c.update(status="pass", ok=True)),
    ("status pass, violations dropped", lambda c: c.update(status="pass", ok=True, violations=[], reason="")),
    ("status skipped with metrics", lambda c: c.update(status="skipped", ok=True, violations=[])),
    ("status error, ok true", lambda c: c.update(status="error", ok=True)),
    ("nonfinite_input ok without expect_nonfinite", lambda c: c.update(status="nonfinite_input", ok=True)),
    ("ok the string false", lambda c: c.update(ok="false")),
]


@pytest.mark.parametrize("label, edit", VERDICT_EDITS, ids=[v[0] for v in VERDICT_EDITS])
def test_an_edited_verdict_is_refused_naming_the_row(tmp_path, capsys, a_report, label, edit):
    data = _failing(a_report)
    edit(data["cases"][0])
    data["summary"]["ok"] = True
    d = _report_dir(tmp_path, data)
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (label, out, err)
    one_line(err, d / "report.json", "smoke-rowend-k")


def test_a_report_of_zero_cases_is_nothing_checked(tmp_path, capsys, a_report):
    data = _failing(a_report)
    data["cases"] = []
    d = _report_dir(tmp_path, data)
    rc, out, err = run(capsys, "report", d)
    assert rc == 1, (out, err)
    assert "NOTHING CHECKED" in out and "NOTHING CHECKED" in (d / "report.md").read_text()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    for k in (1, 2):
        assert main(["validate", "--case", "smoke-rowend-k", "--case", "smoke-chunks-shuffled", "--backend", "reference",
                     "--shard", f"{k}/2", "--report-dir", str(d / f"s{k}"), "-q"]) == 0
    return d


def _copy_shards(shards, tmp_path, edit=None):
    import shutil
    out = []
    for k in (1, 2):
        dst = tmp_path / f"s{k}"
        shutil.copytree(shards / f"s{k}", dst)
        if edit:
            data = json.loads((dst / "report.json").read_text())
            edit(k, data)
            (dst / "report.json").write_text(json.dumps(data))
        out.append(dst)
    return out


def test_a_merge_recomputes_each_shards_verdicts(tmp_path, capsys, shards):
    def edit(k, data):
        if data["cases"]:
            c = data["cases"][0]
            c["metrics"]["k_norm_rope_mxfp4_cache.page_bytes_mismatched"] = 7    # failing; verdict left as pass
    dirs = _copy_shards(shards, tmp_path, edit)
    rc, out, err = run(capsys, "report", "--merge", *dirs, "--report-dir", tmp_path / "m", "-q")
    assert rc == 2, (out, err)
    one_line(err, "page_bytes_mismatched", "report.json")


def test_a_merge_of_zero_cases_is_nothing_checked(tmp_path, capsys, shards):
    def edit(k, data):
        data["cases"] = []
        data["run"]["shard"]["cases"] = []
        data["run"]["shard"]["all_cases"] = []
    dirs = _copy_shards(shards, tmp_path, edit)
    rc, out, err = run(capsys, "report", "--merge", *dirs, "--report-dir", tmp_path / "m", "-q")
    assert rc == 1, (out, err)
    assert "NOTHING CHECKED" in (tmp_path / "m" / "report.md").read_text()


# --- interrupts keep what finished ---------------------------------------------------------------------

def _interrupted_on_call(real, n):
    """`real`, except that its n-th call raises KeyboardInterrupt (Ctrl-C) instead."""
    calls = []

    def wrapped(*a, **kw):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a, **kw)
    return wrapped


def test_diff_interrupted_keeps_the_files_replayed(tmp_path, capsys, monkeypatch, dumps):
    """Ctrl-C during the third of four dumps: a partial report of the two, re-renderable."""
    from harness.run import replay
    files = []
    for i in range(4):
        f = tmp_path / f"d{i}.safetensors"
        f.write_bytes(dumps["good"].read_bytes())
        files.append(f)
    monkeypatch.setattr(replay, "replay_dump", _interrupted_on_call(replay.replay_dump, 3))
    rc, out, err = run(capsys, "diff", *files, "--report-dir", tmp_path / "r", "-q")
    assert rc == 130, err
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [c["case"] for c in data["cases"]] == ["d0.safetensors", "d1.safetensors"]
    assert data["run"]["interrupted"]["cancelled"] == ["d2.safetensors", "d3.safetensors"]
    assert run(capsys, "report", tmp_path / "r", "-q")[0] == 130


def test_a_signal_while_the_reports_are_written_leaves_them_whole(tmp_path, capsys, monkeypatch):
    """SIGINT arriving in the middle of writing the report files: they are finished first
    (report.json included), then the run exits 130."""
    import os
    import signal

    from harness.io import report
    real = report.markdown

    def markdown(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **kw)
    monkeypatch.setattr(report, "markdown", markdown)
    rc, out, err = run(capsys, "validate", "--case", "smoke-rowend-k", "--backend", "reference",
                       "--report-dir", tmp_path / "r", "-q")
    assert rc == 130, err
    assert {p.name for p in (tmp_path / "r").iterdir()} >= {"report.json", "report.md", "junit.xml", "metrics.csv"}
    # every format says what the exit status says: the run was interrupted (after its last case)
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["run"]["interrupted"]["signal"] == "SIGINT" and data["run"]["interrupted"]["cancelled"] == []
    assert "interrupted" in (tmp_path / "r" / "report.md").read_text().lower()
    assert "interrupted" in (tmp_path / "r" / "report.html").read_text().lower()
    monkeypatch.setattr(report, "markdown", real)
    assert run(capsys, "report", tmp_path / "r", "-q")[0] == 130


def test_study_interrupted_keeps_the_contexts_that_finished(tmp_path, capsys, monkeypatch):
    from harness.study import core as study
    (tmp_path / "s.toml").write_text('[distribution.normal]\n[study.s]\nvariants = ["exact", "mxfp4"]\n'
                                     'context_tokens = [512, 1024, 2048]\nrows = 1\nseeds = 1\nneedle_depths = []\n'
                                     'needle_margins = []\nheads = 2\n')
    monkeypatch.setattr(study, "_study_context", _interrupted_on_call(study._study_context, 2))
    rc, out, err = run(capsys, "study", "--study", "s", "--study-file", tmp_path / "s.toml", "--device", "cpu",
                       "--report-dir", tmp_path / "r")
    assert rc == 130, err
    saved = json.loads((tmp_path / "r" / "study.json").read_text())
    assert saved["meta"]["interrupted"]["cases_done"] == 1
    assert {r["context_tokens"] for r in saved["rows"]} == {512}
    assert "interrupted" in (tmp_path / "r" / "study.md").read_text().splitlines()[0]
    rc, out, err = run(capsys, "study", "--from-json", tmp_path / "r" / "study.json", "--report-dir", tmp_path / "r2")
    assert rc == 0, err


def test_recorded_budgets_edited_to_pass_are_refused(tmp_path, capsys, a_report, shards):
    """The recomputation trusts no edited limit silently: a check turned "off" must show in
    run.budgets_off, and a shard's limits must be those its digest names."""
    data = _failing(a_report)
    c = data["cases"][0]
    c.update(status="pass", ok=True, violations=[], reason="")
    data["run"]["budgets"]["default"]["page_bytes_mismatched"] = "off"
    d = _report_dir(tmp_path, data)
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (out, err)
    one_line(err, "page_bytes_mismatched", "budgets_off")

    def loosen(k, data):
        data["run"]["budgets"]["default"]["page_bytes_mismatched"] = "<= 1000000"
    dirs = _copy_shards(shards, tmp_path / "m", loosen)
    rc, out, err = run(capsys, "report", "--merge", *dirs, "--report-dir", tmp_path / "out", "-q")
    assert rc == 2, (out, err)
    one_line(err, "budgets_digest")


def test_report_budgets_judges_against_a_trusted_file(tmp_path, capsys, a_report):
    """Limits loosened in report.json itself pass their own recomputation; `--budgets FILE`
    judges the rows against a file the user trusts instead."""
    data = _failing(a_report)
    c = data["cases"][0]
    c.update(status="pass", ok=True, violations=[], reason="")
    data["run"]["budgets"]["default"]["page_bytes_mismatched"] = "<= 1000"
    d = _report_dir(tmp_path, data)
    rc, out, err = run(capsys, "report", d, "-q", "--budgets", ROOT / "cases" / "budgets.toml")
    assert rc == 2, (out, err)
    one_line(err, "smoke-rowend-k", "page_bytes_mismatched")


def test_limits_loosened_in_an_unsharded_report_are_refused(tmp_path, capsys, a_report):
    """The recorded limits are those of the budgets file the report names, or it is refused:
    a limit loosened inside report.json (its rows rewritten to pass by it) never judges."""
    data = _failing(a_report)
    data["cases"][0].update(status="pass", ok=True, violations=[], reason="")
    data["summary"]["ok"] = True
    data["run"]["budgets"]["default"]["page_bytes_mismatched"] = "<= 1000"
    rc, out, err = run(capsys, "report", _report_dir(tmp_path, data), "-q")
    assert rc == 2, (out, err)
    one_line(err, "run.budgets", "page_bytes_mismatched", "'<= 1000'", "budgets.toml")
    data["run"]["budgets"]["path"] = str(tmp_path / "gone.toml")            # a file that is not here
    rc, out, err = run(capsys, "report", _report_dir(tmp_path, data, "r2"), "-q")
    assert rc == 2, (out, err)
    one_line(err, "gone.toml", "--budgets FILE")
    honest = json.loads(json.dumps(a_report))                                # untouched: re-renders
    honest["run"]["budgets"]["path"] = "/elsewhere/checkout/cases/budgets.toml"   # another checkout's default
    assert run(capsys, "report", _report_dir(tmp_path, honest, "r3"), "-q")[0] == 0


def test_a_failing_row_rewritten_as_expected_nonfinite_input_is_refused(tmp_path, capsys, a_report):
    """Whether non-finite inputs are expected is the case definition's word, not the row's:
    a failing row stored as nonfinite_input with expect_nonfinite and a plant claimed is refused;
    a case that does declare them re-renders as it ran."""
    data = _failing(a_report)
    data["cases"][0].update(status="nonfinite_input", ok=True, expect_nonfinite=True, violations=[],
                            planted=["q[token 0, flat [1]] = inf"], reason="non-finite input")
    data["summary"]["ok"] = True
    d = _report_dir(tmp_path, data)
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (out, err)
    one_line(err, d / "report.json", "smoke-rowend-k", "expect_nonfinite")
    honest = tmp_path / "honest"
    assert main(["validate", "--case", "smoke-inf-q", "--backend", "reference", "--report-dir", str(honest),
                 "-q"]) == 0
    row = json.loads((honest / "report.json").read_text())["cases"][0]
    assert row["status"] == "nonfinite_input" and row["ok"] is True
    assert run(capsys, "report", honest, "-q")[0] == 0
    # a broken invariant on the non-finite inputs is a failure: stored as an ok nonfinite_input, refused
    data = json.loads((honest / "report.json").read_text())
    data["cases"][0]["metrics"]["q_rope_mxfp4_quant.invariant_violations"] = 2
    d = _report_dir(tmp_path, data, "edited")
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (out, err)
    one_line(err, d / "report.json", "smoke-inf-q", "invariant_violations")


# --- round four: untrusted fields, full disks, environment, consoles, API arguments -------------

def test_a_cached_upstream_manifest_is_untrusted(fake_index, capsys):  # noqa: F811
    """Every field of a cached manifest is input: a wrong type means "not cached", and the tree
    is fetched again, never an internal error."""
    import harness.commands.upstream_cmd as uc
    assert main(["upstream", "fetch", "--vllm", "0.33.0"]) == 0
    manifest = uc.tree_dir("0.33.0") / ".mxval-manifest.json"
    good = json.loads(manifest.read_text())
    for field, value in (("files", 5), ("files", [5]), ("modules", "x"), ("sha256", []), ("files", ["../../x"])):
        manifest.write_text(json.dumps({**good, field: value}))
        capsys.readouterr()
        rc = main(["upstream", "fetch", "--vllm", "0.33.0"])
        out, err = capsys.readouterr()
        assert rc == 0, (field, value, out, err)
        assert "downloading" in out or "source files" in out


@pytest.mark.parametrize("label, damage", [
    ("meta a list", lambda s: s.update(meta=[1, 2])),
    ("rows not a list", lambda s: s.update(rows={"a": 1})),
    ("a row not an object", lambda s: s.update(rows=[1, 2])),
    ("a row of the wrong keys", lambda s: s.update(rows=[{"x": [1]}])),
    ("a row value an object", lambda s: s["rows"][0].update(recall={"a": 1})),
    ("needles a string", lambda s: s.update(needles="x")),
    ("a metric a string", lambda s: s["rows"][0].update(recall="x")),
    ("a context a float", lambda s: s["rows"][0].update(context_tokens=1.5)),
])
def test_study_from_json_of_the_wrong_shape_is_one_line(tmp_path, capsys, study_json, label, damage):
    saved = json.loads(study_json.read_text())
    damage(saved)
    bad = tmp_path / "study.json"
    bad.write_text(json.dumps(saved))
    rc, out, err = run(capsys, "study", "--from-json", bad, "--report-dir", tmp_path / "out")
    assert rc == 2, (label, out, err)
    one_line(err, bad)


@pytest.fixture(scope="module")
def study_json(tmp_path_factory):
    d = tmp_path_factory.mktemp("study")
    # 8192 tokens: past the top-k, so the (empty) needle lists are used, not skipped
    (d / "s.toml").write_text('[distribution.normal]\n[study.s]\nvariants = ["exact", "mxfp4"]\n'
                              'context_tokens = [512, 8192]\nrows = 1\nseeds = 1\nneedle_depths = []\n'
                              'needle_margins = []\nheads = 2\n')
    assert main(["study", "--study", "s", "--study-file", str(d / "s.toml"), "--device", "cpu",
                 "--report-dir", str(d / "r")]) == 0
    return d / "r" / "study.json"


def _enospc_save(message):
    """safetensors' save_file on a disk that fills up half way: part of the file, then its error."""
    def save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        from safetensors import SafetensorError
        raise SafetensorError(message)
    return save


@pytest.mark.parametrize("message", [
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',
    "Error while serializing: I/O error: No space left on device (os error 28)"])
def test_a_dump_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, message):
    import safetensors.torch
    monkeypatch.setattr(safetensors.torch, "save_file", _enospc_save(message))
    out = tmp_path / "d.safetensors"
    rc, o, err = run(capsys, "dump", "--case", "smoke-rowend-k", "--backend", "reference", "-o", out)
    assert rc == 2, (o, err)
    one_line(err, out, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_a_suite_file_whose_defaults_is_not_a_table_is_named(tmp_path, capsys):
    (tmp_path / "s.toml").write_text('defaults = "x"\n')
    rc, out, err = run(capsys, "cases", "--cases-dir", tmp_path)
    assert rc == 2, (out, err)
    one_line(err, tmp_path / "s.toml", "defaults")
    (tmp_path / "s.toml").write_text('defaults = "x"\n[[case]]\nname = "a"\nops = ["topk"]\n')
    rc, out, err = run(capsys, "validate", "--suite", "s", "--cases-dir", tmp_path, "--report-dir", tmp_path / "r")
    assert rc == 2, (out, err)
    one_line(err, tmp_path / "s.toml", "defaults")


@pytest.mark.parametrize("key, value", [("chain.page_bytes_mismatched_frac", 1.5), ("chain.topk_recall_min", -0.5),
                                        ("topk_rows_not_exact_frac", 2)])
def test_a_limit_outside_its_metrics_range_is_refused(tmp_path, capsys, key, value):
    """A fraction bounded by 1.5 (or a recall by -0.5) passes anything: refused, never silently useless."""
    text = "\n".join(x for x in CONTRACT.splitlines() if not x.startswith((f'"{key}"', f"{key} ")))
    b = tmp_path / "b.toml"
    b.write_text(text.replace("\n[default]\n", f'\n[default]\n"{key}" = {value}\n', 1))
    rc, out, err = run(capsys, "validate", "--case", "smoke-rowend-k", "--backend", "reference", "--budgets", b,
                       "--report-dir", tmp_path / "r", "-q")
    assert rc == 2, (out, err)
    one_line(err, b, key.split(".")[-1], "range", "checks nothing")


@pytest.mark.parametrize("env, value, argv, needle", [
    ("MXVAL_STAGE_TIMES", "yes", ["dump", "--case", "smoke-rowend-k", "--backend", "reference", "-o", "{tmp}/d"],
     "MXVAL_STAGE_TIMES"),
    ("MXVAL_STAGE_TIMES", "1" * 5000, ["validate", "--case", "smoke-rowend-k", "--report-dir", "{tmp}/r"],
     "MXVAL_STAGE_TIMES"),
    ("MXVAL_GPU_MEMORY_FRACTION", "1" * 5000, ["validate", "--case", "smoke-rowend-k", "--report-dir", "{tmp}/r"],
     "MXVAL_GPU_MEMORY_FRACTION"),
    ("MXVAL_DEBUG", "maybe", ["cases", "--suite", "smoke"], "MXVAL_DEBUG"),
])
def test_an_environment_variable_is_read_with_bounds_and_named(tmp_path, capsys, monkeypatch, env, value, argv,
                                                                needle):
    monkeypatch.setenv(env, value)
    rc, out, err = run(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert rc == 2, (out, err)
    one_line(err, needle)
    assert len(one_line(err)) < 300


def test_capture_variables_are_bounded_and_named(monkeypatch):
    from harness.capture import hook
    for env, value in ((hook.ENV_LAYERS, "1" * 5000), (hook.ENV_RING, "9" * 5000), (hook.ENV_STEPS, "x,1")):
        monkeypatch.setenv(env, value)
        with pytest.raises(ValueError) as e:
            hook._Config.from_env()
        assert str(e.value).startswith(env) and len(str(e.value)) < 300, str(e.value)
        monkeypatch.delenv(env)


def test_mxval_debug_0_means_off(tmp_path, capsys, monkeypatch):
    from harness.commands import cli
    monkeypatch.setattr(cli, "cmd_cases", lambda args: 1 // 0)
    monkeypatch.setitem(cli.BUILTIN, "cases", cli.cmd_cases)
    monkeypatch.setenv("MXVAL_DEBUG", "0")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    rc, out, err = run(capsys, "cases")
    assert rc == 3 and "ZeroDivisionError" in err and "Traceback" not in err, err
    monkeypatch.setenv("MXVAL_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["cases"])


def test_a_stdout_that_cannot_encode_utf8_gets_an_ascii_console(tmp_path, capsys, monkeypatch, a_report):
    """PYTHONIOENCODING=ascii or a C locale: a non-ASCII case name and the table's box
    characters reach the console as ASCII (never UnicodeEncodeError); the files stay UTF-8."""
    import io
    import sys
    d = _report_dir(tmp_path, _renamed(a_report, "caf\u00e9-\u2260-\u0434"))
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii", errors="strict"))
    rc = main(["report", str(d)])
    sys.stdout.flush()
    err = capsys.readouterr().err
    assert rc == 0, err
    out = raw.getvalue().decode("ascii")                    # nothing but ASCII reached it
    assert "caf\\xe9-!=-\\u0434" in out and "pages!=" in out and "+----" in out, out
    assert "caf\u00e9-\u2260-\u0434" in (d / "report.md").read_text(encoding="utf-8")


def test_a_report_json_of_too_many_rows_is_refused_at_once(tmp_path, capsys, a_report):
    import time

    from harness.io import report_shape
    data = json.loads(json.dumps(a_report))
    row = {"case": "x", "status": "pass", "ok": True}
    data["cases"] = [row] * (report_shape.MAX_CASES + 1)
    d = _report_dir(tmp_path, data)
    t = time.time()
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (out, err)
    one_line(err, "cases", str(report_shape.MAX_CASES))
    assert time.time() - t < 30


@pytest.mark.parametrize("backend", ["reference", "triton-interpret"])
def test_the_ops_refuse_a_tensor_that_requires_grad(backend):
    from helpers import k_writer_case
    kw = k_writer_case()
    kw["k"] = kw["k"].clone().requires_grad_(True)
    with pytest.raises(ValueError) as e:
        get_backend(backend).k_norm_rope_mxfp4_cache(**kw)
    assert str(e.value).startswith("k:") and "grad" in str(e.value)


@pytest.mark.parametrize("call, arg", [
    (lambda: reference.k_norm_rope_mxfp4_cache(**{**__import__("helpers").k_writer_case(), "compress_ratio": 2 ** 70}),
     "compress_ratio"),
    (lambda: reference.topk(**{**__import__("helpers").topk_case(), "k": 2 ** 70}), "k"),
    (lambda: reference.topk(**{**__import__("helpers").topk_case(), "k": -2 ** 70}), "k"),
])
def test_the_reference_refuses_integers_past_int64(call, arg):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value).startswith(f"{arg}:"), str(e.value)


def _raw_meta_dump(dumps, name, meta_text, tensors=None):
    path = dumps["dir"] / name
    save_file(tensors or dumps["tensors"], str(path), metadata={"mxval": meta_text})
    return path


def test_dump_metadata_with_a_key_given_twice_is_refused(tmp_path, capsys, dumps):
    text = json.dumps(dumps["meta"])
    k = dumps["meta"]["ops"]["topk"]["k"]
    twice_scalar = text.replace(f'"k": {k}', f'"k": {k}, "k": {k + 1}', 1)
    assert twice_scalar != text
    twice_format = text.replace('"format": ', '"format": "x", "format": ', 1)
    for i, t in enumerate((twice_scalar, twice_format)):
        p = _raw_meta_dump(dumps, f"twice{i}.safetensors", t)
        rc, out, err = run(capsys, "diff", p, "--report-dir", tmp_path / f"r{i}", "-q")
        assert rc == 2, (out, err)
        one_line(err, p, "twice")


def test_a_zero_row_op_of_a_huge_declared_width_is_refused(tmp_path, capsys, dumps):
    k = dumps["meta"]["ops"]["topk"]["k"]
    p = _variant(dumps, "wide.safetensors", ops=["topk"],
                 tensors={"topk/in/logits": torch.zeros(0, 2 ** 40), "topk/in/lengths": torch.zeros(0, dtype=torch.int32),
                          "topk/out/indices": torch.zeros(0, k, dtype=torch.int32)})
    rc, out, err = run(capsys, "diff", p, "--report-dir", tmp_path / "r", "-q")
    assert rc == 2, (out, err)
    one_line(err, p, "topk/in/logits", "no data")


# --- round four: reports as a set, signals, consoles that go away ---------------------------------

def _full_after(n):
    """atomic's file writer on a disk that fills after `n` whole files."""
    import errno

    from harness.io import atomic
    real, calls = atomic._write_fd, []

    def write(fd, blob):
        calls.append(1)
        if len(calls) > n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, blob)
    return write


def _snapshot(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_a_full_disk_under_force_leaves_the_old_reports_whole(tmp_path, capsys, monkeypatch, dumps):
    """A passing report overwritten (--force) by a failing run on a disk that fills after two
    files: the old set stays whole, not one file of the new run replaces it."""
    from harness.io import atomic
    d = tmp_path / "r"
    rc, out, err = run(capsys, "diff", dumps["good"], "--report-dir", d, "-q")
    assert rc == 0, err
    before = _snapshot(d)
    monkeypatch.setattr(atomic, "_write_fd", _full_after(2))
    rc, out, err = run(capsys, "diff", dumps["flipped"], "--report-dir", d, "--force", "-q")
    assert rc == 2, (out, err)
    one_line(err, d, "No space left on device", "verdict: FAIL")
    assert _snapshot(d) == before                          # not one file of the failing run
    monkeypatch.undo()
    assert run(capsys, "report", d, "-q")[0] == 0


def test_a_selftest_into_a_full_disk_gives_its_verdict(tmp_path, capsys, monkeypatch):
    from harness.io import atomic
    monkeypatch.setattr(atomic, "_write_fd", _full_after(1))
    rc, out, err = run(capsys, "selftest", "--fault", "nibbles-swapped", "--seeds", "1", "--backend", "reference",
                       "--shard", "1/64", "--report-dir", tmp_path / "r", "-q")
    assert rc == 2, (out, err)
    one_line(err, "No space left on device", "verdict:")
    left = list((tmp_path / "r").iterdir()) if (tmp_path / "r").exists() else []
    assert not any(p.name.startswith(("report", "selftest", ".mxval-staging")) for p in left), left


def test_a_study_claims_its_report_directory(tmp_path, capsys):
    s = tmp_path / "s.toml"
    s.write_text('[distribution.normal]\n[study.s]\nvariants = ["exact", "mxfp4"]\ncontext_tokens = [512]\n'
                 'rows = 1\nseeds = 1\nneedle_depths = []\nneedle_margins = []\nheads = 2\n')
    v = tmp_path / "v"
    assert main(["validate", "--case", "smoke-rowend-k", "--backend", "reference", "--report-dir", str(v), "-q"]) == 0
    argv = ["study", "--study", "s", "--study-file", s, "--device", "cpu"]
    rc, out, err = run(capsys, *argv, "--report-dir", v)
    assert rc == 2, (out, err)
    one_line(err, v, "report.json", "--force")
    assert not (v / "study.json").exists()
    st = tmp_path / "st"
    assert run(capsys, *argv, "--report-dir", st)[0] == 0
    first = (st / "study.json").read_bytes()
    rc, out, err = run(capsys, *argv, "--report-dir", st)
    assert rc == 2, (out, err)
    one_line(err, st, "study.json", "--force")
    assert (st / "study.json").read_bytes() == first
    assert run(capsys, *argv, "--report-dir", st, "--force")[0] == 0
    rc, out, err = run(capsys, "validate", "--case", "smoke-rowend-k", "--backend", "reference", "--report-dir", st, "-q")
    assert rc == 2, (out, err)
    one_line(err, "study.json")


def test_a_merge_refuses_a_shard_listing_a_case_twice(tmp_path, capsys, shards):
    def edit(k, data):
        data["run"]["shard"]["all_cases"].append(data["run"]["shard"]["all_cases"][0])
    dirs = _copy_shards(shards, tmp_path, edit)
    rc, out, err = run(capsys, "report", "--merge", *dirs, "--report-dir", tmp_path / "m", "-q")
    assert rc == 2, (out, err)
    one_line(err, "twice")


class _GoneStdout:
    """A stdout whose reader went away after the first line: a closed pipe or /dev/full."""

    def __init__(self, error):
        self.error, self.lines, self.encoding = error, 0, "utf-8"

    def write(self, text):
        if "\n" in text:
            self.lines += 1
        if self.lines > 1:
            raise self.error
        return len(text)

    def flush(self):
        if self.lines > 1:
            raise self.error

    def isatty(self):
        return False


@pytest.mark.parametrize("error", [BrokenPipeError(32, "Broken pipe"), OSError(28, "No space left on device")],
                         ids=["closed pipe", "dev full"])
def test_a_console_that_goes_away_does_not_stop_the_run(tmp_path, capsys, monkeypatch, dumps, error):
    import sys
    monkeypatch.setattr(sys, "stdout", _GoneStdout(error))
    rc = main(["diff", str(dumps["flipped"]), str(dumps["good"]), "--report-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 1, err                                  # the verdict: the flipped byte fails
    assert (tmp_path / "r" / "report.json").is_file() and (tmp_path / "r" / "report.md").is_file()
    one_line(err, "stdout", error.strerror)


def test_sighup_stops_a_run_as_sigterm_does(tmp_path):
    """A closed terminal (SIGHUP) stops `validate -j 2` as SIGTERM does: a partial report
    naming the signal, exit 130, every worker gone and the directory's lock released."""
    import signal

    from test_interrupt import CASES, _alive, _run_and_interrupt
    rc, out, err, took, kids, d = _run_and_interrupt(tmp_path, 2, 2, signal.SIGHUP)
    assert rc == 130, (out, err)
    data = json.loads((d / "report.json").read_text())
    stopped = data["run"]["interrupted"]
    assert stopped["signal"] == "SIGHUP" and stopped["cancelled"]
    assert sorted([c["case"] for c in data["cases"]] + stopped["cancelled"]) == sorted(CASES)
    assert not [k for k in kids if _alive(k)]
    assert not (d / ".mxval-run.lock").exists()


@pytest.mark.parametrize("label", ["violated metrics deleted", "every metric deleted"])
def test_a_pass_row_missing_its_metrics_is_refused(tmp_path, capsys, a_report, label):
    """A failing row stored as a pass once its violated metrics were deleted, or a pass row with
    no metric at all: the metrics its ops always report and the budgets bound are required."""
    data = _failing(a_report)
    c = data["cases"][0]
    if label == "every metric deleted":
        c["metrics"] = {}
    else:
        for v in c["violations"]:
            c["metrics"].pop(v["metric"], None)
    c.update(status="pass", ok=True, violations=[], reason="")
    data["summary"]["ok"] = True
    d = _report_dir(tmp_path, data)
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (out, err)
    one_line(err, "smoke-rowend-k", "without")


def test_a_diff_row_missing_its_metrics_is_refused(tmp_path, capsys, dumps):
    d = tmp_path / "r"
    assert run(capsys, "diff", dumps["good"], "--report-dir", d, "-q")[0] == 0
    data = json.loads((d / "report.json").read_text())
    data["cases"][0]["metrics"] = {k: v for k, v in data["cases"][0]["metrics"].items() if not k.startswith("topk.")}
    (d / "report.json").write_text(json.dumps(data))
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 2, (out, err)
    one_line(err, "without topk.")


def test_html_ids_are_unique_per_case(tmp_path, capsys, a_report):
    import re
    data = json.loads(json.dumps(a_report))
    names = ["x y", "x_y", "x.y", "x/y"]
    data["cases"] = [dict(data["cases"][0], case=n) for n in names]
    d = _report_dir(tmp_path, data)
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 0, err
    page = (d / "report.html").read_text()
    ids = re.findall(r"<section class='case[^']*' id='([^']+)'><h3>([^<]+?) —", page)
    assert sorted(h for _, h in ids) == sorted(names) and len({i for i, _ in ids}) == len(names), ids
    for sid, name in ids:                                 # each overview link leads to its own case
        assert f"<a href='#{sid}'>{name}</a>" in page


def test_the_closing_reports_line_escapes_the_directory(tmp_path, capsys, a_report):
    d = _report_dir(tmp_path, a_report, "r\x1b]0;owned\x07")
    rc, out, err = run(capsys, "report", d, "-q")
    assert rc == 0, err
    assert "reports: " in out and "\x1b" not in out + err and "\x07" not in out + err
    rc, out, err = run(capsys, "validate", "--case", "smoke-rowend-k", "--backend", "reference", "-q",
                       "--report-dir", tmp_path / "v\x1b[31mred")
    assert rc == 0, err
    assert "reports: " in out and "\x1b" not in out + err


def test_a_stale_lock_is_taken_over_and_a_live_one_named(tmp_path, capsys):
    """A lock whose pid now belongs to a later process (pid 1, started long before that run) is
    stale: taken over. One held by a live mxval is refused naming the lock file and how to clear it."""
    import subprocess
    import sys
    d = tmp_path / "r"
    d.mkdir()
    (d / ".mxval-run.lock").write_text("1 999999999999")
    argv = ["validate", "--case", "smoke-rowend-k", "--backend", "reference", "--report-dir", d, "-q"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "mxval"])
    try:
        (d / ".mxval-run.lock").write_text(str(live.pid))
        rc, out, err = run(capsys, *argv, "--force")
        assert rc == 2, (out, err)
        one_line(err, f"pid {live.pid}", str(d / ".mxval-run.lock"), "delete")
    finally:
        live.kill()
        live.wait()


def test_a_report_directory_swapped_for_a_link_mid_run_is_not_written_through(tmp_path, capsys, monkeypatch, dumps):
    """The directory a run claimed is the one it writes into (held open): swapped for a link to
    another run's report while the run runs, that other report is left as it was."""
    import os

    from harness.io import report
    other = tmp_path / "other"
    assert run(capsys, "diff", dumps["good"], "--report-dir", other, "-q")[0] == 0
    before = _snapshot(other)
    d = tmp_path / "r"
    real = report.markdown

    def markdown(*a, **kw):
        if not (tmp_path / "moved").exists():
            os.rename(d, tmp_path / "moved")
            os.symlink(other, d)
        return real(*a, **kw)
    monkeypatch.setattr(report, "markdown", markdown)
    rc, out, err = run(capsys, "diff", dumps["flipped"], "--report-dir", d, "-q")
    assert rc == 1, (out, err)
    assert _snapshot(other) == before
    assert json.loads((tmp_path / "moved" / "report.json").read_text())["summary"]["ok"] is False
    assert "replaced while the run ran" in err


@pytest.mark.slow
@pytest.mark.parametrize("gap", [0.05, 0.4])
def test_study_interrupted_twice_ends_without_a_traceback(tmp_path, gap):
    """Ctrl-C, then Ctrl-C again while the study winds down its workers: the partial study is
    announced, exit 130, no traceback, no worker left."""
    import os
    import signal
    import subprocess
    import sys
    import time
    # 40 seeds: a study that runs well past the first interrupt on a fast host (with 3 it ended
    # before it, and the Ctrl-C met a finished process)
    (tmp_path / "s.toml").write_text('[distribution.normal]\n[distribution.wide]\nhead_scale_spread = 1.0\n[study.s]\n'
                                     'variants = ["exact", "mxfp4"]\ncontext_tokens = [8192, 16384]\nrows = 2\n'
                                     'seeds = 40\nneedle_depths = []\nneedle_margins = []\nheads = 4\n')
    d = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-m", "harness", "study", "--study", "s", "--study-file", str(tmp_path / "s.toml"),
                          "--device", "cpu", "--jobs", "2", "--report-dir", str(d)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.time() + 60
        while not d.is_dir() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(4)
        p.send_signal(signal.SIGINT)
        time.sleep(gap)
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_the_interpreter_adds_no_numpy_warnings_to_the_console():
    """The Triton interpreter runs masked lanes through numpy (a softmax's -inf - -inf in a
    pooling window's padding): numpy's "invalid value encountered" says nothing about the
    kernel, whose output is compared byte for byte, and never reaches the console."""
    import warnings

    from helpers import pool_case
    be = get_backend("triton-interpret")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        be.compress_pool(**pool_case())
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in seen]


def test_a_signal_while_a_study_is_written_is_recorded_in_it(tmp_path, capsys, monkeypatch):
    import os
    import signal

    from harness.study import report as study_report
    real = study_report.full_markdown

    def full_markdown(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **kw)
    monkeypatch.setattr(study_report, "full_markdown", full_markdown)
    (tmp_path / "s.toml").write_text('[distribution.normal]\n[study.s]\nvariants = ["exact", "mxfp4"]\n'
                                     'context_tokens = [512]\nrows = 1\nseeds = 1\nneedle_depths = []\n'
                                     'needle_margins = []\nheads = 2\n')
    rc, out, err = run(capsys, "study", "--study", "s", "--study-file", tmp_path / "s.toml", "--device", "cpu",
                       "--report-dir", tmp_path / "r")
    assert rc == 130, err
    saved = json.loads((tmp_path / "r" / "study.json").read_text())
    assert saved["meta"]["interrupted"]["signal"] == "SIGINT"
    assert "interrupted" in (tmp_path / "r" / "study.md").read_text().splitlines()[0]
