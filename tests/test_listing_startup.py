"""`mxval cases` and `mxval backends` load no torch, triton, numpy or pandas (their start-up
target is a row of the start-up bench, harness/bench/startup.py); what `backends` cannot know
without an import it says is not checked, and where it does know, it agrees with the built
backends."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "triton", "numpy", "pandas", "matplotlib")


def _run(*argv, timeout=120):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _imports(*args) -> tuple[subprocess.CompletedProcess, set]:
    """`mxval ARGS` in a fresh process: (the process, every module it imported)."""
    r = _run("-X", "importtime", "-m", "harness", *args)
    mods = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    return r, mods


def _heavy(mods: set) -> list:
    return sorted(m for m in mods if m.split(".")[0] in HEAVY)


@pytest.mark.parametrize("args", [("cases",), ("cases", "--suite", "smoke"), ("backends",), ("backends", "--faults")])
def test_listing_commands_import_no_torch(args):
    r, mods = _imports(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "harness.commands.cli" in mods and "rich.table" in mods      # the import list is the whole story
    assert not _heavy(mods), _heavy(mods)[:10]
    if args[0] == "cases":
        assert "smoke-rowend-k" in r.stdout
    else:
        assert "triton-interpret" in r.stdout and "reference" in r.stdout
    if "--faults" in args:
        assert "fault:window-shift" in r.stdout


def test_the_import_check_sees_torch_where_a_command_loads_it():
    """The check above has teeth: `backends --check` builds the backends, and torch shows."""
    r, mods = _imports("backends", "--check")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch" in mods and "triton" in mods


def test_a_case_error_is_found_without_torch(tmp_path):
    """`mxval cases` still checks every case's shapes (a page size the shuffle cannot tile)."""
    (tmp_path / "bad.toml").write_text('[suite]\nname = "bad"\ndescription = "x"\n\n[[case]]\nname = "odd-page"\n'
                                       'description = "x"\nseqs = [{len = 40, chunks = [40]}]\npage_size = 40\n'
                                       'layout = "shuffled"\nheads = 4\ntopk = 8\nseed = 1\n')
    r, mods = _imports("cases", "--cases-dir", str(tmp_path))
    lines = r.stderr.splitlines()
    errors = [x for x in lines if not x.startswith("import time:")]
    assert r.returncode == 2 and len(errors) == 1 and errors[0].startswith("mxval: ") and "page_size" in errors[0], \
        errors
    assert not _heavy(mods)


def test_torch_build_is_read_without_importing_torch():
    r = _run("-c", "import sys, json; from optimized.probe import torch_build; b = torch_build(); "
                   "assert 'torch' not in sys.modules; import torch; "
                   "print(json.dumps([[b.version, b.cuda, b.hip], [torch.__version__, torch.version.cuda, "
                   "getattr(torch.version, 'hip', None)]]))")
    assert r.returncode == 0, r.stderr[-2000:]
    read, real = json.loads(r.stdout)
    assert read == real


def test_what_the_probe_knows_agrees_with_the_built_backends():
    """Every backend the probe calls available or unavailable is so when built (the unchecked
    ones are those only an import can tell)."""
    script = ("import json, optimized; from optimized import probe; "
              "p = {n: probe.probe(n).status for n in optimized.DECLARED}; "
              "b = {n: optimized.get_backend(n, require=False).available() is None for n in optimized.DECLARED}; "
              "print(json.dumps([p, b]))")
    r = _run("-c", script, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    probed, built = json.loads(r.stdout)
    checked = {n: s for n, s in probed.items() if s != "not checked"}
    assert {"reference", "triton", "aiter"} <= set(checked)
    assert {n: s == "available" for n, s in checked.items()} == {n: built[n] for n in checked}


def test_backends_on_each_torch_build(monkeypatch):
    """A CPU build rules the compiled backends out and points to their -interpret twins; on a
    CUDA build the GPU is unknown until torch loads, and the listing says so."""
    from optimized import probe
    monkeypatch.setattr(probe, "_loaded_torch", lambda: None)       # as in a fresh `mxval backends`
    monkeypatch.setattr(probe, "torch_build", lambda: probe.TorchBuild("2.11.0+cpu", None, None, False))
    for name in ("triton", "vllm-cuda", "vllm-rocm", "aiter-triton"):
        p = probe.probe(name)
        assert p.status == probe.UNAVAILABLE and "no CUDA or ROCm GPU" in p.text, p
        assert f"use {name}-interpret" in p.text and "CPU build" in p.text
    assert "not a ROCm build" in probe.probe("aiter").text
    assert probe.probe("reference") == probe.Probe(probe.AVAILABLE, "cpu", "pure-torch reference (reference/)")

    monkeypatch.setattr(probe, "torch_build", lambda: probe.TorchBuild("2.11.0+cu128", "12.8", None, None))
    p = probe.probe("triton")
    assert p.status == probe.UNCHECKED and "--check" in p.text and "use triton-interpret" in p.text
    assert probe.probe("reference").device == "cuda if visible, else cpu"
    status, which = probe.auto()
    assert status == probe.UNCHECKED and "triton, triton-interpret" in which

    monkeypatch.setattr(probe, "_installed", lambda m: m != "triton")
    p = probe.probe("triton-interpret")
    assert p.status == probe.UNAVAILABLE and "triton is not installed" in p.text
