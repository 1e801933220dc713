"""Fuzz: generated damaged case files, budgets files, dumps and arguments, seeded.

Each attempt runs `mxval` in-process and asserts the contract for bad input: exit 2, exactly
one line on stderr (`mxval: <file or argument>: <problem>`, naming the file and, where there
is one, the case and the key), no traceback, no report written, and every input file left
byte for byte as it was. Content damage that is legal input (a flipped output byte, a
degenerate but well-formed dump) must give a verdict (exit 0 or 1), never an internal error.
"""
import hashlib
import json
import math
import random
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from harness.commands.cli import main
from harness.diff.metrics import METRICS, REQUIRED
from harness.run import cases as C

ROOT = Path(__file__).resolve().parent.parent
SEED = 20261203
KW = "k_norm_rope_mxfp4_cache"


# --- the harness of every attempt ---------------------------------------------------------

def _digest(paths) -> dict:
    out = {}
    for p in paths:
        p = Path(p)
        for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())):
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def attempt(capsys, argv, inputs, *, rc=(2,), needles=(), report_dir=None):
    before = _digest(inputs)
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code in rc, (argv, code, out, err)
    assert "Traceback" not in err and "internal error" not in err, (argv, err)
    if code == 2:
        lines = [x for x in err.strip().splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("mxval: "), (argv, err)
        for n in needles:
            assert str(n) in lines[0], (argv, n, lines[0])
        if report_dir is not None:
            assert not Path(report_dir).exists(), (argv, "a report was written for bad input")
    assert _digest(inputs) == before, (argv, "an input file was modified")
    return code, out, err


# --- TOML writing -------------------------------------------------------------------------

def tv(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(tv(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {tv(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def table(name, d) -> str:
    return f"[{name}]\n" + "".join(f"{json.dumps(k)} = {tv(v)}\n" for k, v in d.items())


# --- case files ---------------------------------------------------------------------------

BASE_CASE = {"name": "c", "ops": ["topk"], "heads": 4, "topk": 8, "seqs": [{"len": 16, "chunks": [16]}]}

BAD_VALUES = {   # per schema kind: values that can never be right
    C.Int: lambda s, r: r.choice(["x", 1.5, True, [1], {"a": 1}, s.lo - 1, s.hi + 1]
                                 + ([10 ** 12] if s.hi < 10 ** 12 else [])),
    C.Float: lambda s, r: r.choice(["x", math.nan, math.inf, -math.inf, 1e300, True]),
    C.Share: lambda s, r: r.choice(["x", math.nan, 0, 0.0, -0.5, 1.5, True]),
    C.Bool: lambda s, r: r.choice(["yes", 1, 0.0, [True]]),
    C.Str: lambda s, r: r.choice([3, 1.5, ["a"], {"a": "b"}, True] + ([""] if not s.empty_ok else [])),
    C.Choice: lambda s, r: r.choice(["bogus", 3, True, [s.options[0]], ""]),
    C.List: lambda s, r: r.choice(["topk" if s.lo else 3, {"a": 1}, 7] + ([[]] if s.lo else [])),
}


def bad_value(spec, r):
    if isinstance(spec, C.Either):
        return r.choice(["bogus", 1.5, {"len": 0}, [1, 2]])
    if isinstance(spec, C.Table):
        return r.choice(["x", 3, {"bogus": 1}])
    return BAD_VALUES[type(spec)](spec, r)


def case_attempts(r: random.Random):
    """(label, files {name: text}, needles) of damaged suite files."""
    out = []
    keys = [k for k in C.CASE_SCHEMA.keys if k != "name"]
    for i in range(70):
        key = keys[i % len(keys)]
        case = dict(BASE_CASE)
        case[key] = bad_value(C.CASE_SCHEMA.keys[key], r)
        text = table("suite", {"name": "s"}) + "[[case]]\n" + "".join(f"{k} = {tv(v)}\n" for k, v in case.items())
        out.append((f"case.{key}={case[key]!r}", {"s.toml": text}, ["s.toml", "'c'", key]))
    semantic = [
        ("chunks exceed len", {"seqs": [{"len": 4, "chunks": [3, 3]}]}, "seqs[0]"),
        ("no step", {"seqs": [{"len": 4, "chunks": []}]}, "seqs[0]"),
        ("too many tokens", {"seqs": [{"len": 2 ** 21}, {"len": 2 ** 21}]}, "seqs"),
        ("unknown key", {"heds": 4}, "heds"),
        ("seq unknown key", {"seqs": [{"len": 4, "chunk": [4]}]}, "seqs[0]"),
        ("plant missing value", {"plant": [{"tensor": "q"}]}, "plant[0].value"),
        ("plant count 0", {"plant": [{"tensor": "q", "value": "nan", "count": 0}]}, "plant[0].count"),
        ("expect without plant", {"expect_nonfinite": True}, "expect_nonfinite"),
        ("mixed chains", {"ops": ["k_norm_rope_mxfp4_cache", "k_norm_rope_fp8_cache"]}, "ops"),
        ("duplicate op", {"ops": ["topk", "topk"]}, "ops"),
        ("layout group", {"layout": [7, 7, 7], "ops": [KW]}, "page_size"),
        ("ops string", {"ops": "topk"}, "ops"),
        ("dist string", {"dist": "normal"}, "dist"),
        ("pool too small", {"seqs": [{"len": 400, "chunks": [400]}], "pool_pages": 1}, "pool_pages"),
        ("pool too large", {"pool_pages": 2 ** 21}, "pool_pages"),
        ("queries too large", {"heads": 256, "seqs": [{"len": 100000, "chunks": [100000]}]}, "seqs"),
        ("logits too large", {"heads": 1, "seqs": [{"len": 2 ** 20, "chunks": [2 ** 19]}]}, "seqs"),
    ]
    for label, over, key in semantic:
        case = {**BASE_CASE, **over}
        text = table("suite", {"name": "s"}) + "[[case]]\n" + "".join(f"{k} = {tv(v)}\n" for k, v in case.items())
        out.append((label, {"s.toml": text}, ["s.toml", "'c'", key]))
    good = "[[case]]\n" + "".join(f"{k} = {tv(v)}\n" for k, v in BASE_CASE.items())
    files = [
        ("suite name type", {"s.toml": table("suite", {"name": 3}) + good}, ["s.toml", "name"]),
        ("suite description type", {"s.toml": table("suite", {"description": [1]}) + good}, ["s.toml", "description"]),
        ("include string", {"s.toml": table("suite", {"include": "smoke"}) + good}, ["s.toml", "include"]),
        ("include unknown", {"s.toml": table("suite", {"include": ["nope"]}) + good}, ["s.toml", "nope"]),
        ("include itself", {"s.toml": table("suite", {"name": "s", "include": ["s"]}) + good}, ["s.toml", "itself"]),
        ("include cycle", {"a.toml": table("suite", {"name": "a", "include": ["b"]}) + good,
                           "b.toml": table("suite", {"name": "b", "include": ["a"]})
                           + good.replace('"c"', '"c2"')}, ["include", "itself"]),
        ("suite not a table", {"s.toml": 'suite = "x"\n' + good}, ["s.toml", "[suite]"]),
        ("defaults bad", {"s.toml": table("defaults", {"heads": "x"}) + good}, ["s.toml", "[defaults]", "heads"]),
        ("defaults name", {"s.toml": table("defaults", {"name": "x"}) + good}, ["s.toml", "[defaults]", "name"]),
        ("case not tables", {"s.toml": 'case = "x"\n'}, ["s.toml", "case"]),
        ("case list of ints", {"s.toml": "case = [1, 2]\n"}, ["s.toml", "case #1"]),
        ("case without name", {"s.toml": "[[case]]\nheads = 4\n"}, ["s.toml", "name"]),
        ("case empty name", {"s.toml": '[[case]]\nname = ""\n'}, ["s.toml", "name"]),
        ("case twice", {"s.toml": good + good}, ["s.toml", "'c'", "twice"]),
        ("top-level key", {"s.toml": "oops = 1\n" + good}, ["s.toml", "oops"]),
        ("malformed", {"s.toml": "[[case]\nname = 'c'\n"}, ["s.toml", "malformed"]),
    ]
    return out + files


def test_damaged_case_files(tmp_path, capsys):
    r = random.Random(SEED)
    attempts = case_attempts(r)
    assert len(attempts) >= 90
    for i, (label, files, needles) in enumerate(attempts):
        d = tmp_path / f"c{i}"
        d.mkdir()
        for name, text in files.items():
            (d / name).write_text(text)
        needles = [str(d / n) if n.endswith(".toml") else n for n in needles]
        if i % 10 == 0:              # validate refuses before running anything
            attempt(capsys, ["validate", "--suite", "s", "--cases-dir", d, "--backend", "reference",
                             "--report-dir", d / "r"],
                    [d], needles=needles, report_dir=d / "r")
        else:
            attempt(capsys, ["cases", "--cases-dir", d], [d], needles=needles)


# --- budgets files ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dump_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("dump")
    path = d / "step.safetensors"
    assert main(["dump", "--case", "smoke-rowend-k", "--backend", "reference", "-o", str(path)]) == 0
    return path


def _budget_text(data: dict) -> str:
    parts = []
    if "default" in data:
        parts.append(table("default", data["default"]))
    for scope in ("suite", "case"):
        for name, t in data.get(scope, {}).items():
            parts.append(table(f'{scope}."{name}"', t))
    return "\n".join(parts)


def budget_attempts(r: random.Random):
    contract = tomllib.loads((ROOT / "cases" / "budgets.toml").read_text())
    required = list(REQUIRED) + ["chain.page_bytes_mismatched_frac", "chain.page_bytes_outside_owned_changed",
                                 "chain.topk_padding_errors", "chain.topk_duplicates", "chain.topk_out_of_range"]
    out = []
    for i in range(45):
        data = json.loads(json.dumps(contract))
        d = data["default"]
        kind = i % 9
        if kind == 0:                          # a required metric left out
            key = r.choice(required)
            del d[key]
            out.append((f"drop {key}", _budget_text(data), ["no limit for", key]))
        elif kind == 1:                        # a misspelt key
            key = r.choice(sorted(d))
            pos = r.randrange(len(key))
            bad = key[:pos] + "x" + key[pos + 1:] if key[pos] != "x" else key + "s"
            d[bad] = d.pop(key)
            out.append((f"typo {bad}", _budget_text(data), [bad]))
        elif kind == 2:                        # a malformed value
            key = r.choice(sorted(d))
            d[key] = r.choice(["lots", True, [1], {"maximum": 1}, {}, {"max": "1"}])
            out.append((f"value {key}", _budget_text(data), [key]))
        elif kind == 3:                        # a limit no value can meet
            key = r.choice([k for k in d if not METRICS[k.rpartition(".")[2]].higher_is_better])
            d[key] = r.choice([-1, -0.5, {"max": -1}, {"max": 1, "min": 2}, math.nan, {"max": math.nan}, math.inf,
                               {"min": -math.inf}])
            out.append((f"impossible {key}", _budget_text(data), [key]))
        elif kind == 4:                        # a recall above 1
            d["topk_recall_min"] = r.choice([1.5, 2, {"min": 1.01}])
            out.append(("recall > 1", _budget_text(data), ["topk_recall_min", "no value can pass"]))
        elif kind == 5:                        # a stage that does not report the metric
            bad = r.choice(["compress_pool.page_bytes_mismatched", "chain.pooled_max_ulp", "bogus.logits_diff",
                            "topk.logits_diff", "page_bytes_mismatched_frac"])
            d[bad] = 0
            out.append((f"stage {bad}", _budget_text(data), [bad]))
        elif kind == 6:                        # a scope that names nothing
            scope = r.choice(["suite", "case"])
            data.setdefault(scope, {})["nope-" + str(i)] = {"pooled_max_ulp": 0}
            out.append((f"{scope} scope", _budget_text(data), [f"[{scope}.nope-{i}]"]))
        elif kind == 7:                        # a scoped key matching no metric of the run
            data["case"] = {"step.safetensors": {"k_norm_rope_fp8_cache.page_bytes_mismatched": 0}}
            out.append(("scoped no metric", _budget_text(data), ["k_norm_rope_fp8_cache.page_bytes_mismatched",
                                                                 "matches no metric"]))
        else:                                  # structure
            text, needle = r.choice([("", "empty"), ("[default]\n", "empty"), ("oops = 1\n", "oops"),
                                     ("[default\n", "malformed"), ("[suite]\nx = 1\n", "suite"),
                                     ('[suite."diff"]\n', "empty"), ("default = 3\n", "default")])
            out.append((f"structure {needle}", text, [needle]))
    return out


def test_damaged_budgets_files(tmp_path, capsys, dump_file):
    r = random.Random(SEED + 1)
    attempts = budget_attempts(r)
    for i, (label, text, needles) in enumerate(attempts):
        b = tmp_path / f"b{i}.toml"
        b.write_text(text)
        validate = i % 7 == 0 or label.startswith("drop chain.")    # a dump has no whole-chain metrics
        cmd = ["validate", "--case", "smoke-rowend-k", "--backend", "reference"] if validate else ["diff", dump_file]
        if cmd[0] == "validate" and "step.safetensors" in text:
            continue
        attempt(capsys, [*cmd, "--budgets", b, "--report-dir", tmp_path / f"r{i}"], [b, dump_file],
                needles=[str(b), *needles], report_dir=tmp_path / f"r{i}")


def test_the_contract_file_passes(tmp_path, capsys, dump_file):
    b = tmp_path / "b.toml"
    shutil.copy(ROOT / "cases" / "budgets.toml", b)
    attempt(capsys, ["diff", dump_file, "--budgets", b, "--report-dir", tmp_path / "r", "-q"], [b, dump_file], rc=(0,))


# --- dumps --------------------------------------------------------------------------------

def _load(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def dump_attempts(r: random.Random, src: Path):
    """(label, builder(dst) -> None, expected exit codes, needles)."""
    t0, m0 = _load(src)
    meta0 = json.loads(m0["mxval"])
    out = []

    def save(t, meta, raw=False):
        def build(dst):
            save_file(t, str(dst), metadata=meta if raw else {"mxval": json.dumps(meta)})
        return build

    def shared_dim0(name):          # narrowing dim 0 breaks a dim another field shares
        from reference.ops import OPS
        op, io, arg = name.split("/")
        f = OPS[op].fields
        table = f.inputs if io == "in" else f.outputs
        sym = str(table[arg].shape[0]).split("/")[0].split("+")[0].split("*")[-1]
        return sum(sym in str(d) for fl in (*f.inputs.values(), *f.outputs.values()) for d in fl.shape) >= 2

    def with_scalar(op, key, value):
        meta = json.loads(json.dumps(meta0))
        if value is KeyError:
            meta["ops"][op].pop(key)
        else:
            meta["ops"][op][key] = value
        return save(t0, meta)

    scalar_damage = [
        (KW, "norm_eps", [-1e-6, 0, "x", None, True, 1e-300, math.nan]), (KW, "page_size", [0, -64, 1.5, "64", 48]),
        (KW, "compress_ratio", [0, -4, 2.5]), (KW, "shuffle", [[7, 7, 7], [32, 16], "x", [0, 16, 2]]),
        ("q_rope_mxfp4_quant", "weights_scale", [-1.0, 0.0, "x", None, 1e300]), ("topk", "k", [0, -8, 1.5, True]),
        ("paged_mxfp4_mqa_logits", "clean_logits", ["yes", 1]), (KW, "bogus", [1]), (KW, "norm_eps", [KeyError]),
    ]
    for op, key, values in scalar_damage:
        for v in values:
            out.append((f"scalar {op}.{key}={v!r}", with_scalar(op, key, v), (2,), [f"{op}" if key != "bogus" else key]))
    names = sorted(t0)
    for i in range(50):
        name = names[r.randrange(len(names))]
        t = dict(t0)
        x = t[name]
        kind = i % 5
        if kind == 0:                  # a dtype no field of the table allows
            t[name] = x.to(torch.float16) if x.is_floating_point() else x.float()
            label = "dtype"
        elif kind == 1:
            t[name] = x.unsqueeze(0).contiguous()
            label = "rank"
        elif kind == 2:
            if not shared_dim0(name):
                continue
            t[name] = x[:-1].contiguous() if x.shape[0] > 1 else torch.cat([x, x]).contiguous()
            label = "shape"
        elif kind == 3:
            del t[name]
            label = "missing"
        else:
            t[name.rsplit("/", 1)[0] + "/bogus"] = x.clone()
            label = "extra tensor"
        out.append((f"tensor {label} {name}", save(t, meta0), (2,), [name.split("/")[0]]))
    raw = src.read_bytes()
    for i in range(8):
        cut = r.randrange(1, len(raw) - 1)
        out.append((f"truncated at {cut}", lambda dst, c=cut: dst.write_bytes(raw[:c]), (2,), []))
    out += [
        ("no metadata key", save(t0, {"other": "1"}, raw=True), (2,), ["mxval"]),
        ("metadata not json", save(t0, {"mxval": "{nope"}, raw=True), (2,), ["JSON"]),
        ("version 2", save(t0, {**meta0, "version": 2}), (2,), ["version"]),
        ("format", save(t0, {**meta0, "format": "x"}), (2,), ["format"]),
        ("no ops", save(t0, {**meta0, "ops": {}}), (2,), ["ops"]),
        ("unknown op", save(t0, {**meta0, "ops": {**meta0["ops"], "nope": {}}}), (2,), ["nope"]),
        ("garbage", lambda dst: dst.write_bytes(b"\x00" * 64), (2,), []),
        ("empty file", lambda dst: dst.write_bytes(b""), (2,), []),
    ]
    # content that is degenerate but legal, or plainly wrong data: a verdict, never a crash
    t = dict(t0)
    t["paged_mxfp4_mqa_logits/in/row_ends"] = -t["paged_mxfp4_mqa_logits/in/row_ends"]
    out.append(("negative row_ends", save(t, meta0), (2,), ["row_ends"]))
    t = dict(t0)
    t["topk/in/lengths"] = torch.full_like(t["topk/in/lengths"], -1)
    out.append(("negative lengths", save(t, meta0), (2,), ["lengths"]))
    rows = t0["topk/in/logits"].shape[0]
    t = {k: v for k, v in t0.items() if k.startswith("topk/")}
    t["topk/in/logits"] = torch.zeros(rows, 0)
    t["topk/in/lengths"] = torch.zeros(rows, dtype=t0["topk/in/lengths"].dtype)
    t["topk/out/indices"] = torch.full((rows, meta0["ops"]["topk"]["k"]), -1, dtype=torch.int32)
    out.append(("top-k of width 0", save(t, {**meta0, "ops": {"topk": meta0["ops"]["topk"]}}), (0,), []))
    q = "q_rope_mxfp4_quant"
    t = {k: (v[:0].clone() if k != f"{q}/in/cos_sin_cache" else v) for k, v in t0.items() if k.startswith(q + "/")}
    out.append(("Q quant of 0 tokens", save(t, {**meta0, "ops": {q: meta0["ops"][q]}}), (0,), []))
    t = dict(t0)
    pool = t[f"{KW}/out/kv_cache"].clone()
    pool.view(-1)[r.randrange(pool.numel())] ^= 0xFF
    t[f"{KW}/out/kv_cache"] = pool
    out.append(("flipped pool byte", save(t, meta0), (1,), []))     # owned or not, a changed byte fails
    t = dict(t0)
    t["q_rope_mxfp4_quant/out/q_scale"] = torch.full_like(t["q_rope_mxfp4_quant/out/q_scale"], 0xFF)
    out.append(("NaN scales out", save(t, meta0), (1,), []))
    return out


def test_damaged_dumps(tmp_path, capsys, dump_file):
    r = random.Random(SEED + 2)
    attempts = dump_attempts(r, dump_file)
    assert len(attempts) >= 80
    failed = []
    for i, (label, build, rc, needles) in enumerate(attempts):
        dst = tmp_path / f"d{i}.safetensors"
        build(dst)
        needles = [str(dst), *needles] if rc == (2,) else []
        try:
            attempt(capsys, ["diff", dst, "--report-dir", tmp_path / f"r{i}", "-q"], [dst, dump_file], rc=rc,
                    needles=needles, report_dir=tmp_path / f"r{i}" if rc == (2,) else None)
        except AssertionError as e:
            failed.append(f"{label}: {str(e)[-300:]}")
    assert not failed, "\n".join(failed)


def test_two_dumps_of_one_name(tmp_path, capsys, dump_file):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = tmp_path / "a" / "x.safetensors", tmp_path / "b" / "x.safetensors"
    shutil.copy(dump_file, a)
    shutil.copy(dump_file, b)
    for files in ([a, b], [a, a]):
        attempt(capsys, ["diff", *files, "--report-dir", tmp_path / "r"], [a, b], needles=["same file name"],
                report_dir=tmp_path / "r")


# --- arguments ----------------------------------------------------------------------------

ARGV = [
    (["validate", "--suite", ""], "--suite"), (["validate", "--case", ""], "--case"),
    (["validate", "--case", "smoke-rowend-k", "--case", " "], "--case"),
    (["validate", "--backend", "", "--case", "smoke-rowend-k"], "--backend"),
    (["validate", "--suite", "nope", "--case", "smoke-rowend-k"], "--suite"),
    (["validate", "--suite", "smoke", "--case", "smoke-rowend-k"], "--case"),
    (["validate", "--case", "smoke-rowend-k", "--case", "smoke-rowend-k"], "twice"),
    (["validate", "--case", "smoke-rowend-k", "-j", "0"], "-j"), (["validate", "--case", "smoke-rowend-k", "-j", "-3"], "-j"),
    (["validate", "--case", "smoke-rowend-k", "-j", "x"], "-j"), (["validate", "--budgets", ""], "--budgets"),
    (["validate", "--cases-dir", ""], "--cases-dir"), (["validate", "--report-dir", ""], "--report-dir"),
    (["diff", ""], "FILE"), (["diff"], "FILE"), (["dump", "--case", ""], "--case"),
    (["dump", "--case", "smoke-rowend-k", "-o", ""], "-o"), (["dump", "--case", "smoke-rowend-k", "--step", "-1"], "--step"),
    (["cases", "--suite", ""], "--suite"), (["cases", "--suite", "nope"], "nope"), (["report", ""], "dir"),
    (["selftest", "--fault", ""], "--fault"), (["selftest", "-j", "0"], "-j"), (["study", "--study", ""], "--study"),
    (["selftest", "--quick", "--large"], "not with --quick"), (["study", "--from-json", "x.json", "--device", "cpu"],
                                                              "not with --from-json"),
]


@pytest.mark.parametrize("argv, needle", ARGV, ids=[" ".join(a) for a, _ in ARGV])
def test_bad_arguments(tmp_path, capsys, argv, needle):
    attempt(capsys, argv, [], needles=[needle])


# --- property-based search (hypothesis): what the hand lists above miss ------------------------
#
# Each property: a generated input is either refused with the command's one-line error class
# or used; never another exception (an internal error, exit 3). Derandomized (the same
# examples on every run) and small, for CI.

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harness.errors import InputError  # noqa: E402

BIG, DEEP = "<a 5000-digit integer>", "<an array nested 5000 deep>"      # written raw into the file
RAW = {BIG: "9" * 5000, DEEP: "[" * 5000 + "]" * 5000}


def raw_json(doc) -> str:
    text = json.dumps(doc, allow_nan=True)
    for k, v in RAW.items():
        text = text.replace(json.dumps(k), v)
    return text


SEARCH = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 80), max_value=2 ** 80)
           | st.sampled_from([0, 1, -1, 2 ** 20, 2 ** 31, 2 ** 63, 10 ** 39])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["", "e4m3fn", "fp32", "shuffled", "natural", "nan", "=1+1", "[/]", "$\\x$", "../x"])
           | st.sampled_from([BIG, DEEP]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)
TOMLISH = st.recursive(SCALARS.filter(lambda v: v is not None),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                           st.sampled_from(["len", "chunks", "decode", "tensor", "value", "count", "x", "max", "min"]),
                           inner, max_size=3), max_leaves=10)


def _paths(obj, prefix=()):
    """Every (path, value) inside a JSON value."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _replace(obj, path, value):
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return obj


def _toml(v) -> str:
    if v is None:
        return '""'
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, str):
        return RAW.get(v) or json.dumps(v).replace("\\u007f", "\\u007F")
    return tv(v)


@pytest.fixture(scope="module")
def search_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("search")


def _fresh(d: Path, suffix: str) -> Path:
    n = len(list(d.iterdir()))
    return d / f"x{n}{suffix}"


def test_search_dump_headers(dump_file, search_dir):
    """Any value anywhere in a dump's `mxval` metadata: DumpError or a readable dump."""
    from harness.io.dumps import DumpError, read_dump
    from harness.run.replay import replay_dump
    t0, m0 = _load(dump_file)
    meta0 = json.loads(m0["mxval"])
    paths = [p for p, _ in _paths(meta0)]

    @SEARCH
    @given(st.data())
    def search(data):
        path = data.draw(st.sampled_from(paths))
        meta = _replace(meta0, path, data.draw(JSON))
        f = _fresh(search_dir, ".safetensors")
        save_file(t0, str(f), metadata={"mxval": raw_json(meta)})
        try:
            dump = read_dump(f)
        except DumpError:
            return
        try:                                             # what the reader let through must replay
            replay_dump(dump)
        except InputError:
            pass
    search()


def test_search_case_files(search_dir):
    """Any value for any case key: CaseError, or a case whose geometry is checked or refused."""
    from harness.run.geometry import geometry
    keys = sorted(C.CASE_SCHEMA.keys)

    @SEARCH
    @given(st.dictionaries(st.sampled_from(keys), TOMLISH, max_size=4))
    def search(over):
        case = {**BASE_CASE, **over}
        d = _fresh(search_dir, "")
        d.mkdir()
        f = d / "s.toml"
        f.write_text('[suite]\nname = "s"\n[[case]]\n' + "".join(f"{k} = {_toml(v)}\n" for k, v in case.items()))
        try:
            for c in C.load_suite_file(f).cases:
                geometry(c)
        except InputError:
            pass
    search()


def test_search_budgets(search_dir):
    """Any limit for any metric key (or a made-up one): BudgetError or usable budgets."""
    from harness.run import budgets as B
    contract = tomllib.loads((ROOT / "cases" / "budgets.toml").read_text())
    names = sorted(contract["default"]) + ["bogus", "chain.bogus", "topk.logits_diff"]

    @SEARCH
    @given(st.dictionaries(st.sampled_from(names), TOMLISH, max_size=3),
           st.sampled_from(["default", "suite.smoke", "case.smoke-rowend-k", "suite.nope"]))
    def search(over, scope):
        data = json.loads(json.dumps(contract))
        if scope == "default":
            data["default"].update(over)
        else:
            kind, name = scope.split(".")
            data.setdefault(kind, {})[name] = over
        f = _fresh(search_dir, ".toml")
        f.write_text(_budget_text(data))
        for k, v in RAW.items():
            f.write_text(f.read_text().replace(json.dumps(k), v))
        try:
            b = B.load(f)
            b.check_run({"smoke-rowend-k": [f"topk.{k}" for k in ("topk_duplicates", "topk_out_of_range")]}, "smoke",
                        known_cases=["smoke-rowend-k"], known_suites=["smoke"])
            b.check({"topk.topk_duplicates": 1.0}, "smoke", "smoke-rowend-k")
        except InputError:
            pass
    search()


@pytest.fixture(scope="module")
def report_json(tmp_path_factory):
    d = tmp_path_factory.mktemp("rj") / "r"
    assert main(["validate", "--case", "smoke-rowend-k", "--backend", "reference", "--report-dir", str(d), "-q"]) == 0
    return json.loads((d / "report.json").read_text())


def test_search_report_json_shapes(report_json, search_dir, capsys):
    """Any value anywhere in a report.json: `mxval report` re-renders it (exit 0/1/130) or
    refuses it with one line (exit 2); never an internal error."""
    paths = [p for p, _ in _paths(report_json) if p and p[0] in ("run", "cases")
             and not (len(p) > 3 and p[2] == "summaries")][:400]

    @settings(SEARCH, max_examples=40)
    @given(st.data())
    def search(data):
        path = data.draw(st.sampled_from(paths))
        doc = _replace(report_json, path, data.draw(JSON))
        d = _fresh(search_dir, "")
        d.mkdir()
        (d / "report.json").write_text(raw_json(doc))
        code = main(["report", str(d), "-q"])
        out, err = capsys.readouterr()
        assert code in (0, 1, 2, 130) and "internal error" not in err, (path, code, err[-500:])
        if code == 2:
            assert len(err.strip().splitlines()) == 1, err
    search()
