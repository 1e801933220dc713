"""Device-side building blocks shared by the kernels: which tokens write, RMS norm, GPT-J
RoPE on pairs, the MXFP4 and FP8 codecs (NUMERICS.md §2-§4, §7), written to give the reference's bits.

Vectors are handled as (even, odd) halves of shape [rows, D/2]: pair m is (x[2m],
x[2m+1]); that is both RoPE's pairing and MXFP4's byte packing (even element in the low
nibble), so byte b of an entry is built from pair b.
"""
from __future__ import annotations

import triton
import triton.language as tl

from reference.formats import E2M1_INV_MAX, E2M1_THRESHOLDS, E8M0_TINY_AMAX

from .interp import bf16_round

_TINY_AMAX: tl.constexpr = tl.constexpr(E8M0_TINY_AMAX)
_ONE_SIXTH: tl.constexpr = tl.constexpr(E2M1_INV_MAX)          # rounded to fp32 in the kernel
# e2m1 rounding thresholds (reference.formats: the code of |y| counts those <= |y|)
_T0: tl.constexpr = tl.constexpr(E2M1_THRESHOLDS[0])
_T1: tl.constexpr = tl.constexpr(E2M1_THRESHOLDS[1])
_T2: tl.constexpr = tl.constexpr(E2M1_THRESHOLDS[2])
_T3: tl.constexpr = tl.constexpr(E2M1_THRESHOLDS[3])
_T4: tl.constexpr = tl.constexpr(E2M1_THRESHOLDS[4])
_T5: tl.constexpr = tl.constexpr(E2M1_THRESHOLDS[5])
_T6: tl.constexpr = tl.constexpr(E2M1_THRESHOLDS[6])

# constexpr codes for the host wrappers
ROUNDING_CODES = {"rocm": 0, "cuda": 1, "deepseek": 2}
SCALE_RULE_CODES = {"ceil": 0, "ocp-floor": 1, "even": 2}


@triton.jit
def rms_norm_pairs(e, o, w_e, w_o, eps, D: tl.constexpr, FAST: tl.constexpr = False):
    """(x * rsqrt(sum(x*x)/D + eps)) * w, fp32. The sum of squares is accumulated in fp64
    (exact for bf16 rows) and rounded once; rsqrt is 1/sqrt in fp64 (IEEE sqrt and divide),
    rounded once to fp32: the same bits as the reference on every device.
    FAST (measurement only, see harness/bench/gpu.py): fp32 tree sum and the hardware's
    approximate rsqrt, as upstream kernels likely do."""
    if FAST:
        ss32 = tl.sum(e * e, axis=1) + tl.sum(o * o, axis=1)
        rstd = tl.math.rsqrt(ss32 / D + eps)
    else:
        e64 = e.to(tl.float64)
        o64 = o.to(tl.float64)
        ss = tl.sum(e64 * e64, axis=1) + tl.sum(o64 * o64, axis=1)
        ms = tl.div_rn(ss.to(tl.float32), tl.full(ss.shape, D, tl.float32))
        v = ms + eps
        rstd = (1.0 / tl.sqrt(v.to(tl.float64))).to(tl.float32)
    return (e * rstd[:, None]) * w_e, (o * rstd[:, None]) * w_o


@triton.jit
def rope_pairs(e, o, cos, sin, is_rope, ROUND: tl.constexpr, NOPE_FORMULA: tl.constexpr):
    """e' = e*cos - o*sin, o' = o*cos + e*sin on the rope pairs (each product rounded to
    fp32: launch with fp fusion off). NOPE_FORMULA: the NoPE pairs go through the formula
    with cos = 1, sin = 0 (aiter's K writer: -0.0 can become +0.0); else they are kept."""
    if NOPE_FORMULA:
        c = tl.where(is_rope, cos, 1.0)
        s = tl.where(is_rope, sin, 0.0)
        e2 = e * c - o * s
        o2 = o * c + e * s
        if ROUND:
            e2 = bf16_round(e2)
            o2 = bf16_round(o2)
    else:
        er = e * cos - o * sin
        orr = o * cos + e * sin
        if ROUND:
            er = bf16_round(er)
            orr = bf16_round(orr)
        e2 = tl.where(is_rope, er, e)
        o2 = tl.where(is_rope, orr, o)
    return e2, o2


@triton.jit
def writing_tokens(pos_ptr, slot_ptr, toks, T, RATIO: tl.constexpr):
    """Of tokens `toks`: (in range, position as int64, writes). A token writes an entry when
    it has a slot (>= 0) and closes its group ((p + 1) % RATIO == 0)."""
    inr = toks < T
    pos = tl.load(pos_ptr + toks, mask=inr, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + toks, mask=inr, other=-1)
    return inr, pos, inr & (slot >= 0) & ((pos + 1) % RATIO == 0)


