"""GPU benchmark of the Triton backend and of the exact reference at DeepSeek-V4-Pro shapes
(`make bench-gpu`).

For each stage: our kernel's time (triton.testing.do_bench, median; and replayed from a
CUDA graph, which removes the host's launch cost as vLLM's decode does), the floor (bytes
over the measured device copy bandwidth, or the scorer's FLOPs over the bf16 tensor-core
rate), and the exact reference on the same GPU: the op as a user calls it (argument checks
and their host syncs included, eager) and, where it has no host sync, its core (the work
after the checks) replayed from a CUDA graph, as the kernels are timed through their
launchers without their op wrappers' checks. The reference / kernel column divides the
reference's better time by the kernel's graph time. Also: plain torch (the scorer as
dequantize-then-matmul, torch.topk), vLLM's own CUDA kernels when the `vllm-cuda` backend
runs here (the fused pool + K op is the K path's peer), the outputs' bytes (reference vs
kernel, GPU reference vs CPU reference), pooling tilings with their bytes, and, for
docs/triton-notes.md, how often the upstream-style shortcuts (fp32 norm sum + approximate
rsqrt + FMA; fp32 exp in the pooling) change bytes. Writes a markdown table (default
reports/bench-gpu.md). Last, the full suite as a user runs it, from a fresh Triton cache:
its wall clock and each case's GPU peak against its tensors.

    python -m harness.bench.gpu [--out reports/bench-gpu.md] [--quick] [--shortcuts]
"""
from __future__ import annotations

import datetime
import pathlib
import sys

import torch

from harness.bench import capture as capture_bench
from harness.bench import resources
from harness.bench import shadow as shadow_bench
from harness.bench.resources import FUSED_TILES
from harness.errors import EXIT_FAIL, EXIT_OK, EXIT_USAGE, Parser, parse_or_exit
from harness.io import atomic
from reference import layout
from reference.formats import E2M1_SIGNED

ENTRY = layout.entry_bytes(128)          # bytes of one MXFP4 key (D = 128)

BF16_TFLOPS = 790e12      # dense bf16 tensor-core rate measured on an H200 (8192^3 matmul, random data)
# scorer tilings (BM rows, BN entries, warps, stages[, register cap]) timed beside the
# default pick_config choice
CONFIGS = {"scorer decode": [(1, 64, 4, 3, 128), (1, 64, 4, 4)],
           "scorer prefill": [(2, 64, 4, 2)]}
# the targets on the H200 (microseconds)
TARGETS_US = {"scorer decode": 100.0, "scorer prefill": 1000.0, "K path (pool + writer)": 27.0}


def _bench(fn, reps_ms=100, graph=False):
    """Median milliseconds of `fn` after a warm-up (eager, or replayed from a CUDA graph)."""
    import triton.testing
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=reps_ms, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a))
    a = b = None                     # free the 4 GiB before the next benchmark
    return 2 * (1 << 31) / (ms * 1e-3)


# --- inputs ---------------------------------------------------------------------------

