"""The optional Hadamard rotation (NUMERICS.md §8)."""
import pytest
import torch

import reference
from reference import hadamard


def test_matrix_is_orthonormal_sylvester():
    for d in (32, 64, 128):
        h = hadamard.hadamard_matrix(d)
        assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-15)
        assert torch.allclose((h * d ** 0.5).abs(), torch.ones(d, d, dtype=torch.float64)) and torch.equal(h, h.T)
    h4 = hadamard.hadamard_matrix(4) * 2
    assert h4.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    with pytest.raises(ValueError, match="^head_dim"):
        hadamard.hadamard_matrix(96)


def test_rotate_rounds_to_bf16_and_keeps_dot_products(gen):
    x = torch.randn(16, 128, generator=gen)
    y = torch.randn(16, 128, generator=gen)
    rx, ry = hadamard.rotate(x), hadamard.rotate(y)
    assert torch.equal(rx, rx.bfloat16().float())
    dots = (x.double() * y.double()).sum(-1)
    assert torch.allclose((rx.double() * ry.double()).sum(-1), dots, rtol=0.05, atol=0.05)


def test_switch_changes_quantized_q(gen, pro_cos_sin):
    args = dict(q=torch.randn(4, 2, 128, generator=gen).bfloat16(), positions=torch.arange(4),
                cos_sin_cache=pro_cos_sin, weights=torch.ones(4, 2), weights_scale=1.0)
    plain = reference.q_rope_mxfp4_quant(**args)["q_fp4"]
    assert not torch.equal(plain, reference.q_rope_mxfp4_quant(**args, hadamard=True)["q_fp4"])
