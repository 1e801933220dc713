"""vLLM's real kernels (loaded from the fetched release, never imported) through the
Triton interpreter on smoke-size cases. Marked `upstream`: `make test-upstream` fetches the
release once (cached) and runs these; without the fetch they are skipped with that reason."""
from __future__ import annotations

import shutil

import helpers as H
import pytest
import torch

import reference
from reference import rope

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def fetched():
    from optimized.vllm_kernels.source import SourceError, find_source
    try:
        return find_source(use_installed=False)
    except SourceError as e:
        pytest.skip(f"{e} (run `make test-upstream`)")


@pytest.fixture(scope="module")
def cuda_be(fetched):
    from optimized import get_backend
    return get_backend("vllm-cuda-interpret")


@pytest.fixture(scope="module")
def rocm_be(fetched):
    from optimized import get_backend
    return get_backend("vllm-rocm-interpret")


def _fused_inputs(fmt, seed=1, page_size=32):
    pc = H.pool_case(seed=seed, tokens=40)
    g = torch.Generator().manual_seed(seed + 10)
    eb = (H.D + 4) if fmt == "fp8" else reference.layout.entry_bytes(H.D)
    pad = 4 if fmt == "fp8" else 7        # vLLM's FP8 writer needs 4-byte aligned pages (fp32 scales)
    kv = torch.randint(0, 256, (3, page_size * eb + pad), generator=g, dtype=torch.uint8)
    cs = rope.cos_sin_cache(256, H.R, 160000.0, yarn_factor=16.0)
    w = (1 + 0.1 * torch.randn(H.D, generator=g)).to(torch.bfloat16)
    return dict(pc, cos_sin_cache=cs, norm_weight=w, kv_cache=kv, norm_eps=1e-6, page_size=page_size)


def _reference_chain(fmt, ins):
    """compress_pool(rounding="cuda") -> k_norm_rope_*_cache(rounding="cuda", natural order)."""
    pooled = reference.compress_pool(state_cache=ins["state_cache"], block_table=ins["block_table"],
                                     positions=ins["positions"], req_index=ins["req_index"],
                                     kv_slot_mapping=ins["kv_slot_mapping"], compress_ratio=4, rounding="cuda")["pooled"]
    kw = dict(k=pooled, positions=ins["positions"], cos_sin_cache=ins["cos_sin_cache"], norm_weight=ins["norm_weight"],
              slot_mapping=ins["kv_slot_mapping"], kv_cache=ins["kv_cache"], norm_eps=ins["norm_eps"], compress_ratio=4,
              page_size=ins["page_size"], rounding="cuda")
    if fmt == "mxfp4":
        return reference.k_norm_rope_mxfp4_cache(**kw, shuffle=None)["kv_cache"]
    return reference.k_norm_rope_fp8_cache(**kw)["kv_cache"]


def test_backends_say_where_the_kernels_came_from(cuda_be, rocm_be, fetched):
    assert cuda_be.available() is None and rocm_be.available() is None
    for be in (cuda_be, rocm_be):
        assert be.source == fetched.describe() and fetched.version in be.description and "interpreter" in be.description
    assert "emulation" in cuda_be.description and "mxval's Triton scorer and top-k" in cuda_be.description
    assert "mxval's Triton K writer" in rocm_be.description


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_fused_k_writer_matches_the_reference_cuda_chain(cuda_be, fmt):
    """The real fused kernel's pages, byte for byte, against the reference chain on
    inputs without signed zeros (the NoPE -0.0 difference is the next test)."""
    ins = _fused_inputs(fmt)
    got = cuda_be.ops[f"compress_norm_rope_{fmt}_cache"](**ins)["kv_cache"]
    want = _reference_chain(fmt, ins)
    assert int((want != ins["kv_cache"]).sum()) > 500            # it wrote something
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"


