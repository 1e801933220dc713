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
* libdevice / inline_asm do not run                                 -> `exp_f64`
* launch options such as enable_fp_fusion are compile options       -> `LAUNCH`
* triton's own library (tl.sum, tl.cdiv...) is decorated at import: triton imported before
  TRITON_INTERPRET=1 is re-imported by __init__._triton_for_interpreter
* `not tensor` is a Python bool, device_assert never fires, out-of-bounds stores are not
  caught: the kernels use `== 0`, and the wrappers check arguments on the host.

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
