"""Adapter: vLLM's DeepSeek-V4 ROCm indexer path (pooling kernel, K store, Q quant) with
aiter's scorer and top-k (what vLLM calls on ROCm), behind the mxval interface.

Signatures looked up in vLLM's public source (nothing copied):

    _compress_pool_kernel[(T,)](state_cache, stride0, stride1, token_to_req_indices,
        positions, kv_slot_mapping, block_table, block_table_stride, block_size, out,
        out_stride, HEAD_SIZE=, STATE_WIDTH=, COMPRESS_RATIO=, OVERLAP=)  (bf16 rows)
    rocm_mxfp4_indexer_k_store(k, positions, cos_sin_cache, norm_weight, eps, kv_cache,
        slot_mapping, compress_ratio, use_fp4_cache, num_heads=)       -> None, in place
    rocm_mxfp4_indexer_q_quant(positions, q, cos_sin_cache, weights, softmax_scale,
        head_scale) -> ((q_fp4, q_scale), weights)

The pooling kernel lives in vLLM's DeepSeek-V4 ROCm model file, whose module path has
moved between versions: the candidates below are tried in order, and
MXVAL_VLLM_POOL_MODULE names another.
"""
from __future__ import annotations

import os

import torch

from reference import layout
from reference.formats import ROUNDING_PATHS
from reference.k_writer import check_mxfp4_k_writer
from reference.pooling import _check as check_pool_args
from reference.q_quant import check_q_args
from reference import checks

from . import Backend, aiter_backend
from .common import import_reason, on_device, paged_view, require_production, rocm_gfx950_reason

NAME = "vllm"
OPS_MODULE = "vllm.v1.attention.ops.rocm_paged_mxfp4_indexer"
POOL_MODULES = ("vllm.models.deepseek_v4.rocm_mxfp4_indexer",
                "vllm.model_executor.models.deepseek_v4.rocm_mxfp4_indexer",
                "vllm.models.deepseek_v4.rocm_paged_mxfp4_indexer")
FUNCTIONS = {
    "k_store": f"{OPS_MODULE}:rocm_mxfp4_indexer_k_store",
    "q_quant": f"{OPS_MODULE}:rocm_mxfp4_indexer_q_quant",
}


def _find_pool_kernel():
    mods = ([os.environ["MXVAL_VLLM_POOL_MODULE"]] if os.environ.get("MXVAL_VLLM_POOL_MODULE")
            else list(POOL_MODULES))
    fn, missing = import_reason({m: f"{m}:_compress_pool_kernel" for m in mods})
    if fn:
        return next(iter(fn.values())), None
    return None, ("vLLM's _compress_pool_kernel not found (tried " + ", ".join(mods)
                  + "; set MXVAL_VLLM_POOL_MODULE)")


def heads_for_shuffle(shuffle, head_dim: int) -> int:
    """vLLM's K store takes the indexer's head count and lets aiter pick the layout from it
    (N = 32 if H >= 32 else 16 at D = 128): the head count that gives `shuffle`."""
    for h in (64, 16):
        if layout.choose_shuffle(head_dim, h) == shuffle:
            return h
    raise ValueError(f"shuffle: vLLM's K store writes aiter's preshuffled layouts "
                     f"([32, 16, 2] or [16, 16, 4] at D=128), got {shuffle and shuffle.as_list()}")


