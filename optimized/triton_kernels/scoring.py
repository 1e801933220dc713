"""Paged MXFP4 (and FP8) MQA logits (NUMERICS.md §6):
logits[row, j] = sum_h w[row, h] * relu(q[row, h] . k[j]) for j < row_ends[row].

One program per (tile of BM rows of one sequence, split): it decodes the tile's q once,
transposed, as the tensor cores' B operand ([D, BM*H], loop-invariant, so it stays in
shared memory), and walks the entry blocks j = split, split + NSPLIT, ... up to the
tile's last row end. Each block of BN entries is gathered through the block table
straight from the pages (natural or preshuffled), decoded to values that are exact in
bf16 (e2m1 * 2**e and e4m3 fit in 8 mantissa bits) and multiplied as the A operand:
S^T[BN, BM*H] = K . Q^T with fp32 accumulation. The heads lie along N, so
`w * relu(.)` is reduced over them inside each thread and across the 4 lanes that share
an accumulator row (no shared-memory reduction); per-head scores never reach memory.
The dot is split into the even and odd elements of each pair so that a packed byte
decodes into two operands without shuffles.

Exactness: every k16 step of the tensor-core dot covers 16 elements of one 32-element
block, so its products share one power-of-two scale and their sum (an integer below
2**15 in units of that scale) is exact; steps and blocks are combined by the fp32
accumulator, and heads by fp32 adds, within a few fp32 ulps of the reference's fp64
logits (the contract's metric allows ~1e-6 relative). That holds while every decoded value
is a normal fp32: a call whose query or key scale bytes hold code 253 or 254 (e2m1 *
2**(e - 127) reaches 2**128) or 0 (a bf16 subnormal) is scored by `_scaled_after`, which
applies each 32-element block's two scales after the block's dot, as scaled-MMA
instructions do (the host picks it: `extreme_codes`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference import layout
from reference.scoring import check_mxfp4_scorer

from ..common import on_device
from .interp import e2m1_pair_operands, mma_operand, tile
from .numerics import e2m1_value, e8m0_value, fp8_value

BN = 64          # entries per block
_TWO_126: tl.constexpr = tl.constexpr(2.0 ** 126)


@triton.jit
def e2m1_scaled_pair(b, sc, FAST: tl.constexpr):
    """Packed byte b (int32) and block scale 2**(e-127) (fp32) -> (even, odd) fp32 values,
    exact. FAST: the 3 code bits are put where an fp32's exponent and first mantissa bit
    are, which spells e2m1 times 2**-126 for every code (0.5 as the subnormal 2**-127),
    so one shift-and-mask and two multiplies decode a value; else the select chain of
    numerics.e2m1_value."""
    if FAST:
        lo = ((b & 0x07) << 22) | ((b & 0x08) << 28)
        hi = ((b & 0x70) << 18) | ((b & 0x80) << 24)
        ve = (lo.to(tl.float32, bitcast=True) * _TWO_126) * sc
        vo = (hi.to(tl.float32, bitcast=True) * _TWO_126) * sc
    else:
        ve = e2m1_value(b & 15) * sc
        vo = e2m1_value(b >> 4) * sc
    return ve, vo


@triton.jit
def _decode_qt(qv_ptr, qs_ptr, row0, nrows, H, BM: tl.constexpr, HP: tl.constexpr, TB: tl.constexpr,
               QFP8: tl.constexpr, FNUZ: tl.constexpr, DECODE: tl.constexpr):
    """q of rows row0..row0+BM-1, all heads, as (even, odd) [TB, BM*HP] fp32 values
    (column n = row * HP + head): the B operand of K . Q^T."""
    mi = tl.arange(0, BM * HP)
    bm = mi // HP
    h = mi % HP
    qrow = (row0 + bm).to(tl.int64) * H + h                  # (row, head) index into [Rw*H]
    ok = ((bm < nrows) & (h < H))[None, :]
    mm = tl.arange(0, TB)
    if QFP8:
        base = qv_ptr + qrow[None, :] * (2 * TB) + 2 * mm[:, None]
        qe = fp8_value(tl.load(base, mask=ok, other=0).to(tl.int32), FNUZ)
        qo = fp8_value(tl.load(base + 1, mask=ok, other=0).to(tl.int32), FNUZ)
    else:
        NB: tl.constexpr = TB // 16
        qb = tl.load(qv_ptr + qrow[None, :] * TB + mm[:, None], mask=ok, other=0).to(tl.int32)
        e8 = tl.load(qs_ptr + qrow[None, :] * NB + mm[:, None] // 16, mask=ok, other=127).to(tl.int32)
        qe, qo = e2m1_scaled_pair(qb, e8m0_value(e8), DECODE != 0)
    return qe, qo


@triton.jit
def _k_block_mxfp4(cache_ptr, start, t, jm, PAGE: tl.constexpr, TB: tl.constexpr, NB: tl.constexpr,
                   SHUF_N: tl.constexpr, SHUF_DT: tl.constexpr, SHUF_L: tl.constexpr, DECODE: tl.constexpr,
                   WORDS: tl.constexpr):
    """(even, odd) [BN, TB] tensor-core operands of entries t of the pages at byte offsets
    `start`. DECODE: 0 select chain, 1 exponent-field trick, 2 inline PTX (NVIDIA)."""
    mm = tl.arange(0, TB)
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
    kb = tl.load(cache_ptr + start + voff, mask=jm[:, None], other=0)
    BN: tl.constexpr = t.shape[0]
    if WORDS:
        t0 = tl.min(t, axis=0)
        # The block's scale bytes are one contiguous run of the page (whole lane groups):
        # loaded as 32-bit words they take the asynchronous copy path with the values
        # (byte loads cannot), then are unshuffled in registers.
        NW: tl.constexpr = BN * NB // 4
        wp = (cache_ptr + start + PAGE * TB + t0 * NB).to(tl.pointer_type(tl.int32))
        w = tl.load(wp + tl.arange(0, NW))
        sb = (w[:, None] >> (8 * tl.arange(0, 4))[None, :]) & 0xFF                  # [NW, 4]
        if SHUF_N == 0:
            sb = tl.reshape(sb, (BN, NB))
        else:
            sb = tl.reshape(tl.permute(tl.reshape(sb, (BN // SHUF_N, SHUF_L, SHUF_N, NB // SHUF_L)), (0, 2, 3, 1)),
                            (BN, NB))                       # [group, s % L, lane, s // L] -> [t, s]
        ks = e8m0_value(sb)
    else:
        ks = e8m0_value(tl.load(cache_ptr + start + soff, mask=jm[:, None], other=127).to(tl.int32))
    ks = tl.reshape(tl.broadcast_to(ks[:, :, None], (BN, NB, 16)), (BN, TB))
    if DECODE == 2:
        return e2m1_pair_operands(kb, ks, True)
    else:
        ke, ko = e2m1_scaled_pair(kb.to(tl.int32), ks, DECODE == 1)
        return mma_operand(ke), mma_operand(ko)


@triton.jit
def _pow2(e):
    """2**e for integer e in [-126, 127], exact (built from the fp32 bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_after(qv_ptr, qs_ptr, row0, nrows, H, cache_ptr, start, t, jm, BM: tl.constexpr, HP: tl.constexpr,
                  TB: tl.constexpr, NB: tl.constexpr, PAGE: tl.constexpr, SHUF_N: tl.constexpr,
                  SHUF_DT: tl.constexpr, SHUF_L: tl.constexpr, BN: tl.constexpr):
    """S^T [BN, BM*HP] with each 32-element block's scales applied after its dot, as
    scaled-MMA instructions do: the block's e2m1 dot (even and odd halves, 16 products each,
    an exact multiple of 1/4 below 2**11) times 2**(e_k + e_q - 254), the power built from
    three exact factors. Exact where the decoded values are not: an e8m0 code of 253 or 254
    (e2m1 * 2**(e - 127) past fp32's range) or 0 (a bf16 subnormal operand). The host picks
    it for a call holding such a code (`extreme_codes`); q is decoded again each block of
    entries (this path is for rare inputs, not for speed)."""
    mi = tl.arange(0, BM * HP)
    qrow = (row0 + mi // HP).to(tl.int64) * H + mi % HP
    qok = ((mi // HP) < nrows) & ((mi % HP) < H)
    ones = tl.full((16, BM * HP), 1.0, tl.float32)
    kones = tl.full((BN, 16), 1.0, tl.float32)
    m16 = tl.arange(0, 16)
    S_HI: tl.constexpr = NB // SHUF_L
    acc = tl.zeros((BN, BM * HP), tl.float32)
    for b in tl.static_range(NB):
        mm = b * 16 + m16                                              # this block's value bytes
        qb = tl.load(qv_ptr + qrow[None, :] * TB + mm[:, None], mask=qok[None, :], other=0).to(tl.int32)
        qe, qo = e2m1_scaled_pair(qb, ones, False)
        qx = tl.load(qs_ptr + qrow * NB + b, mask=qok, other=127).to(tl.int32)
        if SHUF_N == 0:
            voff = t[:, None] * TB + mm[None, :]
            soff = PAGE * TB + t[:, None] * NB + b
        else:
            grp = (t // SHUF_N)[:, None]
            lane = (t % SHUF_N)[:, None]
            voff = (grp * (SHUF_N * TB) + (mm[None, :] // SHUF_DT) * (SHUF_N * SHUF_DT)
                    + lane * SHUF_DT + mm[None, :] % SHUF_DT)
            soff = (PAGE * TB + grp * (SHUF_N * NB) + (b % SHUF_L) * (SHUF_N * S_HI)
                    + lane * S_HI + b // SHUF_L)
        kb = tl.load(cache_ptr + start + voff, mask=jm[:, None], other=0).to(tl.int32)
        ke, ko = e2m1_scaled_pair(kb, kones, False)
        kx = tl.reshape(tl.load(cache_ptr + start + soff, mask=jm[:, None], other=127).to(tl.int32), (BN,))
        sb = tl.dot(mma_operand(ke), mma_operand(qe), out_dtype=tl.float32)
        sb = tl.dot(mma_operand(ko), mma_operand(qo), acc=sb, out_dtype=tl.float32)
        e = kx[:, None] + qx[None, :] - 254                            # in [-254, 254]
        e1 = e // 3
        e2 = (e - e1) // 2
        acc += ((sb * _pow2(e1)) * _pow2(e2)) * _pow2(e - e1 - e2)
    return acc


# Sizes that vary from call to call are not specialized on (one compile serves them all);
# the strides that align vector loads and stores are.
@triton.jit(do_not_specialize=["H", "W", "table_stride", "NSPLIT"])
def _logits_kernel(qv_ptr, qs_ptr, w_ptr, cache_ptr, table_ptr, tile_ptr, end_ptr, out_ptr,
                   H, W, page_stride, table_stride, out_stride,
                   BM: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                   SHUF_N: tl.constexpr, SHUF_DT: tl.constexpr, SHUF_L: tl.constexpr,
                   FP8: tl.constexpr, FNUZ: tl.constexpr, BN: tl.constexpr, NSPLIT,
                   DECODE: tl.constexpr, WORDS: tl.constexpr, SCALE_AFTER: tl.constexpr):
    TB: tl.constexpr = D // 2
    NB: tl.constexpr = D // 32
    # a block of BN entries lies in one page: one table read, and the gathered bytes are
    # runs of 16 (preshuffled) or 64 (natural) that load as 16-byte vectors
    ONE_PAGE: tl.constexpr = PAGE % BN == 0
    tile = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.load(tile_ptr + tile * 3).to(tl.int64)
    row0 = tl.load(tile_ptr + tile * 3 + 1)
    nrows = tl.load(tile_ptr + tile * 3 + 2)
    bi = tl.arange(0, BM)
    rows = row0 + bi
    ends = tl.load(end_ptr + rows, mask=bi < nrows, other=0)
    last = tl.max(ends, axis=0)
    nblocks = tl.cdiv(last, BN)
    if split < nblocks:
        if not SCALE_AFTER:
            qe, qo = _decode_qt(qv_ptr, qs_ptr, row0, nrows, H, BM, HP, TB, FP8, FNUZ, DECODE)
            qe = mma_operand(qe)
            qo = mma_operand(qo)
        ni = tl.arange(0, BM * HP)
        wm = ((ni // HP) < nrows) & ((ni % HP) < H)
        w = tl.load(w_ptr + (row0 + ni // HP).to(tl.int64) * H + ni % HP, mask=wm, other=0.0)
        tbase = table_ptr + seq * table_stride
        obase = out_ptr + rows.to(tl.int64)[None, :] * out_stride
        for jb in range(split, nblocks, NSPLIT):
            j0 = jb * BN
            j = j0 + tl.arange(0, BN)
            jm = j < last
            if ONE_PAGE:
                start = tl.load(tbase + j0 // PAGE).to(tl.int64) * page_stride
                t = j0 % PAGE + tl.arange(0, BN)
            else:
                page = tl.load(tbase + j // PAGE, mask=jm, other=0).to(tl.int64)
                start = (page * page_stride)[:, None]
                t = j % PAGE
            if FP8:
                mm = tl.arange(0, TB)
                voff = t[:, None] * D + 2 * mm[None, :]
                ke = fp8_value(tl.load(cache_ptr + start + voff, mask=jm[:, None], other=0).to(tl.int32), FNUZ)
                ko = fp8_value(tl.load(cache_ptr + start + voff + 1, mask=jm[:, None], other=0).to(tl.int32), FNUZ)
                k4 = tl.arange(0, 4)
                sb = tl.load(cache_ptr + start + PAGE * D + t[:, None] * 4 + k4[None, :],
                             mask=jm[:, None], other=0).to(tl.int32)
                s_k = tl.sum(sb << (8 * k4[None, :]), axis=1).to(tl.float32, bitcast=True)
                ke = mma_operand(ke)
                ko = mma_operand(ko)
            elif not SCALE_AFTER:
                ke, ko = _k_block_mxfp4(cache_ptr, start, t, jm, PAGE, TB, NB, SHUF_N, SHUF_DT, SHUF_L, DECODE,
                                        WORDS)
            if SCALE_AFTER:
                s = _scaled_after(qv_ptr, qs_ptr, row0, nrows, H, cache_ptr, start, t, jm, BM, HP, TB, NB, PAGE,
                                  SHUF_N, SHUF_DT, SHUF_L, BN)
            else:
                s = tl.dot(ke, qe, out_dtype=tl.float32)                       # [BN, BM*HP]
                s = tl.dot(ko, qo, acc=s, out_dtype=tl.float32)
            if FP8:
                s = s * s_k[:, None]
            p = tl.maximum(s, 0.0) * w[None, :]
            if BM == 1:
                logit = tl.sum(p, axis=1)[:, None]                            # heads reduced here
            else:
                logit = tl.sum(tl.reshape(p, (BN, BM, HP)), axis=2)           # [BN, BM]
            omask = (bi[None, :] < nrows) & (j[:, None] < ends[None, :]) & (j[:, None] < W)
            tl.store(obase + j[:, None], logit, mask=omask)


@triton.jit
def _decode_probe_kernel(byte_ptr, scale_ptr, out_ptr, N: tl.constexpr, DECODE: tl.constexpr):
    i = tl.arange(0, N)
    kb = tl.load(byte_ptr + i)
    sc = e8m0_value(tl.load(scale_ptr + i).to(tl.int32))
    if DECODE == 2:
        ve, vo = e2m1_pair_operands(kb, sc, True)
    else:
        ve, vo = e2m1_scaled_pair(kb.to(tl.int32), sc, DECODE == 1)
        ve = mma_operand(ve)
        vo = mma_operand(vo)
    tl.store(out_ptr + 2 * i, ve.to(tl.float32))
    tl.store(out_ptr + 2 * i + 1, vo.to(tl.float32))


def decode_probe(packed: torch.Tensor, scale_bytes: torch.Tensor, decode: int) -> torch.Tensor:
    """The scorer's e2m1 decoder on its own (tests): uint8 [N] bytes and [N] scale bytes
    (N a power of two) -> fp32 [N, 2] (even, odd) operand values."""
    n = packed.numel()
    out = torch.empty(n, 2, dtype=torch.float32, device=packed.device)
    _decode_probe_kernel[(1,)](packed.contiguous(), scale_bytes.contiguous(), out, N=n, DECODE=decode)
    return out


def scale_words(kv_cache: torch.Tensor, page_size: int, d: int, bn: int, shuf) -> bool:
    """A block's scale bytes load as aligned 32-bit words when the block is whole lane
    groups of one page and every page's scale bytes start on a 4-byte boundary."""
    return (page_size % bn == 0 and (shuf is None or bn % shuf.n == 0) and kv_cache.stride(0) % 4 == 0
            and kv_cache.data_ptr() % 4 == 0 and (page_size * d // 2) % 4 == 0 and (bn * d // 32) % 4 == 0)


def decode_mode() -> int:
    """2 (inline PTX) on NVIDIA GPUs, else 1; the interpreter runs mode 2 as plain Triton."""
    return 2 if torch.version.hip is None else 1


def row_tiles(query_start_loc: torch.Tensor, bm: int) -> torch.Tensor:
    """int32 [tiles, 3] = (sequence, first row, rows): up to bm consecutive rows of one sequence."""
    qsl = query_start_loc.tolist()
    tiles = [(b, r, min(bm, qsl[b + 1] - r)) for b in range(len(qsl) - 1) for r in range(qsl[b], qsl[b + 1], bm)]
    return torch.tensor(tiles or [(0, 0, 0)], dtype=torch.int32).view(-1, 3)


def pick_config(rows_per_seq: int, heads: int) -> tuple[int, int, int, int]:
    """(BM rows per program, BN entries per block, warps, pipeline stages): decode rows
    stand alone (N = H); prefill rows of one sequence share each decoded K block
    (N = BM * H <= 128)."""
    hp = max(16, triton.next_power_of_2(heads))
    bn = tile(64, 256)
    if rows_per_seq <= 1:
        return 1, bn, 4, 3
    bm = max(1, min(triton.next_power_of_2(rows_per_seq), 128 // hp))
    return bm, bn, 4, 3


def launch(q_vals, q_scales, weights, kv_cache, block_table, tiles, row_ends, *, width, page_size,
           shuffle, clean_logits, fp8_dtype=None, config=None, nsplit=None, decode=None, words=None,
           scale_after=False):
    """fp32 logits [Rw, width]; past each row's end -inf when clean_logits, else unwritten.
    `tiles` from row_tiles(query_start_loc, config[0]). `decode` (measurement only): the
    e2m1 decoder, default `decode_mode()`; `words` (measurement only): load the scale
    bytes as page words where `scale_words(...)` allows (off by default: not yet timed)."""
    rw, h = weights.shape
    d = q_vals.shape[2] if fp8_dtype else q_vals.shape[2] * 2
    dev = weights.device
    fill = torch.full if clean_logits else (lambda shape, v, **kw: torch.empty(shape, **kw))
    out = fill((rw, width), float("-inf"), dtype=torch.float32, device=dev)
    if rw == 0 or width == 0:
        return out
    bm, bn, warps, stages, *rest = config or (1, BN, 4, 3)
    regs = {"maxnreg": rest[0]} if rest and rest[0] else {}     # (measurement) register cap
    shuf = layout.as_shuffle(shuffle)
    n_tiles = tiles.shape[0]
    if nsplit is None:
        # decode: 16 programs per row (measured on an H200: 16, 32, 64 splits within 5%);
        # prefill: ~2 programs per row tile, 2 per SM and more, balance the causal tail
        target = tile(1024 if bm == 1 else 4096, 1)
        nsplit = max(1, min(triton.cdiv(width, bn), triton.cdiv(target, n_tiles)))
    hp = max(16, triton.next_power_of_2(h))
    # FMA contraction stays on here: the decoder only multiplies by powers of two, and the
    # score sums it fuses are measured by the contract's metric (an FMA rounds less).
    _logits_kernel[(n_tiles, nsplit)](
        q_vals, q_scales if q_scales is not None else q_vals, weights, kv_cache, block_table, tiles,
        row_ends, out, h, width, kv_cache.stride(0), block_table.stride(0), out.stride(0),
        BM=bm, HP=hp, D=d, PAGE=page_size, SHUF_N=shuf.n if shuf else 0, SHUF_DT=shuf.dt if shuf else 1,
        SHUF_L=shuf.l if shuf else 1, FP8=fp8_dtype is not None, FNUZ=fp8_dtype == "e4m3fnuz",
        BN=bn, NSPLIT=nsplit, DECODE=decode_mode() if decode is None else decode,
        WORDS=bool(words and not fp8_dtype and scale_words(kv_cache, page_size, d, bn, shuf)),
        SCALE_AFTER=bool(scale_after and not fp8_dtype), num_warps=warps, num_stages=stages, **regs)
    return out


EXTREME_CODES = (0, 253, 254)    # e8m0 codes whose decoded values leave fp32's normal range


def extreme_codes(q_scale: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  context_lens: torch.Tensor, page_size: int, d: int, shuffle) -> bool:
    """Whether a call's query scales, or the scale bytes of the entries it reads (each
    sequence's first context_lens entries, through its block table: never the bytes of a
    slot no one wrote), hold a code whose e2m1 values decode outside fp32's normal range
    (NUMERICS.md §4): the kernel then applies each block's scales after its dot
    (`_scaled_after`). One gather of the entries' scale bytes (1/17 of what the call reads)."""
    codes = torch.tensor(EXTREME_CODES, dtype=torch.uint8, device=kv_cache.device)
    if bool(torch.isin(q_scale, codes.to(q_scale.device)).any()):
        return True
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    cnt = (context_lens.long()[:, None] - cols[None, :] * page_size).clamp(0, page_size)     # entries read per page
    keep = cnt > 0
    if not bool(keep.any()):
        return False
    pages, cnt = block_table[keep].long().to(kv_cache.device), cnt[keep].to(kv_cache.device)
    t = torch.arange(page_size, device=kv_cache.device)
    offs = layout.scale_offsets(t, page_size, d, shuffle)                                    # [page, NB]
    scales = kv_cache[pages][:, offs]                                                        # [pages, page, NB]
    return bool((torch.isin(scales, codes) & (t[None, :, None] < cnt[:, None, None])).any())


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
        shuf, _, width, _ = check_mxfp4_scorer(q_fp4, q_scale, weights, kv_cache, query_start_loc,
                                            context_lens, block_table, row_ends, page_size, shuffle, width)
        (qv, qs, w, kc, bt, ctx, ends), tiles, config, back = prepare(
            device, query_start_loc, row_ends, weights.shape[1], q_fp4, q_scale, weights, kv_cache, block_table,
            context_lens)
        extreme = extreme_codes(qs, kc, bt, ctx, page_size, q_fp4.shape[2] * 2, shuf)
        out = launch(qv, qs, w, kc, bt, tiles, ends, width=width, page_size=page_size, shuffle=shuf,
                     clean_logits=clean_logits, config=config, scale_after=extreme)
        return {"logits": back(out, weights)}

    return {"paged_mxfp4_mqa_logits": paged_mxfp4_mqa_logits}
