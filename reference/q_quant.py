"""The MXFP4 Q quant, aiter's `q_rope_mxfp4_quant`, and the folded head weights (§3)."""
from __future__ import annotations

import torch

from . import checks, mxfp4
from . import hadamard as _hadamard
from .operands import fp32_factor, fp32_operand
from .rope import ROPE_MODES, rope_rows

SCALE_PAIR_RTOL = 1e-6


def q_values(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *,
             hadamard: bool = False, rope: str = "separate") -> torch.Tensor:
    """q [T, H, D] bf16 -> RoPE at each token's own position, rotated values through bf16,
    NoPE dims untouched (signed zeros kept). fp32 holding bf16 values."""
    return _q_values(q, positions, cos_sin_cache, hadamard=hadamard, rope=rope).float()


def _q_values(q, positions, cos_sin_cache, *, hadamard, rope) -> torch.Tensor:
    """q_values as a bf16 tensor (fp32 after the Hadamard rotation)."""
    y = rope_rows(q, cos_sin_cache, positions, nope_through_formula=False, rope=rope)
    return _hadamard.rotate(y) if hadamard else y


def check_scale_pair(weights_scale, softmax_scale, head_scale):
    """None, or the pair (softmax_scale, head_scale) the CUDA Q kernels multiply by in turn;
    both or neither, finite, and their product equal to `weights_scale` (rel 1e-6)."""
    if softmax_scale is None and head_scale is None:
        return None
    if softmax_scale is None or head_scale is None:
        raise ValueError("softmax_scale, head_scale: give both (the CUDA Q kernels' pair) or neither")
    for name, v in (("softmax_scale", softmax_scale), ("head_scale", head_scale)):
        checks.positive_finite(name, v)
    prod = float(softmax_scale) * float(head_scale)
    if abs(prod - float(weights_scale)) > SCALE_PAIR_RTOL * max(abs(prod), abs(float(weights_scale))):
        raise ValueError(f"softmax_scale * head_scale = {prod!r} differs from weights_scale = "
                         f"{float(weights_scale)!r}")
    return (float(softmax_scale), float(head_scale))


def fold_weights(weights: torch.Tensor, weights_scale: float, pair=None) -> torch.Tensor:
    """fp32(weights) * fp32(weights_scale): one multiply; no q scale in the MXFP4 path.
    With `pair` = (softmax_scale, head_scale): (fp32(w) * fp32(softmax_scale)) * fp32(head_scale),
    the order of vLLM's CUDA Q kernel. The first product takes bf16 weights to fp32
    (`fp32_operand`, `fp32_factor`)."""
    w = fp32_operand(weights)
    for f in (pair or (weights_scale,)):
        w = w * fp32_factor(f, w)
    return w


def check_q_args(q, positions, cos_sin_cache, weights, weights_scale) -> None:
    dims = checks.Dims()
    dims.check("q", q, torch.bfloat16, ("T", "H", "D"))
    dims.check("positions", positions, checks.INT_DTYPES, ("T",))
    dims.check("cos_sin_cache", cos_sin_cache, torch.float32, ("max_pos", "R"))
    dims.check("weights", weights, checks.FLOAT_DTYPES, ("T", "H"))
    checks.head_and_rope_dims("q", q, cos_sin_cache)
    checks.positive_finite("weights_scale", weights_scale)
    checks.int_range("positions", positions, 0, cos_sin_cache.shape[0])
    checks.finite("q", q)
    checks.finite("weights", weights)
    checks.finite("cos_sin_cache (rows used)", cos_sin_cache[positions.long()])


def q_rope_mxfp4_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                       hadamard: bool = False, scale_rule: str = "ceil", rope: str = "separate",
                       softmax_scale: float | None = None, head_scale: float | None = None) -> dict:
    check_q_args(q, positions, cos_sin_cache, weights, weights_scale)
    pair = check_scale_pair(weights_scale, softmax_scale, head_scale)
    checks.choice("rope", rope, ROPE_MODES)
    mxfp4.scale_rule(scale_rule)
    return quantize_q(q, positions, cos_sin_cache, weights, weights_scale, pair, hadamard=hadamard,
                      scale_rule=scale_rule, rope=rope)


def quantize_q(q, positions, cos_sin_cache, weights, weights_scale, pair=None, *, hadamard=False,
               scale_rule="ceil", rope="separate") -> dict:
    """The Q quant's work after its argument checks; no host sync (a CUDA graph can replay it)."""
    packed, scales = mxfp4.quantize_mxfp4(_q_values(q, positions, cos_sin_cache, hadamard=hadamard,
                                                    rope=rope), scale_rule)
    return {"q_fp4": packed, "q_scale": scales, "weights": fold_weights(weights, weights_scale, pair)}
