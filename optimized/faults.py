"""The fault catalogue: deliberately broken backends, one bug class of NUMERICS.md §10 each.

Every fault is the reference path with ONE stage replaced, built by composing the
reference's public stage functions (no switch inside `reference/` or a kernel), so that
the bug is the only difference from a correct backend. `mxval selftest` runs each fault
on the cases that expose it and checks that at least one budget catches it.

A fault's words (bug class, ops, cases, description, source) are its table in faults.toml;
its broken ops are built here (_MAKE_OPS, by the same name).

    from optimized import get_backend
    be = get_backend("fault:window-shift")        # a Backend like any other
    from optimized.faults import FAULTS           # name -> Fault (bug class, ops, cases)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

import reference
from reference import fp8 as ref_fp8
from reference import hadamard as ref_hadamard
from reference import layout, mxfp4, scoring
from reference.k_writer import check_mxfp4_k_writer, group_start, k_values, rms_norm, writer_mask
from reference.pooling import SOFTMAX_MODES, boundary_mask, gather_windows
from reference.q_quant import check_scale_pair, fold_weights
from reference.rope import cos_sin_at, rope_gptj_tail
from reference.topk import packed_row_starts

from . import Backend, get_backend, register
from .fault_table import (
    GRAPH_SPLIT,
    INT32_BITS,
    LOGITS_ROW_SIM_BITS,
    PREFILL_TOPK_ROWS,
    RADIX_FLAGGEMS,
    RADIX_SGLANG,
    SCHEDULE_TILE,
    SCHEDULE_TILES_PER_ROW,
    SIM_WRAP_BITS,
    FaultText,
    read_catalogue,
)
from .reference_backend import NO_GRAPH


@dataclass(frozen=True, kw_only=True)
class Fault(FaultText):
    """A fault's words (faults.toml, optimized/fault_table.py) and its broken ops."""
    make_ops: Callable[[], dict]   # op name -> the faulty op

    def backend(self) -> Backend:
        if self.graph:                   # built on ops a graph can capture (graph_base)
            ops, dev, no_graph = graph_base()
        else:
            ops, dev, no_graph = dict(reference.FUNCTIONS), "cuda" if torch.cuda.is_available() else "cpu", NO_GRAPH
        ops.update(self.make_ops())
        return Backend(self.backend_name, self.describe(), ops, device=dev, no_graph=no_graph)


# --- the correct path, as composable stages ----------------------------------------

def pool_op(windows: Callable = gather_windows) -> Callable:
    """compress_pool whose windows come from `windows(state, table, pos, req, r) ->
    (kv, score, valid)`; the reference op checks the arguments and lays out the result."""
    def compress_pool(*, state_cache, block_table, positions, req_index, kv_slot_mapping,
                      compress_ratio: int = 4, rounding: str = "rocm", softmax: str = "fp64") -> dict:
        out = reference.compress_pool(state_cache=state_cache, block_table=block_table,
                                      positions=positions, req_index=req_index,
                                      kv_slot_mapping=kv_slot_mapping, compress_ratio=compress_ratio,
                                      rounding=rounding, softmax=softmax)
        sel = boundary_mask(positions, compress_ratio) & (kv_slot_mapping >= 0)
        if bool(sel.any()):
            kv, score, _ = windows(state_cache, block_table, positions[sel], req_index[sel],
                                   compress_ratio)
            pooled = out["pooled"].clone()
            pooled[sel] = SOFTMAX_MODES[softmax](kv, score).to(pooled.dtype)
            out["pooled"] = pooled
        return out
    return compress_pool


def default_values(k, rope_pos, cos_sin_cache, norm_weight, norm_eps, rounding, hadamard, rope="separate"):
    return k_values(k, rope_pos, cos_sin_cache, norm_weight, norm_eps, rounding=rounding,
                    hadamard=hadamard, rope=rope)


def default_write(kv_cache, slots, packed, scales, page_size, shuffle):
    return layout.write_entries(kv_cache, slots, packed, scales, page_size=page_size, shuffle=shuffle)


def k_writer_op(*, mask: Callable = writer_mask, rope_pos: Callable = group_start,
                values: Callable = default_values, quantize: Callable = mxfp4.quantize_mxfp4,
                write: Callable = default_write) -> Callable:
    """k_norm_rope_mxfp4_cache as the reference's stages: mask -> RoPE position ->
    norm+RoPE values -> MXFP4 -> page write. Each keyword replaces one stage; with none
    replaced it gives the reference's bytes (tests/test_faults.py holds it to that)."""
    def k_norm_rope_mxfp4_cache(*, k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                norm_eps: float = 1e-6, compress_ratio: int = 4, page_size: int = 64,
                                shuffle=(32, 16, 2), rounding: str = "rocm", hadamard: bool = False,
                                scale_rule: str = "ceil", rope: str = "separate") -> dict:
        shuffle = check_mxfp4_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                       norm_eps, compress_ratio, page_size, shuffle, rounding)
        sel = mask(positions, slot_mapping, compress_ratio)
        y = values(k[sel], rope_pos(positions[sel], compress_ratio), cos_sin_cache, norm_weight,
                   norm_eps, rounding, hadamard, rope)
        packed, scales = quantize(y, scale_rule)
        return {"kv_cache": write(kv_cache, slot_mapping[sel], packed, scales, page_size, shuffle)}
    return k_norm_rope_mxfp4_cache


def q_quant_op(*, force_hadamard: Optional[bool] = None, fold: Callable = fold_weights) -> Callable:
    """q_rope_mxfp4_quant with the Hadamard switch forced and/or the weight fold replaced."""
    def q_rope_mxfp4_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                           hadamard: bool = False, scale_rule: str = "ceil", rope: str = "separate",
                           softmax_scale: Optional[float] = None, head_scale: Optional[float] = None) -> dict:
        out = reference.q_rope_mxfp4_quant(
            q=q, positions=positions, cos_sin_cache=cos_sin_cache, weights=weights,
            weights_scale=weights_scale, scale_rule=scale_rule, rope=rope, softmax_scale=softmax_scale,
            head_scale=head_scale, hadamard=hadamard if force_hadamard is None else force_hadamard)
        out["weights"] = fold(weights, weights_scale, check_scale_pair(weights_scale, softmax_scale, head_scale))
        return out
    return q_rope_mxfp4_quant


