"""MXFP4 encode/decode (NUMERICS.md §4): e2m1 elements, one e8m0 scale per 32.

The production rule is aiter "scaling mode 1" (`ceil`): the scale is the smallest power
of two with amax / scale <= 6, computed from the fp32 bits so that it agrees with the
kernels at every amax (a float ceil(log2()) disagrees just above 6 * 2**k).
The other rules are offered for studies and named for where they come from.
"""
from __future__ import annotations

import functools
import math

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


def _block_amax(xb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """max |x| of each block into `out` (fp32, exact): on a GPU one inf-norm reduction, which
    also takes bf16 to fp32 in the kernel; on the CPU, where that reduction is several times
    slower, abs then amax (xb is fp32 there: `fp32_operand`)."""
    if converts_in_kernel(xb):
        return torch.linalg.vector_norm(xb, float("inf"), dim=-1, dtype=torch.float32, out=out)
    return torch.amax(xb.abs(), dim=-1, out=out)


# The entry bytes come from one lookup in a table whose rows are indexed by the code bucket of
# an odd element (rows 0..17) or by a block's scale row (rows 18..), and whose columns by the
# code bucket of the even element: row r < 18 holds pair[:, r], a scale row its scale byte in
# every column.
_SCALE_ROW0 = 18


def _entry_table(device: torch.device, row_bytes: tuple[int, ...]) -> torch.Tensor:
    """u8 [18 + len(row_bytes), 18]: the pair table transposed, then one row per scale row."""
    pair = _code_tables(torch.device("cpu"))[2]
    n = pair.shape[0]
    rows = torch.tensor(row_bytes, dtype=torch.uint8)[:, None].expand(len(row_bytes), n)
    return torch.cat((pair.t(), rows)).to(device)


@functools.lru_cache(maxsize=8)
def _byte_rows(device: torch.device) -> torch.Tensor:
    """The entry table whose scale row 18 + v holds the byte v (v = e8m0 & 0xFF)."""
    return _entry_table(device, tuple(range(256)))


@functools.lru_cache(maxsize=1)
def _ceil_steps() -> tuple[list[int], list[int]]:
    """The ceil rule as a step function of the int32 bits of amax: (bounds, e) with e8m0_ceil
    = e[j] on the bits from bounds[j - 1] (inclusive) to bounds[j], e[0] below bounds[0].
    Over +0.0 .. +inf the rule is non-decreasing in the bits (the clamp, the fp32 product and
    the exponent are), so each step's first bits are found by a binary search against
    e8m0_ceil itself; then -0.0 .. -inf (e of the tiny clamp), the negative NaNs, and the
    positive NaNs (bits above +inf) are steps of their own. Each step's e is e8m0_ceil at its
    first bits, checked at its last."""
    def e_of(bits):
        return e8m0_ceil(torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32))

    inf, neg_nan = 0x7F800000, 0x7F800001 - (1 << 31)   # bits(+inf); bits(-inf) + 1 as int32
    ks = torch.arange(int(e_of([0])) + 1, int(e_of([inf])) + 1)
    lo, hi = torch.zeros_like(ks), torch.full_like(ks, inf)
    while bool((lo < hi).any()):
        mid = (lo + hi) // 2
        up = e_of(mid) >= ks
        lo, hi = torch.where(up, lo, mid + 1), torch.where(up, mid, hi)
    bounds = [neg_nan, 0] + sorted(set(lo.tolist())) + [inf + 1]   # no empty steps (254: none)
    firsts = [-(1 << 31)] + bounds
    lasts = [b - 1 for b in bounds] + [(1 << 31) - 1]
    e, e_last = e_of(firsts).tolist(), e_of(lasts).tolist()
    if e != e_last or sorted(set(bounds)) != bounds:
        raise AssertionError("e8m0_ceil is not a step function of the amax bits")
    return bounds, e


