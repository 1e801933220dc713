"""The reference on a GPU gives the CPU's bytes (`make test-gpu`).

Every op of the edge-case table (helpers.cases, GPU sizes) runs through the reference on
the CPU and on the GPU; pages, codes, scales, pooled rows, weights and top-k indices must be
identical. The scorer's logits are fp64 sums of exact products in an order the matmul
library picks, so they must agree within that sum's rounding (and then in fp32 within one
ulp). The GPU's batched cores (int8, fp32, fp64 matmuls) are checked against the CPU's
sequence-at-a-time path at the decode shape on adversarial scale bytes, and the
graph-capturable cores replay from a CUDA graph with the eager bits."""
import pytest
import torch
from helpers import cases, needs_gpu

import reference
from reference import k_writer, layout, pooling, q_quant, scoring

pytestmark = pytest.mark.gpu


def on(kw, dev):
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        both_nan = a.isnan() & b.isnan()
        w = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(((a.view(w) == b.view(w)) | both_nan).all())
    return torch.equal(a, b)


def sum_bound(kw, dev) -> torch.Tensor:
    """2 * H * 2**-53 * sum_h |w| relu(dot): how far two orders of the fp64 head sum can differ."""
    mag = scoring.paged_mxfp4_mqa_logits_fp64(**dict(on(kw, dev), weights=kw["weights"].abs().to(dev)))
    return (2 * kw["weights"].shape[1] * 2.0 ** -53 * mag).cpu()


CASES = [c for c in cases(scale=4) if "fp8" not in c[0]]


