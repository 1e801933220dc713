"""vLLM 0.33.0's real kernels compiled on a GPU (marker gpu): the fused K writers and the
Q quants of `vllm-cuda` (NVIDIA), the ROCm pooling kernel of `vllm-rocm`, against the
reference. Compiled, the kernels use the GPU's approximate exp / log2 / rsqrt and contract
the RoPE products into FMAs, so the bounds here are rates, with the counts printed; the
byte-exact comparisons are the interpreter's (tests/test_vllm_upstream.py)."""
from __future__ import annotations

import pytest
import torch

import helpers as H
import reference
from reference import rope

pytestmark = [pytest.mark.gpu, pytest.mark.upstream]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                reason="needs an NVIDIA GPU (vLLM's CUDA path)")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


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
    be = _backend("vllm-cuda")
    differ = owned = 0
    for seed in range(3):
        ins = _fused_inputs(fmt, seed)
        got = be.ops[f"compress_norm_rope_{fmt}_cache"](**ins)["kv_cache"].cpu()
        pooled = reference.compress_pool(**{k: ins[k] for k in ("state_cache", "block_table", "positions", "req_index",
                                                                "kv_slot_mapping")}, compress_ratio=4,
                                         rounding="cuda")["pooled"]
        kw = dict(k=pooled, positions=ins["positions"], cos_sin_cache=ins["cos_sin_cache"],
                  norm_weight=ins["norm_weight"], slot_mapping=ins["kv_slot_mapping"], kv_cache=ins["kv_cache"],
                  norm_eps=1e-6, compress_ratio=4, page_size=ins["page_size"], rounding="cuda")
        want = (reference.k_norm_rope_mxfp4_cache(**kw, shuffle=None) if fmt == "mxfp4"
                else reference.k_norm_rope_fp8_cache(**kw))["kv_cache"]
        changed = want != ins["kv_cache"]
        assert not bool(((got != ins["kv_cache"]) & ~changed & (got != want)).sum() > 0.01 * changed.sum())
        differ += int((got != want).sum())
        owned += int(changed.sum())
    print(f"\n{fmt}: {differ} of ~{owned} written bytes differ from the reference cuda chain")
    assert owned > 1000 and differ <= 0.01 * owned


@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_q_quant_compiled(fmt):
    be = _backend("vllm-cuda")
    qc = H.q_case(seed=2, tokens=64, heads=16)
    op = f"q_rope_{fmt}_quant"
    got = {k: v.cpu() for k, v in be.ops[op](**qc).items()}
    want = reference.OPS[op].fn(**qc)
    for k in want:
        a = got[k].view(torch.uint8) if want[k].dtype == torch.uint8 else got[k]
        n = int((a != want[k]).sum())
        print(f"\n{op} {k}: {n} of {want[k].numel()} differ")
        assert n <= 0.01 * want[k].numel()


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
