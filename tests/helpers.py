"""Helpers for test modules to import (never import another test module)."""
from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import reference
from harness.diff import diff_op
from harness.io.dumps import OpRecord
from harness.run import budgets
from reference import layout, mxfp4, pooling, rope
from reference.formats import preset
from reference.rope import cos_sin_cache

DATA = Path(__file__).resolve().parent / "data"
# a GPU test also carries @pytest.mark.gpu (deselected by `make test`)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


def fresh_json(code: str):
    """The last stdout line (JSON) of `code` run in a fresh interpreter without
    TRITON_INTERPRET, from the repository root: for what compiles the kernels, which a test
    process that already holds them in interpreter mode (or must keep them there) cannot."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root,
                       env={**env, "PYTHONPATH": root})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN payloads and signed zeros included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def sample_path(name: str) -> Path:
    """`tests/data/<name>.safetensors`, one of the committed sample dumps (docs/spec/DUMPS.md,
    "Samples"). A missing sample fails the test: the byte-exact checks must never silently
    not run."""
    path = DATA / f"{name}.safetensors"
    if not path.is_file():
        pytest.fail(f"sample dump {path} is missing (it is part of the repository)", pytrace=False)
    return path


def load_sample(name: str):
    """(op name, scalars of the op, {in name: tensor}, {out name: tensor}) of a one-op sample dump."""
    from safetensors import safe_open
    with safe_open(str(sample_path(name)), "pt") as f:
        meta = json.loads(f.metadata()["mxval"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (op, scalars), = meta["ops"].items()
    ins = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{op}/in/")}
    outs = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{op}/out/")}
    return op, scalars, ins, outs


# --- generated op inputs with the contract's edge cases in them (backend tests, CPU and GPU) ---

D, R, RATIO = 128, 64, 4


# --- builders ----------------------------------------------------------------------

def special_rows(n: int, g: torch.Generator) -> torch.Tensor:
    """bf16 rows [n, D] with the encoder's edge cases: a zero row, signed zeros in the
    NoPE and rope dims, amax exactly at and next to 6 * 2**k, tiny and huge magnitudes,
    bf16 subnormals, e2m1 midpoints after scaling."""
    x = torch.randn(n, D, generator=g) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=g).float())
    if n > 8:
        x[0] = 0.0
        x[1, :40] = -0.0
        x[1, 100:110] = -0.0
        x[2, :32] = torch.tensor([6.0, 3.0, -1.5, 0.75, 0.25, 1.25, 2.5, 5.0] * 4)
        x[3, 32:64] = torch.linspace(-6.03125, 6.03125, 32)
        x[4] *= 2.0 ** -120                        # scale exponents near e8m0's low end
        x[5, :16] = 1e-39                          # bf16 subnormals
        x[6] *= 2.0 ** 60
        x[7, 64:96] = 96.0 * torch.tensor([1, -1] * 16).float()
    return x.to(torch.bfloat16)


def k_writer_case(seed=0, tokens=48, page_size=32, pages=4, pad=12, shuffle=(32, 16, 2),
                  weight_dtype=torch.bfloat16, fp8=False, max_pos=256):
    g = torch.Generator().manual_seed(seed)
    k = special_rows(tokens, g)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    pos[:4] = torch.tensor([3, 0, 2, 7])           # j = 0 boundary, non-boundaries, j = 1
    ebytes = (D + 4) if fp8 else layout.entry_bytes(D)
    slots = torch.randperm(pages * page_size, generator=g)[:tokens]
    slots[5] = -1                                   # a skipped boundary-or-not token
    boundary = (pos + 1) % RATIO == 0
    slots[boundary.nonzero()[-1]] = -1 if boundary.any() else slots[0]
    kv = torch.randint(0, 256, (pages, page_size * ebytes + pad), generator=g, dtype=torch.uint8)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(weight_dtype)
    kw = dict(k=k, positions=pos, cos_sin_cache=rope.cos_sin_cache(max_pos, R, 160000.0, yarn_factor=16.0),
              norm_weight=w, slot_mapping=slots, kv_cache=kv, norm_eps=1e-6, compress_ratio=RATIO,
              page_size=page_size)
    if not fp8:
        kw["shuffle"] = list(shuffle) if shuffle else None
    return kw


def q_case(seed=0, tokens=6, heads=8, max_pos=256):
    g = torch.Generator().manual_seed(seed)
    q = special_rows(tokens * heads, g).view(tokens, heads, D)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    pos[0] = 0
    w = torch.randn(tokens, heads, generator=g).to(torch.bfloat16)
    return dict(q=q, positions=pos, cos_sin_cache=rope.cos_sin_cache(max_pos, R, 160000.0),
                weights=w, weights_scale=preset().weights_scale)


def pool_case(seed=0, tokens=40, block_size=8, reqs=2):
    g = torch.Generator().manual_seed(seed)
    per = tokens // reqs
    nblk = -(-per // block_size)
    table = torch.randperm(reqs * nblk + 3, generator=g)[:reqs * nblk].view(reqs, nblk)
    state = torch.full((reqs * nblk + 3, block_size, 4 * D), float("nan"))   # unread rows: NaN
    pos, req = [], []
    for r in range(reqs):
        p = torch.arange(per)
        rows = pooling.state_rows(torch.randn(per, 2 * D, generator=g) * 2,
                                  torch.randn(per, 2 * D, generator=g) * 3,
                                  torch.randn(RATIO, 2 * D, generator=g) * 0.1, p)
        state = pooling.write_state(state, table, torch.full((per,), r), p, rows)
        pos.append(p)
        req.append(torch.full((per,), r))
    pos, req = torch.cat(pos), torch.cat(req)
    slots = torch.arange(tokens)
    slots[7] = -1                                   # boundary token that writes nothing
    return dict(state_cache=state, block_table=table, positions=pos, req_index=req,
                kv_slot_mapping=slots, compress_ratio=RATIO)


def fused_k_case(seed, shuffle, page_size, rounding="rocm", tokens=48, pages=6):
    """Pooling inputs and K writer inputs (less `k`) of one fused pool+K call: two requests of
    pooled windows, a boundary token without a slot, a channel of -0.0 state values."""
    kw = pool_case(seed=seed, tokens=tokens, block_size=8, reqs=2)
    g = torch.Generator().manual_seed(seed)
    kw["kv_slot_mapping"] = torch.randperm(pages * page_size, generator=g)[:tokens]
    kw["kv_slot_mapping"][7] = -1                     # a boundary token without a slot
    kw["state_cache"][..., 5] = -0.0                  # a channel of -0.0 values: pooled -0.0 (the sign pin)
    max_pos = max(256, int(kw["positions"].max()) + 1)          # every position's row (a long call's too)
    wk = dict(cos_sin_cache=rope.cos_sin_cache(max_pos, 64, 160000.0, yarn_factor=16.0),
              norm_weight=(1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16),
              kv_cache=torch.randint(0, 256, (pages, page_size * layout.entry_bytes(128) + 12), generator=g,
                                     dtype=torch.uint8),
              norm_eps=1e-6, page_size=page_size, shuffle=shuffle, rounding=rounding)
    return kw, wk


def fused_wrong_by_certify(kw, wk, pooled, pages, sel=None) -> dict:
    """{certify mode: (scratch-row values whose bits differ from `pooled`, in rows `sel` or
    all, page bytes that differ from `pages`)} of the fused K launch on the case (kw, wk),
    certified and fp32 without the bound's check."""
    from optimized.triton_kernels import fused_k
    args = [kw[n] for n in ("state_cache", "block_table", "positions", "req_index", "kv_slot_mapping")]
    opts = dict(compress_ratio=4, norm_eps=1e-6, page_size=64, shuffle=[32, 16, 2])
    rows = slice(None) if sel is None else sel
    wrong = {}
    for mode in (True, "unchecked"):
        out, p = wk["kv_cache"].clone(), torch.empty_like(pooled)
        fused_k.launch(*args, wk["cos_sin_cache"], wk["norm_weight"], out, **opts, pooled=p, certify=mode)
        wrong[mode] = (int((p[rows].view(torch.int16) != pooled[rows].view(torch.int16)).sum()),
                       int((out != pages).sum()))
    return wrong


