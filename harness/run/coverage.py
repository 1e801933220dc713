"""Which boundaries of the coverage model (reference/coverage.py) each case reaches.

A case is walked through the reference chain alone (no backend runs): its inputs are
generated from its seed as `validate` generates them, each step goes through the same chain
(`runner.ChainRun`, with every stage the reference's), and every op under test in the case
hands its inputs and the reference's outputs to `observe`, which measures the facts
(`reference.coverage.FACTS`) of that call. Facts are measured on exactly what the op under
test receives in a run, so a boundary reached here is a boundary the op meets in `validate`.

    from harness.run.coverage import measure
    m = measure(case)                 # Measured: op -> fact -> set of values
    m.reached()                       # names of the boundaries the case reaches

Value facts count only where a wrong answer would show: a scale code only in a block that is
not all zero (and, for a scorer, only where the block changes a row's fp32 logit); a plateau
only where k cuts it. Planted non-finite inputs are read from the case (`plant`), counted for
each op under test that takes the planted input.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

import reference
from harness.run import runner
from harness.run.cases import Case
from harness.run.geometry import footprint
from harness.run.inputs import build
from reference import layout
from reference.checks import NonFiniteInput
from reference.coverage import _PLANTS, BOUNDARIES, Boundary
from reference.formats import E2M1_MIDPOINTS, E8M0_BIAS, FP8_AMAX_FLOOR, MX_BLOCK
from reference.op_table import DECLARED
from reference.pooling import boundary_mask, gather_windows
from reference.topk import packed_row_starts

# A CPU measures the cases whose estimated footprint fits this; larger ones need a GPU (their
# boundaries are then reported as not measured here, never as unreached).
CPU_FOOTPRINT = 3 << 30
VISIBLE_ROWS = 64           # scorer rows per call for the visibility of scale codes, evenly spaced,
                            # and the first row holding each query scale code the call has
VISIBLE_KEYS = 4096         # keys per sampled row (the row's last ones: the newest entries)
CROWD_BITS = 12             # a radix select's first pass: sign, exponent and 3 mantissa bits
CROWD_ROW = 2048            # a row counts as crowded from this many entries in one bin
JUDGED_SHARE = 2.0 ** -16  # a product's share of the call's logits norm that the logits_diff budget sees
EXP_OVERFLOW = math.log(torch.finfo(torch.float32).max)     # fp32 exp(x) is inf above this
EXP_UNDERFLOW = math.log(2.0 ** -150)                        # ... and 0 below this


@dataclass
class Measured:
    case: Case
    facts: dict = field(default_factory=dict)      # op -> fact -> set
    note: str = ""                                   # why the case's values were not measured here, if not
    values: bool = True                              # value facts measured (else the structure alone)

    def add(self, op: str, fact: str, values) -> None:
        self.facts.setdefault(op, {}).setdefault(fact, set()).update(values)

    def seen(self, b: Boundary) -> set:
        out: set = set()
        for op in b.ops:
            if op in self.case.ops:
                out |= self.facts.get(op, {}).get(b.fact, set())
        return out

    def reached(self) -> list[str]:
        return [b.name for b in BOUNDARIES if b.reached_by(self.seen(b))]


class _Walk(runner.ChainRun):
    """The case's chain through the reference alone; each op under test is observed. With
    `values` false no op computes: each returns outputs of its shape (zeros, an unchanged
    pool), which is all the structure facts read (rows, lengths, tables, positions)."""
    CHAIN = False

    def __init__(self, case: Case, inputs, observe, values: bool = True):
        super().__init__(dataclasses.replace(case, graph=False), reference_backend(), inputs)   # eager: nothing replays
        self.observe, self.values = observe, values

    def _history(self, kw: str):
        return super()._history(kw) if self.values else self.inp.kv_cache

    def _stage(self, op: str, step: int, ins: dict, *, fallback=None, call=None) -> dict:
        under_test = op in self.case.ops
        if self.values and (under_test or DECLARED[op].stage != "topk"):    # a top-k not under test feeds nothing
            out = reference.OPS[op].fn(**ins, **self.scalars(op))
        else:
            out = _shaped(op, ins, self.scalars(op), self.inp.geo)
        if under_test:
            self.observe(op, ins, self.scalars(op), out)
        return out


def _shaped(op: str, ins: dict, scalars: dict, geo) -> dict:
    """Outputs of `op`'s shapes and dtypes, computing nothing."""
    stage, z = DECLARED[op].stage, torch.zeros
    dev = next(iter(ins.values())).device
    if stage == "pooling":
        return {"pooled": z(ins["positions"].shape[0], geo.head_dim, dtype=torch.bfloat16, device=dev)}
    if stage in ("k_writer", "pool_k"):
        return {"kv_cache": ins["kv_cache"]}
    if stage == "q_quant":
        t, h, d = ins["q"].shape
        out = {"weights": z(t, h, device=dev)}
        if DECLARED[op].format == "fp8":
            return {**out, "q_fp8": z(t, h, d, dtype=torch.uint8, device=dev)}
        return {**out, "q_fp4": z(t, h, d // 2, dtype=torch.uint8, device=dev),
                "q_scale": z(t, h, d // 32, dtype=torch.uint8, device=dev)}
    if stage == "scorer":
        from reference.scoring import default_width
        return {"logits": z(ins["row_ends"].shape[0], default_width(ins["block_table"], geo.page_size), device=dev)}
    return {"indices": torch.full((ins["logits"].shape[0], int(scalars["k"])), -1, dtype=torch.int32, device=dev)}


def reference_backend():
    from optimized import get_backend
    return get_backend("reference")


def measure(case: Case, device: Optional[str] = None, *, values: bool = True) -> Measured:
    """The facts of every op under test in `case` (on `device`: a GPU when there is one).
    `values=False` measures the structure facts alone (nothing computes: seconds for any
    case); value facts (codes, elements, ties, crowds, visibility) are then not measured."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    m = Measured(case)
    _planted(m)
    if dev == "cpu" and footprint(case) > CPU_FOOTPRINT:
        m.note = f"structure only on a CPU (about {footprint(case) >> 20} MiB of tensors): values on a GPU"
        values = False
    m.values = values
    inp = build(case, dev)
    facts = _Facts(m, inp, values)
    try:
        _Walk(case, inp, facts.observe, values).run()
    except NonFiniteInput:
        pass                        # a planted input: the reference stops there; the plant is counted
    return m


def _planted(m: Measured) -> None:
    for p in m.case.plant:
        tag = f"{p.tensor}:{'row-' if getattr(p, 'row', False) else ''}{p.value}"
        ops, _ = _PLANTS.get(p.tensor, ((), ()))
        for op in ops:
            m.add(op, "nonfinite", {tag})


# --- the facts of one call ---------------------------------------------------------------------

def _valid_norm(logits: torch.Tensor, ends: torch.Tensor) -> float:
    """sqrt(sum of squares) of a call's logits over each row's valid columns (as logits_diff sums
    them), a block of rows at a time; non-finite values (a plant) count as 0."""
    total = 0.0
    cols = torch.arange(logits.shape[1], device=logits.device)
    step = max(1, (1 << 22) // max(1, logits.shape[1]))         # about 32 MiB of fp64 a block
    for r0 in range(0, logits.shape[0], step):
        x = logits[r0:r0 + step].double()
        x = torch.where((cols[None, :] < ends[r0:r0 + step, None]) & torch.isfinite(x), x, 0.0)
        total += float((x * x).sum())
    return math.sqrt(total)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).long() & 0xFFFFFFFF


def _heads(h: int) -> set:
    return {h} if h & (h - 1) == 0 else {h, "non-pow2"}


def _len_class(n: int, k: int) -> str:
    if n == 0:
        return "0"
    if n < k:
        return "<k"
    if n <= k + 1:
        return "=k" if n == k else "=k+1"
    return ">k" if n <= 4 * k else ">>k"


class _Facts:
    def __init__(self, m: Measured, inp, values: bool = True):
        self.m, self.geo, self.values = m, getattr(inp, "geo", None), values

    def observe(self, op: str, ins: dict, scalars: dict, out: dict) -> None:
        stage = DECLARED[op].stage
        add = lambda fact, vals: self.m.add(op, fact, vals)   # noqa: E731
        if "positions" in ins:
            pos = ins["positions"].long()
            add("rows", {int(pos.numel())})
            self._positions(add, pos)
            if stage == "q_quant" and pos.numel() and bool((pos == ins["cos_sin_cache"].shape[0] - 1).any()):
                add("positions", {"table-end"})     # the Q side rotates by the token's own position
            if stage in ("pooling", "pool_k"):
                self._chunk_edges(add, pos, ins["req_index"].long())
                add("state_block", {int(ins["state_cache"].shape[1])})
                if self.values:
                    self._pool_scores(add, ins)
        if stage in ("k_writer", "pool_k"):
            self._writer(op, add, ins, scalars, out)
        elif stage == "q_quant":
            self._quant(op, add, ins, scalars, out)
        elif stage == "scorer":
            self._scorer(op, add, ins, scalars, out)
        elif stage == "topk":
            self._topk(add, ins, scalars)

    # structure
    def _positions(self, add, pos: torch.Tensor) -> None:
        if pos.numel() == 0:
            return
        if bool((pos == 0).any()):
            add("positions", {0})
        for e in (15, 16, 17, 20):
            p = 1 << e
            if bool((pos == p).any()) and bool((pos == p - 1).any()):
                add("positions", {p})

    def _chunk_edges(self, add, pos: torch.Tensor, req: torch.Tensor) -> None:
        r = self.geo.ratio
        for b in req.unique().tolist():
            p = pos[req == b]
            p0, p1 = int(p.min()), int(p.max())
            if (p0 + 1) % r == 0:
                add("chunk_edges", {"starts-on-boundary"})
            if (p1 + 1) % r == 0:
                add("chunk_edges", {"ends-on-boundary"})
            bnd = p[(p + 1) % r == 0]
            if bool(((bnd - 2 * r + 1 < p0) & (bnd - 2 * r + 1 >= 0)).any()):
                add("chunk_edges", {"window-before-call"})

    def _pool_scores(self, add, ins) -> None:
        """Each pooled window's largest valid score per channel against fp32 exp's range."""
        pos = ins["positions"]
        sel = boundary_mask(pos, self.geo.ratio) & (ins["kv_slot_mapping"] >= 0)
        if not bool(sel.any()):
            return
        _, score, _ = gather_windows(ins["state_cache"], ins["block_table"], pos[sel], ins["req_index"][sel],
                                     self.geo.ratio)
        top = score.amax(dim=1)                  # slots before position 0 hold -inf
        top = top[torch.isfinite(top)]
        if bool((top > EXP_OVERFLOW).any()):
            add("pool_scores", {"exp-overflow"})
        if bool((top < EXP_UNDERFLOW).any()):
            add("pool_scores", {"exp-underflow"})

    def _norm(self, add, rows: torch.Tensor, eps: float) -> None:
        """The written rows' fp32 sum of squares (exact in fp64, then rounded) against eps."""
        x = rows.double()
        s = (x * x).sum(dim=-1).float()
        live = (x != 0).any(dim=-1)
        mean = s / float(x.shape[-1])
        if bool((live & (s == 0)).any()):
            add("norm", {"sum-underflow"})
        if bool(((mean > 0) & (mean <= eps)).any()):
            add("norm", {"eps-dominant"})

    def _amax(self, add, rows: torch.Tensor) -> None:
        """FP8 rows (a K entry, a query head) whose amax is under the scale's floor, non-zero."""
        amax = rows.float().abs().amax(dim=-1)
        if bool(((amax > 0) & (amax < FP8_AMAX_FLOOR)).any()):
            add("amax", {"under-floor"})

    def _layout(self, add, shuffle, page_size: int, stride: int, fmt: str) -> None:
        if fmt != "mxfp4":
            add("layout", {f"fp8/{page_size}"})      # token-major values, then the page's scales
            return
        name = "natural" if shuffle is None else ",".join(str(v) for v in shuffle)
        add("layout", {f"{name}/{page_size}"})
        pad = stride - layout.page_bytes(page_size, self.geo.head_dim)
        add("stride", {"pad0" if pad == 0 else "pad-odd" if pad % 2 else "pad-even"})

    def _writer(self, op, add, ins, scalars, out) -> None:
        geo, r = self.geo, self.geo.ratio
        slot_key = "kv_slot_mapping" if "kv_slot_mapping" in ins else "slot_mapping"
        pos, slots = ins["positions"].long(), ins[slot_key].long()
        boundary = boundary_mask(pos, r)
        sel = boundary & (slots >= 0)
        written = slots[sel]
        if bool((boundary & (slots < 0)).any()):
            add("entries", {"skipped-boundary"})
        ps, stride = geo.page_size, out["kv_cache"].shape[1]
        fmt = DECLARED[op].format
        shuffle = scalars.get("shuffle")
        self._layout(add, shuffle, ps, stride, fmt)
        if written.numel() == 0:
            return
        add("page_bytes", {int(written.max()) // ps * stride})
        ent = written % ps
        nxt = set((written + 1).tolist())
        edges = set()
        for s, e in zip(written.tolist(), ent.tolist()):
            if s + 1 in nxt and shuffle is not None and (e + 1) % shuffle[0] == 0 and e + 1 < ps:
                edges.add("group-edge")
        # entries j and j + 1 (boundary tokens p and p + r) on two pages: the call crosses a page edge
        by_pos = dict(zip(pos[sel].tolist(), written.tolist()))
        if any(s % ps == ps - 1 and by_pos.get(p + r, -1) % ps == 0 and by_pos.get(p + r, -1) // ps != s // ps
               for p, s in by_pos.items()):
            edges.add("page-edge")
        if int(written.max()) == out["kv_cache"].shape[0] * ps - 1:
            edges.add("pool-end")
        if int(written.max()) // ps >= 1 << 16:
            edges.add("high-2^16")
        if bool(((written >= 1 << 24) & (written % ps == ps - 1)).any()):
            edges.add("slot-2^24")
        if bool(((written // ps >= 1 << 15) & (written // ps < 1 << 16)).any()):
            edges.add("high-2^15")
        add("entries", edges)
        if not self.values:
            return
        k_in = ins.get("k")
        if k_in is None:                         # the fused ops: their rows are the pooled ones, unrounded
            k_rows = reference.compress_pool(state_cache=ins["state_cache"], block_table=ins["block_table"],
                                             positions=pos, req_index=ins["req_index"], kv_slot_mapping=slots,
                                             compress_ratio=r, rounding="cuda")["pooled"][sel]
        else:
            k_rows = k_in[sel]
        self._norm(add, k_rows, float(scalars["norm_eps"]))
        y = None
        if k_in is not None:                     # the values the writer quantizes (normed, rotated)
            from reference.k_writer import group_start, k_values
            y = k_values(k_rows, group_start(pos[sel], r), ins["cos_sin_cache"], ins["norm_weight"],
                         scalars["norm_eps"], rounding=scalars.get("rounding", "rocm"),
                         hadamard=scalars.get("hadamard", False), rope=scalars.get("rope", "separate"))
        if fmt != "mxfp4":
            if y is not None:
                self._amax(add, y)               # FP8: rows under the scale's amax floor
            return
        packed, scales = layout.read_entries(out["kv_cache"], written, page_size=ps, head_dim=geo.head_dim,
                                             shuffle=shuffle)
        self._codes(add, packed, scales)
        if k_in is not None:
            self._subnormal(add, k_rows.float(), packed)
            self._midpoints(add, y, scales)

    def _quant(self, op, add, ins, scalars, out) -> None:
        add("heads", _heads(int(ins["q"].shape[1])))
        add("elements_per_call", {int(ins["q"].shape[0]) * int(ins["q"].shape[1])})
        add("options", {"weights-f32" if ins["weights"].dtype == torch.float32 else "weights-bf16"})
        if "fp8_dtype" in scalars:
            add("options", {scalars["fp8_dtype"]})
        if ins["q"].shape[0] == 0 or not self.values:
            return
        from reference.q_quant import q_values
        if DECLARED[op].format != "mxfp4":
            y = q_values(ins["q"], ins["positions"], ins["cos_sin_cache"], hadamard=scalars.get("hadamard", False),
                         rope=scalars.get("rope", "separate"))
            self._amax(add, y.reshape(-1, y.shape[-1]))
            return
        t, h, d = ins["q"].shape
        packed, scales = out["q_fp4"].reshape(t * h, -1), out["q_scale"].reshape(t * h, -1)
        self._codes(add, packed, scales)
        self._subnormal(add, ins["q"].float().reshape(t * h, d), packed)
        y = q_values(ins["q"], ins["positions"], ins["cos_sin_cache"], hadamard=scalars.get("hadamard", False),
                     rope=scalars.get("rope", "separate"))
        self._midpoints(add, y.reshape(t * h, d), scales)

    def _codes(self, add, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """Codes of the non-zero blocks; element classes of every block."""
        nib = torch.stack((packed & 0xF, packed >> 4), -1).reshape(packed.shape[0], -1, MX_BLOCK)
        live = (nib & 7).ne(0).any(-1)                                   # [rows, blocks]
        add("codes", set(scales[live].unique().tolist()))
        tags = set()
        if bool((~live).any()):
            tags.add("zero-block")
        if bool(((nib == 8) & live[..., None]).any()):
            tags.add("neg-zero")
        if bool(((nib & 7) == 7).any()):
            tags.add("saturated")
        add("elements", tags)

    def _subnormal(self, add, x: torch.Tensor, packed: torch.Tensor) -> None:
        nib = torch.stack((packed & 0xF, packed >> 4), -1).reshape(packed.shape[0], -1, MX_BLOCK)
        live = (nib & 7).ne(0).any(-1)
        xb = x.reshape(x.shape[0], -1, MX_BLOCK)
        sub = ((xb != 0) & (xb.abs() < 2.0 ** -126)).any(-1)
        if bool((sub & live).any()):
            add("elements", {"subnormal"})

    def _midpoints(self, add, y: torch.Tensor, scales: torch.Tensor) -> None:
        inv = torch.exp2(E8M0_BIAS - scales.double())                   # 2^(127 - e8m0), exact in fp64
        v = (y.double().reshape(y.shape[0], -1, MX_BLOCK) * inv[..., None]).abs()
        mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float64, device=v.device)
        if bool(torch.isin(v, mids).any()):
            add("elements", {"midpoint"})

    def _scorer(self, op, add, ins, scalars, out) -> None:
        geo, k = self.geo, self.geo.topk
        ends = ins["row_ends"].long()
        qsl = ins["query_start_loc"].long()
        bt, ctx = ins["block_table"].long(), ins["context_lens"].long()
        ps = geo.page_size
        q_key = "q_fp4" if "q_fp4" in ins else "q_fp8"
        add("rows", {int(ins[q_key].shape[0])})
        add("heads", _heads(int(ins[q_key].shape[1])))
        add("row_len", set(ends.tolist()))
        add("len_vs_k", {_len_class(n, k) for n in ends.tolist()})
        add("options", {"clean_logits" if scalars.get("clean_logits") else "dirty_logits"})
        if "fp8_dtype" in scalars:
            add("options", {scalars["fp8_dtype"]})
        rows_of = (qsl[1:] - qsl[:-1]).tolist()
        add("seq_rows", set(rows_of))
        seqs = set()
        if ends.numel() and bool((ends == 0).all()):
            seqs.add("all-no-context")
        if any(n == 0 for n in rows_of):
            seqs.add("empty")
        if bool((ends == 0).any()):
            seqs.add("no-context")
        for b, n in enumerate(rows_of):
            if n and int(qsl[b]) > 0 and bool((ends[qsl[b]:qsl[b + 1]] > k).any()):
                seqs.add("packed-start")
        add("seqs", seqs)
        need = (ctx + ps - 1) // ps
        used, tags = [], set()
        for b in range(bt.shape[0]):
            ids = bt[b, :int(need[b])]
            used.append(ids)
            if ids.numel() > 1:
                d = ids[1:] - ids[:-1]
                if bool((d != 1).any()):
                    tags.add("permuted")
                if bool((d < 0).all()):
                    tags.add("descending")
        ids = torch.cat(used) if used else bt.new_zeros(0)
        if ids.numel():
            if ids.unique().numel() < ids.numel():
                tags.add("repeated")
            if int(ids.max()) >= 512:
                tags.add("high")
            if bool(((ids >= 1 << 15) & (ids < 1 << 16)).any()):
                tags.add("high-2^15")
            if int(ids.max()) >= 1 << 16:
                tags.add("high-2^16")
            add("page_bytes", {int(ids.max()) * ins["kv_cache"].shape[1]})
        if need.numel() and bt.shape[1] > int(need.max()):
            tags.add("wide-table")
        add("pages", tags)
        logits = out["logits"]
        add("logits_bytes", {int(logits.shape[0]) * int(logits.shape[1]) * 4})
        self._layout(add, scalars.get("shuffle"), ps, ins["kv_cache"].shape[1], DECLARED[op].format)
        if DECLARED[op].format == "mxfp4":
            if self.values:
                self._visible(add, ins, scalars, _valid_norm(logits, ends))

    def _visible(self, add, ins, scalars, norm: float) -> None:
        """Scale codes of the key and query blocks whose products change some row's fp32 logit
        (NUMERICS.md §6: logit = sum_h w_h relu(q_h . k)); sampled rows, each row's last keys,
        each sequence's keys read once. `codes_judged`: those of them whose products are also at
        least JUDGED_SHARE of the call's logits norm `norm` (halved or doubled, such a product
        moves logits_diff, a sum over the call, past its 1e-12 budget; a smaller one, beside
        rows of larger logits, changes its row and no verdict)."""
        ps, d = self.geo.page_size, self.geo.head_dim
        ends, qsl = ins["row_ends"].long(), ins["query_start_loc"].long()
        rows = ends.numel()
        if rows == 0:
            return
        has = torch.zeros(rows, 256, dtype=torch.bool, device=ends.device)
        has.scatter_(1, ins["q_scale"].reshape(rows, -1).long(), True)
        first = has.to(torch.uint8).argmax(0)[has.any(0)]               # a row for each code present
        even = torch.linspace(0, rows - 1, min(rows, VISIBLE_ROWS), device=ends.device).round().long()
        pick = torch.cat((even, first)).unique()
        seq = torch.searchsorted(qsl[1:], pick, right=True)
        shuffle = scalars.get("shuffle")
        kcodes, qcodes, dots, judged = set(), set(), set(), set()
        for b in seq.unique().tolist():
            rs = pick[(seq == b) & (ends[pick] > 0)]
            if rs.numel() == 0:
                continue
            hi = int(ends[rs].max())
            j = torch.arange(max(0, hi - VISIBLE_KEYS), hi, device=ends.device)
            slots = ins["block_table"][b].long()[j // ps] * ps + j % ps
            kp, ks = layout.read_entries(ins["kv_cache"], slots, page_size=ps, head_dim=d, shuffle=shuffle)
            if bool((ks == 255).any()):
                continue                         # a NaN scale: a non-finite input, not scored
            kv = _deq(kp, ks)                                             # [n, NB, 32] fp64
            for r in rs.tolist():
                qs = ins["q_scale"][r]
                if bool((qs == 255).any()):
                    continue
                live = j < ends[r]
                part = torch.einsum("hbe,nbe->hnb", _deq(ins["q_fp4"][r], qs), kv)   # each block's product
                dot = part.sum(-1)                                                  # [H, n]
                if bool((dot.abs() >= 2.0 ** 128).any()):
                    dots |= {"overflow-any"} | ({"overflow"} if dot.shape[0] > 32 else set())
                w = ins["weights"][r].double()[:, None]
                on = (dot > 0) & (w != 0) & live[None, :]
                logit = (w * dot.clamp_min(0)).sum(0)                                # [n]
                ulp = (logit.abs() * 2.0 ** -24).clamp_min(2.0 ** -149)
                seen = (w.abs()[..., None] * part.abs() * on[..., None]) >= ulp[None, :, None]   # [H, n, NB]
                if bool(seen.any()):
                    kcodes |= set(ks.long()[seen.any(0)].unique().tolist())
                    big = seen & (w.abs()[..., None] * part.abs() >= JUDGED_SHARE * norm)
                    judged |= set(ks.long()[big.any(0)].unique().tolist())
                    qcodes |= set(qs.long()[seen.any(1)].unique().tolist())
        add("codes_read", kcodes)
        add("q_codes_read", qcodes)
        add("codes_judged", judged)
        add("dots", dots)

    def _topk(self, add, ins, scalars) -> None:
        k = int(scalars["k"])
        logits, lengths = ins["logits"], ins["lengths"].long()
        add("rows", {int(logits.shape[0])})
        add("k", {k})
        add("row_len", set(lengths.tolist()))
        add("len_vs_k", {_len_class(n, k) for n in lengths.tolist()})
        rows = logits.shape[0]
        if rows == 0:
            return
        if bool(((packed_row_starts(lengths) > 0) & (lengths > k)).any()):
            add("seqs", {"packed-start"})
        if bool((lengths == 0).any()):
            add("seqs", {"no-context"})
        if bool(((lengths == logits.shape[1]) & (lengths > k)).any()):
            add("width", {"fills-width"})
        if k > logits.shape[1]:
            add("width", {"k-past-width"})
        if not self.values:
            return
        ties, crowd, crowded = set(), 0, 0
        width = logits.shape[1]
        cols = torch.arange(width, device=logits.device)
        for r0 in range(0, rows, 1024):
            x = logits[r0:r0 + 1024].float()
            n = lengths[r0:r0 + 1024]
            valid = cols[None, :] < n[:, None]
            if not bool(torch.isfinite(torch.where(valid, x, 0.0)).all()):
                continue                     # a non-finite row: counted as a plant, not here
            key = _bits(x)
            key = torch.where(key >= 1 << 31, key ^ 0xFFFFFFFF, key | (1 << 31)) >> (32 - CROWD_BITS)
            nb = 1 << CROWD_BITS
            idx = torch.arange(x.shape[0], device=x.device)[:, None] * nb + key
            counts = torch.bincount(idx[valid], minlength=x.shape[0] * nb).view(x.shape[0], nb)
            top = counts.max(1).values
            crowd = max(crowd, int(top.max()))
            crowded += int((top >= CROWD_ROW).sum())
            long_rows = (n > k).nonzero().flatten()
            if long_rows.numel():
                xs = torch.where(valid, x, float("-inf"))[long_rows]
                kth = xs.topk(k, dim=1).values[:, -1:]
                greater = (xs > kth).sum(1)
                equal = (xs == kth).sum(1)
                cut = (greater + equal > k) & (equal >= 2)
                nn = n[long_rows]
                for e, c, kv, ln in zip(equal.tolist(), cut.tolist(), kth.flatten().tolist(), nn.tolist()):
                    if not c:
                        continue
                    if e > 1024:
                        ties.add("tie-1024")
                    ties.add("tie-row" if e == ln else "tie-k" if e >= k else "tie-16" if e >= 16 else "tie-2")
                    if kv == 0.0:
                        ties.add("tie-zero")
        add("ties", ties)
        add("crowd", {crowd})
        add("crowd_rows", {crowded})


def _deq(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., D/2] bytes and [..., D/32] e8m0 -> [..., D/32, 32] exact fp64 values."""
    from reference.formats import E2M1_SIGNED
    lut = torch.tensor(E2M1_SIGNED, dtype=torch.float64, device=packed.device)
    nib = torch.stack((packed & 0xF, packed >> 4), -1).reshape(*packed.shape[:-1], -1, MX_BLOCK).long()
    return lut[nib] * torch.exp2(scales.double() - E8M0_BIAS)[..., None]


# --- a suite --------------------------------------------------------------------------------------

@dataclass
class Coverage:
    """A suite's coverage: each case's reached boundaries, and each boundary's cases."""
    cases: list[Measured]

    def reached_by(self) -> dict[str, list[str]]:
        out = {b.name: [] for b in BOUNDARIES}
        for m in self.cases:
            for name in m.reached():
                out[name].append(m.case.name)
        return out

    def unmeasured(self) -> list[Measured]:
        return [m for m in self.cases if m.note]

    def unreached(self, needs: tuple = ("cpu", "gpu")) -> list[Boundary]:
        by = self.reached_by()
        return [b for b in BOUNDARIES if b.needs in needs and not by[b.name]]


def suite_coverage(cases: list[Case], device: Optional[str] = None, progress=None) -> Coverage:
    out = []
    for c in cases:
        out.append(measure(c, device))
        if progress:
            progress(c)
    return Coverage(out)

