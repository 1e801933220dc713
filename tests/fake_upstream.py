"""Fake aiter and vLLM modules, built from the upstream table (optimized.upstream).

`FAKES` maps table keys to fakes. Each fake has the signature and return convention of
its entry -- `test_every_fake_matches_its_table_entry` compares each fake's own source with
the entry exactly as `mxval upstream check` compares upstream's -- and is installed at the
module path and name the table gives (`install`), for the upstream versions asked for
(the entries' `versions`). A fake checks what it receives the way the real op reads it
(dtypes, shapes, page size from the page bytes, layout from the head count or the
preshuffle flag, row bounds from row_ends or cu_ends) and computes through the reference,
so an adapter or a capture that maps the fields correctly reproduces the reference exactly.
Calls are logged in `CALLS` (key, and what the fake noticed).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from typing import Callable, NamedTuple

import torch

import reference
from optimized import upstream
from reference import layout, scoring
from reference.topk import topk_indices

CALLS: list[tuple] = []
SCALE_MODE_WIDE = 1
CANDIDATE_BLOCK = 8
DispatchSpec = tuple
tl = types.SimpleNamespace(constexpr="constexpr")      # annotations stay strings here


def _load(key: str):
    """The table target as installed now (what a real `from module import name` would get)."""
    t = upstream.target(key)
    return getattr(importlib.import_module(t.module), t.name)


# --- aiter ------------------------------------------------------------------------------

def _pages(kv_cache: torch.Tensor, head_dim: int):
    """aiter's reading of a pool: [P, page, (1,) bytes] viewed per page; page size from the bytes."""
    assert kv_cache.dtype == torch.uint8 and kv_cache.dim() in (3, 4)
    assert kv_cache.dim() == 3 or kv_cache.shape[2] == 1
    pages = kv_cache.view(kv_cache.shape[0], -1)
    return pages, pages.shape[1] // layout.entry_bytes(head_dim)


def k_norm_rope_mxfp4_cache(k, positions, cos_sin_cache, norm_weight, norm_eps, kv_cache, slot_mapping,
                            compress_ratio=1, shuffle=None) -> None:
    CALLS.append(("aiter.k_writer",))
    assert isinstance(norm_eps, float) and isinstance(compress_ratio, int) and k.dtype == torch.bfloat16
    pages, page_size = _pages(kv_cache, k.shape[1])
    out = reference.k_norm_rope_mxfp4_cache(
        k=k[:slot_mapping.numel()], positions=positions[:slot_mapping.numel()], cos_sin_cache=cos_sin_cache,
        norm_weight=norm_weight, slot_mapping=slot_mapping, kv_cache=pages.clone(), norm_eps=norm_eps,
        compress_ratio=compress_ratio, page_size=page_size,
        shuffle=[int(v) for v in shuffle] if shuffle is not None else None)["kv_cache"]
    pages.copy_(out)


