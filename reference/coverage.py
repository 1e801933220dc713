"""The coverage model: for every op, the input dimensions a kernel can branch on and the
boundaries on each, with where each boundary comes from. No torch: the generator of cases
(harness/run/generate.py) and `mxval cases` read it alone; harness/run/coverage.py measures
which boundaries a case reaches.

A boundary is a point of one measured **fact** of an op's call (`FACTS`: what the engine reads
from the inputs and outputs the op under test gets, e.g. the rows of a call, each row's length
against k, the e8m0 codes of the non-zero blocks a writer stores). It is **reached** by a case
only where a wrong answer there changes an output mxval compares: the op must be under test
in the case (a stage the reference runs for it does not count), and value facts count only
where the values are visible (a key block's scale code only where the block changes the
logits of some row; a plateau only where k cuts it).

`needs` says where a case can reach it: "cpu" within the default suite's 2-core budget
through the Triton interpreter, "gpu" only at sizes a GPU affords (a 2 GiB pool, rows of
65537 entries). `make test` holds the default suite to every "cpu" boundary and the full
suite to every boundary (tests/test_coverage.py).

Sources: the kernels mxval runs or reads (mxval's optimized/triton_kernels, vLLM's Triton
kernels from the fetched release, aiter's K writer, Q quant, Gluon scorer and HIP top-k; see
docs/coverage-sources.md for the lines) and the bug classes of the field's trackers.
"""
from __future__ import annotations

from dataclasses import dataclass

from reference.formats import E8M0_BIAS, E8M0_NAN, E8M0_ZERO_BLOCK, FP8_AMAX_FLOOR

# --- who reads and writes ---------------------------------------------------------------------

POOL = ("compress_pool", "compress_norm_rope_mxfp4_cache", "compress_norm_rope_fp8_cache")
K_ROCM = ("k_norm_rope_mxfp4_cache",)
K_CUDA = ("compress_norm_rope_mxfp4_cache",)
K_MX = K_ROCM + K_CUDA
K_FP8 = ("k_norm_rope_fp8_cache",)
WRITERS = K_MX + ("k_norm_rope_fp8_cache", "compress_norm_rope_fp8_cache")
Q_MX = ("q_rope_mxfp4_quant",)
Q_FP8 = ("q_rope_fp8_quant",)
QUANTS = Q_MX + ("q_rope_fp8_quant",)
SCORER_MX = ("paged_mxfp4_mqa_logits",)
SCORERS = SCORER_MX + ("paged_fp8_mqa_logits",)
TOPK = ("topk",)
ROPE = WRITERS + QUANTS            # every op that rotates by position
READERS = SCORERS                  # every op that reads K pages through a block table

# --- the facts the engine measures (harness/run/coverage.py computes each) ---------------------

