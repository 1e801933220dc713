"""mxval's exact stand-in for vLLM's `_fp32x2_to_fp4x2` (fused_indexer_q.py).

vLLM packs two fp32 values into one byte of e2m1 nibbles with inline PTX,
`cvt.rn.satfinite.e2m1x2.f32 tmp, x_hi, x_lo` (x_hi -> high nibble, x_lo -> low nibble),
an instruction that exists only on sm_100-class GPUs; inline asm does not run in the Triton
interpreter either. On every other target mxval compiles `EMULATION_SOURCE` in its place
(and says so: backend description, report header, dump `source`). On sm_100 the kernels
run unmodified.

What the instruction computes, per value (PTX ISA, cvt, .e2m1x2):
* round to nearest, ties to even, onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}: the midpoints
  0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to the code with an even mantissa bit
  (0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0);
* .satfinite: |x| > 6 (and +-inf) give +-6;
* the sign is kept, -0.0 and values that round to zero included (code | 8);
* NaN: e2m1 has no NaN; mxval writes +6 (0x7). Not verified on hardware (no sm_100 here);
  the kernels only see a NaN when their input is non-finite, which the harness reports
  as non-finite input before it compares bytes.
"""
from __future__ import annotations

import torch

from reference.formats import E2M1_MAX, E2M1_THRESHOLDS, E2M1_VALUES

HELPER = "_fp32x2_to_fp4x2"
HELPER_PARAMS = ("x_lo", "x_hi")
PTX_MARK = "e2m1x2"          # what the upstream helper must still contain to be the one we replace
NAN_CODE = 0x7

# the magnitude code counts the e2m1 thresholds at or below |x| (reference.formats)
_CODE_SUM = "\n            + ".join(f"(a >= {t!r}).to(tl.uint32)" for t in E2M1_THRESHOLDS)

EMULATION_SOURCE = f'''
@triton.jit
def _mxval_e2m1_code(x):
    a = tl.abs(x)
    code = ({_CODE_SUM})
    sign = (x.to(tl.uint32, bitcast=True) >> 31) & 1
    nan = x != x
    code = tl.where(nan, 7, code)
    sign = tl.where(nan, 0, sign)
    return code | (sign << 3)


@triton.jit
def _fp32x2_to_fp4x2(x_lo, x_hi):
    # mxval emulation of cvt.rn.satfinite.e2m1x2.f32 (see optimized/vllm_kernels/e2m1.py)
    return (_mxval_e2m1_code(x_lo) | (_mxval_e2m1_code(x_hi) << 4)).to(tl.uint8)
'''

_VALUES = torch.tensor(E2M1_VALUES, dtype=torch.float64)


def e2m1_code_table(x: torch.Tensor) -> torch.Tensor:
    """The same conversion computed another way (nearest value of the table in fp64, ties to
    the even code), for tests: fp32 tensor -> uint8 codes."""
    xd = x.double()
    a = xd.abs().clamp(max=E2M1_MAX)
    dist = (a[..., None] - _VALUES).abs()
    best = dist.min(dim=-1, keepdim=True).values
    cand = (dist == best)
    codes = torch.arange(8, dtype=torch.int64)
    # among tied codes, the even one (the two candidates of a tie are adjacent codes)
    even = cand & (codes % 2 == 0)
    pick = torch.where(even.any(-1), (even * (codes + 1)).max(-1).values - 1,
                       (cand * (codes + 1)).max(-1).values - 1)
    sign = torch.signbit(x).to(torch.int64)
    nan = torch.isnan(x)
    pick = torch.where(nan, torch.full_like(pick, NAN_CODE), pick)
    sign = torch.where(nan, torch.zeros_like(sign), sign)
    return (pick | (sign << 3)).to(torch.uint8)


def pack_table(x_lo: torch.Tensor, x_hi: torch.Tensor) -> torch.Tensor:
    return e2m1_code_table(x_lo) | (e2m1_code_table(x_hi) << 4)


def runs_unmodified(device_capability: tuple[int, int] | None) -> bool:
    """The PTX conversion exists on sm_100-class GPUs (compute capability 10.x)."""
    return device_capability is not None and device_capability[0] == 10