def on_bf16_midpoints(kw: dict) -> dict:
    """`kw` (fused_k_case's pooling inputs) with each written row's own kv value (window slot
    2r-1, the token's `_b` half) moved so that its exact pooled value lies on a bf16 rounding
    midpoint, to fp32 precision: where an fp32 pooling's error decides the bf16 value."""
    kw = dict(kw, state_cache=kw["state_cache"].clone())
    r, st = kw["compress_ratio"], kw["state_cache"]
    sel = ((kw["positions"] + 1) % r == 0) & (kw["kv_slot_mapping"] >= 0)
    pos, req = kw["positions"][sel], kw["req_index"][sel]
    kv, score, _ = pooling.gather_windows(st, kw["block_table"], pos, req, r)
    w = torch.softmax(score, dim=1)                                   # fp64 [N, 2r, D]
    c = (w * kv.double()).sum(1)
    b = torch.from_numpy(c.float().numpy().view("int32").astype("int64"))       # fp32 bits of c
    mid = ((b & ~0xFFFF) | 0x8000).to(torch.int32).view(torch.float32).double()  # the midpoint above
    bs = st.shape[1]
    blk = kw["block_table"][req, pos // bs]
    new = kv[:, -1].double() + (mid - c) / w[:, -1]
    st[blk, pos % bs, D:2 * D] = new.float()
    return kw


def logits_case(seed=0, heads=16, page_size=32, shuffle=(32, 16, 2), fp8=None, pad=4,
                seqs=((3, 70), (4, 100), (1, 0))):
    """Sequences of (query rows, context entries); pools hold encoded random keys with
    random bytes in the slack and padding; row ends include 0, 1, a page edge and full."""
    g = torch.Generator().manual_seed(seed)
    maxp = max(-(-c // page_size) for _, c in seqs) + 1
    pages = len(seqs) * maxp + 2
    ebytes = (D + 4) if fp8 else layout.entry_bytes(D)
    kv = torch.randint(0, 256, (pages, page_size * ebytes + pad), generator=g, dtype=torch.uint8)
    table = torch.randperm(pages, generator=g)[:len(seqs) * maxp].view(len(seqs), maxp)
    y = torch.randn(pages * page_size, D, generator=g) * torch.exp2(
        torch.randint(-4, 4, (pages * page_size, 1), generator=g).float())
    slots = torch.arange(pages * page_size)
    if fp8:
        v, s = reference.fp8.quantize_fp8(y, fp8)
        vo, so = reference.fp8.fp8_slot_offsets(slots, page_size, D, kv.shape[1])
        flat = kv.view(-1)
        flat[vo.flatten()] = v.reshape(-1)
        flat[so.flatten()] = s.contiguous().view(torch.uint8).reshape(-1)
    else:
        packed, sc = mxfp4.quantize_mxfp4(y)
        kv = layout.write_entries(kv, slots, packed, sc, page_size=page_size,
                                  shuffle=list(shuffle) if shuffle else None)
    rows = sum(n for n, _ in seqs)
    qy = torch.randn(rows, heads, D, generator=g)
    ends, qsl = [], [0]
    for n, c in seqs:
        e = torch.randint(0, c + 1, (n,), generator=g)
        e[-1] = c
        if n > 1:
            e[0] = min(1, c)
        if n > 2:
            e[1] = min(page_size, c)
        ends.append(e)
        qsl.append(qsl[-1] + n)
    kw = dict(weights=torch.randn(rows, heads, generator=g), kv_cache=kv,
              query_start_loc=torch.tensor(qsl), context_lens=torch.tensor([c for _, c in seqs]),
              block_table=table, row_ends=torch.cat(ends).to(torch.int32), page_size=page_size)
    if fp8:
        v, s = reference.fp8.quantize_fp8(qy, fp8)
        kw.update(q_fp8=v, fp8_dtype=fp8)
    else:
        kw["q_fp4"], kw["q_scale"] = mxfp4.quantize_mxfp4(qy)
        kw["shuffle"] = list(shuffle) if shuffle else None
    return kw


def topk_case(seed=0, rows=5, width=3000, k=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    x[1, :200] = 1.0                                 # ties across the k-th value
    x[2, 10] = -3e38                                 # the most negative finite logits
    x[2, 12] = -3.4e38
    x[2, 11] = -0.0
    lens = torch.tensor([width, 2000, 1500, k, 0][:rows])
    return dict(logits=x, lengths=lens, k=k)


def cases(scale: int = 1) -> list[tuple[str, str, dict]]:
    """(id, op, kwargs) for every op and edge case; `scale` multiplies the sizes (GPU)."""
    s = scale
    out = []
    for shuffle in ((32, 16, 2), (16, 16, 4), None):
        for rounding in ("rocm", "deepseek", "cuda"):
            kw = k_writer_case(tokens=48 * s, pages=4 * s, shuffle=shuffle)
            if rounding == "cuda":
                kw["k"] = kw["k"].float() * 1.001       # the CUDA fused path takes fp32 rows
            out.append((f"k-{shuffle and shuffle[0]}-{rounding}", "k_norm_rope_mxfp4_cache",
                        dict(kw, rounding=rounding)))
    out.append(("k-f32w-unpadded", "k_norm_rope_mxfp4_cache",
                k_writer_case(seed=1, tokens=40 * s, pages=4 * s, pad=0, weight_dtype=torch.float32)))
    for rule in ("ocp-floor", "even"):
        out.append((f"k-{rule}", "k_norm_rope_mxfp4_cache", dict(k_writer_case(seed=2), scale_rule=rule)))
        out.append((f"q-{rule}", "q_rope_mxfp4_quant", dict(q_case(seed=2), scale_rule=rule)))
    out.append(("q", "q_rope_mxfp4_quant", q_case(tokens=6 * s, heads=8 * s)))
    out.append(("pool", "compress_pool", pool_case(tokens=40 * s)))
    out.append(("pool-cuda", "compress_pool", dict(pool_case(seed=1, tokens=24 * s), rounding="cuda")))
    for shuffle in ((32, 16, 2), None):
        for clean in (True, False):
            out.append((f"logits-{shuffle and shuffle[0]}-{clean}", "paged_mxfp4_mqa_logits",
                        dict(logits_case(shuffle=shuffle, seqs=((3 * s, 70 * s), (4, 100 * s), (1, 0))),
                             clean_logits=clean)))
    out.append(("logits-decode", "paged_mxfp4_mqa_logits",
                dict(logits_case(seed=5, seqs=((1, 50 * s), (1, 33), (1, 64))), clean_logits=True)))
    out.append(("logits-h8", "paged_mxfp4_mqa_logits", dict(logits_case(heads=8, seqs=((2, 40),)), clean_logits=True)))
    for fl in ("e4m3fn", "e4m3fnuz"):
        kw = k_writer_case(seed=3, tokens=40 * s, pages=4 * s, fp8=True)
        out.append((f"k-fp8-{fl}", "k_norm_rope_fp8_cache", dict(kw, fp8_dtype=fl)))
        out.append((f"q-fp8-{fl}", "q_rope_fp8_quant", dict(q_case(seed=3), fp8_dtype=fl)))
        out.append((f"logits-fp8-{fl}", "paged_fp8_mqa_logits",
                    dict(logits_case(fp8=fl, seqs=((3, 70 * s), (2, 33))), clean_logits=True)))
    out.append(("k-fp8-cuda-f32", "k_norm_rope_fp8_cache",
                dict(k_writer_case(seed=4, fp8=True), k=k_writer_case(seed=4, fp8=True)["k"].float() * 1.01,
                     rounding="cuda")))
    out.append(("topk-64", "topk", topk_case(k=64)))
    out.append(("topk-1024", "topk", topk_case(k=1024, width=3000 * s)))
    return out



# --- judging a backend's outputs: the product's own diff engine and budgets ------------------

# Our own kernels compute the pooling softmax exactly: hold them to 0 ulp, stricter than the
# contract's 1-ulp allowance for fast-exp kernels (docs/spec/NUMERICS.md, section 1).
_KERNEL_CASE = "backend-kernel-test"


def _judge():
    b = budgets.load()
    return dataclasses.replace(b, cases={**b.cases, _KERNEL_CASE: {"pooled_max_ulp": budgets.Limit(max=0.0)}})


def aiter_backend(name: str):
    """The aiter backend `name`, loaded from the aiter tree in $MXVAL_AITER_SRC; the test is
    skipped, with the reason, when there is no tree, and fails when a given tree cannot load."""
    import os

    from optimized import get_backend
    if not os.environ.get("MXVAL_AITER_SRC"):
        pytest.skip("no aiter tree: set MXVAL_AITER_SRC (make test-aiter AITER=DIR)")
    be = get_backend(name, require=False)
    if be.available():               # a tree was given: a backend that cannot load is a failure
        pytest.fail(f"MXVAL_AITER_SRC is set but {name} cannot run: {be.available()}")
    return be


def reference_outputs(op: str, kw: dict) -> dict:
    """The reference's outputs on `kw` (fp64 logits for the scorers, as the harness compares)."""
    o = reference.OPS[op]
    ins = {k: v for k, v in kw.items() if k in o.fields.inputs}
    sc = {k: v for k, v in kw.items() if k not in o.fields.inputs}
    if o.fp64:
        return {"logits": o.fp64(**ins, **sc)}
    return o.fn(**ins, **sc) if o.stage != "topk" else {}


def compare(op: str, got: dict, kw: dict) -> list[str]:
    """Problems of `got` (a backend's outputs on `kw`) as the product judges them: the public
    diff API and the default budgets file. Empty = pass."""
    o = reference.OPS[op]
    ins = {k: v for k, v in kw.items() if k in o.fields.inputs}
    sc = {k: v for k, v in kw.items() if k not in o.fields.inputs}
    rep = diff_op(op, ins, sc, {k: v.cpu() for k, v in got.items()}, reference_outputs(op, kw))
    bad = _judge().check({f"{o.stage}.{m}": v for m, v in rep.metrics.items()}, "tests", _KERNEL_CASE)
    return [f"{f['metric']} {f['why']} ({rep.summary(max_findings=2)})" for f in bad]

# --- one layer step of every op, recorded (dump, diff and replay tests) ---


def make_layer(seed: int = 0, *, shuffle=(32, 16, 2), page_size: int = 64, heads: int = 4,
               k: int = 8) -> dict[str, OpRecord]:
    """A small whole-layer step of every op in DUMPS.md, outputs from the reference."""
    g = torch.Generator().manual_seed(seed)
    D, R, r = 128, 64, 4
    recs: dict[str, OpRecord] = {}

    def add(op, inputs, scalars):
        out = reference.OPS[op].fn(**inputs, **scalars)
        if reference.OPS[op].stage == "scorer":
            out = {"logits": out["logits"]}
        recs[op] = OpRecord(op, dict(scalars), inputs, out)
        return out

    # pooling: one request, 40 tokens, state blocks of 16 positions, permuted table
    T = 40
    pos = torch.arange(T)
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    state = torch.randn(4, 16, 4 * D, generator=g)
    slot_pool = torch.where((pos + 1) % r == 0, pos // r, -1)
    add("compress_pool", {"state_cache": state, "block_table": table, "positions": pos,
                          "req_index": torch.zeros(T, dtype=torch.int32), "kv_slot_mapping": slot_pool},
        {"compress_ratio": r})
    # K writer: 80 boundary tokens into pages 1 and 2 of a 3-page pool of random bytes
    T = 320
    pos = torch.arange(T)
    entry = pos // r
    slots = torch.where((pos + 1) % r == 0, page_size + entry, -1)
    cs = cos_sin_cache(T + 8, R, 160000.0)
    kk = (torch.randn(T, D, generator=g) * 3).to(torch.bfloat16)
    w = (torch.rand(D, generator=g) + 0.5).to(torch.bfloat16)
    pool = torch.randint(0, 256, (3, page_size * 68), generator=g, dtype=torch.uint8)
    kout = add("k_norm_rope_mxfp4_cache",
               {"k": kk, "positions": pos, "cos_sin_cache": cs, "norm_weight": w, "slot_mapping": slots,
                "kv_cache": pool},
               {"norm_eps": 1e-6, "compress_ratio": r, "page_size": page_size,
                "shuffle": list(shuffle) if shuffle else None})
    fpool = torch.randint(0, 256, (3, page_size * 132), generator=g, dtype=torch.uint8)
    k8 = add("k_norm_rope_fp8_cache",
             {"k": kk, "positions": pos, "cos_sin_cache": cs, "norm_weight": w, "slot_mapping": slots,
              "kv_cache": fpool},
             {"norm_eps": 1e-6, "compress_ratio": r, "page_size": page_size, "fp8_dtype": "e4m3fn"})
    # Q: 6 query rows at the sequence's last positions
    Rw = 6
    qpos = torch.arange(T - Rw, T)
    q = torch.randn(Rw, heads, D, generator=g).to(torch.bfloat16)
    hw = torch.randn(Rw, heads, generator=g)
    ws = 128 ** -0.5 * heads ** -0.5
    qo = add("q_rope_mxfp4_quant", {"q": q, "positions": qpos, "cos_sin_cache": cs, "weights": hw},
             {"weights_scale": ws})
    q8 = add("q_rope_fp8_quant", {"q": q, "positions": qpos, "cos_sin_cache": cs, "weights": hw},
             {"weights_scale": ws, "fp8_dtype": "e4m3fn"})
    n = T // r
    row_ends = torch.tensor([5, k, k + 1, 40, 79, 80])          # short, exactly k, k+1, long
    paged = {"query_start_loc": torch.tensor([0, Rw]), "context_lens": torch.tensor([n]),
             "block_table": torch.tensor([[1, 2]], dtype=torch.int32), "row_ends": row_ends}
    lo = add("paged_mxfp4_mqa_logits",
             {"q_fp4": qo["q_fp4"], "q_scale": qo["q_scale"], "weights": qo["weights"],
              "kv_cache": kout["kv_cache"], **paged},
             {"page_size": page_size, "shuffle": list(shuffle) if shuffle else None, "clean_logits": True})
    add("paged_fp8_mqa_logits", {"q_fp8": q8["q_fp8"], "weights": q8["weights"], "kv_cache": k8["kv_cache"],
                                 **paged},
        {"page_size": page_size, "fp8_dtype": "e4m3fn", "clean_logits": False})
    add("topk", {"logits": lo["logits"], "lengths": row_ends}, {"k": k})
    return recs




# --- exact arithmetic oracles ---

def round_fp32(fr: Fraction) -> Fraction:
    """Round a positive rational to fp32, nearest-even, with subnormals."""
    e = fr.numerator.bit_length() - fr.denominator.bit_length()
    if Fraction(2) ** e > fr:
        e -= 1
    quantum = Fraction(2) ** (max(e, -126) - 23)
    q, rem = divmod(fr, quantum)
    if rem * 2 > quantum or (rem * 2 == quantum and q % 2):
        q += 1
    return q * quantum


# --- inputs of the fast kernel paths (interpreter and compiled) ---

def tie_case():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 700, generator=g)
    x[0, :300] = 2.0                        # 300 ties across the k-th value
    x[1] = 0.0
    x[1, ::3] = -0.0                        # all zeros, mixed signs: every column ties
    x[2] = torch.arange(700).float()        # distinct: the search can stop at exactly k
    x[3, 10:] = -3.4e38
    lens = torch.tensor([700, 650, 700, 400, 64, 63])
    return dict(logits=x, lengths=lens, k=64)


def all_bytes_and_scales(device="cpu"):
    b = torch.arange(256, dtype=torch.int32).repeat(256)[: 256 * 255]
    e = torch.arange(255, dtype=torch.int32).repeat_interleave(256)
    n = 1 << (b.numel() - 1).bit_length()
    pad = n - b.numel()
    b = torch.cat((b, b[:pad])).to(torch.uint8)
    e = torch.cat((e, e[:pad])).to(torch.uint8)
    # shuffled, so that elements a decoder may handle together have different scales
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    return b[perm].to(device), e[perm].to(device)


def expected(b, e):
    """fp32 [N, 2]: the reference's dequantized (even, odd) values (fp64 -> fp32 is exact
    here; 6 * 2**127 overflows to inf in both). Zeros compare equal whatever their sign:
    a dot cannot tell them apart."""
    blocks = b.view(-1, 1).repeat(1, 16).cpu()              # one 32-element block per byte
    vals = mxfp4.dequantize_mxfp4(blocks, e.view(-1, 1).cpu(), torch.float64)
    return vals[:, :2].float()


# --- the CLI, in-process ------------------------------------------------------------------

def mxval(capsys, *argv):
    """Run `mxval ARGV...` in this process: (exit code, stdout, stderr)."""
    from harness.commands.cli import main
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err: str, *needles) -> str:
    """The contract for bad input: exactly one line `mxval: ...` on stderr, no traceback,
    naming each of `needles`. Returns the line."""
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("mxval: ") and "Traceback" not in err, err
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


# --- CUDA graphs faked on the CPU (the capture hook's and the shadow's tests) ---------------------

class FakeGraph:
    """torch.cuda.CUDAGraph's methods, on the CPU: while capturing, emit() keeps the work
    (the model's and the hook's device copies) instead of running it; replay() runs it."""
    capturing = None

    def __init__(self):
        self.work = []

    def capture_begin(self, pool=None, capture_error_mode="global"):
        FakeGraph.capturing = self

    def capture_end(self):
        FakeGraph.capturing = None

    def replay(self):
        for w in self.work:
            w()


class NodeGraph(FakeGraph):
    """FakeGraph that keeps its graph on request (torch's keep_graph, `instantiate`,
    `raw_cuda_graph_exec`) and whose work items are nodes the driver can disable in the
    instantiated graph (FakeNodes): replay() skips a disabled one, and notes which were."""
    execs: dict = {}

    def __init__(self, keep_graph=False):
        super().__init__()
        self.keep, self.exec_, self.disabled, self.replays = keep_graph, None, set(), []

    def capture_end(self):
        super().capture_end()
        if not self.keep:
            self.instantiate()

    def instantiate(self):
        self.exec_ = 1000 + len(NodeGraph.execs)
        NodeGraph.execs[self.exec_] = self

    def raw_cuda_graph_exec(self):
        if self.exec_ is None:
            raise RuntimeError("not instantiated")
        return self.exec_

    def replay(self):
        if self.exec_ is None:
            self.instantiate()
        self.replays.append(frozenset(self.disabled))
        for i, w in enumerate(self.work):
            if i not in self.disabled:
                w()


class FakeNodes:
    """harness.capture.nodes.Nodes over NodeGraph: a node is the index of a work item; `fail`
    makes set_enabled raise for the switches it names (True: on, False: off)."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def last(self, stream=None):
        return len(FakeGraph.capturing.work) - 1

    def set_enabled(self, exec_, node, on):
        if bool(on) in self.fail:
            raise RuntimeError(f"node switch {'on' if on else 'off'} refused")
        self.calls.append((exec_, node, bool(on)))
        g = NodeGraph.execs[exec_]
        (g.disabled.discard if on else g.disabled.add)(node)


def emit(work):
    if FakeGraph.capturing is not None:
        FakeGraph.capturing.work.append(work)
    else:
        work()


def fake_graphs(monkeypatch, hook) -> None:
    """torch.cuda.CUDAGraph replaced by FakeGraph, and the capture hook's device copies
    emitted into the graph being captured (the hook module `hook` is the caller's import)."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph, raising=False)
    monkeypatch.setattr(hook, "_graph_capturing", lambda: FakeGraph.capturing is not None)
    real = hook._stage_copies

    def stage(flag, pairs, launched=None):           # one emitted work item: one launch
        emit(lambda: real(flag, pairs))
        if launched is not None:
            launched()
    monkeypatch.setattr(hook, "_stage_copies", stage)
    monkeypatch.setattr(FakeGraph, "capturing", None)