def make_ops(fn: dict, device: str = "cuda") -> dict:
    """mxval ops over vLLM's `fn` ("pool", "k_store", "q_quant") plus aiter's scorer/top-k."""
    ops = {}

    if "pool" in fn:
        def compress_pool(*, state_cache, block_table, positions, req_index, kv_slot_mapping,
                          compress_ratio: int = 4, rounding: str = "rocm") -> dict:
            checks.choice("rounding", rounding, ROUNDING_PATHS)
            require_production(rounding=rounding, who="vLLM's ROCm pooling kernel")
            check_pool_args(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
            (sc, bt, pos, req, slots), back = on_device(device, state_cache, block_table, positions,
                                                        req_index, kv_slot_mapping)
            t, d = positions.shape[0], state_cache.shape[-1] // 4
            out = torch.full((t, d), float("nan"), dtype=torch.bfloat16, device=device)
            if t:
                fn["pool"][(t,)](sc, sc.stride(0), sc.stride(1), req, pos, slots, bt, bt.stride(0),
                                 sc.shape[1], out, out.stride(0), HEAD_SIZE=d, STATE_WIDTH=2 * d,
                                 COMPRESS_RATIO=compress_ratio, OVERLAP=1, num_warps=1)
            return {"pooled": back(out, state_cache)}
        ops["compress_pool"] = compress_pool

    if "k_store" in fn:
        def k_norm_rope_mxfp4_cache(*, k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                    norm_eps: float = 1e-6, compress_ratio: int = 4, page_size: int = 64,
                                    shuffle=(32, 16, 2), rounding: str = "rocm", hadamard: bool = False,
                                    scale_rule: str = "ceil") -> dict:
            require_production(rounding=rounding, scale_rule=scale_rule, hadamard=hadamard, who="vLLM's K store")
            shuf = check_mxfp4_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                        norm_eps, compress_ratio, page_size, shuffle, rounding)
            heads = heads_for_shuffle(shuf, k.shape[1])
            (kd, pd, cd, wd, sd), back = on_device(device, k, positions, cos_sin_cache, norm_weight, slot_mapping)
            out = kv_cache.to(device, copy=True)
            fn["k_store"](kd.contiguous(), pd.contiguous(), cd, wd, float(norm_eps),
                          paged_view(out, page_size, layout.entry_bytes(k.shape[1])), sd.contiguous(),
                          compress_ratio, True, num_heads=heads)
            return {"kv_cache": back(out, kv_cache)}
        ops["k_norm_rope_mxfp4_cache"] = k_norm_rope_mxfp4_cache

    if "q_quant" in fn:
        def q_rope_mxfp4_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                               hadamard: bool = False, scale_rule: str = "ceil") -> dict:
            require_production(scale_rule=scale_rule, hadamard=hadamard, who="vLLM's Q quant")
            check_q_args(q, positions, cos_sin_cache, weights, weights_scale)
            (qd, pd, cd, wd), back = on_device(device, q, positions, cos_sin_cache, weights)
            # vLLM passes softmax_scale and head_scale and aiter multiplies by their product;
            # the dump holds that product, so it goes in whole with a head scale of 1.
            (q_fp4, q_scale), w = fn["q_quant"](pd.contiguous(), qd, cd, wd.contiguous(), float(weights_scale), 1.0)
            return {"q_fp4": back(q_fp4, q), "q_scale": back(q_scale, q), "weights": back(w, weights)}
        ops["q_rope_mxfp4_quant"] = q_rope_mxfp4_quant

    ops.update(aiter_backend.make_ops({k: v for k, v in fn.items() if k in ("paged_mxfp4_mqa_logits", "topk")},
                                      device))
    return ops


def make_backend() -> Backend:
    desc = "vLLM's DeepSeek-V4 ROCm indexer (pooling kernel, K store, Q quant) + aiter's scorer and top-k"
    fn, missing = import_reason({**FUNCTIONS, **{k: v for k, v in aiter_backend.FUNCTIONS.items()
                                                  if k in ("paged_mxfp4_mqa_logits", "topk")}})
    pool, why = _find_pool_kernel()
    if why and not any(m.startswith("vllm ") for m in missing):
        missing.append(why)
    platform = rocm_gfx950_reason()
    reason = "; ".join(missing + ([platform] if platform else [])) or None
    if reason:
        return Backend(NAME, desc, reason=reason)
    return Backend(NAME, desc, make_ops({**fn, "pool": pool}), device="cuda")
