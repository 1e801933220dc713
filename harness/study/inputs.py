"""Generated indexer inputs for `mxval study`: named distributions, nested contexts, needles.

Everything random is fixed per (distribution, seed) and drawn on the CPU from its own
stream (so the numbers do not depend on the device, and adding a field to one
distribution does not reshuffle another): the outlier channels, the key subspace, the norm
weight, the head-weight projection, the queries, and the keys and values of the longest
context in chunks of CHUNK entries. A shorter context is the prefix of a longer one. Each
query row sits at its own position in the context (`Draw.queries`: the rows spread over its
newer part), so only the queries' RoPE positions (and, in a drifting or local distribution,
their position terms) change with the context.

Streams are keyed by seed and purpose, not by distribution: distributions that draw the
same shapes share their noise (common random numbers), so differences between them are
the distributions', not the draws'.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, fields

import torch

from reference.formats import ModelPreset, preset
from reference.k_writer import group_start, k_values
from reference.q_quant import q_values
from reference.rope import cos_sin_at, cos_sin_cache, rope_gptj_tail

CHUNK = 1024            # entries per key/value stream chunk: the prefix property needs it
WEIGHT_RANK = 16        # width of the hidden state the head weights are projected from


def stream(seed: int, purpose: str, part: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{purpose}/{part}".encode()))


@dataclass
class Distribution:
    """How pooled keys (before the norm) and raw queries are drawn; cases/study.toml names them."""
    name: str = "normal"
    outlier_channels: int = 0
    outlier_scale: float = 1.0        # magnitude of the outlier channels relative to the rest
    outliers_on: str = "k"            # "k": keys only; "qk": the same channels in q and k
    tails: str = "normal"             # "normal" or "student-t" (per element: survives the norm)
    tail_df: int = 3
    head_scale_spread: float = 0.0    # per-head query scale ~ 2**U(-s, s)
    correlation: float = 0.0          # share of a rank-`rank` common component in keys
    rank: int = 8
    query_key_affinity: float = 0.3   # share of queries drawn from the key subspace
    head_weights: str = "signed"      # "signed": a projection of a hidden state; "abs": |N(0,1)|
    drift: float = 0.0                # per-element RMS of a key mean that turns with position
    drift_period: int = 65536         # entries per turn of the drift
    drift_query: float = 0.0          # the query's share of the drift at its own position
    sinks: int = 0                    # first entries: massive-activation keys
    sink_channels: int = 2            # NoPE channels the sinks' massive activations sit in
    sink_scale: float = 0.0           # their magnitude before the norm (the rest is ~1)
    sink_query: float = 0.0           # query component along the sink channels
    locality: float = 0.0             # per-element RMS of a key component shared by every key in the
                                      # RoPE dims: after RoPE, a query holding it scores recent keys up
    locality_query: float = 0.0       # the query's share of that component (heads weighed up hold more)
    weight_coupling: float = 0.0      # head h's query scaled by 2**(c * w_h / sd(w)): the heads the
                                      # indexer weighs up are the ones whose scores spread most

    def __post_init__(self):
        for name, value, ok in (("outliers_on", self.outliers_on, ("k", "qk")),
                                ("tails", self.tails, ("normal", "student-t")),
                                ("head_weights", self.head_weights, ("signed", "abs"))):
            if value not in ok:
                raise ValueError(f"distribution {self.name!r}: {name} = {value!r} (expected one of {', '.join(ok)})")
        if self.tails == "student-t" and (int(self.tail_df) != self.tail_df or self.tail_df < 1):
            raise ValueError(f"distribution {self.name!r}: tail_df must be a positive integer")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"distribution {self.name!r}: {f.name} = {v} is negative")

    def sample(self, shape, gen: torch.Generator) -> torch.Tensor:
        """Unit-variance noise; Student-t divides every element by its own chi, so the row's
        RMS norm cannot cancel the tails (a per-row divisor would)."""
        z = torch.randn(shape, generator=gen)
        if self.tails == "student-t":
            df = int(self.tail_df)
            chi2 = torch.randn(*shape, df, generator=gen).square().mean(-1)
            z = z / chi2.sqrt().clamp_min(1e-3)
            if df > 2:
                z = z * math.sqrt((df - 2) / df)
        return z


@dataclass
class Draw:
    """One (distribution, seed): the longest context's keys and values and the queries."""
    dist: Distribution
    seed: int
    preset: ModelPreset
    k: torch.Tensor          # [Jmax, D] keys after norm and RoPE (fp32 holding bf16)
    v: torch.Tensor          # [Jmax, Dv] generated values (bf16-valued)
    w: torch.Tensor          # [R, H] raw head weights (bf16-valued), before weights_scale
    q_base: torch.Tensor     # [R, H, D] the raw queries' position-independent part
    q_drift: torch.Tensor    # [R, H] each head's share of the drift at its position
    chan: torch.Tensor       # [D] channel scale (outliers)
    basis: torch.Tensor      # [rank, D] orthonormal key subspace
    norm_w: torch.Tensor     # [D] RMSNorm weight (bf16-valued)
    cs: torch.Tensor         # cos/sin cache covering the longest context
    outlier_idx: list
    sink_idx: list
    local_dir: torch.Tensor = None   # [D] the shared RoPE-dims component of locality (0 elsewhere)
    q_local: torch.Tensor = None     # [R, H] each head's share of it

    @property
    def entries(self) -> int:
        return self.k.shape[0]

    def to(self, device) -> "Draw":
        moved = {f.name: getattr(self, f.name).to(device) if torch.is_tensor(getattr(self, f.name))
                 else getattr(self, f.name) for f in fields(self)}
        return Draw(**moved)

    def query_position(self, entries):
        """A query at position p sees (p + 1) // r entries: the last token that sees `entries`."""
        return entries * self.preset.compress_ratio - 1

    def queries(self, entries) -> torch.Tensor:
        """q [R, H, D] after RoPE (fp32 holding bf16 values), row r at the last token that sees
        `entries` entries (an int: every row; a tensor [R]: one count per row)."""
        raw = self.q_base
        rows = raw.shape[0]
        seen = torch.as_tensor(entries, device=raw.device).long().expand(rows)
        if self.dist.drift_query:
            mu = drift_direction(self, seen - 1)                                        # [R, D]
            raw = raw + self.q_drift[..., None] * mu[:, None, :]
        if self.dist.locality_query:
            raw = raw + self.q_local[..., None] * self.local_dir
        return q_values(raw.to(torch.bfloat16), self.query_position(seen), self.cs)

    def pooled(self, entry_idx: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Pooled rows (bf16) at entries `entry_idx` from unit noise [..., D]: drift, channels."""
        x = noise
        if self.dist.drift:
            x = x + self.dist.drift * drift_direction(self, entry_idx)
        if self.dist.locality:
            x = x + self.dist.locality * self.local_dir
        return (x * self.chan).to(torch.bfloat16)

    def keys_at(self, pooled: torch.Tensor, entry_idx: torch.Tensor) -> torch.Tensor:
        """The K writer's values for pooled rows [..., D] at entries `entry_idx` [...]."""
        r = self.preset.compress_ratio
        shape = pooled.shape
        pos = group_start(entry_idx.reshape(-1) * r + r - 1, r)
        out = k_values(pooled.reshape(-1, shape[-1]), pos, self.cs, self.norm_w, self.preset.rms_eps)
        return out.reshape(shape)


def drift_direction(d: Draw, entry_idx: torch.Tensor) -> torch.Tensor:
    """[..., D]: a unit-RMS direction turning in the first two basis vectors with position."""
    theta = 2 * math.pi * entry_idx.double() / d.dist.drift_period
    b0, b1 = d.basis[0].double(), d.basis[1 % d.basis.shape[0]].double()
    dim = d.basis.shape[1]
    return ((theta.cos()[..., None] * b0 + theta.sin()[..., None] * b1) * math.sqrt(dim)).float()


def _noise(dist: Distribution, basis: torch.Tensor, n: int, dim: int, gen) -> torch.Tensor:
    z = dist.sample((n, dim), gen)
    if dist.correlation:
        common = torch.randn(n, basis.shape[0], generator=gen) @ basis * math.sqrt(dim / basis.shape[0])
        z = math.sqrt(1 - dist.correlation) * z + math.sqrt(dist.correlation) * common
    return z


def draw(dist: Distribution, seed: int, *, entries: int, rows: int, heads: int,
         model: str = "deepseek-v4-pro", value_dim: int = 128, device="cpu") -> Draw:
    """The random numbers come from CPU streams; the K writer's norm and RoPE run on `device`."""
    p = preset(model)
    dim, rope = p.head_dim, p.rope_dim
    if dist.rank < 2 and dist.drift:
        raise ValueError(f"distribution {dist.name!r}: drift needs rank >= 2")
    if dist.outlier_channels > dim or dist.sink_channels > dim - rope:
        raise ValueError(f"distribution {dist.name!r}: more outlier or sink channels than dims")
    chan = torch.ones(dim)
    outlier_idx = torch.randperm(dim, generator=stream(seed, "outliers"))[:dist.outlier_channels]
    chan[outlier_idx] = dist.outlier_scale
    basis = torch.linalg.qr(torch.randn(dim, max(dist.rank, 1), generator=stream(seed, "basis")))[0].T.contiguous()
    norm_w = (1 + 0.1 * torch.randn(dim, generator=stream(seed, "norm"))).to(torch.bfloat16).float()
    sink_idx = torch.randperm(dim - rope, generator=stream(seed, "sinks"))[:dist.sink_channels] if dist.sinks else \
        torch.zeros(0, dtype=torch.long)
    cs = cos_sin_cache(entries * p.compress_ratio + 1, rope, p.rope_base, yarn_factor=p.yarn_factor,
                       yarn_original_max_pos=p.yarn_original_max_pos)

    noise, values = [], []
    for c, start in enumerate(range(0, entries, CHUNK)):
        n = min(CHUNK, entries - start)
        noise.append(_noise(dist, basis, n, dim, stream(seed, "keys", c)))
        values.append(torch.randn(n, value_dim, generator=stream(seed, "values", c)).to(torch.bfloat16))
    z = torch.cat(noise)
    if dist.sinks:
        z[:dist.sinks, sink_idx] += dist.sink_scale

    gw = stream(seed, "weights")
    if dist.head_weights == "signed":
        # DeepSeek: weights = weights_proj(x) * H**-0.5, the H**-0.5 inside weights_scale
        proj = torch.randn(WEIGHT_RANK, heads, generator=gw) / math.sqrt(WEIGHT_RANK)
        w = (torch.randn(rows, WEIGHT_RANK, generator=gw) @ proj).to(torch.bfloat16).float()
    else:
        w = torch.randn(rows, heads, generator=gw).abs().to(torch.bfloat16).float()
    # The heads the indexer weighs up are the ones that look at recent entries and sinks: a
    # head with a negative weight that did would push them out of the selection instead.
    lean = (w / w.std().clamp_min(1e-30)).clamp_min(0)                          # [R, H]

    g = stream(seed, "queries")
    q = dist.sample((rows, heads, dim), g)
    if dist.query_key_affinity:
        aligned = torch.randn(rows, heads, basis.shape[0], generator=g) @ basis * math.sqrt(dim / basis.shape[0])
        q = math.sqrt(1 - dist.query_key_affinity) * q + math.sqrt(dist.query_key_affinity) * aligned
    if dist.outliers_on == "qk":
        q = q * chan
    if dist.head_scale_spread:
        q = q * 2 ** ((torch.rand(1, heads, 1, generator=g) * 2 - 1) * dist.head_scale_spread)
    if dist.sinks and dist.sink_query:
        q[..., sink_idx] += dist.sink_query * lean[..., None]
    if dist.weight_coupling:
        q = q * 2 ** (dist.weight_coupling * w / w.std().clamp_min(1e-30))[..., None]
    # locality: one unit-RMS direction in the RoPE dims, in every key and (by head) in the query;
    # RoPE turns q.k's share of it into a sum of cos(theta_i * distance): recent keys score up
    local_dir = torch.zeros(dim)
    local_dir[dim - rope:] = torch.randn(rope, generator=stream(seed, "locality"))
    local_dir[dim - rope:] /= local_dir[dim - rope:].square().mean().sqrt()

    empty = torch.empty(0)
    d = Draw(dist, seed, p, empty, empty, w, q, dist.drift_query * lean, chan, basis, norm_w, cs,
             outlier_idx.tolist(), sink_idx.tolist(), local_dir, dist.locality_query * lean).to(device)
    idx = torch.arange(entries, device=device)
    d.k = d.keys_at(d.pooled(idx, z.to(device)), idx)
    d.v = torch.cat(values).to(device).float()
    return d


def make_inputs(dist: Distribution, *, entries: int, rows: int, heads: int, head_dim: int | None = None,
                rope_dim: int | None = None, seed: int, model: str = "deepseek-v4-pro") -> dict:
    """-> dict(q [rows,H,D], k [entries,D], w [rows,H], weights_scale, draw): one context."""
    p = preset(model)
    if (head_dim or p.head_dim) != p.head_dim or (rope_dim or p.rope_dim) != p.rope_dim:
        raise ValueError(f"make_inputs: {model} has head_dim {p.head_dim}, rope_dim {p.rope_dim}")
    d = draw(dist, seed, entries=entries, rows=rows, heads=heads, model=model)
    return {"q": d.queries(entries), "k": d.k, "w": d.w, "weights_scale": p.weights_scale, "draw": d}


# --- statistics a capture can be compared on ----------------------------------------------


def kurtosis(x: torch.Tensor) -> float:
    x = x.double().flatten()
    x = x - x.mean()
    return float((x ** 4).mean() / (x ** 2).mean() ** 2)


def block_crest(x: torch.Tensor, block: int = 32) -> float:
    """Mean over 32-blocks of amax / RMS: what sets MXFP4's relative error in a block."""
    b = x.double().reshape(-1, block)
    rms = b.square().mean(1).sqrt()
    live = rms > 0
    return float((b.abs().amax(1)[live] / rms[live]).mean())


def channel_ratio(x: torch.Tensor) -> float:
    """Largest channel RMS over the median channel RMS (outlier channels)."""
    rms = x.double().reshape(-1, x.shape[-1]).square().mean(0).sqrt()
    return float(rms.max() / rms.median().clamp_min(1e-30))


def input_stats(k: torch.Tensor, q: torch.Tensor) -> dict:
    """Key and query statistics after the norm and RoPE (what the quantizers see)."""
    return {"k_kurtosis": kurtosis(k), "k_block_crest": block_crest(k), "k_channel_ratio": channel_ratio(k),
            "q_block_crest": block_crest(q), "q_channel_ratio": channel_ratio(q)}


# --- needles ------------------------------------------------------------------------------


def needle_columns(entries: int, depths, sinks: int = 0) -> list[int]:
    """Entry index per depth (0 = oldest non-sink entry, 1 = the newest)."""
    span = entries - 1 - sinks
    return [sinks + round(dp * span) for dp in depths]


def make_needles(d: Draw, entries: int, q: torch.Tensor, w_folded: torch.Tensor, kth: torch.Tensor,
                 depths, margins, *, scale: torch.Tensor | None = None, iters: int = 24,
                 reach: float = 8.0) -> dict:
    """Needles drawn from the key distribution at their own position.

    For every (row, depth) a pooled row is drawn as any key at that entry is (noise, drift,
    channels), then moved along the row's query direction (before the norm, so the norm and
    RoPE act on it as on any key; its norm stays a key's norm) until its exact score sits
    `margin * scale` above the row's exact k-th score (`scale` defaults to |kth|; the study
    passes the k-th key's gross score sum_h |w_h| relu(q_h . k), which is the k-th score
    itself when every weight is positive). The move is found by bisection on its length,
    from `-reach` to `+reach` times the noise norm.

    -> keys [R, nd, nm, D], cols [nd], score [R, nd, nm], margin (realized), valid [R, nd, nm].
    """
    rows, heads, dim = q.shape
    dev = q.device
    cols = needle_columns(entries, depths, d.dist.sinks)
    nd, nm = len(cols), len(margins)
    gen = stream(d.seed, "needles", entries)
    z = _noise(d.dist, d.basis.cpu(), rows * nd, dim, gen).reshape(rows, nd, dim).to(dev)
    idx = torch.tensor(cols, device=dev).expand(rows, nd)
    base = d.pooled(idx, z).float()                                                 # [R, nd, D]
    # direction that raises the score: sum_h w_h q_h (positive-weight heads pull the key in,
    # negative ones push it to where their ReLU is 0), un-rotated to the needle's RoPE
    # position and divided by the norm weight (so the norm maps it back)
    direction = (w_folded[..., None] * q).sum(1)                                    # [R, D]
    r = d.preset.compress_ratio
    cos, sin = cos_sin_at(d.cs, group_start(idx.reshape(-1) * r + r - 1, r))
    dir_rep = direction[:, None, :].expand(rows, nd, dim).reshape(-1, dim)
    unrot = rope_gptj_tail(dir_rep, cos, -sin, round_bf16=False, nope_through_formula=False)
    unrot = (unrot / d.norm_w).reshape(rows, nd, dim)
    unrot = unrot / unrot.norm(dim=-1, keepdim=True).clamp_min(1e-30) * base.norm(dim=-1, keepdim=True)

    m = torch.tensor(margins, dtype=torch.float32, device=dev)
    scale = kth.abs() if scale is None else scale
    target = kth[:, None, None] + m * scale[:, None, None]                         # [R, 1, nm]
    target = target.expand(rows, nd, nm)
    idx3 = idx[..., None].expand(rows, nd, nm)

    def keys(t):                                                                    # t [R, nd, nm]
        pooled = (base[:, :, None, :] + t[..., None] * unrot[:, :, None, :]).to(torch.bfloat16)
        return d.keys_at(pooled, idx3)

    def score(kk):
        s = torch.matmul(q, kk.reshape(rows, nd * nm, dim).transpose(1, 2)).clamp_min(0)
        return torch.bmm(w_folded.unsqueeze(1), s).reshape(rows, nd, nm)

    lo = torch.full_like(target, -reach)
    hi = torch.full_like(target, reach)
    valid = (score(keys(lo)) < target) & (score(keys(hi)) >= target)
    for _ in range(iters):
        mid = (lo + hi) / 2
        up = score(keys(mid)) >= target
        hi = torch.where(up, mid, hi)
        lo = torch.where(up, lo, mid)
    k_n = keys(hi)
    s_n = score(k_n)
    return {"keys": k_n, "cols": cols, "score": s_n, "valid": valid,
            "margin": (s_n - kth[:, None, None]) / scale[:, None, None]}
