"""The optional Hadamard rotation of DeepSeek's reference (NUMERICS.md §8).

q and k are multiplied by H_D * D**-0.5 after RoPE and before quantizing. Exact scores
are unchanged (the matrix is orthonormal); quantized ones are not. Rotating only one
side is a known bug class."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _sylvester(d: int) -> torch.Tensor:
    if d & (d - 1):
        raise ValueError(f"head_dim: {d} is not a power of two; no Sylvester Hadamard matrix")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard_matrix(d: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix H_d * d**-0.5."""
    return (_sylvester(d) * d ** -0.5).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """bf16(x @ H * D**-0.5) over the last dim, accumulated in fp64 (bf16-valued fp32 out)."""
    h = hadamard_matrix(x.shape[-1], device=x.device)
    return (x.double() @ h).float().to(torch.bfloat16).float()
