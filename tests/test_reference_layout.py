"""Page layouts (NUMERICS.md §5): offsets are a bijection onto the page, match the V4-Pro
formulas literally, and reading/writing through them round-trips."""
import pytest
import torch

from reference import layout

CASES = [  # page_size, D, shuffle
    (64, 128, None), (64, 128, (32, 16, 2)), (64, 128, (16, 16, 4)), (32, 64, (32, 16, 2)),
    (128, 256, (32, 16, 2)), (64, 128, (32, 8, 4)), (16, 32, (16, 16, 1)), (48, 96, (16, 16, 3)),
]


def all_offsets(page_size, d, shuffle):
    t = torch.arange(page_size)
    return torch.cat((layout.value_offsets(t, page_size, d, shuffle).flatten(),
                      layout.scale_offsets(t, page_size, d, shuffle).flatten()))


@pytest.mark.parametrize("page_size,d,shuffle", CASES)
def test_offsets_are_a_bijection_onto_the_page(page_size, d, shuffle):
    off = all_offsets(page_size, d, shuffle)
    assert torch.equal(off.sort().values, torch.arange(layout.page_bytes(page_size, d)))
    vals = layout.value_offsets(torch.arange(page_size), page_size, d, shuffle)
    assert int(vals.max()) < page_size * d // 2           # values first, then scales


