"""Softmax-gated overlap pooling, the indexer's compressor (NUMERICS.md §1).

Every boundary token p ((p + 1) % r == 0) produces compressed entry p // r from the 2r
positions p-2r+1 .. p: the previous group's `_a` halves and its own group's `_b` halves,
softmax over the window per channel. Rows are found through the request's state block
table, so chunked prefill and decode pool exactly like one full pass.
"""
from __future__ import annotations

import functools

import torch

from . import checks
from .formats import ROUNDING_PATHS
from .operands import converts_in_kernel, device_const, widened

# --- building the state cache (what the model's compressor writes per position) ------

def state_rows(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """kv, score f32 [T, 2D], ape f32 [r, 2D] -> rows [T, 4D] =
    [kv_a | kv_b | score_a + ape_a[p % r] | score_b + ape_b[p % r]]."""
    r = ape.shape[0]
    return torch.cat((kv.float(), score.float() + ape.float()[positions.long() % r]), dim=-1)


def write_state(state_cache: torch.Tensor, block_table: torch.Tensor, req_index: torch.Tensor,
                positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Return a copy of the state cache with `rows` stored at each token's position."""
    out = state_cache.clone()
    bs = state_cache.shape[1]
    pos = positions.long()
    blk = block_table[req_index.long(), pos // bs].long()
    out[blk, pos % bs] = rows.to(out.dtype)
    return out


# --- the pooling itself -----------------------------------------------------------

def boundary_mask(positions: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    return (positions.long() + 1) % compress_ratio == 0


def gather_windows(state_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                   req_index: torch.Tensor, compress_ratio: int):
    """For tokens at `positions` -> (kv f32 [N, 2r, D], score f64 [N, 2r, D], valid [N, 2r]);
    window slots before position 0 hold kv +0.0 and score -inf. Window i < r reads the `_a`
    halves, i >= r `_b`. The score is the fp32 state value held in fp64 (exact), as the
    softmax takes it.

    One gather reads only the halves the windows use (kv, then score: [2, N, 2r, D]) in
    16-byte lanes (four fp32 as one complex128: a copy of the bits, no arithmetic); the
    slots before position 0 are then set, the score's select widening it to fp64 on a GPU
    (`converts_in_kernel`)."""
    r = compress_ratio
    bs = state_cache.shape[1]
    offsets, halves = _window_slots(r, positions.device)
    q = positions.long()[:, None] + offsets                                       # [N, 2r]
    valid = q >= 0
    qc = q.clamp_min(0)
    blk = block_table[req_index.long()[:, None], qc // bs].long()
    dev = state_cache.device
    g = _lanes(state_cache).view(*state_cache.shape[:2], 4, -1)[blk, qc % bs, halves]
    kv = torch.where(valid[..., None], g[0], device_const(0, g.dtype, dev)).view(state_cache.dtype)
    ninf = device_const(float("-inf"), torch.float64 if converts_in_kernel(g) else state_cache.dtype, dev)
    score = torch.where(valid[..., None], g[1].view(state_cache.dtype), ninf).double()
    return kv, score, valid


@functools.lru_cache(maxsize=16)
def _window_slots(r: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window slot's position relative to the boundary token ([2r]: 1 - 2r .. 0) and
    the state-row quarter it reads ([2, 1, 2r]: kv_a/kv_b = 0/1, then score_a/score_b =
    2/3). Made once per device, on the device (no host copy: CUDA graphs)."""
    i = torch.arange(4 * r, device=device)
    return i[:2 * r] + (1 - 2 * r), (i // r).view(2, 1, 2 * r)


def _lanes(state_cache: torch.Tensor) -> torch.Tensor:
    """An fp32 state as the widest lanes that tile a quarter row: complex128 (4 floats,
    16 bytes), int64 (2) or the floats themselves (any other dtype: as it is)."""
    sc = state_cache
    d = sc.shape[-1] // 4
    for dtype, n in ((torch.complex128, 4), (torch.int64, 2)):
        if sc.dtype == torch.float32 and d % n == 0:
            if not sc.is_contiguous() or sc.storage_offset() % n or sc.data_ptr() % (4 * n):
                sc = sc.clone(memory_format=torch.contiguous_format)
            return sc.view(dtype)
    return sc


def softmax_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """c[d] = sum_i softmax_i(score_i[d]) * kv_i[d], exact (fp64) then rounded to fp32.

    A sum whose terms are all -0.0 is -0.0 under IEEE addition, and that is what a GPU
    reduction over the window gives; torch's (and numpy's) sums start from +0.0 and would
    say +0.0, which later shows up as K bytes 0x88 vs 0x00. So the sign is set here: every
    term is -0.0 (bits INT64_MIN, the smallest int64) iff the largest term's bits are.
    The product is w * kv.double() (`widened`)."""
    w = torch.softmax(score.double(), dim=1)
    terms = w * widened(kv, torch.float64)
    c = terms.sum(dim=1)
    all_neg_zero = terms.view(torch.int64).amax(dim=1) == _NEG_ZERO_BITS     # every term is -0.0
    return torch.where(all_neg_zero, device_const(-0.0, torch.float64, c.device), c).float()


_NEG_ZERO_BITS = -(1 << 63)          # the fp64 bits of -0.0 as an int64


def softmax_pool_fp32(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """The same pooling in fp32, as the kernels write it (`tl.softmax` then `tl.sum`): max,
    exp(s - max), the sum of the exps, one divide per weight, the products, and their sum,
    each an fp32 operation; both sums taken in window order (slot 0 first). The kernels'
    own exp is the hardware's approximate one and their sums follow the compiled reduction
    tree, so this is a closer model of them, not their bits (NUMERICS.md §1)."""
    s = score.float()
    m = s.amax(dim=1, keepdim=True)
    e = torch.exp(s - m)
    den = e[:, 0]
    for i in range(1, e.shape[1]):
        den = den + e[:, i]
    w = e / den[:, None]
    terms = kv.float() * w
    c = terms[:, 0]
    for i in range(1, terms.shape[1]):
        c = c + terms[:, i]
    return c


SOFTMAX_MODES = {"fp64": softmax_pool, "fp32": softmax_pool_fp32}


def check_pool_args(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio):
    dims = checks.Dims()
    dims.check("state_cache", state_cache, torch.float32, ("blocks", "block_size", "4D"))
    if state_cache.shape[-1] % 4:
        raise ValueError(f"state_cache: last dimension {state_cache.shape[-1]} is not 4*D")
    if (state_cache.shape[-1] // 4) % 32:
        raise ValueError(f"state_cache: head dim D={state_cache.shape[-1] // 4} (last dimension / 4) "
                         "is not a multiple of 32")
    dims.check("block_table", block_table, checks.INT_DTYPES, ("reqs", "max_blocks"))
    for name, t in (("positions", positions), ("req_index", req_index),
                    ("kv_slot_mapping", kv_slot_mapping)):
        dims.check(name, t, checks.INT_DTYPES, ("T",))
    checks.scalar("compress_ratio", compress_ratio, positive=True)
    checks.int_range("positions", positions, 0, 2 ** 62)
    checks.int_range("req_index", req_index, 0, block_table.shape[0])


def compress_pool(*, state_cache, block_table, positions, req_index, kv_slot_mapping,
                  compress_ratio: int = 4, rounding: str = "rocm", softmax: str = "fp64") -> dict:
    """Pooled row of every boundary token that writes (slot >= 0); other rows are NaN.
    ROCm split path and DeepSeek: bf16 [T, D]; CUDA fused path: the fp32 rows [T, D].
    `softmax`: "fp64" (exact, the pin) or "fp32" (the kernels' operations in fp32)."""
    check_pool_args(state_cache, block_table, positions, req_index, kv_slot_mapping, compress_ratio)
    checks.choice("rounding", rounding, ROUNDING_PATHS)
    pool_fn = SOFTMAX_MODES[checks.choice("softmax", softmax, tuple(SOFTMAX_MODES))]
    d = state_cache.shape[-1] // 4
    sel = (boundary_mask(positions, compress_ratio) & (kv_slot_mapping >= 0)).nonzero().flatten()
    out = torch.full((positions.shape[0], d), float("nan"), device=state_cache.device)
    if sel.numel():
        pos, req = positions[sel], req_index[sel]
        bs, r = state_cache.shape[1], compress_ratio
        first = (pos.long() - (2 * r - 1)).clamp_min(0) // bs
        checks.int_range("block_table (window blocks)", first, 0, block_table.shape[1])
        checks.int_range("positions (window blocks)", pos.long() // bs, 0, block_table.shape[1])
        used = block_table[req.long()[:, None], torch.stack((first, pos.long() // bs), -1)]
        checks.int_range("block_table", used, 0, state_cache.shape[0])
        kv, score, valid = gather_windows(state_cache, block_table, pos, req, r)
        checks.finite("state_cache (window rows)", torch.where(valid[..., None], score, 0.0))
        checks.finite("state_cache (window rows)", kv)
        out[sel] = pool_fn(kv, score)
    return {"pooled": out if rounding == "cuda" else out.to(torch.bfloat16)}
