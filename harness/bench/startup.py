"""Start-up of the commands a user expects at once, as a ratio to `python -c "import torch"`
measured in the same run (`make bench` adds these rows; `python -m harness.bench.startup`
prints them alone).

Each command runs as a fresh process, the way a user waits for it; the commands and the torch
import take turns, and each time is the best of the repeats (other work on the machine only
ever adds time). Target: at most 0.3x the torch import for each (none of them loads torch:
`cases` reads the declared op table, `backends` checks what it can without importing a backend).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from harness.errors import EXIT_OK, EXIT_USAGE, Parser, count, parse_or_exit

REPO = Path(__file__).resolve().parents[2]
TARGET = 0.3
COMMANDS = (                                    # (label, arguments, target, the exit status it must give)
    ("`mxval --help`", ["-m", "harness", "--help"], TARGET, EXIT_OK),
    ("a usage error (`mxval validate --bogus`)", ["-m", "harness", "validate", "--bogus"], TARGET, EXIT_USAGE),
    ("`mxval cases`", ["-m", "harness", "cases"], TARGET, EXIT_OK),
    ("`mxval backends`", ["-m", "harness", "backends"], TARGET, EXIT_OK),
)
TORCH = ["-c", "import torch"]


def _wall(args: list[str]) -> tuple[float, int]:
    """(seconds, exit status) of one fresh process."""
    t = time.perf_counter()
    rc = subprocess.run([sys.executable, *args], cwd=REPO, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - t, rc


def measure(repeats: int = 5) -> dict:
    """{"torch_s": best import time, "commands": [(label, best seconds, ratio, target, bad exit status
    or None)]}: a command that exits with a status other than its own fails its row, however fast."""
    best = {"torch": float("inf"), **{label: float("inf") for label, *_ in COMMANDS}}
    bad: dict = {}
    for _ in range(max(1, repeats)):
        best["torch"] = min(best["torch"], _wall(TORCH)[0])
        for label, args, _, want in COMMANDS:
            s, rc = _wall(args)
            best[label] = min(best[label], s)
            if rc != want:
                bad[label] = rc
    return {"torch_s": best["torch"],
            "commands": [(label, best[label], best[label] / best["torch"], target, bad.get(label))
                         for label, _, target, _ in COMMANDS]}


def rows(result: dict, device: str = "cpu") -> list[str]:
    """Rows of the `make bench` table: | device | workload | measured | target | peak RSS | met |."""
    out = []
    for label, s, ratio, target, bad_rc in result["commands"]:
        met = "no" if bad_rc is not None else "-" if target is None else ("yes" if ratio <= target else "no")
        exited = "" if bad_rc is None else f", exited {bad_rc}"
        out.append(f"| {device} | start-up: {label}{exited} | {s:.2f} s = {ratio:.2f}x `import torch` "
                   f"({result['torch_s']:.2f} s, same run) | "
                   + (f"<= {target}x `import torch`" if target is not None else "-") + f" | - | {met} |")
    return out


def section(repeats: int = 5) -> str:
    """The start-up rows under their own table head, for the benchmark report."""
    return "\n".join(["Start-up (fresh processes, best of the repeats):", "",
                      "| device | workload | measured | target | peak RSS | met |", "|---|---|---|---|---|---|",
                      *rows(measure(repeats)), ""])


def main(argv=None) -> int:
    ap = Parser(prog="python -m harness.bench.startup", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=count, default=5)
    print(section(parse_or_exit(ap, argv, "bench startup").repeats))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
