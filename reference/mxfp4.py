"""MXFP4 encode/decode (NUMERICS.md §4): e2m1 elements, one e8m0 scale per 32.

The production rule is aiter "scaling mode 1" (`ceil`): the scale is the smallest power
of two with amax / scale <= 6, computed from the fp32 bits so that it agrees with the
kernels at every amax (a float ceil(log2()) disagrees just above 6 * 2**k).
The other rules are offered for studies and named for where they come from.
"""
from __future__ import annotations

import functools

import torch

from . import checks
from .formats import (
    E2M1_INV_MAX,
    E2M1_MAX,
    E2M1_SIGN,
    E2M1_SIGNED,
    E2M1_THRESHOLDS,
    E8M0_BIAS,
    E8M0_NAN,
    E8M0_TINY_AMAX,
    F32_MANT_BITS,
    MX_BLOCK,
)
from .operands import converts_in_kernel, fp32_operand

_ONE_SIXTH = torch.tensor(E2M1_INV_MAX, dtype=torch.float32)  # fp32(1/6), as the kernels hold it


@functools.lru_cache(maxsize=8)
def _code_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The e2m1 code of an fp32 y as a lookup on the int32 bits of y, made once per device
    (no host copy per call: CUDA graphs):

    (bounds int32 [17], code uint8 [18], pair uint8 [18, 18]): `bucketize(bits(y), bounds,
    right=True)` = the number of bounds <= bits(y) is a bucket b, `code[b]` the code of y,
    `pair[b_even, b_odd]` the packed byte of two elements. Non-negative fp32 (+0.0 .. +inf,
    then the NaNs) order as their bits; negative ones (-0.0 .. -inf, then the NaNs) as
    INT32_MIN + bits(|y|). So with Tb_c = bits(E2M1_THRESHOLDS[c]) the bounds are
    INT32_MIN + Tb_0..6 (buckets 0..7: negative, magnitude code b), INT32_MIN + 0x7F800001
    (bucket 8: negative NaN), 0 (buckets 9..16: +0.0 and up, magnitude b - 9), Tb_0..6 and
    0x7F800001 (bucket 17: NaN). `Tb_c <= bits(|y|)` iff `E2M1_THRESHOLDS[c] <= |y|` (fp32
    order), so this is the count of thresholds <= |y|, sign in bit 3, NaN magnitude 0, as
    the spec's sum of comparisons (NUMERICS.md §4) says; one search replaces abs, nan_to_num,
    the fp32 search, signbit and the sign merge, and the pair table the packing."""
    tb = torch.tensor(E2M1_THRESHOLDS, dtype=torch.float32).view(torch.int32).tolist()
    lo, nan = -(1 << 31), 0x7F800001
    bounds = [lo + t for t in tb] + [lo + nan, 0] + tb + [nan]
    code = list(range(E2M1_SIGN, 2 * E2M1_SIGN)) + [E2M1_SIGN] + list(range(E2M1_SIGN)) + [0]
    code_t = torch.tensor(code, dtype=torch.uint8)
    n = len(code)
    pair = pack_nibbles(torch.stack((code_t[:, None].expand(n, n), code_t[None, :].expand(n, n)), -1))
    return (torch.tensor(bounds, dtype=torch.int32, device=device), code_t.to(device),
            pair.reshape(n, n).to(device))


def _code_buckets(y: torch.Tensor) -> torch.Tensor:
    """The bucket of `_code_tables` of every element of y (fp32 or narrower), int64."""
    y = y.float().contiguous()
    return torch.bucketize(y.view(torch.int32), _code_tables(y.device)[0], right=True)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).contiguous().view(torch.float32)


# --- scale rules: fp32 amax -> biased e8m0 (int32) ----------------------------------

def e8m0_ceil(amax: torch.Tensor) -> torch.Tensor:
    """aiter scaling mode 1 / vLLM CUDA: biased exponent of 2**ceil(log2(amax/6))."""
    ratio = torch.clamp_min(amax.float(), E8M0_TINY_AMAX) * _ONE_SIXTH     # a host scalar: no copy
    return (_bits(ratio) + 0x7FFFFF) >> F32_MANT_BITS


def e8m0_ocp_floor(amax: torch.Tensor) -> torch.Tensor:
    """OCP MX v1.0 (torchao FLOOR): floor(log2 amax) - 2, clamped to e8m0's range."""
    exp = ((_bits(amax.float()) >> F32_MANT_BITS) & 0xFF) - E8M0_BIAS
    return torch.clamp(exp - 2 + E8M0_BIAS, 0, 254)


def e8m0_even(amax: torch.Tensor) -> torch.Tensor:
    """aiter mode 0 / torchao EVEN: round amax to e2m1's 1 mantissa bit first, then floor."""
    rounded = (_bits(amax.float()) + (1 << (F32_MANT_BITS - 2))) & 0x7F800000  # exponent only
    return torch.clamp((rounded >> F32_MANT_BITS) - 2, 0, 254)


