"""Page layouts of the MXFP4 K cache (NUMERICS.md §5).

A page holds `page_size` entries: all value bytes (page_size * D/2), then all scale
bytes (page_size * D/32), then optional padding up to the page stride. Entries are
either token-major ("natural") or preshuffled in groups of N tokens so that aiter's
scorer reads them in place.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .formats import MX_BLOCK
from .page_shape import (  # noqa: F401  (this module's API too)
    BLOCK_KV,
    Shuffle,
    as_shuffle,
    check_layout,
    choose_shuffle,
    entry_bytes,
    page_bytes,
)


def value_offsets(t: torch.Tensor, page_size: int, head_dim: int, shuffle) -> torch.Tensor:
    """In-page offsets of the value bytes of entries `t` ([...]) -> [..., D/2] int64."""
    shuffle = as_shuffle(shuffle)
    check_layout(page_size, head_dim, shuffle)
    tb = head_dim // 2
    t = t.long().unsqueeze(-1)
    b = torch.arange(tb, device=t.device)
    if shuffle is None:
        return t * tb + b
    n, dt = shuffle.n, shuffle.dt
    g, lane = t // n, t % n
    return g * n * tb + (b // dt) * n * dt + lane * dt + (b % dt)


def scale_offsets(t: torch.Tensor, page_size: int, head_dim: int, shuffle) -> torch.Tensor:
    """In-page offsets of the scale bytes of entries `t` ([...]) -> [..., D/32] int64."""
    shuffle = as_shuffle(shuffle)
    check_layout(page_size, head_dim, shuffle)
    tb, nb = head_dim // 2, head_dim // MX_BLOCK
    base = page_size * tb
    t = t.long().unsqueeze(-1)
    s = torch.arange(nb, device=t.device)
    if shuffle is None:
        return base + t * nb + s
    n, l = shuffle.n, shuffle.l
    s_hi = nb // l
    g, lane = t // n, t % n
    return base + g * n * nb + (s % l) * n * s_hi + lane * s_hi + (s // l)


def slot_byte_offsets(slots: torch.Tensor, page_size: int, head_dim: int, shuffle,
                      page_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat pool offsets (int64, no 32-bit wrap) of the value and scale bytes of `slots`."""
    vo, so = _in_page_offsets(page_size, head_dim, as_shuffle(shuffle), slots.device)
    page, t = slots.long() // page_size, slots.long() % page_size
    start = (page * page_stride).unsqueeze(-1)
    return start + vo[t], start + so[t]


@functools.lru_cache(maxsize=32)
def _in_page_offsets(page_size: int, head_dim: int, shuffle: Optional[Shuffle], device: torch.device):
    """The in-page offsets of every entry of a page, made once per layout and device."""
    t = torch.arange(page_size, device=device)
    return (value_offsets(t, page_size, head_dim, shuffle), scale_offsets(t, page_size, head_dim, shuffle))


@functools.lru_cache(maxsize=32)
def _entry_offsets(page_size: int, head_dim: int, shuffle: Optional[Shuffle], device: torch.device):
    """In-page offsets of every entry's bytes, values then scales: [page_size, D/2 + D/32]."""
    return torch.cat(_in_page_offsets(page_size, head_dim, shuffle, device), -1)


def write_entries(kv_cache: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor,
                  scales: torch.Tensor, *, page_size: int, shuffle) -> torch.Tensor:
    """Return a copy of the pool [P, stride] u8 with entries stored at `slots`; every
    byte not owned by those entries keeps its value."""
    return write_entry_bytes(kv_cache, slots, torch.cat((packed, scales), -1), page_size=page_size,
                             head_dim=packed.shape[-1] * 2, shuffle=shuffle)