def test_fused_writer_nope_minus_zero_is_the_reference_cuda_path(cuda_be):
    """vLLM's CUDA writer puts the NoPE dims through the RoPE formula with cos = 1, sin = 0
    (masked loads), so an even NoPE element -0.0 next to an odd -0.0 becomes -0 - (-0 * 0) =
    +0.0 (nibble 0x0, not 0x8). The reference's cuda path does the same (NUMERICS.md §2):
    byte for byte equal, and the +0 is there (a reference that left NoPE untouched would
    write 0x88 at those bytes)."""
    ins = _fused_inputs("mxfp4")
    sc = ins["state_cache"].clone()
    sc[..., :H.D] = -0.0                                         # every kv row: -0.0 (scores unchanged)
    sc[..., H.D:2 * H.D] = -0.0
    ins["state_cache"] = sc
    got = cuda_be.ops["compress_norm_rope_mxfp4_cache"](**ins)["kv_cache"]
    want = _reference_chain("mxfp4", ins)
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
    written = (want != ins["kv_cache"]).nonzero()
    nope = written[(written[:, 1] < ins["page_size"] * H.D // 2) & (written[:, 1] % (H.D // 2) < (H.D - H.R) // 2)]
    vals = set(want[nope[:, 0], nope[:, 1]].tolist())
    assert nope.numel() and 0x80 in vals and not any(v & 0x0F == 0x8 for v in vals)   # even nibbles +0, never -0


def test_fused_fp8_refuses_pages_that_would_fault(cuda_be):
    ins = _fused_inputs("fp8")
    ins["kv_cache"] = torch.zeros(3, ins["kv_cache"].shape[1] + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 4"):
        cuda_be.ops["compress_norm_rope_fp8_cache"](**ins)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_q_quant_matches_the_reference(cuda_be, fmt):
    qc = H.q_case(seed=2, tokens=6, heads=4)                     # signed zeros, subnormals, midpoints
    op = f"q_rope_{fmt}_quant"
    got = cuda_be.ops[op](**qc)
    want = reference.OPS[op].fn(**qc)
    for k in want:
        assert torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.uint8 else got[k], want[k]), k


def test_cuda_path_refuses_what_it_cannot_do(cuda_be):
    qc = H.q_case(seed=2, tokens=2, heads=2)
    with pytest.raises(ValueError, match="e4m3fn"):
        cuda_be.ops["q_rope_fp8_quant"](**qc, fp8_dtype="e4m3fnuz")
    assert "e4m3fn" in cuda_be.cannot("q_rope_fp8_quant", {"fp8_dtype": "e4m3fnuz"})
    ins = _fused_inputs("mxfp4")
    ins["kv_slot_mapping"] = ins["kv_slot_mapping"] + 10_000      # past the pool: the kernel would not notice
    with pytest.raises(ValueError, match="kv_slot_mapping"):
        cuda_be.ops["compress_norm_rope_mxfp4_cache"](**ins)
    for op, kw in (("q_rope_mxfp4_quant", qc), ("compress_norm_rope_mxfp4_cache", _fused_inputs("mxfp4"))):
        with pytest.raises(TypeError, match="unexpected keyword"):
            cuda_be.ops[op](**kw, clean_logits=True)
        want = cuda_be.numerics[op]["rope"]
        with pytest.raises(ValueError, match=f"computes rope={want!r} here, got 'fma-xx'"):
            cuda_be.ops[op](**kw, rope="fma-xx")
    with pytest.raises(TypeError, match="unexpected keyword"):                # softmax: the fused ops only
        cuda_be.ops["q_rope_mxfp4_quant"](**qc, softmax="fp32")
    with pytest.raises(ValueError, match="softmax"):
        cuda_be.ops["compress_norm_rope_mxfp4_cache"](**_fused_inputs("mxfp4"), softmax="fp32")


def test_rocm_pooling_kernel_matches_the_reference(rocm_be):
    pc = H.pool_case(seed=1, tokens=40)
    got = rocm_be.ops["compress_pool"](**pc)["pooled"]
    want = reference.compress_pool(**pc)["pooled"]
    sel = ((pc["positions"] + 1) % 4 == 0) & (pc["kv_slot_mapping"] >= 0)
    assert int(sel.sum()) > 5
    assert torch.equal(got[sel].view(torch.int16), want[sel].view(torch.int16))
    assert bool(torch.isnan(got[~sel].float()).all())           # rows it does not pool stay as given


def test_rocm_backend_through_the_runner_on_smoke_cases(rocm_be):
    """The real pooling kernel inside the whole chain (edge values, FP8): a pass, with zero
    pooling differences."""
    from harness.run import budgets
    from harness.run.cases import Catalog
    from harness.run.runner import run_case
    cat, b = Catalog(), budgets.load()
    for name in ("smoke-edge-values", "smoke-fp8"):
        row = budgets.verdict(run_case(cat.case(name), "vllm-rocm-interpret"), b, "smoke")
        assert row["status"] == "pass", row["reason"]
        m = row["metrics"]
        assert m["compress_pool.pooled_rows_compared"] > 0
        assert m["compress_pool.pooled_values_differing"] == 0 and m["compress_pool.pooled_max_ulp"] == 0


def test_drifted_kernel_makes_the_backend_unavailable(fetched, tmp_path, monkeypatch):
    """A parameter renamed upstream: the kernel set refuses to load (no silent wrong launch)."""
    from optimized.vllm_kernels import kernelset
    root = tmp_path / "tree"
    shutil.copytree(fetched.root, root)
    f = root / "vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py"
    text = f.read_text()
    f.write_text(text.replace("kv_cache_block_size", "kv_cache_blocks"))
    with pytest.raises(kernelset.KernelSetError, match="refused: its sha256 .* is not the one pinned"):
        kernelset.kernel_set(interpreted=True, path=str(root))
    monkeypatch.setenv("MXVAL_TRUST_UPSTREAM", "1")          # named and trusted: read, and found drifted
    with pytest.raises(kernelset.KernelSetError, match="drifted.*kv_cache_blocks"):
        kernelset.kernel_set(interpreted=True, path=str(root))


def test_q_quant_takes_vllms_two_scales(cuda_be):
    """With softmax_scale and head_scale, the weights are (w * softmax_scale) * head_scale
    as vLLM's kernel computes them; without, one multiply by weights_scale."""
    qc = H.q_case(seed=3, tokens=4, heads=4)
    ss, hs = 128 ** -0.5, 4 ** -0.5
    got = cuda_be.ops["q_rope_mxfp4_quant"](**dict(qc, weights_scale=ss * hs), softmax_scale=ss, head_scale=hs)
    w = qc["weights"].float()
    want = (w * torch.tensor(ss, dtype=torch.float32)) * torch.tensor(hs, dtype=torch.float32)
    assert torch.equal(got["weights"], want)
    with pytest.raises(ValueError, match="give both"):
        cuda_be.ops["q_rope_mxfp4_quant"](**qc, softmax_scale=ss)
    with pytest.raises(ValueError, match="differs from weights_scale"):
        cuda_be.ops["q_rope_mxfp4_quant"](**dict(qc, weights_scale=0.5), softmax_scale=ss, head_scale=hs)