def e8m0_rceil(amax: torch.Tensor) -> torch.Tensor:
    """torchao RCEIL in eager mode: ceil(log2(amax / 6)) through float log2.
    Differs from `ceil` at some amax just above 6 * 2**k."""
    descale = amax.float() / E2M1_MAX
    exp = torch.clamp(torch.ceil(torch.log2(descale)), -E8M0_BIAS, E8M0_BIAS)
    return (exp + E8M0_BIAS).to(torch.int32)


SCALE_RULES = {
    "ceil": e8m0_ceil,            # production: aiter mode 1, vLLM
    "ocp-floor": e8m0_ocp_floor,  # OCP v1.0, torchao FLOOR
    "even": e8m0_even,            # aiter mode 0, torchao EVEN
    "rceil": e8m0_rceil,          # torchao RCEIL (float log2)
}


def scale_rule(name: str):
    return SCALE_RULES[checks.choice("scale_rule", name, tuple(SCALE_RULES))]


_rule = scale_rule   # quantize_mxfp4's keyword shadows the name


# --- elements --------------------------------------------------------------------

def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto {0,.5,1,1.5,2,3,4,6} (saturating), sign in bit 3: the
    magnitude code is the number of `E2M1_THRESHOLDS` at or below |y| (y fp32 or narrower;
    NaN: magnitude 0, the sign bit kept). Through `_code_tables`.
    Ties go to the even code: .25 -> 0, .75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4."""
    return _code_tables(y.device)[1][_code_buckets(y)]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """byte[b] = code[2b] | code[2b+1] << 4: the even element in the LOW nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def e8m0_to_float(e8m0: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """2**(e - 127) exactly (e = 0 is the fp32 subnormal 2**-127); 255 -> NaN."""
    e = e8m0.to(torch.int32)
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e - E8M0_BIAS).to(dtype)
    return torch.where(e == E8M0_NAN, torch.full_like(out, float("nan")), out)


_E2M1_LUT = torch.tensor(E2M1_SIGNED, dtype=torch.float64)


def e2m1_to_float(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return _E2M1_LUT.to(device=codes.device, dtype=dtype)[codes.long()]


# --- whole blocks ----------------------------------------------------------------

def _blocks(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., D] -> [..., D/32, 32] as an fp32 operand (`fp32_operand`: bf16 may stay bf16)."""
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"{name}: last dimension {x.shape[-1]} is not a multiple of {MX_BLOCK}")
    x = fp32_operand(x)
    return x.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)


def _block_amax(xb: torch.Tensor) -> torch.Tensor:
    """max |x| of each block, fp32 (exact): on a GPU one inf-norm reduction, which also takes
    bf16 to fp32 in the kernel; on the CPU, where that reduction is several times slower, abs
    then amax."""
    if converts_in_kernel(xb):
        return torch.linalg.vector_norm(xb, float("inf"), dim=-1, dtype=torch.float32)
    return xb.abs().amax(dim=-1).float()


def quantize_mxfp4(x: torch.Tensor, scale_rule: str = "ceil", *, name: str = "x", out=None):
    """x [..., D] (any float dtype, taken as fp32) -> (packed u8 [..., D/2], e8m0 u8 [..., D/32]).

    y = x * inv in fp32; the packed bytes come from the code buckets of y through the pair
    table (`_code_tables`): the same bytes as pack_nibbles(e2m1_codes(y)). `out`: a u8
    [..., D/2 + D/32] that receives the packed bytes then the scales (an entry's bytes; the
    two returned tensors are its parts), so no copy joins them."""
    xb = _blocks(x, name)
    e8m0 = _rule(scale_rule)(_block_amax(xb))
    inv = _from_bits((254 - e8m0) << F32_MANT_BITS)       # 2**(127 - e8m0), exact
    b = _code_buckets(xb * inv.unsqueeze(-1)).flatten(-2)
    pair = _code_tables(x.device)[2]
    if out is None:
        return pair[b[..., 0::2], b[..., 1::2]], e8m0.to(torch.uint8)
    packed, scales = out[..., :x.shape[-1] // 2], out[..., x.shape[-1] // 2:]
    torch.ops.aten.index.Tensor_out(pair, [b[..., 0::2], b[..., 1::2]], out=packed)
    return packed, scales.copy_(e8m0)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(packed u8 [..., D/2], e8m0 u8 [..., D/32]) -> values [..., D], exact in fp32 and fp64."""
    vals = e2m1_to_float(unpack_nibbles(packed), dtype)
    blocks = vals.reshape(*vals.shape[:-1], scales.shape[-1], MX_BLOCK)
    return (blocks * e8m0_to_float(scales, dtype).unsqueeze(-1)).flatten(-2)
