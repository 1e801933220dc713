"""The FP8 baseline ops (NUMERICS.md §7) on the same kernels as the MXFP4 path: the K
writer and the Q quant with an FP8 epilogue, and the scorer with an FP8 decoder. FP8 is
encoded and decoded by bit arithmetic (numerics.py), so e4m3fn and gfx942's e4m3fnuz
work on any GPU and in the interpreter."""
from __future__ import annotations

import torch

from reference.fp8 import check_fp8_k_writer, check_fp8_scorer, fp8_flavour
from reference.q_quant import check_q_args

from ..common import on_device, reject_hadamard
from . import k_writer, q_quant, scoring


def make_op(device: str):
    def k_norm_rope_fp8_cache(*, k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                              norm_eps: float = 1e-6, compress_ratio: int = 4, page_size: int = 64,
                              fp8_dtype: str = "e4m3fn", rounding: str = "rocm",
                              hadamard: bool = False) -> dict:
        reject_hadamard(hadamard)
        check_fp8_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache, norm_eps,
                           compress_ratio, page_size, fp8_dtype, rounding)
        args, back = on_device(device, k, positions, cos_sin_cache, norm_weight, slot_mapping)
        out = kv_cache.to(device, copy=True)
        k_writer.launch(*args, out, norm_eps=norm_eps, compress_ratio=compress_ratio,
                        page_size=page_size, shuffle=None, rounding=rounding, fp8_dtype=fp8_dtype)
        return {"kv_cache": back(out, kv_cache)}

    def q_rope_fp8_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                         fp8_dtype: str = "e4m3fn", hadamard: bool = False) -> dict:
        reject_hadamard(hadamard)
        fp8_flavour(fp8_dtype)
        check_q_args(q, positions, cos_sin_cache, weights, weights_scale)
        (qd, pd, cd, wd), back = on_device(device, q, positions, cos_sin_cache, weights)
        v, s = q_quant.launch(qd, pd, cd, fp8_dtype=fp8_dtype)
        # the q scale is folded, in the reference's order: (w * s_q) * weights_scale
        w = wd.float() * s * torch.tensor(weights_scale, dtype=torch.float32, device=wd.device)
        return {"q_fp8": back(v, q), "weights": back(w, weights)}

    def paged_fp8_mqa_logits(*, q_fp8, weights, kv_cache, query_start_loc, context_lens, block_table,
                             row_ends, page_size: int = 64, fp8_dtype: str = "e4m3fn",
                             clean_logits: bool = False, width: int | None = None) -> dict:
        width = check_fp8_scorer(q_fp8, weights, kv_cache, query_start_loc, context_lens, block_table,
                                 row_ends, page_size, fp8_dtype, width)
        (qv, w, kc, bt, ends), tiles, config, back = scoring.prepare(
            device, query_start_loc, row_ends, weights.shape[1], q_fp8, weights, kv_cache, block_table)
        out = scoring.launch(qv, None, w, kc, bt, tiles, ends, width=width,
                             page_size=page_size, shuffle=None, clean_logits=clean_logits,
                             fp8_dtype=fp8_dtype, config=config)
        return {"logits": back(out, weights)}

    return {"k_norm_rope_fp8_cache": k_norm_rope_fp8_cache, "q_rope_fp8_quant": q_rope_fp8_quant,
            "paged_fp8_mqa_logits": paged_fp8_mqa_logits}
