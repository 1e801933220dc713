"""RoPE as the indexer applies it (NUMERICS.md §2, §3): GPT-J interleaved pairs on the
LAST `rope_dim` dims, cos/sin from a `[max_pos, R]` cache laid out `[cos R/2 | sin R/2]`."""
from __future__ import annotations

import functools
import math

import torch

from . import operands
from .operands import fp32_operand


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """bf16(x): round fp32 to bfloat16 nearest-even, back to fp32."""
    return x.to(torch.bfloat16).float()


def inv_freq(rope_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))


def yarn_inv_freq(rope_dim: int, base: float, factor: float, original_max_pos: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """DeepSeek's YaRN: long wavelengths divided by `factor`, short ones kept, a linear
    ramp between the correction dims of beta_fast and beta_slow rotations."""
    freqs = inv_freq(rope_dim, base)

    def corr_dim(rotations: float) -> float:
        return rope_dim * math.log(original_max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return freqs / factor * (1 - keep) + freqs * keep


def cos_sin_cache(max_pos: int, rope_dim: int, base: float = 10000.0, *,
                  yarn_factor: float | None = None, yarn_original_max_pos: int = 65536) -> torch.Tensor:
    """f32 [max_pos, R] = [cos R/2 | sin R/2]; YaRN when `yarn_factor` is given."""
    f = (yarn_inv_freq(rope_dim, base, yarn_factor, yarn_original_max_pos)
         if yarn_factor else inv_freq(rope_dim, base))
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64), f)
    return torch.cat((ang.cos(), ang.sin()), dim=-1).float()


