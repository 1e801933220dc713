"""Softmax-gated overlap pooling (NUMERICS.md §1), vLLM's `_compress_pool_kernel` contract.

One program per tile of tokens; the tokens that write are pooled a few at a time, each
window loaded as one [2r, D] tile. The softmax is computed in fp64 (exp via interp.exp_f64) in the reference's order (max,
exp, sum, divide, weighted sum; fp64 makes the summation order immaterial), then rounded to fp32 and to bf16: pooled rows are byte-exact, so the whole chain
pool -> pages is too. (Upstream kernels use fp32 fast exp: <= 1 bf16 ulp, see §1.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference import checks
from reference.formats import ROUNDING_PATHS
from reference.pooling import boundary_mask, check_pool_args, gather_windows

from ..common import on_device
from .interp import LAUNCH, bf16_bits, exp_f64, tile
from .numerics import writing_tokens


@triton.jit
def _exp(x, FAST: tl.constexpr):
    # FAST (measurement only): fp32 fast exp, as upstream kernels do (the rest stays fp64)
    if FAST:
        return tl.exp(x.to(tl.float32)).to(tl.float64)
    else:
        return exp_f64(x)


@triton.jit
def window_rows(table_ptr, req_ptr, tok, gpos, ok, block_size, table_stride, row_stride, block_stride,
                D: tl.constexpr, RATIO: tl.constexpr, WP: tl.constexpr, SPAN2: tl.constexpr):
    """The state-cache offsets [WP, G] of channel 0 of the `_a`/`_b` kv values of the windows
    of tokens `tok` at positions `gpos` (channel d lies d further, the scores 2D further), and
    which are valid (window slot valid, row `ok`)."""
    i = tl.arange(0, WP)
    req = tl.load(req_ptr + tok, mask=ok, other=0).to(tl.int64)
    tbase = table_ptr + req * table_stride
    if SPAN2:
        # the 2r window positions gpos-2r+1 .. gpos lie in gpos's block or the one
        # before (block_size >= 2r - 1): one division per token, not per slot
        b1 = gpos // block_size
        r1 = (gpos - b1 * block_size).to(tl.int32)
        rr = r1[None, :] - (2 * RATIO - 1) + i[:, None]                 # [WP, G] row in b1
        valid = ((rr >= 0) | (b1 > 0)[None, :]) & (i < 2 * RATIO)[:, None] & ok[None, :]
        crosses = ok & (b1 > 0) & (r1 < 2 * RATIO - 1)
        blk1 = tl.load(tbase + b1, mask=ok, other=0).to(tl.int64) * block_stride
        blk0 = tl.load(tbase + b1 - 1, mask=crosses, other=0).to(tl.int64) * block_stride
        row = tl.where(rr >= 0, blk1[None, :] + rr * row_stride,
                       blk0[None, :] + (rr + block_size) * row_stride)
    else:
        qp = gpos[None, :] - (2 * RATIO - 1) + i[:, None]               # [WP, G]
        valid = (qp >= 0) & (i < 2 * RATIO)[:, None] & ok[None, :]
        blk = tl.load(tbase[None, :] + qp // block_size, mask=valid, other=0).to(tl.int64)
        row = blk * block_stride + (qp % block_size) * row_stride
    half = tl.where(i >= RATIO, D, 0)[:, None]                          # i < r: `_a`, else `_b`
    return row + half, valid


@triton.jit
def window_offsets(table_ptr, req_ptr, tok, gpos, ok, d, dm, block_size, table_stride, row_stride, block_stride,
                   D: tl.constexpr, RATIO: tl.constexpr, WP: tl.constexpr, SPAN2: tl.constexpr):
    """The state-cache offsets [WP, G, channels] of the `_a`/`_b` kv values of the windows of
    tokens `tok` at positions `gpos` (the scores lie 2D further), and their mask (window slot
    valid, row `ok`, channel in range)."""
    base, valid = window_rows(table_ptr, req_ptr, tok, gpos, ok, block_size, table_stride, row_stride,
                              block_stride, D, RATIO, WP, SPAN2)
    return window_tile(base, valid, d, dm)


@triton.jit
def window_tile(base, valid, d, dm):
    """The offsets [WP, G, channels] and mask of channels `d` (masked by `dm`) of the windows
    whose channel-0 offsets and validity `window_rows` gave."""
    return base[:, :, None] + d[None, None, :], valid[:, :, None] & dm[None, None, :]


@triton.jit
def softmax_pool_f64(state_ptr, off, m3, D: tl.constexpr, FAST_EXP: tl.constexpr):
    """c (fp32, [G, channels]) of the windows at `off`: the softmax in fp64 in the reference's
    order (max, exp, sum, divide, weighted sum; fp64 makes the order immaterial), rounded once."""
    s = tl.load(state_ptr + off + 2 * D, mask=m3, other=float("-inf")).to(tl.float64)
    kv = tl.load(state_ptr + off, mask=m3, other=0.0).to(tl.float64)
    mx = tl.max(s, axis=0)
    e = _exp(s - mx[None, :, :], FAST_EXP)
    inv = 1.0 / tl.sum(e, axis=0)                                       # one divide per channel
    terms = (e * inv[None, :, :]) * kv
    c = tl.sum(terms, axis=0)                                            # [G, D]
    # IEEE: terms that are all -0.0 sum to -0.0 (compiled reductions do; the
    # interpreter's numpy sum starts from +0.0): set the sign as the reference does.
    neg_zero = (terms == 0) & (terms.to(tl.int64, bitcast=True) < 0)
    all_neg_zero = tl.min(neg_zero.to(tl.int32), axis=0) == 1
    return tl.where(all_neg_zero, tl.abs(c) * -1.0, c).to(tl.float32)  # unary minus is 0 - x in Triton


@triton.jit
def pool_window(state_ptr, table_ptr, req_ptr, tok, gpos, ok, d, dm, block_size, table_stride, row_stride,
                block_stride, D: tl.constexpr, RATIO: tl.constexpr, WP: tl.constexpr, SPAN2: tl.constexpr,
                FAST_EXP: tl.constexpr):
    """The pooled rows c (fp32, [G, channels d]) of tokens `tok` at positions `gpos` (rows
    masked by `ok`): each [2r, channels] window loaded as [WP, G, channels] (the window axis
    in registers: the reductions stay inside each thread), softmax in fp64 (NUMERICS.md §1).
    Shared by the pooling kernel and the fused pool+K kernel, so both pool the same bits."""
    off, m3 = window_offsets(table_ptr, req_ptr, tok, gpos, ok, d, dm, block_size, table_stride, row_stride,
                             block_stride, D, RATIO, WP, SPAN2)
    return softmax_pool_f64(state_ptr, off, m3, D, FAST_EXP)


@triton.jit(do_not_specialize=["T", "table_stride"])     # one compile for every token count
def _pool_kernel(state_ptr, table_ptr, pos_ptr, req_ptr, slot_ptr, out_ptr,
                 T, block_size, table_stride, row_stride, block_stride,
                 D: tl.constexpr, RATIO: tl.constexpr, WP: tl.constexpr,
                 OUT_BF16: tl.constexpr, BT: tl.constexpr, G: tl.constexpr, BD: tl.constexpr, SPAN2: tl.constexpr,
                 FAST_EXP: tl.constexpr):
    """Tokens pid*BT .. pid*BT+BT-1, channels BD*program_id(1) ..: NaN rows for the tokens
    that write nothing; the others, G at a time (compacted by rank, so no lane computes
    for a token that does not write), pooled over their [2r, BD] windows held as
    [WP, G, BD] (the window axis in registers: the reductions stay inside each thread;
    fp64 needs many registers, so fewer channels per program means more programs per SM)."""
    pid = tl.program_id(0)
    toks = pid * BT + tl.arange(0, BT)
    inr, pos, act = writing_tokens(pos_ptr, slot_ptr, toks, T, RATIO)
    d = tl.program_id(1) * BD + tl.arange(0, BD)         # BD: a power of two
    dm = d < D
    nan = tl.full([BT, BD], float("nan"), tl.float32)
    orow = toks.to(tl.int64)[:, None] * D + d[None, :]
    nmask = (inr & ~act)[:, None] & dm[None, :]
    if OUT_BF16:
        tl.store(out_ptr + orow, bf16_bits(nan), mask=nmask)
    else:
        tl.store(out_ptr + orow, nan, mask=nmask)
    rank = tl.cumsum(act.to(tl.int32), axis=0) - 1
    n_act = tl.sum(act.to(tl.int32), axis=0)
    gi = tl.arange(0, G)
    for g0 in range(0, n_act, G):
        pick = act[None, :] & (rank[None, :] == (g0 + gi)[:, None])          # [G, BT]
        ok = (g0 + gi) < n_act
        tok = tl.sum(tl.where(pick, toks[None, :], 0), axis=1)              # [G]
        gpos = tl.sum(tl.where(pick, pos[None, :], 0), axis=1)
        c = pool_window(state_ptr, table_ptr, req_ptr, tok, gpos, ok, d, dm, block_size, table_stride,
                        row_stride, block_stride, D, RATIO, WP, SPAN2, FAST_EXP)
        grow = tok.to(tl.int64)[:, None] * D + d[None, :]
        gmask = ok[:, None] & dm[None, :]
        if OUT_BF16:
            tl.store(out_ptr + grow, bf16_bits(c), mask=gmask)
        else:
            tl.store(out_ptr + grow, c, mask=gmask)


# tokens per program, tokens pooled at once, warps, channels per program (H200, 16384
# tokens from a CUDA graph: (16, 1, 1, 64) 15.4 us, (16, 2, 2, 128) 34.4 us; one token
# and 64 channels a warp at a time keep the fp64 window tiles in registers)
TILE = tile((16, 1, 1, 64), (256, 32, 4, 128))


def launch(state_cache, block_table, positions, req_index, kv_slot_mapping, *, compress_ratio,
           out_bf16=True, fast_exp=False, tile=None):
    """Pooled rows [T, D] (bf16, or fp32 for the CUDA path); NaN where a token writes
    nothing. `tile` (measurement only): see TILE."""
    t = positions.shape[0]
    d = state_cache.shape[-1] // 4
    dev = state_cache.device
    out = torch.empty((t, d), dtype=torch.bfloat16 if out_bf16 else torch.float32, device=dev)
    if t:
        bt, g, warps, bd = tile or TILE
        bd = min(bd, triton.next_power_of_2(d))
        sc = state_cache
        _pool_kernel[(triton.cdiv(t, bt), triton.cdiv(d, bd))](
            sc, block_table, positions, req_index, kv_slot_mapping,
            out.view(torch.int16) if out_bf16 else out, t, sc.shape[1], block_table.stride(0),
            sc.stride(1), sc.stride(0), D=d, RATIO=compress_ratio,
            WP=triton.next_power_of_2(2 * compress_ratio), OUT_BF16=out_bf16, BT=bt, G=g, BD=bd,
            SPAN2=sc.shape[1] >= 2 * compress_ratio - 1,
            FAST_EXP=fast_exp, num_warps=warps, **LAUNCH)
    return out


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
        _check_windows(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
        args, back = on_device(device, state_cache.contiguous(), block_table.contiguous(),
                               positions.contiguous(), req_index.contiguous(), kv_slot_mapping.contiguous())
        pooled = launch(*args, compress_ratio=compress_ratio, out_bf16=rounding != "cuda")
        return {"pooled": back(pooled, state_cache)}

    return {"compress_pool": compress_pool}
