"""Paged scoring (NUMERICS.md §6): logits[row, j] = sum_h w[row,h] * relu(q[row,h] . k[j]).

The reference scores in fp64 from exactly dequantized operands (MXFP4 and FP8 values are
exact in fp64 and their products and sums of 128 terms are too, for any realistic scale
spread), so its logits are the true scores of the quantized operands; the kernels'
fp32 accumulation lands within ~1e-14 of them in the scale-invariant metric.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from . import checks, layout, mxfp4
from .formats import E2M1_SIGNED, E8M0_NAN, MX_BLOCK

# Work tile of the dense core: rows*H*entries fp64 scores materialized at once.
_TILE_ELEMS = 1 << 23


def weighted_relu_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Dense core. q [Rw, H, D], k [J, D], w [Rw, H] -> fp64 [Rw, J]; never materializes
    more than a tile of per-head scores."""
    rw, h, d = q.shape
    j = k.shape[0]
    q64, k64, w64 = q.double(), k.double(), w.double()
    out = torch.empty(rw, j, dtype=torch.float64, device=q.device)
    if rw == 0 or j == 0:
        return out
    jc = max(1, min(j, _TILE_ELEMS // h))
    rc = max(1, _TILE_ELEMS // (h * jc))
    for r0 in range(0, rw, rc):
        qr = q64[r0:r0 + rc]                                   # [rc, H, D]
        wr = w64[r0:r0 + rc].unsqueeze(1)                      # [rc, 1, H]
        for j0 in range(0, j, jc):
            s = torch.matmul(qr, k64[j0:j0 + jc].T).clamp_min_(0)   # [rc, H, jc]
            out[r0:r0 + rc, j0:j0 + jc] = torch.bmm(wr, s).squeeze(1)
    return out


# --- MXFP4 fast exact core -----------------------------------------------------------
#
# q = a * 2**(eq-128), k = c * 2**(ek-128) with a, c small integers (twice an e2m1 value,
# |.| <= 12), so every product is an integer times 2**(eq_b + ek_b - 256) and a block's
# 32-term dot is an integer below 4608 in those units. Any partial sum of the D terms, in
# any order, is then an integer multiple of 2**Emin below nb*4608 * 2**Emax, which fp32
# holds exactly when the block exponents of the pair span few enough binades and stay in
# fp32's normal range. Those columns come from a plain fp32 matmul and are bit-identical
# to the fp64 dot; wider spreads (up to 38 binades) from an fp64 matmul of the same
# operands, wider still from per-block fp32 dots (exact for any spread) summed in fp64
# (`column_cores`). The operands have 2 significant bits, so a TF32 or bf16-input GEMM
# with fp32 accumulation is exact too.

def _byte_e2m1() -> torch.Tensor:
    """fp64 [256, 2]: the e2m1 values of a packed byte's two codes, the even element (low
    nibble) first. Every decode table below is built from it."""
    e2m1 = torch.tensor(E2M1_SIGNED, dtype=torch.float64)
    b = torch.arange(256)
    return torch.stack((e2m1[b & 15], e2m1[b >> 4]), -1)


def _word_e2m1() -> torch.Tensor:
    """fp64 [65536, 4]: row v + 32768 holds the e2m1 values of the two bytes behind the
    signed int16 word v, in memory order (taken from the machine: any endianness works)."""
    mem = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.uint8).view(-1, 2).long()
    pair = _byte_e2m1()
    return torch.cat((pair[mem[:, 0]], pair[mem[:, 1]]), -1)


@functools.lru_cache(maxsize=8)
def _scaled_byte_lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Entry (e << 8) | byte: the two values e2m1(byte & 15) * 2**(e - 127) and
    e2m1(byte >> 4) * 2**(e - 127), computed in fp64 (exact) and stored as one element of
    twice the width (fp32 pair: int64, fp64 pair: complex128); e = 255 (NaN scale): NaN."""
    e = torch.arange(256)
    pow2 = ((e.clamp(max=254) - 127 + 1023) << 52).view(torch.float64)        # 2**(e - 127)
    pow2 = torch.where(e == E8M0_NAN, float("nan"), pow2)
    lut = (pow2[:, None, None] * _byte_e2m1()).to(dtype).contiguous()         # [256, 256, 2]
    if dtype == torch.float64:
        return torch.view_as_complex(lut).view(-1).to(device)
    return lut.view(torch.int64).view(-1).to(device)


def dequantize_mxfp4_f32(packed: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 values in fp32 (exact for scale bytes in [0, 252]; 253 and 254 overflow, 255
    is NaN; the exact cores send those entries to the generic fp64 one) or fp64 (exact for
    every scale byte). One table read per byte, scale folded in: (e << 8) | byte -> the
    byte's two values."""
    nb = scales.shape[-1]
    idx = packed.reshape(*scales.shape, -1) + (scales.int() << 8).unsqueeze(-1)   # int32
    vals = _scaled_byte_lut(packed.device, dtype).index_select(0, idx.view(-1))
    vals = torch.view_as_real(vals) if dtype == torch.float64 else vals.view(dtype)
    return vals.reshape(*scales.shape[:-1], nb * MX_BLOCK)


def _block_exponents(packed: torch.Tensor, scales: torch.Tensor):
    """Per vector: (lo, hi, ok, any_live) of the scale bytes of its live blocks (a block is
    live when a code is non-zero). ok: no NaN scale, live scales within [2, 252]."""
    live = _live_blocks(packed, scales)
    e = scales.int()
    lo = torch.where(live, e, 1 << 20).amin(-1)
    hi = torch.where(live, e, -(1 << 20)).amax(-1)
    ok = ~(e == 255).any(-1) & (~live | ((e >= 2) & (e <= 252))).all(-1)
    return lo, hi, ok, live.any(-1)


def _live_blocks(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    per_block = packed.shape[-1] // scales.shape[-1]
    if per_block % 8 == 0:   # 8 code pairs per int64 word: 8x fewer elements to test
        words = packed.contiguous().view(torch.int64).reshape(*scales.shape, per_block // 8)
        live = (words & 0x7777777777777777).ne(0).any(-1)
    else:
        live = (packed.reshape(*scales.shape, per_block) & 0x77).ne(0).any(-1)
    return live


# Cores of the fast exact scorer, in order of preference (each column takes the first
# whose exactness is proved for it; exact cores give identical values).
CORE_F32, CORE_F64, CORE_BLOCKS, CORE_FP64_GENERIC = 0, 1, 2, 3


def column_cores(q_packed, q_scale, k_packed, k_scale) -> torch.Tensor:
    """int8 [J]: the core each key column is scored with.

    * CORE_F32: one fp32 matmul is exact: the pair's block exponents span few enough
      binades (24 - 15 = 9 bits of headroom for 128 products below 144 * 2**E) and stay
      inside fp32's normal range;
    * CORE_F64: one fp64 matmul of the same (fp32-exact) operands is exact: 53 - 15 = 38
      binades, no range limit;
    * CORE_BLOCKS: per-block fp32 dots are exact (all 32 products of a block share one
      scale: an integer below 2**13 times 2**(eq+ek-256), exact while eq + ek is in
      [107, 371]), summed over the blocks in fp64;
    * CORE_FP64_GENERIC: the rest (NaN or extreme scale bytes).
    The cheap test counts every block as live; only columns it rejects are scanned for dead
    (all-zero) blocks, whose scale bytes do not matter."""
    return grouped_column_cores(q_packed[None], q_scale[None], k_packed[None], k_scale[None])[0]


def grouped_column_cores(q_packed, q_scale, k_packed, k_scale) -> torch.Tensor:
    """`column_cores` of G groups at once: queries [G, ..., D/2] (every query vector of a
    group counts for all its columns), keys [G, J, D/2] -> int8 [G, J]."""
    g, j, nb = k_scale.shape
    dev = k_scale.device
    qlo, qhi, qok, qlive = (t.reshape(g, -1) for t in _block_exponents(q_packed, q_scale))
    q_ok = qok.all(1)[:, None]
    # all-zero queries (no live block): every product is 0, no range to respect
    q_spread = torch.where(qlive, qhi - qlo, 0).amax(1)[:, None]
    q_lo = torch.where(qlive, qlo, 1 << 20).amin(1)[:, None]
    q_hi = torch.where(qlive, qhi, -(1 << 20)).amax(1)[:, None]
    spread32, spread64 = _exact_spread(nb, 24), _exact_spread(nb, 53)

    def assign(lo, hi, ok, dead, qs, ql, qh, qk):
        f32 = ok & (dead | (((hi - lo) + qs <= spread32) & (lo + ql >= 130) & (hi + qh <= 368)))
        f64 = ok & (dead | ((hi - lo) + qs <= spread64))
        blocks = ok & (dead | ((lo + ql >= 107) & (hi + qh <= 371)))
        c = torch.where(f32, CORE_F32, torch.where(f64, CORE_F64, torch.where(blocks, CORE_BLOCKS,
                                                                                 CORE_FP64_GENERIC)))
        return torch.where(qk, c, CORE_FP64_GENERIC).to(torch.int8)

    e = k_scale.int()
    cores = assign(e.amin(-1), e.amax(-1), (e >= 2).all(-1) & (e <= 252).all(-1),
                   torch.zeros(g, j, dtype=torch.bool, device=dev), q_spread, q_lo, q_hi, q_ok)
    gi, ji = (cores > CORE_F64).nonzero(as_tuple=True)
    if gi.numel():
        klo, khi, kok, klive = _block_exponents(k_packed[gi, ji], k_scale[gi, ji])
        again = assign(klo, khi, kok, ~klive, q_spread[gi, 0], q_lo[gi, 0], q_hi[gi, 0], q_ok[gi, 0])
        cores[gi, ji] = torch.minimum(again, cores[gi, ji])
    return cores


def exact_f32_columns(q_packed, q_scale, k_packed, k_scale) -> torch.Tensor:
    """Bool [J]: key columns whose dots with every query head are exact in fp32."""
    return column_cores(q_packed, q_scale, k_packed, k_scale) == CORE_F32


def exact_f64_columns(q_packed, q_scale, k_packed, k_scale) -> torch.Tensor:
    """Bool [J]: key columns whose dots are exact in fp64 from the fp32-exact operands."""
    return column_cores(q_packed, q_scale, k_packed, k_scale) <= CORE_F64


def blockwise_f32_columns(q_packed, q_scale, k_packed, k_scale) -> torch.Tensor:
    """Bool [J]: key columns whose per-block dots are exact in fp32 (any spread)."""
    return column_cores(q_packed, q_scale, k_packed, k_scale) <= CORE_BLOCKS


def _cpu_cores(q_packed, q_scale, k_scale):
    """The CPU's choice per key column: (q8, mq, lo: the keys' least scale bytes, i8, f64),
    i8 where the int8 table core serves the column (the queries' and the key's scale bytes
    within `_I8_SPREAD` binades, the CPU's int8 GEMM proven exact), f64 where the fp64
    table core does; the other columns go to their `column_cores` core. q8 (the queries'
    `int8_operand` values) is None where no column takes the int8 core."""
    mq, qspread = _live_min_spread(q_packed, q_scale)
    lo, i8, f64 = _cpu_columns(int(qspread.max()), k_scale)
    q8 = _int8_decode(q_packed, q_scale, mq) if bool(i8.any()) else None
    return q8, mq, lo, i8, f64


def _exact_spread(nb: int, mantissa_bits: int) -> int:
    """The most binades a pair's block scales may spread for its dot of nb blocks to be exact
    in a float of `mantissa_bits` (24: fp32, 53: fp64): every partial sum is an integer below
    nb * 4608 in units of the smallest block's scale."""
    return mantissa_bits - (nb * 4608 - 1).bit_length()


def _key_range(k_scale: torch.Tensor):
    """(lo, hi) uint8 [...]: the least and greatest of each key's scale bytes [..., NB], as
    elementwise ops on the NB byte columns (a reduction over a few bytes per row is slow)."""
    cols = k_scale.unbind(-1)
    lo = hi = cols[0]
    for c in cols[1:]:
        lo, hi = torch.minimum(lo, c), torch.maximum(hi, c)
    return lo, hi


def _cpu_columns(qs, k_scale):
    """(lo, i8, f64) of `_cpu_cores` for keys [..., J, NB] and the queries' greatest live
    spread qs (an int, or a tensor broadcasting against [..., J])."""
    nb = k_scale.shape[-1]
    lo, hi = _key_range(k_scale)
    ks = hi - lo                                                   # uint8: hi >= lo
    ok = hi != E8M0_NAN
    i8 = ok & (ks <= _I8_SPREAD) & (qs <= _I8_SPREAD) if _cpu_int_mm_exact() else torch.zeros_like(ok)
    f64 = ok & ~i8 & (ks <= _F64_SHIFTS) & (ks.int() + qs <= _exact_spread(nb, 53))
    return lo, i8, f64


def cpu_core_shares(q_packed, q_scale, k_packed, k_scale) -> dict:
    """The share of key columns each CPU core scores (for benchmarks): int8 and fp64 table
    cores, then the `column_cores` cores of the rest."""
    if bool((q_scale == E8M0_NAN).any()):
        i8 = f64 = torch.zeros(k_scale.shape[0], dtype=torch.bool)
    else:
        *_, i8, f64 = _cpu_cores(q_packed, q_scale, k_scale)
    rest = column_cores(q_packed, q_scale, k_packed, k_scale)[~(i8 | f64)]
    j = max(1, k_scale.shape[0])
    return {"int8 table": int(i8.sum()) / j, "fp64 table": int(f64.sum()) / j,
            **{name: int((rest == c).sum()) / j for name, c in (("fp32", CORE_F32), ("fp64", CORE_F64),
                                                                ("blocks", CORE_BLOCKS),
                                                                ("generic", CORE_FP64_GENERIC))}}


def mxfp4_relu_logits(q_packed, q_scale, k_packed, k_scale, w) -> torch.Tensor:
    """Same values as `weighted_relu_logits` on the dequantized operands (fp64 [Rw, J]):
    exact dots, relu and the weighted head sum in fp64, summed over the heads in order
    (the order of the fp64 matmul there; `_head_sum`). On a CPU, by the spread of each
    key's scale bytes (all blocks counted) and the queries' (live blocks): int8 dots where
    both are within `_I8_SPREAD` binades, else one fp64 matmul where the key's are within
    `_F64_SHIFTS` and the pair's within the fp64 proof (`_table_core`); the other columns
    (and all on other devices) from their `column_cores` core: an fp32 or fp64 matmul, or
    per-block fp32 dots summed in fp64 (exact up to 40 binades between a pair's blocks,
    beyond that only the 3 block additions round)."""
    rw = q_scale.shape[0]
    j, nb = k_scale.shape
    out = torch.empty(rw, j, dtype=torch.float64, device=q_packed.device)
    if rw == 0 or j == 0:
        return out
    if q_packed.device.type != "cpu" or bool((q_scale == E8M0_NAN).any()):
        return _column_core_logits(q_packed, q_scale, k_packed, k_scale, w)
    q8, mq, lo, i8, f64 = _cpu_cores(q_packed, q_scale, k_scale)
    cores = [(i8, lambda kp, ksc, klo, o: _table_core(q8, w.double() * _pow2(mq), kp, ksc, klo, o)),
             (f64, lambda kp, ksc, klo, o: _table_core(dequantize_mxfp4_f32(q_packed, q_scale, torch.float64),
                                                      w.double(), kp, ksc, klo, o))]
    rest = ~(i8 | f64)
    for sel, core in cores:
        if bool(sel.all()):
            core(k_packed, k_scale, lo, out)
            return out
        if bool(sel.any()):
            cols = sel.nonzero().flatten()
            part = torch.empty(rw, cols.numel(), dtype=torch.float64)
            core(k_packed[cols], k_scale[cols], lo[cols], part)
            out[:, cols] = part
    if bool(rest.any()):
        cols = rest.nonzero().flatten()
        out[:, cols] = _column_core_logits(q_packed, q_scale, k_packed[cols], k_scale[cols], w)
    return out


def _column_core_logits(q_packed, q_scale, k_packed, k_scale, w) -> torch.Tensor:
    """fp64 [Rw, J], each column from its `column_cores` core (chosen over all the rows). On
    a GPU in blocks of rows whose dequantized queries (fp64: 8 bytes an element) take no more
    than the call's operands and output, at least `_MIN_COLUMN_ROWS_BYTES`: every row's
    logits are its own."""
    rw, h, d = q_scale.shape[0], q_scale.shape[1], q_packed.shape[-1] * 2
    j = k_scale.shape[0]
    cores = column_cores(q_packed, q_scale, k_packed, k_scale)
    if not _ROWS_IN_BLOCKS.get(q_packed.device.type) or rw <= 1:
        return _column_core_rows(q_packed, q_scale, k_packed, k_scale, w, cores)
    own = sum(t.numel() * t.element_size() for t in (q_packed, q_scale, k_packed, k_scale)) + rw * j * 8
    step = max(1, (_COLUMN_ROWS_BYTES or max(own, _MIN_COLUMN_ROWS_BYTES)) // (h * d * 8))
    if step >= rw:
        return _column_core_rows(q_packed, q_scale, k_packed, k_scale, w, cores)
    out = torch.empty(rw, j, dtype=torch.float64, device=q_packed.device)
    for r0 in range(0, rw, step):
        r1 = min(rw, r0 + step)
        out[r0:r1] = _column_core_rows(q_packed[r0:r1], q_scale[r0:r1], k_packed, k_scale, w[r0:r1], cores)
    return out


_MIN_COLUMN_ROWS_BYTES = 1 << 20
_COLUMN_ROWS_BYTES = None                  # a fixed budget instead (tests)
_ROWS_IN_BLOCKS = {"cuda": True}          # the CPU's memory is not what bounds it


def _column_core_rows(q_packed, q_scale, k_packed, k_scale, w, cores) -> torch.Tensor:
    """`_column_core_logits` of these rows, with the columns' cores given."""
    rw = q_scale.shape[0]
    nb = q_scale.shape[-1]
    j = k_scale.shape[0]
    out = torch.empty(rw, j, dtype=torch.float64, device=q_packed.device)
    q32 = w64 = None
    for core in (CORE_F32, CORE_F64, CORE_BLOCKS, CORE_FP64_GENERIC):
        sel = cores == core
        if not bool(sel.any()):
            continue
        whole = bool(sel.all())
        cols = None if whole else sel.nonzero().flatten()
        kp, ks = (k_packed, k_scale) if whole else (k_packed[cols], k_scale[cols])
        if core == CORE_FP64_GENERIC:
            res = weighted_relu_logits(mxfp4.dequantize_mxfp4(q_packed, q_scale, torch.float64),
                                       mxfp4.dequantize_mxfp4(kp, ks, torch.float64), w)
        elif core == CORE_BLOCKS:
            if q32 is None:
                q32, w64 = dequantize_mxfp4_f32(q_packed, q_scale), w.double()
            res = _blockwise_f32(q32, dequantize_mxfp4_f32(kp, ks), w64, nb)
        else:
            dt = torch.float32 if core == CORE_F32 else torch.float64
            res = _dense(dequantize_mxfp4_f32(q_packed, q_scale, dt), kp, ks, w.double())
        if whole:
            return res
        out[:, cols] = res
    return out


def _head_sum(w64: torch.Tensor, s64: torch.Tensor) -> torch.Tensor:
    """sum_h w[r, h] * s[r, h, j] in fp64: [Rw, H] x [Rw, H, J] -> [Rw, J]. The products are
    exact (the callers' dots are exact, w has 24 bits), the sum is the bmm's: over h in
    order, the same for any J, chunk or row count (the reference's tests pin it bitwise)."""
    return torch.bmm(w64.unsqueeze(1), s64).squeeze(1)


def _dense(q, k_packed, k_scale, w64) -> torch.Tensor:
    """fp64 [Rw, J] from fp32 or fp64 (q's dtype) dots that are exact (the caller proved it),
    relu and the weighted head sum in fp64. Keys are dequantized `_CPU_KEYS` at a time, so
    the matmul reads them from cache, and rows go `_CPU_TILE` scores at a time."""
    rw, h, d = q.shape
    j = k_scale.shape[0]
    out = torch.empty(rw, j, dtype=torch.float64, device=q.device)
    rc = max(1, _CPU_TILE // (h * _CPU_KEYS))
    for c0 in range(0, j, _CPU_KEYS):
        k = dequantize_mxfp4_f32(k_packed[c0:c0 + _CPU_KEYS], k_scale[c0:c0 + _CPU_KEYS], q.dtype)
        for r0 in range(0, rw, rc):
            s = _relu64(torch.matmul(q[r0:r0 + rc], k.T))                  # [rc, H, c]
            out[r0:r0 + rc, c0:c0 + _CPU_KEYS] = _head_sum(w64[r0:r0 + rc], s)
    return out


# --- the CPU's table-decoded cores ----------------------------------------------------
#
# A key whose scale bytes e_b lie in [lo, lo + S] is k = c * 2**(lo - 128) with c the
# vector of 2 * e2m1 * 2**(e_b - lo): small integers, read from a table (the shift and the
# decode in one gather; dead blocks decode to zeros whatever their scale byte). For q . c
# exact, scaling by the power of two 2**(lo - 128) > 0 commutes with relu, and every fp64
# product and sum of
#     logits[r, j] = 2**(lo[j]-128) * sum_h w[r,h] * relu(q[r,h] . c[j])
# is the one of `_head_sum` on the true dots scaled by the same power of two (no value
# nears fp64's subnormal or overflow range): the same bits, whatever rounds. Two cores:
# * int8 (S = `_I8_SPREAD`, |c| <= 12 * 2**3 = 96; a word per table read, index
#   s * 65536 + word + 32768): the queries as `int8_operand`s too (q = q8 * 2**(mq - 128),
#   that factor moved onto w: exact), int32 dots exact;
# * fp64 (S = `_F64_SHIFTS`, |c| <= 12 * 2**11 fits int16; a byte per table read, index
#   s << 8 | byte): the queries' fp64 values, c converted to fp64 (exact) just before one
#   fp64 matmul, exact where the pair's spread is within the fp64 proof (`column_cores`).

# keys per matmul (and per-head scores per tile, fp64 2 MB: in cache between the matmul
# and the head sum), decoded keys per gather (4 MB)
_CPU_KEYS = 4096
_CPU_TILE = 1 << 18
_CPU_DECODE_BYTES = 1 << 22
_F64_SHIFTS = 11


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**(e - 128) in fp64 (exact, e an e8m0 byte in [0, 254])."""
    return ((e.long() - 128 + 1023) << 52).view(torch.float64)


@functools.lru_cache(maxsize=4)
def _shift_byte_lut_i16(device: torch.device) -> torch.Tensor:
    """int32 [(_F64_SHIFTS + 1) * 256]: entry (s << 8) | byte holds, in memory order, the int16
    values 2 * e2m1(byte & 15) * 2**s and 2 * e2m1(byte >> 4) * 2**s (|.| <= 12 * 2**11)."""
    pair = _byte_e2m1() * 2                                                    # [256, 2]
    lut = torch.cat([pair * 2 ** s for s in range(_F64_SHIFTS + 1)]).to(torch.int16).contiguous()
    return lut.view(torch.int32).view(-1).to(device)


@functools.lru_cache(maxsize=1)
def _cpu_int_mm_exact() -> bool:
    """Whether torch's CPU int8 GEMM returns exact int32 dots at the operands' extremes
    (|.| <= 96, K = 128: a u8 x s8 pair sum in int16, as some int8 GEMMs without VNNI form,
    saturates here). Checked once."""
    pattern = torch.tensor([[96] * 8, [-96] * 8, [96, -96] * 4, [96, 96, -96, 96, -96, -96, 96, -96]])
    a = pattern.repeat(5, 16).to(torch.int8)                                    # [20, 128]
    b = torch.cat((pattern, -pattern)).repeat(3, 16).to(torch.int8)             # [24, 128]
    try:
        got = torch._int_mm(a, b.T)
    except RuntimeError:
        return False
    return bool(torch.equal(got.long(), a.long() @ b.long().T))


def _table_core(q, w64, k_packed, k_scale, lo, out) -> None:
    """out fp64 [Rw, J] from queries q [Rw, H, D] (int8: the int8 core, w64 carrying their
    factor; fp64: the fp64 core) and keys whose scale bytes lie in [lo, lo + S] (lo [J],
    NaN excluded); the caller proved the dots exact. Few, large operations: keys decoded
    (to int8 or int16) `_CPU_DECODE_BYTES` at a time, scored `_CPU_KEYS` at a time (fp64:
    converted just before the matmul), the power of two last."""
    rw, h, d = q.shape
    j, nb = k_scale.shape
    int8 = q.dtype == torch.int8
    shift = (k_scale - lo.unsqueeze(-1)).int().unsqueeze(-1)                       # [J, nb, 1]
    if int8:    # a word (2 bytes) per index: entry s * 65536 + (word + 32768) -> 4 int8 values
        kp = k_packed.reshape(j, nb, -1).view(torch.int16)
        sh = (shift << 16) + 32768
        lut = _shifted_word_lut(q.device, _I8_SPREAD + 1)
    else:       # a byte per index: entry (s << 8) | byte -> 2 int16 values
        kp = k_packed.reshape(j, nb, -1)
        sh = shift << 8
        lut = _shift_byte_lut_i16(q.device)
    per_key = kp.shape[1] * kp.shape[2]                                            # table reads
    step = _CPU_KEYS
    dk = max(step, _CPU_DECODE_BYTES // (d * (1 if int8 else 2)) // step * step)
    # buffers reused chunk after chunk: they stay in cache, no page faults
    idx = torch.empty(min(j, dk) * per_key, dtype=torch.int32)
    kbuf = torch.empty(min(j, dk) * per_key, dtype=lut.dtype)
    bufs: dict = {}
    for d0 in range(0, j, dk):
        dn = min(dk, j - d0)
        ic = idx[:dn * per_key]
        ic.view(dn, nb, -1).copy_(kp[d0:d0 + dn]).add_(sh[d0:d0 + dn])             # no temporary
        kd = torch.index_select(lut, 0, ic, out=kbuf[:dn * per_key])
        _score_decoded(q, w64, kd.view(torch.int8 if int8 else torch.int16).view(dn, d), out[:, d0:d0 + dn], bufs)
    out.mul_(_pow2(lo))


def _score_decoded(q, w64, kd, out, bufs: dict) -> None:
    """out fp64 [Rw, J] = sum_h w64[r, h] * relu(q[r, h] . kd[j]) for decoded keys kd
    (int8 [J, D] with int8 q: exact int32 dots; int16 [J, D] with fp64 q: exact fp64 dots
    where the caller proved it), relu and the head sum in fp64 (`_head_sum`'s order),
    `_CPU_KEYS` keys at a time (fp64: converted just before the matmul); the keys' powers
    of two are the caller's. `bufs`: scratch kept across the caller's calls."""
    rw, h, d = q.shape
    j = kd.shape[0]
    int8 = q.dtype == torch.int8
    step = _CPU_KEYS
    rc = max(1, min(rw, _CPU_TILE // (h * step)))
    cc = min(j, step)
    if bufs.get("shape") != (rc, h, cc, d, int8):
        bufs.update(shape=(rc, h, cc, d, int8),
                    k64=None if int8 else torch.empty(cc, d, dtype=torch.float64),
                    dots=torch.empty(rc * h * cc, dtype=torch.int32 if int8 else torch.float64))
        bufs["s64"] = torch.empty(rc * h * cc, dtype=torch.float64) if int8 else bufs["dots"]
    k64, dots, s64 = bufs["k64"], bufs["dots"], bufs["s64"]
    for c0 in range(0, j, step):
        c = min(step, j - c0)
        kc = kd[c0:c0 + c] if int8 else k64[:c].copy_(kd[c0:c0 + c])               # int16 -> fp64, exact
        for r0 in range(0, rw, rc):
            rn = min(rc, rw - r0)
            dc, sc = dots[:rn * h * c].view(rn * h, c), s64[:rn * h * c].view(rn, h, c)
            qm = q[r0:r0 + rn].reshape(rn * h, d)
            if int8:
                torch._int_mm(qm, kc.T, out=dc)                                    # exact int32 dots
                sc.copy_(dc.clamp_min_(0).view(rn, h, c))                          # relu, to fp64
            else:
                torch.mm(qm, kc.T, out=dc).clamp_min_(0)                           # exact fp64 dots, relu
            dst = out[r0:r0 + rn, c0:c0 + c]
            if rn == 1:
                torch.mm(w64[r0:r0 + 1], sc[0], out=dst)                           # = `_head_sum`
            else:
                dst.copy_(_head_sum(w64[r0:r0 + rn], sc))


# columns per chunk of the blockwise core: its fp32 and fp64 block scores stay in cache
_BLOCK_COLS = 1024


def _blockwise_f32(q32, k32, w64, nb: int) -> torch.Tensor:
    """fp64 [Rw, J]: per row, one batched fp32 matmul over the nb blocks ([nb, H, 32] x
    [nb, 32, jc]: each block's dot exact, the caller proved it), the blocks summed in
    fp64, then relu and the weighted head sum in fp64."""
    rw, h, d = q32.shape
    j = k32.shape[0]
    blk = d // nb
    out = torch.empty(rw, j, dtype=torch.float64, device=q32.device)
    kb = k32.view(j, nb, blk).permute(1, 2, 0)                        # [nb, 32, J]
    d32 = torch.empty(nb, h, min(j, _BLOCK_COLS), dtype=torch.float32, device=q32.device)
    d64 = torch.empty(nb, h, min(j, _BLOCK_COLS), dtype=torch.float64, device=q32.device)
    for r in range(rw):
        qb = q32[r].view(h, nb, blk).transpose(0, 1)                  # [nb, H, 32]
        wr = w64[r].view(1, h)
        for j0 in range(0, j, _BLOCK_COLS):
            jc = min(_BLOCK_COLS, j - j0)
            if jc == d32.shape[2]:
                a64 = d64
                torch.bmm(qb, kb[:, :, j0:j0 + jc], out=d32)
                a64.copy_(d32)
            else:
                a64 = torch.bmm(qb, kb[:, :, j0:j0 + jc]).double()
            s = a64[0]
            for b in range(1, nb):                                   # block order, fp64
                s = s + a64[b]
            out[r, j0:j0 + jc] = (wr @ s.clamp_min_(0)).squeeze(0)
    return out


# --- many sequences at once -----------------------------------------------------------
#
# A decode step scores one row per sequence against each sequence's own keys: per sequence
# that is a small matmul, and a loop of them is bound by launches and host syncs on a GPU.
# `grouped_relu_logits` scores G sequences with the same number of rows as batched
# matmuls. Its cores are the exact ones above, plus one for GPUs:
#
# CORE_I8 (integer dots): a vector whose live blocks' scale bytes span at most
# `_I8_SPREAD` binades is an int8 vector times one power of two (twice an e2m1 value is an
# integer of magnitude <= 12, and 12 * 2**3 = 96 fits int8), so q . k = N * 2**(mq+mk-256)
# with N an exact int32 dot (|N| <= 128 * 96 * 96). As 2**x > 0 commutes with relu,
#     logits[r, j] = 2**(mk[j]-128) * sum_h (w[r,h] * 2**(mq[r,h]-128)) * relu(N[r,h,j])
# where every product is exact in fp64 and equals the fp32/fp64 cores' product times the
# column's power of two: the same fp64 sum, term by term, scaled exactly.

_I8_SPREAD = 3
# where the batched cores (and CORE_I8 among them) are the default: on a CPU one sequence at
# a time keeps each matmul's keys in cache, and the fp32 matmul is as fast as the int8 one
BATCHED_DEVICES = ("cuda",)
INT8_DEVICES = ("cuda",)
# how the last batched call scored its groups ("int8", "fp32", "fp64", "per sequence"): for
# benchmarks and reports
last_path = ""
# Work tile of the batched cores: scores materialized at once (fp32 or int32, then fp64),
# at most this many; on a GPU also at most as many bytes as the call's operands and output
# (so a call's peak stays within a few times its tensors), but never fewer than _MIN_TILE_ELEMS
_GROUP_TILE_ELEMS = {"cpu": 1 << 23, "cuda": 1 << 27}
_MIN_TILE_ELEMS = 1 << 22


def _group_tile(device: torch.device, *tensors: torch.Tensor, elem_bytes: int = 1) -> int:
    """Scores per work tile on `device`; with `tensors` (the call's operands and output) and
    `elem_bytes` (what one score takes across its intermediates), bounded by their bytes."""
    most = _GROUP_TILE_ELEMS.get(device.type, 1 << 23)
    if not tensors or device.type != "cuda":
        return most
    own = sum(t.numel() * t.element_size() for t in tensors)
    return min(most, max(_MIN_TILE_ELEMS, own // elem_bytes))


def int8_operand(packed: torch.Tensor, scales: torch.Tensor):
    """MXFP4 vectors [..., D/2] as (int8 [..., D], m int32 [...], spread int32 [...]): the
    value is int8 * 2**(m - 128) wherever spread (of the live blocks' scale bytes) <=
    `_I8_SPREAD`; all-zero vectors have spread 0."""
    m, spread = _live_min_spread(packed, scales)
    return _int8_decode(packed, scales, m), m, spread


def _live_min_spread(packed: torch.Tensor, scales: torch.Tensor):
    """(m, spread) int32 [...] of MXFP4 vectors: the least scale byte of the live blocks and
    the binades the live blocks' scale bytes span (all-zero vectors: 128 and 0)."""
    live = _live_blocks(packed, scales)
    e = scales.int()
    lo = torch.where(live, e, 1 << 20).amin(-1)
    hi = torch.where(live, e, -(1 << 20)).amax(-1)
    any_live = live.any(-1)
    return torch.where(any_live, lo, 128), torch.where(any_live, hi - lo, 0)


def _int8_decode(packed: torch.Tensor, scales: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int8 [..., D]: twice the e2m1 values times 2**(scale byte - m), shifts clamped to
    [0, `_I8_SPREAD`] (exact where the vector's live spread allows; dead blocks hold zeros):
    one `_shifted_word_lut` read per int16 word."""
    shift = (scales.int() - m.unsqueeze(-1)).clamp(0, _I8_SPREAD)
    words = packed.contiguous().view(torch.int16).view(*scales.shape, MX_BLOCK // 4)
    idx = words + (shift * 65536 + 32768).unsqueeze(-1)                     # int32
    vals = _shifted_word_lut(packed.device, _I8_SPREAD + 1).index_select(0, idx.view(-1))
    return vals.view(torch.int8).view(*scales.shape[:-1], scales.shape[-1] * MX_BLOCK)


@functools.lru_cache(maxsize=8)
def _shifted_word_lut(device: torch.device, shifts: int) -> torch.Tensor:
    """int32 [shifts * 65536] (every caller asks for `_I8_SPREAD` + 1: one table a device):
    entry s * 65536 + (v + 32768), for a signed int16 word v of packed codes and a block
    shift s, holds the word's 4 int8 values (twice an e2m1 value, times 2**s) as one int32
    in memory order: one gather decodes and scales 4 values."""
    signed = (_word_e2m1() * 2).int()                                   # by v + 32768
    return torch.cat([(signed << s).to(torch.int8) for s in range(shifts)]).contiguous(
        ).view(torch.int32).reshape(-1).to(device)


def paged_int8_keys(pg: torch.Tensor, k_scale: torch.Tensor, m: torch.Tensor, *, page_size: int, head_dim: int,
                    shuffle):
    """Keys of gathered pages `pg` as an `int8_operand` (int8 [E, D]) read straight from the
    page bytes, E = pages * page_size in entry order, with scale bytes `k_scale` [E, D/32]
    (`layout.page_scales`) and m [E] the smallest of each entry's scale bytes (dead blocks
    included): the value is int8 * 2**(m - 128), exact where the entry's scale bytes span
    at most `_I8_SPREAD` binades (the caller checks the entries it reads; the others hold
    clamped values, never read). None where the layout cannot be read so. The unshuffle,
    the decode and the block scaling are one add and one gather (no per-nibble passes)."""
    words = layout.page_block_words(pg, page_size=page_size, head_dim=head_dim, shuffle=shuffle)
    if words is None:
        return None
    shift = (k_scale - m.unsqueeze(-1)).clamp_(max=_I8_SPREAD).int()       # uint8: m is the row's least
    off = (shift * 65536 + 32768).view(*words.shape[:5], 1)
    idx = torch.empty(words.shape, dtype=torch.int32, device=pg.device)
    torch.add(words, off, out=idx)                                       # unshuffled, in entry order
    vals = _shifted_word_lut(pg.device, _I8_SPREAD + 1).index_select(0, idx.view(-1))
    return vals.view(torch.int8).view(k_scale.shape[0], head_dim)


def _relu64(s: torch.Tensor) -> torch.Tensor:
    """max(s, 0) as fp64, one pass (exact: s is an exact dot)."""
    if s.dtype == torch.float64:
        return s.clamp_min_(0)
    out = torch.empty(s.shape, dtype=torch.float64, device=s.device)
    return torch.maximum(s, torch.zeros((), dtype=s.dtype, device=s.device), out=out)


def _int_dots(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a [M, D] . b [J, D]^T, int8 in, exact int32 out (J a multiple of 8). The GPU's
    int8 GEMM wants M > 16: fewer rows are padded with zeros."""
    m = a.shape[0]
    if m > 16:
        torch._int_mm(a, b.T, out=out)
    else:
        out.copy_(torch._int_mm(torch.nn.functional.pad(a, (0, 0, 0, 32 - m)), b.T)[:m])


def _i8_logits(q8, mq, k8, mk, w, out) -> None:
    """CORE_I8 over whole groups into out fp64 [G, R, J] from `int8_operand`s of the queries
    ([G, R, H, D], [G, R, H]) and keys ([G, J, D], [G, J]); the caller proved the spreads."""
    g, r, h = mq.shape
    j = mk.shape[1]
    wq = torch.ldexp(w.double(), (mq - 128).double())                      # exact
    jp = j + (-j % 8)                                                     # the int8 GEMM's column multiple
    if jp != j:
        k8 = torch.nn.functional.pad(k8, (0, 0, 0, jp - j))
    colscale = torch.ldexp(torch.ones_like(wq[:, :1, :1]), (mk - 128).double().unsqueeze(1))  # [G, 1, J]
    tile = _group_tile(out.device, q8, k8, out, elem_bytes=12)                 # int32 dots, fp64 relu
    gc = max(1, min(g, tile // max(1, r * h * jp)))
    rc = max(1, min(r, tile // (h * jp)))
    for g0 in range(0, g, gc):
        gn = min(gc, g - g0)
        for r0 in range(0, r, rc):
            rn = min(rc, r - r0)
            n = torch.empty(gn, rn * h, jp, dtype=torch.int32, device=out.device)
            for i in range(gn):                                           # exact int32 dots
                _int_dots(q8[g0 + i, r0:r0 + rn].reshape(rn * h, -1), k8[g0 + i], n[i])
            s = _relu64(n).view(gn * rn, h, jp)
            dots = torch.bmm(wq[g0:g0 + gn, r0:r0 + rn].reshape(gn * rn, 1, h), s).view(gn, rn, jp)
            torch.mul(dots[:, :, :j], colscale[g0:g0 + gn], out=out[g0:g0 + gn, r0:r0 + rn])


def _dense_logits(q_packed, q_scale, k_packed, k_scale, w, out, dt) -> None:
    """CORE_F32 (dt fp32) or CORE_F64 (dt fp64) over whole groups into out fp64 [G, R, J]."""
    g, r, h = q_scale.shape[:3]
    j = k_scale.shape[1]
    q = dequantize_mxfp4_f32(q_packed, q_scale, dt)                       # [G, R, H, D]
    w64 = w.double()
    tile = _group_tile(q_packed.device, q, k_packed, k_scale, out, elem_bytes=2 * q.element_size() + 8)
    gc = max(1, min(g, tile // max(1, r * h * j)))
    rc = max(1, min(r, tile // (h * j)))
    for g0 in range(0, g, gc):
        gn = min(gc, g - g0)
        k = dequantize_mxfp4_f32(k_packed[g0:g0 + gn], k_scale[g0:g0 + gn], dt).transpose(1, 2)  # [gn, D, J]
        for r0 in range(0, r, rc):
            rn = min(rc, r - r0)
            s = torch.matmul(q[g0:g0 + gn, r0:r0 + rn].reshape(gn, rn * h, -1), k)             # [gn, rn*H, J]
            s = _relu64(s).view(gn * rn, h, j)
            out[g0:g0 + gn, r0:r0 + rn] = torch.bmm(w64[g0:g0 + gn, r0:r0 + rn].reshape(gn * rn, 1, h),
                                                    s).view(gn, rn, j)


def grouped_relu_logits(q_packed, q_scale, k_packed, k_scale, w, n, *, batched: bool | None = None,
                        int8: bool | None = None) -> torch.Tensor:
    """G sequences with R rows each: queries [G, R, H, D/2] (+ scales [G, R, H, D/32]),
    keys [G, J, D/2] (+ [G, J, D/32]), weights [G, R, H], n [G] the keys each sequence
    reads -> fp64 [G, R, J]; columns at and past n[g] are unspecified.

    Per sequence, the values of `mxfp4_relu_logits`. `batched` (default: on a GPU) scores
    all sequences with batched matmuls when one core serves every column (CORE_I8 where
    `int8`, default on a GPU, and the spreads allow; else CORE_F32, or CORE_F64 where some
    column needs it), and falls back to one `mxfp4_relu_logits` per sequence otherwise."""
    g, r = q_scale.shape[:2]
    j = k_scale.shape[1]
    dev = q_packed.device
    out = torch.empty(g, r, j, dtype=torch.float64, device=dev)
    if g == 0 or r == 0 or j == 0:
        return out
    n = torch.as_tensor(n, device=dev).long()
    if batched is None:
        batched = dev.type in BATCHED_DEVICES
    if batched:
        valid = torch.arange(j, device=dev)[None, :] < n[:, None]
        d = q_packed.shape[-1] * 2
        if int8 is None:
            int8 = dev.type in INT8_DEVICES
        global last_path
        if int8 and d % 8 == 0:
            q8, mq, qspread = int8_operand(q_packed, q_scale)
            k8, mk, kspread = int8_operand(k_packed, k_scale)
            if bool((qspread <= _I8_SPREAD).all() & (~valid | (kspread <= _I8_SPREAD)).all()):
                _i8_logits(q8, mq, k8, mk, w, out)
                last_path = "int8"
                return out
            q8 = k8 = None
        # the fp64 matmul is exact wherever the fp32 one is: one of them serves every column
        worst = int(torch.where(valid, grouped_column_cores(q_packed, q_scale, k_packed, k_scale), -128).amax())
        if worst <= CORE_F64:
            _dense_logits(q_packed, q_scale, k_packed, k_scale, w, out,
                          torch.float32 if worst == CORE_F32 else torch.float64)
            last_path = "fp32" if worst == CORE_F32 else "fp64"
            return out
        last_path = "per sequence"
    if dev.type == "cpu" and not bool((q_scale == E8M0_NAN).any()):
        _cpu_sequences(q_packed, q_scale, k_packed, k_scale, w, n, out)
        return out
    for g0, ng in enumerate(n.tolist()):
        if ng:
            out[g0, :, :ng] = mxfp4_relu_logits(q_packed[g0], q_scale[g0], k_packed[g0, :ng], k_scale[g0, :ng], w[g0])
    return out


def _cpu_sequences(q_packed, q_scale, k_packed, k_scale, w, n, out) -> None:
    """`mxfp4_relu_logits` of each sequence of a group into out [G, R, J] (no NaN query
    scale byte), the choice of `_cpu_cores` made for the whole group at once: a sequence
    whose keys all take one table core is scored by it directly (the same call with the
    same operands), the others column by column."""
    g, j = k_scale.shape[:2]
    mq, qspread = _live_min_spread(q_packed, q_scale)                       # [G, R, H]
    lo, i8, f64 = _cpu_columns(qspread.flatten(1).amax(1, keepdim=True), k_scale)
    past = torch.arange(j)[None, :] >= n[:, None]
    whole = torch.stack(((i8 | past).all(1), (f64 | past).all(1))).tolist()
    q8 = _int8_decode(q_packed, q_scale, mq) if any(whole[0]) else None
    q64 = dequantize_mxfp4_f32(q_packed, q_scale, torch.float64) if any(whole[1]) else None
    for g0, ng in enumerate(n.tolist()):
        if not ng:
            continue
        keys = (k_packed[g0, :ng], k_scale[g0, :ng], lo[g0, :ng], out[g0, :, :ng])
        if whole[0][g0]:
            _table_core(q8[g0], w[g0].double() * _pow2(mq[g0]), *keys)
        elif whole[1][g0]:
            _table_core(q64[g0], w[g0].double(), *keys)
        else:
            out[g0, :, :ng] = mxfp4_relu_logits(q_packed[g0], q_scale[g0], k_packed[g0, :ng], k_scale[g0, :ng], w[g0])


def check_paged_args(dims: checks.Dims, weights, kv_cache, query_start_loc, context_lens,
                     block_table, row_ends, page_size, entry_bytes: int, more=()) -> list[int]:
    """The paged scorers' argument checks (and `more`: (flag, check) pairs run after them)
    with two host syncs -> query_start_loc as a list."""
    dims.check("weights", weights, torch.float32, ("Rw", "H"))
    dims.check("kv_cache", kv_cache, torch.uint8, ("P", "page_bytes"))
    dims.check("query_start_loc", query_start_loc, checks.INT_DTYPES, ("B+1",))
    dims.check("context_lens", context_lens, checks.INT_DTYPES, ("B",))
    dims.check("block_table", block_table, checks.INT_DTYPES, ("B", "max_pages"))
    dims.check("row_ends", row_ends, checks.INT_DTYPES, ("Rw",))
    checks.scalar("page_size", page_size, positive=True)
    if query_start_loc.shape[0] != context_lens.shape[0] + 1:
        raise ValueError(f"query_start_loc: expected {context_lens.shape[0] + 1} entries (B+1), "
                         f"got {query_start_loc.shape[0]}")
    qsl = query_start_loc.long().tolist()
    if qsl[0] != 0 or qsl[-1] != row_ends.shape[0] or any(b < a for a, b in zip(qsl, qsl[1:])):
        raise ValueError(f"query_start_loc: must rise from 0 to Rw={row_ends.shape[0]}, got {qsl[:8]}")
    need = page_size * entry_bytes
    if kv_cache.shape[1] < need:
        raise ValueError(f"kv_cache: page stride {kv_cache.shape[1]} is below the {need} bytes of "
                         f"{page_size} entries")
    span = block_table.shape[1] * page_size
    ctx = context_lens.long()
    ctx_bad = ((ctx < 0) | (ctx > span)).any()
    seq = seq_of_rows(query_start_loc, row_ends.shape[0])
    ends = row_ends.long()
    bad_end = (ends < 0) | (ends > ctx[seq])
    # the pages each sequence reads (its context's), all at once
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size < ctx[:, None]
    bt = block_table.long()
    bad_bt = used & ((bt < 0) | (bt >= kv_cache.shape[0]))

    def end_error():
        r = int(bad_end.nonzero()[0])
        raise ValueError(f"row_ends: row {r} ends at {int(row_ends[r])}, outside [0, context_lens="
                         f"{int(context_lens[seq[r]])}]")

    def table_error():
        b = int(bad_bt.any(1).nonzero()[0])
        checks.int_range(f"block_table[{b}]", bt[b][used[b]], 0, kv_cache.shape[0])

    tests = [(ctx_bad, lambda: checks.int_range("context_lens", context_lens, 0, span + 1)),
             (bad_end.any(), end_error), (bad_bt.any(), table_error)]
    tests.append((~torch.isfinite(weights).all(), lambda: checks.finite("weights", weights)))
    checks.first_failure([*tests, *more])
    return qsl


def seq_of_rows(query_start_loc: torch.Tensor, rows: int) -> torch.Tensor:
    qsl = query_start_loc.long()
    return torch.searchsorted(qsl[1:], torch.arange(rows, device=qsl.device), right=True)


def entry_slots(block_table_row: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """Pool slots of entries 0..n-1 of one sequence: table[j // ps] * ps + j % ps."""
    j = torch.arange(n, device=block_table_row.device)
    return block_table_row.long()[j // page_size] * page_size + j % page_size


def paged_logits(q: torch.Tensor, weights: torch.Tensor, query_start_loc: torch.Tensor,
                 block_table: torch.Tensor, row_ends: torch.Tensor, page_size: int,
                 read_keys: Callable[[torch.Tensor], torch.Tensor], width: int) -> torch.Tensor:
    """fp64 [Rw, width]; -inf at and past each row's end. `read_keys(slots)` -> [n, D]."""
    rw = q.shape[0]
    out = torch.full((rw, width), float("-inf"), dtype=torch.float64, device=q.device)
    qsl = query_start_loc.long().tolist()
    for b in range(len(qsl) - 1):
        r0, r1 = qsl[b], qsl[b + 1]
        if r1 == r0:
            continue
        n = int(row_ends[r0:r1].max())
        if n == 0:
            continue
        keys = read_keys(entry_slots(block_table[b], n, page_size))
        s = weighted_relu_logits(q[r0:r1], keys, weights[r0:r1])
        cols = torch.arange(n, device=q.device)
        s[cols[None, :] >= row_ends[r0:r1].long()[:, None]] = float("-inf")
        out[r0:r1, :n] = s
    return out


def default_width(block_table: torch.Tensor, page_size: int) -> int:
    return block_table.shape[1] * page_size


def check_width(width, block_table: torch.Tensor, page_size: int, row_ends: torch.Tensor) -> int:
    """The logits width: given, or the block table's span; never below a row's end."""
    if width is None:
        return default_width(block_table, page_size)
    checks.scalar("width", width, positive=True)
    need = int(row_ends.max()) if row_ends.numel() else 0
    if width < need:
        raise ValueError(f"width: {width} is below the largest row end {need}")
    return width


def nan_scale(name: str, scales: torch.Tensor) -> None:
    """e8m0 byte 255 encodes NaN: a non-finite input, reported, never scored."""
    checks.nonfinite(name, scales == E8M0_NAN)


def check_mxfp4_scorer(q_fp4, q_scale, weights, kv_cache, query_start_loc, context_lens, block_table,
                       row_ends, page_size, shuffle, width):
    """Every argument check of the MXFP4 scorer -> (parsed shuffle, head dim D, logits width,
    query_start_loc as a list)."""
    shuffle = layout.as_shuffle(shuffle)
    dims = checks.Dims()
    dims.check("q_fp4", q_fp4, torch.uint8, ("Rw", "H", "D/2"))
    dims.check("q_scale", q_scale, torch.uint8, ("Rw", "H", "D/32"))
    d = q_fp4.shape[2] * 2
    if d % 32:
        raise ValueError(f"q_fp4: head dim {d} (twice the last dimension) is not a multiple of 32")
    if q_scale.shape[2] * 32 != d:
        raise ValueError(f"q_scale: {q_scale.shape[2]} scale blocks do not match D={d} from q_fp4")
    layout.check_layout(page_size, d, shuffle)
    qsl = check_paged_args(dims, weights, kv_cache, query_start_loc, context_lens, block_table, row_ends,
                           page_size, layout.entry_bytes(d),
                           more=[((q_scale == E8M0_NAN).any(), lambda: nan_scale("q_scale", q_scale))])
    return shuffle, d, check_width(width, block_table, page_size, row_ends), qsl


# pages read at once per group of sequences (bytes)
_GROUP_PAGE_BYTES = {"cpu": 1 << 24, "cuda": 1 << 31}


def paged_mxfp4_mqa_logits_fp64(*, q_fp4, q_scale, weights, kv_cache, query_start_loc, context_lens,
                                 block_table, row_ends, page_size: int = 64, shuffle=(32, 16, 2),
                                 width: int | None = None, **_unused) -> torch.Tensor:
    """The scorer's logits in fp64 (what the study and top-k use). Sequences with the same
    number of rows are scored together (`grouped_relu_logits`)."""
    shuffle, d, width, qsl = check_mxfp4_scorer(q_fp4, q_scale, weights, kv_cache, query_start_loc,
                                                context_lens, block_table, row_ends, page_size, shuffle, width)
    rw = q_fp4.shape[0]
    dev = q_fp4.device
    out = torch.full((rw, width), float("-inf"), dtype=torch.float64, device=dev)
    if rw == 0:
        return out
    geo = dict(page_size=page_size, head_dim=d, shuffle=shuffle)
    ends = row_ends.long()
    for plan in group_plans(qsl, query_start_loc, row_ends, block_table, page_size, d):
        _score_group(out, plan, q_fp4, q_scale, weights, kv_cache, ends, geo)
    return out


def _paged_i8_logits(q_packed, q_scale, pg, k_scale, w, n, j, geo):
    """`grouped_relu_logits` of G sequences whose keys are the gathered pages `pg` (each
    sequence's pages in turn) with scale bytes `k_scale` [G * pages * ps, NB], with CORE_I8
    read straight from the pages (`paged_int8_keys`) -> (fp64 [G, R, j], ok: a device bool,
    false where a spread rules CORE_I8 out and the values are not the scores), or None
    where the layout rules it out. Nothing here waits for the device: the caller reads ok
    with its other flags in one host sync."""
    g, r = q_scale.shape[:2]
    e_all = k_scale.shape[0] // g                                         # entries per sequence read
    mk, hi = _key_range(k_scale)
    kspread = (hi - mk).view(g, e_all)                                     # uint8: hi - lo >= 0
    k8 = paged_int8_keys(pg, k_scale, mk, **geo)
    if k8 is None:
        return None
    q8, mq, qspread = int8_operand(q_packed, q_scale)
    valid = torch.arange(e_all, device=pg.device)[None, :] < n[:, None]
    ok = (qspread <= _I8_SPREAD).all() & (~valid | (kspread <= _I8_SPREAD)).all()
    out = torch.empty(g, r, e_all, dtype=torch.float64, device=pg.device)
    _i8_logits(q8, mq, k8.view(g, e_all, -1), mk.view(g, e_all).int(), w, out)
    return out[:, :, :j], ok


@dataclass(frozen=True)
class GroupPlan:
    """Sequences scored together: `seqs` (host ints), each with `rows` rows and reading
    n[i] keys (j the most); on the device: `pages_read` [G * pages] (pages past a
    sequence's own read its first page), `n_dev` [G] (n) and the rows `ridx` [G * rows]."""
    seqs: list
    rows: int
    n: list
    j: int
    pages_read: torch.Tensor
    n_dev: torch.Tensor
    ridx: torch.Tensor


def group_plans(qsl: list, query_start_loc, row_ends, block_table: torch.Tensor, page_size: int, d: int):
    """The groups the scorer scores at once (after its argument checks; `qsl` is
    query_start_loc as a list): sequences with the same number of rows, as many as fit
    `_GROUP_PAGE_BYTES` of pages. One host sync reads the keys each sequence reads (its
    rows' largest end); each plan's index tensors reach the device in one asynchronous
    copy."""
    dev = block_table.device
    n_of = torch.zeros(len(qsl) - 1, dtype=torch.long, device=dev).scatter_reduce(
        0, seq_of_rows(query_start_loc, row_ends.shape[0]), row_ends.long(), "amax").tolist()
    groups: dict[int, list[int]] = {}
    for b in range(len(qsl) - 1):
        if qsl[b + 1] > qsl[b] and n_of[b]:
            groups.setdefault(qsl[b + 1] - qsl[b], []).append(b)
    budget = _GROUP_PAGE_BYTES.get(dev.type, 1 << 24)
    for rows, seqs in groups.items():
        step = max(1, budget // (max(n_of[b] for b in seqs) * layout.entry_bytes(d)))
        for c0 in range(0, len(seqs), step):
            part = seqs[c0:c0 + step]
            n = [n_of[b] for b in part]
            host = torch.tensor([*part, *(-(-m // page_size) for m in n), *n, *(qsl[b] for b in part)])
            if dev.type == "cuda":
                host = host.pin_memory()
            sel, own, n_dev, start = host.to(dev, non_blocking=True).split(len(part))
            j = max(n)
            pages = -(-j // page_size)
            bt = block_table[sel, :pages].long()
            bt = torch.where(torch.arange(pages, device=dev)[None, :] < own[:, None], bt, bt[:, :1])
            ridx = (start[:, None] + torch.arange(rows, device=dev)).flatten()
            yield GroupPlan(part, rows, n, j, bt.flatten(), n_dev, ridx)


def group_inputs(plan: GroupPlan, q_fp4, q_scale, weights, kv_cache, ends, geo) -> dict:
    """A group's operands on the device, with no host sync: its pages, their scale bytes
    (all, and the j columns read), the NaN-scale flag, its queries and weights, and the
    mask of columns past each row's end."""
    g, j = len(plan.seqs), plan.j
    pg = layout.gather_pages(kv_cache, plan.pages_read, **geo)
    all_scales = layout.page_scales(pg, **geo)                                # [G * pages * ps, NB]
    scales = all_scales.view(g, -1, all_scales.shape[-1])[:, :j]
    cols = torch.arange(j, device=pg.device)
    return dict(pg=pg, all_scales=all_scales, scales=scales,
                nan=((scales == E8M0_NAN).any(-1) & (cols[None, :] < plan.n_dev[:, None])).any(),
                q=q_fp4[plan.ridx].view(g, plan.rows, *q_fp4.shape[1:]),
                qs=q_scale[plan.ridx].view(g, plan.rows, *q_scale.shape[1:]),
                w=weights[plan.ridx].view(g, plan.rows, -1),
                past=cols[None, :] >= ends[plan.ridx][:, None])


def group_core_i8(plan: GroupPlan, q_fp4, q_scale, weights, kv_cache, ends, geo):
    """The GPU scorer's work for one group, with no host sync (a CUDA graph can replay it):
    (fp64 logits [G * rows, j], -inf past the row ends; flags [2]: a NaN scale byte read,
    CORE_I8 exact), or None where the layout rules the paged int8 read out."""
    return _core_i8(plan, group_inputs(plan, q_fp4, q_scale, weights, kv_cache, ends, geo), geo)


def _core_i8(plan: GroupPlan, x: dict, geo):
    """`group_core_i8` on the group's `group_inputs` x."""
    fast = _paged_i8_logits(x["q"], x["qs"], x["pg"], x["all_scales"], x["w"], plan.n_dev, plan.j, geo)
    if fast is None:
        return None
    return fast[0].reshape(-1, plan.j).masked_fill_(x["past"], float("-inf")), torch.stack((x["nan"], fast[1]))


def _score_group(out, plan: GroupPlan, q_fp4, q_scale, weights, kv_cache, ends, geo) -> None:
    """Score one group into `out`: the paged CORE_I8 on a GPU (its flags read in one host
    sync after everything is queued), else (or where a flag says so) the grouped cores."""
    ridx, j = plan.ridx, plan.j
    x = group_inputs(plan, q_fp4, q_scale, weights, kv_cache, ends, geo)
    core = _core_i8(plan, x, geo) if q_fp4.device.type in INT8_DEVICES else None
    if core is not None:
        is_nan, exact = core[1].tolist()
        if exact and not is_nan:
            out[ridx, :j] = core[0]
            global last_path
            last_path = "int8"
            return
    else:
        is_nan = bool(x["nan"])
    if is_nan:
        for i, b in enumerate(plan.seqs):
            nan_scale(f"kv_cache (scale bytes of sequence {b}'s entries)", x["scales"][i, :plan.n[i]])
    packed = layout.page_values(x["pg"], **geo).view(len(plan.seqs), -1, geo["head_dim"] // 2)
    s = grouped_relu_logits(x["q"], x["qs"], packed[:, :j], x["scales"], x["w"], plan.n_dev)
    out[ridx, :j] = s.reshape(-1, j).masked_fill_(x["past"], float("-inf"))


def paged_mxfp4_mqa_logits(*, clean_logits: bool = False, **kwargs) -> dict:
    """Reference of aiter's scorer. Columns past a row's end are -inf (the clean form);
    when the kernel runs without `clean_logits` they are unspecified and not compared."""
    return {"logits": paged_mxfp4_mqa_logits_fp64(**kwargs).float()}
