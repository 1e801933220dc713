"""Top-k over each row's valid logits (NUMERICS.md §6)."""
from __future__ import annotations

import torch

from . import checks


def topk_indices(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [Rw, k]. Rows with length <= k: 0..len-1 then -1. Longer rows: the k best
    columns of [0, len), best first (ties broken by torch.topk, which the contract leaves
    open)."""
    width = logits.shape[1]
    lengths = lengths.long()
    cols = torch.arange(k, device=logits.device)
    out = torch.where(cols[None, :] < lengths[:, None], cols[None, :], -1)       # right for short rows
    is_long = lengths > k
    if not bool(is_long.any()):
        return out.to(torch.int32)
    every = bool(is_long.all())
    rows = logits.double() if every else logits[is_long.nonzero().flatten()].double()
    ends = lengths if every else lengths[is_long]
    if bool((ends < width).any()):              # one pass: -inf past each row's end (a new tensor)
        past = torch.arange(width, device=logits.device)[None, :] >= ends[:, None]
        rows = torch.where(past, float("-inf"), rows)
    best = torch.topk(rows, k, dim=1).indices
    if every:
        return best.to(torch.int32)
    out[is_long] = best
    return out.to(torch.int32)


def check_topk_args(logits, lengths, k: int) -> None:
    """Shapes, dtypes, k, lengths; non-finite logits inside a row's length are reported,
    never ranked."""
    dims = checks.Dims()
    dims.check("logits", logits, (torch.float32, torch.float64), ("Rw", "W"))
    dims.check("lengths", lengths, checks.INT_DTYPES, ("Rw",))
    checks.scalar("k", k, positive=True)
    checks.int_range("lengths", lengths, 0, logits.shape[1] + 1)
    if bool(torch.isfinite(logits).all()):
        return
    valid = torch.arange(logits.shape[1], device=logits.device)[None, :] < lengths.long()[:, None]
    checks.nonfinite("logits", valid & ~torch.isfinite(logits))


def topk(*, logits, lengths, k: int) -> dict:
    check_topk_args(logits, lengths, k)
    return {"indices": topk_indices(logits, lengths, k)}


def packed_row_starts(lengths: torch.Tensor) -> torch.Tensor:
    """vLLM packs a prefill call's sequences along the logits columns and hands the top-k
    each row's start (the packed offset of its sequence); mxval's op gives per-sequence
    columns. The rows' sequences are recovered from their ends: inside a chunk consecutive
    rows' ends differ by 0 or 1, so any other step starts a sequence, whose packed start is
    the sum of the previous sequences' last ends."""
    n = lengths.long()
    if n.numel() == 0:
        return n
    new = torch.ones_like(n, dtype=torch.bool)
    step = n[1:] - n[:-1]
    new[1:] = (step < 0) | (step > 1)
    seg = torch.cumsum(new.long(), 0) - 1
    ends = torch.ones_like(new)                          # a segment's last row: the final row,
    ends[:-1] = new[1:]                                  # or one whose next row starts a segment
    last = n[ends]                                       # one per segment, in segment order
    starts = torch.cumsum(last, 0) - last
    return starts[seg]
