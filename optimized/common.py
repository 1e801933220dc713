"""Host-side glue shared by the backends (Triton, aiter, vLLM): device moves, the
arguments every backend rejects the same way, and the row bookkeeping of the scorer."""
from __future__ import annotations

from typing import Callable

import torch

from reference import checks

# scale rules the kernels implement from the fp32 bits; torchao's "rceil" goes through a
# float log2 and is only offered by the reference (for studies).
KERNEL_SCALE_RULES = ("ceil", "ocp-floor", "even")


def on_device(device: str, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], Callable]:
    """Move inputs to the backend's device; `back(out, like)` returns an output on the
    device its input `like` came from (inputs may arrive on the CPU)."""
    moved = [t.to(device) for t in tensors]

    def back(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return out if out.device == like.device else out.to(like.device)

    return moved, back


def reject_hadamard(hadamard: bool) -> None:
    if hadamard:
        raise ValueError("hadamard: the optimized kernels (like vLLM's) do not rotate; "
                         "use the reference backend for Hadamard studies")


def scale_rule_code(scale_rule: str) -> str:
    return checks.choice("scale_rule", scale_rule, KERNEL_SCALE_RULES)


def row_sequences(query_start_loc: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [rows]: the sequence each query row belongs to."""
    qsl = query_start_loc.long()
    return torch.searchsorted(qsl[1:], torch.arange(rows, device=qsl.device), right=True).to(torch.int32)
