"""Format constants and model presets: one small table each (NUMERICS.md §0, §4, §7)."""
from __future__ import annotations

import math
from dataclasses import dataclass

# --- MXFP4 (OCP MX, e2m1 elements with one e8m0 scale per 32) -----------------
MX_BLOCK = 32                      # elements per shared scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # code 0..7; code | 8 is the negative
E2M1_SIGN = 8                      # the sign bit of a code
E2M1_SIGNED = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)   # the value of every code 0..15
E2M1_MAX = E2M1_VALUES[-1]         # largest e2m1 magnitude
# Round to nearest, ties to the even code (the midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
# go to the code with an even mantissa bit), saturating at 6: the magnitude code of |y| is the
# number of these fp32 thresholds <= |y|. Threshold c is the smallest fp32 that rounds to
# code c + 1: the midpoint when c + 1 is even, else the fp32 just above it.
E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))
E2M1_THRESHOLDS = tuple(m if c % 2 else m + 2.0 ** (math.frexp(m)[1] - 24)   # m + one fp32 ulp
                        for c, m in enumerate(E2M1_MIDPOINTS))
E8M0_BIAS = 127
E8M0_NAN = 255                     # decodes to NaN
E8M0_ZERO_BLOCK = 1                # what the ceil rule stores for an all-zero block
F32_MANT_BITS = 23
F32_MIN_NORMAL = 2.0 ** -126
# The ceil rule (§4) takes the exponent of max(amax, E8M0_TINY_AMAX) * fp32(E2M1_INV_MAX).
E2M1_INV_MAX = 1.0 / E2M1_MAX      # the kernels hold it as fp32
E8M0_TINY_AMAX = E2M1_MAX * F32_MIN_NORMAL

# --- FP8 baseline (§7) ---------------------------------------------------------
FP8_FLAVOURS = {
    # name: (torch dtype name, the max the kernels scale to)
    "e4m3fn": ("float8_e4m3fn", 448.0),
    "e4m3fnuz": ("float8_e4m3fnuz", 224.0),  # gfx942; vLLM clamps to 224, not the type's 240
}
FP8_AMAX_FLOOR = 1e-4


@dataclass(frozen=True)
class ModelPreset:
    name: str
    index_heads: int          # H
    head_dim: int             # D
    rope_dim: int             # R: the LAST R dims are rotated
    compress_ratio: int       # r
    topk: int
    rms_eps: float
    kv_block: int             # tokens per KV block -> kv_block // r entries per page
    rope_base: float
    yarn_factor: float
    yarn_original_max_pos: int

    @property
    def page_size(self) -> int:
        return self.kv_block // self.compress_ratio

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def head_scale(self) -> float:
        return self.index_heads ** -0.5

    @property
    def weights_scale(self) -> float:
        """What vLLM passes to the Q quant: softmax_scale * head_scale."""
        return self.softmax_scale * self.head_scale


PRESETS = {
    p.name: p
    for p in (
        ModelPreset("deepseek-v4-pro", 64, 128, 64, 4, 1024, 1e-6, 256, 160000.0, 16.0, 65536),
        ModelPreset("deepseek-v4-flash", 64, 128, 64, 4, 512, 1e-6, 256, 160000.0, 16.0, 65536),
        ModelPreset("deepseek-v4.1", 32, 128, 64, 4, 512, 1e-20, 256, 160000.0, 16.0, 65536),
    )
}
DEFAULT_PRESET = "deepseek-v4-pro"


def preset(name: str = DEFAULT_PRESET) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"model: unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


# Rounding points after pooling (§1): which path the reference reproduces.
ROUNDING_PATHS = ("rocm", "cuda", "deepseek")
