"""The FP8 baseline indexer, the default cache of 132 B per entry (NUMERICS.md §7).

K: one power-of-two scale per entry, pages `[page_size*D fp8][page_size fp32 scales]`,
token-major. Q: one scale per (token, head), folded into the head weights."""
from __future__ import annotations

import torch

from . import checks
from .formats import F32_MANT_BITS, FP8_AMAX_FLOOR, FP8_FLAVOURS, ROUNDING_PATHS
from .k_writer import check_k_writer_args, group_start, k_values, writer_mask
from .q_quant import check_q_args, check_scale_pair, q_values
from .rope import ROPE_MODES
from .scoring import check_paged_args, check_width, paged_logits


def fp8_flavour(name: str) -> tuple[torch.dtype, float]:
    checks.choice("fp8_dtype", name, tuple(FP8_FLAVOURS))
    dtype_name, fmax = FP8_FLAVOURS[name]
    return getattr(torch, dtype_name), fmax


def entry_bytes(head_dim: int) -> int:
    return head_dim + 4


def pow2_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """2**ceil(log2(max(amax, 1e-4) / fp8_max)), exponent taken from the fp32 bits."""
    ratio = torch.clamp_min(amax.float(), FP8_AMAX_FLOOR) / fp8_max
    e = (ratio.contiguous().view(torch.int32) + 0x7FFFFF) >> F32_MANT_BITS
    return (e << F32_MANT_BITS).view(torch.float32)


def quantize_fp8(x: torch.Tensor, fp8_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 bytes u8 [..., D], scale f32 [...]) with one scale per row."""
    dtype, fmax = fp8_flavour(fp8_dtype)
    s = pow2_scale(x.abs().amax(dim=-1), fmax)
    v = torch.clamp(x.float() / s.unsqueeze(-1), -fmax, fmax).to(dtype)
    return v.view(torch.uint8), s


def dequantize_fp8(v: torch.Tensor, fp8_dtype: str, out_dtype=torch.float64) -> torch.Tensor:
    dtype, _ = fp8_flavour(fp8_dtype)
    return v.view(dtype).to(out_dtype)


def fp8_slot_offsets(slots: torch.Tensor, page_size: int, head_dim: int, page_stride: int):
    page, t = slots.long() // page_size, slots.long() % page_size
    start = page * page_stride
    vals = (start + t * head_dim).unsqueeze(-1) + torch.arange(head_dim, device=slots.device)
    scales = (start + page_size * head_dim + t * 4).unsqueeze(-1) + torch.arange(4, device=slots.device)
    return vals, scales


def check_fp8_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache, norm_eps,
                       compress_ratio, page_size, fp8_dtype, rounding) -> None:
    """Every argument check of the FP8 K writer."""
    checks.choice("rounding", rounding, ROUNDING_PATHS)
    fp8_flavour(fp8_dtype)
    check_k_writer_args(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache, norm_eps,
                        compress_ratio, page_size, k_dtypes=checks.FLOAT_DTYPES, entry_bytes=entry_bytes)


def k_norm_rope_fp8_cache(*, k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                          norm_eps: float = 1e-6, compress_ratio: int = 4, page_size: int = 64,
                          fp8_dtype: str = "e4m3fn", rounding: str = "rocm",
                          hadamard: bool = False, rope: str = "separate") -> dict:
    check_fp8_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache, norm_eps,
                       compress_ratio, page_size, fp8_dtype, rounding)
    checks.choice("rope", rope, ROPE_MODES)
    sel = writer_mask(positions, slot_mapping, compress_ratio)
    y = k_values(k[sel], group_start(positions[sel], compress_ratio), cos_sin_cache, norm_weight,
                 norm_eps, rounding=rounding, hadamard=hadamard, rope=rope)
    v, s = quantize_fp8(y, fp8_dtype)
    out = kv_cache.clone()
    if v.shape[0]:
        vo, so = fp8_slot_offsets(slot_mapping[sel], page_size, k.shape[1], kv_cache.shape[1])
        flat = out.view(-1)
        flat[vo.flatten()] = v.reshape(-1)
        flat[so.flatten()] = s.contiguous().view(torch.uint8).reshape(-1)
    return {"kv_cache": out}


def q_rope_fp8_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                     fp8_dtype: str = "e4m3fn", hadamard: bool = False, rope: str = "separate",
                     softmax_scale: float | None = None, head_scale: float | None = None) -> dict:
    """`softmax_scale` and `head_scale` (both or neither): the weights are
    ((w * s_q) * softmax_scale) * head_scale, as vLLM's CUDA Q kernel multiplies them in turn."""
    check_q_args(q, positions, cos_sin_cache, weights, weights_scale)
    pair = check_scale_pair(weights_scale, softmax_scale, head_scale)
    checks.choice("rope", rope, ROPE_MODES)
    v, s = quantize_fp8(q_values(q, positions, cos_sin_cache, hadamard=hadamard, rope=rope), fp8_dtype)
    w = weights.float() * s
    for f in (pair or (weights_scale,)):
        w = w * torch.tensor(f, dtype=torch.float32, device=weights.device)
    return {"q_fp8": v, "weights": w}


def check_fp8_scorer(q_fp8, weights, kv_cache, query_start_loc, context_lens, block_table, row_ends,
                     page_size, fp8_dtype, width) -> int:
    """Every argument check of the FP8 scorer -> the logits width."""
    dims = checks.Dims()
    dims.check("q_fp8", q_fp8, torch.uint8, ("Rw", "H", "D"))
    fp8_flavour(fp8_dtype)
    check_paged_args(dims, weights, kv_cache, query_start_loc, context_lens, block_table, row_ends,
                     page_size, entry_bytes(q_fp8.shape[2]))
    checks.finite("q_fp8 (decoded)", dequantize_fp8(q_fp8, fp8_dtype))
    return check_width(width, block_table, page_size, row_ends)


def paged_fp8_mqa_logits_fp64(*, q_fp8, weights, kv_cache, query_start_loc, context_lens, block_table,
                               row_ends, page_size: int = 64, fp8_dtype: str = "e4m3fn",
                               width: int | None = None, **_unused) -> torch.Tensor:
    width = check_fp8_scorer(q_fp8, weights, kv_cache, query_start_loc, context_lens, block_table,
                             row_ends, page_size, fp8_dtype, width)
    d = q_fp8.shape[2]
    q = dequantize_fp8(q_fp8, fp8_dtype)

    def read_keys(slots):
        vo, so = fp8_slot_offsets(slots, page_size, d, kv_cache.shape[1])
        flat = kv_cache.reshape(-1)
        s = flat[so].contiguous().view(torch.float32).double()          # [n, 1]
        k = dequantize_fp8(flat[vo], fp8_dtype) * s
        checks.finite("kv_cache (entries read, decoded)", k)
        return k

    return paged_logits(q, weights, query_start_loc, block_table, row_ends, page_size, read_keys, width)


def paged_fp8_mqa_logits(*, clean_logits: bool = False, **kwargs) -> dict:
    return {"logits": paged_fp8_mqa_logits_fp64(**kwargs).float()}
