"""Paged scoring (NUMERICS.md §6): logits[row, j] = sum_h w[row,h] * relu(q[row,h] . k[j]).

The reference scores in fp64 from exactly dequantized operands (MXFP4 and FP8 values are
exact in fp64 and their products and sums of 128 terms are too, for any realistic scale
spread), so its logits are the true scores of the quantized operands; the kernels'
fp32 accumulation lands within ~1e-14 of them in the scale-invariant metric.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from . import checks, layout, mxfp4
from .formats import E2M1_SIGNED, MX_BLOCK

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

@functools.lru_cache(maxsize=8)
def _pair_lut(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[65536, 4]: the e2m1 values of the two packed bytes behind each int16 value
    (byte order taken from the machine, so any endianness works)."""
    e2m1 = torch.tensor(E2M1_SIGNED, dtype=dtype)
    byte_lut = torch.stack((e2m1[torch.arange(256) & 15], e2m1[torch.arange(256) >> 4]), -1)
    words = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    mem = words.view(torch.uint8).view(-1, 2).long()
    lut = torch.empty(65536, 4, dtype=dtype)
    lut[words.int() & 0xFFFF] = torch.cat((byte_lut[mem[:, 0]], byte_lut[mem[:, 1]]), -1)
    return lut.to(device)


def dequantize_mxfp4_f32(packed: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact dequantization for scale bytes in [2, 252] (others give subnormals, inf or
    NaN; the exact core sends those entries to the generic fp64 one). `dtype` fp64: the
    same values, read from an fp64 table (no fp32 pass)."""
    nb = scales.shape[-1]
    words = packed.contiguous().view(torch.int16).reshape(-1).int() & 0xFFFF
    vals = _pair_lut(packed.device, dtype).index_select(0, words).view(*scales.shape, MX_BLOCK)
    pow2 = (scales.int().clamp(1, 254) << 23).view(torch.float32)        # 2**(e - 127)
    return vals.mul_(pow2.to(dtype).unsqueeze(-1)).view(*scales.shape[:-1], nb * MX_BLOCK)


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
    Scale bytes must be in [2, 252] for the fp32 dequantization to be exact. The cheap
    test counts every block as live; only columns it rejects are scanned for dead
    (all-zero) blocks, whose scale bytes do not matter."""
    nb = q_scale.shape[-1]
    j = k_scale.shape[0]
    dev = k_scale.device
    cores = torch.full((j,), CORE_FP64_GENERIC, dtype=torch.int8, device=dev)
    qlo, qhi, qok, qlive = (t.reshape(-1) for t in _block_exponents(q_packed, q_scale))
    if not bool(qok.all()):
        return cores
    if bool(qlive.any()):
        q_spread = int((qhi - qlo)[qlive].max())
        q_lo, q_hi = int(qlo[qlive].min()), int(qhi[qlive].max())
    else:                     # all-zero queries: every product is 0, no range to respect
        q_spread, q_lo, q_hi = 0, 1 << 20, -(1 << 20)
    spread32 = 24 - (nb * 4608 - 1).bit_length()
    spread64 = 53 - (nb * 4608 - 1).bit_length()

    def assign(idx, lo, hi, ok, dead):
        f32 = ok & (dead | (((hi - lo) + q_spread <= spread32) & (lo + q_lo >= 130) & (hi + q_hi <= 368)))
        f64 = ok & (dead | ((hi - lo) + q_spread <= spread64))
        blocks = ok & (dead | ((lo + q_lo >= 107) & (hi + q_hi <= 371)))
        c = torch.where(f32, CORE_F32, torch.where(f64, CORE_F64, torch.where(blocks, CORE_BLOCKS,
                                                                                 CORE_FP64_GENERIC)))
        cores[idx] = c.to(torch.int8)

    e = k_scale.int()
    everyone = torch.arange(j, device=dev)
    assign(everyone, e.amin(-1), e.amax(-1), (e >= 2).all(-1) & (e <= 252).all(-1),
           torch.zeros(j, dtype=torch.bool, device=dev))
    rest = (cores > CORE_F64).nonzero().flatten()
    if rest.numel():
        klo, khi, kok, klive = _block_exponents(k_packed[rest], k_scale[rest])
        before = cores[rest].clone()
        assign(rest, klo, khi, kok, ~klive)
        cores[rest] = torch.minimum(cores[rest], before)
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


def mxfp4_relu_logits(q_packed, q_scale, k_packed, k_scale, w) -> torch.Tensor:
    """Same values as `weighted_relu_logits` on the dequantized operands (fp64 [Rw, J]),
    each column from its `column_cores` core: exact dots wherever the core's proof holds
    (fp32 or fp64 matmul, or per-block fp32 dots summed in fp64: those are exact up to 40
    binades between a pair's blocks, beyond that only the 3 block additions round);
    relu and the weighted head sum in fp64. The fp64 matmul is about as fast as the fp32
    one on a CPU (the scorer streams keys), so wide scale spreads cost little."""
    rw, h = q_scale.shape[:2]
    nb = q_scale.shape[-1]
    j = k_scale.shape[0]
    out = torch.empty(rw, j, dtype=torch.float64, device=q_packed.device)
    if rw == 0 or j == 0:
        return out
    cores = column_cores(q_packed, q_scale, k_packed, k_scale)
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
        else:
            if q32 is None:
                q32, w64 = dequantize_mxfp4_f32(q_packed, q_scale), w.double()
            if core == CORE_BLOCKS:
                res = _blockwise_f32(q32, dequantize_mxfp4_f32(kp, ks), w64, nb)
            else:
                # keys dequantized a chunk at a time, so the matmul reads them from cache
                qx = q32 if core == CORE_F32 else q32.double()
                dt = torch.float32 if core == CORE_F32 else torch.float64
                res = torch.empty(rw, kp.shape[0], dtype=torch.float64, device=q_packed.device)
                for c0 in range(0, kp.shape[0], _KEY_CHUNK):
                    kc = dequantize_mxfp4_f32(kp[c0:c0 + _KEY_CHUNK], ks[c0:c0 + _KEY_CHUNK], dt)
                    res[:, c0:c0 + _KEY_CHUNK] = _dense(qx, kc, w64)
        if whole:
            return res
        out[:, cols] = res
    return out


def _dense(q32, k32, w64) -> torch.Tensor:
    """fp64 [Rw, J] from fp32 or fp64 dots that are exact (the caller proved it), relu
    and the weighted head sum in fp64; tiled so that per-head scores never fill memory."""
    rw, h = q32.shape[:2]
    j = k32.shape[0]
    out = torch.empty(rw, j, dtype=torch.float64, device=q32.device)
    jc = max(1, min(j, _TILE_ELEMS // h))
    rc = max(1, _TILE_ELEMS // (h * jc))
    for r0 in range(0, rw, rc):
        qr = q32[r0:r0 + rc]
        wr = w64[r0:r0 + rc].unsqueeze(1)
        for j0 in range(0, j, jc):
            s = torch.matmul(qr, k32[j0:j0 + jc].T).clamp_min_(0).to(torch.float64)
            out[r0:r0 + rc, j0:j0 + jc] = torch.bmm(wr, s).squeeze(1)
    return out


# keys per chunk of the matmul cores (4096 x 128 fp64 = 4 MB)
_KEY_CHUNK = 4096
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


def check_paged_args(dims: checks.Dims, weights, kv_cache, query_start_loc, context_lens,
                     block_table, row_ends, page_size, entry_bytes: int) -> None:
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
    qsl = query_start_loc.long()
    if int(qsl[0]) != 0 or int(qsl[-1]) != row_ends.shape[0] or bool((qsl[1:] < qsl[:-1]).any()):
        raise ValueError(f"query_start_loc: must rise from 0 to Rw={row_ends.shape[0]}, got {qsl.tolist()[:8]}")
    need = page_size * entry_bytes
    if kv_cache.shape[1] < need:
        raise ValueError(f"kv_cache: page stride {kv_cache.shape[1]} is below the {need} bytes of "
                         f"{page_size} entries")
    checks.int_range("context_lens", context_lens, 0, block_table.shape[1] * page_size + 1)
    seq = seq_of_rows(query_start_loc, row_ends.shape[0])
    bad = (row_ends.long() < 0) | (row_ends.long() > context_lens.long()[seq])
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        raise ValueError(f"row_ends: row {r} ends at {int(row_ends[r])}, outside [0, context_lens="
                         f"{int(context_lens[seq[r]])}]")
    for b in range(context_lens.shape[0]):
        pages = -(-int(context_lens[b]) // page_size)
        checks.int_range(f"block_table[{b}]", block_table[b, :pages], 0, kv_cache.shape[0])
    checks.finite("weights", weights)


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
    bad = scales == 255
    if bool(bad.any()):
        raise checks.NonFiniteInput(name, int(bad.sum()), bad.nonzero()[0].tolist())


def check_mxfp4_scorer(q_fp4, q_scale, weights, kv_cache, query_start_loc, context_lens, block_table,
                       row_ends, page_size, shuffle, width):
    """Every argument check of the MXFP4 scorer -> (parsed shuffle, head dim D, logits width)."""
    shuffle = layout.as_shuffle(shuffle)
    dims = checks.Dims()
    dims.check("q_fp4", q_fp4, torch.uint8, ("Rw", "H", "D/2"))
    dims.check("q_scale", q_scale, torch.uint8, ("Rw", "H", "D/32"))
    d = q_fp4.shape[2] * 2
    if d % 32:
        raise ValueError(f"q_fp4: head dim {d} (twice the last dimension) is not a multiple of 32")
    if q_scale.shape[2] * 32 != d:
        raise ValueError(f"q_scale: {q_scale.shape[2]} scale blocks do not match D={d} from q_fp4")
    check_paged_args(dims, weights, kv_cache, query_start_loc, context_lens, block_table, row_ends,
                     page_size, layout.entry_bytes(d))
    layout.check_layout(page_size, d, shuffle)
    nan_scale("q_scale", q_scale)
    return shuffle, d, check_width(width, block_table, page_size, row_ends)


def paged_mxfp4_mqa_logits_fp64(*, q_fp4, q_scale, weights, kv_cache, query_start_loc, context_lens,
                                 block_table, row_ends, page_size: int = 64, shuffle=(32, 16, 2),
                                 width: int | None = None, **_unused) -> torch.Tensor:
    """The scorer's logits in fp64 (what the study and top-k use)."""
    shuffle, d, width = check_mxfp4_scorer(q_fp4, q_scale, weights, kv_cache, query_start_loc,
                                           context_lens, block_table, row_ends, page_size, shuffle, width)
    rw = q_fp4.shape[0]
    out = torch.full((rw, width), float("-inf"), dtype=torch.float64, device=q_fp4.device)
    qsl = query_start_loc.long().tolist()
    for b in range(len(qsl) - 1):
        r0, r1 = qsl[b], qsl[b + 1]
        n = int(row_ends[r0:r1].max()) if r1 > r0 else 0
        if n == 0:
            continue
        packed, scales = layout.read_pages(kv_cache, block_table[b, :-(-n // page_size)],
                                           page_size=page_size, head_dim=d, shuffle=shuffle)
        nan_scale(f"kv_cache (scale bytes of sequence {b}'s entries)", scales[:n])
        s = mxfp4_relu_logits(q_fp4[r0:r1], q_scale[r0:r1], packed[:n], scales[:n], weights[r0:r1])
        s[torch.arange(n, device=s.device)[None, :] >= row_ends[r0:r1].long()[:, None]] = float("-inf")
        out[r0:r1, :n] = s
    return out


def paged_mxfp4_mqa_logits(*, clean_logits: bool = False, **kwargs) -> dict:
    """Reference of aiter's scorer. Columns past a row's end are -inf (the clean form);
    when the kernel runs without `clean_logits` they are unspecified and not compared."""
    return {"logits": paged_mxfp4_mqa_logits_fp64(**kwargs).float()}
