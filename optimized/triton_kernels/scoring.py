"""Paged MXFP4 (and FP8) MQA logits (NUMERICS.md §6):
logits[row, j] = sum_h w[row, h] * relu(q[row, h] . k[j]) for j < row_ends[row].

One program per (tile of BM rows of one sequence, split): it decodes the tile's q once
([BM*H, D] in registers) and walks the entry blocks j = split, split + NSPLIT, ... up to
the tile's last row end; each decoded K block serves BM*H rows of the tensor-core dot
(decode: BM = 1; prefill: BM*H = 128 or 256). Each block
is gathered through the block table straight from the pages (natural or preshuffled),
decoded to values that are exact in bf16 (e2m1 * 2**e and e4m3 fit in 8 mantissa bits),
multiplied on the tensor cores with fp32 accumulation, and reduced over heads in
registers: per-head scores never reach memory. The dot is split into the even and odd
elements of each pair so that a packed byte decodes into two operands without shuffles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference import layout
from reference.scoring import check_mxfp4_scorer

from ..common import on_device
from .interp import LAUNCH, mma_operand
from .numerics import e2m1_value, e8m0_value, fp8_value

BN = 64          # entries per block
TARGET_PROGRAMS = 2048


@triton.jit
def _decode_q(qv_ptr, qs_ptr, row0, nrows, H, BM: tl.constexpr, HP: tl.constexpr, TB: tl.constexpr,
              QFP8: tl.constexpr, FNUZ: tl.constexpr):
    """q of rows row0..row0+BM-1, all heads, as (even, odd) [BM*HP, TB] fp32 values."""
    mi = tl.arange(0, BM * HP)
    bm = mi // HP
    h = mi % HP
    qrow = (row0 + bm).to(tl.int64) * H + h                  # (row, head) index into [Rw*H]
    ok = ((bm < nrows) & (h < H))[:, None]
    mm = tl.arange(0, TB)
    if QFP8:
        base = qv_ptr + qrow[:, None] * (2 * TB) + 2 * mm[None, :]
        qe = fp8_value(tl.load(base, mask=ok, other=0).to(tl.int32), FNUZ)
        qo = fp8_value(tl.load(base + 1, mask=ok, other=0).to(tl.int32), FNUZ)
    else:
        NB: tl.constexpr = TB // 16
        qb = tl.load(qv_ptr + qrow[:, None] * TB + mm[None, :], mask=ok, other=0).to(tl.int32)
        e8 = tl.load(qs_ptr + qrow[:, None] * NB + mm[None, :] // 16, mask=ok, other=127).to(tl.int32)
        sc = e8m0_value(e8)
        qe = e2m1_value(qb & 15) * sc
        qo = e2m1_value(qb >> 4) * sc
    return qe, qo


@triton.jit
def _logits_kernel(qv_ptr, qs_ptr, w_ptr, cache_ptr, table_ptr, tile_ptr, end_ptr, out_ptr,
                   H, W, page_stride, table_stride, out_stride,
                   BM: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                   SHUF_N: tl.constexpr, SHUF_DT: tl.constexpr, SHUF_L: tl.constexpr,
                   FP8: tl.constexpr, FNUZ: tl.constexpr, BN: tl.constexpr, NSPLIT: tl.constexpr):
    TB: tl.constexpr = D // 2
    NB: tl.constexpr = D // 32
    tile = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.load(tile_ptr + tile * 3).to(tl.int64)
    row0 = tl.load(tile_ptr + tile * 3 + 1)
    nrows = tl.load(tile_ptr + tile * 3 + 2)
    bi = tl.arange(0, BM)
    rows = row0 + bi
    ends = tl.load(end_ptr + rows, mask=bi < nrows, other=0).to(tl.int64)
    nblocks = tl.cdiv(tl.max(ends, axis=0), BN)
    if split < nblocks:
        qe, qo = _decode_q(qv_ptr, qs_ptr, row0, nrows, H, BM, HP, TB, FP8, FNUZ)
        qe = mma_operand(qe)
        qo = mma_operand(qo)
        mi = tl.arange(0, BM * HP)
        wm = ((mi // HP) < nrows) & ((mi % HP) < H)
        w = tl.load(w_ptr + (row0 + mi // HP).to(tl.int64) * H + mi % HP, mask=wm, other=0.0)
        mm = tl.arange(0, TB)
        for jb in range(split, nblocks, NSPLIT):
            j = jb * BN + tl.arange(0, BN)
            jm = j < tl.max(ends, axis=0)
            page = tl.load(table_ptr + seq * table_stride + j // PAGE, mask=jm, other=0).to(tl.int64)
            t = j % PAGE
            start = (page * page_stride)[:, None]
            if FP8:
                voff = t[:, None] * D + 2 * mm[None, :]
                ke = fp8_value(tl.load(cache_ptr + start + voff, mask=jm[:, None], other=0).to(tl.int32), FNUZ)
                ko = fp8_value(tl.load(cache_ptr + start + voff + 1, mask=jm[:, None], other=0).to(tl.int32), FNUZ)
                k4 = tl.arange(0, 4)
                sb = tl.load(cache_ptr + start + PAGE * D + t[:, None] * 4 + k4[None, :],
                             mask=jm[:, None], other=0).to(tl.int32)
                s_k = tl.sum(sb << (8 * k4[None, :]), axis=1).to(tl.float32, bitcast=True)
            else:
                sidx = tl.arange(0, NB)
                if SHUF_N == 0:
                    voff = t[:, None] * TB + mm[None, :]
                    soff = PAGE * TB + t[:, None] * NB + sidx[None, :]
                else:
                    S_HI: tl.constexpr = NB // SHUF_L
                    grp = (t // SHUF_N)[:, None]
                    lane = (t % SHUF_N)[:, None]
                    voff = (grp * (SHUF_N * TB) + (mm[None, :] // SHUF_DT) * (SHUF_N * SHUF_DT)
                            + lane * SHUF_DT + mm[None, :] % SHUF_DT)
                    soff = (PAGE * TB + grp * (SHUF_N * NB) + (sidx[None, :] % SHUF_L) * (SHUF_N * S_HI)
                            + lane * S_HI + sidx[None, :] // SHUF_L)
                kb = tl.load(cache_ptr + start + voff, mask=jm[:, None], other=0).to(tl.int32)
                ks = e8m0_value(tl.load(cache_ptr + start + soff, mask=jm[:, None], other=127).to(tl.int32))
                ks = tl.reshape(tl.broadcast_to(ks[:, :, None], (BN, NB, 16)), (BN, TB))
                ke = e2m1_value(kb & 15) * ks
                ko = e2m1_value(kb >> 4) * ks
            s = tl.dot(qe, tl.trans(mma_operand(ke)), out_dtype=tl.float32)
            s = tl.dot(qo, tl.trans(mma_operand(ko)), acc=s, out_dtype=tl.float32)
            if FP8:
                s = s * s_k[None, :]
            p = tl.maximum(s, 0.0) * w[:, None]                              # [BM*HP, BN]
            logit = tl.sum(tl.reshape(p, (BM, HP, BN)), axis=1)               # heads reduced here
            omask = (bi[:, None] < nrows) & (j[None, :] < ends[:, None]) & (j[None, :] < W)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_stride + j[None, :], logit, mask=omask)


def row_tiles(query_start_loc: torch.Tensor, bm: int) -> torch.Tensor:
    """int32 [tiles, 3] = (sequence, first row, rows): up to bm consecutive rows of one sequence."""
    qsl = query_start_loc.tolist()
    tiles = [(b, r, min(bm, qsl[b + 1] - r)) for b in range(len(qsl) - 1) for r in range(qsl[b], qsl[b + 1], bm)]
    return torch.tensor(tiles or [(0, 0, 0)], dtype=torch.int32).view(-1, 3)


def pick_config(rows_per_seq: int, heads: int) -> tuple[int, int, int]:
    """(BM rows per program, BN entries per block, warps): decode rows stand alone; prefill
    rows of one sequence share each decoded K block (M = BM * H on the tensor cores)."""
    hp = max(16, triton.next_power_of_2(heads))
    if rows_per_seq <= 1:
        return 1, 64, 4
    bm = max(1, min(triton.next_power_of_2(rows_per_seq), 256 // hp))
    return bm, 64, 8 if bm * hp >= 256 else 4


def launch(q_vals, q_scales, weights, kv_cache, block_table, tiles, row_ends, *, width, page_size,
           shuffle, clean_logits, fp8_dtype=None, config=None, nsplit=None):
    """fp32 logits [Rw, width]; past each row's end -inf when clean_logits, else unwritten.
    `tiles` from row_tiles(query_start_loc, config[0])."""
    rw, h = weights.shape
    d = q_vals.shape[2] if fp8_dtype else q_vals.shape[2] * 2
    dev = weights.device
    fill = torch.full if clean_logits else (lambda shape, v, **kw: torch.empty(shape, **kw))
    out = fill((rw, width), float("-inf"), dtype=torch.float32, device=dev)
    if rw == 0 or width == 0:
        return out
    bm, bn, warps = config or (1, BN, 4)
    shuf = layout.as_shuffle(shuffle)
    n_tiles = tiles.shape[0]
    if nsplit is None:
        nsplit = max(1, min(triton.cdiv(width, bn), triton.cdiv(TARGET_PROGRAMS, n_tiles)))
    hp = max(16, triton.next_power_of_2(h))
    _logits_kernel[(n_tiles, nsplit)](
        q_vals, q_scales if q_scales is not None else q_vals, weights, kv_cache, block_table, tiles,
        row_ends, out, h, width, kv_cache.stride(0), block_table.stride(0), out.stride(0),
        BM=bm, HP=hp, D=d, PAGE=page_size, SHUF_N=shuf.n if shuf else 0, SHUF_DT=shuf.dt if shuf else 1,
        SHUF_L=shuf.l if shuf else 1, FP8=fp8_dtype is not None, FNUZ=fp8_dtype == "e4m3fnuz",
        BN=bn, NSPLIT=nsplit, num_warps=warps, **LAUNCH)
    return out


def prepare(device, query_start_loc, row_ends, heads, *tensors):
    """Move everything to the device; pick the tiling and build the row tiles."""
    moved, back = on_device(device, *(t.contiguous() for t in tensors), row_ends.contiguous())
    qsl = query_start_loc.long()
    per = int((qsl[1:] - qsl[:-1]).max()) if qsl.numel() > 1 else 1
    config = pick_config(per, heads)
    return moved, row_tiles(qsl.cpu(), config[0]).to(device), config, back


def make_op(device: str):
    def paged_mxfp4_mqa_logits(*, q_fp4, q_scale, weights, kv_cache, query_start_loc, context_lens,
                               block_table, row_ends, page_size: int = 64, shuffle=(32, 16, 2),
                               clean_logits: bool = False, width: int | None = None) -> dict:
        shuf, _, width = check_mxfp4_scorer(q_fp4, q_scale, weights, kv_cache, query_start_loc,
                                            context_lens, block_table, row_ends, page_size, shuffle, width)
        (qv, qs, w, kc, bt, ends), tiles, config, back = prepare(
            device, query_start_loc, row_ends, weights.shape[1], q_fp4, q_scale, weights, kv_cache, block_table)
        out = launch(qv, qs, w, kc, bt, tiles, ends, width=width,
                     page_size=page_size, shuffle=shuf, clean_logits=clean_logits, config=config)
        return {"logits": back(out, weights)}

    return {"paged_mxfp4_mqa_logits": paged_mxfp4_mqa_logits}