@functools.lru_cache(maxsize=8)
def _ceil_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ceil rule by lookup, made once per device: (bounds int32, inv fp32, entry table u8).
    `bucketize(bits(amax), bounds, right=True)` is the block's scale row (18 + its step: the
    bounds start with 18 INT32_MINs), `inv[row]` is 2**(127 - e8m0) as the arithmetic
    `_from_bits((254 - e8m0) << 23)` gives it, and the table's scale row the byte e8m0 & 0xFF
    (e8m0.to(uint8)); the same values as e8m0_ceil on every amax."""
    bounds, e = _ceil_steps()
    e_t = torch.tensor(e, dtype=torch.int32)
    inv = torch.cat((torch.zeros(_SCALE_ROW0), _from_bits((254 - e_t) << F32_MANT_BITS)))
    bounds_t = torch.tensor([-(1 << 31)] * _SCALE_ROW0 + bounds, dtype=torch.int32)
    return bounds_t.to(device), inv.to(device), _entry_table(device, tuple(e_t.to(torch.uint8).tolist()))


def _stored(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view t, or its transpose: whichever is contiguous (an elementwise op or a search
    gives the same values either way, and with a non-contiguous result or input bucketize
    copies)."""
    return t if t.is_contiguous() else t.t()


QUANT_MIN_ROWS = 1 << 16       # a GPU quantize's rows per block, at least (fewer ops cost more than they save)


