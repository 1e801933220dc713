"""Cases generated from the coverage model (reference/coverage.py): a suite file's
`[generate]` table becomes `[[case]]` tables, reproducible from the file alone.

    [generate]
    seed = 29          # every choice below is drawn from it
    tier = "cpu"       # "cpu": what fits the default suite's 2-core budget; "gpu": the rest

Each family below reaches a group of boundaries, and combines the dimensions that interact
(every page layout and size with a writer and a reader in the same case; every plateau size
class with a k that cuts it; every non-finite value in every input with the ops that take it,
downstream ones included). The seed picks what does not decide a boundary (which page order,
which history, which options ride along with which layout; the cases' own seeds), so that
every value of those dimensions appears and two seeds give different pairings.

A generated case is named by what it reaches (`gen-layout-natural-16-shared`,
`gen-ties-zero-k64-tie16`), and is checked by the same schema as a written one. No torch:
`mxval cases` reads suite files without it.
"""
from __future__ import annotations

import random

from reference.formats import PRESETS
from reference.page_shape import page_bytes

TIERS = ("cpu", "gpu")
R = PRESETS["deepseek-v4-pro"].compress_ratio
HEAD_DIM = PRESETS["deepseek-v4-pro"].head_dim


def _decode_at(end: int) -> dict:
    """A sequence whose one decode row sees exactly `end` entries (a token at position
    end * r - 1 sees (p + 1) // r = end; position 1 sees none)."""
    return {"len": end * R, "decode": 1} if end else {"len": 2, "decode": 1}


def _rows_at(ends: list[int]) -> list[dict]:
    return [_decode_at(e) for e in ends]


# --- the families ------------------------------------------------------------------------------

LAYOUTS = (("natural", 16), ("natural", 32), ("natural", 64), ((32, 16, 2), 32), ((32, 16, 2), 64),
           ((16, 16, 4), 16), ((16, 16, 4), 32), ((16, 16, 4), 64))
PAGE_ORDERS = ("permuted", "reversed", "shared", "top", "sequential")
HISTORIES = ("pooled", "direct", "raw")
PADS = (0, 13, 64)


def _layout_name(lay) -> str:
    return lay if isinstance(lay, str) else ",".join(map(str, lay))


