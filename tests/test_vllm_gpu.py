"""vLLM 0.33.0's real kernels compiled on a GPU (marker gpu): the fused K writers and the
Q quants of `vllm-cuda` (NVIDIA), the ROCm pooling kernel of `vllm-rocm`, against the
reference. Compiled, the kernels use the GPU's approximate exp / log2 / rsqrt and contract
the RoPE products into FMAs, so the bounds here are rates, with the counts printed; the
byte-exact comparisons are the interpreter's (tests/test_vllm_upstream.py)."""
from __future__ import annotations

import helpers as H
import pytest
import torch
from helpers import needs_gpu

import reference
from reference import rope

pytestmark = [pytest.mark.gpu, pytest.mark.upstream]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                reason="needs an NVIDIA GPU (vLLM's CUDA path)")


def _backend(name):
    from optimized import get_backend
    from optimized.vllm_kernels.source import SourceError, find_source
    try:
        find_source()
    except SourceError as e:
        pytest.skip(str(e))
    return get_backend(name)


def _fused_inputs(fmt, seed, tokens=400, page_size=64):
    pc = H.pool_case(seed=seed, tokens=tokens, block_size=16)
    g = torch.Generator().manual_seed(seed + 10)
    eb = (H.D + 4) if fmt == "fp8" else reference.layout.entry_bytes(H.D)
    kv = torch.randint(0, 256, (-(-tokens // page_size) + 1, page_size * eb + 16), generator=g, dtype=torch.uint8)
    cs = rope.cos_sin_cache(1024, H.R, 160000.0, yarn_factor=16.0)
    w = (1 + 0.1 * torch.randn(H.D, generator=g)).to(torch.bfloat16)
    return dict(pc, cos_sin_cache=cs, norm_weight=w, kv_cache=kv, norm_eps=1e-6, page_size=page_size)


@needs_cuda
def test_vllm_cuda_loads_compiled_and_says_how_e2m1_runs():
    be = _backend("vllm-cuda")
    assert be.available() is None, be.available()
    from optimized.vllm_kernels.kernelset import kernel_set
    ks = kernel_set(interpreted=False)
    major = torch.cuda.get_device_capability(0)[0]
    assert ks.e2m1 == ("unmodified" if major == 10 else "emulated")
    assert ("emulation" in be.description) == (major != 10)


@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_fused_writer_compiled_against_the_reference_chain(fmt):
    """vLLM's fused K writer compiled, against the reference's fused op with the rope mode the
    kernel compiles to (Backend.numerics): no byte outside the written slots changes, and
    the written bytes differ only where the kernel's approximate exp/rsqrt pooling moves a
    value one grid step (H200: 6.7e-7 of MXFP4, 1.8e-6 of FP8 bytes; NUMERICS.md §2a)."""
    be = _backend("vllm-cuda")
    op = f"compress_norm_rope_{fmt}_cache"
    assert be.numerics[op] == {"rope": "fma-oc"}
    differ = owned = 0
    for seed in range(3):
        ins = _fused_inputs(fmt, seed)
        got = be.ops[op](**ins)["kv_cache"].cpu()
        want = reference.OPS[op].fn(**ins, **be.numerics[op])["kv_cache"]
        changed = want != ins["kv_cache"]
        assert not bool(((got != want) & ~changed).any()), "a byte outside the written slots changed"
        differ += int((got != want).sum())
        owned += int(changed.sum())
    print(f"\n{fmt}: {differ} of ~{owned} written bytes differ from the reference's fused op")
    assert owned > 1000 and differ <= 1e-4 * owned


@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_q_quant_compiled(fmt):
    """vLLM's fused Q quant compiled: byte for byte the reference with the kernel's rope mode."""
    be = _backend("vllm-cuda")
    qc = H.q_case(seed=2, tokens=64, heads=16)
    op = f"q_rope_{fmt}_quant"
    assert be.numerics[op] == {"rope": "fma-es"}
    got = {k: v.cpu() for k, v in be.ops[op](**qc).items()}
    want = reference.OPS[op].fn(**qc, **be.numerics[op])
    for k in want:
        a = got[k].view(torch.uint8) if want[k].dtype == torch.uint8 else got[k]
        n = int((a != want[k]).sum())
        print(f"\n{op} {k}: {n} of {want[k].numel()} differ")
        assert n == 0, f"{op} {k}: {n} of {want[k].numel()} differ"


@needs_gpu
def test_rocm_pooling_kernel_compiled():
    be = _backend("vllm-rocm")
    pc = H.pool_case(seed=1, tokens=400, block_size=16)
    got = be.ops["compress_pool"](**pc)["pooled"].cpu()
    want = reference.compress_pool(**pc)["pooled"]
    sel = ((pc["positions"] + 1) % 4 == 0) & (pc["kv_slot_mapping"] >= 0)

    def ordered(x):
        b = x.view(torch.int16).to(torch.int32)
        return torch.where(b < 0, -(b & 0x7FFF), b)
    ulp = (ordered(got[sel]) - ordered(want[sel])).abs()
    print(f"\npooling: {int((ulp > 0).sum())} of {ulp.numel()} values differ, max {int(ulp.max())} ulp")
    assert int(ulp.max()) <= 32 and int((ulp > 0).sum()) <= 0.01 * ulp.numel()