def cos_sin_at(cache: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = cache.shape[-1] // 2
    rows = cache[pos.long()]
    return rows[..., :half], rows[..., half:]


# How the rotation's two products and one sum are rounded (NUMERICS.md §2). Compiled with fp
# fusion on (Triton's default, and vLLM's launchers ask for it), LLVM contracts `a*b - c*d`
# and `a*b + c*d` into one multiply and one FMA, and which product it keeps unrounded depends
# on the kernel (read from the PTX of vLLM 0.33.0's kernels, sm_90):
#   separate  e' = (e*cos) - (o*sin), o' = (o*cos) + (e*sin): three fp32 roundings each (mxval's
#             pin; every kernel in the Triton interpreter; compiled with fp fusion off)
#   fma-oc    e' = fma(e, cos, -(o*sin)), o' = fma(o, cos, e*sin): vLLM's fused K kernels (MXFP4
#             and FP8); also what vLLM's ROCm Q kernel writes out with tl.fma
#   fma-es    e' = fma(e, cos, -(o*sin)), o' = fma(e, sin, o*cos): vLLM's CUDA Q kernels (MXFP4
#             and FP8)
ROPE_MODES = ("separate", "fma-oc", "fma-es")


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add, correctly rounded: round(a*b + c) once.

    a*b is exact in fp64 (48 significant bits); the fp64 sum is rounded to odd (its error,
    from TwoSum, pushes an inexact result to the neighbour with an odd last bit), and a
    round-to-odd fp64 result rounds to fp32 exactly as the infinitely precise value would."""
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    even = (s.view(torch.int64) & 1) == 0
    fix = (err != 0) & even & torch.isfinite(s)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where(fix, torch.nextafter(s, toward), s)
    return s.float()


def rotate_pairs(e: torch.Tensor, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 rope: str = "separate") -> tuple[torch.Tensor, torch.Tensor]:
    """(e', o') of GPT-J pairs in fp32, rounded as `rope` says (ROPE_MODES)."""
    if rope == "separate":
        return e * cos - o * sin, o * cos + e * sin
    if rope == "fma-oc":
        return fma32(e, cos, -(o * sin)), fma32(o, cos, e * sin)
    if rope == "fma-es":
        return fma32(e, cos, -(o * sin)), fma32(e, sin, o * cos)
    raise ValueError(f"rope: expected one of {', '.join(ROPE_MODES)}, got {rope!r}")


def rope_gptj_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                   round_bf16: bool = True, nope_through_formula: bool = True,
                   rope: str = "separate") -> torch.Tensor:
    """Rotate pairs (x[2m], x[2m+1]) of the last 2*cos.shape[-1] dims of x ([..., D] fp32).

    `cos`/`sin` are [..., R/2] (broadcast over any head dim by the caller).
    e' = e*cos - o*sin, o' = o*cos + e*sin (rounded as `rope` says), each rounded to bf16
    when `round_bf16`. With `nope_through_formula` the NoPE pairs go through the same formula
    with cos = 1, sin = 0 (aiter's K writer and vLLM's CUDA K kernels do, and that can turn
    -0.0 into +0.0)."""
    d, half = x.shape[-1], cos.shape[-1]
    nope = d - 2 * half
    pairs = x.reshape(*x.shape[:-1], d // 2, 2)
    if nope_through_formula:
        c = torch.nn.functional.pad(cos, (nope // 2, 0), value=1.0)
        s = torch.nn.functional.pad(sin, (nope // 2, 0), value=0.0)
        e, o = pairs[..., 0], pairs[..., 1]
        out = torch.stack(rotate_pairs(e, o, c, s, rope), -1).flatten(-2)
        return bf16_round(out) if round_bf16 else out
    e, o = pairs[..., nope // 2:, 0], pairs[..., nope // 2:, 1]
    rot = torch.stack(rotate_pairs(e, o, cos, sin, rope), -1).flatten(-2)
    if round_bf16:
        rot = bf16_round(rot)
    return torch.cat((x[..., :nope], rot), -1)


# --- the rotation as the writers run it: tables per pair, each output rounded once ----------

@functools.lru_cache(maxsize=32)
def _pair_columns(pairs: int, half: int, device: torch.device):
    """For a row of `pairs` GPT-J pairs whose last `half` are rotated: the cache columns of
    each pair's cos and sin ([2, pairs]; a NoPE pair reads column 0 / half, replaced after),
    the NoPE pairs (bool [pairs]) and their (cos, sin) = (1, 0) ([2, 1]). Made once per
    device, on the device (no host copy: CUDA graphs)."""
    j = torch.arange(pairs, device=device) - (pairs - half)
    jc = j.clamp_min(0)
    fill = torch.ones(2, 1, device=device)
    fill[1] = 0.0
    return torch.stack((jc, jc + half)), j < 0, fill


def cos_sin_pairs(cache: torch.Tensor, rows: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., pairs] for every pair of a row of 2 * pairs dims at cache rows `rows`
    ([...]): the cache's for the last R/2 pairs, cos = 1 and sin = 0 for the NoPE pairs before
    them (cos_sin_at padded as rope_gptj_tail pads it): one gather and one select."""
    cols, nope, fill = _pair_columns(pairs, cache.shape[-1] // 2, rows.device)
    t = cache[rows.long()[..., None, None], cols]                      # [..., 2, pairs]
    if pairs > cache.shape[-1] // 2:
        t = torch.where(nope, fill, t)
    return t[..., 0, :], t[..., 1, :]


def rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rope: str = "separate") -> torch.Tensor:
    """out[..., 0::2], out[..., 1::2] = rotate_pairs(x[..., 0::2], x[..., 1::2], cos, sin, rope),
    each fp32 result rounded once to out's dtype (bf16: bf16_round).

    x fp32 or an fp32 operand (`fp32_operand`). `separate`: each
    line is two fp32 products and one fp32 sum or difference computed into out, so the
    rounding to out's dtype is the store's (round to nearest even, as `.to()`), no copy."""
    e, o = x[..., 0::2], x[..., 1::2]
    if rope == "separate":
        torch.sub(e * cos, o * sin, out=out[..., 0::2])
        torch.add(o * cos, e * sin, out=out[..., 1::2])
    else:
        a, b = rotate_pairs(e.float(), o.float(), cos, sin, rope)
        out[..., 0::2], out[..., 1::2] = a, b
    return out


@functools.lru_cache(maxsize=32)
def _rotation_tables(d: int, half: int, through: bool, device: torch.device):
    """For rows of d dims whose rotated part is the last L = 2 * half dims, or all d with
    `through` (the NoPE pairs before the last `half` through the formula with cos 1, sin 0),
    made once per device, on the device: the columns of x to gather ([d + L]: all of x, then the rotated dims
    pair-swapped: o, e per pair), the cache columns of (cos, cos per pair | sin, sin per pair)
    ([2L]), where the NoPE pairs' values go (bool [2L]) and those values (1 | 0), and the sign
    of the second products ([L]: -1 on even dims, +1 on odd). Each pair's entries are
    `_pair_columns`' for the pairs from `start`, given to both of its dims."""
    start = 0 if through else d - 2 * half
    length = d - start
    cols, nope, fill = _pair_columns(length // 2, half, device)
    swapped = start + (torch.arange(length, device=device) ^ 1)
    sign = (torch.arange(length, device=device) % 2) * 2.0 - 1.0
    return (torch.cat((torch.arange(d, device=device), swapped)), cols.repeat_interleave(2, dim=1).flatten(),
            nope.repeat_interleave(2).repeat(2), fill.expand(2, length).flatten(), sign)


def rope_rows(x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, *, nope_through_formula: bool,
              rope: str = "separate", dtype=torch.bfloat16) -> torch.Tensor:
    """rope_gptj_tail(x.float(), *cos_sin_at(cache, rows)) (cos/sin broadcast over the dims
    of x between rows' and the last), each value rounded once to `dtype`: the same values as
    bf16_round(rope_gptj_tail(..., round_bf16=False)) or rope_gptj_tail(..., round_bf16=True),
    as a `dtype` tensor (on a GPU possibly a view into longer rows). x fp32 or narrower;
    NoPE dims not through the formula are copied (x must then hold `dtype` values there).

    `separate` on a GPU: with x's rotated dims gathered next to themselves pair-swapped (g)
    and a table t of (cos, cos | sin, sin) per pair, one product pq = g * t gives (e*cos,
    o*cos | o*sin, e*sin), and e' = e*cos - o*sin, o' = o*cos + e*sin are one addcmul
    pq[:L] + pq[L:] * (-1, +1) stored in `dtype`: the product by -1 or +1 is exact, so each
    output is the fp32 sum of the two rounded products, rounded once on the store, whether or
    not a kernel fuses the multiply-add; the rounding of `rotate_pairs`. On the CPU, where
    the gather costs more than the ops it saves, and for the FMA modes: `rotate_into`."""
    d, half = x.shape[-1], cache.shape[-1] // 2
    bcast = (1,) * (x.dim() - rows.dim() - 1)
    if rope != "separate" or not operands.converts_in_kernel(x):
        return _rope_rows_pairs(x, cache, rows, nope_through_formula=nope_through_formula, rope=rope,
                                dtype=dtype, bcast=bcast)
    start = 0 if nope_through_formula else d - 2 * half
    gather, cols, nope, fill, sign = _rotation_tables(d, half, nope_through_formula, rows.device)
    g = x[..., gather]
    t = cache[rows.long()[..., None], cols]
    if nope_through_formula and d > 2 * half:
        t = torch.where(nope, fill, t)
    pq = fp32_operand(g[..., start:]) * t.reshape(*rows.shape, *bcast, t.shape[-1])
    if g.dtype == dtype:
        out = g[..., :d]                       # x's NoPE dims already in place
    else:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
        if start:
            out[..., :start] = x[..., :start]
    torch.addcmul(pq[..., :d - start], pq[..., d - start:], sign, out=out[..., start:])
    return out


def _rope_rows_pairs(x, cache, rows, *, nope_through_formula, rope, dtype, bcast) -> torch.Tensor:
    """rope_rows through `rotate_into` (the even and odd dims as strided views)."""
    d, half = x.shape[-1], cache.shape[-1] // 2
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    x = fp32_operand(x)
    if nope_through_formula:
        c, s = cos_sin_pairs(cache, rows, d // 2)
        shape = (*rows.shape, *bcast, d // 2)
        return rotate_into(out, x, c.reshape(shape), s.reshape(shape), rope)
    nope = d - 2 * half
    cs = cache[rows.long()].reshape(*rows.shape, *bcast, 2 * half)
    out[..., :nope] = x[..., :nope]
    rotate_into(out[..., nope:], x[..., nope:], cs[..., :half], cs[..., half:], rope)
    return out