FACTS: dict[str, str] = {
    "rows": "rows (tokens) of one call of the op",
    "row_len": "a row's length (row_ends / lengths): the entries it scores or ranks",
    "len_vs_k": "a row's length against k: '0', '<k', '=k', '=k+1', '>k' (k+2 .. 4k), '>>k' (over 4k)",
    "k": "the top-k's k",
    "heads": "query heads of a call, and 'non-pow2' where the count is not a power of two (a head tile "
             "of 4, 16 or 64 left partial, a loop bound rounded to a power of two)",
    "positions": "powers of two P with positions P-1 and P in one call; 0 when position 0 is in a call; "
                 "'table-end' when a token the op rotates by its own position sits on the cos/sin table's "
                 "last row",
    "chunk_edges": "'starts-on-boundary', 'ends-on-boundary', 'window-before-call' (a boundary token's "
                   "pooling window reaches positions before the call's first token)",
    "seqs": "'empty' (a sequence of the batch with no row in the call), 'no-context' (a row that sees "
            "0 entries), 'all-no-context' (every row of the call sees 0 entries), 'packed-start' (a long "
            "row whose sequence's rows start past row 0 of the call)",
    "seq_rows": "rows of one sequence in one call (a scorer's rows per block: next_n, a prefill chunk)",
    "elements_per_call": "tokens x heads of one Q quant call (aiter picks BLOCK_H by it)",
    "state_block": "positions per state-cache block (below 2r - 1 a window spans three blocks)",
    "dots": "'overflow' (a head's dot beyond fp32's range at more than 32 heads, where aiter's relu is "
            "x + |x|), 'overflow-any' (at any head count); measured, no case generates it yet",
    "entries": "where a writer's entries fall: 'group-edge' (entries e and e+1 across a shuffle group), "
               "'page-edge' (across a page), 'pool-end' (the pool's last slot), 'skipped-boundary' (a "
               "boundary token with slot -1), 'slot-2^24' (a page's last entry at a slot >= 2^24), 'high-2^15' (in a page "
               "id in [32768, 65536): int16's sign bit), 'high-2^16' (in a page id >= 65536, past 16 bits)",
    "norm": "a written K row's sum of squares (fp64, rounded to fp32 as the norm takes it) against the "
            "norm's eps: 'eps-dominant' (0 < sum / D <= eps: the eps term sets the row's scale), "
            "'sum-underflow' (a non-zero row whose fp32 sum of squares is 0)",
    "pool_scores": "a pooling window's scores (per channel, valid slots) against fp32 exp's range: "
                   "'exp-overflow' (the largest above ln(FLT_MAX) = 88.72), 'exp-underflow' (every one "
                   "below ln(2^-150) = -103.97)",
    "pages": "the block table read: 'permuted', 'descending', 'repeated' (one page id in two places), "
             "'high' (a page id >= 512), 'high-2^15' (a page id in [32768, 65536): int16's sign bit), "
             "'high-2^16' (a page id >= 65536, past 16 bits), 'wide-table' "
             "(columns past the longest sequence's pages)",
    "page_bytes": "the largest byte offset of a page the op touches (its id times the page stride)",
    "logits_bytes": "the largest byte offset of a logits row the op writes",
    "layout": "page layout and page size: 'natural/64', '32,16,2/64', ...",
    "stride": "'pad0', 'pad-odd', 'pad-even': bytes of padding after a page's data",
    "options": "'clean_logits', 'dirty_logits', 'weights-f32', 'weights-bf16', 'e4m3fn', 'e4m3fnuz'",
    "codes": "e8m0 scale codes of the non-zero blocks the op writes (a writer's K entries, a quant's Q)",
    "codes_read": "e8m0 scale codes of the non-zero key blocks a scorer reads whose product with some "
                  "query block changes that row's fp32 logit",
    "codes_judged": "the codes_read whose blocks' products are also at least 2^-16 of the call's logits "
                    "norm (sqrt of the sum of squares over every row's valid columns): a wrong decode of them "
                    "moves logits_diff, taken over the whole call, past its budget",
    "q_codes_read": "e8m0 scale codes of the non-zero query blocks a scorer reads whose product with "
                    "some key block changes the row's fp32 logit",
    "elements": "'midpoint' (a value exactly at an e2m1 rounding midpoint before rounding), "
                "'neg-zero' (code 0x8 in a non-zero block), 'saturated' (|value| 6), 'zero-block' "
                "(an all-zero block), 'subnormal' (a bf16 subnormal input in a non-zero block)",
    "ties": "plateaus of exactly equal scores that k cuts (more than k - #greater equal the k-th "
            "score): 'tie-2' (2..15 equal), 'tie-16' (16 .. k-1), 'tie-k' (k or more, not the whole "
            "row), 'tie-row' (the whole row), 'tie-zero' (the plateau is relu's exact 0)",
    "amax": "an FP8 row's amax against the 1e-4 floor of its scale: 'under-floor' (a non-zero row, a K "
            "entry or a query head, whose amax is below it: its scale is the floor's, not its own)",
    "width": "'fills-width' (a top-k row longer than k whose length is the logits width: no column of "
             "its own past its end, the next row's first column follows); 'k-past-width' (k larger than "
             "the logits width: output places past the width are -1 padding)",
    "crowd": "most valid entries of one row sharing the first 12 bits of the order-preserving "
             "float key (one radix bin of the first pass)",
    "crowd_rows": "rows of one call whose largest first-pass bin holds 2048 entries or more",
    "nonfinite": "'<input>:<value>' planted in an input the op takes ('q:nan', 'logits:row-nan', ...)",
}

