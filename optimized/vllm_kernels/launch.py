"""Launch arguments of vLLM's kernels, written by mxval from vLLM's launchers (0.33.0; 0.34.0's
launchers pin the same values, `mxval upstream check --vllm 0.34.0`).

Each builder returns (grid, kernel keyword arguments, launch options), following the
launcher named beside it (pinned in optimized.upstream, so `mxval upstream check` says when
the launcher changed). Two checks make drift an error instead of a silent wrong launch:

* `check_kernel`: the kernel's parameter list, as parsed from the source, must be the
  table's (names, order, constexpr marks);
* `check_args`: a builder must bind exactly the table's parameters.
"""
from __future__ import annotations

import torch

from .. import upstream

FP8_MAX = 448.0                 # FusedKVCompressNormRopeInsertIndexerTritonKernel: FP8_MAX=448.0
MXFP4_BLOCK = 32                # fused_indexer_q.MXFP4_BLOCK_SIZE; the K dispatch's fp4 quant block
FP8_QUANT_BLOCK = 128           # the K dispatch launches the FP8 writer with one 128-wide quant block (== D)
OVERLAP_RATIO = 4               # dispatch: overlap = compress_ratio == 4

K_KEYS = {"mxfp4": "vllm.cuda.k_mxfp4", "fp8": "vllm.cuda.k_fp8"}
Q_KEYS = {"mxfp4": "vllm.cuda.q_mxfp4", "fp8": "vllm.cuda.q_fp8"}
POOL_KEY = "vllm.rocm.compress_pool_kernel"


class LaunchDrift(RuntimeError):
    """The kernel's parameters are not the ones mxval launches it with."""


def table_params(key: str) -> list[tuple[str, bool]]:
    t = upstream.target(key)
    return [(p.split(":", 1)[0], p.endswith(":constexpr")) for p in t.params if p != "*"]


def check_kernel(key: str, params) -> None:
    """`params`: the loader's Param list of the kernel as upstream wrote it."""
    want = table_params(key)
    have = [(p.name, p.constexpr) for p in params]
    if want == have:
        return
    wn, hn = [n for n, _ in want], [n for n, _ in have]
    problems = []
    if set(hn) - set(wn):
        problems.append("new upstream: " + ", ".join(n for n in hn if n not in wn))
    if set(wn) - set(hn):
        problems.append("gone upstream: " + ", ".join(n for n in wn if n not in hn))
    if not problems and wn != hn:
        problems.append("reordered")
    flips = [n for (n, c) in want if n in dict(have) and dict(have)[n] != c]
    if flips:
        problems.append("constexpr changed: " + ", ".join(flips))
    t = upstream.target(key)
    raise LaunchDrift(f"{t.module}:{t.name}: parameters drifted from optimized/upstream.py ({'; '.join(problems)}); "
                      "update the table entry and optimized/vllm_kernels/launch.py from the new launcher")


def check_args(key: str, kwargs: dict) -> None:
    want = [n for n, _ in table_params(key)]
    if set(kwargs) != set(want):
        extra, missing = sorted(set(kwargs) - set(want)), [n for n in want if n not in kwargs]
        raise LaunchDrift(f"{key}: mxval's launch binds {extra or '-'} beyond and misses {missing or '-'} of "
                          "the kernel's parameters")


def next_pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def fused_k(fmt: str, *, state_cache, block_table, positions, req_index, kv_slot_mapping, cos_sin_cache,
            norm_weight, norm_eps: float, kv_cache, page_size: int, compress_ratio: int, mx_scale: bool = False):
    """FusedKVCompressNormRopeInsertIndexerTritonKernel.__call__ with .dispatch's values:
    one program per token; quant block 32 (MXFP4) or 128 (FP8); token stride D/2 or D;
    scale dim D/32 or 4 (one fp32); STATE_WIDTH = D * (1 + overlap); num_warps 1.

    The compressor's state slot mapping (`slot_mapping_ptr`: negative = padding token) and
    the cache's slot mapping are both mxval's kv_slot_mapping: a token that writes no entry
    is skipped either way."""
    d = state_cache.shape[-1] // 4
    overlap = compress_ratio == OVERLAP_RATIO
    fp4 = fmt == "mxfp4"
    kw = dict(
        state_cache_ptr=state_cache, state_cache_stride0=state_cache.stride(0),
        state_cache_stride1=state_cache.stride(1),
        token_to_req_indices_ptr=req_index, positions_ptr=positions, slot_mapping_ptr=kv_slot_mapping,
        block_table_ptr=block_table, block_table_stride=block_table.stride(0), block_size=state_cache.shape[1],
        rms_norm_weight_ptr=norm_weight, rms_norm_eps=float(norm_eps),
        cos_sin_cache_ptr=cos_sin_cache, cos_sin_stride=cos_sin_cache.stride(0),
        k_cache_ptr=kv_cache, kv_slot_mapping_ptr=kv_slot_mapping, kv_cache_block_size=page_size,
        HEAD_SIZE=d, TRITON_BLOCK_SIZE=next_pow2(d), STATE_WIDTH=d * (1 + overlap),
        COMPRESS_RATIO=compress_ratio, OVERLAP=overlap, ROPE_HEAD_DIM=cos_sin_cache.shape[-1],
        FP8_MAX=FP8_MAX, QUANT_BLOCK=MXFP4_BLOCK if fp4 else FP8_QUANT_BLOCK,
        TOKEN_STRIDE=d // 2 if fp4 else d, SCALE_DIM=d // MXFP4_BLOCK if fp4 else 4,
        KV_BLOCK_STRIDE=kv_cache.stride(0), MX_SCALE=bool(mx_scale) and not fp4,
    )
    check_args(K_KEYS[fmt], kw)
    return (positions.shape[0],), kw, dict(num_warps=1)


