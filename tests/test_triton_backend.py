"""The Triton backend through the Triton interpreter (CPU, CI) against the reference, on
small cases that hold the spec's edge cases (tests/helpers.py)."""
import pytest
import torch
from helpers import cases, compare, same_bits

from optimized import OP_NAMES, get_backend
from reference.ops import OPS

CASES = cases()


@pytest.fixture(scope="module")
def be():
    return get_backend("triton-interpret")


def test_every_op_is_implemented(be):
    assert be.available() is None
    rocm_ops = {op for op in OP_NAMES if "rocm" in OPS[op].paths}     # the CUDA fused stage is vLLM's
    assert all(be.supports(op) for op in rocm_ops)
    assert {op for _, op, _ in CASES} == rocm_ops


def test_same_bits_sees_any_modified_input():
    x = torch.tensor([1.0, float("nan"), -0.0, 3.0])
    assert same_bits(x, x.clone())
    for i, v in enumerate((2.0, 0.0, 0.0, float("nan"))):   # a value, NaN -> number, -0 -> +0, number -> NaN
        y = x.clone()
        y[i] = v
        assert not same_bits(x, y), i
    assert not same_bits(x, x.double()) and not same_bits(x, x[:3])


@pytest.mark.parametrize("op,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_reference(be, op, kw):
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    got = getattr(be, op)(**kw)
    assert compare(op, got, kw) == []
    modified = [k for k in before if not same_bits(before[k], kw[k])]
    assert not modified, f"inputs modified: {modified}"


def test_rejects_what_it_does_not_implement(be):
    from helpers import k_writer_case, q_case
    with pytest.raises(ValueError, match="hadamard"):
        be.k_norm_rope_mxfp4_cache(**k_writer_case(), hadamard=True)
    with pytest.raises(ValueError, match="scale_rule"):
        be.q_rope_mxfp4_quant(**q_case(), scale_rule="rceil")
    from helpers import topk_case

    import reference
    from reference.checks import NonFiniteInput
    kw = topk_case()
    kw["logits"][0, 5] = float("-inf")
    kw["logits"][1] = float("nan")
    with pytest.raises(NonFiniteInput, match="logits"):
        reference.topk(**kw)
    # the kernel takes what it is given, as kernels do; its indices keep the invariants
    from harness.diff import invariants
    out = be.topk(**kw)
    assert invariants.check("topk", kw, {"k": kw["k"]}, out, declared_nonfinite=True).metrics[
        "invariant_violations"] == 0
    with pytest.raises(ValueError, match="kv_cache"):
        kw = k_writer_case()
        be.k_norm_rope_mxfp4_cache(**dict(kw, kv_cache=kw["kv_cache"][:, :100]))


def test_interpreter_bf16_round_is_nearest_even(be):
    """interp.bf16_round must round ties to even where the interpreter's cast truncates."""
    import triton
    import triton.language as tl

    from optimized.triton_kernels import interp
    globals()["bf16_bits"] = interp.bf16_bits     # the kernel below resolves it as a global

    @triton.jit
    def k(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, bf16_bits(tl.load(x_ptr + i)))  # noqa: F821 - bound above

    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0xBF818000, 0x00008000,
                         0x7F7FFFFF, 0x3F800001], dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    out = torch.empty(8, dtype=torch.int16)
    k[(1,)](x, out, N=8)
    assert torch.equal(out, x.to(torch.bfloat16).view(torch.int16))
    # the fault it works around: the interpreter's own cast truncates the first tie
    @triton.jit
    def raw(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16).to(tl.int16, bitcast=True))

    raw[(1,)](x, out, N=8)
    assert not torch.equal(out, x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU-only machine")
def test_compiled_backend_says_why_it_cannot_run():
    reason = get_backend("triton", require=False).available()
    assert reason and ("no CUDA or ROCm GPU" in reason or "TRITON_INTERPRET" in reason)


def test_interpreter_works_after_triton_was_imported_compiled():
    """triton imported first (tl.sum decorated for compiling) must not break the interpreter."""
    import subprocess
    import sys
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import triton, triton.language\n"
            "import sys; sys.path.insert(0, 'tests')\n"
            "from optimized import get_backend\n"
            "from helpers import q_case, compare\n"
            "be = get_backend('triton-interpret'); kw = q_case(tokens=2, heads=2)\n"
            "assert compare('q_rope_mxfp4_quant', be.q_rope_mxfp4_quant(**kw), kw) == []\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