# --- the boundaries ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Boundary:
    """One boundary: `fact` of a call of one of `ops` takes a value `match` accepts.

    match: ("has", v): some call shows v; ("ge", v): some value >= v; ("every", lo, hi): the
    case shows every integer of [lo, hi) (over all its calls)."""
    name: str
    ops: tuple
    input: str
    dim: str
    fact: str
    match: tuple
    source: str
    needs: str = "cpu"

    def __post_init__(self):
        assert self.fact in FACTS, self.fact
        assert self.needs in ("cpu", "gpu"), self.needs
        assert self.match[0] in ("has", "ge", "every"), self.match

    @property
    def point(self) -> str:
        how = self.match[0]
        if how == "has":
            return str(self.match[1])
        if how == "ge":
            return f">= {self.match[1]}"
        return f"every {self.match[1]}..{self.match[2] - 1}"

    def reached_by(self, seen) -> bool:
        """Whether the fact's observed values `seen` (a set) reach this boundary."""
        how = self.match[0]
        if how == "has":
            return self.match[1] in seen
        if how == "every":
            return all(v in seen for v in range(self.match[1], self.match[2]))
        return any(not isinstance(x, (str, bool)) and x >= self.match[1] for x in seen)


_B = Boundary
_MX = "OCP MX v1.0 e8m0/e2m1; NUMERICS.md §4"
_PG = "NUMERICS.md §5 page layouts; aiter's preshuffle; vLLM's block tables"
_TK = "NUMERICS.md §6 top-k contract; radix/bitonic select in aiter's and vLLM's top-k"
_NF = "NUMERICS.md §4/§6: non-finite inputs are outside the contract, but no output may break an invariant"
_I16 = "page ids past 15 and 16 bits (a table or a packed page/offset word narrowed to int16 or uint16)"
_I31 = "int32 byte offsets (aiter's scorer, the K writers: pid * stride in 32 bits)"
_PLANTS = {   # input -> (ops taking it, values); `plant` tensors of the case schema
    "state_kv": (POOL, ("nan", "inf", "-inf")),
    "state_score": (POOL, ("nan", "inf", "-inf")),
    "k": (("k_norm_rope_mxfp4_cache", "k_norm_rope_fp8_cache"), ("nan", "inf", "-inf")),
    "norm_weight": (WRITERS, ("nan", "inf")),
    "cos_sin_cache": (ROPE, ("nan",)),
    "q": (QUANTS, ("nan", "inf", "-inf", "row-nan")),
    "weights": (QUANTS, ("nan", "inf")),
    "kv_scale": (SCORER_MX, ("nan",)),
    "logits": (TOPK, ("nan", "inf", "-inf", "row-nan")),
}


