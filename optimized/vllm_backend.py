"""Adapter: vLLM's DeepSeek-V4 ROCm indexer path (pooling, K store, Q quant, top-k) with
aiter's scorer (what vLLM calls on ROCm), behind the mxval interface.

The functions are pinned in `optimized.upstream` (`mxval upstream check` compares them
with a vLLM release):

    vllm.rocm.compress_pool  the pooling dispatcher of 0.33.0: (state_cache,
        token_to_req_indices, positions, kv_slot_mapping, block_table, block_size,
        pooled_k, state_width, compress_ratio, overlap), one program per pooled_k row;
        at 8e4f5df9 the kernel itself, launched kernel[(T,)](...)
    vllm.ops.k_store  (k, positions, cos_sin_cache, norm_weight, eps, kv_cache,
        slot_mapping, compress_ratio, use_fp4_cache, *, num_heads) -> None, in place
    vllm.ops.q_quant  (positions, q, cos_sin_cache, weights, softmax_scale, head_scale)
        -> ((q_fp4, q_scale as one int32 per head [T, H]), weights)
    vllm.ops.topk  (logits, lengths, out, k): vLLM's own choice of top-k kernel
        (aiter's or torch.ops._C's, by shape), so the adapter runs what vLLM runs
"""
from __future__ import annotations

import torch

from reference import checks, layout
from reference.formats import ROUNDING_PATHS
from reference.k_writer import check_mxfp4_k_writer
from reference.pooling import check_pool_args
from reference.q_quant import check_q_args

from . import DECLARED, Backend, aiter_backend
from .common import import_targets, on_device, paged_view, require_production, rocm_gfx950_reason, topk_on_device

NAME = "vllm"
FUNCTIONS = {
    "pool": "vllm.rocm.compress_pool",
    "k_store": "vllm.ops.k_store",
    "q_quant": "vllm.ops.q_quant",
    "topk": "vllm.ops.topk",
}
AITER_FUNCTIONS = {"paged_mxfp4_mqa_logits": aiter_backend.FUNCTIONS["paged_mxfp4_mqa_logits"]}
OPTIONAL = ("topk",)               # a layout without vLLM's top-k still serves the other ops

# The compressor overlaps windows only at ratio 4 (`overlap = compress_ratio == 4`), where a
# state row holds [kv (2D) | score (2D)]; at other ratios it pools r rows of [kv | score] (D
# each), a different computation from mxval's compress_pool.
POOL_OVERLAP_RATIO = 4


def heads_for_shuffle(shuffle, head_dim: int) -> int:
    """vLLM's K store takes the indexer's head count and lets aiter pick the layout from it
    (N = 32 if H >= 32 else 16 at D = 128): the head count that gives `shuffle`."""
    for h in (64, 16):
        if layout.choose_shuffle(head_dim, h) == shuffle:
            return h
    raise ValueError(f"shuffle: vLLM's K store writes aiter's preshuffled layouts "
                     f"([32, 16, 2] or [16, 16, 4] at D=128), got {shuffle and shuffle.as_list()}")


def scale_bytes(q_scale: torch.Tensor, q_fp4: torch.Tensor) -> torch.Tensor:
    """vLLM's Q quant hands back each head's D/32 e8m0 scales as one int32, [T, H] (and
    views it back to bytes before scoring): the same bytes as u8 [T, H, D/32]."""
    t, h = q_fp4.shape[:2]
    if q_scale.dtype == torch.uint8 and q_scale.dim() == 3:
        return q_scale
    if q_scale.dtype != torch.int32 or tuple(q_scale.shape) != (t, h):
        raise ValueError(f"q_scale: vLLM's Q quant returned {str(q_scale.dtype)[6:]} {list(q_scale.shape)}, "
                         f"expected int32 [{t}, {h}] (optimized.upstream: vllm.ops.q_quant)")
    return q_scale.contiguous().view(torch.uint8).view(t, h, -1)


def make_ops(fn: dict, device: str = "cuda", *, pool_kind: str = "function") -> dict:
    """mxval ops over vLLM's `fn` (FUNCTIONS labels) plus aiter's scorer. `pool_kind`:
    "function" for the 0.33.0 dispatcher, "triton_jit" for the 8e4f5df9 kernel."""
    ops = {}

    if "pool" in fn:
        def compress_pool(*, state_cache, block_table, positions, req_index, kv_slot_mapping,
                          compress_ratio: int = 4, rounding: str = "rocm") -> dict:
            checks.choice("rounding", rounding, ROUNDING_PATHS)
            require_production(rounding=rounding, who="vLLM's ROCm pooling kernel")
            check_pool_args(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
            if compress_ratio != POOL_OVERLAP_RATIO:
                raise ValueError(f"compress_ratio: vLLM's compressor pools overlapping windows only at ratio "
                                 f"{POOL_OVERLAP_RATIO}; at {compress_ratio} it computes another pooling than "
                                 "mxval's compress_pool (use the reference or triton backend)")
            (sc, bt, pos, req, slots), back = on_device(device, state_cache, block_table, positions,
                                                        req_index, kv_slot_mapping)
            t, d = positions.shape[0], state_cache.shape[-1] // 4
            overlap = compress_ratio == POOL_OVERLAP_RATIO
            state_width = state_cache.shape[-1] // 2      # kv then score, as the compressor sizes it
            out = torch.full((t, d), float("nan"), dtype=torch.bfloat16, device=device)
            if t and pool_kind == "function":
                fn["pool"](sc, req, pos, slots, bt, sc.shape[1], out, state_width, compress_ratio, overlap)
            elif t:
                fn["pool"][(t,)](sc, sc.stride(0), sc.stride(1), req, pos, slots, bt, bt.stride(0),
                                 sc.shape[1], out, out.stride(0), HEAD_SIZE=d, STATE_WIDTH=state_width,
                                 COMPRESS_RATIO=compress_ratio, OVERLAP=overlap, num_warps=1)
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
            return {"q_fp4": back(q_fp4, q), "q_scale": back(scale_bytes(q_scale, q_fp4), q),
                    "weights": back(w, weights)}
        ops["q_rope_mxfp4_quant"] = q_rope_mxfp4_quant

    if "topk" in fn:
        def topk(*, logits, lengths, k: int) -> dict:
            x, ln, idx, back = topk_on_device("vLLM's", device, logits, lengths, k)
            fn["topk"](x, ln.to(torch.int32).contiguous(), idx, k)
            return {"indices": back(idx, logits)}
        ops["topk"] = topk

    ops.update(aiter_backend.make_ops({k: v for k, v in fn.items() if k in AITER_FUNCTIONS}, device))
    return ops


def make_backend() -> Backend:
    desc = DECLARED[NAME].summary
    fn, which, missing = import_targets({**FUNCTIONS, **AITER_FUNCTIONS})
    if "vllm is not importable" not in " ".join(missing):
        missing = [m for m in missing if not any(m.startswith(FUNCTIONS[o] + ":") for o in OPTIONAL)]
    platform = rocm_gfx950_reason()
    reason = "; ".join(missing + ([platform] if platform else [])) or None
    if reason:
        return Backend(NAME, desc, reason=reason)
    return Backend(NAME, desc, make_ops(fn, pool_kind=which["pool"].kind), device="cuda")
