"""Shared fixtures. Additive only: other test files rely on these names."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO.parent / "shared" / "samples"


def load_sample(name: str):
    """(scalars of the op, op name, {in name: tensor}, {out name: tensor}) of a one-op sample dump."""
    from safetensors import safe_open
    path = SAMPLES / f"{name}.safetensors"
    if not path.exists():
        pytest.skip(f"sample {path} not present")
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["mxval"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (op, scalars), = meta["ops"].items()
    ins = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{op}/in/")}
    outs = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{op}/out/")}
    return op, scalars, ins, outs


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