@triton.jit
def rope_cos_sin(cs_ptr, at, cs_stride, m, mask, NOPE2: tl.constexpr, R: tl.constexpr):
    """cos and sin of pair m of each row at RoPE position `at` (rows masked by `mask`), and
    is_rope: the pairs from NOPE2 on rotate; the NoPE pairs before them read cos 1, sin 0."""
    is_rope = m[None, :] >= NOPE2
    mr = tl.where(m >= NOPE2, m - NOPE2, 0)
    cs_off = at[:, None] * cs_stride + mr[None, :]
    cmask = mask & is_rope
    cos = tl.load(cs_ptr + cs_off, mask=cmask, other=1.0)
    sin = tl.load(cs_ptr + cs_off + R // 2, mask=cmask, other=0.0)
    return cos, sin, is_rope


# --- MXFP4 -----------------------------------------------------------------------

@triton.jit
def e8m0_from_amax(amax, RULE: tl.constexpr):
    """Biased e8m0 (int32) from the fp32 bits; never through log2 (NUMERICS.md §4)."""
    if RULE == 0:    # ceil: aiter scaling mode 1, vLLM
        ratio = tl.maximum(amax, _TINY_AMAX) * _ONE_SIXTH
        e = (ratio.to(tl.int32, bitcast=True) + 0x7FFFFF) >> 23
    elif RULE == 1:  # OCP v1.0 floor
        ex = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.minimum(tl.maximum(ex - 2 + 127, 0), 254)
    else:            # even: round amax to one mantissa bit, then floor
        r = (amax.to(tl.int32, bitcast=True) + (1 << 21)) & 0x7F800000
        e = tl.minimum(tl.maximum((r >> 23) - 2, 0), 254)
    return e


@triton.jit
def e2m1_code(y):
    """Nearest-even e2m1 code of y (|y| <= 6 after scaling), sign in bit 3."""
    a = tl.abs(y)
    code = ((a >= _T0).to(tl.int32) + (a >= _T1).to(tl.int32) + (a >= _T2).to(tl.int32)
            + (a >= _T3).to(tl.int32) + (a >= _T4).to(tl.int32) + (a >= _T5).to(tl.int32)
            + (a >= _T6).to(tl.int32))
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


@triton.jit
def mxfp4_encode_pairs(e, o, ROWS: tl.constexpr, TB: tl.constexpr, RULE: tl.constexpr):
    """(even, odd) [ROWS, TB] fp32 -> (packed bytes [ROWS, TB] int32, e8m0 [ROWS, TB//16] int32)."""
    NB: tl.constexpr = TB // 16
    a = tl.maximum(tl.abs(e), tl.abs(o))
    amax = tl.max(tl.reshape(a, (ROWS, NB, 16)), axis=2)
    e8 = e8m0_from_amax(amax, RULE)
    inv = ((254 - e8) << 23).to(tl.float32, bitcast=True)
    inv_b = tl.reshape(tl.broadcast_to(inv[:, :, None], (ROWS, NB, 16)), (ROWS, TB))
    packed = e2m1_code(e * inv_b) | (e2m1_code(o * inv_b) << 4)
    return packed, e8


@triton.jit
def e2m1_value(code):
    """e2m1 code (0..15, int32) -> fp32 value, exact."""
    m = code & 7
    ex = m >> 1
    big = (((ex + 126) << 23) | ((m & 1) << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(m >= 2, big, m.to(tl.float32) * 0.5)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def e8m0_value(e8):
    """2**(e - 127) exactly (e = 0 -> 2**-127, subnormal); 255 -> NaN."""
    v = tl.where(e8 == 0, (1 << 22), e8 << 23).to(tl.float32, bitcast=True)
    return tl.where(e8 == 255, float("nan"), v)


# --- FP8 -------------------------------------------------------------------------

@triton.jit
def pow2_scale(amax, FMAX: tl.constexpr):
    """2**ceil(log2(max(amax, 1e-4) / FMAX)) from the fp32 bits of the correctly rounded ratio."""
    ratio = tl.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, FMAX, tl.float32))
    ex = (ratio.to(tl.int32, bitcast=True) + 0x7FFFFF) >> 23
    return (ex << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_encode(v, FNUZ: tl.constexpr):
    """fp32 (already clamped to the format's range) -> e4m3fn / e4m3fnuz byte (int32),
    round to nearest even, by bit arithmetic (the interpreter's fp8 casts are wrong)."""
    if FNUZ:
        BIAS: tl.constexpr = 8
        SUB_SCALE: tl.constexpr = 1024.0       # 2**(BIAS + 2): one subnormal step -> 1
        MIN_NORMAL: tl.constexpr = 0.0078125   # 2**(1 - BIAS)
    else:
        BIAS: tl.constexpr = 7
        SUB_SCALE: tl.constexpr = 512.0
        MIN_NORMAL: tl.constexpr = 0.015625
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 31) & 1
    a = tl.abs(v)
    ab = a.to(tl.int32, bitcast=True)
    # normal range: drop 20 mantissa bits with nearest-even, then rebias the exponent
    r = (ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20
    normal = r - ((127 - BIAS) << 3)
    # subnormal range: a * 2**(BIAS + 2) rounded to an integer (nearest even via 1.5*2**23)
    t = a * SUB_SCALE
    sub = ((t + 12582912.0) - 12582912.0).to(tl.int32)
    code = tl.where(a < MIN_NORMAL, sub, normal)
    if FNUZ:
        sign = tl.where(code == 0, 0, sign)   # fnuz has no -0: 0x80 is NaN
    return code | (sign << 7)


@triton.jit
def fp8_value(byte, FNUZ: tl.constexpr):
    """e4m3fn / e4m3fnuz byte (int32 0..255) -> fp32, exact; NaN codes -> NaN."""
    if FNUZ:
        BIAS: tl.constexpr = 8
        SUB_STEP: tl.constexpr = 0.0009765625   # 2**-(BIAS + 2)
    else:
        BIAS: tl.constexpr = 7
        SUB_STEP: tl.constexpr = 0.001953125
    ex = (byte >> 3) & 15
    m = byte & 7
    normal = (((ex + (127 - BIAS)) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * SUB_STEP
    mag = tl.where(ex == 0, sub, normal)
    val = tl.where((byte & 0x80) != 0, -mag, mag)
    if FNUZ:
        val = tl.where(byte == 0x80, float("nan"), val)
    else:
        val = tl.where((byte & 0x7F) == 0x7F, float("nan"), val)
    return val
