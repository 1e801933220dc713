"""Both top-k kernels (row in registers, row streamed) on the contract's cases: ties at
the k-th value, signed zeros, the most negative logits, exact-count early stops, short
rows, widths that are not powers of two (Triton interpreter; compiled in
test_gpu_triton.py)."""
import pytest
import torch

from test_triton_cases import topk_case, topk_problems


@pytest.fixture(scope="module")
def topk():
    from optimized import get_backend
    get_backend("triton-interpret")
    from optimized.triton_kernels import topk
    return topk


def tie_case():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 700, generator=g)
    x[0, :300] = 2.0                        # 300 ties across the k-th value
    x[1] = 0.0
    x[1, ::3] = -0.0                        # all zeros, mixed signs: every column ties
    x[2] = torch.arange(700).float()        # distinct: the search can stop at exactly k
    x[3, 10:] = -3.4e38
    lens = torch.tensor([700, 650, 700, 400, 64, 63])
    return dict(logits=x, lengths=lens, k=64)


@pytest.mark.parametrize("resident,chunk", [(True, None), (True, 128), (False, None)])
@pytest.mark.parametrize("case", ["ties", "topk-64", "topk-1024"])
def test_both_kernels_meet_the_contract(topk, resident, chunk, case):
    """(the GPU writes the selection in chunks of up to 1024 columns; the interpreter in
    one: chunk=128 runs the chunked pass here)"""
    kw = {"ties": tie_case, "topk-64": lambda: topk_case(k=64),
          "topk-1024": lambda: topk_case(k=1024)}[case]()
    idx = topk.launch(kw["logits"], kw["lengths"], kw["k"], resident=resident, chunk=chunk)
    assert topk_problems(idx, kw["logits"], kw["lengths"], kw["k"]) == []


def test_ties_are_taken_in_column_order(topk):
    kw = tie_case()
    idx = topk.launch(kw["logits"], kw["lengths"], kw["k"], resident=True)
    above = (kw["logits"][0] > 2.0).nonzero().flatten().tolist()
    assert idx[0].tolist() == above + list(range(64 - len(above)))   # then the first tied columns
    assert sorted(idx[1].tolist()) == list(range(64))  # -0.0 ties with +0.0
