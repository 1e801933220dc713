"""Host-side glue shared by the backends (Triton, aiter, vLLM): device moves, the
arguments every backend rejects the same way, and the ROCm adapters' availability and
argument shaping."""
from __future__ import annotations

from typing import Callable

import torch

from reference import checks
from reference.topk import check_topk_args

from .probe import rocm_gfx950_reason  # noqa: F401  (the ROCm adapters' platform check)

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


def topk_on_device(who: str, device: str, logits: torch.Tensor, lengths: torch.Tensor, k: int):
    """A float32-only top-k kernel's arguments, checked and on `device`, with its index buffer
    cleared to -1 (as vLLM clears it before the indexer runs): (logits, lengths, indices, back)."""
    check_topk_args(logits, lengths, k)
    if logits.dtype != torch.float32:
        raise ValueError(f"logits: {who} top-k takes float32, got {str(logits.dtype)[6:]}")
    (x, ln), back = on_device(device, logits, lengths)
    return x, ln, torch.full((x.shape[0], k), -1, dtype=torch.int32, device=device), back


def reject_hadamard(hadamard: bool) -> None:
    if hadamard:
        raise ValueError("hadamard: the optimized kernels (like vLLM's) do not rotate; "
                         "use the reference backend for Hadamard studies")


def scale_rule_code(scale_rule: str) -> str:
    return checks.choice("scale_rule", scale_rule, KERNEL_SCALE_RULES)


# --- the ROCm adapters (aiter, vLLM) -----------------------------------------------------

def import_targets(keys: dict[str, str]) -> tuple[dict, dict, list[str]]:
    """`{label: upstream table key}` -> ({label: object}, {label: the Target that resolved},
    one line per missing one). A key's alternatives (`key@...`) and alt_modules are tried in
    table order; the first present wins."""
    import importlib

    from . import upstream
    found, which, missing = {}, {}, []
    for label, key in keys.items():
        problems = []
        for t in upstream.group(key):
            for mod in t.modules:
                try:
                    obj = getattr(importlib.import_module(mod), t.name.split(".")[0])
                except ModuleNotFoundError as e:
                    top = (e.name or mod).split(".")[0]
                    problems.append(f"{top} is not importable (ModuleNotFoundError: {e})" if top == t.package
                                    and e.name == top else f"{mod} is not importable (ModuleNotFoundError: {e})")
                    continue
                except ImportError as e:
                    problems.append(f"{mod} is not importable (ImportError: {e})")
                    continue
                except AttributeError:
                    problems.append(f"{mod} has no {t.name}")
                    continue
                found[label], which[label] = obj, t
                break
            if label in found:
                break
        if label not in found:
            pkg = upstream.group(key)[0].package
            whole = next((p for p in problems if p.startswith(f"{pkg} is not importable")), None)
            missing.append(whole or f"{key}: " + "; ".join(dict.fromkeys(problems)))
    return found, which, list(dict.fromkeys(missing))


def require_production(*, rounding: str = "rocm", scale_rule: str = "ceil", hadamard: bool = False,
                       who: str) -> None:
    """The real kernels implement one point of each study axis; say so instead of ignoring it."""
    if rounding != "rocm":
        raise ValueError(f"rounding: {who} implements the ROCm split path ('rocm'), got {rounding!r}")
    if scale_rule != "ceil":
        raise ValueError(f"scale_rule: {who} implements 'ceil' (aiter scaling mode 1), got {scale_rule!r}")
    reject_hadamard(hadamard)


def paged_view(pool: torch.Tensor, page_size: int, entry_bytes: int) -> torch.Tensor:
    """[P, page_size, 1, entry_bytes] view of the owned part of each page of a [P, stride]
    pool (the ROCm ops derive page_size from the page's bytes; padding stays outside)."""
    return pool[:, :page_size * entry_bytes].view(pool.shape[0], page_size, 1, entry_bytes)


def equal_row_groups(query_start_loc: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Runs of consecutive sequences with the same number of query rows (aiter's scorer
    takes q as [B, next_n, H, D/2]): (first seq, last seq + 1, first row, rows per seq)."""
    qsl = query_start_loc.long().tolist()
    groups: list[tuple[int, int, int, int]] = []
    for b in range(len(qsl) - 1):
        n = qsl[b + 1] - qsl[b]
        if groups and groups[-1][3] == n and groups[-1][1] == b:
            s0, _, r0, _ = groups[-1]
            groups[-1] = (s0, b + 1, r0, n)
        else:
            groups.append((b, b + 1, qsl[b], n))
    return [g for g in groups if g[3] > 0]
