"""The ROCm K path in one launch: pool -> RMS norm -> RoPE -> MXFP4 -> paged store
(NUMERICS.md §1, §2, §4, §5; docs/fused-k.md).

vLLM's ROCm path runs two kernels per indexer layer: the pooling kernel stores a bf16 row in a
scratch buffer, aiter's `k_norm_rope_mxfp4_cache` reads it back and writes the pages. This
kernel does both in registers and writes **the split path's bytes**: it is built from the two
split kernels' own device functions (`pooling.pool_window`, `k_writer.write_entries`), and the
pooled row goes through the same bf16 round the scratch store would apply before the norm
reads it (rocm and deepseek rounding; the cuda rounding keeps fp32, as vLLM's CUDA kernel does).
Page order is the case's: aiter's preshuffle `[N, Dt, L]` for any page size it accepts
(`page_size % N == 0`), or natural.

A program scans TPP tokens (2 x RATIO compiled: about two writing tokens in a prefill
chunk) and pools its writing tokens BT at a time, compacted by rank, so no lane works for
a token that writes nothing (3 in 4 of a chunk). A writing token's whole row (all D
channels) is in its program, as the norm's sum needs; the window tile is [2r, BT, D], its
slot axis in registers. The pooled row is computed in fp32 with a
certified error bound, and only the values the bound cannot decide (about 1 in 200 on normal
data) are recomputed, gathered U at a time, with the split pooling's own fp64 code: the row
is always the split path's bf16 row. `STORE_POOLED` additionally stores the scratch row (NaN
for the tokens that write nothing, as the pooling kernel does): the harness asks for it so
that the pooling stage is judged on this very launch; in production it is off and the row
never leaves registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference import checks, layout
from reference.formats import ROUNDING_PATHS
from reference.k_writer import check_mxfp4_k_writer
from reference.pooling import check_pool_args

from ..common import on_device, reject_hadamard, scale_rule_code
from .interp import INTERPRETED, LAUNCH, bf16_bits, bf16_round, tile
from .k_writer import write_entries
from .numerics import ROUNDING_CODES, SCALE_RULE_CODES, writing_tokens
from .pooling import _check_windows, pool_window, softmax_pool_f64, window_rows, window_tile

# (tokens per program, writing tokens pooled at once, undecided values recomputed in fp64 at
# once, warps[, registers per thread at most]): compiled, 2 x RATIO tokens per program (a
# prefill chunk's programs each write about two entries, one at a time) capped at 128
# registers, so that a 16k-token chunk's 2,048 one-warp programs are resident at once on an
# H100's or H200's 132 SMs (16 per SM: one wave; the kernel fits the cap, a few bytes spilled at most),
# and one undecided value refined a round (the refinement's shortest chain: a row rarely
# has more than one). `make bench-gpu`'s sweep times the others (docs/fused-k.md). The cap
# is CUDA's (`maxnreg`); elsewhere the compiler's own allocation. The interpreter's wide
# tile: few programs.
COMPILED_TILE = (8, 1, 1, 1, 128)
TILE = tile(COMPILED_TILE, (1024, 256, 32, 4))

# The certified fp32 pooling (`pool_bf16`). With u = 2**-24, the kernel computes, in fp32,
# a_i = s_i - max, e_i = exp2(a_i * log2 e) (the hardware's exp2, taken as 2 ulp at most:
# CUDA documents exp2f so; ex2.approx.ftz.f32 measured over every input <= 0 on an H200:
# 2.42u relative at most, results below 2**-126 flushed to 0; ROCm's v_exp_f32 is assumed
# within it, not measured here), S = sum e, 1/S within 2 ulp (the full-range divide Triton
# emits for `/`: PTX's div.full.f32, documented at 2 ulp at most, 1.65u measured over every
# S in [1, 8] on an H200; ROCm's divide assumed within it, not measured here; a correctly
# rounded divide is a subroutine whose registers spill at the register cap), w_i = e_i *
# (1/S) and t_i = w_i * kv_i rounded, and c = sum t (any order). To first order, with E_i,
# S*, t*_i, c* the exact values: e_i = E_i (1 + eta_i), |eta_i| <= 4u + 3u |a_i| (the exp2,
# and the three roundings of its argument: s_i - max, log2 e, the product); S = sum_i E_i
# (1 + eta_i + theta_i), |theta_i| <= 7u (8 positive terms); so every t_i carries the same
# factor S*/S (1 + rho), whose error is at most 4u (the reciprocal) + sum_i w*_i (11u + 3u
# |a_i|) <= 18u (the softmax-weighted mean of |a| is below 1 for 8 slots: at most 0.98,
# with 7 slots 2.1 below the max), and its own errors eta_i and two roundings (the weight,
# the product): 6u + 3u |a_i|; the sum of the terms adds 7u sum |t_i|. So |c - c*| <=
# sum_i |t_i| (13u + 3u |a_i|) + 18u |c|: the error common to every term scales with |c|,
# and only the per-term errors with sum |t| (large where the terms cancel). Plus 2**-126
# |kv_i| / S where an exp2 underflows or is flushed (S is about 1 or more) and at most 2**-126 per
# operation in the subnormal range. The bound below takes 16u and 4u per term (one FMA
# each), 20u |c| and |c| 2**-22 for the rounding of c -+ bound itself, 2**-125 |kv_i| and
# 2**-120. (Over 5 million random windows on the CPU, scores spread 0.1 to 50, kv from 1e-20
# to 1e20, with numpy's exp2 and divide, tighter than the hardware's: the fp32 error reached
# at most 0.21 of the bound. It leaves 0.14 % to 0.54 % of the values of normal data
# undecided, for score spreads 8 to 0.5: a tenth more than a bound with expf and a correctly
# rounded reciprocal.)
_B_TERM: tl.constexpr = tl.constexpr(2.0 ** -20)
_B_ARG: tl.constexpr = tl.constexpr(2.0 ** -22)
_B_KV: tl.constexpr = tl.constexpr(2.0 ** -125)
_B_C: tl.constexpr = tl.constexpr(2.0 ** -20 + 2.0 ** -21)
_B_TINY: tl.constexpr = tl.constexpr(2.0 ** -120)
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def pool_bf16(state_ptr, off, m3, D: tl.constexpr):
    """(bf16(c) as fp32, certain) of the windows at `off` [WP, BT, D]: c pooled in fp32, and
    where that value is certain to be the split pooling's.

    x -> bf16(fp32(x)) is monotone, so where c - B and c + B (B the bound above on the fp32
    result's distance to the exact c) round to the same non-zero bf16 value, so does the
    exact c, and so does the fp64 pooling (within a few fp64 ulps of it): that value is
    certain. Elsewhere (a value within B of a bf16 rounding boundary, or of zero, whose sign
    the IEEE sum decides, or not finite) `refine_f64` recomputes it."""
    s = tl.load(state_ptr + off + 2 * D, mask=m3, other=float("-inf"))
    kv = tl.load(state_ptr + off, mask=m3, other=0.0)
    mx = tl.max(s, axis=0)
    a = s - mx[None, :, :]
    e = tl.math.exp2(a * _LOG2E)
    total = tl.sum(e, axis=0)
    inv = 1.0 / total
    t = (e * inv[None, :, :]) * kv
    c = tl.sum(t, axis=0)
    arg = tl.where(m3, tl.abs(a), 0.0)                   # a masked slot's -inf weighs nothing
    bound = (tl.sum(tl.fma(tl.abs(t), tl.fma(arg, _B_ARG, _B_TERM), tl.abs(kv) * _B_KV), axis=0)
             + tl.abs(c) * _B_C + _B_TINY)
    lo = bf16_bits(c - bound)
    hi = bf16_bits(c + bound)
    # equal, not zero, and finite (an overflowed bound, or inf * 0 in it, decides nothing)
    certain = (lo == hi) & ((lo & 0x7FFF) != 0) & ((lo & 0x7F80) != 0x7F80)
    return bf16_round(c), certain


@triton.jit
def refine_f64(state_ptr, base, valid, unc, out, D: tl.constexpr, BT: tl.constexpr, U: tl.constexpr):
    """`out` [BT, D] (the program's tokens, channels) with the values `unc` marks replaced by
    the split pooling's own fp64 code (`pooling.softmax_pool_f64`) on those (token, channel)
    windows alone, U of them at a time: the fp64 work is per undecided value, not per row.
    `base`, `valid` [WP, BT]: the windows' row offsets as the fp32 pass found them (in
    registers: a round is one load from the lines that pass just read, not the block-table
    lookups again)."""
    N: tl.constexpr = BT * D
    flag = tl.reshape(unc.to(tl.int32), (N,))
    bits = tl.reshape(out, (N,)).to(tl.int32, bitcast=True)
    idx = tl.arange(0, N)
    n = tl.sum(flag, axis=0)
    bt = tl.arange(0, BT)
    if U == 1:
        # one value a round, the first still flagged: no rank scan and no [U, N] matches (the
        # fewest live registers, which the whole kernel pays for, refined or not)
        for _ in range(0, n):
            at = tl.min(tl.where(flag != 0, idx, N), axis=0)
            flag = tl.where(idx == at, 0, flag)
            mine = bt == at // D                                                    # [BT]: its token
            row = tl.sum(tl.where(mine[None, :], base, 0), axis=1)                  # [WP]
            m = tl.sum(tl.where(mine[None, :], valid.to(tl.int32), 0), axis=1) != 0
            v = bf16_round(softmax_pool_f64(state_ptr, (row + at % D)[:, None, None], m[:, None, None], D, False))
            vb = tl.sum(tl.sum(v.to(tl.int32, bitcast=True), axis=1), axis=0)       # the one value's bits
            bits = tl.where(idx == at, vb, bits)
        return tl.reshape(bits.to(tl.float32, bitcast=True), (BT, D))
    rank = tl.cumsum(flag, axis=0) - 1
    ui = tl.arange(0, U)
    for j in range(0, n, U):
        match = (flag[None, :] != 0) & (rank[None, :] == (j + ui)[:, None])         # [U, N]
        at = tl.sum(tl.where(match, idx[None, :], 0), axis=1)                       # [U]
        ok = (j + ui) < n
        mine = (bt[None, None, :] == (at // D)[None, :, None])                      # [1, U, BT]: its token
        row = tl.sum(tl.where(mine, base[:, None, :], 0), axis=2)                   # [WP, U]
        m = (tl.sum(tl.where(mine, valid[:, None, :].to(tl.int32), 0), axis=2) != 0) & ok[None, :]
        off = row + (at % D)[None, :]
        v = bf16_round(softmax_pool_f64(state_ptr, off[:, :, None], m[:, :, None], D, False))
        vb = tl.reshape(v, (U,)).to(tl.int32, bitcast=True)
        # scattered as bits: a -0.0 keeps its sign
        hit = tl.max(match.to(tl.int32), axis=0) != 0
        bits = tl.where(hit, tl.sum(tl.where(match, vb[:, None], 0), axis=0), bits)
    return tl.reshape(bits.to(tl.float32, bitcast=True), (BT, D))


@triton.jit
def _pool_and_write(state_ptr, table_ptr, req_ptr, slot_ptr, cs_ptr, w_ptr, cache_ptr, pooled_ptr, toks, pos, act,
                    block_size, table_stride, row_stride, block_stride, page_stride, cs_stride, eps,
                    D: tl.constexpr, R: tl.constexpr, RATIO: tl.constexpr, WP: tl.constexpr,
                    PAGE: tl.constexpr, SHUF_N: tl.constexpr, SHUF_DT: tl.constexpr, SHUF_L: tl.constexpr,
                    ROUNDING: tl.constexpr, RULE: tl.constexpr, STORE_POOLED: tl.constexpr,
                    BT: tl.constexpr, U: tl.constexpr, SPAN2: tl.constexpr, CERTIFY: tl.constexpr):
    """The entries of BT writing tokens `toks` (rows masked by `act`) at positions `pos`."""
    TB: tl.constexpr = D // 2
    d = tl.arange(0, D)
    dm = d < D
    # 1. pooling: the row the split pooling stores (window slots in registers)
    if CERTIFY == 0:
        # every value by the split pooling's fp64 code: the cuda path (its fp32 row) and
        # the measurement of what the certified pooling saves
        c = pool_window(state_ptr, table_ptr, req_ptr, toks, pos, act, d, dm, block_size, table_stride,
                        row_stride, block_stride, D, RATIO, WP, SPAN2, False)
        if ROUNDING != 1:
            c = bf16_round(c)
    else:
        # rocm / deepseek: bf16(c), the value the scratch buffer holds, in fp32 where the
        # bound decides it; CERTIFY = 2 (measurement only) skips the fp64 refinement
        base, valid = window_rows(table_ptr, req_ptr, toks, pos, act, block_size, table_stride, row_stride,
                                  block_stride, D, RATIO, WP, SPAN2)
        off, m3 = window_tile(base, valid, d, dm)
        c, certain = pool_bf16(state_ptr, off, m3, D)
        if CERTIFY == 1:
            unc = act[:, None] & (certain == 0)
            if tl.max(tl.max(unc.to(tl.int32), axis=1), axis=0) != 0:
                c = refine_f64(state_ptr, base, valid, unc, c, D, BT, U)
    if STORE_POOLED:
        orow = toks.to(tl.int64)[:, None] * D + d[None, :]
        if ROUNDING == 1:
            tl.store(pooled_ptr + orow, c, mask=act[:, None])
        else:
            tl.store(pooled_ptr + orow, bf16_bits(c), mask=act[:, None])
    # 2. the row as the K writer reads it: (even, odd) channel pairs; on the rocm and
    # deepseek paths already bf16(c), the value the scratch buffer holds
    e, o = tl.split(tl.reshape(c, (BT, TB, 2)))
    # 3. norm -> RoPE -> MXFP4 -> store: the split K writer's own device function
    slot = tl.load(slot_ptr + toks, mask=act, other=0).to(tl.int64)
    write_entries(e, o, pos, slot, act[:, None], tl.arange(0, TB), cs_ptr, w_ptr, cache_ptr, page_stride,
                  cs_stride, eps, D, R, RATIO, PAGE, SHUF_N, SHUF_DT, SHUF_L, ROUNDING, False, False, 0.0, RULE,
                  BT, False)


@triton.jit(do_not_specialize=["T", "table_stride"])     # one compile for every token count
def _fused_k_kernel(state_ptr, table_ptr, pos_ptr, req_ptr, slot_ptr, cs_ptr, w_ptr, cache_ptr, pooled_ptr,
                    T, block_size, table_stride, row_stride, block_stride, page_stride, cs_stride, eps,
                    D: tl.constexpr, R: tl.constexpr, RATIO: tl.constexpr, WP: tl.constexpr,
                    PAGE: tl.constexpr, SHUF_N: tl.constexpr, SHUF_DT: tl.constexpr, SHUF_L: tl.constexpr,
                    ROUNDING: tl.constexpr, RULE: tl.constexpr, STORE_POOLED: tl.constexpr,
                    TPP: tl.constexpr, BT: tl.constexpr, U: tl.constexpr, SPAN2: tl.constexpr,
                    CERTIFY: tl.constexpr):
    # the program's TPP tokens; the ones that write (1 in RATIO of a prefill chunk) are
    # compacted by rank into groups of BT, so no lane works for a token that writes nothing
    toks_all = tl.program_id(0) * TPP + tl.arange(0, TPP)
    inr, pos_all, act_all = writing_tokens(pos_ptr, slot_ptr, toks_all, T, RATIO)
    if STORE_POOLED:
        # the scratch rows of the tokens that write nothing are NaN (compress_pool's contract)
        d = tl.arange(0, D)
        orow = toks_all.to(tl.int64)[:, None] * D + d[None, :]
        nan = tl.full([TPP, D], float("nan"), tl.float32)
        nmask = (inr & (act_all == 0))[:, None]
        if ROUNDING == 1:
            tl.store(pooled_ptr + orow, nan, mask=nmask)
        else:
            tl.store(pooled_ptr + orow, bf16_bits(nan), mask=nmask)
    rank = tl.cumsum(act_all.to(tl.int32), axis=0) - 1
    n_act = tl.sum(act_all.to(tl.int32), axis=0)
    gi = tl.arange(0, BT)
    for g0 in range(0, n_act, BT):                  # most programs of a prefill chunk: once
        pick = act_all[None, :] & (rank[None, :] == (g0 + gi)[:, None])             # [BT, TPP]
        toks = tl.sum(tl.where(pick, toks_all[None, :], 0), axis=1)
        pos = tl.sum(tl.where(pick, pos_all[None, :], 0), axis=1)
        act = (g0 + gi) < n_act
        _pool_and_write(state_ptr, table_ptr, req_ptr, slot_ptr, cs_ptr, w_ptr, cache_ptr, pooled_ptr, toks, pos,
                        act, block_size, table_stride, row_stride, block_stride, page_stride, cs_stride, eps,
                        D, R, RATIO, WP, PAGE, SHUF_N, SHUF_DT, SHUF_L, ROUNDING, RULE, STORE_POOLED, BT, U,
                        SPAN2, CERTIFY)


def launch(state_cache, block_table, positions, req_index, kv_slot_mapping, cos_sin_cache, norm_weight,
           out_cache, *, compress_ratio, norm_eps, page_size, shuffle, rounding="rocm", scale_rule="ceil",
           pooled=None, tile=None, certify=True):
    """Write the entries of every boundary token with a slot into `out_cache` in place (all
    tensors on the kernel's device, checked by the caller). `pooled`: an optional [T, D]
    output (bf16; fp32 for rounding="cuda") that receives the scratch rows the split path
    would store. `tile` (measurement only): (tokens per program, writing tokens pooled at
    once, undecided values refined at once, warps[, registers per thread at most (CUDA)]);
    `certify` (measurement only): False pools every value in fp64 (the same bytes, slower),
    "unchecked" in fp32 without the fp64 refinement (not the split path's bytes)."""
    t = positions.shape[0]
    d = state_cache.shape[-1] // 4
    if t == 0:
        return out_cache
    shuf = layout.as_shuffle(shuffle)
    tpp, bt, u, warps, *rest = tile or TILE
    if len(rest) > 1:
        raise ValueError(f"fused K tile: 4 or 5 numbers, got {tile}")
    # a register cap (CUDA, measurement): more one-warp programs resident per SM; spills do
    # not change a result bit (ptxas allocates registers for the same instructions)
    cap = {"maxnreg": rest[0]} if rest and rest[0] and not INTERPRETED and torch.version.hip is None else {}
    if tpp % bt or tpp & (tpp - 1) or bt & (bt - 1):
        raise ValueError(f"fused K tile: tokens per program and tokens at once are powers of two, the first a "
                         f"multiple of the second (got {tpp}, {bt})")
    if tile is None:
        warps = max(warps, d // 128)                # a 256-channel row in one warp spills
    sc = state_cache
    store = pooled is not None
    if store:
        pooled_arg = pooled.view(torch.int16) if pooled.dtype == torch.bfloat16 else pooled
    else:
        pooled_arg = out_cache                      # never written (STORE_POOLED is off)
    _fused_k_kernel[(triton.cdiv(t, tpp),)](
        sc, block_table, positions, req_index, kv_slot_mapping, cos_sin_cache, norm_weight.float().contiguous(),
        out_cache, pooled_arg, t, sc.shape[1], block_table.stride(0), sc.stride(1), sc.stride(0),
        out_cache.shape[1], cos_sin_cache.stride(0), float(norm_eps),
        D=d, R=cos_sin_cache.shape[1], RATIO=compress_ratio, WP=triton.next_power_of_2(2 * compress_ratio),
        PAGE=page_size, SHUF_N=shuf.n if shuf else 0, SHUF_DT=shuf.dt if shuf else 1,
        SHUF_L=shuf.l if shuf else 1, ROUNDING=ROUNDING_CODES[rounding], RULE=SCALE_RULE_CODES[scale_rule],
        STORE_POOLED=store, TPP=tpp, BT=bt, U=u, SPAN2=sc.shape[1] >= 2 * compress_ratio - 1,
        CERTIFY=0 if rounding == "cuda" else {True: 1, False: 0, "unchecked": 2}[certify], num_warps=warps,
        **LAUNCH, **cap)
    return out_cache


def make_fused(device: str) -> dict:
    """{K writer op: the fused launch}: `compress_pool` followed by `k_norm_rope_mxfp4_cache`
    as one kernel (Backend.fused_pool). It takes both ops' inputs but `k`, and both ops'
    scalars, checks them as the two ops do, and returns both ops' outputs: the pages and the
    pooled rows the launch stored (`store_pooled`; without it only the pages)."""
    def pool_k_mxfp4(*, state_cache, block_table, positions, req_index, kv_slot_mapping, cos_sin_cache,
                     norm_weight, kv_cache, compress_ratio: int = 4, norm_eps: float = 1e-6, page_size: int = 64,
                     shuffle=(32, 16, 2), rounding: str = "rocm", hadamard: bool = False,
                     scale_rule: str = "ceil", store_pooled: bool = True) -> dict:
        reject_hadamard(hadamard)
        scale_rule_code(scale_rule)
        check_pool_args(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
        checks.choice("rounding", rounding, ROUNDING_PATHS)
        _check_windows(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
        d = state_cache.shape[-1] // 4
        # the writer's checks, on a stand-in for the pooled rows (finite wherever a window is)
        row = torch.zeros((positions.shape[0], d), device=positions.device,
                          dtype=torch.float32 if rounding == "cuda" else torch.bfloat16)
        shuf = check_mxfp4_k_writer(row, positions, cos_sin_cache, norm_weight, kv_slot_mapping, kv_cache,
                                    norm_eps, compress_ratio, page_size, shuffle, rounding)
        if d not in (64, 128, 256):
            raise ValueError(f"state_cache: the fused kernel holds a row as D/2 pairs, D a power of two "
                             f"from 64 to 256, got D = {d}")
        args, back = on_device(device, state_cache.contiguous(), block_table.contiguous(), positions.contiguous(),
                               req_index.contiguous(), kv_slot_mapping.contiguous(), cos_sin_cache.contiguous(),
                               norm_weight)
        out = kv_cache.to(device, copy=True)
        pooled = torch.empty((positions.shape[0], d), dtype=row.dtype, device=device) if store_pooled else None
        launch(*args, out, compress_ratio=compress_ratio, norm_eps=norm_eps, page_size=page_size, shuffle=shuf,
               rounding=rounding, scale_rule=scale_rule, pooled=pooled)
        res = {"kv_cache": back(out, kv_cache)}
        if store_pooled:
            res["pooled"] = back(pooled, state_cache)
        return res

    return {"k_norm_rope_mxfp4_cache": pool_k_mxfp4}