def scorer_op(*, row_ends_fn: Optional[Callable] = None,
              scale_offsets: Callable = layout.scale_offsets,
              dequantize: Callable = mxfp4.dequantize_mxfp4, tables_fn: Optional[Callable] = None) -> Callable:
    """paged_mxfp4_mqa_logits whose mask bound is `row_ends_fn(row_ends, context_lens, qsl)`,
    whose key scales are read at `scale_offsets(t, page_size, D, shuffle)`, whose keys are
    decoded by `dequantize(packed, scales, torch.float64)` and whose rows find their
    sequence's pages through `tables_fn(query_start_loc, block_table, context_lens,
    page_size) -> (query_start_loc, block_table)`."""
    def paged_mxfp4_mqa_logits(*, q_fp4, q_scale, weights, kv_cache, query_start_loc, context_lens,
                               block_table, row_ends, page_size: int = 64, shuffle=(32, 16, 2),
                               width: Optional[int] = None, clean_logits: bool = False) -> dict:
        args = dict(q_fp4=q_fp4, q_scale=q_scale, weights=weights, kv_cache=kv_cache,
                    query_start_loc=query_start_loc, context_lens=context_lens,
                    block_table=block_table, row_ends=row_ends, page_size=page_size,
                    shuffle=shuffle, width=width)
        reference.paged_mxfp4_mqa_logits(**args)          # the reference's argument checks
        ends = row_ends if row_ends_fn is None else row_ends_fn(row_ends, context_lens, query_start_loc)
        sh = layout.as_shuffle(shuffle)
        d = q_fp4.shape[2] * 2
        q = mxfp4.dequantize_mxfp4(q_fp4, q_scale, torch.float64)

        def read_keys(slots):
            page, t = slots.long() // page_size, slots.long() % page_size
            start = (page * kv_cache.shape[1]).unsqueeze(-1)
            flat = kv_cache.reshape(-1)
            vals = flat[start + layout.value_offsets(t, page_size, d, sh)]
            scales = flat[start + scale_offsets(t, page_size, d, sh)]
            return dequantize(vals, scales, torch.float64)

        qsl, table = (query_start_loc, block_table) if tables_fn is None else tables_fn(
            query_start_loc, block_table, context_lens, page_size)
        logits = scoring.paged_logits(q, weights, qsl, table, ends, page_size,
                                      read_keys, width or scoring.default_width(block_table, page_size))
        return {"logits": logits.float()}
    return paged_mxfp4_mqa_logits


def topk_op(post: Callable) -> Callable:
    """topk whose indices go through `post(indices, lengths, k)` after the reference."""
    def topk(*, logits, lengths, k: int) -> dict:
        out = reference.topk(logits=logits, lengths=lengths, k=k)
        return {"indices": post(out["indices"].clone(), lengths.long(), k)}
    return topk


# --- the replaced stages --------------------------------------------------------------

def _shifted_windows(state_cache, block_table, positions, req_index, r):
    return gather_windows(state_cache, block_table, positions - 1, req_index, r)


def _swapped_halves_windows(state_cache, block_table, positions, req_index, r):
    d = state_cache.shape[-1] // 4
    kv_a, kv_b, s_a, s_b = state_cache.split(d, dim=-1)
    swapped = torch.cat((kv_b, kv_a, s_b, s_a), dim=-1)
    return gather_windows(swapped, block_table, positions, req_index, r)


def _permuted_values(perm_fn: Callable) -> Callable:
    """RoPE on other dims/pairs, built from the reference: permute the channels so that
    the wrongly rotated dims land where the reference rotates, run the reference stages
    (the norm is order-free: its fp64 sum of bf16 squares is exact), permute back."""
    def values(k, rope_pos, cos_sin_cache, norm_weight, norm_eps, rounding, hadamard, rope="separate"):
        perm = perm_fn(k.shape[-1], cos_sin_cache.shape[-1]).to(k.device)
        inv = torch.argsort(perm)
        y = k_values(k[:, perm], rope_pos, cos_sin_cache, norm_weight[perm], norm_eps,
                     rounding=rounding, hadamard=False, rope=rope)[:, inv]
        return ref_hadamard.rotate(y) if hadamard else y
    return values


def _neox_perm(d: int, rdim: int) -> torch.Tensor:
    """NeoX pairs (t[i], t[i + R/2]) of the rope dims t become GPT-J's (u[2i], u[2i+1])."""
    half = rdim // 2
    tail = torch.stack((torch.arange(half), torch.arange(half) + half), -1).flatten() + (d - rdim)
    return torch.cat((torch.arange(d - rdim), tail))


def _first_dims_perm(d: int, rdim: int) -> torch.Tensor:
    """The first R dims moved to where the reference rotates (the last R)."""
    return torch.cat((torch.arange(rdim, d), torch.arange(rdim)))


def _values_norm_unrounded(k, rope_pos, cos_sin_cache, norm_weight, norm_eps, rounding, hadamard,
                           rope="separate"):
    """The ROCm path without its bf16 round between the norm and RoPE."""
    cos, sin = cos_sin_at(cos_sin_cache, rope_pos)
    y = rope_gptj_tail(rms_norm(k.float(), norm_weight, norm_eps), cos, sin, round_bf16=True,
                       nope_through_formula=(rounding == "rocm"), rope=rope)
    return ref_hadamard.rotate(y) if hadamard else y


def _boundary_first_token(positions, slot_mapping, r):
    return (slot_mapping >= 0) & (positions.long() % r == 0)


def _swap_nibbles(x, scale_rule):
    packed, scales = mxfp4.quantize_mxfp4(x, scale_rule)
    return (packed >> 4) | (packed << 4), scales


def _ocp_floor(x, scale_rule):
    return mxfp4.quantize_mxfp4(x, "ocp-floor")


