"""Both top-k kernels (row in registers, row streamed) on the contract's cases: ties at
the k-th value, signed zeros, the most negative logits, exact-count early stops, short
rows, widths that are not powers of two (Triton interpreter; compiled in
test_gpu_triton.py)."""
import pytest
from helpers import compare, tie_case, topk_case


@pytest.fixture(scope="module")
def topk():
    from optimized import get_backend
    get_backend("triton-interpret")
    from optimized.triton_kernels import topk
    return topk


@pytest.mark.parametrize("resident,chunk", [(True, None), (True, 128), (False, None)])
@pytest.mark.parametrize("case", ["ties", "topk-64", "topk-1024"])
def test_both_kernels_meet_the_contract(topk, resident, chunk, case):
    """(the GPU writes the selection in chunks of up to 1024 columns; the interpreter in
    one: chunk=128 runs the chunked pass here)"""
    kw = {"ties": tie_case, "topk-64": lambda: topk_case(k=64),
          "topk-1024": lambda: topk_case(k=1024)}[case]()
    idx = topk.launch(kw["logits"], kw["lengths"], kw["k"], resident=resident, chunk=chunk)
    assert compare("topk", {"indices": idx}, kw) == []


def test_ties_are_taken_in_column_order(topk):
    kw = tie_case()
    idx = topk.launch(kw["logits"], kw["lengths"], kw["k"], resident=True)
    above = (kw["logits"][0] > 2.0).nonzero().flatten().tolist()
    assert idx[0].tolist() == above + list(range(64 - len(above)))   # then the first tied columns
    assert sorted(idx[1].tolist()) == list(range(64))  # -0.0 ties with +0.0