def test_v4_pro_formulas_literally():
    t = torch.arange(64)[:, None]
    b = torch.arange(64)[None, :]
    s = torch.arange(4)[None, :]
    val = (t // 32) * 2048 + (b // 16) * 512 + (t % 32) * 16 + b % 16
    scale = 4096 + (t // 32) * 128 + (s % 2) * 64 + (t % 32) * 2 + s // 2
    assert torch.equal(layout.value_offsets(t[:, 0], 64, 128, (32, 16, 2)), val)
    assert torch.equal(layout.scale_offsets(t[:, 0], 64, 128, (32, 16, 2)), scale)
    assert torch.equal(layout.value_offsets(t[:, 0], 64, 128, None), t * 64 + b)
    assert torch.equal(layout.scale_offsets(t[:, 0], 64, 128, None), 4096 + t * 4 + s)
    assert layout.page_bytes(64, 128) == 4352
    # teeth: a [pages, 64, 68] token-major view is not this layout
    assert not torch.equal(layout.value_offsets(t[:, 0], 64, 128, (32, 16, 2)), t * 64 + b)


def test_general_preshuffle_formula():
    for page_size, d, shuffle in CASES:
        if shuffle is None:
            continue
        n, dt, l = shuffle
        tb, nb = d // 2, d // 32
        t = torch.arange(page_size)[:, None]
        b, s = torch.arange(tb)[None, :], torch.arange(nb)[None, :]
        g, lane, s_hi = t // n, t % n, nb // l
        val = g * n * tb + (b // dt) * n * dt + lane * dt + (b % dt)
        scale = page_size * tb + g * n * nb + (s % l) * n * s_hi + lane * s_hi + (s // l)
        assert torch.equal(layout.value_offsets(t[:, 0], page_size, d, shuffle), val)
        assert torch.equal(layout.scale_offsets(t[:, 0], page_size, d, shuffle), scale)


def test_choose_shuffle_rule():
    assert layout.choose_shuffle(128, 64).as_list() == [32, 16, 2]      # V4-Pro, V4-Flash
    assert layout.choose_shuffle(128, 32).as_list() == [32, 16, 2]      # V4.1
    assert layout.choose_shuffle(128, 16).as_list() == [16, 16, 4]
    assert layout.choose_shuffle(64, 8).as_list() == [32, 16, 2]
    assert layout.choose_shuffle(96, 31).as_list() == [16, 16, 4]


@pytest.mark.parametrize("pad", [40, 13, 16])                  # 13: rows not 8-byte aligned; 16: read in place
@pytest.mark.parametrize("page_size,d,shuffle", CASES)
def test_write_read_roundtrip_with_padding(gen, page_size, d, shuffle, pad):
    pages, stride = 3, layout.page_bytes(page_size, d) + pad           # padded pages
    pool = torch.randint(0, 256, (pages, stride), dtype=torch.uint8, generator=gen)
    slots = torch.randperm(pages * page_size, generator=gen)[: page_size + 3]
    packed = torch.randint(0, 256, (slots.numel(), d // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 256, (slots.numel(), d // 32), dtype=torch.uint8, generator=gen)
    out = layout.write_entries(pool, slots, packed, scales, page_size=page_size, shuffle=shuffle)
    p2, s2 = layout.read_entries(out, slots, page_size=page_size, head_dim=d, shuffle=shuffle)
    assert torch.equal(p2, packed) and torch.equal(s2, scales)
    owned = layout.owned_mask(pages, stride, slots, page_size=page_size, head_dim=d, shuffle=shuffle)
    assert int(owned.sum()) == slots.numel() * layout.entry_bytes(d)
    assert torch.equal(out[~owned], pool[~owned])
    assert not bool(owned[:, layout.page_bytes(page_size, d):].any())   # padding never owned
    # page-wise reader gives the same bytes, pages in any order
    order = torch.tensor([2, 0, 1])
    pp, ss = layout.read_pages(out, order, page_size=page_size, head_dim=d, shuffle=shuffle)
    all_slots = (order[:, None] * page_size + torch.arange(page_size)).flatten()
    pe, se = layout.read_entries(out, all_slots, page_size=page_size, head_dim=d, shuffle=shuffle)
    assert torch.equal(pp, pe) and torch.equal(ss, se)


def test_locate_inverts_offsets():
    for shuffle in (None, (32, 16, 2)):
        v = layout.value_offsets(torch.tensor([37]), 64, 128, shuffle)[0, 21]
        s = layout.scale_offsets(torch.tensor([37]), 64, 128, shuffle)[0, 3]
        stride = 4400
        assert layout.locate(stride + int(v), page_stride=stride, page_size=64, head_dim=128, shuffle=shuffle) == \
            {"page": 1, "kind": "value", "entry": 37, "byte": 21, "elements": [42, 43], "block": 1}
        assert layout.locate(int(s), page_stride=stride, page_size=64, head_dim=128, shuffle=shuffle) == \
            {"page": 0, "kind": "scale", "entry": 37, "block": 3}
        assert layout.locate(4360, page_stride=stride, page_size=64, head_dim=128, shuffle=shuffle)["kind"] == "padding"


def test_bad_layouts_raise():
    with pytest.raises(ValueError, match="page_size"):
        layout.value_offsets(torch.arange(3), 48, 128, (32, 16, 2))
    with pytest.raises(ValueError, match="Dt"):
        layout.value_offsets(torch.arange(3), 64, 128, (32, 24, 2))
    with pytest.raises(ValueError, match="L="):
        layout.scale_offsets(torch.arange(3), 64, 128, (32, 16, 3))
    with pytest.raises(ValueError, match="shuffle"):
        layout.as_shuffle([32, 16])


@pytest.mark.parametrize("pad", [40, 13])                              # 13: odd page stride
@pytest.mark.parametrize("page_size,d,shuffle", [*CASES, (64, 128, (32, 32, 2)), (64, 128, (32, 64, 4)),
                                                 (32, 128, (32, 8, 2))])
def test_page_block_words_copy_to_the_unshuffled_values(gen, page_size, d, shuffle, pad):
    """The strided int16 view of gathered pages, copied, is `page_values` word for word
    (entries in order, blocks in order); a tile narrower than a block has no such view."""
    pages, stride = 3, layout.page_bytes(page_size, d) + pad
    pool = torch.randint(0, 256, (pages, stride), dtype=torch.uint8, generator=gen)
    pg = layout.gather_pages(pool, torch.tensor([2, 0, 1]), page_size=page_size, head_dim=d, shuffle=shuffle)
    words = layout.page_block_words(pg, page_size=page_size, head_dim=d, shuffle=shuffle)
    if shuffle is not None and shuffle[1] % 16:
        assert words is None
        return
    assert words.dim() == 6 and words.shape[0] == pages and words.shape[-1] == 8
    assert words.shape[1] * words.shape[2] == page_size and words.shape[3] * words.shape[4] == d // 32
    vals = layout.page_values(pg, page_size=page_size, head_dim=d, shuffle=shuffle)
    assert torch.equal(words.contiguous().view(torch.uint8).view(pages * page_size, d // 2), vals)


@pytest.mark.parametrize("stride_pad", [8, 13])
def test_one_page_with_an_unaligned_stride_is_read(gen, stride_pad):
    """One gathered page whose stride is not a multiple of the read unit (a lone row keeps
    its stride through contiguous()): values and block words still read."""
    page_size, d, shuffle = 64, 128, (32, 16, 2)
    pool = torch.randint(0, 256, (2, layout.page_bytes(page_size, d) + stride_pad), dtype=torch.uint8, generator=gen)
    pg = layout.gather_pages(pool, torch.tensor([1]), page_size=page_size, head_dim=d, shuffle=shuffle)
    vals = layout.page_values(pg, page_size=page_size, head_dim=d, shuffle=shuffle)
    slots = torch.arange(page_size) + page_size
    want, _ = layout.read_entries(pool, slots, page_size=page_size, head_dim=d, shuffle=shuffle)
    assert torch.equal(vals, want)
    words = layout.page_block_words(pg, page_size=page_size, head_dim=d, shuffle=shuffle)
    assert torch.equal(words.contiguous().view(torch.uint8).view(page_size, d // 2), want)

