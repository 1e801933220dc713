"""Top-k per row by threshold select, all in Triton (NUMERICS.md §6).

One program per row. Logits map to order-preserving 32-bit keys (-0.0 tied with +0.0);
a binary search over the key space finds the k-th largest key T (each step counts
`key >= mid` over the row's valid columns; it stops early once exactly k keys are
>= mid); a last pass writes every column with key > T and the first
`k - count(key > T)` columns with key == T, in column order (the contract leaves the
order open, and ties at the k-th value are broken by column). Rows up to RESIDENT
columns are loaded once and searched in registers (16 warps: 64 keys a thread at 32768
columns), so the 32 counting steps read no memory; longer rows stream from memory on
every step. Rows with length <= k get 0..len-1 then -1. fp32 logits only: fp64 logits
(a study format, not a kernel's) are handed to the reference's torch.topk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import reference
from reference.topk import check_topk_args

from ..common import on_device
from .interp import tile

BLOCK = 1024
RESIDENT = 32768
_INT_MIN: tl.constexpr = tl.constexpr(-2 ** 31)
_INT_MAX: tl.constexpr = tl.constexpr(2 ** 31 - 1)


@triton.jit
def _keys32(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 -> 0, as +0.0)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(x == 0.0, 0, b)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _short_row(obase, n, K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for s0 in range(0, K, BLOCK):
        sidx = s0 + offs
        tl.store(obase + sidx, tl.where(sidx < n, sidx, -1).to(tl.int32), mask=sidx < K)


@triton.jit
def _write_selected(base, obase, n, thr, exact, K: tl.constexpr, CH: tl.constexpr):
    """Columns with key > thr (>= thr when `exact`), then the first K - count(key > thr)
    columns with key == thr, in column order."""
    offs = tl.arange(0, CH)
    n_gt = tl.full([], 0, tl.int32)
    for c0 in range(0, n, CH):
        idx = c0 + offs
        key = _keys32(tl.load(base + idx, mask=idx < n, other=0.0))
        gt = ((idx < n) & ((key > thr) | (exact & (key == thr)))).to(tl.int32)
        tl.store(obase + n_gt + tl.cumsum(gt, axis=0) - 1, idx, mask=gt != 0)
        n_gt += tl.sum(gt, axis=0)
    if exact == 0:
        n_eq = tl.full([], 0, tl.int32)
        for c0 in range(0, n, CH):
            idx = c0 + offs
            key = _keys32(tl.load(base + idx, mask=idx < n, other=0.0))
            eq = ((idx < n) & (key == thr)).to(tl.int32)
            rank = n_eq + tl.cumsum(eq, axis=0) - 1
            tl.store(obase + n_gt + rank, idx, mask=(eq != 0) & (rank < K - n_gt))
            n_eq += tl.sum(eq, axis=0)


@triton.jit
def _topk_resident_kernel(x_ptr, len_ptr, out_ptr, stride, K: tl.constexpr, BLOCK: tl.constexpr,
                          OUT_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(len_ptr + row)
    obase = out_ptr + row.to(tl.int64) * K
    if n <= K:
        _short_row(obase, n, K, OUT_BLOCK)
    else:
        offs = tl.arange(0, BLOCK)
        valid = offs < n
        x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=valid, other=0.0)
        # finite logits never map to INT_MIN, and every mid is above it: padding never counts
        key = tl.where(valid, _keys32(x), _INT_MIN)
        lo = tl.full([], _INT_MIN, tl.int64)          # count(key >= lo) >= K holds
        hi = tl.full([], _INT_MAX, tl.int64)
        cnt = tl.full([], 0, tl.int32)
        while (lo < hi) & (cnt != K):
            mid = (lo + hi + 1) >> 1
            cnt = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
            ok = cnt >= K
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        thr = lo.to(tl.int32)
        exact = cnt == K                                # exactly K keys >= thr: no tie to break
        # the writing pass reloads the row in chunks (it is in L2): the search's key
        # registers plus whole-row scans would not fit
        _write_selected(x_ptr + row.to(tl.int64) * stride, obase, n, thr, exact, K, OUT_BLOCK)


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


def launch(logits, lengths, k, resident=None, chunk=None):
    """int32 [Rw, k]. `resident` (measurement only): force the in-register (True) or the
    streaming (False) kernel; default: in registers when the row fits RESIDENT columns.
    `chunk` (tests): columns per step of the writing pass."""
    rw, width = logits.shape
    out = torch.empty(rw, k, dtype=torch.int32, device=logits.device)
    if rw == 0:
        return out
    block = triton.next_power_of_2(max(width, 1))
    if resident if resident is not None else block <= RESIDENT:
        warps = max(4, min(16, block // 2048))
        out_block = chunk or tile(min(BLOCK, triton.next_power_of_2(k)), block)   # writing-pass chunk
        _topk_resident_kernel[(rw,)](logits, lengths, out, logits.stride(0), K=k, BLOCK=block,
                                     OUT_BLOCK=out_block, num_warps=warps)
    else:
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