def _sizes(b: list) -> None:
    # --- rows per call: where a grid dimension, a rows-per-program split or a path changes
    for ops, stage, points, src in (
            (TOPK, "topk", (1, 4096, 4097), "top-k calls of 4096 / 4097 rows: aiter's topk switches "
                                            "to its multi-block path past 4096 rows (aiter-2901, aiter-3087)"),
            (SCORERS, "scorer", (1, 256, 257, 512, 513, 1024, 1025),
             "scorer row tiles and the logits row offset: mxval scoring.py, aiter's paged logits schedule"),
            (QUANTS, "q", (1,), "a decode step's single row"),
            (WRITERS, "k", (1,), "a decode step's single token")):
        for n in points:
            b.append(_B(f"{stage}.rows.{n}", ops, "rows", "rows per call", "rows", ("has", n), src))
    for n in (127, 128):
        b.append(_B(f"topk.rows.{n}", TOPK, "rows", "rows per call", "rows", ("has", n),
                    "vLLM routes a top-k call to aiter only from 128 rows (or k >= 2048)"))
    for n, need in ((16, "cpu"), (17, "cpu"), (256, "cpu"), (257, "cpu")):
        b.append(_B(f"pool.rows.{n}", POOL, "positions", "tokens per call", "rows", ("has", n),
                    "pooling tokens per program: 16 compiled, 256 interpreted (mxval pooling.py)", need))
    for n in (32, 33):
        b.append(_B(f"k.rows.{n}", K_MX, "k", "tokens per call", "rows", ("has", n),
                    "K writer tokens per program: a 32-token tile (mxval k_writer.py)"))
    for n, how, need in ((8192, "has", "cpu"), (8193, "ge", "cpu"), (262144, "has", "gpu"), (262145, "ge", "gpu")):
        b.append(_B(f"q.elements.{n}", Q_MX, "q", "tokens x heads per call", "elements_per_call", (how, n),
                    "aiter's Q quant BLOCK_H: 4 up to 8192 token-heads, 16 up to 262144, else 64", need))
    for n in (1, 2, 8, 9, 512):
        b.append(_B(f"scorer.seq_rows.{n}", SCORERS, "query_start_loc", "rows of one sequence in a call",
                    "seq_rows", ("has", n), "aiter's scorer BLOCK_M: 1, 2..8 (speculative rows), >= 512"))
    b.append(_B("scorer.seqs.all-no-context", SCORERS, "context_lens", "row starts and sequences", "seqs",
                ("has", "all-no-context"), "a call whose every context is 0 (DeepGEMM's schedule search)"))
    b.append(_B("pool.state_block.small", POOL, "state_cache", "state block against the window", "state_block",
                ("has", 4), "vLLM's warm-up uses block_size = r = 4 < 2r - 1: a window spans three blocks"))
    b.append(_B("topk.rows.65537", TOPK, "rows", "rows per call", "rows", ("ge", 65537),
                "CUDA grid.y <= 65535 (a top-k launched one row per block in y)", "gpu"))
    # --- row length against k and absolute row lengths
    for cls in ("0", "<k", "=k", "=k+1", ">k", ">>k"):
        b.append(_B(f"topk.len.{cls}", TOPK, "lengths", "row length against k", "len_vs_k", ("has", cls), _TK))
        b.append(_B(f"scorer.len.{cls}", SCORERS, "row_ends", "row length against k", "len_vs_k", ("has", cls),
                    "vLLM skips scoring when max_len // r <= k: both sides of k"))
    for n, need in ((2048, "cpu"), (2049, "cpu"), (4096, "cpu"), (4097, "cpu"), (16384, "cpu"), (16385, "cpu"),
                    (32768, "cpu"), (32769, "cpu"), (65537, "gpu")):
        b.append(_B(f"topk.len.{n}", TOPK, "lengths", "row length (a select path's width)", "row_len",
                    ("has", n) if n < 65537 else ("ge", n),
                    "radix top-k per-row widths: 2048 / 4096 per block, 16-bit counts past 65535", need))
    b.append(_B("topk.k.1024", TOPK, "k", "k", "k", ("has", 1024), "V4-Pro top-k"))
    b.append(_B("topk.k.512", TOPK, "k", "k", "k", ("has", 512), "V4-Flash / V4.1 top-k"))
    b.append(_B("topk.k.small", TOPK, "k", "k", "k", ("has", 8), "a k below a warp"))
    b.append(_B("topk.k.2048", TOPK, "k", "k", "k", ("has", 2048), "vLLM routes k >= 2048 to aiter's top-k"))


