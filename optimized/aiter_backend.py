"""Adapter: aiter's ROCm ops (gfx950) behind the mxval backend interface.

Thin by design: arguments are checked with the reference's own checks, moved to the GPU,
and mapped onto aiter's signatures (looked up in aiter's public source; nothing copied):

    k_norm_rope_mxfp4_cache(k, positions, cos_sin_cache, norm_weight, norm_eps, kv_cache,
                            slot_mapping, compress_ratio, shuffle)       -> None, in place
    q_rope_mxfp4_quant(q, positions, cos_sin_cache, weights, weights_scale)
                                                     -> (q_fp4, q_scale, weights)
    paged_mxfp4_mqa_logits(q [B, next_n, H, D/2], q_scales, kv_cache [P, ps, 1, 68],
                           weights, context_lens, block_table, max_model_len,
                           out_logits=, clean_logits=, preshuffle=, cu_ends=) -> logits
    top_k_per_row_decode(logits, next_n, seq_lens, indices, num_rows, stride0, stride1, k)

The pool is cloned first (the mxval op returns a new pool; aiter writes in place).
"""
from __future__ import annotations

import torch

from reference import layout
from reference.k_writer import check_mxfp4_k_writer
from reference.q_quant import check_q_args
from reference.scoring import check_mxfp4_scorer
from reference.topk import check_topk_args

from . import Backend
from .common import (equal_row_groups, import_reason, on_device, paged_view, require_production,
                     rocm_gfx950_reason)

NAME = "aiter"
FUNCTIONS = {
    "k_norm_rope_mxfp4_cache": "aiter.ops.triton.fusions.k_norm_rope_mxfp4_cache:k_norm_rope_mxfp4_cache",
    "q_rope_mxfp4_quant": "aiter.ops.triton.rope.q_rope_mxfp4_quant:q_rope_mxfp4_quant",
    "paged_mxfp4_mqa_logits": "aiter.ops.triton.attention.pa_mqa_logits_mxfp4:paged_mxfp4_mqa_logits",
    "topk": "aiter:top_k_per_row_decode",
}


def make_ops(fn: dict, device: str = "cuda") -> dict:
    """mxval ops over aiter's functions `fn` (by FUNCTIONS label). Tests pass fakes."""
    ops = {}

    if "k_norm_rope_mxfp4_cache" in fn:
        def k_norm_rope_mxfp4_cache(*, k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                    norm_eps: float = 1e-6, compress_ratio: int = 4, page_size: int = 64,
                                    shuffle=(32, 16, 2), rounding: str = "rocm", hadamard: bool = False,
                                    scale_rule: str = "ceil") -> dict:
            require_production(rounding=rounding, scale_rule=scale_rule, hadamard=hadamard, who="aiter's K writer")
            shuf = check_mxfp4_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                        norm_eps, compress_ratio, page_size, shuffle, rounding)
            (kd, pd, cd, wd, sd), back = on_device(device, k, positions, cos_sin_cache, norm_weight, slot_mapping)
            out = kv_cache.to(device, copy=True)
            fn["k_norm_rope_mxfp4_cache"](kd.contiguous(), pd.contiguous(), cd, wd, float(norm_eps),
                                          paged_view(out, page_size, layout.entry_bytes(k.shape[1])),
                                          sd.contiguous(), compress_ratio,
                                          tuple(shuf.as_list()) if shuf else None)
            return {"kv_cache": back(out, kv_cache)}
        ops["k_norm_rope_mxfp4_cache"] = k_norm_rope_mxfp4_cache

    if "q_rope_mxfp4_quant" in fn:
        def q_rope_mxfp4_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                               hadamard: bool = False, scale_rule: str = "ceil") -> dict:
            require_production(scale_rule=scale_rule, hadamard=hadamard, who="aiter's Q quant")
            check_q_args(q, positions, cos_sin_cache, weights, weights_scale)
            (qd, pd, cd, wd), back = on_device(device, q, positions, cos_sin_cache, weights)
            q_fp4, q_scale, w = fn["q_rope_mxfp4_quant"](qd, pd.contiguous(), cd, wd.contiguous(),
                                                          float(weights_scale))
            return {"q_fp4": back(q_fp4, q), "q_scale": back(q_scale, q), "weights": back(w, weights)}
        ops["q_rope_mxfp4_quant"] = q_rope_mxfp4_quant

    if "paged_mxfp4_mqa_logits" in fn:
        def paged_mxfp4_mqa_logits(*, q_fp4, q_scale, weights, kv_cache, query_start_loc, context_lens,
                                   block_table, row_ends, page_size: int = 64, shuffle=(32, 16, 2),
                                   clean_logits: bool = False, width: int | None = None) -> dict:
            shuf, d, width = check_mxfp4_scorer(q_fp4, q_scale, weights, kv_cache, query_start_loc,
                                                context_lens, block_table, row_ends, page_size, shuffle, width)
            rw, h, tb = q_fp4.shape
            if shuf is not None and shuf != layout.choose_shuffle(d, h):
                raise ValueError(f"shuffle: aiter's scorer reads {layout.choose_shuffle(d, h).as_list()} "
                                 f"pages for H={h}, D={d}; got {shuf.as_list()}")
            (qv, qs, w, kc, bt, cl, ends), back = on_device(device, q_fp4, q_scale, weights, kv_cache,
                                                            block_table, context_lens, row_ends)
            fill = float("-inf") if clean_logits else 0.0
            out = torch.full((rw, width), fill, dtype=torch.float32, device=device)
            pages = paged_view(kc, page_size, layout.entry_bytes(d))
            for s0, s1, r0, n in equal_row_groups(query_start_loc):
                r1 = r0 + (s1 - s0) * n
                fn["paged_mxfp4_mqa_logits"](
                    qv[r0:r1].reshape(s1 - s0, n, h, tb), qs[r0:r1].reshape(s1 - s0, n, h, d // 32), pages,
                    w[r0:r1].contiguous(), cl[s0:s1].to(torch.int32).contiguous(),
                    bt[s0:s1].to(torch.int32).contiguous(), width, out_logits=out[r0:r1],
                    clean_logits=clean_logits, preshuffle=int(shuf is not None),
                    cu_ends=ends[r0:r1].to(torch.int32).contiguous())
            return {"logits": back(out, weights)}
        ops["paged_mxfp4_mqa_logits"] = paged_mxfp4_mqa_logits

    if "topk" in fn:
        def topk(*, logits, lengths, k: int) -> dict:
            check_topk_args(logits, lengths, k)
            if logits.dtype != torch.float32:
                raise ValueError(f"logits: aiter's top-k takes float32, got {str(logits.dtype)[6:]}")
            (x, ln), back = on_device(device, logits, lengths)
            idx = torch.empty(x.shape[0], k, dtype=torch.int32, device=device)
            # next_n = 1 and seq_lens = the row lengths: row r sees [0, lengths[r])
            fn["topk"](x, 1, ln.to(torch.int32).contiguous(), idx, x.shape[0], x.stride(0), x.stride(1), k)
            return {"indices": back(idx, logits)}
        ops["topk"] = topk

    return ops


def make_backend() -> Backend:
    desc = "aiter's ROCm ops (K writer, Q quant, paged MXFP4 scorer, top-k), gfx950"
    fn, missing = import_reason(FUNCTIONS)
    platform = rocm_gfx950_reason()
    reason = "; ".join(missing + ([platform] if platform else [])) or None
    if reason:
        return Backend(NAME, desc, reason=reason)
    return Backend(NAME, desc, make_ops(fn), device="cuda")
