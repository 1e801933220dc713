"""GPU benchmark of the Triton backend at DeepSeek-V4-Pro shapes (`make bench-gpu`).

For each kernel: its time (triton.testing.do_bench, median; and replayed from a CUDA
graph, which removes the host's launch cost as vLLM's decode does), the floor (bytes over
the measured device copy bandwidth, or the scorer's FLOPs over the bf16 tensor-core rate),
the reference (pure torch, fp64 scores) on the same GPU, plain torch (the scorer as
dequantize-then-matmul, torch.topk), and peers: vLLM's own CUDA kernels when the
`vllm-cuda` backend runs here (else the row says why not). Kernels are timed through their
launchers (the op wrappers add argument checks with host syncs and, for the K writer, a
copy of the pool that the in-place production kernel does not make); peers are timed
through the op interface, next to ours through the same interface. Also measures, for
docs/triton-notes.md, how often the upstream-style shortcuts (fp32 norm sum + approximate
rsqrt + FMA; fp32 exp in the pooling) change bytes. Writes a markdown table (default
reports/bench-gpu.md).

    python -m harness.bench.gpu [--out reports/bench-gpu.md] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch

from harness.bench import capture as capture_bench
from reference import layout

ENTRY = layout.entry_bytes(128)          # bytes of one MXFP4 key (D = 128)

BF16_TFLOPS = 790e12      # dense bf16 tensor-core rate measured on an H200 (8192^3 matmul, random data)
# scorer tilings (BM rows, BN entries, warps, stages[, register cap]) timed beside the
# default pick_config choice
CONFIGS = {"scorer decode": [(1, 64, 4, 3, 128), (1, 64, 4, 3, 96), (1, 64, 4, 4), (1, 128, 8, 3)],
           "scorer prefill": [(2, 64, 4, 3, 128), (4, 128, 8, 2), (2, 64, 4, 2)]}
# the targets on the H200 (microseconds)
TARGETS_US = {"scorer decode": 100.0, "scorer prefill": 1000.0, "K path (pool + writer)": 27.0}


def _bench(fn, reps_ms=100, max_reps=None, graph=False):
    import triton.testing
    if max_reps == 1:          # slow torch paths: one timed run (no compilation to warm up)
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3
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


def scorer_inputs(seqs: int, rows_per_seq: int, context_tokens: int, causal: bool, seed=0):
    """Pages of valid random MXFP4 entries (scale bytes in a sane range) on the GPU."""
    from reference.formats import preset
    p = preset()
    ps, h, d = p.page_size, p.index_heads, p.head_dim
    entries = context_tokens // p.compress_ratio
    pages_per = entries // ps
    torch.manual_seed(seed)
    pool = torch.randint(0, 256, (seqs * pages_per, layout.page_bytes(ps, 128)), dtype=torch.uint8, device="cuda")
    pool[:, ps * 64:] = torch.randint(118, 130, (seqs * pages_per, ps * 4), dtype=torch.uint8, device="cuda")
    table = torch.randperm(seqs * pages_per, device="cuda").view(seqs, pages_per).to(torch.int32)
    rw = seqs * rows_per_seq
    if causal:
        posn = context_tokens - rows_per_seq + torch.arange(rows_per_seq, device="cuda")
        ends = ((posn + 1) // p.compress_ratio).repeat(seqs)
    else:
        ends = torch.full((rw,), entries, device="cuda")
    return dict(q_fp4=torch.randint(0, 256, (rw, h, d // 2), dtype=torch.uint8, device="cuda"),
                q_scale=torch.randint(120, 130, (rw, h, d // 32), dtype=torch.uint8, device="cuda"),
                weights=torch.randn(rw, h, device="cuda"), kv_cache=pool,
                query_start_loc=torch.arange(0, rw + 1, rows_per_seq, device="cuda"),
                context_lens=torch.full((seqs,), entries, device="cuda"), block_table=table,
                row_ends=ends.to(torch.int32), page_size=ps, shuffle=[32, 16, 2])


# --- the plain torch scorer: dequantize every key, then matmul ------------------------------

def torch_dequant_matmul(kw, row_chunk=512):
    """What a straightforward torch implementation does: gather and dequantize the keys to
    bf16, dequantize q, bf16 matmul with fp32 output, relu, weight, sum over heads."""
    from reference.formats import E2M1_VALUES
    lut = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)],
                       device="cuda", dtype=torch.bfloat16)
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/bench-gpu.md")
    ap.add_argument("--quick", action="store_true", help="skip the slow reference timings at prefill")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench-gpu: no CUDA/ROCm GPU visible to torch", file=sys.stderr)
        return 2
    import triton

    from optimized import BackendUnavailable, get_backend
    try:
        get_backend("triton")
    except BackendUnavailable as e:
        print(f"bench-gpu: {e}", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name(0)
    bw = copy_bandwidth()
    lines = ["# GPU benchmark: Triton backend at DeepSeek-V4-Pro shapes", "",
             f"Machine: {dev}; torch {torch.__version__}, triton {triton.__version__}; "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Measured copy bandwidth "
             f"{bw / 1e12:.2f} TB/s (read + written). Times are medians of triton.testing.do_bench; "
             "'graph' replays the launch from a CUDA graph (no host launch cost, as in vLLM's decode). "
             "The reference: one timed run (it compiles nothing). Floors: bytes over the copy bandwidth; "
             f"the scorer's FLOPs over {BF16_TFLOPS / 1e12:.0f} TFLOP/s (bf16, measured on this GPU kind) "
             "when that is larger.", "",
             "| kernel | shape | triton | triton (graph) | floor | graph / floor | reference (same GPU) "
             "| plain torch | vs reference | vs torch |", "|---|---|---|---|---|---|---|---|---|---|"]
    results, sweeps, notes, failures = {}, {}, [], []

    def row(name, shape, t, tg, floor, ref=None, tor=None):
        results[name] = dict(t=t, tg=tg, floor=floor, ref=ref, tor=tor)
        f = lambda v: "-" if v is None else (f"{v * 1e3:.1f} us" if v < 1 else f"{v:.2f} ms")
        sp = lambda v: "-" if v is None else f"{v / t:.1f}x"
        ratio = "-" if tg is None or not floor else f"{tg / floor:.1f}x"
        lines.append(f"| {name} | {shape} | {f(t)} | {f(tg)} | {f(floor)} | {ratio} | {f(ref)} | {f(tor)} "
                     f"| {sp(ref)} | {sp(tor)} |")
        print(lines[-1], flush=True)

    def section(fn):
        """Run one part; a failure is written into the report, and the rest still runs."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported, never hidden
            failures.append(f"{fn.__name__}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print("FAILED", failures[-1], flush=True)
            torch.cuda.empty_cache()

    def k_path():
        _k_path(row, bw, sweeps)

    def q_quant():
        _q_quant(row, bw)

    def scorers():
        _scorers(row, sweeps, results, a.quick, bw)

    def top_k():
        _top_k(row, bw, sweeps)

    def peers():
        _peers(notes)

    for part in (k_path, q_quant, scorers, top_k, peers):
        section(part)
    var = pd = None

    def variants():
        nonlocal var, pd
        var = measure_variants()
        pd = measure_pool_fast_exp()

    section(variants)
    section(capture_bench.section_for(lines))
    _write_report(a.out, lines, results, sweeps, notes, var, pd, failures)
    return 1 if failures else 0


def _k_path(row, bw, sweeps):
    import reference
    from optimized.triton_kernels import k_writer, pooling
    # K path: a 16384-token prefill chunk -> 4096 entries
    pool_kw, k_kw = k_path_inputs()
    pk = dict(pool_kw)
    r = pk.pop("compress_ratio")
    pool = lambda: pooling.launch(*pk.values(), compress_ratio=r)
    t_pool, g_pool = _bench(pool), _bench(pool, graph=True)
    pooled = pool().nan_to_num()
    kargs = (pooled, k_kw["positions"], k_kw["cos_sin_cache"], k_kw["norm_weight"], k_kw["slot_mapping"])
    kc = k_kw["kv_cache"].clone()
    kopts = dict(norm_eps=k_kw["norm_eps"], compress_ratio=4, page_size=64, shuffle=[32, 16, 2])
    write = lambda: k_writer.launch(*kargs, kc, **kopts)
    t_kw, g_kw = _bench(write), _bench(write, graph=True)
    sweeps["pooling"] = (pooling.TILE, {tile: _bench(lambda: pooling.launch(*pk.values(), compress_ratio=r, tile=tile),
                                                     graph=True)
                                        for tile in dict.fromkeys([pooling.TILE, (16, 2, 2, 128), (16, 1, 1, 64)])})
    sweeps["K writer"] = ((k_writer.TILE, k_writer.BT, 4), {tile: _bench(lambda: k_writer.launch(*kargs, kc, **kopts, tile=tile),
                                                                         graph=True)
                                                            for tile in dict.fromkeys([(k_writer.TILE, k_writer.BT, 4), (64, 16, 4)])})
    ref_pool = _bench(lambda: reference.compress_pool(**pool_kw), max_reps=1)
    ref_k = _bench(lambda: reference.k_norm_rope_mxfp4_cache(k=pooled, **k_kw), max_reps=1)
    state_bytes = pool_kw["state_cache"].numel() * 4
    ent = 4096
    row("pooling", "16384 tokens, D=128, r=4", t_pool, g_pool, (state_bytes + 16384 * 256) / bw * 1e3, ref_pool)
    row("K writer", "4096 entries of 16384 tokens", t_kw, g_kw, (ent * 256 + ent * ENTRY) / bw * 1e3, ref_k)
    row("K path (pool + writer)", "16384-token prefill chunk", t_pool + t_kw, g_pool + g_kw,
        (state_bytes + 16384 * 256 + ent * ENTRY) / bw * 1e3, ref_pool + ref_k)


def _q_quant(row, bw):
    import reference
    from optimized.triton_kernels import q_quant
    from reference import rope
    g = torch.Generator().manual_seed(3)
    for label, t in (("Q quant decode", 64), ("Q quant prefill", 4096)):
        q = torch.randn(t, 64, 128, generator=g).to(torch.bfloat16).cuda()
        pos = torch.randint(0, 131072, (t,), generator=g).cuda()
        cs = rope.cos_sin_cache(131072, 64, 160000.0, yarn_factor=16.0).cuda()
        fn = lambda: q_quant.launch(q, pos, cs)
        w = torch.randn(t, 64, generator=g).to(torch.bfloat16).cuda()
        ref = _bench(lambda: reference.q_rope_mxfp4_quant(q=q, positions=pos, cos_sin_cache=cs, weights=w,
                                                          weights_scale=0.01), max_reps=1)
        nbytes = q.numel() * 2 + q.numel() // 2 + q.numel() // 32 + t * 8
        row(label, f"{t} tokens x 64 heads", _bench(fn), _bench(fn, graph=True), nbytes / bw * 1e3, ref)


def _scorers(row, sweeps, results, quick, bw):
    import reference
    from optimized.triton_kernels import scoring
    # decode: 64 rows at 128k context (64 sequences of 32768 entries; 143 MB of pages);
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
        for cfg, words in [(c, False) for c in configs] + [(default, True)]:
            label = cfg if not words else f"{cfg} + scale words"
            try:
                sweep[label] = _bench(lambda: call(cfg, words), graph=True)
            except Exception as e:  # noqa: BLE001 - a tiling this triton cannot build is noted
                sweep[label] = f"{type(e).__name__}"
        sweeps[name] = (default, sweep)
        t, tg = _bench(lambda: call(default)), sweep[default]
        if not isinstance(tg, float):
            raise RuntimeError(f"the default tiling {default} failed: {tg}")
        got = call(default)
        tor = _bench(lambda: torch_dequant_matmul(kw))
        ref = None
        if not (quick and causal):
            ref = _bench(lambda: reference.paged_mxfp4_mqa_logits(**kw), max_reps=1)
        ref64 = reference.scoring.paged_mxfp4_mqa_logits_fp64(**kw)
        valid = torch.arange(width, device="cuda")[None] < kw["row_ends"].long()[:, None]
        x, y = got[valid].double(), ref64[valid]
        results[name + " metric"] = float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())
        nbytes = kw["kv_cache"].numel() + kw["q_fp4"].numel() * 1.0625 + rows * seqs * width * 4
        flops = 2 * 64 * 128 * float(kw["row_ends"].double().sum())
        floor = max(nbytes / bw, flops / BF16_TFLOPS) * 1e3
        row(name, f"{seqs * rows} rows x {ctx // 4 // 1024}k entries, H=64", t, tg, floor, ref, tor)
        kw = ref64 = None            # free the pages before the next shape


