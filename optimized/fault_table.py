"""The fault catalogue's words, without torch: each fault's bug class, ops, cases,
description and source (faults.toml), and the constants its texts name. optimized/faults.py
builds each fault's broken ops on this; `mxval backends --faults` lists it without loading
torch."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

# Signed width of the emulated offset arithmetic. The production bug wraps at 32 bits
# (pools past 2 GiB); CI cannot hold such a pool, so a second fault wraps at 20 bits
# (pools past 512 KiB) to exercise the same mechanism on a small case.
INT32_BITS = 32
SIM_WRAP_BITS = 20
# Byte offsets of a logits row past this width wrap (aiter's buffer_store voffset is a
# 32-bit byte offset). The simulated twin wraps at 22 bits (rows past 4 MiB) so that a CPU
# case can hold the buffer.
LOGITS_ROW_SIM_BITS = 22
# aiter's FP4 MQA-logits scheduler: 256-entry tiles, at most 64 of them per row (16384
# entries); work past the schedule's capacity was dropped without a word.
SCHEDULE_TILE = 256
SCHEDULE_TILES_PER_ROW = 64
# aiter's prefill top-k takes its long-row path once a call has more than this many rows.
PREFILL_TOPK_ROWS = 4096
# Radix top-k candidate buffers: sglang fast_topk_v2 keeps 4096 candidates of the threshold
# bin (coarse key: the top 8 bits of the fp16 value); FlagGems' sampled prefill path keeps
# 2048 (key: sign, 5 exponent and 5 mantissa bits of the fp16 value).
RADIX_SGLANG = (8, 4096)
RADIX_FLAGGEMS = (11, 2048)
# The graph-only split-count fault: entries of a row each scorer program covers.
GRAPH_SPLIT = 16


@dataclass(frozen=True)
class FaultText:
    name: str
    bug_class: str                 # the §10 wording
    ops: tuple[str, ...]           # ops whose output it changes
    cases: tuple[str, ...]         # cases (cases/selftest.toml) that expose it
    description: str               # exactly what is broken
    large: bool = False            # needs more than a CPU affords (a pool or logits past 2 GiB):
                                   # full selftest on a GPU (or --large) only, not --quick
    source: str = ""               # the shipped bug it models ("ROCm/aiter#4244"); "" = invented here
    graph: bool = False            # graph-only: correct eagerly, wrong only when replayed from a
                                   # CUDA/HIP graph (caught by graph mode, harness/run/graph.py)

    @property
    def backend_name(self) -> str:
        return f"fault:{self.name}"

    def describe(self) -> str:
        """The fault backend's description."""
        return f"FAULT ({self.bug_class}): {self.description}"


# Values the catalogue's texts name ({NAME} in faults.toml).
_TEXT_VALUES = dict(
    SIM_WRAP_BITS=SIM_WRAP_BITS, SIM_WRAP_KIB=(1 << (SIM_WRAP_BITS - 1)) // 1024,
    LOGITS_ROW_SIM_BITS=LOGITS_ROW_SIM_BITS, LOGITS_ROW_SIM_MIB=(1 << (LOGITS_ROW_SIM_BITS - 1)) >> 20,
    SCHEDULE_TILE=SCHEDULE_TILE, SCHEDULE_TILES_PER_ROW=SCHEDULE_TILES_PER_ROW,
    SCHEDULE_REACH=SCHEDULE_TILE * SCHEDULE_TILES_PER_ROW, PREFILL_TOPK_ROWS=PREFILL_TOPK_ROWS,
    RADIX_SGLANG=RADIX_SGLANG, RADIX_FLAGGEMS=RADIX_FLAGGEMS, GRAPH_SPLIT=GRAPH_SPLIT,
)

def read_catalogue(path: Path = Path(__file__).with_name("faults.toml")) -> dict[str, FaultText]:
    """name -> FaultText, in the file's order."""
    rows = tomllib.loads(path.read_text())
    return {name: FaultText(name, row["bug_class"].format(**_TEXT_VALUES), tuple(row["ops"]), tuple(row["cases"]),
                            row["description"].format(**_TEXT_VALUES), large=row.get("large", False),
                            source=row.get("source", ""), graph=row.get("graph", False))
            for name, row in rows.items()}
