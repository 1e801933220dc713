"""aiter's real K writer and Q quant (wrappers + Triton kernels, loaded from the aiter tree in
$MXVAL_AITER_SRC, never imported) through the aiter-triton-interpret backend, against the
reference, byte for byte: whole pools (written entries, padding, untouched bytes), Q values,
scales and weights. Marked `upstream`: `make test-aiter AITER=DIR` runs them; without a tree
they are skipped with that reason."""
from __future__ import annotations

import helpers as H
import pytest
import torch

import reference
from reference import layout

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def be():
    return H.aiter_backend("aiter-triton-interpret")


@pytest.mark.parametrize("heads,ratio,shuffled", [(64, 4, True), (16, 1, True), (32, 2, False), (64, 4, False)])
def test_k_writer_writes_the_reference_pool(be, heads, ratio, shuffled):
    kw = H.k_writer_case(seed=heads + ratio, shuffle=layout.choose_shuffle(128, heads).as_list() if shuffled
                         else None)
    kw["compress_ratio"] = ratio
    got = be.ops["k_norm_rope_mxfp4_cache"](**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                               for k, v in kw.items()})
    want = reference.k_norm_rope_mxfp4_cache(**kw)
    diff = int((got["kv_cache"] != want["kv_cache"]).sum())
    assert diff == 0, f"{diff} pool bytes differ"


@pytest.mark.parametrize("seed,tokens,heads", [(1, 6, 8), (2, 5, 64)])
def test_q_quant_gives_the_reference_bytes(be, seed, tokens, heads):
    kw = H.q_case(seed=seed, tokens=tokens, heads=heads)
    got = be.ops["q_rope_mxfp4_quant"](**kw)
    want = reference.q_rope_mxfp4_quant(**kw)
    for name in ("q_fp4", "q_scale", "weights"):
        assert torch.equal(got[name], want[name]), name
