"""Every workaround for the Triton interpreter (TRITON_INTERPRET=1), in one place.

The interpreter runs the kernels on numpy and differs from compiled Triton in ways that
change bits. Each helper below is what the kernels call instead of the faulty primitive;
compiled, it is the plain primitive. Faults handled (seen with triton 3.6/3.7):

* fp32 -> bf16 casts truncate instead of rounding to nearest even   -> `bf16_round`, `bf16_bits`
* bf16 subnormals are mangled when widened to fp32                  -> `widen_bf16` (all bf16
  inputs reach the kernels as int16 bit patterns and are widened by a shift, both modes)
* fp32 -> fp8 casts are wrong in ~2% of cases                       -> fp8 is encoded by bit
  arithmetic in numerics.py in both modes (no cast anywhere)
* tl.dot on bf16 operands gives garbage                             -> `mma_operand` (fp32)
* libdevice / inline_asm do not run                                 -> `exp_f64`,
  `e2m1_pair_operands` (inline PTX when compiled for NVIDIA; plain Triton elsewhere)
* launch options such as enable_fp_fusion are compile options       -> `LAUNCH`
* triton's own library (tl.sum, tl.cdiv...) is decorated at import: triton imported before
  TRITON_INTERPRET=1 is re-imported by __init__._triton_for_interpreter
* `not tensor` is a Python bool, device_assert never fires, out-of-bounds stores are not
  caught: the kernels use `== 0`, and the wrappers check arguments on the host.
* every program and every nested @triton.jit call costs milliseconds of Python, whatever
  its tile size (numpy does the element work): launchers take `tile(compiled,
  interpreted)`, wide tiles when interpreted, so one validation run launches few programs.

`INTERPRETED` is read once, when this module is imported: the backend factory sets
TRITON_INTERPRET before importing the kernel modules (see __init__.py).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# Compiled Triton contracts a*b - c*d into an FMA by default, which changes the RoPE bits
# (the contract rounds each product to fp32). The interpreter has no such option.
LAUNCH: dict = {} if INTERPRETED else {"enable_fp_fusion": False}

def tile(compiled, interpreted):
    """A launcher's tiling: `interpreted` under the interpreter, else `compiled`."""
    return interpreted if INTERPRETED else compiled


if not INTERPRETED:
    from triton.language.extra import libdevice as _libdevice
else:  # pragma: no cover - the interpreter cannot call libdevice
    _libdevice = None


@triton.jit
def widen_bf16(bits):
    """int16 bf16 bit patterns -> exact fp32 (subnormals included, both modes)."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _rne_bf16_bits_u32(x):
    # round-to-nearest-even of the fp32 bits at bit 16 (finite inputs)
    b = x.to(tl.uint32, bitcast=True)
    return (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000


@triton.jit
def bf16_round(x):
    """bf16(x): fp32 -> nearest-even bfloat16 -> fp32."""
    if INTERPRETED:
        return _rne_bf16_bits_u32(x).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def bf16_bits(x):
    """fp32 -> the int16 bit pattern of bf16(x), ready to store into an int16 view."""
    if INTERPRETED:
        return (_rne_bf16_bits_u32(x) >> 16).to(tl.int32).to(tl.int16)
    else:
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True)


@triton.jit
def mma_operand(x):
    """Operand for tl.dot of values exact in bf16 (dequantized MXFP4/FP8): bf16 on the
    tensor cores when compiled; fp32 in the interpreter, whose bf16 dot is wrong."""
    if INTERPRETED:
        return x
    else:
        return x.to(tl.bfloat16)


@triton.jit
def exp_f64(x):
    """exp in fp64 (libdevice when compiled; numpy in the interpreter)."""
    if INTERPRETED:
        return tl.exp(x)
    else:
        return _libdevice.exp(x)


# e2m1 pair decode for the scorer's tensor-core operands. Compiled for NVIDIA: two packed
# bytes per call ($2), each with its own block scale ($3, $4: Triton does not promise which
# two elements share a call, so they may come from different blocks or entries); each nibble's 3 magnitude bits are placed where a bf16's exponent and
# first mantissa bit are (that spells e2m1 * 2**-126 for every code, 0.5 as the subnormal
# 2**-127), the sign bit at bit 15, two bf16 per register; then two packed multiplies,
# by 2**126 and by the block scale (both powers of two: exact, subnormals kept).
_E2M1_PTX: tl.constexpr = tl.constexpr("""
{
.reg .b32 x, t, u, s, c;
mov.b32 c, 0x7E807E80;
cvt.rn.bf16x2.f32 s, $4, $3;
prmt.b32 x, $2, 0, 0x4140;
shl.b32 t, x, 6; and.b32 t, t, 0x01C001C0; shl.b32 u, x, 12; and.b32 u, u, 0x80008000; or.b32 t, t, u;
mul.rn.bf16x2 t, t, c; mul.rn.bf16x2 $0, t, s;
shl.b32 t, x, 2; and.b32 t, t, 0x01C001C0; shl.b32 u, x, 8; and.b32 u, u, 0x80008000; or.b32 t, t, u;
mul.rn.bf16x2 t, t, c; mul.rn.bf16x2 $1, t, s;
}
""")


@triton.jit
def e2m1_pair_operands(kb, sc, PTX: tl.constexpr):
    """Packed MXFP4 bytes kb (uint8) and their block scales 2**(e-127) (fp32, same shape)
    -> (even, odd) values as tensor-core operands: bf16 when compiled, fp32 when
    interpreted (see mma_operand). Exact: e2m1 times a power of two fits bf16.
    PTX (compiled for NVIDIA only): the inline-assembly decoder above; else plain Triton."""
    if PTX and not INTERPRETED:
        return tl.inline_asm_elementwise(_E2M1_PTX, "=r,=r,r,r,r", [kb, sc],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    else:
        b = kb.to(tl.int32)
        lo = ((b & 0x07) << 22) | ((b & 0x08) << 28)
        hi = ((b & 0x70) << 18) | ((b & 0x80) << 24)
        ve = (lo.to(tl.float32, bitcast=True) * 8.507059173023462e37) * sc     # * 2**126
        vo = (hi.to(tl.float32, bitcast=True) * 8.507059173023462e37) * sc
        return mma_operand(ve), mma_operand(vo)