def _top_k(row, bw, sweeps):
    import reference
    from optimized.triton_kernels import topk
    torch.manual_seed(0)
    logits = torch.randn(64, 32768, device="cuda")
    lens = torch.full((64,), 32768, device="cuda")
    t = _bench(lambda: topk.launch(logits, lens, 1024))
    tg = _bench(lambda: topk.launch(logits, lens, 1024), graph=True)
    tt = _bench(lambda: torch.topk(logits, 1024, dim=1), graph=True)
    ties = logits.bfloat16().float()          # bf16-rounded logits: many ties, no early stop
    sweeps["top-k"] = ("in registers", {
        "in registers, bf16-rounded logits (ties)": _bench(lambda: topk.launch(ties, lens, 1024), graph=True),
        "streamed (rows past 32768 columns)": _bench(lambda: topk.launch(logits, lens, 1024, resident=False),
                                                     graph=True)})
    ref = _bench(lambda: reference.topk(logits=logits, lengths=lens, k=1024), max_reps=1)
    row("top-k (k=1024)", "64 rows x 32768", t, tg, logits.numel() * 4 / bw * 1e3, ref, tt)


def _peers(notes):
    """vLLM's own CUDA kernels on the same inputs, through the op interface, next to ours."""
    from optimized import BackendUnavailable, get_backend
    try:
        peer = get_backend("vllm-cuda")
    except BackendUnavailable as e:
        why = ("no `vllm-cuda` backend in this checkout" if "unknown backend" in str(e) else str(e))
        notes.append(f"vLLM CUDA kernels: not run ({why})")
        return
    ours = get_backend("triton")
    pool_kw, k_kw = k_path_inputs()
    from optimized.triton_kernels import pooling
    pk = dict(pool_kw)
    r = pk.pop("compress_ratio")
    pooled32 = pooling.launch(*pk.values(), compress_ratio=r, out_bf16=False).nan_to_num()
    g = torch.Generator().manual_seed(3)
    from reference import rope
    q = torch.randn(64, 64, 128, generator=g).to(torch.bfloat16).cuda()
    qkw = dict(q=q, positions=torch.randint(0, 131072, (64,), generator=g).cuda(),
               cos_sin_cache=rope.cos_sin_cache(131072, 64, 160000.0, yarn_factor=16.0).cuda(),
               weights=torch.randn(64, 64, generator=g).to(torch.bfloat16).cuda(), weights_scale=0.0110485)
    cases = {"k_norm_rope_mxfp4_cache": dict(k=pooled32, rounding="cuda", **k_kw),
             "q_rope_mxfp4_quant": qkw}
    for op, kw in cases.items():
        if not peer.supports(op):
            notes.append(f"vLLM CUDA kernels: {op} not provided by the vllm-cuda backend")
            continue
        tp = _bench(lambda: getattr(peer, op)(**kw))
        to = _bench(lambda: getattr(ours, op)(**kw))
        notes.append(f"{op} through the op interface: ours {to * 1e3:.1f} us, vLLM's {tp * 1e3:.1f} us "
                     f"(ours / vLLM's = {to / tp:.2f}; target <= 1)")


