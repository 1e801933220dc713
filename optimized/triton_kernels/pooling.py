"""Softmax-gated overlap pooling (NUMERICS.md §1), vLLM's `_compress_pool_kernel` contract.

One program per (token, channel block), the 2r window rows loaded as one [2r, BD] tile.
The softmax is computed in fp64 (exp via interp.exp_f64) in the reference's order (max,
exp, sum, divide, weighted sum; fp64 makes the summation order immaterial), then rounded to fp32 and to bf16: pooled rows are byte-exact, so the whole chain
pool -> pages is too. (Upstream kernels use fp32 fast exp: <= 1 bf16 ulp, see §1.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference import checks
from reference.formats import ROUNDING_PATHS
from reference.pooling import check_pool_args
from reference.pooling import boundary_mask, gather_windows

from ..common import on_device
from .interp import LAUNCH, bf16_bits, exp_f64

BD = 64   # channels per program


@triton.jit
def _exp(x, FAST: tl.constexpr):
    # FAST (measurement only): fp32 fast exp, as upstream kernels do (the rest stays fp64)
    if FAST:
        return tl.exp(x.to(tl.float32)).to(tl.float64)
    else:
        return exp_f64(x)


@triton.jit
def _pool_kernel(state_ptr, table_ptr, pos_ptr, req_ptr, slot_ptr, out_ptr, out_bf16_ptr,
                 T, block_size, table_stride, row_stride, block_stride,
                 D: tl.constexpr, RATIO: tl.constexpr, WP: tl.constexpr, OUT_BF16: tl.constexpr,
                 BD: tl.constexpr, FAST_EXP: tl.constexpr):
    tok = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if (slot >= 0) & ((pos + 1) % RATIO == 0):
        req = tl.load(req_ptr + tok).to(tl.int64)
        i = tl.arange(0, WP)                               # window slot; WP = 2r rounded up
        qp = pos - (2 * RATIO - 1) + i
        valid = (qp >= 0) & (i < 2 * RATIO)
        blk = tl.load(table_ptr + req * table_stride + qp // block_size, mask=valid, other=0).to(tl.int64)
        row = blk * block_stride + (qp % block_size) * row_stride
        half = tl.where(i >= RATIO, D, 0)                  # i < r: the `_a` halves, else `_b`
        off = (row + half)[:, None] + d[None, :]
        m2 = valid[:, None]
        s = tl.load(state_ptr + off + 2 * D, mask=m2, other=float("-inf")).to(tl.float64)
        kv = tl.load(state_ptr + off, mask=m2, other=0.0).to(tl.float64)
        mx = tl.max(s, axis=0)
        e = _exp(s - mx[None, :], FAST_EXP)
        den = tl.sum(e, axis=0)
        terms = (e / den[None, :]) * kv
        c = tl.sum(terms, axis=0)
        # IEEE: terms that are all -0.0 sum to -0.0 (compiled reductions do; the
        # interpreter's numpy sum starts from +0.0): set the sign as the reference does.
        neg_zero = (terms == 0) & (terms.to(tl.int64, bitcast=True) < 0)
        all_neg_zero = tl.min(neg_zero.to(tl.int32), axis=0) == 1
        c = tl.where(all_neg_zero, tl.abs(c) * -1.0, c).to(tl.float32)  # unary minus is 0 - x in Triton
        if OUT_BF16:
            tl.store(out_bf16_ptr + tok * D + d, bf16_bits(c))
        else:
            tl.store(out_ptr + tok * D + d, c)


def launch(state_cache, block_table, positions, req_index, kv_slot_mapping, *, compress_ratio,
           out_bf16=True, fast_exp=False):
    t = positions.shape[0]
    d = state_cache.shape[-1] // 4
    dev = state_cache.device
    # rows of tokens that write nothing are NaN, as in the reference
    out = torch.full((t, d), float("nan"), device=dev)
    outb = out.to(torch.bfloat16) if out_bf16 else out
    if t:
        sc = state_cache
        _pool_kernel[(t, triton.cdiv(d, BD))](
            sc, block_table, positions, req_index, kv_slot_mapping, out,
            outb.view(torch.int16) if out_bf16 else out, t, sc.shape[1], block_table.stride(0),
            sc.stride(1), sc.stride(0), D=d, RATIO=compress_ratio,
            WP=triton.next_power_of_2(2 * compress_ratio), OUT_BF16=out_bf16, BD=BD,
            FAST_EXP=fast_exp, **LAUNCH)
    return outb


def _check_windows(state_cache, block_table, positions, req_index, kv_slot_mapping, r):
    """What the reference checks before pooling: every block the windows read exists (the
    kernel would read out of bounds), and the window rows are finite."""
    sel = boundary_mask(positions, r) & (kv_slot_mapping >= 0)
    if not bool(sel.any()):
        return
    pos, req = positions[sel].long(), req_index[sel].long()
    bs = state_cache.shape[1]
    first = (pos - (2 * r - 1)).clamp_min(0) // bs
    checks.int_range("block_table (window blocks)", first, 0, block_table.shape[1])
    checks.int_range("positions (window blocks)", pos // bs, 0, block_table.shape[1])
    used = block_table[req[:, None], torch.stack((first, pos // bs), -1)]
    checks.int_range("block_table", used, 0, state_cache.shape[0])
    kv, score, valid = gather_windows(state_cache, block_table, pos, req, r)
    checks.finite("state_cache (window rows)", torch.where(valid[..., None], score, 0.0))
    checks.finite("state_cache (window rows)", kv)


def make_op(device: str):
    def compress_pool(*, state_cache, block_table, positions, req_index, kv_slot_mapping,
                      compress_ratio: int = 4, rounding: str = "rocm") -> dict:
        check_pool_args(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
        checks.choice("rounding", rounding, ROUNDING_PATHS)
        if state_cache.shape[-1] // 4 % BD:
            raise ValueError(f"state_cache: D={state_cache.shape[-1] // 4} is not a multiple of {BD}")
        _check_windows(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
        args, back = on_device(device, state_cache.contiguous(), block_table.contiguous(),
                               positions.contiguous(), req_index.contiguous(), kv_slot_mapping.contiguous())
        pooled = launch(*args, compress_ratio=compress_ratio, out_bf16=rounding != "cuda")
        return {"pooled": back(pooled, state_cache)}

    return {"compress_pool": compress_pool}
