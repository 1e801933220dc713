"""Helpers for test modules to import (never import another test module)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"


def sample_path(name: str) -> Path:
    """`tests/data/<name>.safetensors`, one of the committed sample dumps (docs/spec/DUMPS.md,
    "Samples"). A missing sample fails the test: the byte-exact checks must never silently
    not run."""
    path = DATA / f"{name}.safetensors"
    if not path.is_file():
        pytest.fail(f"sample dump {path} is missing (it is part of the repository)", pytrace=False)
    return path


def load_sample(name: str):
    """(op name, scalars of the op, {in name: tensor}, {out name: tensor}) of a one-op sample dump."""
    from safetensors import safe_open
    with safe_open(str(sample_path(name)), "pt") as f:
        meta = json.loads(f.metadata()["mxval"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (op, scalars), = meta["ops"].items()
    ins = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{op}/in/")}
    outs = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{op}/out/")}
    return op, scalars, ins, outs