def wrong_scale_offsets(t, page_size, head_dim, shuffle):
    """A scale order that disagrees with §5: in a preshuffled page the blocks of a lane
    are stored together (no `s % L` interleave; for L = 1 the interleave of L = D/32 is
    used instead); in a natural page, block-major instead of token-major."""
    nb = head_dim // 32
    if shuffle is None:
        return page_size * (head_dim // 2) + torch.arange(nb, device=t.device) * page_size + t.long().unsqueeze(-1)
    wrong = layout.Shuffle(shuffle.n, shuffle.dt, 1 if shuffle.l != 1 else nb)
    return layout.scale_offsets(t, page_size, head_dim, wrong)


def _write_flat(kv_cache, vo, so, packed, scales):
    out = kv_cache.clone()
    flat = out.view(-1)
    flat[vo.flatten()] = packed.reshape(-1)
    flat[so.flatten()] = scales.reshape(-1)
    return out


def _write_wrong_scale_order(kv_cache, slots, packed, scales, page_size, shuffle):
    d = packed.shape[-1] * 2
    page, t = slots.long() // page_size, slots.long() % page_size
    start = (page * kv_cache.shape[1]).unsqueeze(-1)
    return _write_flat(kv_cache, start + layout.value_offsets(t, page_size, d, shuffle),
                       start + wrong_scale_offsets(t, page_size, d, shuffle), packed, scales)


def wrapping_write(bits: int) -> Callable:
    """Page write whose flat byte offsets are computed in a signed `bits`-wide integer.
    Offsets that wrap negative point before the pool; a kernel would scribble over other
    memory there, the emulation drops those bytes (the owned bytes stay stale either way)."""
    def write(kv_cache, slots, packed, scales, page_size, shuffle):
        d = packed.shape[-1] * 2
        vo, so = layout.slot_byte_offsets(slots, page_size, d, shuffle, kv_cache.shape[1])
        half = 1 << (bits - 1)
        out = kv_cache.clone()
        flat = out.view(-1)
        for off, src in ((vo, packed), (so, scales)):
            wrapped = ((off + half) % (2 * half) - half).flatten()
            keep = (wrapped >= 0) & (wrapped < flat.numel())
            flat[wrapped[keep]] = src.reshape(-1)[keep]
        return out
    return write


def _write_clobbering(kv_cache, slots, packed, scales, page_size, shuffle):
    """Each entry's scales go out as part of a wider store that also zeroes the 4 bytes
    after its last scale byte; the entries' own bytes are written after, so only bytes
    the call does not own are damaged."""
    d = packed.shape[-1] * 2
    vo, so = layout.slot_byte_offsets(slots, page_size, d, shuffle, kv_cache.shape[1])
    out = kv_cache.clone()
    flat = out.view(-1)
    if slots.numel():
        spill = so.max(dim=-1, keepdim=True).values + 1 + torch.arange(4, device=so.device)
        spill = spill.flatten()
        flat[spill[spill < flat.numel()]] = 0
    flat[vo.flatten()] = packed.reshape(-1)
    flat[so.flatten()] = scales.reshape(-1)
    return out


def _row_ends_minus_one(row_ends, context_lens, qsl):
    return (row_ends.long() - 1).clamp_min(0).to(row_ends.dtype)


def _row_ends_unmasked(row_ends, context_lens, qsl):
    return context_lens.long()[scoring.seq_of_rows(qsl, row_ends.shape[0])].to(row_ends.dtype)


def _fold_none(weights, weights_scale, pair=None):
    return weights.float()


def _fold_twice(weights, weights_scale, pair=None):
    return fold_weights(fold_weights(weights, weights_scale, pair), weights_scale, pair)


def _pad_one_late(idx, lengths, k):
    """Short rows: the padding starts one column late, at index `len` instead of -1."""
    rows = (lengths < k).nonzero().flatten()
    idx[rows, lengths[rows]] = lengths[rows].to(idx.dtype)
    return idx


def _duplicate_last(idx, lengths, k):
    """Long rows: the last selected index repeats the first."""
    rows = (lengths > k).nonzero().flatten()
    idx[rows, k - 1] = idx[rows, 0]
    return idx


def _fp8_scorer_reading(keys: Callable, read_as: Optional[str] = None) -> Callable:
    """paged_fp8_mqa_logits whose keys come from `keys(kv_cache, slots, page_size, d, flavour)`,
    every fp8 byte decoded as `read_as` (None: the flavour the call names). The reference
    checks the arguments in the flavour they were written in; the decode does not stop at
    NaNs a misread makes (0x80 is NaN in FNUZ), as a kernel would not."""
    def paged_fp8_mqa_logits(*, q_fp8, weights, kv_cache, query_start_loc, context_lens, block_table,
                             row_ends, page_size: int = 64, fp8_dtype: str = "e4m3fn",
                             width: Optional[int] = None, clean_logits: bool = False) -> dict:
        reference.paged_fp8_mqa_logits(q_fp8=q_fp8, weights=weights, kv_cache=kv_cache,
                                       query_start_loc=query_start_loc, context_lens=context_lens,
                                       block_table=block_table, row_ends=row_ends, page_size=page_size,
                                       fp8_dtype=fp8_dtype, width=width)
        flavour = read_as or fp8_dtype
        d = q_fp8.shape[2]
        logits = scoring.paged_logits(ref_fp8.dequantize_fp8(q_fp8, flavour), weights, query_start_loc,
                                      block_table, row_ends, page_size,
                                      lambda slots: keys(kv_cache, slots, page_size, d, flavour),
                                      width or scoring.default_width(block_table, page_size))
        return {"logits": logits.float()}
    return paged_fp8_mqa_logits


def _planar_keys(kv_cache, slots, page_size, d, flavour):
    """The keys of block-planar pages (all values, then all scales), as written."""
    vo, so = ref_fp8.fp8_slot_offsets(slots, page_size, d, kv_cache.shape[1])
    flat = kv_cache.reshape(-1)
    return ref_fp8.dequantize_fp8(flat[vo], flavour) * flat[so].contiguous().view(torch.float32).double()


def fp8_scorer_op(read_as: Optional[str] = None) -> Callable:
    """paged_fp8_mqa_logits decoding every fp8 byte as `read_as` (None: the flavour the call names)."""
    return _fp8_scorer_reading(_planar_keys, read_as)


# --- the CUDA path (vLLM's fused K stage and Q kernels) --------------------------------------

def _fused_nope_untouched() -> Callable:
    """The fused pool+K stage as first described: the NoPE dims skip the rotation (the
    kernels push them through e*1 - o*0, o*1 + e*0, NUMERICS.md §2)."""
    def compress_norm_rope_mxfp4_cache(*, state_cache, block_table, positions, req_index, kv_slot_mapping,
                                       cos_sin_cache, norm_weight, kv_cache, compress_ratio: int = 4,
                                       norm_eps: float = 1e-6, page_size: int = 64, rope: str = "fma-oc",
                                       softmax: str = "fp64") -> dict:
        pooled = reference.compress_pool(state_cache=state_cache, block_table=block_table, positions=positions,
                                         req_index=req_index, kv_slot_mapping=kv_slot_mapping,
                                         compress_ratio=compress_ratio, rounding="cuda", softmax=softmax)["pooled"]
        sel = writer_mask(positions, kv_slot_mapping, compress_ratio)
        cos, sin = cos_sin_at(cos_sin_cache, group_start(positions[sel], compress_ratio))
        n = rms_norm(pooled[sel].float(), norm_weight, norm_eps)
        y = rope_gptj_tail(n, cos, sin, round_bf16=False, nope_through_formula=False, rope=rope)
        packed, scales = mxfp4.quantize_mxfp4(y.to(torch.bfloat16).float())
        return {"kv_cache": layout.write_entries(kv_cache, kv_slot_mapping[sel], packed, scales,
                                                 page_size=page_size, shuffle=None)}
    return compress_norm_rope_mxfp4_cache


def _q_one_multiply() -> Callable:
    """The CUDA Q quant folding softmax_scale * head_scale as one multiply instead of the
    kernels' two in turn (the pair is accepted and dropped)."""
    def q_rope_mxfp4_quant(*, softmax_scale=None, head_scale=None, **kw) -> dict:
        return reference.q_rope_mxfp4_quant(**kw)
    return q_rope_mxfp4_quant


# --- the field's bugs: what shipped, modelled at the size where it appeared ------------------

POOL_RATIO = 4                  # r of every preset (the scorer is not told r)


def logits_post_op(post: Callable) -> Callable:
    """paged_mxfp4_mqa_logits whose fp32 logits go through `post(logits, args)` after the
    reference computed them; `args` are the call's keyword arguments."""
    def paged_mxfp4_mqa_logits(**kw) -> dict:
        out = reference.paged_mxfp4_mqa_logits(**kw)
        return {"logits": post(out["logits"].clone(), kw)}
    return paged_mxfp4_mqa_logits


def _rows_past_offset(bits: int) -> Callable:
    """Rows whose first byte lies at or past 2**(bits-1) in the fp32 [Rw, W] buffer are
    never stored: they keep the zeros of the buffer the caller allocated."""
    def post(logits, kw):
        width = logits.shape[1]
        first = -(-(1 << (bits - 1)) // (width * 4))
        logits[first:] = 0.0
        return logits
    return post


def _schedule_truncated(logits, kw):
    """Entries past the schedule's capacity per row are never scored: they keep the -inf
    the kernel fills the row with."""
    cap = SCHEDULE_TILE * SCHEDULE_TILES_PER_ROW
    if logits.shape[1] > cap:
        logits[:, cap:] = float("-inf")
    return logits


def _seq_rows(kw):
    qsl = kw["query_start_loc"].long()
    return scoring.seq_of_rows(qsl, kw["row_ends"].shape[0]), qsl


def _window_from_chunk_offset(logits, kw):
    """sglang's prefill ke built from the row's offset inside its chunk instead of inside its
    sequence: a chunk that starts at entry e0 > 0 scores e0 entries too few per row."""
    seq, qsl = _seq_rows(kw)
    ends = kw["row_ends"].long()
    if ends.numel() == 0:
        return logits
    first = ends[qsl[:-1].clamp(max=ends.numel() - 1)]
    chunk = (qsl[1:] - qsl[:-1]) > 1                    # prefill: decode rows keep their bound
    wrong = torch.where(chunk[seq], ends - first[seq], ends)
    cols = torch.arange(logits.shape[1], device=logits.device)
    logits[(cols[None, :] >= wrong[:, None]) & (cols[None, :] < ends[:, None])] = float("-inf")
    return logits


def _chunk_rows_only(logits, kw):
    """mlx-lm's indexer scores only as many pool rows as this call's own tokens pooled
    (tokens // r): deeper chunks, and decode (one token pools none), lose the rest."""
    seq, qsl = _seq_rows(kw)
    own = (qsl[1:] - qsl[:-1]) // POOL_RATIO
    cols = torch.arange(logits.shape[1], device=logits.device)
    ends = kw["row_ends"].long()
    logits[(cols[None, :] >= own[seq][:, None]) & (cols[None, :] < ends[:, None])] = float("-inf")
    return logits


def _nan_in_decode(logits, kw):
    """A decode call (one query row per sequence) returns NaN over every scored column."""
    qsl = kw["query_start_loc"].long()
    if qsl.numel() > 1 and bool(((qsl[1:] - qsl[:-1]) <= 1).all()):
        ends = kw["row_ends"].long()
        cols = torch.arange(logits.shape[1], device=logits.device)
        logits[cols[None, :] < ends[:, None]] = float("nan")
    return logits


def _neighbour_scale_offsets(t, page_size, head_dim, shuffle):
    """Each key's values read with the scale bytes of the next entry of its page."""
    return layout.scale_offsets((t.long() + 1) % page_size, page_size, head_dim, shuffle)


def _write_natural_pages(kv_cache, slots, packed, scales, page_size, shuffle):
    """The K writer stores natural (flat) pages whatever layout the reader expects."""
    return layout.write_entries(kv_cache, slots, packed, scales, page_size=page_size, shuffle=None)


def _neox_q_op() -> Callable:
    """q_rope_mxfp4_quant rotating NeoX pairs (t[i], t[i+R/2]) of the rope dims, as the K
    writer of the same fault does: q and k agree with each other, not with the model."""
    def q_rope_mxfp4_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                           hadamard: bool = False, scale_rule: str = "ceil", rope: str = "separate",
                           **pair) -> dict:
        out = reference.q_rope_mxfp4_quant(q=q, positions=positions, cos_sin_cache=cos_sin_cache,
                                           weights=weights, weights_scale=weights_scale,
                                           hadamard=hadamard, scale_rule=scale_rule, rope=rope, **pair)
        from reference.q_quant import q_values
        perm = _neox_perm(q.shape[-1], cos_sin_cache.shape[-1]).to(q.device)
        y = q_values(q[..., perm], positions, cos_sin_cache, rope=rope)[..., torch.argsort(perm)]
        out["q_fp4"], out["q_scale"] = mxfp4.quantize_mxfp4(ref_hadamard.rotate(y) if hadamard else y,
                                                            scale_rule)
        return out
    return q_rope_mxfp4_quant


def _token_interleaved_keys(kv_cache, slots, page_size, d, flavour):
    """The keys of pages read as token-interleaved [page_size, D + 4] rows."""
    page, t = slots.long() // page_size, slots.long() % page_size
    row = page * kv_cache.shape[1] + t * (d + 4)
    flat = kv_cache.reshape(-1)
    vals = flat[row.unsqueeze(-1) + torch.arange(d, device=slots.device)]
    sc = flat[(row + d).unsqueeze(-1) + torch.arange(4, device=slots.device)]
    return ref_fp8.dequantize_fp8(vals, flavour) * sc.contiguous().view(torch.float32).double()


def fp8_token_interleaved_op() -> Callable:
    """paged_fp8_mqa_logits reading block-planar pages (all values, then all scales) as
    token-interleaved [page_size, D + 4] rows: the same bytes per page, so nothing asserts."""
    return _fp8_scorer_reading(_token_interleaved_keys)


def _row_start_ignored(idx, lengths, k, logits):
    """More than 4096 rows: the long-row path ranks the packed window [0, len) instead of
    [start, start + len): of the row's own columns it sees only the first len - start,
    and pads with whatever the rest of the window holds (here: the next columns)."""
    if idx.shape[0] <= PREFILL_TOPK_ROWS:
        return idx
    starts = packed_row_starts(lengths)
    for r in ((lengths > k) & (starts > 0)).nonzero().flatten().tolist():
        n, s = int(lengths[r]), int(starts[r])
        seen = max(0, n - s)
        row = logits[r, :seen].double()
        top = torch.topk(row, min(k, seen)).indices if seen else row.new_zeros(0, dtype=torch.long)
        fill = torch.arange(seen, n, device=idx.device)[:k - top.numel()]
        idx[r] = torch.cat((top.to(idx.device), fill)).to(idx.dtype)
    return idx


def _row_start_twice(idx, lengths, k, logits):
    """More than 4096 rows: the row start is added to the output indices a second time."""
    if idx.shape[0] <= PREFILL_TOPK_ROWS:
        return idx
    starts = packed_row_starts(lengths).to(idx.dtype)
    long_rows = lengths > k
    idx[long_rows] = idx[long_rows] + starts[long_rows, None]
    return idx


def _fp16_radix_key(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Order-preserving key of fp16(x), its top `bits` bits."""
    b = x.to(torch.float16).view(torch.int16).int() & 0xFFFF
    key = torch.where(b & 0x8000 != 0, ~b & 0xFFFF, b | 0x8000)
    return key >> (16 - bits)


def radix_overflow(bits: int, capacity: int, arrival: str) -> Callable:
    """Radix top-k whose threshold bin keeps at most `capacity` candidates: bins above the
    threshold bin are taken whole, the threshold bin's candidates are stored in arrival
    order (`column` order, or `random` as atomics deliver them, drawn from a per-row seed so the
    fault itself is reproducible) until the buffer is full,
    and the rest of k comes exactly from what was stored. Bins that fit are exact."""
    def post(idx, lengths, k, logits):
        for r in (lengths > k).nonzero().flatten().tolist():
            n = int(lengths[r])
            row = logits[r, :n].float()
            key = _fp16_radix_key(row, bits)
            hist = torch.bincount(key, minlength=1 << bits)
            above = torch.cumsum(hist.flip(0), 0).flip(0)          # count with key >= bin
            thr = int((above >= k).nonzero().max())
            higher = (key > thr).nonzero().flatten()
            cand = (key == thr).nonzero().flatten()
            if cand.numel() <= capacity:
                continue
            if arrival == "random":     # an arrival order other than columns', seeded by the row so reruns agree
                perm = torch.randperm(cand.numel(), generator=torch.Generator().manual_seed(r))
                cand = cand[perm.to(cand.device)]
            kept = cand[:capacity]
            need = k - higher.numel()
            best = kept[torch.topk(row[kept].double(), need).indices]
            idx[r] = torch.cat((higher, best)).to(idx.dtype)
        return idx
    return post


def topk_logits_op(post: Callable) -> Callable:
    """topk whose indices go through `post(indices, lengths, k, logits)` after the reference."""
    def topk(*, logits, lengths, k: int) -> dict:
        out = reference.topk(logits=logits, lengths=lengths, k=k)
        return {"indices": post(out["indices"].clone(), lengths.long(), k, logits)}
    return topk


# --- value boundaries: plateaus of exact ties, e8m0 codes no writer emits, subnormals -------

def _ties_dropped(idx, lengths, k, logits):
    """A threshold top-k that takes the entries above the k-th value, then the entries equal to
    it only when they all fit: when more tie at the k-th value than places remain, those
    places stay -1. Rows without such a tie are the reference's."""
    for r in (lengths > k).nonzero().flatten().tolist():
        row = logits[r, :int(lengths[r])].double()
        kth = torch.topk(row, k).values[-1]
        above = int((row > kth).sum())
        if int((row == kth).sum()) > k - above:
            sel = idx[r].long()
            keep = sel[row[sel] > kth]
            idx[r] = torch.cat((keep, keep.new_full((k - keep.numel(),), -1))).to(idx.dtype)
    return idx


def _zero_as_masked(idx, lengths, k, logits):
    """A top-k whose validity test is `score != 0` (0 standing for a masked entry): an entry
    scoring exactly 0 is never selected, and a row with fewer than k other entries is padded
    with -1. Rows whose selection holds no 0 are the reference's."""
    for r in (lengths > k).nonzero().flatten().tolist():
        row = logits[r, :int(lengths[r])]
        if not bool((row[idx[r].long()] == 0).any()):
            continue
        live = (row != 0).nonzero().flatten()
        m = min(k, live.numel())
        top = live[torch.topk(row[live].double(), m).indices]
        idx[r] = torch.cat((top, top.new_full((k - m,), -1))).to(idx.dtype)
    return idx


def _code0_flushed(packed, scales, dtype):
    """Keys decoded with the scale as fp32 bits `code << 23`: code 0 gives +0.0 instead of the
    subnormal 2^-127 (codes 1..254 are exact)."""
    vals = mxfp4.dequantize_mxfp4(packed, scales, dtype)
    zero = (scales == 0).repeat_interleave(vals.shape[-1] // scales.shape[-1], -1)
    return vals.masked_fill(zero, 0.0)


def _fp32_dequant(packed, scales, dtype):
    """Keys dequantized to fp32 before the product with q: e2m1 * 2^(code - 127) past fp32's
    range (6 * 2^127 at code 254, 6 * 2^126 at 253) is inf; every other value is exact."""
    return mxfp4.dequantize_mxfp4(packed, scales, torch.float32).to(dtype)


def _flush_subnormals(x: torch.Tensor) -> torch.Tensor:
    """Denormals-are-zero on a load: every subnormal becomes a zero of its sign."""
    return torch.where(x.float().abs() < torch.finfo(torch.float32).tiny, x * 0, x)


def _ftz_values(k, *args):
    return default_values(_flush_subnormals(k), *args)


def _ftz_q_op() -> Callable:
    """q_rope_mxfp4_quant loading q with its subnormals flushed to zero."""
    def q_rope_mxfp4_quant(*, q, **kw) -> dict:
        return reference.q_rope_mxfp4_quant(q=_flush_subnormals(q), **kw)
    return q_rope_mxfp4_quant


# --- structural boundaries: page geometry and batch structure ------------------------------

def _pages_read(context_lens, page_size: int) -> list[int]:
    return [-(-int(c) // page_size) for c in context_lens.long().tolist()]


def _one_owner_per_page(logits, kw):
    """A schedule over physical pages with a page -> sequence map scattered from the block
    tables (the last sequence listing a page owns it): each page is scored for its owner's
    rows only, so a page several sequences share (a prefix cache) is scored for one of them
    and the other sharers' columns of it are never written (here: -inf, a filled buffer)."""
    bt, ps = kw["block_table"].long(), kw["page_size"]
    qsl = kw["query_start_loc"].long().tolist()
    used = _pages_read(kw["context_lens"], ps)
    owner = {}
    for b, n in enumerate(used):
        for i in range(n):
            owner[int(bt[b, i])] = b
    for b, n in enumerate(used):
        for i in range(n):
            if owner[int(bt[b, i])] != b:
                logits[qsl[b]:qsl[b + 1], i * ps:(i + 1) * ps] = float("-inf")
    return logits


def _table_stride_from_context(query_start_loc, block_table, context_lens, page_size):
    """The block table read flat with a row stride of the pages the longest context needs
    (as if the table were exactly that wide) instead of its own: with a wider table (vLLM
    sizes it for the longest sequence the engine admits) every sequence after the first
    reads another row's page ids."""
    w = max(1, max(_pages_read(context_lens, page_size), default=1))
    b, width = block_table.shape
    flat = block_table.reshape(-1)
    idx = torch.arange(b, device=flat.device)[:, None] * w + torch.arange(width, device=flat.device)[None, :]
    return query_start_loc, flat[idx.clamp(max=flat.numel() - 1)]


def _decode_rows_are_sequences(query_start_loc, block_table, context_lens, page_size):
    """A call with at most one row per sequence takes the decode layout [B, next_n = 1]: row r
    reads sequence r's block table. Exact while every sequence has its row; after a sequence
    with no rows in the batch, each later row reads the table of the sequence before its own."""
    qsl = query_start_loc.long()
    rows = int(qsl[-1])
    if qsl.numel() < 2 or rows == 0 or not bool(((qsl[1:] - qsl[:-1]) <= 1).all()):
        return query_start_loc, block_table
    return torch.arange(rows + 1, device=qsl.device), block_table[:rows]


# --- non-finite inputs carried through, as a kernel carries them ------------------------------
# The reference refuses non-finite inputs; a kernel computes on them. These ops stand for a
# kernel on inputs a case plants (`plant`, `expect_nonfinite`): the reference on the finite
# part, the non-finite values carried where the arithmetic carries them. On finite inputs
# each gives the reference's bytes.

def _finite_part(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def nan_weights_q_op() -> Callable:
    """q_rope_mxfp4_quant whose head weights are folded as a kernel folds them (a multiply:
    NaN and inf stay NaN and inf); q quantized by the reference."""
    def q_rope_mxfp4_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                           hadamard: bool = False, scale_rule: str = "ceil", rope: str = "separate",
                           softmax_scale: Optional[float] = None, head_scale: Optional[float] = None) -> dict:
        out = reference.q_rope_mxfp4_quant(
            q=q, positions=positions, cos_sin_cache=cos_sin_cache, weights=_finite_part(weights),
            weights_scale=weights_scale, hadamard=hadamard, scale_rule=scale_rule, rope=rope,
            softmax_scale=softmax_scale, head_scale=head_scale)
        out["weights"] = fold_weights(weights, weights_scale, check_scale_pair(weights_scale, softmax_scale, head_scale))
        return out
    return q_rope_mxfp4_quant


def nan_weights_scorer_op(mask_add: bool = False) -> Callable:
    """paged_mxfp4_mqa_logits on non-finite head weights as a kernel scores them: a row with
    a NaN or inf weight sums NaN into every column it scores (w * relu(dot) is NaN for an
    infinite w times 0, and inf - inf or NaN in the sum). With `mask_add`, the columns at and
    past each row's end are masked by ADDING -inf (an additive mask) instead of writing it:
    NaN + -inf stays NaN there."""
    def paged_mxfp4_mqa_logits(*, weights, row_ends, clean_logits: bool = False, **kw) -> dict:
        out = reference.paged_mxfp4_mqa_logits(weights=_finite_part(weights), row_ends=row_ends,
                                               clean_logits=clean_logits, **kw)
        logits = out["logits"].clone()
        bad = ~torch.isfinite(weights).all(1)
        if bool(bad.any()):
            cols = torch.arange(logits.shape[1], device=logits.device)
            before = cols[None, :] < row_ends.to(logits.device).long()[:, None]
            logits[bad[:, None] & before] = float("nan")
            if mask_add and clean_logits:
                logits[bad[:, None] & ~before] = float("nan")
        return {"logits": logits}
    return paged_mxfp4_mqa_logits


def nan_ranking_topk_op(post: Callable = lambda idx, lengths, k, logits: idx) -> Callable:
    """topk on logits that may hold NaN inside a row, ranked as torch.topk ranks them (NaN
    above every number, so a NaN is taken first), then `post(indices, lengths, k, logits)`."""
    def topk(*, logits, lengths, k: int) -> dict:
        big = torch.finfo(torch.float32).max
        ranked = torch.where(torch.isnan(logits), big, logits.clamp(-big, big))
        out = reference.topk(logits=ranked, lengths=lengths, k=k)
        return {"indices": post(out["indices"].clone(), lengths.long(), k, logits)}
    return topk


def nonfinite_q_op(tile_guard: bool = False) -> Callable:
    """q_rope_mxfp4_quant on a q holding NaN or inf, as a kernel quantizes it: each
    (token, head) with a non-finite value stores the NaN scale (255) in every block; the rest
    is the reference's. With `tile_guard`, a non-finite check taken over the whole token (the
    tile of its heads) stores 255 in every head of that token: finite heads lose their scales."""
    def q_rope_mxfp4_quant(*, q, **kw) -> dict:
        bad = ~torch.isfinite(q.float()).all(-1)                      # [T, H]
        out = reference.q_rope_mxfp4_quant(q=torch.where(bad[..., None], torch.zeros_like(q), q), **kw)
        if tile_guard:
            bad = bad.any(1, keepdim=True).expand_as(bad)
        q_scale = out["q_scale"].clone()
        q_scale[bad] = 255
        out["q_scale"] = q_scale
        return out
    return q_rope_mxfp4_quant


def _nan_index_past_end(idx, lengths, k, logits):
    """A radix top-k that reads a NaN's bits as a key above every bin: each NaN it takes is
    written as the row's length (one past the row's last index), not its column."""
    taken = idx >= 0
    vals = torch.gather(logits, 1, idx.clamp_min(0).long())
    nan = taken & torch.isnan(vals)
    return torch.where(nan, lengths[:, None].to(idx.dtype).expand_as(idx), idx)


# --- graph-only faults: correct eagerly, wrong only when replayed from a graph -------------
#
# Each decides something on the host from its inputs. Run eagerly, every call decides again
# and is right; captured in a graph (harness/run/graph.py), the decision is the capture's
# dummy step's and every replay repeats it. Each wraps a correct op (`graph_base`).

def graph_base() -> tuple[dict, str, Optional[str]]:
    """(ops, device, why not capturable) a graph-only fault breaks one op of: compiled Triton's
    where it runs (a graph captures them), else the reference's (on the CPU, where graph
    mode's stand-in graph replays them in tests)."""
    if torch.cuda.is_available():
        be = get_backend("triton", require=False)
        if be.available() is None:
            return dict(be.ops), str(be.device), None
        return dict(reference.FUNCTIONS), "cuda", NO_GRAPH
    return dict(reference.FUNCTIONS), "cpu", None


def _fits_k_shortcut(inner: Callable) -> Callable:
    """topk that skips ranking when every row fits in k: each row's columns in order."""
    def topk(*, logits, lengths, k: int) -> dict:
        if lengths.numel() == 0 or int(lengths.max()) <= k:           # decided on the host
            idx = torch.arange(k, dtype=torch.int32, device=lengths.device).expand(lengths.shape[0], k)
            return {"indices": torch.where(idx < lengths[:, None], idx, torch.full_like(idx, -1)).contiguous()}
        return inner(logits=logits, lengths=lengths, k=k)
    return topk


def _split_count(inner: Callable) -> Callable:
    """A scorer whose programs per row are counted on the host from the longest row: columns
    past the last program's reach are never scored (-inf)."""
    def paged_mxfp4_mqa_logits(**kw) -> dict:
        out = inner(**kw)
        ends = kw["row_ends"]
        splits = -(-int(ends.max()) // GRAPH_SPLIT) if ends.numel() else 0
        logits = out["logits"]
        logits[:, splits * GRAPH_SPLIT:] = float("-inf")
        return {"logits": logits}
    return paged_mxfp4_mqa_logits


def _stale_workspace(inner: Callable) -> Callable:
    """A scorer split as vLLM's backends are: a metadata builder (`build`, which graph mode runs
    before every replay, outside the graph) copies the row ends into a workspace, reallocated
    when the longest row passes the power of two it was sized for; the kernel (`kernel`, what a
    graph captures) reads the row ends from the workspace it is given. Old workspaces stay
    allocated: a replay reads real, stale memory, never freed memory."""
    state: dict = {"ws": None, "reach": 0, "old": []}

    def build(*, row_ends, **_) -> torch.Tensor:
        longest = int(row_ends.max()) if row_ends.numel() else 0
        reach = 1 << max(0, longest - 1).bit_length()
        ws = state["ws"]
        if ws is None or reach > state["reach"] or ws.shape[0] < row_ends.shape[0] or ws.dtype != row_ends.dtype:
            if ws is not None:
                state["old"].append(ws)
            state["ws"] = ws = torch.empty(row_ends.shape[0], dtype=row_ends.dtype, device=row_ends.device)
            state["reach"] = max(reach, state["reach"])
        ws[:row_ends.shape[0]].copy_(row_ends)
        return ws

    def kernel(ws: torch.Tensor, **kw) -> dict:
        return inner(**dict(kw, row_ends=ws[:kw["row_ends"].shape[0]]))

    def paged_mxfp4_mqa_logits(**kw) -> dict:
        return kernel(build(**kw), **kw)
    paged_mxfp4_mqa_logits.build, paged_mxfp4_mqa_logits.kernel = build, kernel
    return paged_mxfp4_mqa_logits


def _count_item(inner: Callable) -> Callable:
    """A K writer that sizes its launch by the number of slots it writes, read with `.item()`:
    the slots past that count (in token order) are not written."""
    def k_norm_rope_mxfp4_cache(*, slot_mapping, **kw) -> dict:
        owned = slot_mapping >= 0
        n = owned.sum().item()                                     # read on the host
        rank = torch.cumsum(owned.to(torch.int64), 0) - 1
        slots = torch.where(owned & (rank < n), slot_mapping, torch.full_like(slot_mapping, -1))
        return inner(slot_mapping=slots, **kw)
    return k_norm_rope_mxfp4_cache


def _on_base(op: str, wrap: Callable) -> Callable[[], dict]:
    return lambda: {op: wrap(graph_base()[0][op])}


# --- the catalogue ----------------------------------------------------------------------

K = "k_norm_rope_mxfp4_cache"
Q = "q_rope_mxfp4_quant"
POOL = "compress_pool"
SCORE = "paged_mxfp4_mqa_logits"
TOPK = "topk"
FUSED = "compress_norm_rope_mxfp4_cache"

# fault name -> its broken ops (op name -> the faulty op); its words are in faults.toml.
_MAKE_OPS: dict[str, Callable[[], dict]] = {
    "window-shift": lambda: {POOL: pool_op(_shifted_windows)},
    "halves-swapped": lambda: {POOL: pool_op(_swapped_halves_windows)},
    "rope-neox": lambda: {K: k_writer_op(values=_permuted_values(_neox_perm))},
    "rope-first-dims": lambda: {K: k_writer_op(values=_permuted_values(_first_dims_perm))},
    "rope-at-p": lambda: {K: k_writer_op(rope_pos=lambda p, r: p.long())},
    "rope-at-p-div-r": lambda: {K: k_writer_op(rope_pos=lambda p, r: p.long() // r)},
    "boundary-off-by-one": lambda: {K: k_writer_op(mask=_boundary_first_token)},
    "nibbles-swapped": lambda: {K: k_writer_op(quantize=_swap_nibbles)},
    "scale-ocp-floor": lambda: {K: k_writer_op(quantize=_ocp_floor)},
    "scale-interleave-writer": lambda: {K: k_writer_op(write=_write_wrong_scale_order)},
    "scale-interleave-reader": lambda: {SCORE: scorer_op(scale_offsets=wrong_scale_offsets)},
    "missing-bf16-round": lambda: {K: k_writer_op(values=_values_norm_unrounded)},
    "fp8-ocp-read-fnuz": lambda: {"paged_fp8_mqa_logits": fp8_scorer_op("e4m3fnuz")},
    "hadamard-q-only": lambda: {Q: q_quant_op(force_hadamard=True)},
    "mask-off-by-one": lambda: {SCORE: scorer_op(row_ends_fn=_row_ends_minus_one)},
    "mask-missing": lambda: {SCORE: scorer_op(row_ends_fn=_row_ends_unmasked)},
    "offset-int32-wrap": lambda: {K: k_writer_op(write=wrapping_write(INT32_BITS))},
    "offset-wrap-sim": lambda: {K: k_writer_op(write=wrapping_write(SIM_WRAP_BITS))},
    "weights-scale-missing": lambda: {Q: q_quant_op(fold=_fold_none)},
    "weights-scale-twice": lambda: {Q: q_quant_op(fold=_fold_twice)},
    "topk-padding": lambda: {TOPK: topk_op(_pad_one_late)},
    "topk-duplicates": lambda: {TOPK: topk_op(_duplicate_last)},
    "writer-unowned-bytes": lambda: {K: k_writer_op(write=_write_clobbering)},
    "cuda-nope-untouched": lambda: {FUSED: _fused_nope_untouched()},
    "cuda-weights-one-multiply": lambda: {Q: _q_one_multiply()},
    "aiter-4244-int32-row-offset": lambda: {SCORE: logits_post_op(_rows_past_offset(INT32_BITS))},
    "aiter-4244-row-offset-sim": lambda: {SCORE: logits_post_op(_rows_past_offset(LOGITS_ROW_SIM_BITS))},
    "aiter-4028-schedule-truncation": lambda: {SCORE: logits_post_op(_schedule_truncated)},
    "aiter-2901-row-start-ignored": lambda: {TOPK: topk_logits_op(_row_start_ignored)},
    "aiter-3087-row-start-twice": lambda: {TOPK: topk_logits_op(_row_start_twice)},
    "sglang-36807-radix-overflow": lambda: {TOPK: topk_logits_op(radix_overflow(*RADIX_SGLANG, "random"))},
    "flaggems-831-narrow-band": lambda: {TOPK: topk_logits_op(radix_overflow(*RADIX_FLAGGEMS, "column"))},
    "vllm-50576-token-interleaved-read": lambda: {"paged_fp8_mqa_logits": fp8_token_interleaved_op()},
    "vllm-40991-flat-write": lambda: {K: k_writer_op(write=_write_natural_pages)},
    "atom-2216-neighbour-scale": lambda: {SCORE: scorer_op(scale_offsets=_neighbour_scale_offsets)},
    "sglang-13495-indexer-rope-layout": lambda: {K: k_writer_op(values=_permuted_values(_neox_perm)),
                                                 Q: _neox_q_op()},
    "sglang-12583-chunk-offset-ke": lambda: {SCORE: logits_post_op(_window_from_chunk_offset)},
    "mlx-lm-1189-chunk-rows-only": lambda: {SCORE: logits_post_op(_chunk_rows_only)},
    "vllm-41136-nan-decode": lambda: {SCORE: logits_post_op(_nan_in_decode)},
    # --- value boundaries
    "topk-tie-drop": lambda: {TOPK: topk_logits_op(_ties_dropped)},
    "topk-zero-as-masked": lambda: {TOPK: topk_logits_op(_zero_as_masked)},
    "e8m0-code0-flush": lambda: {SCORE: scorer_op(dequantize=_code0_flushed)},
    "e8m0-fp32-dequant-overflow": lambda: {SCORE: scorer_op(dequantize=_fp32_dequant)},
    "subnormal-flush": lambda: {K: k_writer_op(values=_ftz_values), Q: _ftz_q_op()},
    "scorer-page-owner": lambda: {SCORE: logits_post_op(_one_owner_per_page)},
    "scorer-table-stride": lambda: {SCORE: scorer_op(tables_fn=_table_stride_from_context)},
    "empty-seq-row-shift": lambda: {SCORE: scorer_op(tables_fn=_decode_rows_are_sequences)},
    # --- invariants: caught on non-finite inputs the reference refuses
    "topk-nan-row-garbage": lambda: {Q: nan_weights_q_op(), SCORE: nan_weights_scorer_op(),
                                     TOPK: nan_ranking_topk_op(_nan_index_past_end)},
    "scorer-nan-mask-add": lambda: {Q: nan_weights_q_op(), SCORE: nan_weights_scorer_op(mask_add=True),
                                    TOPK: nan_ranking_topk_op()},
    "q-nan-guard-per-token": lambda: {Q: nonfinite_q_op(tile_guard=True)},

    # graph-only
    "graph-fits-k-shortcut": _on_base(TOPK, _fits_k_shortcut),
    "graph-split-count": _on_base(SCORE, _split_count),
    "graph-stale-workspace": _on_base(SCORE, _stale_workspace),
    "graph-count-item": _on_base(K, _count_item),
}


def _catalogue() -> tuple[Fault, ...]:
    words = read_catalogue()
    if list(words) != list(_MAKE_OPS):
        raise RuntimeError(f"optimized/faults.toml: its faults {list(words)} are not those of optimized/faults.py "
                           f"{list(_MAKE_OPS)}")
    return tuple(Fault(**vars(w), make_ops=_MAKE_OPS[name]) for name, w in words.items())


_CATALOGUE = _catalogue()

FAULTS: dict[str, Fault] = {f.name: f for f in _CATALOGUE}

# Shipped bugs the catalogue cannot model, with the reason (the selftest matrix lists them).
NOT_MODELLED: dict[str, str] = {
    "vllm-project/vllm#52644": (
        "an accuracy drop only under FULL_DECODE_ONLY CUDA/HIP graph replay on MI350/MI355: graph mode "
        "(`--graph`) replays every op from a graph captured as vLLM captures it and the graph-only faults "
        "model the class, but the bug lives in aiter's kernels on MI350/MI355, which mxval's graphs do not "
        "run elsewhere; a capture taken under graph replay (`mxval diff` on its dumps) is the way to see it"),
}

for _f in _CATALOGUE:
    register(_f.backend_name, _f.backend)