def _layouts(rng: random.Random, tier: str) -> list[tuple[str, dict]]:
    """Every layout and page size with the K writer and the scorer of one chain; the page
    order, history, stride padding and scorer options drawn so each value appears."""
    orders = _cycle(rng, PAGE_ORDERS, len(LAYOUTS))
    hist = _cycle(rng, HISTORIES, len(LAYOUTS))
    pads = _cycle(rng, PADS, len(LAYOUTS))
    clean = _cycle(rng, (True, False), len(LAYOUTS))
    wdt = _cycle(rng, ("bfloat16", "float32"), len(LAYOUTS))
    heads, k = (4, 8) if tier == "cpu" else (64, 1024)
    out = []
    for i, (lay, ps) in enumerate(LAYOUTS):
        per_page = ps
        # two sequences over several pages each (history on 3+ pages, a chunk crossing a page
        # edge), one decode-only sequence, and an empty one where the order allows
        h = 3 * per_page * R - per_page // 4 * R + rng.randrange(R)     # the chunk's entries cross a page edge
        seqs = [{"len": h + 2 * R * per_page // 4 + 8, "chunks": [2 * R * per_page // 4 + 8]},
                {"len": 2 * per_page * R + R, "decode": 2},
                {"len": (k + 1) * R, "decode": 1},
                {"len": per_page * R + 5, "chunks": [0]}]       # in the batch with no rows
        if tier == "gpu":
            seqs = [{"len": 40000 + rng.randrange(4000), "chunks": [256], "decode": 1},
                    {"len": 20000 + rng.randrange(4000), "decode": 2}, {"len": (k + 1) * R, "decode": 1}]
        case = {"heads": heads, "topk": k, "page_size": ps, "layout": list(lay) if not isinstance(lay, str) else lay,
                "seqs": seqs, "page_order": orders[i], "history": hist[i], "page_stride_pad": pads[i],
                "clean_logits": clean[i], "weights_dtype": wdt[i], "spare_pages": 3,
                "description": f"{_layout_name(lay)} pages of {ps} entries written and read in one chain; "
                               f"{orders[i]} page ids, {hist[i]} history, stride padded by {pads[i]} bytes"}
        if orders[i] == "top":
            # on a GPU the last pages lie past 2^31 bytes: int32 offsets of the writer and the reader
            stride = page_bytes(ps, HEAD_DIM) + pads[i]
            case["pool_pages"] = 600 if tier == "cpu" else (1 << 31) // stride + 1024
        if hist[i] == "raw":
            case["dist"] = ["scale_codes"]
            case["description"] += " (raw entries: every scale code the format holds, read)"
        out.append((f"layout-{_layout_name(lay).replace(',', '-')}-{ps}-{orders[i]}", case))
    return out


def _ties(rng: random.Random, tier: str) -> list[tuple[str, dict]]:
    """Plateaus of exactly equal scores that k cuts, each size class: relu's exact zeros at
    the bottom of the row (#positive < k < #positive + #zeros) and duplicated keys at its top
    (more copies than k), up to the whole row; coarse scores for ties at random ranks."""
    out = []
    plans = [  # (tag, k, dist, tie_share, row ends)
        ("zero-k8-tiek", 8, "relu_zero", 0.9, [40, 41, 80]),
        ("zero-k64-tie2", 64, "relu_zero", 0.125, [72, 73]),
        ("zero-k64-tie16", 64, "relu_zero", 0.5, [100, 101]),
        ("zero-row", 8, "relu_zero", 1.0, [9, 30, 64]),
        ("dup-top-k8", 8, "duplicate_keys", 0.5, [24, 64, 65]),
        ("dup-row", 8, "duplicate_keys", 1.0, [9, 33]),
        ("coarse-k16", 16, "coarse", 0.5, [17, 40, 200]),
    ]
    if tier == "gpu":
        plans = [("zero-pro-k1024", 1024, "relu_zero", 0.99, [32768, 32769, 65536]),
                 ("dup-pro-k1024", 1024, "duplicate_keys", 0.25, [8192, 16385]),
                 ("coarse-pro-k1024", 1024, "coarse", 0.5, [2049, 32768])]
    for tag, k, dist, share, ends in plans:
        heads = 4 if tier == "cpu" else 64
        case = {"heads": heads, "topk": k, "dist": [dist], "seqs": _rows_at(ends),
                "ops": ["paged_mxfp4_mqa_logits", "topk"], "history": "direct",
                "description": f"{dist}: plateaus of exact ties (share {share}) at k = {k} over rows of "
                               f"{', '.join(map(str, ends))} entries"}
        if dist != "coarse":
            case["tie_share"] = share
        if tier == "cpu" and tag.startswith("zero-k8"):
            case["ops"] = ["compress_pool", "k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant",
                           "paged_mxfp4_mqa_logits", "topk"]
            case["history"] = "pooled"
        out.append((f"ties-{tag}", case))
    return out


def _crowds(rng: random.Random, tier: str) -> list[tuple[str, dict]]:
    """Many scores in one first-pass radix bin: long rows, and calls of many crowded rows."""
    if tier == "cpu":
        base = 4400 * R + rng.randrange(R)
        return [("crowd-rows-257", {
            "heads": 4, "topk": 8, "dist": ["narrow_band"], "ops": ["topk"], "history": "direct",
            "state_block": 64, "seqs": [{"len": base + 257, "chunks": [257]}],
            "description": "one call of 257 rows, each over 4400 entries whose scores share one radix bin"})]
    return [("crowd-row-65536", {
                "heads": 8, "dist": ["narrow_band"], "ops": ["topk"], "history": "direct", "state_block": 256,
                "seqs": [{"len": 65540 * R, "decode": 1}, {"len": 70000 * R, "decode": 1}],
                "description": "rows of 65540 and 70000 entries in one radix bin (16-bit counts)"}),
            ("crowd-rows-4097", {
                "heads": 8, "dist": ["narrow_band"], "ops": ["topk"], "history": "direct", "state_block": 256,
                "seqs": [{"len": 4400 * R + 4097, "chunks": [4097]}],
                "description": "one call of 4097 crowded rows (the multi-block path)"})]


def _codes(rng: random.Random, tier: str) -> list[tuple[str, dict]]:
    """Every scale code the writers and the Q quant produce (1..253), in non-zero blocks,
    visible in the logits; bf16 subnormal inputs."""
    heads = 4 if tier == "cpu" else 64
    return [(f"codes-{'pro' if tier == 'gpu' else 'h4'}", {
        "heads": heads, "topk": 8 if tier == "cpu" else 1024, "dist": ["scale_codes"],
        "seqs": [{"len": 1100, "chunks": [1024]}] if tier == "cpu" else [{"len": 9000, "chunks": [2048]}],
        "layout": "shuffled",
        "description": "every e8m0 code 1..253 in K entries and Q, non-zero and visible; bf16 subnormals"})]


_PLANTS = (  # tensor -> the ops it is planted into (the op that takes it, and every one downstream)
    ("state_kv", None, ("nan", "inf", "-inf")),
    ("state_score", None, ("nan", "inf", "-inf")),
    ("k", ["k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"], ("nan", "inf", "-inf")),
    ("norm_weight", None, ("nan", "inf")),
    ("cos_sin_cache", None, ("nan",)),
    ("q", ["q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"], ("nan", "inf", "-inf", "row-nan")),
    ("weights", ["q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"], ("nan", "inf")),
    ("kv_scale", ["paged_mxfp4_mqa_logits", "topk"], ("nan",)),
    ("logits", ["topk"], ("nan", "inf", "-inf", "row-nan")),
)


def _nonfinite(rng: random.Random, tier: str) -> list[tuple[str, dict]]:
    """Each non-finite value in each input that takes one, with the op that takes it and the
    ops downstream of it under test (their outputs must keep the invariants)."""
    out = []
    at_scale = {("q", "row-nan"), ("logits", "row-nan"), ("kv_scale", "nan")}   # the GPU tier: NaN rows at V4-Pro size
    for tensor, ops, values in _PLANTS:
        for v in values:
            if tier == "gpu" and (tensor, v) not in at_scale:
                continue
            row = v.startswith("row-")
            plant = {"tensor": tensor, "value": v[4:] if row else v, "count": 1}
            if row:
                plant["row"] = True
            k = 8 if tier == "cpu" else 1024
            case = {"heads": 4 if tier == "cpu" else 64, "topk": k, "plant": [plant], "expect_nonfinite": True,
                    "seqs": [{"len": 3 * k + 9, "chunks": [12]}, {"len": 2 * k + 5, "decode": 1}],
                    "description": f"{v} planted in {tensor}: the ops that take it and those downstream keep "
                                   f"their invariants"}
            if tier == "gpu":
                case["seqs"] = [{"len": 40000, "chunks": [64]}, {"len": 9000, "decode": 1}]
            if ops:
                case["ops"] = ops
                case["history"] = "direct"
            out.append((f"nonfinite-{tensor.replace('_', '')}-{v}", case))
    return out


def _page_ids_across(bits: int) -> dict:
    """A K writer and a scorer on the pool's top 12 pages, ids across 2^bits (an id narrowed to
    int16 or uint16 wraps there), natural pages of 4 entries; the decode step's entry fills the
    last page, so the writer also writes the pool's last slot."""
    top = (1 << bits) + 4
    return {"heads": 4, "topk": 8, "page_size": 4, "layout": "natural", "pool_pages": top, "page_order": "top",
            "seqs": [{"len": 120, "chunks": [24]}, {"len": 64, "decode": 1}],
            "description": f"K writer and scorer on page ids {top - 12} .. {top - 1} (across 2^{bits}), natural "
                           "pages of 4 entries, the pool's last slot written"}


def _sizes(rng: random.Random, tier: str) -> list[tuple[str, dict]]:
    """Rows and widths where a kernel changes program, block or path (docs/coverage-sources.md):
    pooling's 16 / 256 tokens per program and a state block smaller than a window, the K
    writer's 32-token tile, vLLM's top-k routing at 128 rows and k = 2048, aiter's Q quant
    BLOCK_H at 8192 token-heads, the scorer's rows per sequence (1, 2..8, 9)."""
    if tier != "cpu":
        return [("sizes-q-262144", {
            "heads": 64, "ops": ["q_rope_mxfp4_quant"], "seqs": [{"len": 8300, "chunks": [4096, 4097]}],
            "description": "Q quant calls of 4096 and 4097 tokens at 64 heads: 262144 token-heads and past it"})]
    h = 64 * R + rng.randrange(R)
    return [
        ("sizes-pool-k-rows", {
            "heads": 4, "ops": ["compress_pool", "k_norm_rope_mxfp4_cache"], "state_block": 4,
            "seqs": [{"len": h + 611, "chunks": [16, 17, 32, 33, 256, 257]}],
            "description": "pooling calls of 16/17 and 256/257 tokens, K writer calls of 32/33, 4-position "
                           "state blocks (a window over three blocks)"}),
        ("sizes-no-context", {
            "heads": 4, "topk": 8, "ops": ["paged_mxfp4_mqa_logits", "topk"],
            "seqs": [{"len": 2, "chunks": [2]}, {"len": 3, "chunks": [3]}, {"len": 1, "chunks": [1]}],
            "description": "a call whose every row sees no entry (contexts of 0: a schedule's empty search)"}),
        ("sizes-topk-rows-128", {
            "heads": 4, "topk": 8, "ops": ["topk"], "history": "direct",
            "seqs": [{"len": h + 255, "chunks": [127, 128]}],
            "description": "top-k calls of 127 then 128 rows (vLLM's routing to aiter's top-k)"}),
        ("sizes-topk-k2048", {
            "heads": 4, "topk": 2048, "ops": ["topk"], "history": "direct", "state_block": 64,
            "seqs": _rows_at([2048, 2049, 4100]),
            "description": "k = 2048 (vLLM's routing) over rows of 2048, 2049 and 4100 entries"}),
        ("sizes-page-ids-65536", _page_ids_across(16)),
        ("sizes-q-8192", {
            "heads": 64, "ops": ["q_rope_mxfp4_quant"], "seqs": [{"len": 300, "chunks": [128, 129]}],
            "description": "Q quant calls of 128 and 129 tokens at 64 heads: 8192 token-heads and past it"}),
        ("sizes-scorer-seq-rows", {
            "heads": 4, "topk": 8, "ops": ["paged_mxfp4_mqa_logits", "topk"], "history": "direct",
            "seqs": [{"len": 90, "chunks": [2]}, {"len": 120, "chunks": [8]}, {"len": 77, "chunks": [9]}],
            "description": "one scorer call with sequences of 2, 8 and 9 rows (BLOCK_M 1, 2..8 and past it)"}),
        ("ties-zero-k1024-tie1024", {
            "heads": 4, "topk": 1024, "dist": ["relu_zero"], "tie_share": 0.9, "history": "direct",
            "ops": ["paged_mxfp4_mqa_logits", "topk"], "state_block": 64, "seqs": _rows_at([2100, 2101]),
            "description": "k = 1024 against a plateau of about 1900 exact zeros (a 1024-entry tie buffer)"}),
    ]


def _cuda(rng: random.Random, tier: str) -> list[tuple[str, dict]]:
    """vLLM's CUDA path: its fused pool+K op writes natural pages of every size with every scale
    code, zero blocks and signed zeros, as the ROCm writer does (the coverage model holds each
    writer to them on its own)."""
    if tier != "cpu":
        return []
    pads = _cycle(rng, PADS, 3)
    out = []
    for i, ps in enumerate((16, 32, 64)):
        h = 2 * ps * R - ps // 4 * R + rng.randrange(R)              # the chunk crosses a page edge
        out.append((f"cuda-natural-{ps}", {
            "path": "cuda", "heads": 4, "topk": 8, "page_size": ps, "page_stride_pad": pads[i],
            "dist": ["normal", "zero_rows", "neg_zero"], "page_order": "permuted",
            "seqs": [{"len": h + ps * R // 2, "chunks": [ps * R // 2]}, {"len": (ps + 9) * R, "decode": 2}],
            "description": f"vLLM's fused pool+K op on natural pages of {ps} entries, stride padded by "
                           f"{pads[i]} bytes; zero windows and signed zeros"}))
    out.append(("cuda-codes", {
        "path": "cuda", "heads": 4, "topk": 8, "dist": ["scale_codes"], "seqs": [{"len": 1100, "chunks": [1024]}],
        "description": "vLLM's fused pool+K op writing every e8m0 code 1..253 in non-zero blocks"}))
    return out


def _extremes(rng: random.Random, tier: str) -> list[tuple[str, dict]]:
    """Values at the edges of the norm and of the pooling softmax, on both paths: K rows whose
    mean square is at or below the norm's eps (a small `scale`) or whose fp32 sum of squares
    underflows (`tiny` rows, or a scale of 2^-90 for the fused op's pooled rows), and pooling
    scores past fp32 exp's range (`score_extremes`). The bytes hold at any magnitude."""
    if tier != "cpu":
        return []
    chunk = R * (8 + rng.randrange(8))
    return [
        ("extremes-pool-norm", {
            "heads": 4, "topk": 8, "scale": 2.0 ** -12, "dist": ["normal", "score_extremes"],
            "seqs": [{"len": 40, "chunks": [40]}, {"len": 120 + chunk, "chunks": [chunk]}, {"len": 90, "decode": 2}],
            "description": "pooling scores past fp32 exp's range (windows above 88.72, windows below -103.97) "
                           "and K rows 2^-12 small (mean square under eps)"}),
        ("extremes-k-underflow", {
            "heads": 6, "topk": 8, "dist": ["normal", "tiny"], "history": "direct",
            "ops": ["k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"],
            "seqs": [{"len": 100 + chunk, "chunks": [chunk]}],
            "description": "K writer rows 2^-120 .. 2^-135 small among normal ones: the fp32 sum of squares "
                           "underflows, eps alone sets the scale; 6 query heads"}),
        ("extremes-cuda-pool-norm", {
            "path": "cuda", "heads": 4, "topk": 8, "scale": 2.0 ** -12, "dist": ["normal", "score_extremes"],
            "seqs": [{"len": 40, "chunks": [40]}, {"len": 90, "decode": 2}],
            "description": "the fused pool+K op on scores past fp32 exp's range and rows under the norm's eps"}),
        ("extremes-cuda-underflow", {
            "path": "cuda", "heads": 4, "topk": 8, "scale": 2.0 ** -90,
            "ops": ["compress_norm_rope_mxfp4_cache"],           # its logits would be 2^-180: zero in fp32
            "seqs": [{"len": 36, "chunks": [36]}],
            "description": "the fused pool+K op on pooled rows 2^-90 small: the fp32 sum of squares underflows"}),
    ]


def _edges(rng: random.Random, tier: str) -> list[tuple[str, dict]]:
    """Narrow edges of page ids, heads, top-k widths, scale codes and the FP8 scales: page ids
    across 2^15 (int16's sign bit), positions across 2^16 and 2^17 for the K writer and the Q
    quant, a heads count that is not a power of two, top-k rows that fill the logits width,
    raw key codes 0 and 254 each carrying a call's logits, FP8 rows under the norm's eps,
    with sums of squares that underflow, and under the scale's 1e-4 amax floor, FP8 pages of
    16 entries, boundary tokens with slot -1 (padded) for the MXFP4 and FP8 writers, and a
    top-k k past the logits width. A family of its
    own, last, so that the seeds of the families before it stay as they were."""
    if tier != "cpu":
        return []
    chunk = R * (8 + rng.randrange(8))
    raw = [(f"edges-codes-raw-read-{lay}", {
        "heads": 4, "ops": ["paged_mxfp4_mqa_logits"], "dist": ["scale_codes"], "history": "raw",
        "seqs": [{"len": 1027, "decode": 3}], "layout": lay,
        "description": f"raw history entries of every code 0..254 on {lay} pages read by three decode queries, "
                       "the last one's logits from code-0 blocks alone (beside code 254's, code 0 is under "
                       "the logits budget)"}) for lay in ("natural", "shuffled")]
    return raw + [
        ("edges-page-ids-32768", _page_ids_across(15)),
        ("edges-rope-65536", {
            "heads": 4, "ops": ["k_norm_rope_mxfp4_cache", "q_rope_mxfp4_quant"], "history": "direct",
            "seqs": [{"len": (1 << 16) + 4, "chunks": [8]}, {"len": (1 << 17) + 4, "chunks": [8]}],
            "description": "K writer and Q quant at positions across 2^16 and 2^17 (cos/sin rows past 16 bits)"}),
        ("edges-heads-6", {
            "heads": 6, "topk": 8, "ops": ["q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"],
            "history": "direct", "seqs": [{"len": 90, "chunks": [5]}, {"len": 70, "decode": 1}],
            "description": "6 query heads: not a power of two, a partial tile of 4"}),
        ("edges-topk-fills-width", {
            "heads": 4, "topk": 8, "ops": ["topk"], "history": "direct", "page_size": 16,
            "seqs": _rows_at([32, 0, 32, 5]),
            "description": "rows of 32 entries filling the logits width (two 16-entry pages), each followed "
                           "by a row: one with no entry (its columns hold the largest fp32), one of 5"}),
        ("edges-fp8-norm", {
            "heads": 4, "topk": 8, "scale": 2.0 ** -12, "dist": ["normal", "tiny"], "history": "direct",
            "fp8_dtype": "e4m3fnuz",
            "ops": ["k_norm_rope_fp8_cache", "q_rope_fp8_quant", "paged_fp8_mqa_logits", "topk"],
            "seqs": [{"len": 100 + chunk, "chunks": [chunk]}],
            "description": "the FP8 K writer and Q quant (e4m3fnuz) on rows under the norm's eps, rows whose "
                           "fp32 sum of squares underflows and rows under the scale's 1e-4 amax floor"}),
        ("edges-fp8-q", {
            "heads": 4, "topk": 8, "scale": 2.0 ** -12, "dist": ["normal", "tiny"], "history": "direct",
            "ops": ["q_rope_fp8_quant", "paged_fp8_mqa_logits", "topk"],
            "seqs": [{"len": 40, "chunks": [24]}, {"len": 90, "decode": 2}],
            "description": "the FP8 Q quant (e4m3fn) on queries under the scale's 1e-4 amax floor"}),
        ("edges-fp8-page-16", {
            "heads": 4, "topk": 8, "page_size": 16, "history": "direct",
            "ops": ["k_norm_rope_fp8_cache", "q_rope_fp8_quant", "paged_fp8_mqa_logits", "topk"],
            "seqs": [{"len": 160, "chunks": [40]}, {"len": 70, "decode": 1}],
            "description": "FP8 pages of 16 entries: each page's scales after 16 * D value bytes, entries "
                           "written and read across several pages"}),
        ("edges-k-skipped-writes", {
            "heads": 4, "ops": ["k_norm_rope_mxfp4_cache"], "history": "direct", "skip_writes": 3,
            "seqs": [{"len": 40, "chunks": [24]}, {"len": 30, "decode": 1}],
            "description": "the first three boundary tokens of each K-writer call carry slot -1 (padded "
                           "tokens): nothing of theirs is written, slot 0 included"}),
        ("edges-k-skipped-writes-natural", {
            "heads": 4, "ops": ["k_norm_rope_mxfp4_cache"], "history": "direct", "skip_writes": 1,
            "layout": "natural", "page_size": 32, "page_order": "sequential",
            "seqs": [{"len": 20, "chunks": [20]}],
            "description": "a call whose first boundary token carries slot -1, on natural pages from page 0"}),
        ("edges-k-fp8-skipped-writes", {
            "heads": 4, "ops": ["k_norm_rope_fp8_cache"], "history": "direct", "skip_writes": 2,
            "page_size": 32, "page_order": "sequential", "seqs": [{"len": 24, "chunks": [24]}],
            "description": "the FP8 K writer with a call's first two boundary tokens at slot -1 (padded), "
                           "the first of them on the pool's slot 0"}),
        ("edges-topk-k-past-width", {
            "heads": 4, "topk": 64, "ops": ["topk"], "history": "direct", "page_size": 16,
            "seqs": _rows_at([20, 0, 7]),
            "description": "k = 64 past a logits width of 32 (short contexts): places 32..63 of every row, "
                           "and all of the empty row's, are -1 padding"}),
    ]


FAMILIES = (("layout", _layouts), ("cuda", _cuda), ("ties", _ties), ("crowd", _crowds), ("codes", _codes),
            ("nonfinite", _nonfinite), ("sizes", _sizes), ("extremes", _extremes), ("edges", _edges))


def _cycle(rng: random.Random, values, n: int) -> list:
    """n values, each of `values` at least once when n allows, in a seeded order."""
    out = []
    while len(out) < n:
        v = list(values)
        rng.shuffle(v)
        out += v
    return out[:n]


def generate(seed: int, tier: str) -> list[dict]:
    """The raw [[case]] tables of one tier (checked by the case schema like written ones)."""
    rng = random.Random(f"mxval-generate-{seed}-{tier}")
    cases = []
    for family, make in FAMILIES:
        for name, case in make(rng, tier):
            case = dict(case)
            case["name"] = f"gen-{name}" if tier == "cpu" else f"gen-gpu-{name}"
            case["seed"] = rng.randrange(1 << 31)
            case["description"] = f"[generated: {family}] {case['description']}"
            if tier == "gpu":
                case["requires"] = "gpu"
            cases.append(case)
    return cases
