"""How a narrower float enters wider arithmetic: exactly, by the device's faster way."""
from __future__ import annotations

import functools

import torch

_NARROW = (torch.bfloat16, torch.float16)


def converts_in_kernel(t: torch.Tensor) -> bool:
    """Whether an op on t with an operand of another dtype converts it in the kernel (a GPU)
    rather than through the CPU's slower mixed-dtype path."""
    return t.is_cuda


def widened(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t (a float dtype no wider than `dtype`) as an operand of `dtype` arithmetic; the
    values are exact either way. On a GPU t as it is: an op whose operands differ in dtype
    converts them in the kernel, one pass over memory fewer than a conversion first. On the
    CPU t converted: there such an op is several times slower than the conversion and a
    same-dtype op together (measured: bf16 * fp32 over 512k elements 0.97 ms against 0.25)."""
    return t if converts_in_kernel(t) or t.dtype == dtype else t.to(dtype)


def fp32_operand(t: torch.Tensor) -> torch.Tensor:
    """t as an operand of fp32 arithmetic: bf16 and fp16 widened (exact, `widened`), wider
    floats rounded to fp32 (`.float()`)."""
    return widened(t, torch.float32) if t.dtype in _NARROW else t.float()


def fp32_factor(f: float, t: torch.Tensor) -> torch.Tensor:
    """fp32(f) as the other factor of a product with t (an fp32 operand) that is fp32: on a GPU
    a 1-element tensor made once per device, so that bf16 t is converted in the kernel (a 0-dim
    factor would leave the product bf16); on the CPU, where t is fp32, a 0-dim host tensor
    (no copy)."""
    return device_const(float(f), torch.float32, t.device) if converts_in_kernel(t) else torch.tensor(f, dtype=torch.float32)


def device_const(value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`value` as a 1-element tensor of `dtype`, made once per device, on the device (no host
    copy: CUDA graphs). As an operand it takes its dtype into the result's (a Python scalar
    or 0-dim tensor would not, and a Python scalar would make a scalar tensor per call).
    Keyed by the value's text too: -0.0 and 0.0 are equal keys, and must stay two tensors."""
    return _device_const(repr(value), value, dtype, device)


@functools.lru_cache(maxsize=64)
def _device_const(text: str, value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((1,), value, dtype=dtype, device=device)