def _structure(b: list) -> None:
    # --- sequences, rows, positions
    for ops, stage in ((SCORERS, "scorer"), (TOPK, "topk")):
        for tag in ("empty", "no-context", "packed-start"):
            if stage == "topk" and tag == "empty":
                continue
            b.append(_B(f"{stage}.seqs.{tag}", ops, "query_start_loc", "row starts and sequences", "seqs",
                        ("has", tag), "query_start_loc / row starts: vLLM's metadata, aiter's row-start bugs"))
    b.append(_B("topk.width.fills-width", TOPK, "lengths", "a row's length against the logits width", "width",
                ("has", "fills-width"), _TK + "; a read of column len (col <= len, an unmasked tail) past a "
                "row that fills the width lands in the next row"))
    b.append(_B("topk.width.k-past-width", TOPK, "lengths", "k against the logits width", "width",
                ("has", "k-past-width"), _TK + "; short-context batches size the logits to their longest row: "
                "a kernel that loops its output places over the width leaves places width..k-1 unwritten"))
    for ops, stage in ((POOL, "pool"), (ROPE, "rope")):
        for p in (0, 2 ** 15, 2 ** 16, 2 ** 17):
            b.append(_B(f"{stage}.pos.{p}", ops, "positions", "positions (16-bit indices, RoPE tables)",
                        "positions", ("has", p), "int16 position and cos/sin indices; j = 0 windows"))
    b.append(_B("rope.pos.table-end", QUANTS, "positions", "positions against the cos/sin table's rows",
                "positions", ("has", "table-end"), "the RoPE table's last row (max_position - 1, a sequence at "
                "the model's longest context): a load mask pos < rows - 1 leaves that token unrotated"))
    for tag in ("starts-on-boundary", "ends-on-boundary", "window-before-call"):
        b.append(_B(f"pool.chunk.{tag}", POOL, "positions", "chunk edges against pooling windows", "chunk_edges",
                    ("has", tag), "NUMERICS.md §1 overlapping windows across chunks"))
    b.append(_B("q.heads.64", QUANTS + SCORERS, "q", "heads", "heads", ("has", 64), "V4-Pro's 64 index heads"))
    b.append(_B("q.heads.32", QUANTS + SCORERS, "q", "heads", "heads", ("has", 32), "V4.1's 32 heads"))
    b.append(_B("q.heads.16", QUANTS + SCORERS, "q", "heads", "heads", ("has", 16),
                "under 32 heads aiter picks the N = 16 shuffle"))
    b.append(_B("q.heads.non-pow2", QUANTS + SCORERS, "q", "heads", "heads", ("has", "non-pow2"),
                "head tiles: aiter's Q quant BLOCK_H 4/16/64, the scorers' head loop (tl.arange needs a power "
                "of two: the count is masked, or wrongly rounded)"))
    # --- pages: tables, offsets, layouts
    b.append(_B("k.entries.skipped-boundary", WRITERS, "slot_mapping", "a pooling-boundary token with slot -1",
                "entries", ("has", "skipped-boundary"), "vLLM's PAD_SLOT_ID (-1) on padded tokens, whose stale "
                "positions can sit on a boundary: a writer that clamps the slot for a safe address and masks "
                "the store by the boundary alone writes slot 0"))
    for tag in ("group-edge", "page-edge", "pool-end", "high-2^15", "high-2^16"):
        b.append(_B(f"k.entries.{tag}", WRITERS, "slot_mapping", "entries across shuffle groups and pages",
                    "entries", ("has", tag), _PG + "; a bounds guard on the pool's slot count; " + _I16))
    b.append(_B("k.entries.slot-2^24", WRITERS, "slot_mapping", "slots past fp32's integers", "entries",
                ("has", "slot-2^24"), "a page's last entry at a slot >= 2^24, where fp32 stops holding every "
                "integer (a page = slot / page_size taken in fp32 rounds it onto the next page)", "gpu"))
    for tag in ("permuted", "descending", "repeated", "high", "high-2^15", "high-2^16", "wide-table"):
        b.append(_B(f"scorer.pages.{tag}", READERS, "block_table", "block table page ids", "pages", ("has", tag),
                    _PG + "; prefix caching shares pages between sequences; " + _I16))
    for ops, stage in ((WRITERS, "k"), (READERS, "scorer")):
        b.append(_B(f"{stage}.page_bytes.2^31", ops, "kv_cache", "page byte offsets", "page_bytes",
                    ("ge", 2 ** 31), _I31, "gpu"))
    b.append(_B("scorer.logits_bytes.2^31", SCORERS, "logits", "logits byte offsets", "logits_bytes",
                ("ge", 2 ** 31), "aiter-4244: int32 logits row offsets", "gpu"))
    every_layout = ("natural/16", "natural/32", "natural/64", "32,16,2/32", "32,16,2/64", "16,16,4/16",
                    "16,16,4/32", "16,16,4/64")
    for ops, stage in ((K_FP8, "k_fp8"), (("paged_fp8_mqa_logits",), "scorer_fp8")):
        for ps in (16, 32, 64):
            b.append(_B(f"{stage}.layout.fp8/{ps}", ops, "kv_cache", "FP8 page size", "layout", ("has", f"fp8/{ps}"),
                        "NUMERICS.md §5 FP8 pages: each page's scales follow its page_size * D value bytes (an "
                        "offset written for one page size lands in the next page's values at another)"))
    for ops, stage, layouts in ((K_ROCM, "k", every_layout), (K_CUDA, "pool_k", every_layout[:3]),
                                (SCORER_MX, "scorer", every_layout)):     # vLLM's fused K kernel: natural pages
        for lay in layouts:
            b.append(_B(f"{stage}.layout.{lay}", ops, "kv_cache", "page layout / page size", "layout",
                        ("has", lay), _PG + ": every layout and page size for every reader and writer"))
        for tag in ("pad0", "pad-odd", "pad-even"):
            b.append(_B(f"{stage}.stride.{tag}", ops, "kv_cache", "page stride padding", "stride", ("has", tag),
                        _PG))
    for tag in ("clean_logits", "dirty_logits"):
        b.append(_B(f"scorer.options.{tag}", SCORERS, "options", "scorer options", "options", ("has", tag),
                    "NUMERICS.md §6 clean_logits: -inf past each row's end, or unspecified"))
    for tag in ("weights-f32", "weights-bf16"):
        b.append(_B(f"q.options.{tag}", QUANTS, "weights", "head weights dtype", "options", ("has", tag),
                    "vLLM's bf16 head weights; fp32 where the model keeps them"))
    for tag in ("e4m3fn", "e4m3fnuz"):
        b.append(_B(f"fp8.{tag}", ("k_norm_rope_fp8_cache", "paged_fp8_mqa_logits"), "kv_cache", "fp8 flavour",
                    "options", ("has", tag), "NUMERICS.md §7: gfx950 e4m3fn, gfx942 e4m3fnuz"))