def _write_report(out, lines, results, sweeps, notes, var, pd, failures):
    lines += ["", "## Targets", ""]
    for key, target in TARGETS_US.items():
        if key not in results:
            lines.append(f"* {key}: not measured (see failures)")
            continue
        tg = results[key]["tg"]
        lines.append(f"* {key}: {tg * 1e3:.1f} us from a graph (target <= {target:.0f} us: "
                     f"{'met' if tg * 1e3 <= target else 'NOT met'})")
    if "top-k (k=1024)" in results:
        r = results["top-k (k=1024)"]
        lines.append(f"* top-k: {r['tg'] * 1e3:.1f} us vs torch.topk {r['tor'] * 1e3:.1f} us, both from a graph "
                     f"(target: faster: {'met' if r['tg'] < r['tor'] else 'NOT met'}, {r['tor'] / r['tg']:.1f}x)")
    for name in ("scorer decode", "scorer prefill"):
        if name + " metric" in results:
            lines.append(f"* {name} agreement with the fp64 reference: metric {results[name + ' metric']:.2e} "
                         "(<= 1e-12)")
    lines += ["", "## Peers", ""] + [f"* {n}" for n in notes or ["none measured"]]
    if var:
        lines += ["", "## Upstream-style shortcuts (measured on this GPU)", "",
                  "| variant of the exact K writer | bytes differing | per million entries |", "|---|---|---|"]
        for v, (nd, n) in var.items():
            lines.append(f"| {v} | {nd} of {n * ENTRY} | {nd / n * 1e6:.0f} |")
    lines += ["", "## Tilings and variants (from a graph); the default is the op's choice", ""]
    fmt = lambda v: f"{v * 1e3:.1f} us" if isinstance(v, float) else f"failed ({v})"
    for name, (default, sweep) in sweeps.items():
        lines.append(f"* {name}: " + ", ".join(
            f"{c}{' (default)' if c == default else ''} {fmt(v)}" for c, v in sweep.items()))
    if pd:
        lines += ["", f"Pooling with fp32 exp instead of fp64: {pd[0]} of {pd[1]} pooled bf16 values differ "
                  f"(max {pd[2]} ulp)."]
    if failures:
        lines += ["", "## Failures", ""] + [f"* {f}" for f in failures]
    text = "\n".join(lines) + "\n"
    import pathlib
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
