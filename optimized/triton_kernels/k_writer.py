"""Fused K writer: norm -> RoPE -> MXFP4 (or FP8) -> paged store (NUMERICS.md §2, §5, §7).

One program handles TILE tokens; the ones that write (slot >= 0 and a boundary) are
compacted on the device, BT at a time, so no host-side compaction or sync is needed. Only the bytes of the written
entries are stored: the pool is cloned first, so every other byte keeps its value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference import layout
from reference.formats import FP8_FLAVOURS
from reference.k_writer import check_mxfp4_k_writer

from ..common import on_device, reject_hadamard, scale_rule_code
from .interp import LAUNCH, bf16_round, tile, widen_bf16
from .numerics import (
    ROUNDING_CODES,
    SCALE_RULE_CODES,
    fp8_encode,
    mxfp4_encode_pairs,
    pow2_scale,
    rms_norm_pairs,
    rope_cos_sin,
    rope_pairs,
    writing_tokens,
)

# tokens per program, tokens written at once (H200: 32, 8 the fastest of 6 timed)
TILE, BT = tile((32, 8), (512, 128))


@triton.jit
def write_entries(e, o, pos, slot, amask, m, cs_ptr, w_ptr, cache_ptr, page_stride, cs_stride, eps,
                  D: tl.constexpr, R: tl.constexpr, RATIO: tl.constexpr, PAGE: tl.constexpr,
                  SHUF_N: tl.constexpr, SHUF_DT: tl.constexpr, SHUF_L: tl.constexpr,
                  ROUNDING: tl.constexpr, QUANT_FP8: tl.constexpr, FNUZ: tl.constexpr, FMAX: tl.constexpr,
                  RULE: tl.constexpr, BT: tl.constexpr, FAST_NORM: tl.constexpr):
    """Norm -> RoPE -> quantize -> store of BT entries given as (even, odd) halves [BT, D/2]
    (fp32; already bf16 on the rocm and deepseek paths), at positions `pos`, slots `slot`
    (rows masked by `amask` [BT, 1]). Shared by the K writer and the fused pool+K kernel, so
    both write the same bytes from the same row."""
    TB: tl.constexpr = D // 2
    NB: tl.constexpr = D // 32
    NOPE2: tl.constexpr = (D - R) // 2
    w_e = tl.load(w_ptr + 2 * m)[None, :]
    w_o = tl.load(w_ptr + 2 * m + 1)[None, :]
    ne, no = rms_norm_pairs(e, o, w_e, w_o, eps, D, FAST_NORM)

    g = (pos // RATIO) * RATIO                          # RoPE at the group's first position
    cos, sin, is_rope = rope_cos_sin(cs_ptr, g, cs_stride, m, amask, NOPE2, R)
    if ROUNDING == 1:      # cuda fused: fp32 through norm and RoPE (NoPE through the formula), one bf16 round
        ye, yo = rope_pairs(ne, no, cos, sin, is_rope, False, True)
        ye = bf16_round(ye)
        yo = bf16_round(yo)
    else:                  # rocm / deepseek: bf16 after the norm and after RoPE
        ye, yo = rope_pairs(bf16_round(ne), bf16_round(no), cos, sin, is_rope, True, ROUNDING == 0)

    page = slot // PAGE
    t = slot % PAGE
    start = page * page_stride
    if QUANT_FP8:
        amax = tl.max(tl.maximum(tl.abs(ye), tl.abs(yo)), axis=1)
        s = pow2_scale(amax, FMAX)
        ve = tl.minimum(tl.maximum(tl.div_rn(ye, s[:, None]), -FMAX), FMAX)
        vo = tl.minimum(tl.maximum(tl.div_rn(yo, s[:, None]), -FMAX), FMAX)
        voff = start[:, None] + t[:, None] * D + 2 * m[None, :]
        tl.store(cache_ptr + voff, fp8_encode(ve, FNUZ).to(tl.uint8), mask=amask)
        tl.store(cache_ptr + voff + 1, fp8_encode(vo, FNUZ).to(tl.uint8), mask=amask)
        sb = s.to(tl.int32, bitcast=True)
        k4 = tl.arange(0, 4)
        soff = start[:, None] + PAGE * D + t[:, None] * 4 + k4[None, :]
        sbytes = (sb[:, None] >> (8 * k4[None, :])) & 0xFF     # little-endian fp32
        tl.store(cache_ptr + soff, sbytes.to(tl.uint8), mask=amask)
    else:
        packed, e8 = mxfp4_encode_pairs(ye, yo, BT, TB, RULE)
        sidx = tl.arange(0, NB)
        if SHUF_N == 0:
            voff = t[:, None] * TB + m[None, :]
            soff = PAGE * TB + t[:, None] * NB + sidx[None, :]
        else:
            grp = t // SHUF_N
            lane = t % SHUF_N
            voff = (grp[:, None] * (SHUF_N * TB) + (m[None, :] // SHUF_DT) * (SHUF_N * SHUF_DT)
                    + lane[:, None] * SHUF_DT + (m[None, :] % SHUF_DT))
            S_HI: tl.constexpr = NB // SHUF_L
            soff = (PAGE * TB + grp[:, None] * (SHUF_N * NB) + (sidx[None, :] % SHUF_L) * (SHUF_N * S_HI)
                    + lane[:, None] * S_HI + sidx[None, :] // SHUF_L)
        tl.store(cache_ptr + start[:, None] + voff, packed.to(tl.uint8), mask=amask)
        tl.store(cache_ptr + start[:, None] + soff, e8.to(tl.uint8), mask=amask)


@triton.jit(do_not_specialize=["T"])     # one compile for every token count
def _k_writer_kernel(k_ptr, pos_ptr, cs_ptr, w_ptr, slot_ptr, cache_ptr,
                     T, page_stride, cs_stride, eps,
                     D: tl.constexpr, R: tl.constexpr, RATIO: tl.constexpr, PAGE: tl.constexpr,
                     SHUF_N: tl.constexpr, SHUF_DT: tl.constexpr, SHUF_L: tl.constexpr,
                     K_BF16: tl.constexpr, ROUNDING: tl.constexpr, QUANT_FP8: tl.constexpr,
                     FNUZ: tl.constexpr, FMAX: tl.constexpr, RULE: tl.constexpr,
                     TILE: tl.constexpr, BT: tl.constexpr, FAST_NORM: tl.constexpr):
    TB: tl.constexpr = D // 2
    pid = tl.program_id(0)
    # The tile's tokens that write are compacted (by rank) into groups of BT, so no lane
    # works for a token that writes nothing (3 of 4 in a prefill chunk).
    toks = pid * TILE + tl.arange(0, TILE)
    _, _, t_act = writing_tokens(pos_ptr, slot_ptr, toks, T, RATIO)
    rank = tl.cumsum(t_act.to(tl.int32), axis=0) - 1
    n_act = tl.sum(t_act.to(tl.int32), axis=0)
    gi = tl.arange(0, BT)
    for g0 in range(0, n_act, BT):
        pick = t_act[None, :] & (rank[None, :] == (g0 + gi)[:, None])          # [BT, TILE]
        rows = tl.sum(tl.where(pick, toks[None, :], 0), axis=1)
        active = (g0 + gi) < n_act
        pos = tl.load(pos_ptr + rows, mask=active, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + rows, mask=active, other=0).to(tl.int64)
        m = tl.arange(0, TB)
        base = rows.to(tl.int64)[:, None] * D + 2 * m[None, :]
        amask = active[:, None]
        if K_BF16:
            # one 32-bit word per pair (little-endian: the even element in the low half)
            word = tl.load(k_ptr + base // 2, mask=amask, other=0)
            e = widen_bf16(word)
            o = widen_bf16(word >> 16)
        else:
            e = tl.load(k_ptr + base, mask=amask, other=0.0)
            o = tl.load(k_ptr + base + 1, mask=amask, other=0.0)
            if ROUNDING == 2:  # deepseek rounds the pooled row to bf16 before the norm
                e = bf16_round(e)
                o = bf16_round(o)
        write_entries(e, o, pos, slot, amask, m, cs_ptr, w_ptr, cache_ptr, page_stride, cs_stride, eps,
                      D, R, RATIO, PAGE, SHUF_N, SHUF_DT, SHUF_L, ROUNDING, QUANT_FP8, FNUZ, FMAX, RULE, BT,
                      FAST_NORM)


def launch(k, positions, cos_sin_cache, norm_weight, slot_mapping, out_cache, *, norm_eps,
           compress_ratio, page_size, shuffle, rounding="rocm", fp8_dtype=None, scale_rule="ceil",
           variant=None, tile=None):
    """Write into `out_cache` in place (all tensors on the kernel's device, checked).
    `variant` (measurement only): "fast-norm" (fp32 sum, approximate rsqrt), "fma" (fp
    contraction left on), or "fast-norm+fma": what upstream kernels likely do. `tile`
    (measurement only): (tokens per program, tokens written at once, warps)."""
    t, d = k.shape
    r = cos_sin_cache.shape[1]
    shuf = layout.as_shuffle(shuffle)
    fmax = FP8_FLAVOURS[fp8_dtype][1] if fp8_dtype else 0.0   # FMAX: read by the FP8 path only
    k_arg = k.contiguous().view(torch.int32) if k.dtype == torch.bfloat16 else k.contiguous()
    tile_t, bt, warps = tile or (TILE, BT, 4)
    grid = (triton.cdiv(t, tile_t),)
    if t == 0:
        return out_cache
    _k_writer_kernel[grid](
        k_arg, positions.contiguous(), cos_sin_cache.contiguous(), norm_weight.float().contiguous(),
        slot_mapping.contiguous(), out_cache, t, out_cache.shape[1], cos_sin_cache.stride(0),
        float(norm_eps), D=d, R=r, RATIO=compress_ratio, PAGE=page_size,
        SHUF_N=shuf.n if shuf else 0, SHUF_DT=shuf.dt if shuf else 1, SHUF_L=shuf.l if shuf else 1,
        K_BF16=k.dtype == torch.bfloat16, ROUNDING=ROUNDING_CODES[rounding],
        QUANT_FP8=fp8_dtype is not None, FNUZ=fp8_dtype == "e4m3fnuz", FMAX=fmax,
        RULE=SCALE_RULE_CODES[scale_rule], TILE=tile_t, BT=bt, num_warps=warps,
        FAST_NORM=bool(variant and "fast-norm" in variant),
        **({} if variant and "fma" in variant else LAUNCH))
    return out_cache


def make_op(device: str):
    def k_norm_rope_mxfp4_cache(*, k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                norm_eps: float = 1e-6, compress_ratio: int = 4, page_size: int = 64,
                                shuffle=(32, 16, 2), rounding: str = "rocm", hadamard: bool = False,
                                scale_rule: str = "ceil") -> dict:
        reject_hadamard(hadamard)
        scale_rule_code(scale_rule)
        shuf = check_mxfp4_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                    norm_eps, compress_ratio, page_size, shuffle, rounding)
        args, back = on_device(device, k, positions, cos_sin_cache, norm_weight, slot_mapping)
        out = kv_cache.to(device, copy=True)
        launch(*args, out, norm_eps=norm_eps, compress_ratio=compress_ratio, page_size=page_size,
               shuffle=shuf, rounding=rounding, scale_rule=scale_rule)
        return {"kv_cache": back(out, kv_cache)}

    return {"k_norm_rope_mxfp4_cache": k_norm_rope_mxfp4_cache}