def k_path_inputs(tokens=16384, seed=0):
    from reference import pooling, rope
    from reference.formats import preset
    p = preset()
    g = torch.Generator().manual_seed(seed)
    d, r, bs = p.head_dim, p.compress_ratio, 256
    pos = torch.arange(tokens)
    nblk = tokens // bs
    table = torch.arange(nblk).view(1, -1)
    rows = pooling.state_rows(torch.randn(tokens, 2 * d, generator=g), torch.randn(tokens, 2 * d, generator=g) * 2,
                              torch.randn(r, 2 * d, generator=g) * 0.1, pos)
    state = rows.view(nblk, bs, 4 * d)
    boundary = (pos + 1) % r == 0
    slots = torch.where(boundary, pos // r, -1)
    entries = tokens // r
    pool = torch.randint(0, 256, (entries // p.page_size, layout.page_bytes(p.page_size, p.head_dim)),
                         generator=g, dtype=torch.uint8)
    cs = rope.cos_sin_cache(tokens, p.rope_dim, p.rope_base, yarn_factor=p.yarn_factor,
                            yarn_original_max_pos=p.yarn_original_max_pos)
    cuda = lambda t: t.cuda()
    pool_kw = dict(state_cache=cuda(state), block_table=cuda(table), positions=cuda(pos),
                   req_index=cuda(torch.zeros(tokens, dtype=torch.long)), kv_slot_mapping=cuda(slots),
                   compress_ratio=r)
    k_kw = dict(positions=cuda(pos), cos_sin_cache=cuda(cs),
                norm_weight=cuda((1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)),
                slot_mapping=cuda(slots), kv_cache=cuda(pool), norm_eps=p.rms_eps, compress_ratio=r,
                page_size=p.page_size, shuffle=[32, 16, 2])
    return pool_kw, k_kw


def _scale_bytes(shape, wide: bool, g) -> torch.Tensor:
    """Realistic e8m0 bytes (a per-vector level in 118..123 and a 0/1 step per block, as
    normed activations give; the bench-reference data) or, `wide`, every block random over
    12 binades (115..126): no fp32 or int8 proof holds, the fp64 core scores it."""
    if wide:
        return torch.randint(115, 127, (*shape, 4), generator=g).to(torch.uint8)
    return (torch.randint(118, 124, (*shape, 1), generator=g) + torch.randint(0, 2, (*shape, 4), generator=g)
            ).to(torch.uint8)


def scorer_inputs(seqs: int, rows_per_seq: int, context_tokens: int, causal: bool, seed=0, wide=False):
    """Pages of random MXFP4 entries (codes random, scale bytes by `_scale_bytes`) on the
    GPU, block tables a permutation of the pool's pages."""
    from reference.formats import preset
    p = preset()
    ps, h, d = p.page_size, p.index_heads, p.head_dim
    entries = context_tokens // p.compress_ratio
    pages_per = entries // ps
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (seqs * pages_per, layout.page_bytes(ps, d)), dtype=torch.uint8, generator=g)
    # V4-Pro preshuffle (32, 16, 2): scale byte of (group, lane, s) sits at [group, s%2, lane, s//2]
    e = _scale_bytes((seqs * pages_per, ps // 32, 32), wide, g)
    pool[:, ps * d // 2:] = e.view(-1, ps // 32, 32, 2, 2).permute(0, 1, 4, 2, 3).reshape(seqs * pages_per, -1)
    table = torch.randperm(seqs * pages_per, generator=g).view(seqs, pages_per).to(torch.int32)
    rw = seqs * rows_per_seq
    if causal:
        posn = context_tokens - rows_per_seq + torch.arange(rows_per_seq)
        ends = ((posn + 1) // p.compress_ratio).repeat(seqs)
    else:
        ends = torch.full((rw,), entries)
    kw = dict(q_fp4=torch.randint(0, 256, (rw, h, d // 2), dtype=torch.uint8, generator=g),
              q_scale=_scale_bytes((rw, h), wide, g), weights=torch.randn(rw, h, generator=g), kv_cache=pool,
              query_start_loc=torch.arange(0, rw + 1, rows_per_seq, dtype=torch.int32),
              context_lens=torch.full((seqs,), entries, dtype=torch.int32), block_table=table,
              row_ends=ends.to(torch.int32))
    return dict({k: v.cuda() for k, v in kw.items()}, page_size=ps, shuffle=[32, 16, 2])


def differing_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of a and b differ in their bits (NaN equal to NaN)."""
    a, b = a.cpu(), b.cpu()
    if a.is_floating_point():
        w = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return int(((a.view(w) != b.view(w)) & ~(a.isnan() & b.isnan())).sum())
    return int((a != b).sum())


# --- the plain torch scorer: dequantize every key, then matmul ------------------------------

def torch_dequant_matmul(kw, row_chunk=512):
    """What a straightforward torch implementation does: gather and dequantize the keys to
    bf16, dequantize q, bf16 matmul with fp32 output, relu, weight, sum over heads."""
    lut = torch.tensor(E2M1_SIGNED, device="cuda", dtype=torch.bfloat16)
    ps, shuf = kw["page_size"], kw["shuffle"]
    vo = layout.value_offsets(torch.arange(ps, device="cuda"), ps, 128, shuf)      # [ps, 64]
    so = layout.scale_offsets(torch.arange(ps, device="cuda"), ps, 128, shuf)      # [ps, 4]

    def deq(packed, scales):
        v = torch.stack((lut[(packed & 15).long()], lut[(packed >> 4).long()]), -1).flatten(-2)
        s = torch.exp2(scales.float() - 127).to(torch.bfloat16)
        return (v.unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)

    q = deq(kw["q_fp4"], kw["q_scale"])                                           # [Rw, H, D]
    qsl = kw["query_start_loc"].tolist()
    if len(qsl) - 1 == q.shape[0]:        # decode: one row per sequence, all in one batched matmul
        pages = kw["kv_cache"][kw["block_table"].long()]                          # [B, np, stride]
        k = deq(pages[:, :, vo], pages[:, :, so]).flatten(1, 2)                   # [B, J, D]
        s = torch.bmm(q, k.transpose(1, 2)).float().relu_()                       # [B, H, J]
        return torch.einsum("bhj,bh->bj", s, kw["weights"])
    out = torch.full((q.shape[0], kw["block_table"].shape[1] * ps), float("-inf"), device="cuda")
    for b in range(len(qsl) - 1):
        pages = kw["kv_cache"][kw["block_table"][b].long()]                       # [np, stride]
        k = deq(pages[:, vo], pages[:, so]).flatten(0, 1)                         # [J, D]
        for r0 in range(qsl[b], qsl[b + 1], row_chunk):
            r1 = min(r0 + row_chunk, qsl[b + 1])
            s = torch.matmul(q[r0:r1], k.T.unsqueeze(0)).float().relu_()          # [rc, H, J]
            out[r0:r1] = torch.einsum("rhj,rh->rj", s, kw["weights"][r0:r1])
    return out


# --- measurements -------------------------------------------------------------------------

def measure_variants(n=1 << 20, seed=1):
    """Bytes per million entries where the upstream-style K writer differs from the exact one."""
    from optimized.triton_kernels import k_writer
    from reference import rope
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, 128, generator=g) * torch.exp2(torch.randn(n, 1, generator=g) * 2)).to(torch.bfloat16).cuda()
    pos = ((torch.arange(n) % 32768) * 4 + 3).cuda()
    cs = rope.cos_sin_cache(32768 * 4, 64, 160000.0, yarn_factor=16.0).cuda()
    w = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16).cuda()
    slots = torch.arange(n, device="cuda")
    base = torch.zeros(n // 64, layout.page_bytes(64, 128), dtype=torch.uint8, device="cuda")
    args = (k, pos, cs, w, slots)
    common = dict(norm_eps=1e-6, compress_ratio=4, page_size=64, shuffle=[32, 16, 2])
    exact = k_writer.launch(*args, base.clone(), **common)
    out = {}
    for v in ("fast-norm", "fma", "fast-norm+fma"):
        o = k_writer.launch(*args, base.clone(), **common, variant=v)
        diff = (o != exact)
        out[v] = (int(diff.sum()), n)
    return out


def measure_pool_fast_exp(tokens=16384, seeds=4):
    from optimized.triton_kernels import pooling
    diff = total = worst = 0
    for s in range(seeds):
        kw, _ = k_path_inputs(tokens, seed=100 + s)
        kw = dict(kw)
        r = kw.pop("compress_ratio")
        a = pooling.launch(*kw.values(), compress_ratio=r)
        b = pooling.launch(*kw.values(), compress_ratio=r, fast_exp=True)
        ok = ~a.isnan()
        ai, bi = a[ok].view(torch.int16).int(), b[ok].view(torch.int16).int()
        diff += int((ai != bi).sum())
        total += int(ok.sum())
        worst = max(worst, int((ai - bi).abs().max()))
    return diff, total, worst


def main(argv=None) -> int:
    ap = Parser(prog="python -m harness.bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/bench-gpu.md")
    ap.add_argument("--quick", action="store_true", help="skip the wide-scale reference rows")
    ap.add_argument("--shortcuts", action="store_true",
                    help="also measure how often upstream-style shortcuts change bytes (docs/triton-notes.md)")
    ap.add_argument("--skip", action="append", default=[], choices=sorted(PARTS),
                    help="leave a part out (the report says so); may be repeated")
    a = parse_or_exit(ap, argv, "bench gpu")
    if not torch.cuda.is_available():
        print("mxval: bench gpu: no CUDA/ROCm GPU visible to torch", file=sys.stderr)
        return EXIT_USAGE
    from optimized import BackendUnavailable, get_backend
    try:
        get_backend("triton")
    except BackendUnavailable as e:
        print(f"mxval: bench gpu: {e}", file=sys.stderr)
        return EXIT_USAGE
    bench = Bench(copy_bandwidth(), a.quick)
    for name, part in PARTS.items():
        if name in a.skip:
            bench.note("Parts left out of this run", name)
        elif name != "shortcuts" or a.shortcuts:
            bench.section(part)
            bench.write(a.out, quiet=True)       # a run stopped by a time limit keeps what it measured
    bench.write(a.out)
    return EXIT_FAIL if bench.failures else EXIT_OK


class Bench:
    """What the parts record: stage rows, notes per heading, tiling sweeps, failures. A part
    is a function of the Bench; a failing part is written into the report and the rest run."""

    def __init__(self, bw: float, quick: bool):
        self.bw, self.quick = bw, quick
        self.results: dict = {}
        self.rows: list[str] = []
        self.notes: dict[str, list[str]] = {}
        self.sweeps: dict = {}
        self.failures: list[str] = []
        self.extra: list[str] = []          # lines a part writes itself (after the tables)

    def section(self, fn) -> None:
        try:
            fn(self)
        except Exception as e:  # noqa: BLE001 - reported, never hidden
            self.failures.append(f"{fn.__name__}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print("FAILED", self.failures[-1], flush=True)
            torch.cuda.empty_cache()

    def note(self, heading: str, text: str) -> None:
        self.notes.setdefault(heading, []).append(text)
        print(f"[{heading}] {text}", flush=True)

    def row(self, name, shape, t, tg, floor, ref_op=None, ref_core=None, tor=None):
        """One stage: kernel eager and graph, floor, reference op (eager) and core (graph)."""
        ref = min(v for v in (ref_op, ref_core, float("inf")) if v is not None)
        ref = None if ref == float("inf") else ref
        self.results[name] = dict(t=t, tg=tg, floor=floor, ref=ref, ref_op=ref_op, ref_core=ref_core, tor=tor)
        ratio = lambda x, y: "-" if x is None or not y else f"{x / y:.1f}x"
        self.rows.append(f"| {name} | {shape} | {_ms(t)} | {_ms(tg)} | {_ms(floor)} | {ratio(tg, floor)} | "
                         f"{_ms(ref_op)} | {_ms(ref_core)} | **{ratio(ref, tg)}** | {_ms(tor)} | {ratio(tor, tg)} |")
        print(self.rows[-1], flush=True)

    def write(self, out: str, quiet: bool = False) -> None:
        import triton
        lines = ["# GPU benchmark: the Triton backend and the exact reference at DeepSeek-V4-Pro shapes", "",
                 f"Machine: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}; "
                 f"torch {torch.__version__}, triton {triton.__version__}; "
                 f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, one run of `make bench-gpu`. "
                 f"Measured copy bandwidth {self.bw / 1e12:.2f} TB/s (read + written). Times are medians of "
                 "triton.testing.do_bench after a warm-up; 'graph' replays the launch from a CUDA graph (no host "
                 "launch cost, as in vLLM's decode). Kernels are timed through their launchers (no argument "
                 "checks). The reference: the op as called (checks and their host syncs included, eager) and "
                 "its core (the work after the checks) from a CUDA graph where it has no host sync; "
                 "reference / kernel divides the reference's better time by the kernel's graph time. Floors: "
                 f"bytes over the copy bandwidth; the scorer's FLOPs over {BF16_TFLOPS / 1e12:.0f} TFLOP/s (bf16, "
                 "measured on this GPU kind) when that is larger.", "",
                 "| stage | shape | triton | triton (graph) | floor | graph / floor | reference op | "
                 "reference core (graph) | reference / kernel | plain torch | torch / kernel |",
                 "|---|---|---|---|---|---|---|---|---|---|---|", *self.rows, "", "## Targets", ""]
        for key, target in TARGETS_US.items():
            if key in self.results:
                tg = self.results[key]["tg"]
                lines.append(f"* {key}: {tg * 1e3:.1f} us from a graph (target <= {target:.0f} us: "
                             f"{'met' if tg * 1e3 <= target else 'NOT met'})")
            else:
                lines.append(f"* {key}: not measured (see failures)")
        worst = [(v["ref"] / v["tg"], k) for k, v in self.results.items() if v.get("ref") and v.get("tg")]
        if worst:
            r, k = max(worst)
            lines.append(f"* reference / kernel <= 20x for every stage: {'met' if r <= 20 else 'NOT met'} "
                         f"(largest: {k}, {r:.1f}x)")
        if "top-k (k=1024)" in self.results:
            r = self.results["top-k (k=1024)"]
            lines.append(f"* top-k: {r['tg'] * 1e3:.1f} us vs torch.topk {r['tor'] * 1e3:.1f} us, both from a graph "
                         f"(target: faster: {'met' if r['tg'] < r['tor'] else 'NOT met'}, {r['tor'] / r['tg']:.1f}x)")
        for heading, items in self.notes.items():
            lines += ["", f"## {heading}", ""] + [f"* {n}" for n in items]
        if self.sweeps:
            lines += ["", "## Tilings (from a graph); the default is the op's choice", ""]
            fmt = lambda v: _ms(v) if isinstance(v, float) else f"failed ({v})"
            for name, (default, sweep) in self.sweeps.items():
                lines.append(f"* {name}: " + ", ".join(
                    f"{c}{' (default)' if c == default else ''} {fmt(v)}" for c, v in sweep.items()))
        lines += self.extra
        if self.failures:
            lines += ["", "## Failures", ""] + [f"* {f}" for f in self.failures]
        text = "\n".join(lines) + "\n"
        pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(out, text)
        if not quiet:
            print(text)


def _core(b: Bench, label: str, fn):
    """A reference core's time from a CUDA graph; a core that cannot be captured is noted."""
    try:
        return _bench(fn, graph=True)
    except Exception as e:  # noqa: BLE001 - reported, never hidden
        b.note("Failures", f"{label}: the reference core did not replay from a CUDA graph: {type(e).__name__}: "
               f"{str(e).splitlines()[0] if str(e) else ''}")
        torch.cuda.synchronize()
        return None


def _ms(v) -> str:
    return "-" if v is None else (f"{v * 1e3:.1f} us" if v < 1 else f"{v:.2f} ms")


def _k_path(b: Bench):
    import reference
    from optimized.triton_kernels import k_writer, pooling
    from reference import k_writer as ref_k
    from reference import pooling as ref_pool
    pool_kw, k_kw = k_path_inputs()                    # a 16384-token prefill chunk -> 4096 entries
    pk = dict(pool_kw)
    r = pk.pop("compress_ratio")
    pool = lambda: pooling.launch(*pk.values(), compress_ratio=r)
    t_pool, g_pool = _bench(pool), _bench(pool, graph=True)
    pooled_t = pool()
    pooled = pooled_t.nan_to_num()
    kargs = (pooled, k_kw["positions"], k_kw["cos_sin_cache"], k_kw["norm_weight"], k_kw["slot_mapping"])
    kc = k_kw["kv_cache"].clone()
    kopts = dict(norm_eps=k_kw["norm_eps"], compress_ratio=4, page_size=64, shuffle=[32, 16, 2])
    write = lambda: k_writer.launch(*kargs, kc, **kopts)
    t_kw, g_kw = _bench(write), _bench(write, graph=True)
    tiles = list(dict.fromkeys([pooling.TILE, (16, 2, 2, 128), (16, 1, 1, 64)]))
    b.sweeps["pooling"] = (pooling.TILE, {tile: _bench(lambda: pooling.launch(*pk.values(), compress_ratio=r, tile=tile),
                                                       graph=True) for tile in tiles})
    for tile in tiles[1:]:
        other = pooling.launch(*pk.values(), compress_ratio=r, tile=tile)
        b.note("Bytes", f"pooling tiling {tile} against the default {pooling.TILE}: {differing_elements(other, pooled_t)} of "
               f"{pooled_t.numel()} pooled values differ")
    b.sweeps["K writer"] = ((k_writer.TILE, k_writer.BT, 4), {
        tile: _bench(lambda: k_writer.launch(*kargs, kc, **kopts, tile=tile), graph=True)
        for tile in dict.fromkeys([(k_writer.TILE, k_writer.BT, 4), (64, 16, 4)])})
    # the reference: the ops as called, and their cores on the tokens that write
    ref_pool_op = _bench(lambda: reference.compress_pool(**pool_kw))
    sel = (ref_pool.boundary_mask(pool_kw["positions"], r) & (pool_kw["kv_slot_mapping"] >= 0)).nonzero().flatten()
    pargs = (pool_kw["state_cache"], pool_kw["block_table"], pool_kw["positions"][sel], pool_kw["req_index"][sel], r)
    ref_pool_core = _core(b, "pooling", lambda: ref_pool.softmax_pool(*ref_pool.gather_windows(*pargs)[:2]))
    ref_k_op = _bench(lambda: reference.k_norm_rope_mxfp4_cache(k=pooled, **k_kw))
    rows = ref_k.writer_mask(k_kw["positions"], k_kw["slot_mapping"], r).nonzero().flatten()
    wargs = (pooled[rows], k_kw["positions"][rows], k_kw["slot_mapping"][rows], k_kw["cos_sin_cache"],
             k_kw["norm_weight"], k_kw["kv_cache"])
    wopts = dict(norm_eps=k_kw["norm_eps"], compress_ratio=r, page_size=64, shuffle=layout.as_shuffle([32, 16, 2]))
    ref_k_core = _core(b, "K writer", lambda: ref_k.write_rows(*wargs, **wopts))
    state_bytes = pool_kw["state_cache"].numel() * 4
    ent = 4096
    b.row("pooling", "16384 tokens, D=128, r=4", t_pool, g_pool, (state_bytes + 16384 * 256) / b.bw * 1e3,
          ref_pool_op, ref_pool_core)
    b.row("K writer", "4096 entries of 16384 tokens", t_kw, g_kw, (ent * 256 + ent * ENTRY) / b.bw * 1e3,
          ref_k_op, ref_k_core)
    b.row("K path (pool + writer)", "16384-token prefill chunk", t_pool + t_kw, g_pool + g_kw,
          (state_bytes + 16384 * 256 + ent * ENTRY) / b.bw * 1e3, ref_pool_op + ref_k_op,
          None if None in (ref_pool_core, ref_k_core) else ref_pool_core + ref_k_core)
    # bytes: the reference on the GPU against the kernels and against the CPU reference
    ref_pooled = reference.compress_pool(**pool_kw)["pooled"]
    cpu_pool_kw = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in pool_kw.items()}
    b.note("Bytes", f"pooling, 16384 tokens: GPU reference vs kernel {differing_elements(ref_pooled, pooled_t)}, vs CPU "
           f"reference {differing_elements(ref_pooled, reference.compress_pool(**cpu_pool_kw)['pooled'])} of "
           f"{ref_pooled.numel()} values differ")
    ref_pages = reference.k_norm_rope_mxfp4_cache(k=pooled_t, **k_kw)["kv_cache"]
    kern_pages = k_writer.launch(pooled_t, *kargs[1:], k_kw["kv_cache"].clone(), **kopts)
    cpu_k_kw = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in k_kw.items()}
    b.note("Bytes", f"K writer, 4096 entries: GPU reference vs kernel {differing_elements(ref_pages, kern_pages)}, vs CPU "
           f"reference {differing_elements(ref_pages, reference.k_norm_rope_mxfp4_cache(k=pooled_t.cpu(), **cpu_k_kw)['kv_cache'])}"
           f" of {ref_pages.numel()} pool bytes differ")


INDEXER_LAYERS = 30          # V4-Pro's ratio-4 layers, each with one indexer K path per step


def _vllm_fused_k(pool_kw, k_kw):
    """vLLM's fused CUDA-path K kernel on these inputs: (launch, its pool), or (None, why)."""
    from optimized import BackendUnavailable, get_backend
    try:
        get_backend("vllm-cuda")
    except BackendUnavailable as e:
        return None, ("no `vllm-cuda` backend in this checkout" if "unknown backend" in str(e) else str(e))
    from optimized.vllm_kernels import launch as vlaunch
    from optimized.vllm_kernels.kernelset import kernel_set
    ks = kernel_set(interpreted=False)
    out = k_kw["kv_cache"].clone()
    built = vlaunch.fused_k("mxfp4", **dict(pool_kw, cos_sin_cache=k_kw["cos_sin_cache"],
                                            norm_weight=k_kw["norm_weight"], kv_cache=out,
                                            norm_eps=k_kw["norm_eps"], page_size=k_kw["page_size"]))
    kern = ks.kernels[vlaunch.K_KEYS["mxfp4"]]
    return (lambda: vlaunch.run(kern, built, interpreted=False)), out


def _fused_k(b: Bench):
    """The ROCm K path as one launch (optimized/triton_kernels/fused_k.py) beside the split
    path (pooling + K writer) and vLLM's fused CUDA-path kernel, on the same inputs in the same
    run: times from graphs, and the pages' bytes against the split path's."""
    from optimized.triton_kernels import fused_k, k_writer, pooling
    heading = "Fused ROCm K path (one launch: pool -> norm -> RoPE -> MXFP4 -> paged store)"
    pool_kw, k_kw = k_path_inputs()
    pk = dict(pool_kw)
    r = pk.pop("compress_ratio")
    wargs = (k_kw["positions"], k_kw["cos_sin_cache"], k_kw["norm_weight"], k_kw["slot_mapping"])
    fargs = (*pk.values(), k_kw["cos_sin_cache"], k_kw["norm_weight"])
    times, pages = {}, {}
    for shuffle, name in (([32, 16, 2], "preshuffled"), (None, "natural")):
        opts = dict(norm_eps=k_kw["norm_eps"], compress_ratio=r, page_size=64, shuffle=shuffle)
        split_out, fused_out = k_kw["kv_cache"].clone(), k_kw["kv_cache"].clone()

        def split():
            k_writer.launch(pooling.launch(*pk.values(), compress_ratio=r), *wargs, split_out, **opts)

        def fused(tile=None, out=fused_out, certify=True):
            fused_k.launch(*fargs, out, **opts, tile=tile, certify=certify)
        split()
        fused()
        times[name] = (_bench(split), _bench(split, graph=True), _bench(fused), _bench(fused, graph=True))
        pages[name] = (split_out, fused_out)
        b.note("Bytes", f"fused K path, {name} pages, 16384 tokens: {differing_elements(fused_out, split_out)} of "
               f"{split_out.numel()} pool bytes differ from the split path's (pooling + K writer)")
        if name == "preshuffled":
            sweep = {}
            for tile in FUSED_TILES:
                out = k_kw["kv_cache"].clone()
                try:
                    fused(tile, out)
                    sweep[tile] = _bench(lambda: fused(tile, out), graph=True)
                    if not torch.equal(out, split_out):
                        b.note("Bytes", f"fused tiling {tile}: {differing_elements(out, split_out)} pool bytes "
                               f"differ from the split path's")
                except Exception as e:  # noqa: BLE001 - a tiling that does not compile is reported
                    sweep[tile] = f"{type(e).__name__}"
            out = k_kw["kv_cache"].clone()
            fused(None, out, False)
            sweep["default, every value pooled in fp64"] = _bench(lambda: fused(None, out, False), graph=True)
            b.note("Bytes", f"fused, every value pooled in fp64: {differing_elements(out, split_out)} pool bytes differ "
                   f"from the split path's")
            out = k_kw["kv_cache"].clone()
            fused(None, out, "unchecked")
            sweep["default, fp32 pooling without the fp64 refinement (measurement only)"] = _bench(
                lambda: fused(None, out, "unchecked"), graph=True)
            b.sweeps["fused K path"] = (fused_k.TILE, sweep)
            _fused_k_residency(b, heading)
    state_bytes = pool_kw["state_cache"].numel() * 4
    floor = (state_bytes + 4096 * ENTRY) / b.bw * 1e3          # no pooled row through memory
    for name in ("preshuffled", "natural"):
        t_s, g_s, t_f, g_f = times[name]
        b.row(f"K path, fused, {name}", "16384-token prefill chunk", t_f, g_f, floor)
        b.note(heading, f"{name} pages, 16384-token chunk: split {_ms(t_s)} (graph {_ms(g_s)}), fused "
               f"{_ms(t_f)} (graph {_ms(g_f)}): {(g_s - g_f) * 1e3:.1f} us saved per layer from graphs, "
               f"{(g_s - g_f) * 1e3 * INDEXER_LAYERS:.0f} us per step of {INDEXER_LAYERS} indexer layers")
    theirs, out_v = _vllm_fused_k(pool_kw, k_kw)
    if theirs is None:
        b.note(heading, f"vLLM's fused CUDA-path kernel: not run ({out_v})")
    else:
        theirs()
        g_v = _bench(theirs, graph=True)
        g_f = times["preshuffled"][3]
        b.note(heading, f"vLLM's fused CUDA-path kernel (compress_norm_rope_mxfp4_cache, natural pages, fp32 "
               f"rounding) on the same chunk: {_ms(_bench(theirs))} (graph {_ms(g_v)}); ours fused preshuffled / "
               f"vLLM's = {g_f / g_v:.2f}, natural / vLLM's = {times['natural'][3] / g_v:.2f} from graphs "
               f"(target <= 1: {'met' if g_f <= g_v else 'NOT met'}); its pages against our fused natural ones "
               f"(other rounding points, docs/paths.md): {differing_elements(out_v, pages['natural'][1])} of "
               f"{out_v.numel()} bytes differ")
    _fused_k_small(b, heading)


def _fused_k_residency(b: Bench, heading: str):
    """The sweep's tilings as this GPU's Triton compiles them (`harness.bench.resources`): the
    registers and spills that set how many programs an SM holds, which the times follow."""
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    if torch.version.hip is not None or arch not in resources.ARCHS:
        b.note(heading, f"registers per tiling: not compiled for this GPU (sm_{arch}; compiled for "
                        f"{', '.join(f'sm_{a}' for a in resources.ARCHS)})")
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        rows = resources.fused_k_rows(FUSED_TILES, arch=arch, sms=sms)
    except RuntimeError as e:
        b.note(heading, f"registers per tiling: not compiled ({e})")
        return
    b.note(heading, f"registers per tiling, as this Triton compiles them for sm_{arch} (tile: registers, spilled "
                    f"bytes a thread, programs per SM, waves of the 16k chunk on this GPU's {sms} SMs): "
                    + "; ".join(f"{r['tile']}: {r['registers']}, {r['spill_stores']} B, {r['programs_per_sm']}, "
                                f"{r['waves']}" for r in rows))


def _fused_k_small(b: Bench, heading: str):
    """Decode-sized batches, where the launch saved is most of the time."""
    from optimized.triton_kernels import fused_k, k_writer, pooling
    r = 4
    for tokens in (256,):
        pkw, kkw = k_path_inputs(tokens=tokens, seed=1)
        pkd = dict(pkw)
        pkd.pop("compress_ratio")
        opts = dict(norm_eps=kkw["norm_eps"], compress_ratio=r, page_size=64, shuffle=[32, 16, 2])
        so, fo = kkw["kv_cache"].clone(), kkw["kv_cache"].clone()
        wa = (kkw["positions"], kkw["cos_sin_cache"], kkw["norm_weight"], kkw["slot_mapping"])
        split = lambda: k_writer.launch(pooling.launch(*pkd.values(), compress_ratio=r), *wa, so, **opts)
        fused = lambda: fused_k.launch(*pkd.values(), kkw["cos_sin_cache"], kkw["norm_weight"], fo, **opts)
        split()
        fused()
        g_s, g_f = _bench(split, graph=True), _bench(fused, graph=True)
        b.note(heading, f"{tokens} tokens (a decode-sized batch), preshuffled: split graph {_ms(g_s)}, fused graph "
               f"{_ms(g_f)}: {(g_s - g_f) * 1e3:.1f} us per layer, {(g_s - g_f) * 1e3 * INDEXER_LAYERS:.0f} us "
               f"per step of {INDEXER_LAYERS} layers; {differing_elements(fo, so)} of {so.numel()} bytes differ")


def _q_quant(b: Bench):
    import reference
    from optimized.triton_kernels import q_quant
    from reference import q_quant as ref_q
    from reference import rope
    g = torch.Generator().manual_seed(3)
    cs = rope.cos_sin_cache(131072, 64, 160000.0, yarn_factor=16.0).cuda()
    for label, t in (("Q quant decode", 64), ("Q quant prefill", 4096)):
        q = torch.randn(t, 64, 128, generator=g).to(torch.bfloat16).cuda()
        pos = torch.randint(0, 131072, (t,), generator=g).cuda()
        w = torch.randn(t, 64, generator=g).to(torch.bfloat16).cuda()
        fn = lambda: q_quant.launch(q, pos, cs)
        ref_op = _bench(lambda: reference.q_rope_mxfp4_quant(q=q, positions=pos, cos_sin_cache=cs, weights=w,
                                                             weights_scale=0.01))
        ref_core = _core(b, label, lambda: ref_q.quantize_q(q, pos, cs, w, 0.01))
        nbytes = q.numel() * 2 + q.numel() // 2 + q.numel() // 32 + t * 8
        b.row(label, f"{t} tokens x 64 heads", _bench(fn), _bench(fn, graph=True), nbytes / b.bw * 1e3, ref_op, ref_core)
        got = q_quant.launch(q, pos, cs)
        ref = reference.q_rope_mxfp4_quant(q=q, positions=pos, cos_sin_cache=cs, weights=w, weights_scale=0.01)
        cpu = reference.q_rope_mxfp4_quant(q=q.cpu(), positions=pos.cpu(), cos_sin_cache=cs.cpu(), weights=w.cpu(),
                                           weights_scale=0.01)
        b.note("Bytes", f"{label}: GPU reference vs kernel {differing_elements(ref['q_fp4'], got[0])} value and "
               f"{differing_elements(ref['q_scale'], got[1])} scale bytes differ; vs CPU reference "
               f"{sum(differing_elements(ref[k], cpu[k]) for k in ref)} of {sum(v.numel() for v in ref.values())} elements")


def _scorers(b: Bench):
    import reference
    from optimized.triton_kernels import scoring
    from reference import scoring as ref_scoring
    # decode: 64 rows at 128k context (64 sequences of 32768 entries; 151 MB of pages);
    # prefill: 4096 causal rows of one 32k-token sequence (8192 entries)
    for name, (seqs, rows, ctx, causal) in {"scorer decode": (64, 1, 131072, False),
                                             "scorer prefill": (1, 4096, 32768, True)}.items():
        kw = scorer_inputs(seqs, rows, ctx, causal)
        width = kw["block_table"].shape[1] * 64
        default = scoring.pick_config(rows, 64)
        configs = list(dict.fromkeys([default, *CONFIGS[name]]))
        # row tiles built before timing: a host copy cannot run inside a graph capture
        tile_cache = {c[0]: scoring.row_tiles(kw["query_start_loc"].cpu(), c[0]).cuda() for c in configs}

        def call(cfg, words=False):
            return scoring.launch(kw["q_fp4"], kw["q_scale"], kw["weights"], kw["kv_cache"], kw["block_table"],
                                  tile_cache[cfg[0]], kw["row_ends"], width=width, page_size=64, shuffle=[32, 16, 2],
                                  clean_logits=False, config=cfg, words=words)
        sweep = {}
        for cfg, words in [(c, False) for c in configs]:
            label = cfg if not words else f"{cfg} + scale words"
            try:
                sweep[label] = _bench(lambda: call(cfg, words), graph=True)
            except Exception as e:  # noqa: BLE001 - a tiling this triton cannot build is noted
                sweep[label] = f"{type(e).__name__}"
        b.sweeps[name] = (default, sweep)
        t, tg = _bench(lambda: call(default)), sweep[default]
        if not isinstance(tg, float):
            raise RuntimeError(f"the default tiling {default} failed: {tg}")
        got = call(default)
        tor = _bench(lambda: torch_dequant_matmul(kw))
        ref_op = _bench(lambda: reference.paged_mxfp4_mqa_logits(**kw))
        # the core: the scoring after the checks and the grouping (one plan per group of
        # sequences), as the other stages' cores; the op reads its flags after it
        geo = dict(page_size=64, head_dim=128, shuffle=layout.as_shuffle([32, 16, 2]))
        plans = list(ref_scoring.group_plans(kw["query_start_loc"].tolist(), kw["query_start_loc"], kw["row_ends"],
                                             kw["block_table"], 64, 128))
        ends = kw["row_ends"].long()
        ref_core = _core(b, name, lambda: [ref_scoring.group_core_i8(p, kw["q_fp4"], kw["q_scale"], kw["weights"],
                                                                     kw["kv_cache"], ends, geo) for p in plans])
        ref64 = ref_scoring.paged_mxfp4_mqa_logits_fp64(**kw)
        valid = torch.arange(width, device="cuda")[None] < kw["row_ends"].long()[:, None]
        x, y = got[valid].double(), ref64[valid]
        metric = float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())
        b.note("Bytes", f"{name}: kernel vs GPU reference, metric {metric:.2e} (<= 1e-12); the reference "
               f"scored it with the {ref_scoring.last_path} core")
        nbytes = kw["kv_cache"].numel() + kw["q_fp4"].numel() * 1.0625 + rows * seqs * width * 4
        flops = 2 * 64 * 128 * float(kw["row_ends"].double().sum())
        floor = max(nbytes / b.bw, flops / BF16_TFLOPS) * 1e3
        b.row(name, f"{seqs * rows} rows x {ctx // 4 // 1024}k entries, H=64", t, tg, floor, ref_op, ref_core, tor)
        plans = None
        if name == "scorer decode":
            cpu = ref_scoring.paged_mxfp4_mqa_logits_fp64(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                             for k, v in kw.items()})
            a32, c32 = ref64.float().cpu(), cpu.float()
            fin = c32.isfinite()
            ulp = (a32[fin].view(torch.int32).long() - c32[fin].view(torch.int32).long()).abs()
            b.note("Bytes", f"{name}: GPU reference vs CPU reference: {int((ulp > 0).sum())} of {int(fin.sum())} fp32 "
                   f"logits differ (at most {int(ulp.max())} ulp); fp64 max relative difference "
                   f"{float(((ref64.cpu() - cpu).abs() / cpu.abs().clamp_min(1e-300))[fin].max()):.1e}")
            if not b.quick:
                wide = scorer_inputs(seqs, rows, ctx, causal, wide=True)
                tw = _bench(lambda: reference.paged_mxfp4_mqa_logits(**wide))
                b.note("Reference at other scales", f"{name}, scale bytes random over 12 binades per block "
                       f"({ref_scoring.last_path} core): {_ms(tw)}, {tw / tg:.1f}x the kernel")
                wide = None
        kw = ref64 = got = None            # free the pages before the next shape
        torch.cuda.empty_cache()


def _top_k(b: Bench):
    import reference
    from optimized.triton_kernels import topk
    torch.manual_seed(0)
    logits = torch.randn(64, 32768, device="cuda")
    lens = torch.full((64,), 32768, device="cuda")
    t = _bench(lambda: topk.launch(logits, lens, 1024))
    tg = _bench(lambda: topk.launch(logits, lens, 1024), graph=True)
    tt = _bench(lambda: torch.topk(logits, 1024, dim=1), graph=True)
    ties = logits.bfloat16().float()          # bf16-rounded logits: many ties, no early stop
    b.sweeps["top-k"] = ("in registers", {
        "in registers, bf16-rounded logits (ties)": _bench(lambda: topk.launch(ties, lens, 1024), graph=True),
        "streamed (rows past 32768 columns)": _bench(lambda: topk.launch(logits, lens, 1024, resident=False),
                                                     graph=True)})
    ref = _bench(lambda: reference.topk(logits=logits, lengths=lens, k=1024))
    b.row("top-k (k=1024)", "64 rows x 32768", t, tg, logits.numel() * 4 / b.bw * 1e3, ref, None, tt)
    gpu = reference.topk(logits=logits, lengths=lens, k=1024)["indices"]
    cpu = reference.topk(logits=logits.cpu(), lengths=lens.cpu(), k=1024)["indices"]
    b.note("Bytes", f"top-k: GPU reference vs CPU reference, {int((gpu.sort(1).values.cpu() != cpu.sort(1).values).sum())} "
           f"of {gpu.numel()} selected indices differ (as sets per row)")


def _peers(b: Bench):
    """vLLM's own CUDA kernels on the same inputs, next to ours: the fused pool + K kernel
    against our pooling + K writer (the CUDA path: fp32 pooled rows, natural page order),
    launchers and graphs; and both through the op interface."""
    from optimized import BackendUnavailable, get_backend
    try:
        peer = get_backend("vllm-cuda")
    except BackendUnavailable as e:
        why = ("no `vllm-cuda` backend in this checkout" if "unknown backend" in str(e) else str(e))
        b.note("Peers", f"vLLM CUDA kernels: not run ({why})")
        return
    from optimized.triton_kernels import k_writer, pooling
    from optimized.vllm_kernels import launch as vlaunch
    from optimized.vllm_kernels.kernelset import kernel_set
    from reference import rope
    pool_kw, k_kw = k_path_inputs()
    pk = dict(pool_kw)
    r = pk.pop("compress_ratio")
    natural = k_kw["kv_cache"].clone()
    fused_kw = dict(pool_kw, cos_sin_cache=k_kw["cos_sin_cache"], norm_weight=k_kw["norm_weight"],
                    kv_cache=natural, norm_eps=k_kw["norm_eps"], page_size=64)
    ks = kernel_set(interpreted=False)
    out_v = natural.clone()
    built = vlaunch.fused_k("mxfp4", **dict(fused_kw, kv_cache=out_v, compress_ratio=r))
    kern = ks.kernels[vlaunch.K_KEYS["mxfp4"]]
    theirs = lambda: vlaunch.run(kern, built, interpreted=False)
    out_o = natural.clone()
    kopts = dict(norm_eps=k_kw["norm_eps"], compress_ratio=r, page_size=64, shuffle=None, rounding="cuda")

    def ours():
        p32 = pooling.launch(*pk.values(), compress_ratio=r, out_bf16=False)
        k_writer.launch(p32, k_kw["positions"], k_kw["cos_sin_cache"], k_kw["norm_weight"], k_kw["slot_mapping"],
                        out_o, **kopts)
    t_v, g_v = _bench(theirs), _bench(theirs, graph=True)
    t_o, g_o = _bench(ours), _bench(ours, graph=True)
    theirs()
    ours()
    b.note("Peers", f"K path, CUDA path (16384-token chunk, natural pages): vLLM's fused "
           f"compress_norm_rope_mxfp4_cache kernel {_ms(t_v)} (graph {_ms(g_v)}); ours, pooling + K writer "
           f"{_ms(t_o)} (graph {_ms(g_o)}); ours / vLLM's = {g_o / g_v:.2f} from graphs; "
           f"{differing_elements(out_o, out_v)} of {out_o.numel()} pool bytes differ ({ks.note()})")
    tp = _bench(lambda: peer.compress_norm_rope_mxfp4_cache(**fused_kw))
    b.note("Peers", f"compress_norm_rope_mxfp4_cache through vLLM's op interface: {_ms(tp)}")
    ours_be = get_backend("triton")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(64, 64, 128, generator=g).to(torch.bfloat16).cuda()
    qkw = dict(q=q, positions=torch.randint(0, 131072, (64,), generator=g).cuda(),
               cos_sin_cache=rope.cos_sin_cache(131072, 64, 160000.0, yarn_factor=16.0).cuda(),
               weights=torch.randn(64, 64, generator=g).to(torch.bfloat16).cuda(), weights_scale=0.0110485)
    if peer.supports("q_rope_mxfp4_quant"):
        tp = _bench(lambda: peer.q_rope_mxfp4_quant(**qkw))
        to = _bench(lambda: ours_be.q_rope_mxfp4_quant(**qkw))
        b.note("Peers", f"q_rope_mxfp4_quant through the op interface: ours {_ms(to)}, vLLM's {_ms(tp)} "
               f"(ours / vLLM's = {to / tp:.2f}; target <= 1)")


def _variants(b: Bench):
    var = measure_variants()
    for v, (nd, n) in var.items():
        b.note("Upstream-style shortcuts (measured on this GPU)",
               f"K writer with {v}: {nd} of {n * ENTRY} bytes differ ({nd / n * 1e6:.0f} per million entries)")
    pd = measure_pool_fast_exp()
    b.note("Upstream-style shortcuts (measured on this GPU)",
           f"pooling with fp32 exp instead of fp64: {pd[0]} of {pd[1]} pooled bf16 values differ (max {pd[2]} ulp)")


def _capture(b: Bench):
    """The capture hook's overhead (harness.bench.capture), its rows after the tables."""
    capture_bench.section_for(b.extra)()


def _shadow(b: Bench):
    """Shadow mode (harness.bench.shadow): the added time per step at 1/1000 and 1/100, eager
    and graph; a catalogue fault flagged and its dump replayed on the CPU; 0 alarms over
    10,000 checked steps of a correct loop (2,000 with --quick); the checker stopped mid-run."""
    shadow_bench.section_for(b.extra, alarm_steps=2000 if b.quick else 10000)()


# the parts of a run, in order (a new section is a function of the Bench, added here)
SUITE_TARGET_S = 60.0        # `mxval validate --suite full --backend triton`, wall clock
PEAK_RATIO_TARGET = 3.0      # each case's GPU peak against its tensors


def _suite(b: Bench):
    """The full suite through the Triton backend as a user runs it (`mxval validate --suite
    full --backend triton`, default -j), from a fresh Triton cache (every kernel compiled:
    a fresh machine, or a changed kernel); then in graph mode (`--graph`); without --quick
    also with -j 1 (one process).
    Wall clock against SUITE_TARGET_S, and each case's GPU peak against its tensors."""
    import json
    import os
    import resource
    import subprocess
    import tempfile
    import time
    runs = [("default -j (auto)", []), ("--graph (every decode step replayed from CUDA graphs), default -j",
                                         ["--graph"])] + ([] if b.quick else [("-j 1", ["-j", "1"])])
    for label, extra in runs:
        with tempfile.TemporaryDirectory(prefix="mxval-bench-suite-") as tmp:
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
            env.pop("MXVAL_GPU_MEMORY_FRACTION", None)
            out = os.path.join(tmp, "report")
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "harness", "validate", "--suite", "full", "--backend",
                                "triton", "--report-dir", out, "-q", *extra], env=env, capture_output=True,
                               text=True, timeout=900)
            wall = time.perf_counter() - t0
            try:
                data = json.loads(pathlib.Path(out, "report.json").read_text())
            except (OSError, ValueError):
                tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"the full suite ({label}) wrote no report (exit {p.returncode}): {tail[0]}")
        s, run = data["summary"], data["run"]
        cases = [c for c in data["cases"] if c.get("gpu_peak_bytes") is not None and c.get("tensor_bytes")]
        worst = max(cases, key=lambda c: c["gpu_peak_bytes"] / c["tensor_bytes"])
        over = sum(c["gpu_peak_bytes"] > PEAK_RATIO_TARGET * c["tensor_bytes"] for c in cases)
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20
        b.note("Full suite (`mxval validate --suite full --backend triton`, fresh Triton cache)",
               f"{label}: {wall:.1f} s wall (target <= {SUITE_TARGET_S:.0f} s: "
               f"{'met' if wall <= SUITE_TARGET_S else 'NOT met'}), the run's own clock {run.get('seconds')} s, "
               f"exit {p.returncode}; {s.get('pass')} pass, {s.get('fail')} fail, {s.get('error')} error, "
               f"{s.get('nonfinite_input')} planted non-finite, {s.get('skipped')} skipped; largest case GPU peak "
               f"{max(c['gpu_peak_bytes'] for c in cases) / 2 ** 30:.1f} GiB; peak / tensors at most "
               f"{worst['gpu_peak_bytes'] / worst['tensor_bytes']:.2f}x ({worst['case']}; target <= "
               f"{PEAK_RATIO_TARGET:g}x: {'met' if not over else f'NOT met in {over} case(s)'}); largest process "
               f"so far {rss:.1f} GiB of host memory")


PARTS = {"k-path": _k_path, "fused-k": _fused_k, "q-quant": _q_quant, "scorers": _scorers, "top-k": _top_k, "peers": _peers,
         "shortcuts": _variants, "capture": _capture, "shadow": _shadow,
         "suite": _suite}


if __name__ == "__main__":
    sys.exit(main())
