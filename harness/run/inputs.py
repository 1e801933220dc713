"""Every input tensor of a case, generated from its seed (deterministic on any machine:
all random draws happen on the CPU with one torch.Generator; only pools too large for
the CPU are filled on the device).

The state cache goes through `reference.pooling.state_rows`/`write_state` with a
permuted state block table; cos/sin come from `reference.rope.cos_sin_cache` with the
preset's YaRN values; K pools start as random bytes so that a writer touching bytes it
does not own is caught; slot mappings give -1 to non-boundary tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from harness.run.cases import PLANT_VALUES, STRUCTURED_DISTS, Case, CaseError
from harness.run.geometry import Geometry, geometry, page_needs, pool_pages, shared_pages
from reference import layout
from reference.formats import E2M1_VALUES, E8M0_NAN, MX_BLOCK
from reference.mxfp4 import pack_nibbles
from reference.ops import OPS
from reference.pooling import state_rows, write_state
from reference.rope import cos_sin_cache

# Pools above this many bytes are filled on the device (the GPU suite's > 2 GiB pools).
_CPU_POOL_LIMIT = 1 << 28
_GARBAGE = 1000.0       # never-read state rows: a kernel reading a wrong row shows up large

E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_GRID = E2M1_VALUES
# 6 * 2**k in bf16 and its bf16 neighbours: the amax values where the e8m0 scale steps.
POW2_EDGES = (6.0, 6.03125, 5.96875)


@dataclass
class Tokens:
    """One batch of tokens (a step, or the history written before the first step)."""
    positions: torch.Tensor          # int64 [T]
    req_index: torch.Tensor          # int64 [T]: row of the block tables
    slot_mapping: torch.Tensor       # int64 [T]: K slot, -1 for non-boundary tokens
    seqs: list[int]                  # sequences present, in token order
    query_start_loc: torch.Tensor    # int32 [B'+1] over `seqs`
    context_lens: torch.Tensor       # int32 [B']: entries after this batch
    block_table: torch.Tensor        # int32 [B', max_pages]: the K pages of `seqs`
    row_ends: torch.Tensor           # int32 [T]: (p + 1) // r
    q: Optional[torch.Tensor] = None         # bf16 [T, H, D]
    weights: Optional[torch.Tensor] = None   # [T, H]
    k: Optional[torch.Tensor] = None         # bf16 [T, D]: K writer input when pooling is not run

    @property
    def n(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class LatePlant:
    """A plant put in once the history is written (the history's writes read the norm weight
    and RoPE table, and write the entries whose scale bytes a plant replaces), or, for
    `logits`, into top-k's input of step `step`. `index`: CPU index tensors into the tensor
    (kv_scale: flat pool byte offsets); `value`: a float, or the bytes (uint8) of kv_scale."""
    tensor: str
    index: tuple
    value: object
    step: int = 0


@dataclass
class CaseInputs:
    case: Case
    geo: Geometry
    state_cache: torch.Tensor        # f32 [blocks, state_block, 4D]
    state_block_table: torch.Tensor  # int32 [B, max_blocks]
    cos_sin_cache: torch.Tensor      # f32 [max_pos, R]
    norm_weight: torch.Tensor        # bf16 [D]
    kv_cache: torch.Tensor           # u8 [P, stride]: random bytes
    k_block_table: torch.Tensor      # int32 [B, max_pages]
    history: Optional[Tokens]
    steps: list[Tokens]
    planted: list[str] = field(default_factory=list)
    # {tensor, value, row, count}: each plant of the case, as built (its site is in `planted`)
    plant_facts: list[dict] = field(default_factory=list)
    late: list[LatePlant] = field(default_factory=list)

    def after_history(self, pool: torch.Tensor) -> tuple["CaseInputs", torch.Tensor]:
        """(these inputs, `pool`) with the plants the history write must not see: the norm
        weight, RoPE rows and scale bytes of written entries. Unchanged without such plants."""
        mine = [p for p in self.late if p.tensor != "logits"]
        if not mine:
            return self, pool
        got = {"norm_weight": self.norm_weight.clone(), "cos_sin_cache": self.cos_sin_cache.clone(),
               "kv_scale": pool.clone()}
        for p in mine:
            t = got[p.tensor]
            idx = tuple(i.to(t.device) for i in p.index)
            if p.tensor == "kv_scale":
                t.view(-1)[idx[0]] = p.value.to(t.device)
            else:
                t[idx] = p.value
        return (dataclasses.replace(self, norm_weight=got["norm_weight"], cos_sin_cache=got["cos_sin_cache"]),
                got["kv_scale"])

    def plant_logits(self, step: int, logits: torch.Tensor) -> torch.Tensor:
        """Top-k's input of `step` with the logits plants (a copy; `logits` without any)."""
        mine = [p for p in self.late if p.tensor == "logits" and p.step == step]
        if not mine:
            return logits
        logits = logits.clone()
        for p in mine:
            logits[tuple(i.to(logits.device) for i in p.index)] = p.value
        return logits

    def scalars(self, op: str) -> dict:
        g, c = self.geo, self.case
        table = {
            "compress_pool": {"compress_ratio": g.ratio},
            "k_norm_rope_mxfp4_cache": {"norm_eps": g.preset.rms_eps, "compress_ratio": g.ratio,
                                        "page_size": g.page_size, "shuffle": g.shuffle},
            "k_norm_rope_fp8_cache": {"norm_eps": g.preset.rms_eps, "compress_ratio": g.ratio,
                                      "page_size": g.page_size, "fp8_dtype": c.fp8_dtype},
            "q_rope_mxfp4_quant": {"weights_scale": g.weights_scale},
            "q_rope_fp8_quant": {"weights_scale": g.weights_scale, "fp8_dtype": c.fp8_dtype},
            "paged_mxfp4_mqa_logits": {"page_size": g.page_size, "shuffle": g.shuffle,
                                       "clean_logits": c.clean_logits},
            "paged_fp8_mqa_logits": {"page_size": g.page_size, "fp8_dtype": c.fp8_dtype,
                                     "clean_logits": c.clean_logits},
            "topk": {"k": g.topk},
            "compress_norm_rope_mxfp4_cache": {"compress_ratio": g.ratio, "norm_eps": g.preset.rms_eps,
                                               "page_size": g.page_size},
            "compress_norm_rope_fp8_cache": {"compress_ratio": g.ratio, "norm_eps": g.preset.rms_eps,
                                             "page_size": g.page_size, "fp8_dtype": c.fp8_dtype},
        }
        out = dict(table[op])
        if OPS[op].fuses:
            from reference.fused import CUDA_ROPE
            out["rope"] = CUDA_ROPE          # said in every dump; a backend's numerics may override
        if c.path == "cuda" and OPS[op].stage == "q_quant":
            # vLLM's CUDA Q kernels multiply by softmax_scale, then head_scale, and contract
            # their rotation as `fma-es` (NUMERICS.md §3); a backend's numerics may override
            from reference.fused import CUDA_Q_ROPE
            out.update(softmax_scale=g.head_dim ** -0.5, head_scale=g.heads ** -0.5, rope=CUDA_Q_ROPE)
        return out

    def to(self, device) -> "CaseInputs":
        def mv(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x

        def mv_tokens(t: Optional[Tokens]):
            if t is None:
                return None
            return Tokens(**{k: mv(v) for k, v in t.__dict__.items()})

        return CaseInputs(self.case, self.geo, mv(self.state_cache), mv(self.state_block_table),
                          mv(self.cos_sin_cache), mv(self.norm_weight), mv(self.kv_cache),
                          mv(self.k_block_table), mv_tokens(self.history),
                          [mv_tokens(s) for s in self.steps], list(self.planted), list(self.plant_facts),
                          list(self.late))


# --- value distributions -------------------------------------------------------------

def _rows_mask(n: int, frac: float, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=gen) < frac


def shape_values(x: torch.Tensor, dist: tuple[str, ...], gen: torch.Generator, *,
                 kind: str, group: int = 1, ctx: Optional[ValueContext] = None,
                 req: Optional[torch.Tensor] = None, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Apply the case's distribution modifiers to fp32 `x` [..., C] (rows = leading dims).
    `kind` "q" also gets the MXFP4 edge values in its NoPE blocks (they reach the
    quantizer unchanged); "kv" zeroes whole pooling windows (`group` rows) so that pooled
    rows are exactly zero. A structured dist (`ctx`, rows' sequences `req` and positions
    `pos`) first replaces x (`structured_values`), then the modifiers it allows apply."""
    if ctx is not None:
        x = structured_values(x, ctx, gen, kind=kind, req=req, pos=pos)
    shape = x.shape
    x = x.reshape(-1, shape[-1]).clone()
    n, c = x.shape
    for d in dist:
        if d == "outlier_channels":
            ch = torch.randperm(c, generator=gen)[:max(1, c // 32)]
            x[:, ch] *= 64.0
        elif d == "heavy_tails":
            x *= torch.exp(1.5 * torch.randn(n, c, generator=gen))
        elif d in ("zero_rows", "neg_zero"):
            fill = 0.0 if d == "zero_rows" else -0.0
            if kind == "kv":
                starts = torch.nonzero(_rows_mask(max(1, n // group), 0.15, gen)).flatten() * group
                for s in starts.tolist():
                    x[s:s + 2 * group] = fill
            else:
                x[_rows_mask(n, 0.12, gen)] = fill
            if d == "neg_zero":
                x[torch.rand(n, c, generator=gen) < 0.05] = -0.0
        elif d == "tiny":
            rows = _rows_mask(n, 0.25, gen)
            exps = torch.tensor([-120.0, -128.0, -135.0])[torch.randint(0, 3, (n,), generator=gen)]
            x[rows] *= torch.exp2(exps[rows])[:, None]
        elif d == "e2m1_midpoints" and kind == "q":
            x = _edge_blocks(x, gen, 0, E2M1_MIDPOINTS + E2M1_GRID, (6.0,))
        elif d == "pow2_boundary" and kind == "q":
            x = _edge_blocks(x, gen, 32, (0.5, 1.0, 2.0, 3.0, 4.0), POW2_EDGES)
    return x.reshape(shape)


def _edge_blocks(x: torch.Tensor, gen: torch.Generator, start: int, values, amax_values) -> torch.Tensor:
    """Replace the 32-element block at `start` of a third of the rows with values * 2**k
    (exact in bf16) and one element at an amax of `amax_values` * 2**k."""
    n = x.shape[0]
    rows = torch.nonzero(_rows_mask(n, 0.35, gen)).flatten()
    if rows.numel() == 0 or x.shape[1] < start + 32:
        return x
    m = rows.numel()
    vals = torch.tensor(values)[torch.randint(0, len(values), (m, 32), generator=gen)]
    sign = torch.where(torch.rand(m, 32, generator=gen) < 0.5, -1.0, 1.0)
    amax = torch.tensor(amax_values)[torch.randint(0, len(amax_values), (m,), generator=gen)]
    where = torch.randint(0, 32, (m,), generator=gen)
    vals[torch.arange(m), where] = amax
    scale = torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen).float())
    x[rows, start:start + 32] = vals * sign * scale
    return x


# Pooling scores past fp32 exp's range: each group of r positions of a sequence moves its
# scores by one offset, 0 for three groups in seven; a window reads two groups, so windows
# whose largest score is past ln(FLT_MAX) (88.72) and windows whose every score is below
# ln(2^-150) (-103.97) both occur. The softmax is the same at any offset.
SCORE_OFFSETS = (0.0, 0.0, 0.0, 96.0, 1000.0, -128.0, -1000.0)


def score_offsets(req: torch.Tensor, pos: torch.Tensor, r: int, gen: torch.Generator) -> torch.Tensor:
    """The score offset of each (request, position) row: one per group of r positions."""
    if pos.numel() == 0:
        return torch.zeros(0)
    shape = (int(req.max()) + 1, int(pos.max()) // r + 1)
    table = torch.tensor(SCORE_OFFSETS)[torch.randint(0, len(SCORE_OFFSETS), shape, generator=gen)]
    return table[req.long(), pos.long() // r]


# Narrow band: every key shares one NoPE vector (a positive direction, as a trained
# indexer's keys share a large common component) and carries a small RoPE part; queries
# point their NoPE dims along the same direction and head weights are positive. Scores then
# sit in a band about 1 % wide, away from zero, yet distinct well beyond the
# top-k tolerance (1e-4 of the row's largest score).
NARROW_ROPE_SCALE = 0.05


def narrow_band_base(d: int, gen: torch.Generator) -> torch.Tensor:
    return 2.0 + torch.rand(d, generator=gen) * 2.0


def narrow_keys(x: torch.Tensor, base: torch.Tensor, d: int) -> torch.Tensor:
    """x [N, k*D] (k D-wide halves): the NoPE dims of each half set to `base`, the RoPE
    dims scaled down."""
    nope = base.shape[0]
    halves = x.reshape(x.shape[0], -1, d).clone()
    halves[..., :nope] = base
    halves[..., nope:] *= NARROW_ROPE_SCALE
    return halves.reshape(x.shape)


def narrow_queries(q: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """q [T, H, D]: NoPE dims along `base` (unit RMS), RoPE dims kept."""
    q = q.clone()
    q[..., :base.shape[0]] = base / base.pow(2).mean().sqrt()
    return q


# --- value boundaries: plateaus of exact ties, every e8m0 code ----------------------------
#
# relu_zero, duplicate_keys, coarse and scale_codes build every key and query themselves, one
# D-vector per K entry: a pooled history writes that vector into every row of the entry's
# window (the `_b` halves of its own group, the `_a` halves of the group before), so the
# pooled row is that vector exactly, and direct history and the steps' K rows take it as
# the row. What each reaches, and how to measure it, is in the README ("Value boundaries").

GOLDEN = 0.6180339887498949
RELU_ROPE_SCALE = 2.0 ** -8     # relu_zero keys' RoPE dims against their NoPE dims
DUP_QUERY_NOPE = 4.0            # duplicate_keys queries: NoPE RMS against RoPE RMS
# scale_codes: the e8m0 codes each 32-block carries. Keys (the K writer's ceil rule, 1..253)
# and raw history (0..254) by block; each query token puts values in ONE block (its focus,
# (p + 1) % 4) at a code from that block's range, every other block zero, so that the block's
# contribution is the whole logit and every pair stays finite: key code + query code <= 365.
KEY_CODES = ((239, 253), (1, 112), (113, 238), None)          # block 3: the norm's anchor (126)
RAW_CODES = ((239, 254), (1, 112), (113, 238), (0, 0))
QUERY_CODES = ((1, 111), (112, 253), (1, 127), (130, 239))
KEY_NORM_WEIGHT = (2.0 ** 127, 1.0, 2.0 ** 115, 1.0)          # per block of the norm weight
SUBNORMAL_AMAX = 1.5 * 2.0 ** -127                             # a bf16 subnormal that encodes non-zero


@dataclass(frozen=True)
class ValueContext:
    """What every key and query of a structured dist shares (drawn once per case from its own
    generator, so that the other dists' draws do not move)."""
    dist: str
    share: float
    d: int
    nope: int
    ratio: int
    u: torch.Tensor                 # [nope] > 0: the common NoPE direction
    offset: float                   # the share mask's phase
    code_offset: tuple[int, ...]    # per block: where the code sweep starts


def value_context(case: Case, geo) -> Optional[ValueContext]:
    dist = [x for x in case.dist if x in STRUCTURED_DISTS]
    if not dist:
        return None
    d, nope = geo.head_dim, geo.head_dim - geo.rope_dim
    if dist[0] == "scale_codes" and (d != 4 * MX_BLOCK or nope != 2 * MX_BLOCK):
        raise CaseError(f"{case.file}: case {case.name!r}: dist scale_codes needs D = 128 with 64 RoPE dims "
                        f"(two NoPE and two RoPE blocks), got D = {d}, R = {geo.rope_dim}")
    g = torch.Generator().manual_seed((case.seed * 0x9E3779B1 + 0x5EED) % (1 << 63))
    return ValueContext(dist[0], case.tie_share, d, nope, geo.ratio,
                        1.0 + torch.rand(nope, generator=g), float(torch.rand(1, generator=g)),
                        tuple(int(x) for x in torch.randint(0, 1 << 16, (8,), generator=g)))


def share_mask(j: torch.Tensor, share: float, offset: float) -> torch.Tensor:
    """Entries j in the plateau: frac(j * golden + offset) < share, so every run of entries
    (each sequence's, each row's prefix) holds the share to within a few entries."""
    return torch.frac(j.double() * GOLDEN + offset) < share


def _sweep(idx: torch.Tensor, span, offset: int) -> torch.Tensor:
    """Codes lo..hi in turn: consecutive idx take consecutive codes, so any hi - lo + 1 of them
    take every code once."""
    lo, hi = span
    return lo + (idx + offset) % (hi - lo + 1)


ANCHOR_CODE = 126             # block 3 of scale_codes keys: +-2 after the norm, rotated to at most 2.83


def key_codes(ctx: ValueContext, j: torch.Tensor, *, raw: bool = False) -> torch.Tensor:
    """The e8m0 code of every block [n, D/32] of scale_codes entries j (int64): what the
    K writer writes (`raw`: what raw history stores); a coverage check reads them here
    without running a stage (tests/test_inputs_values.py holds the K writer to them)."""
    spans = RAW_CODES if raw else KEY_CODES
    return torch.stack([_sweep(j.long(), span, ctx.code_offset[b]) if span else torch.full_like(j.long(), ANCHOR_CODE)
                        for b, span in enumerate(spans)], -1)


def query_codes(ctx: ValueContext, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(focus block, e8m0 code of that block) of scale_codes query tokens at `positions`:
    every other block of the token is zero (its code 1, its nibbles 0)."""
    p = positions.long()
    focus = (p + 1) % 4
    code = torch.zeros_like(p)
    for b, span in enumerate(QUERY_CODES):
        at = focus == b
        code[at] = _sweep(p[at] // 4, span, ctx.code_offset[4 + b])
    return focus, code


def _block_at(n: int, amax: torch.Tensor, gen: torch.Generator, *, rotated: bool) -> torch.Tensor:
    """[n, 32] blocks whose largest |value| is amax (one element; `rotated`: the even element
    of a pair whose odd element is 0, so RoPE keeps the block's amax within [amax/sqrt 2, amax]),
    the rest within amax/4, bf16 values."""
    out = (torch.rand(n, MX_BLOCK, generator=gen) * 2 - 1) * (amax[:, None] / 4)
    at = torch.randint(0, MX_BLOCK // 2, (n,), generator=gen) * 2
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    rows = torch.arange(n)
    out[rows, at] = amax * sign
    if rotated:
        out[rows, at + 1] = 0.0
    return out.bfloat16().float()


def _code_amax(code: torch.Tensor, *, rotated: bool) -> torch.Tensor:
    """An amax inside the ceil rule's step for `code` (NUMERICS.md §4: (3, 6] * 2^(code - 127)):
    4.5 * 2^(code-127), or 5.8 * 2^(code-127) for a block RoPE may shrink by up to sqrt 2;
    code 253 at 1.75 * 2^127 (6 * 2^126 is past fp32)."""
    amax = torch.ldexp(torch.full(code.shape, 5.8 if rotated else 4.5, dtype=torch.float64), code.long() - 127)
    return torch.where(code >= 253, 1.75 * 2.0 ** 127, amax).float()


def _scale_code_keys(j: torch.Tensor, ctx: ValueContext, gen: torch.Generator) -> torch.Tensor:
    """[n, 128] pooled rows whose K-writer entries carry KEY_CODES: block 3 is all +-1 (the
    norm's anchor: rstd within 5 % of 2 whatever the other blocks hold), block b's amax is
    the code's amax / (2 * norm weight); code-1 blocks have a bf16 subnormal amax (which
    still encodes non-zero: 1.5 * 2^-127 is e2m1 1.5 at scale 2^-126)."""
    n = j.numel()
    blocks = []
    codes = key_codes(ctx, j)
    for b, span in enumerate(KEY_CODES):
        if span is None:
            blocks.append(torch.where(torch.rand(n, MX_BLOCK, generator=gen) < 0.5, -1.0, 1.0))
            continue
        code = codes[:, b]
        rotated = b * MX_BLOCK >= ctx.nope
        amax = (_code_amax(code, rotated=rotated).double() / (2.0 * KEY_NORM_WEIGHT[b])).float()
        amax = torch.where(code == 1, SUBNORMAL_AMAX, amax)      # bf16 subnormal inputs
        blocks.append(_block_at(n, amax, gen, rotated=rotated))
    return torch.cat(blocks, -1)


def key_norm_weight(ctx: Optional[ValueContext], weight: torch.Tensor) -> torch.Tensor:
    """The K norm weight a structured dist needs (bf16 [D]): scale_codes one power of two per
    block (KEY_NORM_WEIGHT), coarse all ones (the grid survives the norm), relu_zero and
    duplicate_keys |w| (the sign of a key's NoPE part is the norm's output's)."""
    if ctx is None:
        return weight
    if ctx.dist == "scale_codes":
        return torch.tensor(KEY_NORM_WEIGHT).repeat_interleave(MX_BLOCK).to(torch.bfloat16)
    if ctx.dist == "coarse":
        return torch.ones_like(weight)
    return weight.abs()


def _coarse_rows(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """[n, d] rows of {0, +-1, +-2}: in every 32-block 8 zeros, 16 ones and 8 twos, in a random
    order and random signs, so every row has the same sum of squares (one rstd for all keys)."""
    base = torch.tensor([0.0] * 8 + [1.0] * 16 + [2.0] * 8)
    perm = torch.argsort(torch.rand(n * d // MX_BLOCK, MX_BLOCK, generator=gen), -1)
    vals = base[perm].view(n, d)
    return vals * torch.where(torch.rand(n, d, generator=gen) < 0.5, -1.0, 1.0)


def entry_keys(req: torch.Tensor, j: torch.Tensor, ctx: ValueContext, gen: torch.Generator) -> torch.Tensor:
    """One pooled row [n, D] (fp32 holding bf16) per (sequence, entry j): rows of the same
    entry are equal."""
    key = req.long() * (1 << 40) + j.long()
    uniq, inv = torch.unique(key, return_inverse=True)
    ju = uniq % (1 << 40)
    n, d, nope = uniq.numel(), ctx.d, ctx.nope
    if ctx.dist == "relu_zero":
        sign = torch.where(share_mask(ju, ctx.share, ctx.offset), -1.0, 1.0)
        mag = 0.5 + torch.rand(n, generator=gen)
        out = torch.cat((ctx.u * (sign * mag)[:, None],
                         torch.randn(n, d - nope, generator=gen) * RELU_ROPE_SCALE), -1)
    elif ctx.dist == "duplicate_keys":
        out = torch.randn(n, d, generator=gen)
        dup = share_mask(ju, ctx.share, ctx.offset)
        out[dup] = torch.cat((ctx.u, torch.zeros(d - nope)))
    elif ctx.dist == "coarse":
        out = _coarse_rows(n, d, gen)
    else:
        out = _scale_code_keys(ju, ctx, gen)
    return out.bfloat16().float()[inv]


def entry_queries(q: torch.Tensor, positions: torch.Tensor, ctx: ValueContext,
                  gen: torch.Generator) -> torch.Tensor:
    """Queries [T, H, D] for the structured dist (`q`: the normal draw, for its shape; the case's
    scale is not applied). relu_zero: every head's NoPE part along +u, RoPE dims N(0, 1); duplicate_keys: NoPE
    along u at DUP_QUERY_NOPE times the RoPE RMS; coarse: one {0, +-1, +-2} NoPE vector per token
    times a power of two per head, RoPE dims 0; scale_codes: values only in the token's focus
    block, at a code of QUERY_CODES, heads in pairs +v, -v (relu keeps one of each pair)."""
    t, h, d = q.shape
    nope = ctx.nope
    if ctx.dist in ("relu_zero", "duplicate_keys"):
        mag = 0.5 + torch.rand(t, h, 1, generator=gen)
        unit = ctx.u / ctx.u.pow(2).mean().sqrt()
        nope_part = unit * mag * (DUP_QUERY_NOPE if ctx.dist == "duplicate_keys" else 1.0)
        return torch.cat((nope_part, torch.randn(t, h, d - nope, generator=gen)), -1)
    if ctx.dist == "coarse":
        base = _coarse_rows(t, nope, gen)
        e = torch.randint(-2, 3, (t, h, 1), generator=gen).float()
        return torch.cat((base[:, None, :] * torch.exp2(e), torch.zeros(t, h, d - nope)), -1)
    out = torch.zeros(t, h, d)
    focus, codes = query_codes(ctx, positions)
    for b in range(len(QUERY_CODES)):
        rows = (focus == b).nonzero().flatten()
        if rows.numel() == 0:
            continue
        code = codes[rows]
        rotated = b * MX_BLOCK >= nope
        amax = torch.where(code == 253, 1.75 * 2.0 ** 127, torch.ldexp(
            torch.full(code.shape, 5.8 if rotated else 6.0, dtype=torch.float64), code.long() - 127).float())
        amax = torch.where((code == 1) & (b == 0), SUBNORMAL_AMAX, amax)     # bf16 subnormal inputs
        pairs = -(-h // 2)
        v = _block_at(rows.numel() * pairs, amax.repeat_interleave(pairs), gen, rotated=rotated)
        v = v.view(rows.numel(), pairs, 1, MX_BLOCK).expand(-1, -1, 2, -1).reshape(rows.numel(), 2 * pairs, -1)
        sign = torch.tensor([1.0, -1.0]).repeat(pairs)[:h, None]
        out[rows, :, b * MX_BLOCK:(b + 1) * MX_BLOCK] = v[:, :h] * sign
    return out


def raw_entries(j: torch.Tensor, ctx: ValueContext, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw MXFP4 entries for history = "raw": (packed u8 [n, D/2], scales u8 [n, D/32]); any
    nibble (-0 = 0x8 included), the scale codes of RAW_CODES swept by entry, one element of
    every block at 6.0 (nibble 0x7 or 0xF, so code 254 is 6 * 2^127, past fp32)."""
    n, d = j.numel(), ctx.d
    codes = key_codes(ctx, j, raw=True)
    nib = torch.randint(0, 16, (n, d), generator=gen, dtype=torch.uint8)
    at = torch.arange(d // MX_BLOCK) * MX_BLOCK + torch.randint(0, MX_BLOCK, (n, d // MX_BLOCK), generator=gen)
    nib[torch.arange(n)[:, None], at] = torch.where(torch.rand(n, d // MX_BLOCK, generator=gen) < 0.5, 7, 15).to(torch.uint8)
    return pack_nibbles(nib), codes.to(torch.uint8)


def structured_values(x: torch.Tensor, ctx: ValueContext, gen: torch.Generator, *, kind: str,
                      req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`shape_values`' first step for a structured dist: x [N, 2D] state rows ("kv": the `_b`
    half holds the row's own entry, the `_a` half the next entry, so that every window is one
    vector), [N, D] K rows ("k": entry p // r) or [T, H, D] queries ("q")."""
    r = ctx.ratio
    j = pos.long() // r
    if kind == "kv":        # one draw for both halves: an entry's rows are equal in every window
        both = entry_keys(torch.cat((req, req)), torch.cat((j + 1, j)), ctx, gen)
        return torch.cat(both.chunk(2), -1)
    if kind == "k":
        return entry_keys(req, j, ctx, gen)
    return entry_queries(x, pos, ctx, gen)


# --- building the case ---------------------------------------------------------------

def _tokens(case: Case, geo: Geometry, ranges: dict[int, tuple[int, int]],
            k_bt: torch.Tensor, *, keep_empty: bool = True, no_write: Optional[list[int]] = None,
            skip: int = 0) -> Tokens:
    """The batch of `ranges` (sequence -> [start, end) positions). A sequence with no tokens
    stays in the batch (its rows are empty: query_start_loc repeats) unless `keep_empty` is
    off; `no_write[b]`: sequence b's entries below it get no slot (pages it reads, shared);
    `skip`: the first `skip` tokens at a pooling boundary get slot -1 (a padded token)."""
    r, ps = geo.ratio, geo.page_size
    pos, req, seqs, qsl, ctx = [], [], [], [0], []
    for b, (s, e) in sorted(ranges.items()):
        if e < s or (e == s and not keep_empty):
            continue
        pos.append(torch.arange(s, e))
        req.append(torch.full((e - s,), b))
        seqs.append(b)
        qsl.append(qsl[-1] + e - s)
        ctx.append(e // r)
    positions = torch.cat(pos).long() if pos else torch.zeros(0, dtype=torch.long)
    req_index = torch.cat(req).long() if req else torch.zeros(0, dtype=torch.long)
    j = positions // r
    page = (j // ps).clamp(max=k_bt.shape[1] - 1)     # tokens past the last entry write nothing
    slot = k_bt[req_index, page].long() * ps + j % ps
    write = (positions + 1) % r == 0
    if no_write is not None:
        write &= j >= torch.tensor(no_write, dtype=torch.long)[req_index] * ps
    if skip:
        write[write.nonzero().flatten()[:skip]] = False
    slot = torch.where(write, slot, torch.full_like(slot, -1))
    return Tokens(positions, req_index, slot, seqs, torch.tensor(qsl, dtype=torch.int32),
                  torch.tensor(ctx, dtype=torch.int32), k_bt[seqs].clone(),
                  ((positions + 1) // r).to(torch.int32))


def _pages(case: Case, needs: list[int], gen: torch.Generator, shared: list[int]) -> tuple[int, torch.Tensor]:
    """The pool's page count and the block table [B, width] in the case's page order
    (cases.PAGE_ORDERS); `shared[b]`: sequence b's first pages are sequence 0's."""
    total = sum(needs)
    pool = pool_pages(case, needs)
    if pool < total:
        raise CaseError(f"{case.file}: case {case.name!r}: pool_pages {pool} < the {total} pages needed")
    if case.page_order in ("permuted", "shared"):
        phys = torch.randperm(pool, generator=gen)[:total]
    elif case.page_order == "top":
        phys = torch.arange(pool - total, pool)
    elif case.page_order == "reversed":
        phys = torch.arange(pool - 1, pool - 1 - total, -1)
    else:
        phys = torch.arange(total)
    table = torch.zeros(len(needs), max(max(needs), case.table_pages or 0), dtype=torch.int32)
    at = 0
    for b, n in enumerate(needs):
        table[b, :n] = phys[at:at + n].to(torch.int32)
        table[b, :shared[b]] = table[0, :shared[b]]      # its own pages there stay unread
        at += n
    return pool, table


def _state(case: Case, geo, gen: torch.Generator):
    """The state cache and its block table, the narrow band (or None), and what was planted in it.

    Every position of every sequence goes in through permuted state blocks. With direct history
    only the blocks the steps' pooling windows reach are materialized; the blocks before them all
    map to the one spare block (never read)."""
    r, d = geo.ratio, geo.head_dim
    seqs = case.seqs
    sb = case.state_block
    direct = case.history in ("direct", "raw")
    blocks = [-(-s.len // sb) for s in seqs]
    skip = [max(0, s.steps()[0][0] - 2 * r) // sb if direct else 0 for s in seqs]
    n_blocks = sum(blocks) - sum(skip) + 1
    perm = torch.randperm(n_blocks, generator=gen)
    state_bt = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        state_bt[b, :skip[b]] = int(perm[-1])
        state_bt[b, skip[b]:n] = perm[at:at + n - skip[b]].to(torch.int32)
        at += n - skip[b]
    state = torch.randn(n_blocks, sb, 4 * d, generator=gen) * _GARBAGE
    lo = [k * sb for k in skip]
    all_pos = torch.cat([torch.arange(lo[b], s.len) for b, s in enumerate(seqs)])
    all_req = torch.cat([torch.full((s.len - lo[b],), b) for b, s in enumerate(seqs)])
    kv = shape_values(torch.randn(len(all_pos), 2 * d, generator=gen) * case.scale, case.dist,
                      gen, kind="kv", group=r, ctx=value_context(case, geo), req=all_req, pos=all_pos)
    band = narrow_band_base(d - geo.rope_dim, gen) if "narrow_band" in case.dist else None
    if band is not None:
        kv = narrow_keys(kv, band, d)
    score = torch.randn(len(all_pos), 2 * d, generator=gen) * 2.0
    if "score_extremes" in case.dist:
        score += score_offsets(all_req, all_pos, r, gen)[:, None]
    ape = torch.randn(r, 2 * d, generator=gen) * 0.5
    planted: list[str] = []

    def boundary_rows(n: int) -> list[tuple[int, int]]:
        """(row in all_pos order, position) of the first n boundary tokens of the first step."""
        out = []
        for b, s in enumerate(seqs):
            s0, e0 = s.steps()[0]
            for p in range(s0, e0):
                if (p + 1) % r == 0 and len(out) < n:
                    out.append((sum(x.len - lo[i] for i, x in enumerate(seqs[:b])) + p - lo[b], p))
        return out

    for pl in case.plant:
        if pl.tensor in ("state_kv", "state_score"):
            rows = boundary_rows(pl.count if pl.row else 1)
            if len(rows) < (pl.count if pl.row else 1):
                raise CaseError(f"{case.file}: case {case.name!r}: plant: {pl.count if pl.row else 1} boundary "
                                f"token(s) of the first step needed to plant {pl.tensor} in, found {len(rows)}")
            target = kv if pl.tensor == "state_kv" else score
            # the token's own `_b` half: `count` channels of it, or all of it in each of `count` rows
            chans = d + (torch.arange(d) if pl.row else torch.randperm(d, generator=gen)[:pl.count])
            for row, p in rows:
                target[row, chans] = PLANT_VALUES[pl.value]
            where = (f"rows at pos {[p for _, p in rows]}, ch {d}..{2 * d - 1}" if pl.row
                     else f"pos {rows[0][1]}, ch {chans.tolist()}")
            planted.append(f"{pl.tensor}[{where}] = {pl.value}")
    rows = state_rows(kv, score, ape, all_pos)
    return write_state(state, state_bt, all_req, all_pos, rows), state_bt, band, planted


def _k_pool(case: Case, geo, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The K cache pool (random bytes; filled on `device` when over _CPU_POOL_LIMIT) and its block table."""
    n_pages, k_bt = _pages(case, page_needs(case, geo.ratio, geo.page_size), gen,
                           shared_pages(case, geo.ratio, geo.page_size))
    pool_bytes = n_pages * geo.page_stride
    if pool_bytes > _CPU_POOL_LIMIT:
        dgen = torch.Generator(device=device).manual_seed(case.seed)
        kv_cache = torch.randint(0, 256, (n_pages, geo.page_stride), generator=dgen,
                                 dtype=torch.uint8, device=device)
    else:
        kv_cache = torch.randint(0, 256, (n_pages, geo.page_stride), generator=gen, dtype=torch.uint8)
    return kv_cache, k_bt


def _step(case: Case, geo, rng, k_bt, gen: torch.Generator, band, planted: list[str] | None):
    """One step's tokens with q, weights and K; `planted` (first step only) takes the q/weights plants."""
    h, d = geo.heads, geo.head_dim
    t = _tokens(case, geo, rng, k_bt, skip=case.skip_writes)
    ctx = value_context(case, geo)
    q = shape_values(torch.randn(t.n, h, d, generator=gen) * case.scale, case.dist, gen, kind="q",
                     ctx=ctx, req=t.req_index, pos=t.positions)
    t.weights = torch.randn(t.n, h, generator=gen)
    t.k = shape_values(torch.randn(t.n, d, generator=gen) * case.scale, case.dist, gen,
                       kind="k", ctx=ctx, req=t.req_index, pos=t.positions)
    if ctx is not None and ctx.dist in ("relu_zero", "duplicate_keys"):
        t.weights = t.weights.abs()         # positive heads: a positive key scores > 0, the plateau on top
    if band is not None:
        q, t.weights, t.k = narrow_queries(q, band), t.weights.abs(), narrow_keys(t.k, band, d)
    t.k = t.k.to(torch.bfloat16)
    if planted is not None:
        for pl in case.plant:
            v = PLANT_VALUES[pl.value]
            if pl.tensor in ("q", "weights") and pl.row:
                _enough(case, pl, t.n, "token(s) in the first step")
                (q if pl.tensor == "q" else t.weights)[:pl.count] = v
                planted.append(f"{pl.tensor}[rows: tokens 0..{pl.count - 1}, all] = {pl.value}")
            elif pl.tensor == "q":
                _enough(case, pl, t.n, "token(s) in the first step", 1)
                idx = torch.randperm(h * d, generator=gen)[:pl.count]
                q[0].view(-1)[idx] = v
                planted.append(f"q[token 0, flat {idx.tolist()}] = {pl.value}")
            elif pl.tensor == "weights":
                _enough(case, pl, t.n, "token(s) in the first step", 1)
                idx = torch.randperm(h, generator=gen)[:pl.count]
                t.weights[0, idx] = v
                planted.append(f"weights[token 0, heads {idx.tolist()}] = {pl.value}")
            elif pl.tensor == "k":             # the K writer's input rows it writes (pooling not run)
                rows = torch.nonzero(((t.positions + 1) % geo.ratio == 0) & (t.slot_mapping >= 0)).flatten()
                _enough(case, pl, rows.numel(), "written K row(s) in the first step", None if pl.row else 1)
                if pl.row:
                    t.k[rows[:pl.count]] = v
                    planted.append(f"k[rows: tokens {rows[:pl.count].tolist()}, all] = {pl.value}")
                else:
                    idx = torch.randperm(d, generator=gen)[:pl.count]
                    t.k[rows[0], idx] = v
                    planted.append(f"k[token {int(rows[0])}, dims {idx.tolist()}] = {pl.value}")
    t.q = q.to(torch.bfloat16)
    t.weights = t.weights.to(torch.bfloat16 if case.weights_dtype == "bfloat16" else torch.float32)
    return t


def _enough(case: Case, pl, have: int, what: str, need: Optional[int] = None) -> None:
    need = pl.count if need is None else need
    if have < need:
        raise CaseError(f"{case.file}: case {case.name!r}: plant {pl.tensor}: {need} {what} needed, found {have}")


def _late_plants(case: Case, geo: Geometry, steps: list[Tokens], k_bt: torch.Tensor, gen: torch.Generator,
                 planted: list[str]) -> list[LatePlant]:
    """The sites of the plants put in after the history (LatePlant), each where the first step
    reads it: the norm weight; the RoPE rows of the first step's first written entry and first
    token (the K writer and the Q quant read them); a history entry's scale bytes that the first
    step's rows score; the first rows of top-k's input with a valid column."""
    out: list[LatePlant] = []
    st, r, d = steps[0], geo.ratio, geo.head_dim
    for pl in case.plant:
        v = PLANT_VALUES[pl.value]
        if pl.tensor == "norm_weight":
            idx = torch.arange(d) if pl.row else torch.randperm(d, generator=gen)[:pl.count]
            out.append(LatePlant("norm_weight", (idx,), v))
            planted.append(f"norm_weight[{'rows: all' if pl.row else f'dims {idx.tolist()}'}] = {pl.value}")
        elif pl.tensor == "cos_sin_cache":
            _enough(case, pl, st.n, "token(s) in the first step", pl.count if pl.row else 1)
            w = torch.nonzero(((st.positions + 1) % r == 0) & (st.slot_mapping >= 0)).flatten()
            rows = st.positions[:pl.count if pl.row else 1].tolist()
            rows = sorted({*rows, *([int(st.positions[w[0]]) // r * r] if w.numel() else [])})
            rdim = geo.rope_dim
            cols = torch.arange(rdim) if pl.row else torch.randperm(rdim, generator=gen)[:pl.count]
            ri = torch.tensor(rows).repeat_interleave(cols.numel())
            out.append(LatePlant("cos_sin_cache", (ri, cols.repeat(len(rows))), v))
            planted.append(f"cos_sin_cache[{'rows' if pl.row else 'positions'} {rows}, "
                           f"cols {'all' if pl.row else cols.tolist()}] = {pl.value}")
        elif pl.tensor == "kv_scale":
            out.append(_kv_scale_plant(case, geo, st, k_bt, gen, pl, planted))
        elif pl.tensor == "logits":
            ends = st.row_ends.long()
            live = torch.nonzero(ends > 0).flatten()
            _enough(case, pl, live.numel(), "row(s) with a valid column in the first step", pl.count if pl.row else 1)
            if pl.row:
                rows = live[:pl.count]
                mask = torch.arange(int(ends[rows].max()))[None, :] < ends[rows, None]
                ri, ci = mask.nonzero(as_tuple=True)
                out.append(LatePlant("logits", (rows[ri], ci), v))
                planted.append(f"logits[step 0, rows {rows.tolist()}, all valid columns] = {pl.value}")
            else:
                row = int(live[0])
                _enough(case, pl, int(ends[row]), f"valid column(s) in row {row}")
                cols = torch.randperm(int(ends[row]), generator=gen)[:pl.count]
                out.append(LatePlant("logits", (torch.full_like(cols, row), cols), v))
                planted.append(f"logits[step 0, row {row}, cols {cols.tolist()}] = {pl.value}")
    return out


def _kv_scale_plant(case: Case, geo: Geometry, st: Tokens, k_bt: torch.Tensor, gen: torch.Generator,
                    pl, planted: list[str]) -> LatePlant:
    """Scale bytes of the first history entries of the first sequence of the first step that
    has rows and history: `count` of one entry's e8m0 scale bytes set to 255 (NaN), or with
    `row` every scale byte of its first `count` entries; an FP8 pool's fp32 scale of the
    first `count` entries set to the value."""
    r, ps, d, stride = geo.ratio, geo.page_size, geo.head_dim, geo.page_stride
    qsl = st.query_start_loc.tolist()
    n = pl.count if (pl.row or geo.fmt == "fp8") else 1
    cand = [b for i, b in enumerate(st.seqs) if qsl[i + 1] > qsl[i] and case.seqs[b].history // r >= n]
    if not cand:
        raise CaseError(f"{case.file}: case {case.name!r}: plant kv_scale: no sequence of the first step has "
                        f"{n} history entr{'y' if n == 1 else 'ies'} (written before the step, then read by it)")
    b = cand[0]
    j = torch.arange(n)
    slot = k_bt[b, j // ps].long() * ps + j % ps
    page, t = slot // ps, slot % ps
    if geo.fmt == "mxfp4":
        nb = d // 32
        _enough(case, pl, nb, "scale block(s) in an entry", 1 if pl.row else pl.count)
        blocks = torch.arange(nb) if pl.row else torch.randperm(nb, generator=gen)[:pl.count]
        offs = layout.scale_offsets(t, ps, d, layout.as_shuffle(geo.shuffle))[:, blocks]
        offs = (page * stride)[:, None] + offs
        value = torch.full((offs.numel(),), E8M0_NAN, dtype=torch.uint8)
        shown = "255"
    else:
        offs = (page * stride + ps * d + 4 * t)[:, None] + torch.arange(4)
        value = torch.tensor([PLANT_VALUES[pl.value]], dtype=torch.float32).view(torch.uint8).repeat(n)
        shown = pl.value
    planted.append(f"kv_scale[seq {b}, entries {j.tolist()}, pool bytes {offs.flatten().tolist()[:16]}] = {shown}")
    return LatePlant("kv_scale", (offs.flatten(),), value)


def build(case: Case, device: str | torch.device = "cpu") -> CaseInputs:
    """All inputs of `case`; tensors on `device`."""
    geo = geometry(case)
    gen = torch.Generator().manual_seed(case.seed)
    d = geo.head_dim
    seqs = case.seqs
    state, state_bt, band, planted = _state(case, geo, gen)
    # exactly as many rows as the longest sequence has positions: its last token is rotated by
    # the table's last row (coverage boundary rope.pos.table-end), as at a model's longest context
    cs = cos_sin_cache(max(s.len for s in seqs), geo.rope_dim, geo.preset.rope_base,
                       yarn_factor=geo.preset.yarn_factor,
                       yarn_original_max_pos=geo.preset.yarn_original_max_pos)
    norm_weight = (1.0 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    ctx = value_context(case, geo)
    norm_weight = key_norm_weight(ctx, norm_weight)
    kv_cache, k_bt = _k_pool(case, geo, gen, device)

    hist = {b: (0, s.history) for b, s in enumerate(seqs)}
    history = (_tokens(case, geo, hist, k_bt, keep_empty=False, no_write=shared_pages(case, geo.ratio, geo.page_size))
               if any(e > 0 for _, e in hist.values()) else None)
    if history is not None and case.history == "direct":
        # history entries straight from random K rows: pooling runs on the steps only
        hk = shape_values(torch.randn(history.n, d, generator=gen) * case.scale, case.dist, gen, kind="k",
                          ctx=ctx, req=history.req_index, pos=history.positions)
        history.k = (narrow_keys(hk, band, d) if band is not None else hk).to(torch.bfloat16)
    if history is not None and case.history == "raw":
        # history entries as raw MXFP4 bytes, written here: the runner finds them in the pool
        kv_cache = write_raw_history(kv_cache, history, geo, ctx, gen)
        history = None
    steps = [_step(case, geo, {b: s.steps()[i] for b, s in enumerate(seqs) if i < len(s.steps())},
                   k_bt, gen, band, planted if i == 0 else None)
             for i in range(max(len(s.steps()) for s in seqs))]
    late = _late_plants(case, geo, steps, k_bt, gen, planted)
    facts = [{"tensor": p.tensor, "value": p.value, "row": p.row, "count": p.count} for p in case.plant]
    out = CaseInputs(case, geo, state, state_bt, cs, norm_weight, kv_cache, k_bt, history, steps, planted,
                     facts, late)
    return out.to(device)


def write_raw_history(kv_cache: torch.Tensor, history: Tokens, geo, ctx: ValueContext,
                      gen: torch.Generator) -> torch.Tensor:
    """The pool with the history's entries (its boundary tokens) stored as `raw_entries`, in the
    case's layout (reference/layout.py)."""
    from reference.layout import write_entries
    sel = history.slot_mapping >= 0
    j = history.positions[sel] // geo.ratio
    packed, scales = raw_entries(j, ctx, gen)
    dev = kv_cache.device
    return write_entries(kv_cache, history.slot_mapping[sel].to(dev), packed.to(dev), scales.to(dev),
                         page_size=geo.page_size, shuffle=geo.shuffle)


def filled_on_device(case: Case) -> bool:
    """Whether `build` fills the case's K pool on the device (a pool over _CPU_POOL_LIMIT):
    its bytes then depend on the device, and only `build(case, device)` gives them."""
    geo = geometry(case)
    return pool_pages(case, page_needs(case, geo.ratio, geo.page_size)) * geo.page_stride > _CPU_POOL_LIMIT
