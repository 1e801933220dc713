"""Shared fixtures. Additive only: other test files rely on these names."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen():
    """A seeded torch generator: every test draws the same data on every run."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def pro_cos_sin():
    """V4-Pro cos/sin cache (YaRN), 4096 positions."""
    from reference import preset, rope
    p = preset("deepseek-v4-pro")
    return rope.cos_sin_cache(4096, p.rope_dim, p.rope_base, yarn_factor=p.yarn_factor,
                              yarn_original_max_pos=p.yarn_original_max_pos)