def q_quant(fmt: str, *, q, positions, cos_sin_cache, weights, softmax_scale: float, head_scale: float,
            out, scale=None, weights_out):
    """FusedIndexerQRope{MxFp4,Quant}TritonKernel.__call__: grid (T, H), num_warps 1,
    enable_fp_fusion (the RoPE products contract into FMAs when compiled)."""
    kw = dict(pos_ptr=positions, index_q_ptr=q, index_q_stride0=q.stride(0), index_q_stride1=q.stride(1),
              index_q_cos_sin_ptr=cos_sin_cache, index_q_cos_sin_stride=cos_sin_cache.stride(0),
              INDEX_Q_HALF_ROT_DIM=cos_sin_cache.shape[-1] // 2, INDEX_Q_HEAD_DIM=q.shape[2],
              index_weights_ptr=weights, index_weights_stride=weights.stride(0),
              index_weights_softmax_scale=float(softmax_scale), index_weights_head_scale=float(head_scale),
              index_weights_out_ptr=weights_out, index_weights_out_stride=weights_out.stride(0))
    if fmt == "mxfp4":
        kw.update(index_q_mxfp4_ptr=out, index_q_mxfp4_stride0=out.stride(0), index_q_mxfp4_stride1=out.stride(1),
                  index_q_scale_ptr=scale, index_q_scale_stride0=scale.stride(0),
                  index_q_scale_stride1=scale.stride(1), MXFP4_BLOCK=MXFP4_BLOCK)
    else:
        kw.update(index_q_fp8_ptr=out, index_q_fp8_stride0=out.stride(0), index_q_fp8_stride1=out.stride(1),
                  FP8_MAX=FP8_MAX, USE_FNUZ=False, USE_EXPLICIT_FMA=False)
    check_args(Q_KEYS[fmt], kw)
    return (q.shape[0], q.shape[1]), kw, dict(num_warps=1, enable_fp_fusion=True)


def pool(*, state_cache, block_table, positions, req_index, kv_slot_mapping, out, compress_ratio: int):
    """vLLM's ROCm `compress_pool` dispatcher (table key vllm.rocm.compress_pool): grid (pooled_k rows,),
    HEAD_SIZE = pooled_k.shape[1], STATE_WIDTH = the compressor's state width (2D), num_warps 1."""
    kw = dict(state_cache_ptr=state_cache, state_cache_stride0=state_cache.stride(0),
              state_cache_stride1=state_cache.stride(1), token_to_req_indices_ptr=req_index,
              positions_ptr=positions, kv_slot_mapping_ptr=kv_slot_mapping, block_table_ptr=block_table,
              block_table_stride=block_table.stride(0), block_size=state_cache.shape[1],
              pooled_k_ptr=out, pooled_k_stride=out.stride(0), HEAD_SIZE=out.shape[1],
              STATE_WIDTH=state_cache.shape[-1] // 2, COMPRESS_RATIO=compress_ratio,
              OVERLAP=compress_ratio == OVERLAP_RATIO)
    check_args(POOL_KEY, kw)
    return (out.shape[0],), kw, dict(num_warps=1)


def run(kernel, built, *, interpreted: bool) -> None:
    grid, kw, opts = built
    if grid[0] == 0:
        return
    if interpreted:
        from . import interp_patch
        with interp_patch.active():
            kernel[grid](**kw)
    else:
        kernel[grid](**kw, **opts)


__all__ = ["LaunchDrift", "check_kernel", "check_args", "fused_k", "q_quant", "pool", "run", "torch"]
