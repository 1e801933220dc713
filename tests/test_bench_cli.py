"""The benchmarks' command lines: bad input is one line `mxval: bench <name>: <problem>` and
exit 2, as for every mxval command (argparse alone prints its usage and a second line)."""
import importlib

import pytest

BAD = [("reference", ["--nonsense"]), ("resources", ["--arch", "x"]), ("resources", ["--arch", "75"]),
       ("resources", ["--rocm-arch", "gfx1100"]),
       ("startup", ["--repeats", "x"]), ("gpu", ["--skip", "no-such-part"]), ("shadow", ["--steps", "x"]),
       ("shadow", ["--alarm-jobs", "0"]), ("capture", ["--nonsense"]), ("capture", ["--steps", "0"]),
       ("reference", ["--repeats", "-1"]), ("startup", ["--repeats", "0"])]


@pytest.mark.parametrize("module,argv", BAD, ids=[f"{m}:{' '.join(a)}" for m, a in BAD])
def test_bad_bench_arguments_are_one_line_and_exit_2(module, argv, capsys):
    main = importlib.import_module(f"harness.bench.{module}").main
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"mxval: bench {module}: "), err
    assert "usage:" not in err[0] and "Traceback" not in err[0]


def test_help_still_exits_0(capsys):
    from harness.bench import shadow
    with pytest.raises(SystemExit) as e:
        shadow.main(["--help"])
    assert e.value.code == 0 and "usage: python -m harness.bench.shadow" in capsys.readouterr().out
