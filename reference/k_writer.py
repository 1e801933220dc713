"""The MXFP4 K writer, aiter's `k_norm_rope_mxfp4_cache` (NUMERICS.md §2).

For each boundary token with a slot: RMS-norm -> GPT-J RoPE on the last R dims at the
group's first position -> MXFP4 -> store at the slot in the page layout. Every byte the
op does not own keeps its previous value.
"""
from __future__ import annotations

import torch

from . import checks, layout, mxfp4
from . import hadamard as _hadamard
from .formats import ROUNDING_PATHS
from .operands import device_const, fp32_operand, widened
from .rope import ROPE_MODES, rope_rows


def writer_mask(positions: torch.Tensor, slot_mapping: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    """Tokens that write: slot >= 0 and (p + 1) % r == 0."""
    return (slot_mapping >= 0) & ((positions.long() + 1) % compress_ratio == 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, dtype=torch.float32) -> torch.Tensor:
    """(x * rsqrt(sum(x*x)/D + eps)) * fp32(w), in this order, fp32, the last product rounded
    to `dtype` (fp32: not rounded; bf16: bf16_round of the fp32 result).

    The spec leaves the summation order and the rsqrt's accuracy to the kernel; the
    reference pins both so that it gives the same bits on every device: the squares are
    exact in fp64 and summed there, the sum rounded to fp32, and rsqrt is correctly rounded
    (via fp64). A kernel's fp32 tree sum and approximate rsqrt differ from this by an ulp or
    two in fp32, which the bf16 round after the norm hides almost always.
    Each op computes in its inputs' dtype and rounds on the store, so there are no separate
    casts: the squares are 0 + x*x in fp64 (one addcmul with an fp64 zero, which on a GPU
    takes bf16 x to fp64 in the kernel; exact, so whether a kernel fuses it changes nothing);
    `eps + sum / D` is one fp32 op (addcdiv: an IEEE divide, then an add; with a tensor
    divisor, so a GPU divides rather than multiplying by 1/D) stored as fp64 (exact) for the
    rsqrt, whose fp64 result is stored as fp32 (rounded to nearest, as `.float()`)."""
    x = fp32_operand(x)
    eps32 = device_const(float(eps), torch.float32, x.device)
    d32 = device_const(float(x.shape[-1]), torch.float32, x.device)
    zero64 = device_const(0.0, torch.float64, x.device)
    x64 = widened(x, torch.float64)
    s = torch.addcmul(zero64, x64, x64).sum(dim=-1, keepdim=True).float()
    v = torch.addcdiv(eps32, s, d32, out=torch.empty_like(s, dtype=torch.float64))
    rstd = torch.rsqrt(v, out=torch.empty_like(s))
    return torch.mul(x * rstd, fp32_operand(weight), out=torch.empty(x.shape, dtype=dtype, device=x.device))


def group_start(positions: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    """The position RoPE uses for a compressed key: the group's first token."""
    return (positions.long() // compress_ratio) * compress_ratio


def k_values(k: torch.Tensor, rope_pos: torch.Tensor, cos_sin_cache: torch.Tensor,
             norm_weight: torch.Tensor, norm_eps: float, *, rounding: str = "rocm",
             hadamard: bool = False, rope: str = "separate") -> torch.Tensor:
    """Pooled rows [N, D] -> the values the writer quantizes (fp32 holding bf16 values).

    rocm:     bf16 pooled row; bf16 after the norm; bf16 after RoPE; NoPE pairs go
              through the RoPE formula with cos=1, sin=0 (as aiter's kernel does).
    cuda:     fp32 through norm and RoPE, NoPE pairs through the formula with cos=1, sin=0
              (vLLM's fused CUDA kernels load cos/sin with other=1.0/0.0 for them), one
              bf16 round of all D values at the end.
    deepseek: bf16 before and after the norm, RoPE rounded, NoPE untouched.
    `rope`: how the rotation rounds (reference.rope.ROPE_MODES).
    """
    return _k_values(k, cos_sin_cache, rope_pos, norm_weight, norm_eps, rounding=rounding,
                     hadamard=hadamard, rope=rope).float()


def _k_values(k, cache, rows, norm_weight, norm_eps, *, rounding, hadamard, rope) -> torch.Tensor:
    """k_values with the cos/sin of cache row `rows`, as a bf16 tensor (fp32 after the
    Hadamard rotation)."""
    checks.choice("rope", rope, ROPE_MODES)
    x = fp32_operand(k)
    if rounding == "cuda":
        y = rope_rows(rms_norm(x, norm_weight, norm_eps), cache, rows, nope_through_formula=True, rope=rope)
    else:
        if rounding == "deepseek":
            x = x.to(torch.bfloat16)                  # bf16_round; a no-op for bf16 rows
        n = rms_norm(x, norm_weight, norm_eps, dtype=torch.bfloat16)
        y = rope_rows(n, cache, rows, nope_through_formula=(rounding == "rocm"), rope=rope)
    return _hadamard.rotate(y) if hadamard else y


def check_k_writer_args(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                        norm_eps, compress_ratio, page_size, *, k_dtypes, entry_bytes) -> checks.Dims:
    dims = checks.Dims()
    dims.check("k", k, k_dtypes, ("T", "D"))
    dims.check("positions", positions, checks.INT_DTYPES, ("T",))
    dims.check("slot_mapping", slot_mapping, checks.INT_DTYPES, ("T",))
    dims.check("cos_sin_cache", cos_sin_cache, torch.float32, ("max_pos", "R"))
    dims.check("norm_weight", norm_weight, checks.FLOAT_DTYPES, ("D",))
    dims.check("kv_cache", kv_cache, torch.uint8, ("P", "page_bytes"))
    d, _ = checks.head_and_rope_dims("k", k, cos_sin_cache)
    checks.positive_finite("norm_eps", norm_eps)
    checks.scalar("compress_ratio", compress_ratio, positive=True)
    checks.scalar("page_size", page_size, positive=True)
    need = page_size * entry_bytes(d)
    if kv_cache.shape[1] < need:
        raise ValueError(f"kv_cache: page stride {kv_cache.shape[1]} is below the {need} bytes "
                         f"of {page_size} entries")
    checks.int_range("slot_mapping", slot_mapping, 0, kv_cache.shape[0] * page_size, allow_negative=True)
    sel = writer_mask(positions, slot_mapping, compress_ratio)
    rope_pos = group_start(positions[sel], compress_ratio)
    checks.int_range("positions", rope_pos, 0, cos_sin_cache.shape[0])
    checks.finite("k", k[sel])
    checks.finite("norm_weight", norm_weight)
    checks.finite("cos_sin_cache (rows used)", cos_sin_cache[rope_pos])
    return dims


def check_mxfp4_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache, norm_eps,
                         compress_ratio, page_size, shuffle, rounding) -> "layout.Shuffle | None":
    """Every argument check of the MXFP4 K writer; returns the parsed shuffle."""
    shuffle = layout.as_shuffle(shuffle)
    checks.choice("rounding", rounding, ROUNDING_PATHS)
    check_k_writer_args(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                        norm_eps, compress_ratio, page_size,
                        k_dtypes=(torch.bfloat16,) if rounding != "cuda" else checks.FLOAT_DTYPES,
                        entry_bytes=layout.entry_bytes)
    layout.check_layout(page_size, k.shape[1], shuffle)
    return shuffle


def k_norm_rope_mxfp4_cache(*, k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                            norm_eps: float = 1e-6, compress_ratio: int = 4, page_size: int = 64,
                            shuffle=(32, 16, 2), rounding: str = "rocm", hadamard: bool = False,
                            scale_rule: str = "ceil", rope: str = "separate") -> dict:
    shuffle = check_mxfp4_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                   norm_eps, compress_ratio, page_size, shuffle, rounding)
    checks.choice("rope", rope, ROPE_MODES)
    mxfp4.scale_rule(scale_rule)
    rows = writer_mask(positions, slot_mapping, compress_ratio).nonzero().flatten()
    return {"kv_cache": write_rows(k[rows], positions[rows], slot_mapping[rows], cos_sin_cache, norm_weight,
                                   kv_cache, norm_eps=norm_eps, compress_ratio=compress_ratio,
                                   page_size=page_size, shuffle=shuffle, rounding=rounding,
                                   hadamard=hadamard, scale_rule=scale_rule, rope=rope)}


def write_rows(k, positions, slots, cos_sin_cache, norm_weight, kv_cache, *, norm_eps, compress_ratio,
               page_size, shuffle, rounding="rocm", hadamard=False, scale_rule="ceil",
               rope="separate") -> torch.Tensor:
    """The writer's work on the tokens that write (rows already selected, arguments already
    checked): norm, RoPE, MXFP4, store -> the pool after the call. No host sync: on a GPU
    a CUDA graph can replay it."""
    # cos_sin_cache[::r][p // r] is the cache row of group_start(p) = (p // r) * r (a strided
    # view: one integer op fewer)
    y = _k_values(k, cos_sin_cache[::compress_ratio], positions.long() // compress_ratio, norm_weight,
                  norm_eps, rounding=rounding, hadamard=hadamard, rope=rope)
    d = y.shape[-1]
    entries = torch.empty(*y.shape[:-1], layout.entry_bytes(d), dtype=torch.uint8, device=y.device)
    mxfp4.quantize_mxfp4(y, scale_rule, out=entries)
    return layout.write_entry_bytes(kv_cache, slots, entries, page_size=page_size, head_dim=d, shuffle=shuffle)