def _values(b: list) -> None:
    # --- values: scale codes, elements
    # each writer on its own (the ROCm path's K writer, the CUDA path's fused pool+K op) and the Q
    # quant; the fused op takes no K row, so its input-side classes (midpoints, subnormals) are the writer's
    every_element = ("midpoint", "neg-zero", "saturated", "zero-block", "subnormal")
    for ops, stage, elements in ((K_ROCM, "k", every_element), (K_CUDA, "pool_k", every_element[1:4]),
                                 (Q_MX, "q", every_element)):
        b.append(_B(f"{stage}.codes.every", ops, "values", "e8m0 scale codes of non-zero blocks", "codes",
                    ("every", E8M0_ZERO_BLOCK, E8M0_NAN - 1),
                    _MX + ": the ceil rule stores 1..253 from finite fp32"))
        for c in (E8M0_ZERO_BLOCK, 2, E8M0_BIAS, E8M0_NAN - 2):
            b.append(_B(f"{stage}.codes.{c}", ops, "values", "e8m0 scale code", "codes", ("has", c), _MX))
        for tag in elements:
            b.append(_B(f"{stage}.elements.{tag}", ops, "values", "e2m1 elements", "elements", ("has", tag), _MX))
    b.append(_B("scorer.codes_read.every", SCORER_MX, "kv_cache", "key scale codes visible in the logits",
                "codes_read", ("every", 0, E8M0_NAN), _MX + ": every code the format holds, read"))
    for c in (0, 1, E8M0_NAN - 1):
        b.append(_B(f"scorer.codes_read.{c}", SCORER_MX, "kv_cache", "key scale code visible in the logits",
                    "codes_read", ("has", c), _MX + ": 0 is fp32's 2^-127, 254 makes 6 * 2^127 overflow fp32"))
    for c in (0, E8M0_NAN - 1):
        b.append(_B(f"scorer.codes_judged.{c}", SCORER_MX, "kv_cache", "key scale code seen by the logits budget",
                    "codes_judged", ("has", c), _MX + "; a block of code 0 beside rows of larger logits changes "
                    "its row by less than logits_diff's budget over the call: the code's decode is judged only "
                    "where its products carry the call"))
    for c in (E8M0_ZERO_BLOCK, E8M0_NAN - 2):
        b.append(_B(f"scorer.q_codes_read.{c}", SCORER_MX, "q_scale", "query scale code visible in the logits",
                    "q_codes_read", ("has", c), _MX))
    # --- values: the norm's eps and the pooling softmax's range
    for ops, stage in ((K_ROCM, "k"), (K_CUDA, "pool_k"), (K_FP8, "fp8_k")):
        for tag in ("eps-dominant", "sum-underflow"):
            b.append(_B(f"{stage}.norm.{tag}", ops, "k", "a K row's mean square against eps", "norm", ("has", tag),
                        "NUMERICS.md §2 x * rsqrt(sum(x*x)/D + eps): where eps sets the scale, its place (under "
                        "the root or after it) and the sum's width decide every byte of the row"))
    for ops, stage in ((K_FP8, "fp8_k"), (Q_FP8, "fp8_q")):
        b.append(_B(f"{stage}.amax.under-floor", ops, "values", "an FP8 row's amax against its scale's floor",
                    "amax", ("has", "under-floor"),
                    f"NUMERICS.md §7 scale = 2^ceil(log2(max(amax, {FP8_AMAX_FLOOR}) / max)): a row under the "
                    "floor takes the floor's scale (its values round to zero), not its own"))
    for tag in ("exp-overflow", "exp-underflow"):
        b.append(_B(f"pool.scores.{tag}", POOL, "state_score", "window scores against fp32 exp's range",
                    "pool_scores", ("has", tag),
                    "NUMERICS.md §1 softmax over the window: exp(s - max) holds at any score; exp(s) without "
                    "the max, or a running max started at 0, overflows above 88.72 or empties a window "
                    "below -103.97"))
    # --- values: ties and crowded bins
    for tag in ("tie-2", "tie-16", "tie-k", "tie-row", "tie-zero", "tie-1024"):
        b.append(_B(f"topk.{tag}", TOPK, "logits", "exact ties at the k-th score", "ties", ("has", tag), _TK))
    for n, need in ((2048, "cpu"), (4096, "cpu"), (65536, "gpu")):
        b.append(_B(f"topk.crowd.{n}", TOPK, "logits", "entries in one first-pass radix bin", "crowd", ("ge", n),
                    "radix select: a bin past a block's candidate buffer (2048, 4096) or a 16-bit count "
                    "(sglang-36807, flaggems-831)", need))
    b.append(_B("topk.crowd_rows.257", TOPK, "logits", "crowded rows in one call", "crowd_rows", ("ge", 257),
                "a call of many crowded rows: per-block scratch shared between rows"))
    b.append(_B("topk.crowd_rows.4097", TOPK, "logits", "crowded rows in one call", "crowd_rows", ("ge", 4097),
                "crowded rows on the multi-block path past 4096 rows", "gpu"))
    # --- non-finite inputs, each input of each op
    for inp, (ops, values) in _PLANTS.items():
        for v in values:
            b.append(_B(f"nonfinite.{inp}.{v}", ops, inp, "non-finite input", "nonfinite", ("has", f"{inp}:{v}"),
                        _NF))


def _boundaries() -> tuple[Boundary, ...]:
    b: list[Boundary] = []
    for group in (_sizes, _structure, _values):
        group(b)
    names = [x.name for x in b]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    return tuple(b)


BOUNDARIES: tuple[Boundary, ...] = _boundaries()
BY_NAME: dict[str, Boundary] = {x.name: x for x in BOUNDARIES}
