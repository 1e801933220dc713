"""mxval's worker pool (harness/run/runner.py): a worker that dies costs exactly its case
(an error row naming the worker and how it died), the others finish, no case runs twice
and none is lost; GPUs are handed out round-robin."""
import os

import pytest

from harness.run import runner
from harness.run.cases import Catalog
from harness.run.runner import DIE_ENV, run_cases, worker_env

FAST = ["smoke-rowend-k", "smoke-clean-logits", "smoke-fp8", "smoke-nan-state", "smoke-inf-q"]


@pytest.fixture(scope="module")
def cases():
    cat = Catalog()
    return [cat.case(n) for n in FAST]


@pytest.fixture
def ran(tmp_path, monkeypatch):
    """Every case a worker starts, appended (one line each, from any process) to a file."""
    log = tmp_path / "ran.log"
    real = runner.run_case

    def logged(case, backend_name, **kw):
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{case.name}\n".encode())
        os.close(fd)
        return real(case, backend_name, **kw)
    monkeypatch.setattr(runner, "run_case", logged)
    return lambda: log.read_text().split() if log.exists() else []


@pytest.mark.parametrize("how, needle", [("", "exited with code 71"), (":kill", "killed by SIGKILL")])
def test_a_dead_worker_costs_only_its_case(cases, ran, monkeypatch, how, needle):
    victim = "smoke-clean-logits"
    monkeypatch.setenv(DIE_ENV, victim + how)
    seen = []
    rows = run_cases(cases, "reference", jobs=2, progress=lambda r: seen.append(r["case"]))
    assert [r["case"] for r in rows] == FAST                  # none lost, in case order
    assert sorted(seen) == sorted(FAST)                        # one progress call per case
    by = {r["case"]: r for r in rows}
    assert by[victim]["outcome"] == "error"
    assert "died while running this case" in by[victim]["reason"] and needle in by[victim]["reason"]
    assert all(by[n]["outcome"] in ("ok", "nonfinite_input") for n in FAST if n != victim), \
        [(r["case"], r["reason"]) for r in rows]
    started = ran()
    assert sorted(started) == sorted(n for n in FAST if n != victim)   # no case ran twice
    assert by["smoke-rowend-k"]["metrics"]                     # the others are whole rows


def test_every_worker_dying_still_gives_every_row(cases, ran, monkeypatch):
    """-j 1 worker (j=2 over 2 cases) dies on the first case: a replacement runs the rest."""
    two = cases[:2]
    monkeypatch.setenv(DIE_ENV, two[0].name)
    rows = run_cases(two, "reference", jobs=2)
    assert [r["outcome"] for r in rows] == ["error", "ok"]
    assert ran() == [two[1].name]


def test_the_death_check_can_fail(cases, ran, monkeypatch):
    """Without the hook the same run has no error row (the test above sees the fault)."""
    monkeypatch.delenv(DIE_ENV, raising=False)
    rows = run_cases(cases, "reference", jobs=2)
    assert all(r["outcome"] in ("ok", "nonfinite_input") for r in rows)
    assert sorted(ran()) == sorted(FAST)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_hung_case_costs_only_itself_under_a_case_timeout(cases, ran, monkeypatch, jobs):
    """A case that never returns (a hung kernel) is killed after --case-timeout and reported
    as an error row; every other case runs, once (at -j 1 too: the timeout runs the pool)."""
    victim = "smoke-fp8"
    monkeypatch.setenv(DIE_ENV, victim + ":hang")
    import signal

    def stuck(*_):
        raise AssertionError("the run did not end: the hung case held it past its timeout")
    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(120)                                            # a watchdog: fail, never hang
    try:
        rows = run_cases(cases, "reference", jobs=jobs, case_timeout=12.0)   # the others take < 1 s each here
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    by = {r["case"]: r for r in rows}
    assert [r["case"] for r in rows] == FAST
    assert by[victim]["outcome"] == "error" and "--case-timeout 12 s" in by[victim]["reason"]
    assert all(by[n]["outcome"] in ("ok", "nonfinite_input") for n in FAST if n != victim), \
        [(r["case"], r["reason"]) for r in rows]
    assert sorted(ran()) == sorted(n for n in FAST if n != victim)


