"""The reference reproduces the real kernels' sample dumps byte for byte."""
import torch
from helpers import load_sample

import reference


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps via the monotone integer map of the bit patterns."""
    def key(x):
        i = x.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (key(a) - key(b)).abs()


def test_k_writer_sample_byte_exact():
    op, scalars, ins, outs = load_sample("k_natural")
    before = {k: v.clone() for k, v in ins.items()}
    got = reference.OPS[op].fn(**ins, **scalars)["kv_cache"]
    assert torch.equal(got, outs["kv_cache"])
    assert all(torch.equal(before[k], ins[k]) for k in ins), "the op modified an input"
    # teeth: the same pool written with the OCP floor rule is not the recorded one
    assert not torch.equal(reference.OPS[op].fn(**ins, **scalars, scale_rule="ocp-floor")["kv_cache"],
                           outs["kv_cache"])


def test_pooling_sample_within_one_ulp():
    op, scalars, ins, outs = load_sample("pool_pro")
    got = reference.OPS[op].fn(**ins, **scalars)["pooled"]
    want = outs["pooled"]
    rows = ~torch.isnan(want.float()).any(-1)
    assert torch.equal(rows, ~torch.isnan(got.float()).any(-1)), "pooled rows differ from the written set"
    ulps = _bf16_ulps(got[rows], want[rows])
    assert int(ulps.max()) <= 1
    # teeth: a one-position window shift moves far more than one ulp
    from reference.pooling import gather_windows, softmax_pool
    sel = rows.nonzero().flatten()
    kv, score, _ = gather_windows(ins["state_cache"], ins["block_table"], ins["positions"][sel] - 1,
                                  ins["req_index"][sel], scalars["compress_ratio"])
    moved = softmax_pool(kv, score).to(torch.bfloat16)
    assert int(_bf16_ulps(moved, want[sel]).max()) > 1
