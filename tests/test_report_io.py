"""Reports are never lost: each file written to a temporary name and renamed, a directory
holding another run's report refused unless --force, default directories unique, the
directory proven writable before any case runs, `mxval report` never rewriting its input,
and every file created with the mode the umask asks for."""
import json
import os
import stat
from pathlib import Path

import pytest
from helpers import mxval
from helpers import one_line_error as one_line

from harness.io import atomic, report

CASE = "smoke-clean-logits"
FILES = ("report.json", "report.md", "report.html", "junit.xml", "metrics.csv")






def validate(capsys, d, *more):
    return mxval(capsys, "validate", "--case", CASE, "--backend", "reference", "--report-dir", d, "-q", *more)


@pytest.fixture
def no_run(monkeypatch):
    """Fails the test if any case starts."""
    def boom(*a, **k):
        raise AssertionError("a case ran")
    monkeypatch.setattr("harness.run.runner.run_cases", boom)


def test_a_second_run_into_the_same_dir_is_refused_unless_force(tmp_path, capsys, monkeypatch):
    d = tmp_path / "r"
    assert validate(capsys, d)[0] == 0
    first = {n: (d / n).read_bytes() for n in FILES}
    with monkeypatch.context() as m:
        m.setattr("harness.run.runner.run_cases", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
        rc, out, err = validate(capsys, d)
    assert rc == 2 and out == ""
    one_line(err, "--report-dir", str(d), "another run's report", "--force")
    assert {n: (d / n).read_bytes() for n in FILES} == first           # untouched
    # the same for diff and selftest into that directory
    rc, out, err = mxval(capsys, "selftest", "--fault", "nibbles-swapped", "--report-dir", d, "-q")
    assert rc == 2 and out == ""
    one_line(err, "--force")
    # the first report marked, so that the forced run's is told from it even within the
    # same second (its "started" has a resolution of one)
    (d / "report.json").write_text(json.dumps({"stale": True}))
    rc, out, err = validate(capsys, d, "--force")
    assert rc == 0, err
    assert json.loads((d / "report.json").read_text())["run"]["started"]


def test_an_empty_or_unrelated_dir_is_fine(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert validate(capsys, tmp_path)[0] == 0
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_default_dirs_are_unique(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {report.default_dir("validate-x-y") for _ in range(5)}      # same second, same pid
    assert len(names) == 5 and all(p.is_dir() and f"-{os.getpid()}" in p.name for p in names)
    for _ in range(2):
        assert mxval(capsys, "validate", "--case", CASE, "--backend", "reference", "-q")[0] == 0
    runs = [p for p in (tmp_path / "reports").iterdir() if p.name.startswith("validate-") and
            (p / "report.json").exists()]
    assert len(runs) == 2


def test_an_unwritable_dir_is_refused_before_any_case_runs(tmp_path, capsys, no_run):
    target = Path("/proc/mxval-cannot-write-here")
    try:
        target.mkdir()
        target.rmdir()
        pytest.skip("/proc is writable here")
    except OSError:
        pass
    rc, out, err = validate(capsys, target)
    assert rc == 2 and out == ""
    one_line(err, "--report-dir", str(target), "cannot write")


def test_writability_check_can_fail(tmp_path, capsys, no_run, monkeypatch):
    """The probe itself is what refuses: a directory whose files cannot be created."""
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(atomic.tempfile, "mkstemp", denied)
    rc, out, err = validate(capsys, tmp_path / "r")
    assert rc == 2 and out == ""
    one_line(err, "cannot write", "Permission denied")


def test_files_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    p = tmp_path / "f.txt"
    atomic.write_text(p, "old")

    class Boom(Exception):
        pass

    def broken_fsync(fd):
        raise Boom()
    monkeypatch.setattr(atomic.os, "fsync", broken_fsync)
    with pytest.raises(Boom):
        atomic.write_text(p, "new")
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["f.txt"]


def test_a_report_write_that_fails_keeps_the_previous_report_json(tmp_path, capsys, monkeypatch):
    d = tmp_path / "r"
    assert validate(capsys, d)[0] == 0
    old = (d / "report.json").read_bytes()
    monkeypatch.setattr(report, "junit", lambda *a: (_ for _ in ()).throw(RuntimeError("disk on fire")))
    rc, out, err = validate(capsys, d, "--force")
    assert rc == 3
    assert (d / "report.json").read_bytes() == old                   # report.json is written last
    assert not [x for x in d.iterdir() if x.name.startswith(".")]    # no temporary files left


def test_report_never_rewrites_its_input(tmp_path, capsys):
    d = tmp_path / "r"
    assert validate(capsys, d)[0] == 0
    data = json.loads((d / "report.json").read_text())
    data["note"] = "kept as written"
    raw = json.dumps(data).encode()                  # not the layout mxval writes
    (d / "report.json").write_bytes(raw)
    os.utime(d / "report.json", (1_000_000, 1_000_000))
    for n in FILES[1:]:
        (d / n).unlink()
    rc, out, err = mxval(capsys, "report", d, "-q")
    assert rc == 0, err
    assert (d / "report.json").read_bytes() == raw and (d / "report.json").stat().st_mtime == 1_000_000
    assert all((d / n).exists() for n in FILES)
    rc, out, err = mxval(capsys, "report", d, "--report-dir", tmp_path / "copy", "-q")
    assert rc == 0 and (tmp_path / "copy" / "report.json").read_bytes() == raw
    # and a report directory that holds another run is refused there too
    rc, out, err = mxval(capsys, "report", tmp_path / "copy", "--report-dir", d, "-q")
    assert rc == 2
    one_line(err, "--force")


def test_report_on_a_broken_report_json_leaves_it_alone(tmp_path, capsys):
    (tmp_path / "report.json").write_text('{"schema": "mxval-report", "version": 1, "run": {}, "cases": [1]}')
    before = (tmp_path / "report.json").read_bytes()
    rc, out, err = mxval(capsys, "report", tmp_path, "-q")
    assert rc == 2 and (tmp_path / "report.json").read_bytes() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["report.json"]


@pytest.mark.parametrize("mask", [0o027, 0o002])
def test_files_follow_the_umask(tmp_path, capsys, mask):
    from helpers import load_sample

    from harness.io.dumps import OpRecord, write_dump
    old = os.umask(mask)
    try:
        assert validate(capsys, tmp_path / "r")[0] == 0
        op, scalars, ins, outs = load_sample("pool_pro")
        path = write_dump(str(tmp_path / "x.safetensors"), {op: OpRecord(op, scalars, ins, outs)},
                          source="test", model="m")
    finally:
        os.umask(old)
    want = 0o666 & ~mask
    for f in [*(tmp_path / "r").iterdir(), Path(path)]:
        assert stat.S_IMODE(f.stat().st_mode) == want, (f.name, oct(f.stat().st_mode))


def test_a_write_failing_at_the_end_still_shows_the_verdict(tmp_path, capsys, monkeypatch):
    """Past the up-front check (a disk filling during the run): one line, exit 2, with the
    verdict in it rather than hidden behind the errno."""
    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomic, "_write_fd", full)
    rc, out, err = validate(capsys, tmp_path / "r")
    assert rc == 2
    one_line(err, "No space left on device", "verdict: OK", "1 pass")
    d = tmp_path / "r"
    assert not [p for p in (d.iterdir() if d.exists() else []) if p.name != report.LOCK]    # nothing half written


def test_a_dir_in_use_by_a_running_mxval_is_refused_even_with_force(tmp_path, capsys, no_run):
    import subprocess
    import sys
    d = tmp_path / "r"
    d.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (d / report.LOCK).write_text(str(other.pid))
        rc, out, err = validate(capsys, d, "--force")
        assert rc == 2 and out == ""
        one_line(err, str(d), "in use by a running mxval", str(other.pid))
    finally:
        other.kill()
        other.wait()


def test_a_dead_runs_lock_is_taken_over_and_released(tmp_path, capsys):
    d = tmp_path / "r"
    d.mkdir()
    (d / report.LOCK).write_text("999999999")
    assert validate(capsys, d)[0] == 0
    assert not (d / report.LOCK).exists()
