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
