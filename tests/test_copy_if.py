"""The capture hook's flagged copy (optimized/triton_kernels/copy_if.py), through the
Triton interpreter: with the flag clear a launch writes nothing, with it set every pair is
copied byte for byte (any dtype, sizes that are not a multiple of the block, more pairs
than one launch takes, empty tensors). The compiled kernel inside a real CUDA graph runs in
tests/test_shadow_gpu.py and tests/test_capture_gpu.py."""
import pytest
import torch


@pytest.fixture(scope="module")
def copy_if():
    from optimized import get_backend
    b = get_backend("triton-interpret")                     # fixes this process's Triton mode
    if not b.available:
        pytest.skip(b.reason)
    from optimized.triton_kernels import copy_if as mod
    return mod


def _fields(g):
    return [torch.randn(1000, generator=g), torch.randint(0, 256, (3, 4097), dtype=torch.uint8, generator=g),
            torch.randn(5, generator=g).double(), torch.empty(0), torch.randn(2, 3, generator=g).bfloat16(),
            torch.randint(-2 ** 31, 2 ** 31 - 1, (17,), dtype=torch.int32, generator=g)] * 2


def test_flag_clear_copies_nothing_and_flag_set_copies_every_byte(copy_if):
    g = torch.Generator().manual_seed(0)
    src = _fields(g)
    assert len(src) > copy_if.SEGMENTS                     # two launches
    dst = [torch.full_like(s, 7) for s in src]
    flag = torch.zeros(1, dtype=torch.int32)
    copy_if.copy_if(flag, list(zip(src, dst)))
    assert all(bool((d == 7).all()) for d in dst)
    flag.fill_(1)
    copy_if.copy_if(flag, list(zip(src, dst)))
    assert all(torch.equal(copy_if.flat_bytes(s), copy_if.flat_bytes(d)) for s, d in zip(src, dst))   # every byte


def test_refuses_what_it_cannot_copy_exactly(copy_if):
    flag = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        copy_if.copy_if(flag, [(torch.randn(4, 4).t(), torch.empty(4, 4))])
    with pytest.raises(ValueError, match="copy_if"):
        copy_if.copy_if(flag, [(torch.randn(4), torch.empty(5))])
    with pytest.raises(ValueError, match="int32"):
        copy_if.copy_if(torch.ones(1), [(torch.randn(4), torch.empty(4))])