def test_a_forked_worker_runs_after_the_parent_used_threads(cases):
    """The parent's OpenMP pool does not survive fork: a worker given two intra-op threads
    hung on its first case (CI, -j 1 with a case timeout). Forked workers use one."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(1500, 1500)
        float((x @ x).sum())                                     # the parent's thread pool now exists
        rows = run_cases(cases[:1], "reference", jobs=1, case_timeout=60.0)
    finally:
        torch.set_num_threads(before)
    assert rows[0]["outcome"] == "ok", rows[0]["reason"]


def test_large_cases_run_in_this_process_beside_the_workers(cases, ran, monkeypatch):
    """The pool's local lane (a GPU run's large cases): the cases it names run in this
    process while spawned workers run the rest; every row comes back once, in case order.
    `ran` sees only this process's cases (a spawned worker imports the real run_case), and
    the hook that kills a worker never fires here."""
    local = [0, 3]
    monkeypatch.setenv(DIE_ENV, cases[0].name)                 # in a worker this case would die
    rows = run_cases(cases, "reference", jobs=2, local=local)
    assert [r["case"] for r in rows] == FAST
    assert all(r["outcome"] in ("ok", "nonfinite_input") for r in rows), [(r["case"], r["reason"]) for r in rows]
    assert sorted(ran()) == sorted(cases[i].name for i in local)


def test_the_large_cases_are_the_ones_that_cannot_share_a_gpu():
    cat = Catalog()
    names = ["smoke-fp8", "full-scorer-rows", "full-logits-2gib", "full-topk-65537", "full-pool-2gib"]
    big = runner._large_cases([cat.case(n) for n in names])
    assert [names[i] for i in big] == ["full-logits-2gib", "full-topk-65537", "full-pool-2gib"]


def test_a_case_timeout_must_be_positive(cases):
    with pytest.raises(ValueError, match="case_timeout"):
        run_cases(cases[:1], "reference", case_timeout=0)


def test_gpus_round_robin_one_per_worker():
    envs = [worker_env(s, "CUDA_VISIBLE_DEVICES", ["2", "5", "7"]) for s in range(5)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "5", "7", "2", "5"]
    assert all(e["HIP_VISIBLE_DEVICES"] is None for e in envs)
    hip = worker_env(1, "HIP_VISIBLE_DEVICES", ["0", "1"])
    assert hip == {"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": None}
    assert worker_env(3, "CUDA_VISIBLE_DEVICES", []) == {}


def test_visible_gpus_reads_the_environment(monkeypatch):
    monkeypatch.setattr(runner.torch.version, "hip", None, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1")
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    assert runner._visible_gpus() == ("CUDA_VISIBLE_DEVICES", ["3", "1"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "4,6")
    assert runner._visible_gpus() == ("HIP_VISIBLE_DEVICES", ["4", "6"])
    monkeypatch.setattr(runner.torch.version, "hip", "6.2", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert runner._visible_gpus() == ("HIP_VISIBLE_DEVICES", ["4", "6"])   # ROCm: HIP's list wins


def test_a_worker_runs_under_its_gpu_environment(cases, tmp_path, monkeypatch):
    """The pool worker itself sets its GPU variable before running anything."""
    import multiprocessing as mp
    seen = tmp_path / "env.txt"
    real = runner.run_case

    def record(case, backend_name, **kw):
        seen.write_text(f"{os.environ.get('CUDA_VISIBLE_DEVICES')} {os.environ.get('HIP_VISIBLE_DEVICES')}")
        return real(case, backend_name, **kw)
    monkeypatch.setattr(runner, "run_case", record)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=runner._worker_main, args=(b, worker_env(1, "CUDA_VISIBLE_DEVICES", ["4", "9"]), 1))
    p.start()
    a.send((0, cases[0], "reference"))
    i, row = a.recv()
    a.send(None)
    p.join(10)
    assert (i, row["case"], p.exitcode) == (0, cases[0].name, 0)
    assert seen.read_text() == "9 None"


def test_spawned_workers_keep_the_same_books(cases, monkeypatch):
    """The GPU path starts workers with spawn (a fresh interpreter, nothing inherited but the
    environment): the same bookkeeping, on the CPU."""
    monkeypatch.setenv(DIE_ENV, "smoke-fp8:kill")
    rows = run_cases(cases[:3], "reference", jobs=2, start_method="spawn")
    assert [r["case"] for r in rows] == FAST[:3]
    assert [r["outcome"] for r in rows] == ["ok", "ok", "error"]
    assert "killed by SIGKILL" in rows[2]["reason"]