def quantize_mxfp4(x: torch.Tensor, scale_rule: str = "ceil", *, name: str = "x", out=None):
    """x [..., D] (any float dtype, taken as fp32) -> (packed u8 [..., D/2], e8m0 u8 [..., D/32]).

    y = x * inv in fp32 (inv = 2**(127 - e8m0), exact); the packed bytes are pair[b_even, b_odd]
    over the code buckets b of y (`_code_tables`): the same bytes as
    pack_nibbles(e2m1_codes(y)). `out`: a u8 [..., D/2 + D/32] that receives the packed bytes
    then the scales (an entry's bytes; the two returned tensors are its parts).

    y holds a row's even elements, then its odd ones (one strided store), so that the
    buckets of each are a block of columns. On a GPU the steps are laid out for one op each
    (`_quantize_element_major`); on the CPU, where element-major stores and small lookups
    cost more than the ops they save, the rows stay row-major, the scale is the rule's
    arithmetic and the scale bytes a copy."""
    xb = _blocks(x, name)
    lead, nb = xb.shape[:-2], xb.shape[-2]
    half, m, dev = nb * MX_BLOCK // 2, math.prod(lead), x.device
    xb = xb.reshape(m, nb, MX_BLOCK)
    if converts_in_kernel(xb):
        step = max(QUANT_MIN_ROWS, -(-m * x.element_size() // 12))
        if m <= step:
            return _quantize_element_major(xb, lead, scale_rule, out)
        # in blocks of rows (each row is quantized on its own: the same bytes), so that the
        # int64 buckets and fp32 values (~12 bytes an element) take no more than x does
        buf = out if out is not None else torch.empty(*lead, half + nb, dtype=torch.uint8, device=dev)
        rows = buf.view(m, half + nb)
        for r0 in range(0, m, step):
            _quantize_element_major(xb[r0:r0 + step], (min(step, m - r0),), scale_rule, rows[r0:r0 + step])
        if out is not None:
            return out[..., :half], out[..., half:]
        return buf[..., :half].contiguous(), buf[..., half:].contiguous()
    amax = _block_amax(xb, out=torch.empty(m, nb, dtype=torch.float32, device=dev))
    e8m0 = _rule(scale_rule)(amax)
    inv = _from_bits((254 - e8m0) << F32_MANT_BITS)       # 2**(127 - e8m0), exact
    y = _evens_then_odds(xb, inv, torch.empty(m, 2 * half, dtype=torch.float32, device=dev))
    b = torch.bucketize(y.view(torch.int32), _code_tables(dev)[0], right=True)
    if out is None:
        packed = torch.empty(*lead, half, dtype=torch.uint8, device=dev)
        scales = e8m0.to(torch.uint8).view(*lead, nb)
    else:
        packed, scales = out[..., :half], out[..., half:]
        scales.view(m, nb).copy_(e8m0)
    torch.ops.aten.index.Tensor_out(_code_tables(dev)[2], [b[:, :half], b[:, half:]], out=packed.view(m, half))
    return packed, scales


def _evens_then_odds(xb: torch.Tensor, inv: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y [M, D] (any 2-D layout) = xb [M, D/32, 32] * inv [M, D/32] in fp32, row n holding
    element 2j + p of xb's row n at column p * D/2 + j."""
    m, nb = xb.shape[:2]
    torch.mul(xb.view(m, nb, MX_BLOCK // 2, 2), inv[..., None, None],
              out=y.view(m, 2, nb, MX_BLOCK // 2).permute(0, 2, 3, 1))
    return y


def _quantize_element_major(xb: torch.Tensor, lead, scale_rule: str, out):
    """quantize_mxfp4 on a GPU, one op a step: amax, y and the buckets are stored element-major
    ([rows, M] for the M rows of x: `_stored`), the code buckets (evens, then odds) and each
    block's scale row in one int64 buffer, and one lookup in `_entry_table` with (the odd
    buckets, then the scale rows) against (the even buckets, then any code buckets) gives
    whole entries. With the ceil rule the scale row and inv are lookups on the amax bits
    (`_ceil_tables`); with the others, the rule's arithmetic."""
    m, nb = xb.shape[:2]
    half, dev = nb * MX_BLOCK // 2, xb.device
    amax = _block_amax(xb, out=torch.empty(nb, m, dtype=torch.float32, device=dev).t())
    rows = torch.empty(2 * half + nb, m, dtype=torch.int64, device=dev).t()
    srow = rows[:, 2 * half:]
    if _rule(scale_rule) is e8m0_ceil:
        bounds, inv, table = _ceil_tables(dev)
        torch.bucketize(_stored(amax).view(torch.int32), bounds, right=True, out=_stored(srow))
        inv = inv[srow]
    else:
        e8m0 = _rule(scale_rule)(amax)
        torch.add(e8m0 & 0xFF, _SCALE_ROW0, out=srow)
        inv, table = _from_bits((254 - e8m0) << F32_MANT_BITS), _byte_rows(dev)
    y = _evens_then_odds(xb, inv, torch.empty(2 * half, m, dtype=torch.float32, device=dev).t())
    torch.bucketize(_stored(y).view(torch.int32), _code_tables(dev)[0], right=True, out=_stored(rows[:, :2 * half]))
    odd, even = rows[:, half:], rows[:, :half + nb]      # odds, scale rows | evens, any codes
    if out is not None:
        torch.ops.aten.index.Tensor_out(table, [odd, even], out=out.view(m, half + nb))
        return out[..., :half], out[..., half:]
    parts = (torch.empty(*lead, half, dtype=torch.uint8, device=dev),   # tensors of their own: a
             torch.empty(*lead, nb, dtype=torch.uint8, device=dev))     # lookup's result would take
    for part, c in zip(parts, (slice(None, half), slice(half, None))):  # the buckets' layout
        torch.ops.aten.index.Tensor_out(table, [odd[:, c], even[:, c]], out=part.view(m, part.shape[-1]))
    return parts


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(packed u8 [..., D/2], e8m0 u8 [..., D/32]) -> values [..., D], exact in fp32 and fp64."""
    vals = e2m1_to_float(unpack_nibbles(packed), dtype)
    blocks = vals.reshape(*vals.shape[:-1], scales.shape[-1], MX_BLOCK)
    return (blocks * e8m0_to_float(scales, dtype).unsqueeze(-1)).flatten(-2)