@needs_gpu
@pytest.mark.parametrize("op,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gpu_reference_gives_the_cpu_bytes(op, kw):
    cpu = reference.FUNCTIONS[op](**kw)
    gpu = reference.FUNCTIONS[op](**on(kw, "cuda"))
    assert set(cpu) == set(gpu)
    for name in cpu:
        assert gpu[name].is_cuda
        if name == "logits":
            # fp32 of two fp64 sums that differ by at most the bound: one ulp more at most
            a, b = cpu[name].double(), gpu[name].cpu().double()
            assert torch.equal(a.isinf(), b.isinf())
            fin = a.isfinite()
            tol = sum_bound(kw, "cpu") + a.abs() * torch.finfo(torch.float32).eps + 2.0 ** -149
            assert bool(((a - b).abs() <= tol)[fin].all())
        elif op == "topk":
            # the top-k contract is a set per row (NUMERICS: the order inside a row is free;
            # torch.topk orders ties differently on the two devices): the same sorted rows
            assert same_bits(cpu[name].sort(dim=1).values, gpu[name].sort(dim=1).values), f"{op}: {name} differs"
        else:
            assert same_bits(cpu[name], gpu[name]), f"{op}: {name} differs"


@needs_gpu
@pytest.mark.parametrize("mode", ["realistic", "int8-edge", "fp64", "wide"])
def test_decode_batched_cores_on_gpu_match_the_cpu(mode):
    """64 decode rows x 2048 entries, H = 64, permuted block tables: the GPU's batched
    path (int8 / fp32 / fp64 matmul, or per sequence for wide spreads) against the CPU's."""
    g = torch.Generator().manual_seed(11)
    seqs, entries, h, ps = 64, 2048, 64, 64
    pages = seqs * entries // ps
    pool = torch.randint(0, 256, (pages, layout.page_bytes(ps, 128)), dtype=torch.uint8, generator=g)

    def scales(shape):
        if mode == "realistic":
            s = torch.randint(118, 124, (*shape, 1), generator=g) + torch.randint(0, 2, (*shape, 4), generator=g)
        elif mode == "int8-edge":
            s = torch.randint(0, 252, (*shape, 1), generator=g) + torch.randint(0, 4, (*shape, 4), generator=g)
        elif mode == "fp64":
            s = torch.randint(110, 120, (*shape, 1), generator=g) + torch.tensor([0, 12, 0, 1])
        else:
            s = torch.randint(100, 140, (*shape, 4), generator=g)
        return s.clamp(0, 254).to(torch.uint8)

    # keys are written through the layout so every entry's 4 scale bytes belong to it
    packed = torch.randint(0, 256, (pages * ps, 64), dtype=torch.uint8, generator=g)
    packed[::9] = 0
    packed[1::9] = 0x88
    pool = layout.write_entries(pool, torch.arange(pages * ps), packed, scales((pages * ps,)),
                                page_size=ps, shuffle=[32, 16, 2])
    q_fp4 = torch.randint(0, 256, (seqs, h, 64), dtype=torch.uint8, generator=g)
    q_fp4[0, :3] = 0
    kw = dict(q_fp4=q_fp4, q_scale=scales((seqs, h)), weights=torch.randn(seqs, h, generator=g),
              kv_cache=pool, query_start_loc=torch.arange(seqs + 1, dtype=torch.int32),
              context_lens=torch.full((seqs,), entries, dtype=torch.int32),
              block_table=torch.randperm(pages, generator=g).view(seqs, -1).int(),
              row_ends=torch.randint(1, entries + 1, (seqs,), generator=g).int(), page_size=ps,
              shuffle=[32, 16, 2])
    cpu = scoring.paged_mxfp4_mqa_logits_fp64(**kw)
    gpu = scoring.paged_mxfp4_mqa_logits_fp64(**on(kw, "cuda")).cpu()
    assert torch.equal(cpu.isinf(), gpu.isinf())
    fin = cpu.isfinite()
    assert bool(((cpu - gpu).abs()[fin] <= sum_bound(kw, "cpu")[fin]).all())


def eager_and_replayed(fn):
    """fn's output run eagerly, and its output captured once in a CUDA graph then replayed."""
    eager = fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return eager, out


@needs_gpu
def test_cores_replay_from_a_cuda_graph_with_the_eager_bits():
    """The K writer's, the Q quant's and the pooling's cores have no host sync: captured
    once, replayed, they give the eager (and the CPU's) bytes."""
    kw = on([c for c in CASES if c[0] == "k-32-rocm"][0][2], "cuda")
    rows = k_writer.writer_mask(kw["positions"], kw["slot_mapping"], 4).nonzero().flatten()
    k_args = (kw["k"][rows], kw["positions"][rows], kw["slot_mapping"][rows], kw["cos_sin_cache"],
              kw["norm_weight"], kw["kv_cache"])
    k_opts = dict(norm_eps=kw["norm_eps"], compress_ratio=kw["compress_ratio"], page_size=kw["page_size"],
                  shuffle=layout.as_shuffle(kw["shuffle"]))
    qkw = on([c for c in CASES if c[0] == "q"][0][2], "cuda")
    q_args = (qkw["q"], qkw["positions"], qkw["cos_sin_cache"], qkw["weights"], qkw["weights_scale"])
    pkw = on([c for c in CASES if c[0] == "pool"][0][2], "cuda")
    sel = (pooling.boundary_mask(pkw["positions"], 4) & (pkw["kv_slot_mapping"] >= 0)).nonzero().flatten()
    p_args = (pkw["state_cache"], pkw["block_table"], pkw["positions"][sel], pkw["req_index"][sel], 4)
    cores = {"k": lambda: k_writer.write_rows(*k_args, **k_opts),
             "q": lambda: q_quant.quantize_q(*q_args)["q_fp4"],
             "pool": lambda: pooling.softmax_pool(*pooling.gather_windows(*p_args)[:2])}
    for name, fn in cores.items():
        eager, out = eager_and_replayed(fn)
        assert same_bits(out, eager), name


@needs_gpu
@pytest.mark.parametrize("name", ["logits-32-True", "logits-decode", "logits-None-False"])
def test_scorer_core_replays_from_a_cuda_graph_with_the_op_bits(name):
    """The GPU scorer's per-group core (pages, int8 keys, GEMMs, head sums, masks; its
    flags read after it) has no host sync: captured once and replayed, every group gives
    the op's fp64 logits bit for bit."""
    kw = on([c for c in CASES if c[0] == name][0][2], "cuda")
    kw.pop("clean_logits", None)
    want = scoring.paged_mxfp4_mqa_logits_fp64(**kw)
    d = kw["q_fp4"].shape[2] * 2
    geo = dict(page_size=kw["page_size"], head_dim=d, shuffle=layout.as_shuffle(kw["shuffle"]))
    plans = list(scoring.group_plans(kw["query_start_loc"].tolist(), kw["query_start_loc"], kw["row_ends"],
                                     kw["block_table"], kw["page_size"], d))
    ends = kw["row_ends"].long()
    fn = lambda: [scoring.group_core_i8(p, kw["q_fp4"], kw["q_scale"], kw["weights"], kw["kv_cache"], ends, geo)
                  for p in plans]
    eager, out = eager_and_replayed(fn)
    assert plans and all(o is not None for o in out)
    for p, (logits, flags), (e_logits, e_flags) in zip(plans, out, eager):
        assert flags.tolist() == [False, True] and same_bits(flags, e_flags)
        assert same_bits(logits, e_logits) and same_bits(logits, want[p.ridx, :p.j])

