"""Top-k per row by threshold select, all in Triton (NUMERICS.md §6).

One program per row. Logits map to order-preserving unsigned 32-bit keys (held in int64);
a 32-step binary search over the key space finds the k-th largest key T (each step
counts `key >= mid` over the row's valid columns); a last pass writes every column with
key > T and the first `k - count(key > T)` columns with key == T, in column order (the
contract leaves the order open, and ties at the k-th value are broken by column).
Rows with length <= k get 0..len-1 then -1. fp32 logits only: fp64 logits (a study
format, not a kernel's) are handed to the reference's torch.topk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import reference
from reference.topk import check_topk_args

from ..common import on_device

BLOCK = 1024


@triton.jit
def _keys(x):
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(x == 0.0, 0, b)                 # -0.0 ties with +0.0
    u = b.to(tl.int64) & 0xFFFFFFFF
    return tl.where(b < 0, 0xFFFFFFFF - u, u | 0x80000000)


@triton.jit
def _topk_kernel(x_ptr, len_ptr, out_ptr, stride, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(len_ptr + row).to(tl.int64)
    base = x_ptr + row.to(tl.int64) * stride
    obase = out_ptr + row.to(tl.int64) * K
    offs = tl.arange(0, BLOCK)
    if n <= K:
        for s0 in range(0, K, BLOCK):
            sidx = s0 + offs
            tl.store(obase + sidx, tl.where(sidx < n, sidx, -1).to(tl.int32), mask=sidx < K)
    else:
        lo = tl.full([], 0, tl.int64)               # count(key >= lo) >= K holds
        hi = tl.full([], 0xFFFFFFFF, tl.int64)
        for _ in range(32):
            mid = (lo + hi + 1) >> 1
            cnt = tl.full([], 0, tl.int64)
            for c0 in range(0, n, BLOCK):
                idx = c0 + offs
                valid = idx < n
                key = _keys(tl.load(base + idx, mask=valid, other=0.0))
                cnt += tl.sum((valid & (key >= mid)).to(tl.int64), axis=0)
            ok = cnt >= K
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        thr = lo
        n_gt = tl.full([], 0, tl.int64)
        for c0 in range(0, n, BLOCK):
            idx = c0 + offs
            valid = idx < n
            key = _keys(tl.load(base + idx, mask=valid, other=0.0))
            n_gt += tl.sum((valid & (key > thr)).to(tl.int64), axis=0)
        need_eq = K - n_gt
        gt_off = tl.full([], 0, tl.int64)
        eq_off = tl.full([], 0, tl.int64)
        for c0 in range(0, n, BLOCK):
            idx = c0 + offs
            valid = idx < n
            key = _keys(tl.load(base + idx, mask=valid, other=0.0))
            gt = (valid & (key > thr)).to(tl.int64)
            eq = (valid & (key == thr)).to(tl.int64)
            gt_rank = gt_off + tl.cumsum(gt, axis=0) - 1
            eq_rank = eq_off + tl.cumsum(eq, axis=0) - 1
            tl.store(obase + gt_rank, idx.to(tl.int32), mask=gt != 0)
            tl.store(obase + n_gt + eq_rank, idx.to(tl.int32), mask=(eq != 0) & (eq_rank < need_eq))
            gt_off += tl.sum(gt, axis=0)
            eq_off += tl.sum(eq, axis=0)


def launch(logits, lengths, k):
    rw = logits.shape[0]
    out = torch.empty(rw, k, dtype=torch.int32, device=logits.device)
    if rw:
        _topk_kernel[(rw,)](logits, lengths, out, logits.stride(0), K=k, BLOCK=BLOCK)
    return out


def make_op(device: str):
    def topk(*, logits, lengths, k: int) -> dict:
        if logits.dtype == torch.float64:
            return reference.topk(logits=logits, lengths=lengths, k=k)
        check_topk_args(logits, lengths, k)
        (x, ln), back = on_device(device, logits.contiguous(), lengths.contiguous())
        return {"indices": back(launch(x, ln, k), logits)}

    return {"topk": topk}