def write_entry_bytes(kv_cache: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor, *,
                      page_size: int, head_dim: int, shuffle) -> torch.Tensor:
    """write_entries with each entry's bytes given whole ([..., D/2 + D/32]: the packed
    values, then the scales): one store at (page, in-page offset), the offsets of
    `slot_byte_offsets`."""
    out = kv_cache.clone()
    if slots.numel():
        offs = _entry_offsets(page_size, head_dim, as_shuffle(shuffle), slots.device)
        s = slots.long()
        out[(s // page_size).unsqueeze(-1), offs[s % page_size]] = entries
    return out


def read_entries(kv_cache: torch.Tensor, slots: torch.Tensor, *, page_size: int, head_dim: int,
                 shuffle) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather (packed [..., D/2], scales [..., D/32]) of the entries at `slots` ([...])."""
    vo, so = slot_byte_offsets(slots, page_size, head_dim, shuffle, kv_cache.shape[1])
    flat = kv_cache.reshape(-1)
    return flat[vo], flat[so]


def owned_mask(num_pages: int, page_stride: int, slots: torch.Tensor, *, page_size: int,
               head_dim: int, shuffle) -> torch.Tensor:
    """Bool [P, stride]: the bytes that writing `slots` owns."""
    mask = torch.zeros(num_pages * page_stride, dtype=torch.bool, device=slots.device)
    if slots.numel():
        vo, so = slot_byte_offsets(slots, page_size, head_dim, shuffle, page_stride)
        mask[vo.flatten()] = True
        mask[so.flatten()] = True
    return mask.view(num_pages, page_stride)


def locate(offset: int, *, page_stride: int, page_size: int, head_dim: int,
           shuffle) -> dict:
    """Inverse map of a flat pool byte offset: page, entry, and value byte or scale block
    (or 'padding'). Used by the diff engine to say where a byte lies."""
    shuffle = as_shuffle(shuffle)
    page, off = divmod(int(offset), page_stride)
    tb, nb = head_dim // 2, head_dim // MX_BLOCK
    if off >= page_size * (tb + nb):
        return {"page": page, "kind": "padding", "offset": off}
    t_all = torch.arange(page_size)
    if off < page_size * tb:
        hit = (value_offsets(t_all, page_size, head_dim, shuffle) == off).nonzero()[0].tolist()
        return {"page": page, "kind": "value", "entry": hit[0], "byte": hit[1],
                "elements": [2 * hit[1], 2 * hit[1] + 1], "block": (2 * hit[1]) // MX_BLOCK}
    hit = (scale_offsets(t_all, page_size, head_dim, shuffle) == off).nonzero()[0].tolist()
    return {"page": page, "kind": "scale", "entry": hit[0], "block": hit[1]}


def read_pages(kv_cache: torch.Tensor, pages: torch.Tensor, *, page_size: int, head_dim: int,
               shuffle) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries of whole pages in entry order: (packed [len(pages)*page_size, D/2], scales
    [len(pages)*page_size, D/32]). Same bytes as `read_entries` on those pages' slots, but
    un-shuffled with one view/permute per page instead of a gather per byte."""
    pg = gather_pages(kv_cache, pages, page_size=page_size, head_dim=head_dim, shuffle=shuffle)
    return (page_values(pg, page_size=page_size, head_dim=head_dim, shuffle=shuffle),
            page_scales(pg, page_size=page_size, head_dim=head_dim, shuffle=shuffle))


def gather_pages(kv_cache: torch.Tensor, pages: torch.Tensor, *, page_size: int, head_dim: int,
                 shuffle) -> torch.Tensor:
    """The pages' bytes [len(pages), stride], checked against the layout (one gather)."""
    check_layout(page_size, head_dim, as_shuffle(shuffle))
    return kv_cache.index_select(0, pages.long())


def page_values(pg: torch.Tensor, *, page_size: int, head_dim: int, shuffle) -> torch.Tensor:
    """Value bytes of gathered pages `pg` in entry order: packed [pages*page_size, D/2]."""
    shuffle = as_shuffle(shuffle)
    tb = head_dim // 2
    vals = pg[:, :page_size * tb]
    if shuffle is None:
        return vals.reshape(-1, tb)
    n, dt = shuffle.n, shuffle.dt
    g = page_size // n
    # val = g*N*TB + (b//Dt)*N*Dt + lane*Dt + b%Dt  ->  dims [page, g, b//Dt, lane, b%Dt];
    # tiles move whole, so permute 16- or 8-byte units when Dt allows (16x or 8x fewer
    # elements; complex128 only as 16 opaque bytes: a copy moves them bit for bit), read in
    # place when the page stride and offset are multiples of the unit
    w = 16 if dt % 16 == 0 else 8 if dt % 8 == 0 else 1
    if w > 1:
        if vals.stride(0) % w or vals.storage_offset() % w:
            vals = vals.clone(memory_format=torch.contiguous_format)   # (contiguous() keeps a lone row's stride)
        vals = vals.view(torch.complex128 if w == 16 else torch.int64)
    vals = vals.reshape(-1, g, tb // dt, n, dt // w).permute(0, 1, 3, 2, 4).contiguous()
    return vals.view(torch.uint8).reshape(-1, tb)


def page_scales(pg: torch.Tensor, *, page_size: int, head_dim: int, shuffle) -> torch.Tensor:
    """Scale bytes of gathered pages `pg` in entry order: [pages*page_size, D/32]."""
    shuffle = as_shuffle(shuffle)
    tb, nb = head_dim // 2, head_dim // MX_BLOCK
    scs = pg[:, page_size * tb:page_size * (tb + nb)]
    if shuffle is None:
        return scs.reshape(-1, nb)
    n, l = shuffle.n, shuffle.l
    # scale = g*N*NB + (s%L)*N*S_HI + lane*S_HI + s//L  ->  dims [page, g, s%L, lane, s//L]
    return scs.reshape(-1, page_size // n, l, n, nb // l).permute(0, 1, 3, 4, 2).reshape(-1, nb)


def page_block_words(pg: torch.Tensor, *, page_size: int, head_dim: int, shuffle):
    """Value bytes of gathered pages as a strided int16 view with 6 dims [P, a, b, c, e, 8]:
    entry (a, b) of a page is a*b_size + b, MX block (c, e) is c*e_size + e, and the 8 words
    are the block's 16 bytes in order. Copying it contiguously gives [P*page_size, D/32, 8]
    in entry order without materializing the unshuffled bytes first (the GPU scorer folds
    that copy into its decode). None where a block's 16 bytes are not contiguous in the
    page (a tile narrower than a block): use `page_values` then."""
    shuffle = as_shuffle(shuffle)
    tb, nb = head_dim // 2, head_dim // MX_BLOCK
    vals = pg[:, :page_size * tb]
    if vals.stride(0) % 2 or vals.storage_offset() % 2:
        # an odd page stride: int16 words need even offsets (contiguous() keeps a lone row's stride)
        vals = vals.clone(memory_format=torch.contiguous_format)
    words = vals.view(torch.int16)
    p = pg.shape[0]
    if shuffle is None:
        return words.view(p, 1, page_size, 1, nb, 8)
    n, dt = shuffle.n, shuffle.dt
    if dt % 16:
        return None
    # value byte offset g*N*TB + (b//Dt)*N*Dt + lane*Dt + b%Dt, in words of 2 bytes
    return words.view(p, page_size // n, tb // dt, n, dt // 16, 8).permute(0, 1, 3, 2, 4, 5)