def q_rope_mxfp4_quant(q, positions, cos_sin_cache, weights=None, weights_scale=1.0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    CALLS.append(("aiter.q_quant",))
    assert q.dim() == 3 and positions.dim() == 1 and isinstance(weights_scale, float)
    o = reference.q_rope_mxfp4_quant(q=q, positions=positions, cos_sin_cache=cos_sin_cache, weights=weights,
                                     weights_scale=weights_scale)
    return o["q_fp4"], o["q_scale"], o["weights"]


def _default_ends(context_lens, next_n):
    n = torch.arange(next_n, dtype=torch.int32).repeat(context_lens.numel())
    return (context_lens.repeat_interleave(next_n) - next_n + n + 1).clamp_min(0).to(torch.int32)


def _score(q, q_scales, kv_cache, weights, query_start_loc, context_lens, block_table, ends, width,
           out_logits, clean_logits, preshuffle, block_scores, calc_logits, calc_block_scores, cand):
    """The scorer on [Rw, H, D/2] rows; writes out_logits / block_scores, returns aiter's way."""
    rw, h, tb = q.shape
    assert q.dtype == q_scales.dtype == torch.uint8 and q_scales.shape == (rw, h, 2 * tb // 32)
    assert block_table.dtype == context_lens.dtype == torch.int32
    assert block_table.shape[0] == context_lens.numel() == query_start_loc.numel() - 1
    assert weights.shape == (rw, h) and weights.dtype == torch.float32
    assert ends.dtype == torch.int32 and ends.shape == (rw,)
    pages, page_size = _pages(kv_cache, 2 * tb)
    ref = scoring.paged_mxfp4_mqa_logits_fp64(
        q_fp4=q, q_scale=q_scales, weights=weights, kv_cache=pages, query_start_loc=query_start_loc,
        context_lens=context_lens, block_table=block_table, row_ends=ends, page_size=page_size,
        shuffle=layout.choose_shuffle(2 * tb, h) if preshuffle else None, width=width).float()
    valid = torch.arange(width)[None] < ends.long()[:, None]
    fill = float("-inf") if clean_logits else float("nan")       # unspecified: make it visible
    logits = None
    if calc_logits:
        logits = out_logits if out_logits is not None else torch.full((rw, width), fill)
        assert logits.shape == (rw, width)
        logits[valid] = ref[valid]
    if calc_block_scores:
        nb = -(-width // cand)
        if block_scores is None:
            block_scores = torch.full((rw, nb), fill)
        padded = torch.full((rw, nb * cand), float("-inf"))
        padded[:, :width] = torch.where(valid, ref, float("-inf"))
        block_scores[:, :nb] = padded.view(rw, nb, cand).amax(-1)
        newest = ((ends.long() - 1).clamp_min(0) // cand)[:, None]
        block_scores[:, :nb].scatter_(1, newest, float("inf"))
    if calc_logits and calc_block_scores:
        return logits, block_scores
    return logits if calc_logits else block_scores


def paged_mxfp4_mqa_logits(q, q_scales, kv_cache, weights, context_lens, block_table, max_model_len,
                           kv_scale_cache=None, out_logits=None, clean_logits=True, preshuffle=1,
                           scale_mode=SCALE_MODE_WIDE, dynamic=0, schedule=None, row_ends=None,
                           query_start_loc=None, next_n=None, use_gather=False, candidates=None,
                           block_scores=None, calc_logits=True, calc_block_scores=False,
                           candidate_block_size=CANDIDATE_BLOCK) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The row_ends generation: varlen q [Rw, H, D/2] with query_start_loc, or [B, next_n, H, D/2]."""
    assert kv_scale_cache is None and scale_mode == SCALE_MODE_WIDE
    if query_start_loc is not None:
        assert q.dim() == 3 and query_start_loc.dtype == torch.int32
        qsl, rows, qs = query_start_loc, q, q_scales
    else:
        assert next_n is None and q.dim() == 4
        qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32) * q.shape[1]
        rows, qs = q.reshape(-1, *q.shape[2:]), q_scales.reshape(-1, *q_scales.shape[2:])
    CALLS.append(("aiter.scorer", "varlen" if query_start_loc is not None else "batched",
                  "gather" if use_gather else ""))
    if use_gather:
        # candidate slots: column j is candidate slot j (not modelled beyond its shape)
        assert candidates is not None and row_ends is not None and not calc_block_scores
        out_logits.zero_()
        return out_logits
    ends = row_ends if row_ends is not None else _default_ends(context_lens, q.shape[1])
    return _score(rows, qs, kv_cache, weights, qsl, context_lens, block_table, ends, max_model_len, out_logits,
                  clean_logits, preshuffle, block_scores, calc_logits, calc_block_scores, candidate_block_size)


def paged_mxfp4_mqa_logits_cu_ends(q, q_scales, kv_cache, weights, context_lens, block_table, max_model_len,
                                   kv_scale_cache=None, out_logits=None, clean_logits=True, preshuffle=1,
                                   scale_mode=SCALE_MODE_WIDE, dynamic=0, schedule=None, cu_ends=None,
                                   use_gather=False, candidates=None, block_scores=None, calc_logits=True,
                                   calc_block_scores=False, candidate_block_size=CANDIDATE_BLOCK
                                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The cu_ends generation: q [B, next_n, H, D/2] only."""
    assert kv_scale_cache is None and q.dim() == 4 and not use_gather
    CALLS.append(("aiter.scorer@cu_ends", "batched", ""))
    b, n = q.shape[:2]
    ends = cu_ends if cu_ends is not None else _default_ends(context_lens, n)
    return _score(q.reshape(b * n, *q.shape[2:]), q_scales.reshape(b * n, *q_scales.shape[2:]), kv_cache,
                  weights, torch.arange(b + 1, dtype=torch.int32) * n, context_lens, block_table, ends,
                  max_model_len, out_logits, clean_logits, preshuffle, block_scores, calc_logits,
                  calc_block_scores, candidate_block_size)


def _reference_topk(logits, lengths, out, rows, k, *, scramble):
    idx = topk_indices(logits[:rows], lengths.reshape(-1)[:rows], k)
    if scramble:                         # an unordered set, as aiter's (stable=False) is
        long_rows = lengths.reshape(-1)[:rows].long() > k
        idx[long_rows] = idx[long_rows].flip(1)
    out[:rows].copy_(idx)


def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k=2048, stable=False,
                         *, workspace=None) -> None:
    CALLS.append(("aiter.topk", numRows, logits.shape[1], k))
    assert logits.dtype == torch.float32 and seqLens.dtype == torch.int32 and indices.dtype == torch.int32
    assert (stride0, stride1) == logits.stride() and next_n == 1
    # vLLM never launches it on rows narrower than k; what it does there is not documented
    assert logits.shape[1] >= k, f"aiter's top-k launched on {logits.shape[1]} columns for k={k}"
    _reference_topk(logits, seqLens, indices, numRows, k, scramble=not stable)


# --- vLLM ---------------------------------------------------------------------------------

class _Jit:
    """A @triton.jit kernel: kernel[grid](*args, num_warps=, **kwargs) runs one launch."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.arg_names = list(inspect.signature(fn).parameters)
        self.grid = None

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, **kwargs):
            self.grid = tuple(grid)
            return self.fn(*args, **kwargs)
        return launch


def _pool(state, strides, req, positions, slots, table, table_stride, block_size, out, out_stride,
          head_size, state_width, ratio, overlap, grid):
    """What the pooling kernel reads: state rows [kv (from 0) | score (from STATE_WIDTH)],
    window (1 + OVERLAP) * ratio, the own group's half at +HEAD_SIZE."""
    t = grid[0]
    assert strides == state.stride()[:2] and table_stride == table.stride(0) and out_stride == out.stride(0)
    assert block_size == state.shape[1] and head_size == out.shape[1]
    assert overlap, "the fake models the overlap pooling (ratio 4) only"
    d = head_size
    rows = torch.cat((state[..., :2 * d], state[..., state_width:state_width + 2 * d]), -1)
    pooled = reference.compress_pool(state_cache=rows, block_table=table, positions=positions[:t],
                                     req_index=req[:t], kv_slot_mapping=slots[:t], compress_ratio=ratio)["pooled"]
    hit = ~pooled.isnan().any(1)
    out[:t][hit] = pooled[hit]


def _compress_pool_kernel_033(state_cache_ptr, state_cache_stride0, state_cache_stride1, token_to_req_indices_ptr,
                              positions_ptr, kv_slot_mapping_ptr, block_table_ptr, block_table_stride, block_size,
                              pooled_k_ptr, pooled_k_stride, HEAD_SIZE: tl.constexpr, STATE_WIDTH: tl.constexpr,
                              COMPRESS_RATIO: tl.constexpr, OVERLAP: tl.constexpr):
    CALLS.append(("vllm.rocm.compress_pool_kernel",))
    _pool(state_cache_ptr, (state_cache_stride0, state_cache_stride1), token_to_req_indices_ptr, positions_ptr,
          kv_slot_mapping_ptr, block_table_ptr, block_table_stride, block_size, pooled_k_ptr, pooled_k_stride,
          HEAD_SIZE, STATE_WIDTH, COMPRESS_RATIO, OVERLAP, POOL_KERNEL_033.grid)


def _compress_pool_kernel_8e4f(state_cache_ptr, state_cache_stride0, state_cache_stride1, token_to_req_indices_ptr,
                               positions_ptr, kv_slot_mapping_ptr, block_table_ptr, block_table_stride, block_size,
                               out_ptr, out_stride, HEAD_SIZE: tl.constexpr, STATE_WIDTH: tl.constexpr,
                               COMPRESS_RATIO: tl.constexpr, OVERLAP: tl.constexpr):
    CALLS.append(("vllm.rocm.compress_pool@8e4f5df9",))
    _pool(state_cache_ptr, (state_cache_stride0, state_cache_stride1), token_to_req_indices_ptr, positions_ptr,
          kv_slot_mapping_ptr, block_table_ptr, block_table_stride, block_size, out_ptr, out_stride,
          HEAD_SIZE, STATE_WIDTH, COMPRESS_RATIO, OVERLAP, POOL_KERNEL_8E4F.grid)


POOL_KERNEL_033 = _Jit(_compress_pool_kernel_033)
POOL_KERNEL_8E4F = _Jit(_compress_pool_kernel_8e4f)


class _Dispatcher:
    """vLLM's triton_kernel_dispatcher_with_warmup: a callable object whose dispatch function
    returns (grid, launch kwargs); tensor inputs bind to the kernel's `<name>_ptr`."""

    def __init__(self, kernel, dispatch):
        functools.update_wrapper(self, dispatch, updated=())
        self.kernel, self._dispatch = kernel, dispatch
        self._names = tuple(inspect.signature(dispatch).parameters)
        self.warmups = []

    def register_warmup(self, **kwargs) -> None:
        self.warmups.append(kwargs)

    def __call__(self, *args, **kwargs):
        grid, launch = self._dispatch(*args, **kwargs)
        inputs = dict(zip(self._names, args), **kwargs)
        kw = dict(launch)
        num_warps = kw.pop("num_warps", 4)
        for name, value in inputs.items():
            target = next((c for c in (name, f"{name}_ptr", name.upper()) if c in self.kernel.arg_names), None)
            if target is not None and target not in kw:
                kw[target] = value
        return self.kernel[grid](num_warps=num_warps, **kw)

    def __getitem__(self, grid):
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def compress_pool(state_cache, token_to_req_indices, positions, kv_slot_mapping, block_table, block_size, pooled_k,
                  state_width, compress_ratio, overlap) -> DispatchSpec:
    return (pooled_k.shape[0],), dict(
        state_cache_stride0=state_cache.stride(0), state_cache_stride1=state_cache.stride(1),
        block_table_stride=block_table.stride(0), pooled_k_stride=pooled_k.stride(0),
        HEAD_SIZE=pooled_k.shape[1], STATE_WIDTH=state_width, COMPRESS_RATIO=compress_ratio, OVERLAP=overlap,
        num_warps=1)


POOL_DISPATCHER = _Dispatcher(POOL_KERNEL_033, compress_pool)


@functools.cache
def _aiter_indexer_cache_ops() -> tuple[Callable[..., None], Callable[..., tuple]]:
    return _load("aiter.k_writer"), _load("aiter.q_quant")


@functools.cache
def _aiter():
    return importlib.import_module(upstream.target("aiter.scorer").module)


@functools.cache
def _aiter_topk():
    return _load("aiter.topk")


class CacheLayout(NamedTuple):
    n_per_tile: int
    d_per_tile: int
    scale_lanes: int


def _cache_layout(num_heads: int, head_dim: int, page_entries: int) -> CacheLayout:
    """What vLLM reads from aiter's cache_format: the MFMA N from the head count."""
    npt = 32 if (head_dim <= 64 or num_heads >= 32) else 16
    assert page_entries % npt == 0
    return CacheLayout(npt, 16, 64 // npt)


def rocm_mxfp4_indexer_k_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache,
                               kv_slot_mapping, compress_ratio, use_fp4_cache, *, num_heads) -> None:
    CALLS.append(("vllm.ops.k_store", num_heads))
    assert use_fp4_cache is True
    lay = _cache_layout(num_heads, k_pre.shape[1], k_cache.shape[1])
    k_norm_rope, _ = _aiter_indexer_cache_ops()
    k_norm_rope(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache, kv_slot_mapping,
                compress_ratio, shuffle=lay)


def rocm_mxfp4_indexer_q_quant(positions, index_q, index_q_cos_sin_cache, index_weights, index_weights_softmax_scale,
                               index_weights_head_scale, use_fp4=True, weights_out_dtype=torch.float32
                               ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    CALLS.append(("vllm.ops.q_quant",))
    _, q_quant = _aiter_indexer_cache_ops()
    q_packed, q_scale, weights_out = q_quant(index_q, positions, index_q_cos_sin_cache, index_weights,
                                             index_weights_softmax_scale * index_weights_head_scale)
    return (q_packed, q_scale.view(torch.int32).squeeze(-1)), weights_out


def vllm_c_top_k_per_row_decode(logits, next_n, seq_lens, indices, num_rows, stride0, stride1, k):
    """torch.ops._C.top_k_per_row_decode: any width, -1 pads."""
    CALLS.append(("torch.ops._C.top_k_per_row_decode", num_rows, logits.shape[1], k))
    assert next_n == 1 and (stride0, stride1) == logits.stride()
    _reference_topk(logits, seq_lens, indices, num_rows, k, scramble=False)


def _topk(logits, lengths, out, k) -> None:
    rows, width = logits.shape
    if rows == 0:
        return
    if width >= k and (k >= 2048 or rows >= 128):
        _aiter_topk()(logits, 1, lengths.reshape(-1), out, rows, logits.stride(0), logits.stride(1), k=k)
    else:
        torch.ops._C.top_k_per_row_decode(logits, 1, lengths, out, rows, logits.stride(0), logits.stride(1), k)


def _vllm_topk(rows: int, k: int) -> bool:
    return rows < 128 and k < 2048


def _topk_034(logits, lengths, out, k) -> None:
    """vLLM 0.34.0's _topk: the same rule, stated in _vllm_topk."""
    rows, width = logits.shape
    if rows == 0:
        return
    if width >= k and not _vllm_topk(rows, k):
        _aiter_topk()(logits, 1, lengths.reshape(-1), out, rows, logits.stride(0), logits.stride(1), k=k)
    else:
        torch.ops._C.top_k_per_row_decode(logits, 1, lengths, out, rows, logits.stride(0), logits.stride(1), k)


def kv_tile(page_size: int) -> int:
    return min(64, page_size)


def cache_format(num_heads, head_size, page_size) -> dict:
    """aiter's rule for a preshuffled cache: a page is a whole number of MFMA N and of BLOCK_KV."""
    sh = layout.choose_shuffle(head_size, num_heads)
    bkv = kv_tile(page_size)
    if page_size % sh.n or page_size % bkv:
        raise ValueError(f"page_size {page_size} must be a multiple of BLOCK_KV ({bkv})")
    return {"n_per_tile": sh.n, "d_per_tile": sh.dt, "scale_lanes": sh.l, "block_kv": bkv}


class AiterTritonLogger:
    def info(self, msg, *args):
        pass


def make_kernel_repr(base_name, config_keys, name_key=None):
    return base_name


def _fused_k(fmt: str, kw: dict, grid) -> None:
    """What vLLM's fused K kernels read: state rows [kv (from 0) | score (from STATE_WIDTH)],
    one program per token of the grid, a token written when its compressor slot, its
    boundary and its cache slot say so; pages [P, page_size, entry bytes]."""
    t, d, sw = grid[0], kw["HEAD_SIZE"], kw["STATE_WIDTH"]
    sc, kv, table = kw["state_cache_ptr"], kw["k_cache_ptr"], kw["block_table_ptr"]
    assert (kw["state_cache_stride0"], kw["state_cache_stride1"]) == sc.stride()[:2] and kw["block_size"] == sc.shape[1]
    assert kw["block_table_stride"] == table.stride(0) and kw["cos_sin_stride"] == kw["cos_sin_cache_ptr"].stride(0)
    assert kw["KV_BLOCK_STRIDE"] == kv.stride(0) and kw["kv_cache_block_size"] == kv.shape[1] and kv.dtype == torch.uint8
    assert kw["OVERLAP"] and sw == 2 * d and kw["TRITON_BLOCK_SIZE"] == d and not kw["MX_SCALE"]
    assert kw["QUANT_BLOCK"] == (32 if fmt == "mxfp4" else d) and kw["ROPE_HEAD_DIM"] == kw["cos_sin_cache_ptr"].shape[1]
    slots = kw["kv_slot_mapping_ptr"][:t].masked_fill(kw["slot_mapping_ptr"][:t] < 0, -1)
    pages = kv.view(kv.shape[0], -1)
    rows = torch.cat((sc[..., :2 * d], sc[..., sw:sw + 2 * d]), -1)
    op = reference.compress_norm_rope_mxfp4_cache if fmt == "mxfp4" else reference.compress_norm_rope_fp8_cache
    out = op(state_cache=rows, block_table=table, positions=kw["positions_ptr"][:t],
             req_index=kw["token_to_req_indices_ptr"][:t], kv_slot_mapping=slots, cos_sin_cache=kw["cos_sin_cache_ptr"],
             norm_weight=kw["rms_norm_weight_ptr"], kv_cache=pages.clone(), compress_ratio=kw["COMPRESS_RATIO"],
             norm_eps=kw["rms_norm_eps"], page_size=kv.shape[1])["kv_cache"]
    pages.copy_(out)


def _fused_k_kernel(name: str, key: str, fmt: str) -> _Jit:
    """vLLM's fused K kernel `name` (one signature for both formats), logging `key`."""
    def kernel(
            state_cache_ptr, state_cache_stride0, state_cache_stride1, token_to_req_indices_ptr, positions_ptr,
            slot_mapping_ptr, block_table_ptr, block_table_stride, block_size, rms_norm_weight_ptr, rms_norm_eps,
            cos_sin_cache_ptr, cos_sin_stride, k_cache_ptr, kv_slot_mapping_ptr, kv_cache_block_size,
            HEAD_SIZE: tl.constexpr, TRITON_BLOCK_SIZE: tl.constexpr, STATE_WIDTH: tl.constexpr,
            COMPRESS_RATIO: tl.constexpr, OVERLAP: tl.constexpr, ROPE_HEAD_DIM: tl.constexpr, FP8_MAX: tl.constexpr,
            QUANT_BLOCK: tl.constexpr, TOKEN_STRIDE: tl.constexpr, SCALE_DIM: tl.constexpr,
            KV_BLOCK_STRIDE: tl.constexpr, MX_SCALE: tl.constexpr):
        CALLS.append((key,))
        _fused_k(fmt, dict(locals()), jit.grid)

    kernel.__name__ = kernel.__qualname__ = name
    jit = _Jit(kernel)
    return jit


FUSED_K_MXFP4 = _fused_k_kernel("_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn", "vllm.cuda.k_mxfp4", "mxfp4")
FUSED_K_FP8 = _fused_k_kernel("_fused_kv_compress_norm_rope_insert_indexer_attn", "vllm.cuda.k_fp8", "fp8")
# vLLM's CUDA-path kernels the capture hook wraps (install(..., fused=True) puts them in place)
FUSED_KEYS = ("vllm.cuda.k_mxfp4", "vllm.cuda.k_fp8")


FAKES = {
    "vllm.rocm.compress_pool": POOL_DISPATCHER,
    "vllm.rocm.compress_pool@8e4f5df9": POOL_KERNEL_8E4F,
    "vllm.rocm.compress_pool_kernel": POOL_KERNEL_033,
    "vllm.rocm.compress_pool_kernel@8e4f5df9": POOL_KERNEL_8E4F,
    "vllm.ops.k_store": rocm_mxfp4_indexer_k_store,
    "vllm.ops.q_quant": rocm_mxfp4_indexer_q_quant,
    "vllm.ops.topk": _topk_034,
    "vllm.ops.topk@0.33.0": _topk,
    "vllm.ops.vllm_topk": _vllm_topk,
    "vllm.ops.vllm_topk@0.33.0": _topk,
    "vllm.ops.aiter_cache_ops": _aiter_indexer_cache_ops,
    "aiter.k_writer": k_norm_rope_mxfp4_cache,
    "aiter.q_quant": q_rope_mxfp4_quant,
    "aiter.scorer": paged_mxfp4_mqa_logits,
    "aiter.scorer@cu_ends": paged_mxfp4_mqa_logits_cu_ends,
    "aiter.topk": top_k_per_row_decode,
    "aiter.cache_format": cache_format,
    "aiter.triton.logger": AiterTritonLogger,
    "aiter.triton.kernel_repr": make_kernel_repr,
    "vllm.cuda.k_mxfp4": FUSED_K_MXFP4,
    "vllm.cuda.k_fp8": FUSED_K_FP8,
}
# helpers vLLM's ops module has next to the targets (installed with them)
OPS_HELPERS = {"_aiter": _aiter, "_aiter_topk": _aiter_topk}


def source_of(fake):
    """The Python function a fake is (a kernel's body, a dispatcher's dispatch function)."""
    if isinstance(fake, _Jit):
        return fake.fn
    if isinstance(fake, _Dispatcher):
        return fake._dispatch
    return getattr(fake, "__wrapped__", fake)


def reset() -> None:
    CALLS.clear()
    for f in (_aiter_indexer_cache_ops, _aiter, _aiter_topk):
        f.cache_clear()


_INSTALLED: list[str] = []


def install(monkeypatch, *versions: str, without: tuple[str, ...] = (),
            fused: bool = False) -> dict[str, types.ModuleType]:
    """Put the fakes of every table entry known for `versions` ("vllm==0.33.0",
    "aiter:row_ends", ...) into sys.modules at the table's module paths; -> {module: fake module}.
    `fused`: vLLM's CUDA-path fused K kernels too (read from source elsewhere, never imported)."""
    reset()
    for name in _INSTALLED:                  # a second install in one test replaces the first
        monkeypatch.delitem(sys.modules, name, raising=False)
    _INSTALLED.clear()
    mods: dict[str, types.ModuleType] = {}

    def module(name):
        if name not in mods:
            parent, _, child = name.rpartition(".")
            m = types.ModuleType(name)
            m.__path__ = []                  # a package, so that submodules import
            mods[name] = m
            monkeypatch.setitem(sys.modules, name, m)
            _INSTALLED.append(name)
            if parent:
                setattr(module(parent), child, m)
        return mods[name]

    for t in upstream.TABLE:
        if t.key in without or not set(t.versions) & set(versions):
            continue
        if t in upstream.VLLM_TRITON and not (fused and t.key in FUSED_KEYS):
            continue                         # read from source by optimized.vllm_kernels, never imported
        m = module(t.module)
        setattr(m, t.name, FAKES[t.key])
        if t.module == upstream.target("vllm.ops.k_store").module:
            for name, fn in OPS_HELPERS.items():
                setattr(m, name, fn)
            setattr(m, upstream.target("vllm.ops.aiter_cache_ops").name, _aiter_indexer_cache_ops)
    monkeypatch.setattr(torch.ops, "_C", types.SimpleNamespace(top_k_per_row_decode=vllm_c_top_k_per_row_decode),
                        raising=False)
    monkeypatch.setattr(sys.modules[__name__], "CALLS", CALLS)
    return mods


# --- a small synthetic aiter source tree (for the source loader; no aiter code) -------------

AITER_TREE = {
    "aiter/__init__.py": "",
    "aiter/ops/triton/utils/logger.py": '''\
import logging


class AiterTritonLogger(object):
    _instance = None

    def __new__(cls):
        raise RuntimeError("the loader replaces this class; it never runs")

    def info(self, msg):
        logging.getLogger("AITER_TRITON").info(msg)
''',
    "aiter/ops/triton/utils/_triton/kernel_repr.py": '''\
def make_kernel_repr(base_name, config_keys, name_key=None):
    def _repr(specialization):
        return base_name
    return _repr
''',
    "aiter/ops/triton/_triton_kernels/quant/quant.py": '''\
import triton
import triton.language as tl
from triton.language.target_info import is_hip_cdna4


@triton.jit
def _not_positive(x, USE_ASM: tl.constexpr = False):
    """1 where x <= 0, as aiter's _mxfp4_pack_bits builds its masks (`not` on a tensor)."""
    if USE_ASM and is_hip_cdna4():
        out = (x <= 0).to(tl.uint8)
    else:
        positive = x > 0
        neg = (not positive) & (x < 1e30)
        out = tl.where(neg, 1, 0).to(tl.uint8)
    return out
''',
    "aiter/ops/triton/_triton_kernels/fusions/k_norm_rope_mxfp4_cache.py": '''\
import triton
import triton.language as tl

from aiter.ops.triton._triton_kernels.quant.quant import _not_positive
from aiter.ops.triton.utils._triton.kernel_repr import make_kernel_repr

_k_repr = make_kernel_repr("_k_kernel", ["N"])


@triton.jit(repr=_k_repr)
def _k_kernel(k_ptr, out_ptr, slot_ptr, N: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs = tl.arange(0, N)
    x = tl.load(k_ptr + t * N + offs).to(tl.float32)
    tl.store(out_ptr + slot * N + offs, _not_positive(x, USE_ASM=True))
''',
    "aiter/ops/triton/fusions/k_norm_rope_mxfp4_cache.py": '''\
import torch

from aiter.ops.triton._triton_kernels.fusions.k_norm_rope_mxfp4_cache import _k_kernel
from aiter.ops.triton.utils.logger import AiterTritonLogger

_LOGGER = AiterTritonLogger()


def k_norm_rope_mxfp4_cache(k, positions, cos_sin_cache, norm_weight, norm_eps, kv_cache, slot_mapping,
                            compress_ratio=1, shuffle=None) -> None:
    _LOGGER.info("K: k=%s", tuple(k.shape))
    if k.dtype != torch.float32:
        raise ValueError(f"k must be float32, got {k.dtype}")
    n = slot_mapping.numel()
    if n == 0:
        return
    _k_kernel[(n,)](k, kv_cache, slot_mapping, N=k.shape[1], num_warps=1)
''',
    "aiter/ops/triton/_triton_kernels/rope/q_rope_mxfp4_quant.py": '''\
import triton
import triton.language as tl

from aiter.ops.triton._triton_kernels.quant.quant import _not_positive


@triton.jit
def _q_kernel(q_ptr, out_ptr, N: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, N)
    tl.store(out_ptr + t * N + offs, _not_positive(tl.load(q_ptr + t * N + offs)))
''',
    "aiter/ops/triton/rope/q_rope_mxfp4_quant.py": '''\
import torch
import triton

from aiter.ops.triton._triton_kernels.rope.q_rope_mxfp4_quant import _q_kernel
from aiter.ops.triton.utils.logger import AiterTritonLogger

_LOGGER = AiterTritonLogger()


def q_rope_mxfp4_quant(q, positions, cos_sin_cache, weights=None, weights_scale=1.0):
    _LOGGER.info("Q: q=%s", tuple(q.shape))
    t = q.shape[0]
    out = torch.empty((t, q.shape[1]), dtype=torch.uint8, device=q.device)
    if t:
        _q_kernel[(triton.cdiv(t, 1),)](q, out, N=q.shape[1])
    return out, None, weights
''',
}


def write_aiter_tree(root, files: dict | None = None):
    """AITER_TREE (updated with `files`) under root; -> root."""
    for rel, text in {**AITER_TREE, **(files or {})}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def aiter_pins(root) -> dict:
    """{rel: sha256} of a synthetic tree, as optimized.upstream.PINS would pin it."""
    import hashlib
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in AITER_TREE
            if rel.endswith(".py") and rel != "aiter/__init__.py"}
