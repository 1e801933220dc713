"""The shape of an MXFP4 K cache page, in integers (NUMERICS.md §5): the preshuffle groups,
entry and page bytes, and which page sizes a layout takes. No tensors and no torch
(reference/layout.py builds the byte offsets on these; case files are checked with them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .formats import MX_BLOCK


@dataclass(frozen=True)
class Shuffle:
    """Preshuffle parameters (N tokens per group, Dt value bytes per tile, L scale lanes)."""
    n: int = 32
    dt: int = 16
    l: int = 2

    def as_list(self) -> list[int]:
        return [self.n, self.dt, self.l]


def choose_shuffle(head_dim: int, heads: int) -> Shuffle:
    """The layout aiter picks: N = 32 if (D <= 64 or H >= 32) else 16, Dt = 16, L = 64 // N."""
    n = 32 if (head_dim <= 64 or heads >= 32) else 16
    return Shuffle(n, 16, 64 // n)


def as_shuffle(shuffle) -> Optional[Shuffle]:
    """Accept None, a Shuffle, or the dump's `[N, Dt, L]` list."""
    if shuffle is None or isinstance(shuffle, Shuffle):
        return shuffle
    if isinstance(shuffle, (list, tuple)) and len(shuffle) == 3 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shuffle):
        return Shuffle(*shuffle)
    raise ValueError(f"shuffle: expected [N, Dt, L] or null, got {shuffle!r}")


def entry_bytes(head_dim: int) -> int:
    return head_dim // 2 + head_dim // MX_BLOCK


def page_bytes(page_size: int, head_dim: int) -> int:
    """Bytes a page needs (the stride may be larger)."""
    return page_size * entry_bytes(head_dim)


# aiter's scorer reads a preshuffled page in tiles of BLOCK_KV = min(64, page_size) entries;
# its cache_format() refuses a page that is not a whole number of them (and vLLM calls it).
BLOCK_KV = 64


def check_layout(page_size: int, head_dim: int, shuffle: Optional[Shuffle]) -> None:
    """Natural pages take any page size; a preshuffled one must tile into shuffle groups and,
    as aiter's cache_format() requires, into BLOCK_KV = min(64, page_size) entries (96 or 160
    would tile into groups of 32 but are read by no production path)."""
    if head_dim % MX_BLOCK:
        raise ValueError(f"head_dim: {head_dim} is not a multiple of {MX_BLOCK}")
    if shuffle is None:
        return
    tb, nb = head_dim // 2, head_dim // MX_BLOCK
    if page_size % shuffle.n:
        raise ValueError(f"page_size: {page_size} is not a multiple of the shuffle group N={shuffle.n}")
    block_kv = min(BLOCK_KV, page_size)
    if page_size % block_kv:
        raise ValueError(f"page_size: a preshuffled page of {page_size} entries is not a multiple of aiter's "
                         f"BLOCK_KV = min({BLOCK_KV}, page_size) = {block_kv} (its cache_format refuses it)")
    if tb % shuffle.dt:
        raise ValueError(f"shuffle: Dt={shuffle.dt} does not divide the {tb} value bytes of an entry")
    if nb % shuffle.l:
        raise ValueError(f"shuffle: L={shuffle.l} does not divide the {nb} scale blocks of an entry")
