"""Q quant: RoPE at the token's own position -> MXFP4 (or FP8) per (token, head)
(NUMERICS.md §3, §7). The folded weights are one fp32 multiply on the host side
(reference.q_quant.fold_weights), shared with the reference so they cannot drift."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference.formats import FP8_FLAVOURS
from reference.q_quant import check_q_args, fold_weights

from ..common import on_device, reject_hadamard, scale_rule_code
from .interp import LAUNCH, tile, widen_bf16
from .numerics import SCALE_RULE_CODES, fp8_encode, mxfp4_encode_pairs, pow2_scale, rope_cos_sin, rope_pairs

BR = tile(16, 256)   # (token, head) rows per program


@triton.jit(do_not_specialize=["N"])     # one compile for every token count
def _q_quant_kernel(q_ptr, pos_ptr, cs_ptr, out_ptr, scale_ptr, N, H, cs_stride,
                    D: tl.constexpr, R: tl.constexpr, QUANT_FP8: tl.constexpr, FNUZ: tl.constexpr,
                    FMAX: tl.constexpr, RULE: tl.constexpr, BR: tl.constexpr):
    TB: tl.constexpr = D // 2
    NB: tl.constexpr = D // 32
    NOPE2: tl.constexpr = (D - R) // 2
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    live = rows < N
    pos = tl.load(pos_ptr + rows // H, mask=live, other=0).to(tl.int64)
    m = tl.arange(0, TB)
    base = rows.to(tl.int64)[:, None] * D + 2 * m[None, :]
    lmask = live[:, None]
    e = widen_bf16(tl.load(q_ptr + base, mask=lmask, other=0))
    o = widen_bf16(tl.load(q_ptr + base + 1, mask=lmask, other=0))
    cos, sin, is_rope = rope_cos_sin(cs_ptr, pos, cs_stride, m, lmask, NOPE2, R)
    ye, yo = rope_pairs(e, o, cos, sin, is_rope, True, False)   # NoPE dims untouched
    if QUANT_FP8:
        amax = tl.max(tl.maximum(tl.abs(ye), tl.abs(yo)), axis=1)
        s = pow2_scale(amax, FMAX)
        ve = tl.minimum(tl.maximum(tl.div_rn(ye, s[:, None]), -FMAX), FMAX)
        vo = tl.minimum(tl.maximum(tl.div_rn(yo, s[:, None]), -FMAX), FMAX)
        tl.store(out_ptr + base, fp8_encode(ve, FNUZ).to(tl.uint8), mask=lmask)
        tl.store(out_ptr + base + 1, fp8_encode(vo, FNUZ).to(tl.uint8), mask=lmask)
        tl.store(scale_ptr + rows, s, mask=live)
    else:
        packed, e8 = mxfp4_encode_pairs(ye, yo, BR, TB, RULE)
        sidx = tl.arange(0, NB)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * TB + m[None, :], packed.to(tl.uint8), mask=lmask)
        tl.store(scale_ptr + rows.to(tl.int64)[:, None] * NB + sidx[None, :], e8.to(tl.uint8), mask=lmask)


def launch(q, positions, cos_sin_cache, *, fp8_dtype=None, scale_rule="ceil"):
    """-> (q_fp4 [T,H,D/2], q_scale [T,H,D/32]) or, for fp8, (q_fp8 [T,H,D], s_q f32 [T,H])."""
    t, h, d = q.shape
    n = t * h
    dev = q.device
    if fp8_dtype:
        out = torch.empty(t, h, d, dtype=torch.uint8, device=dev)
        scale = torch.empty(t, h, dtype=torch.float32, device=dev)
    else:
        out = torch.empty(t, h, d // 2, dtype=torch.uint8, device=dev)
        scale = torch.empty(t, h, d // 32, dtype=torch.uint8, device=dev)
    if n:
        fmax = FP8_FLAVOURS[fp8_dtype][1] if fp8_dtype else 0.0   # FMAX: read by the FP8 path only
        _q_quant_kernel[(triton.cdiv(n, BR),)](
            q.contiguous().view(torch.int16), positions.contiguous(), cos_sin_cache.contiguous(), out, scale,
            n, h, cos_sin_cache.stride(0), D=d, R=cos_sin_cache.shape[1],
            QUANT_FP8=fp8_dtype is not None, FNUZ=fp8_dtype == "e4m3fnuz", FMAX=fmax,
            RULE=SCALE_RULE_CODES[scale_rule], BR=BR, **LAUNCH)
    return out, scale


def make_op(device: str):
    def q_rope_mxfp4_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                           hadamard: bool = False, scale_rule: str = "ceil") -> dict:
        reject_hadamard(hadamard)
        scale_rule_code(scale_rule)
        check_q_args(q, positions, cos_sin_cache, weights, weights_scale)
        (qd, pd, cd, wd), back = on_device(device, q, positions, cos_sin_cache, weights)
        packed, scales = launch(qd, pd, cd, scale_rule=scale_rule)
        return {"q_fp4": back(packed, q), "q_scale": back(scales, q),
                "weights": back(fold_weights(wd, weights_scale), weights)}

    return {"q_rope_mxfp4_quant": q_rope_mxfp4_quant}
