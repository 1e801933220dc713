"""The reference's CUDA path (NUMERICS.md §2a, docs/paths.md): the fused pool+K ops, the
rope contraction modes, the pooling softmax modes, the CUDA Q kernels' pair of weight
scales, and the fused stage through dumps, the diff engine and `mxval diff`. Each option
is shown to change bytes on an input built for it."""
import json
from fractions import Fraction

import pytest
import torch
from helpers import pool_case
from safetensors import safe_open
from safetensors.torch import save_file

import reference
from harness.commands.cli import main
from harness.diff import diff_op
from harness.io.dumps import OpRecord, read_dump, record_problem, write_dump
from harness.run.replay import replay_dump
from reference import layout, rope
from reference.k_writer import writer_mask
from reference.pooling import softmax_pool, softmax_pool_fp32

D, R = 128, 64
MX = "compress_norm_rope_mxfp4_cache"
F8 = "compress_norm_rope_fp8_cache"


def fused_case(seed=0, tokens=40, fmt="mxfp4", page_size=16, pad=8):
    kw = pool_case(seed=seed, tokens=tokens)
    g = torch.Generator().manual_seed(seed + 100)
    entry = layout.entry_bytes(D) if fmt == "mxfp4" else D + 4
    pages = -(-tokens // page_size) + 1
    kw.update(cos_sin_cache=rope.cos_sin_cache(64, R, 160000.0),
              norm_weight=(1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16),
              kv_cache=torch.randint(0, 256, (pages, page_size * entry + pad), dtype=torch.uint8, generator=g),
              norm_eps=1e-6, page_size=page_size)
    if fmt == "fp8":
        kw["fp8_dtype"] = "e4m3fn"
    return kw


def chain_of(kw, fmt, **opts):
    """The split chain the fused op stands for: compress_pool(cuda) -> K writer(cuda, natural)."""
    pool_kw = {k: kw[k] for k in ("state_cache", "block_table", "positions", "req_index", "kv_slot_mapping",
                                  "compress_ratio")}
    pooled = reference.compress_pool(**pool_kw, rounding="cuda", softmax=opts.get("softmax", "fp64"))["pooled"]
    wk = dict(k=pooled, positions=kw["positions"], cos_sin_cache=kw["cos_sin_cache"], norm_weight=kw["norm_weight"],
              slot_mapping=kw["kv_slot_mapping"], kv_cache=kw["kv_cache"], norm_eps=kw["norm_eps"],
              compress_ratio=kw["compress_ratio"], page_size=kw["page_size"], rounding="cuda",
              rope=opts.get("rope", "fma-oc"))
    if fmt == "mxfp4":
        return reference.k_norm_rope_mxfp4_cache(**wk, shuffle=None)["kv_cache"]
    return reference.k_norm_rope_fp8_cache(**wk, fp8_dtype="e4m3fn")["kv_cache"]


# --- the fused op is the chain ----------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_fused_op_is_the_cuda_chain_in_natural_order(fmt):
    kw = fused_case(fmt=fmt)
    op = MX if fmt == "mxfp4" else F8
    before = kw["kv_cache"].clone()
    out = reference.OPS[op].fn(**kw)["kv_cache"]
    assert torch.equal(kw["kv_cache"], before), "the fused op modified its input pool"
    assert torch.equal(out, chain_of(kw, fmt))
    assert not torch.equal(out, before)
    # bytes no written slot owns keep their value (padding, other entries)
    slots = kw["kv_slot_mapping"][writer_mask(kw["positions"], kw["kv_slot_mapping"], 4)]
    if fmt == "mxfp4":
        owned = layout.owned_mask(out.shape[0], out.shape[1], slots, page_size=kw["page_size"], head_dim=D,
                                  shuffle=None)
        assert torch.equal(out[~owned], before[~owned])


def test_fused_op_refuses_bad_arguments():
    kw = fused_case()
    with pytest.raises(ValueError, match="rope"):
        reference.OPS[MX].fn(**kw, rope="fma")
    with pytest.raises(ValueError, match="softmax"):
        reference.OPS[MX].fn(**kw, softmax="fp16")
    with pytest.raises(ValueError, match="state_cache"):
        reference.OPS[MX].fn(**{**kw, "state_cache": kw["state_cache"].double()})


# --- NoPE through the rotation on the cuda path ---------------------------------------------

def test_cuda_nope_pairs_go_through_the_formula():
    """An all -0.0 window pools to -0.0 (P1); vLLM's CUDA kernels push the NoPE pairs through
    e*1 - o*0, o*1 + e*0, so e' = +0.0 and o' = -0.0: byte 0x80, not 0x88 (untouched)."""
    kw = fused_case(tokens=40)
    st = kw["state_cache"].clone()
    for p in range(4, 12):                           # the window of position 11 (request 0)
        st[kw["block_table"][0, p // 8], p % 8, :2 * D] = -0.0
    kw["state_cache"] = st
    out = reference.OPS[MX].fn(**kw)["kv_cache"]
    slot = int(kw["kv_slot_mapping"][11])
    page, t = divmod(slot, kw["page_size"])
    nope_bytes = out[page, t * 64: t * 64 + (D - R) // 2]
    assert set(nope_bytes.tolist()) == {0x80}
    # the previous reading (NoPE untouched) would have written 0x88 there
    k = torch.full((1, D), -0.0)
    untouched = rope.rope_gptj_tail(k, *rope.cos_sin_at(kw["cos_sin_cache"], torch.tensor([0])),
                                    round_bf16=False, nope_through_formula=False)
    assert torch.signbit(untouched[0, :D - R]).all()


# --- rope modes ---------------------------------------------------------------------------------

# Found by search (bf16 e, o; fp32 cos, sin): the e2m1 code of the rotated value differs by mode.
EVEN = (1.9921875, 1.109375, 0.7779766917228699, 0.26678910851478577)   # e': separate vs fma
ODD = (1.453125, 1.984375, 0.7028928995132446, 0.2417483776807785)      # o': fma-oc vs fma-es vs separate


def _exact_fma_ok(a, b, c, r) -> bool:
    """r is round-to-nearest-even of a*b + c in fp32."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    t = torch.tensor([r], dtype=torch.float32)
    lo = float(torch.nextafter(t, torch.tensor([-float("inf")])))
    hi = float(torch.nextafter(t, torch.tensor([float("inf")])))
    d, dl, dh = abs(exact - Fraction(r)), abs(exact - Fraction(lo)), abs(exact - Fraction(hi))
    if d < dl and d < dh:
        return True
    if d == min(dl, dh):                          # a tie: the even significand wins
        return (t.view(torch.int32).item() & 1) == 0
    return False


def test_fma32_is_correctly_rounded():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3000, generator=g)
    b = torch.randn(3000, generator=g)
    c = -(a * b) * (1 + torch.randn(3000, generator=g) * 1e-6)      # heavy cancellation
    c[:1000] = torch.randn(1000, generator=g)
    r = rope.fma32(a, b, c)
    for i in range(0, 3000, 3):
        assert _exact_fma_ok(float(a[i]), float(b[i]), float(c[i]), float(r[i])), i
    # a double-rounding trap: a*b + c exactly halfway in fp64 terms but not in exact terms
    x = torch.tensor([1 + 2 ** -23], dtype=torch.float32)
    y = torch.tensor([1 + 2 ** -23], dtype=torch.float32)
    z = torch.tensor([-(2 ** -46) * 0.75], dtype=torch.float32)
    assert _exact_fma_ok(float(x), float(y), float(z), float(rope.fma32(x, y, z)))
    # signed zeros as IEEE: fma(-0, 1, -0) = -0, fma(-0, 1, +0) = +0
    z0 = rope.fma32(torch.tensor([-0.0]), torch.tensor([1.0]), torch.tensor([-0.0]))
    z1 = rope.fma32(torch.tensor([-0.0]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.signbit(z0).item() and not torch.signbit(z1).item()


def _q_for(pairs):
    """q [1, 1, D] and a cos/sin cache row: the given (e, o, cos, sin) at rope pairs 0 and 2
    of block 2, a 6.0 at pair 1 (cos 1, sin 0) so the block's scale is 1."""
    q = torch.zeros(1, 1, D)
    cs = torch.zeros(1, R)
    cs[0, :R // 2] = 1.0
    for m, (e, o, c, s) in pairs.items():
        q[0, 0, D - R + 2 * m], q[0, 0, D - R + 2 * m + 1] = e, o
        cs[0, m], cs[0, R // 2 + m] = c, s
    q[0, 0, D - R + 2] = 6.0
    return q.to(torch.bfloat16), cs


def test_each_rope_mode_writes_other_bytes():
    q, cs = _q_for({0: EVEN, 2: ODD})
    args = dict(q=q, positions=torch.tensor([0]), cos_sin_cache=cs, weights=torch.ones(1, 1), weights_scale=1.0)
    out = {m: reference.q_rope_mxfp4_quant(**args, rope=m)["q_fp4"] for m in rope.ROPE_MODES}
    b_even, b_odd = (D - R) // 2, (D - R) // 2 + 2
    assert out["separate"][0, 0, b_even] != out["fma-oc"][0, 0, b_even] == out["fma-es"][0, 0, b_even]
    assert out["fma-oc"][0, 0, b_odd] != out["fma-es"][0, 0, b_odd]
    assert out["separate"][0, 0, b_even] != out["fma-es"][0, 0, b_even]
    # the K side takes the same modes (cuda rounding, through the K writer)
    kw = dict(positions=torch.tensor([3]), cos_sin_cache=cs, norm_weight=torch.ones(D), slot_mapping=torch.tensor([0]),
              kv_cache=torch.zeros(1, 68, dtype=torch.uint8), norm_eps=1e-30, page_size=1, shuffle=None, rounding="cuda")
    # a row whose norm is exactly 1 leaves the crafted values as they are: rstd = 1 when mean(x^2) = 1
    # (eps = 1e-30 vanishes in fp32 next to 1; 0 itself is refused)
    k = q.float()[0].clone()
    k[0, 0] = (D - float((k * k).sum())) ** 0.5
    assert abs(float((k * k).mean()) - 1) < 1e-6
    kout = {m: reference.k_norm_rope_mxfp4_cache(k=k, rope=m, **kw)["kv_cache"] for m in rope.ROPE_MODES}
    assert len({bytes(v.flatten().tolist()) for v in kout.values()}) >= 2


def test_cuda_q_path_on_the_chain_passes_the_kernels_rope_and_pair():
    from harness.run.cases import Catalog
    from harness.run.inputs import build
    inp = build(Catalog().case("smoke-cuda-path"), "cpu")
    sc = inp.scalars("q_rope_mxfp4_quant")
    assert sc["rope"] == "fma-es" and sc["softmax_scale"] == D ** -0.5 and sc["head_scale"] == 4 ** -0.5
    assert inp.scalars(MX)["rope"] == "fma-oc"
    rocm = build(Catalog().case("smoke-edge-values"), "cpu")
    assert "rope" not in rocm.scalars("q_rope_mxfp4_quant")


# --- the Q kernels' pair of scales ----------------------------------------------------------------

def test_weights_pair_is_two_multiplies_in_turn():
    """V4.1 (H = 32): head_scale 2^-2.5 is not a power of two, and (w * softmax_scale) *
    head_scale differs from w * fp32(softmax_scale * head_scale) at some weights."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    sm, hs = D ** -0.5, 32 ** -0.5
    q = torch.randn(64, 32, D, generator=g).to(torch.bfloat16)
    args = dict(q=q, positions=torch.zeros(64, dtype=torch.long), cos_sin_cache=rope.cos_sin_cache(4, R, 1e4),
                weights=w, weights_scale=sm * hs)
    for fn in (reference.q_rope_mxfp4_quant, reference.q_rope_fp8_quant):
        one = fn(**args)["weights"]
        pair = fn(**args, softmax_scale=sm, head_scale=hs)["weights"]
        f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
        if fn is reference.q_rope_mxfp4_quant:
            assert torch.equal(pair, (w * f32(sm)) * f32(hs))
        assert not torch.equal(one, pair)
    with pytest.raises(ValueError, match="both"):
        reference.q_rope_mxfp4_quant(**args, softmax_scale=sm)
    with pytest.raises(ValueError, match="differs from weights_scale"):
        reference.q_rope_mxfp4_quant(**args, softmax_scale=sm, head_scale=hs * 2)


# --- pooling softmax modes -------------------------------------------------------------------------

def test_softmax_fp32_pools_other_values_and_writes_other_bytes():
    kw = fused_case(tokens=40)
    st = kw["state_cache"].clone()
    # cancellation: kv +-1e6 on position pairs (2k, 2k+1) with equal scores, so the +-1e6 cancel
    # exactly and the fp32 products' rounding (~1e-2) is what is left beside the O(1) rest
    for req in range(2):
        for p in range(1, 20, 2):
            b0, o0 = kw["block_table"][req, (p - 1) // 8], (p - 1) % 8
            b1, o1 = kw["block_table"][req, p // 8], p % 8
            st[b1, o1, 2 * D:] = st[b0, o0, 2 * D:]
            st[b0, o0, :2 * D] += 1e6
            st[b1, o1, :2 * D] -= 1e6
    kw["state_cache"] = st
    a = reference.OPS[MX].fn(**kw, softmax="fp64")["kv_cache"]
    b = reference.OPS[MX].fn(**kw, softmax="fp32")["kv_cache"]
    assert not torch.equal(a, b)
    # and the fp32 pooling is the kernels' operation sequence, not a rounding of the exact value
    kv = torch.randn(5, 8, 16, dtype=torch.float32) * 100
    s = torch.randn(5, 8, 16)
    assert not torch.equal(softmax_pool(kv, s), softmax_pool_fp32(kv, s))
    assert torch.allclose(softmax_pool(kv, s), softmax_pool_fp32(kv, s), rtol=1e-4, atol=1e-3)


# --- dumps, diff, mxval diff ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_fused_dump_round_trip_and_diff(tmp_path, fmt):
    op = MX if fmt == "mxfp4" else F8
    kw = fused_case(fmt=fmt)
    scal = {k: kw.pop(k) for k in ("compress_ratio", "norm_eps", "page_size", *(["fp8_dtype"] if fmt == "fp8" else []))}
    scal["rope"] = "fma-oc"
    out = reference.OPS[op].fn(**kw, **scal)
    rec = OpRecord(op, scal, kw, out)
    assert record_problem(rec) is None
    path = write_dump(tmp_path / "f.safetensors", {op: rec}, source="test")
    d = read_dump(path)
    back = d.ops[op]
    same = lambda a, b: torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # noqa: E731
    assert back.scalars == scal and all(same(back.inputs[k], kw[k]) for k in kw)
    (rep,) = replay_dump(d)
    assert rep.metrics["page_bytes_mismatched"] == 0 and rep.metrics["pool_k_bytes_mismatched_frac"] == 0
    # one flipped value byte: found, classified, localized, and counted in the stage's own key
    bad = out["kv_cache"].clone()
    slots = kw["kv_slot_mapping"][writer_mask(kw["positions"], kw["kv_slot_mapping"], 4)]
    page, t = divmod(int(slots[0]), scal["page_size"])
    eb = D // 2 if fmt == "mxfp4" else D
    bad[page, t * eb + 3] ^= 0x01
    rep = diff_op(op, kw, scal, {"kv_cache": bad}, out)
    assert rep.metrics["page_bytes_mismatched"] == 1
    owned = int(torch.unique(slots).numel()) * (68 if fmt == "mxfp4" else 132)
    assert rep.metrics["pool_k_bytes_mismatched_frac"] == pytest.approx(1 / owned)
    (f,) = rep.findings
    assert (f["page"], f["entry"], f["byte"]) == (page, t, 3) and f["class"] in ("one_step", "value_other")
    # a scalar the op does not know is refused; a bad rope mode too
    assert "unknown scalar" in record_problem(OpRecord(op, {**scal, "shuffle": None}, kw, out))
    assert "rope" in record_problem(OpRecord(op, {**scal, "rope": "fma"}, kw, out))


def test_mxval_diff_of_a_fused_dump(tmp_path, capsys):
    path = tmp_path / "cuda.safetensors"
    assert main(["dump", "--case", "smoke-cuda-path", "--backend", "reference", "--step", "0", "-o", str(path)]) == 0
    capsys.readouterr()
    with safe_open(str(path), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    ops = json.loads(meta["mxval"])["ops"]
    assert set(ops) == {MX, "q_rope_mxfp4_quant", "paged_mxfp4_mqa_logits", "topk"}
    assert ops[MX]["rope"] == "fma-oc" and ops["q_rope_mxfp4_quant"]["rope"] == "fma-es"
    assert main(["diff", str(path), "--report-dir", str(tmp_path / "r"), "-q"]) == 0
    row = json.loads((tmp_path / "r" / "report.json").read_text())["cases"][0]
    assert row["status"] == "pass" and row["metrics"][f"{MX}.pool_k_bytes_mismatched_frac"] == 0
    # flip one scale byte of the first written entry: the diff fails on the byte count (held
    # to 0 like a K writer's, whatever the case's size) and on the stage's fraction
    sc = ops[MX]
    pos, slots = t[f"{MX}/in/positions"], t[f"{MX}/in/kv_slot_mapping"]
    slot = int(slots[writer_mask(pos, slots, 4)][0])
    page, e = divmod(slot, sc["page_size"])
    pool = t[f"{MX}/out/kv_cache"].clone()
    pool[page, sc["page_size"] * 64 + e * 4 + 1] ^= 0x01
    t[f"{MX}/out/kv_cache"] = pool
    bad = tmp_path / "bad.safetensors"
    save_file(t, str(bad), metadata=meta)
    assert main(["diff", str(bad), "--report-dir", str(tmp_path / "r2"), "-q"]) == 1
    row = json.loads((tmp_path / "r2" / "report.json").read_text())["cases"][0]
    assert [v["metric"] for v in row["violations"]] == [f"{MX}.page_bytes_mismatched",
                                                        f"{MX}.pool_k_bytes_mismatched_frac"]
    f = [x for x in row["findings"] if x["stage"] == MX]
    assert f and (f[0]["page"], f[0]["entry"]) == (page, e) and f[0]["kind"] == "scale"
    # a backend without the fused op is never a pass
    assert main(["diff", str(path), "--backend", "triton-interpret", "--report-dir", str(tmp_path / "r3"), "-q"]) == 1
    row = json.loads((tmp_path / "r3" / "report.json").read_text())["cases"][0]
    assert row["metrics"][f"{MX}.op_unsupported"] == 1
    # ... nor one whose Q quant has no parameter for the recorded rope mode (read from its signature)
    assert row["metrics"]["q_rope_mxfp4_quant.op_unsupported"] == 1
    assert any("option rope" in x["where"] for x in row["findings"] if x["stage"] == "q_rope_mxfp4_quant")
