"""On a GPU (marker gpu):

* the two ways kernels derive the MXFP4 e8m0 scale, vLLM's `ceil(log2(amax * (1/6)))`
  through the GPU's log2 and aiter's exponent-bit rule, over every positive bf16 amax and
  the fp32 values next to 6 * 2^k (the counts are printed: NUMERICS.md quotes them);
* aiter's K writer and Q quant compiled (aiter-triton, tree in $MXVAL_AITER_SRC; also marked
  upstream) against the reference under the numerics the backend declares; on a mismatch the
  message says which rope contraction the kernels did compute."""
from __future__ import annotations

import helpers as H
import pytest
import torch
from helpers import needs_gpu

import reference
from reference import layout

pytestmark = pytest.mark.gpu


def amax_values() -> tuple[torch.Tensor, torch.Tensor]:
    """(every positive finite bf16 value and +0 as fp32, the fp32 values 1-3 ulps either side
    of 6 * 2^k for every k that keeps them finite)."""
    bf16 = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    six = (6.0 * torch.pow(2.0, torch.arange(-130, 126, dtype=torch.float64))).float()
    near = []
    for toward in (float("inf"), 0.0):
        x = six.clone()
        for _ in range(3):
            x = torch.nextafter(x, torch.full_like(x, toward))
            near.append(x.clone())
    return bf16, torch.cat([six, *near])


def scale_bytes(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(vLLM's float rule, aiter's bit rule) e8m0 bytes of `amax`, computed by one Triton kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def rules(a_ptr, ceil_ptr, bits_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        amax = tl.maximum(tl.load(a_ptr + offs, mask=m, other=1.0), 6.0 * (2**-126))
        log2_ratio = tl.ceil(tl.log2(amax * (1.0 / 6.0)))                 # vLLM (fused_indexer_q.py)
        log2_ratio = tl.minimum(tl.maximum(log2_ratio, -127.0), 127.0)
        tl.store(ceil_ptr + offs, (log2_ratio + 127.0).to(tl.uint8), mask=m)
        ratio = amax * (1.0 / 6.0)                                          # aiter (quant.py)
        bs = (ratio.to(tl.uint32, bitcast=True) + 0x7FFFFF) >> 23
        tl.store(bits_ptr + offs, bs.to(tl.uint8), mask=m)

    a = amax.cuda().contiguous()
    c, b = torch.empty_like(a, dtype=torch.uint8), torch.empty_like(a, dtype=torch.uint8)
    rules[(triton.cdiv(a.numel(), 1024),)](a, c, b, a.numel(), BLOCK=1024)
    return c.cpu(), b.cpu()


@needs_gpu
def test_the_two_scale_rules_agree_on_every_bf16_amax():
    bf16, near = amax_values()
    c, b = scale_bytes(bf16)
    nc, nb = scale_bytes(near)
    d = nc != nb
    print(f"\nscale rules on {torch.cuda.get_device_name(0)}: {int((c != b).sum())} of {bf16.numel()} bf16 amax "
          f"differ; {int(d.sum())} of {near.numel()} fp32 values next to 6*2^k differ "
          f"(float rule lower by one: {int((nb[d].int() - nc[d].int() == 1).sum())}; examples "
          f"{near[d][:3].tolist()})")
    assert int((c != b).sum()) == 0


def _which_rope(op: str, kw: dict, got: dict, keys) -> str:
    hits = [m for m in ("separate", "fma-oc", "fma-es")
            if all(torch.equal(got[k], reference.OPS[op].fn(**kw, rope=m)[k]) for k in keys)]
    return ", ".join(hits) or "none"


@needs_gpu
@pytest.mark.upstream
@pytest.mark.parametrize("heads,ratio,shuffled", [(64, 4, True), (16, 1, True), (32, 2, False)])
def test_aiter_k_writer_compiled(heads, ratio, shuffled):
    be = H.aiter_backend("aiter-triton")
    kw = H.k_writer_case(seed=heads + ratio, shuffle=layout.choose_shuffle(128, heads).as_list() if shuffled
                         else None)
    kw["compress_ratio"] = ratio
    rope = be.numerics["k_norm_rope_mxfp4_cache"]["rope"]
    got = be.ops["k_norm_rope_mxfp4_cache"](**kw, rope=rope)
    want = reference.k_norm_rope_mxfp4_cache(**kw, rope=rope)
    diff = int((got["kv_cache"] != want["kv_cache"]).sum())
    assert diff == 0, (f"{diff} pool bytes differ with rope={rope}; the kernel matches rope="
                       f"{_which_rope('k_norm_rope_mxfp4_cache', kw, got, ('kv_cache',))}")


@needs_gpu
@pytest.mark.upstream
@pytest.mark.parametrize("seed,tokens,heads", [(1, 6, 8), (2, 5, 64)])
def test_aiter_q_quant_compiled(seed, tokens, heads):
    be = H.aiter_backend("aiter-triton")
    kw = H.q_case(seed=seed, tokens=tokens, heads=heads)
    rope = be.numerics["q_rope_mxfp4_quant"]["rope"]
    got = be.ops["q_rope_mxfp4_quant"](**kw, rope=rope)
    want = reference.q_rope_mxfp4_quant(**kw, rope=rope)
    bad = [k for k in ("q_fp4", "q_scale", "weights") if not torch.equal(got[k], want[k])]
    assert not bad, (f"{bad} differ with rope={rope}; the kernel matches rope="
                     f"{_which_rope('q_rope_mxfp4_quant', kw, got, ('q_fp4', 'q_scale'))}")
