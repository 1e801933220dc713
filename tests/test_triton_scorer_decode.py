"""The scorer's e2m1 decoders (select chain, exponent-field trick, inline PTX) against
the reference dequantization, on every byte and every finite scale byte; and the
scorer's logits with each decoder (interpreter here; compiled in test_gpu_triton.py)."""
import pytest
import torch
from helpers import all_bytes_and_scales, compare, expected, logits_case


@pytest.fixture(scope="module")
def kernels():
    from optimized import get_backend
    get_backend("triton-interpret")           # fixes the interpreter mode before the import
    from optimized.triton_kernels import scoring
    return scoring


@pytest.mark.parametrize("decode", [0, 1, 2])
def test_decoder_is_exact_on_every_byte_and_scale(kernels, decode):
    b, e = all_bytes_and_scales()
    got = kernels.decode_probe(b, e, decode)
    want = expected(b, e)
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} values differ, first at byte/scale " \
        f"{[int(b[i]) for i in (~same.all(1)).nonzero()[:1].flatten()]}"


def test_decoder_probe_has_teeth(kernels):
    b, e = all_bytes_and_scales()
    want = expected(b, e)
    got = kernels.decode_probe(b, (e.int() + 1).clamp_max(254).to(torch.uint8), 1)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("decode,words,page_size,shuffle,bn", [
    (0, False, 32, (32, 16, 2), 64), (1, False, 32, (32, 16, 2), 64), (2, False, 32, (32, 16, 2), 64),
    (2, True, 64, (32, 16, 2), 64), (2, True, 64, (16, 16, 4), 64), (2, True, 64, None, 64),
    (2, True, 128, (32, 16, 2), 64), (2, False, 64, (32, 16, 2), 64)])
def test_logits_with_each_decoder(kernels, decode, words, page_size, shuffle, bn):
    """Each e2m1 decoder, and the scale bytes read as whole-page words (preshuffled in
    both layouts aiter picks, and natural) or byte by byte."""
    kw = dict(logits_case(seqs=((3, 170), (1, 33)), page_size=page_size, pad=8, shuffle=shuffle),
              clean_logits=True)
    from reference.scoring import check_mxfp4_scorer
    shuf, _, width, _ = check_mxfp4_scorer(kw["q_fp4"], kw["q_scale"], kw["weights"], kw["kv_cache"],
                                        kw["query_start_loc"], kw["context_lens"], kw["block_table"],
                                        kw["row_ends"], kw["page_size"], kw["shuffle"], None)
    (qv, qs, w, kc, bt, ends), tiles, config, _ = kernels.prepare(
        "cpu", kw["query_start_loc"], kw["row_ends"], kw["weights"].shape[1], kw["q_fp4"], kw["q_scale"],
        kw["weights"], kw["kv_cache"], kw["block_table"])
    assert kernels.scale_words(kc, page_size, 128, bn, shuf) or not words
    out = kernels.launch(qv, qs, w, kc, bt, tiles, ends, width=width, page_size=kw["page_size"],
                         shuffle=shuf, clean_logits=True, config=(config[0], bn, config[2], config[3]),
                         decode=decode, words=words)
    assert compare("paged_mxfp4_mqa_logits", {"logits": out}, kw) == []


@pytest.mark.parametrize("shuffle", [(32, 16, 2), (16, 16, 4), None])
def test_extreme_scale_codes_are_scaled_after_the_block_dot(kernels, shuffle):
    """Keys whose e8m0 code is 254 (6 * 2^127 is past fp32) or 0 (2^-127 against a huge
    query block): decoding each value to fp32 before the product overflows, as the fast path
    does; the call is routed to the path that scales each block's dot (as scaled-MMA
    instructions do), which meets the reference."""
    from reference import layout
    kw = dict(logits_case(seqs=((3, 170), (1, 33)), page_size=32, pad=8, shuffle=shuffle), clean_logits=True)
    sh = list(shuffle) if shuffle else None
    slots = torch.arange(kw["kv_cache"].shape[0] * 32)
    packed, scales = layout.read_entries(kw["kv_cache"], slots, page_size=32, head_dim=128, shuffle=sh)
    packed, scales = packed.clone(), scales.clone()
    packed[::7, :16] = 0x77                                    # block 0: every element 6 ...
    scales[::7, 0] = 254                                       # ... times 2^127
    scales[3::7, 3] = 0                                        # block 3: 2^-127
    kw["kv_cache"] = layout.write_entries(kw["kv_cache"], slots, packed, scales, page_size=32, shuffle=sh)
    kw["q_scale"] = torch.full_like(kw["q_scale"], 60)
    kw["q_scale"][..., 3] = 200                                # lifts the 2^-127 blocks into view
    from reference.scoring import check_mxfp4_scorer
    shuf, _, width, _ = check_mxfp4_scorer(kw["q_fp4"], kw["q_scale"], kw["weights"], kw["kv_cache"],
                                        kw["query_start_loc"], kw["context_lens"], kw["block_table"],
                                        kw["row_ends"], 32, kw["shuffle"], None)
    (qv, qs, w, kc, bt, ends), tiles, config, _ = kernels.prepare(
        "cpu", kw["query_start_loc"], kw["row_ends"], kw["weights"].shape[1], kw["q_fp4"], kw["q_scale"],
        kw["weights"], kw["kv_cache"], kw["block_table"])
    assert kernels.extreme_codes(qs, kc, bt, kw["context_lens"], 32, 128, shuf)

    def run(after):
        return kernels.launch(qv, qs, w, kc, bt, tiles, ends, width=width, page_size=32, shuffle=shuf,
                              clean_logits=True, config=config, scale_after=after)
    assert compare("paged_mxfp4_mqa_logits", {"logits": run(True)}, kw) == []
    assert compare("paged_mxfp4_mqa_logits", {"logits": run(False)}, kw) != []       # the fast path's overflow


def test_ordinary_codes_take_the_fast_path(kernels):
    """Only the entries a call reads count: a pool's unwritten slots hold random bytes (254s
    among them), which must not send ordinary calls down the slow path."""
    from reference import layout
    kw = logits_case(seqs=((3, 70),))
    sh = list(kw["shuffle"]) if kw["shuffle"] else None
    args = (kw["q_scale"], kw["kv_cache"], kw["block_table"], kw["context_lens"], 32, 128, sh)
    assert not kernels.extreme_codes(*args)
    assert bool((kw["kv_cache"] == 254).any())                     # garbage outside the entries read
    page = int(kw["block_table"][0, 70 // 32])
    last = layout.scale_offsets(torch.tensor([70 % 32 - 1]), 32, 128, sh)[0, 0]       # entry 69, block 0
    kw["kv_cache"][page, last] = 254
    assert kernels.extreme_codes(*args)
