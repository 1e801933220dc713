"""The reference's two formulations give the same bytes (reference/operands.py): on a GPU
its ops take narrower operands into the wider dtype inside the kernel, on the CPU it converts
them first. The CPU can run either; every writer, the Q quant and the pooling must agree."""
import pytest
import torch
from helpers import cases, same_bits

import reference
from reference import mxfp4, operands, pooling, rope

OPS = ("k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant", "compress_pool", "k_norm_rope_fp8_cache")
CASES = [c for c in cases() if c[1] in OPS]


def in_kernel(monkeypatch, on: bool):
    for m in (operands, mxfp4, pooling):
        monkeypatch.setattr(m, "converts_in_kernel", lambda t: on)


@pytest.mark.parametrize("op,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_gpu_formulation_gives_the_cpu_bytes(monkeypatch, op, kw):
    extra = [{}, {"hadamard": True}] if op != "compress_pool" else [{}, {"softmax": "fp32"}]
    for more in extra if "hadamard" not in kw and op != "k_norm_rope_fp8_cache" else [{}]:
        in_kernel(monkeypatch, False)
        cpu = reference.FUNCTIONS[op](**kw, **more)
        in_kernel(monkeypatch, True)
        gpu = reference.FUNCTIONS[op](**kw, **more)
        for name in cpu:
            assert same_bits(cpu[name], gpu[name]), f"{op} {more}: {name}"


def test_the_comparison_sees_a_formulation_that_rounds_differently(monkeypatch):
    """Teeth: an in-kernel path that kept the state in bf16 would change the pooled rows."""
    kw = [c for c in CASES if c[0] == "pool"][0][2]
    in_kernel(monkeypatch, False)
    want = reference.compress_pool(**kw)["pooled"]
    in_kernel(monkeypatch, True)
    monkeypatch.setattr(pooling, "widened", lambda t, dtype: t.bfloat16())
    assert not same_bits(reference.compress_pool(**kw)["pooled"], want)


def test_codes_of_the_non_finite_and_signed_zeros():
    """The code search on the fp32 bits keeps the comparison rule's answers where abs, NaN
    and the sign bit meet: -0.0 -> 8, NaN -> magnitude 0 with its sign, inf -> 7."""
    nan = torch.tensor(float("nan"))
    x = torch.stack((torch.tensor(0.0), torch.tensor(-0.0), nan.abs(), -nan.abs(),
                     torch.tensor(float("inf")), torch.tensor(float("-inf")),
                     torch.tensor(-1e-45), torch.tensor(0.25), torch.tensor(-0.25).nextafter(torch.tensor(-1.0))))
    assert mxfp4.e2m1_codes(x).tolist() == [0, 8, 0, 8, 7, 15, 8, 0, 9]


def test_device_constants_are_made_once_and_keep_the_sign_of_zero():
    """The pooling's -0.0 and the norm's fp64 zero are equal as cache keys: two tensors."""
    cpu = torch.device("cpu")
    zero = operands.device_const(0.0, torch.float64, cpu)
    neg = operands.device_const(-0.0, torch.float64, cpu)
    assert zero.shape == neg.shape == (1,) and zero.dtype == torch.float64
    assert not bool(torch.signbit(zero)) and bool(torch.signbit(neg))
    assert operands.device_const(-0.0, torch.float64, cpu) is neg
    assert operands.device_const(0, torch.float64, cpu) is not neg
    assert operands.device_const(0.5, torch.float32, cpu).dtype == torch.float32


@pytest.mark.parametrize("through", [True, False])
def test_rope_rows_on_either_formulation_is_the_pairwise_rotation(monkeypatch, through):
    """The gathered-table formulation and the strided pairs give rope_gptj_tail's bits, NoPE
    pairs (-0.0 among them) through the formula with cos 1, sin 0 or copied."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 128, generator=g).bfloat16()
    x[:2, :, :64:3] = -0.0
    cache = rope.cos_sin_cache(40, 64, yarn_factor=4.0, yarn_original_max_pos=16)
    rows = torch.randint(0, 40, (6,), generator=g)
    cos, sin = rope.cos_sin_at(cache, rows)
    want = rope.rope_gptj_tail(x.float(), cos[:, None], sin[:, None], nope_through_formula=through).bfloat16()
    for on in (False, True):
        in_kernel(monkeypatch, on)
        assert same_bits(rope.rope_rows(x, cache, rows, nope_through_formula=through), want), on


@pytest.mark.parametrize("rule", ["ceil", "ocp-floor"])
@pytest.mark.parametrize("with_out", [False, True])
def test_the_gpu_quantize_in_blocks_of_rows_gives_the_same_bytes(monkeypatch, rule, with_out):
    """On a GPU the quantize runs a block of rows at a time (bounded memory): the same
    packed bytes and scales as one pass, with or without an `out` entry buffer, the last
    block partial."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 5, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (7, 5, 1), generator=g))
         ).bfloat16()
    in_kernel(monkeypatch, True)

    def run(min_rows):
        monkeypatch.setattr(mxfp4, "QUANT_MIN_ROWS", min_rows)
        out = torch.full((7, 5, 64 + 4), 0xAA, dtype=torch.uint8) if with_out else None
        p, s = mxfp4.quantize_mxfp4(x, rule, out=out)
        assert p.shape == (7, 5, 64) and s.shape == (7, 5, 4)
        return p.clone(), s.clone(), out
    whole, blocks = run(10 ** 6), run(4)                   # one pass; blocks of 6 rows (35 = 5 * 6 + 5)
    assert torch.equal(whole[0], blocks[0]) and torch.equal(whole[1], blocks[1])
    if with_out:
        assert torch.equal(whole[2], blocks[2])
    in_kernel(monkeypatch, False)
    cpu = mxfp4.quantize_mxfp4(x, rule)
    assert torch.equal(cpu[0], blocks[0]) and torch.equal(cpu[1], blocks[1])
