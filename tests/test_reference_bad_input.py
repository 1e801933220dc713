"""Bad input: one clear ValueError naming the argument; non-finite inputs raise
NonFiniteInput (a ValueError too), never a silent encode."""
import pytest
import torch

import reference
from reference import mxfp4, rope

CS = rope.cos_sin_cache(64, 64)
NAN = float("nan")


def k_args(**over):
    a = dict(k=torch.randn(8, 128).bfloat16(), positions=torch.arange(8), cos_sin_cache=CS,
             norm_weight=torch.ones(128).bfloat16(), slot_mapping=torch.arange(8),
             kv_cache=torch.zeros(1, 4352, dtype=torch.uint8), norm_eps=1e-6, compress_ratio=4, page_size=64,
             shuffle=[32, 16, 2])
    a.update(over)
    return a


def q_args(**over):
    a = dict(q=torch.randn(3, 4, 128).bfloat16(), positions=torch.arange(3), cos_sin_cache=CS,
             weights=torch.randn(3, 4), weights_scale=0.1)
    a.update(over)
    return a


def pool_args(**over):
    a = dict(state_cache=torch.randn(4, 16, 512), block_table=torch.tensor([[0, 1], [2, 3]]),
             positions=torch.arange(8), req_index=torch.zeros(8, dtype=torch.long),
             kv_slot_mapping=torch.arange(8), compress_ratio=4)
    a.update(over)
    return a


def score_args(**over):
    a = dict(q_fp4=torch.zeros(2, 4, 64, dtype=torch.uint8), q_scale=torch.full((2, 4, 4), 127, dtype=torch.uint8),
             weights=torch.randn(2, 4), kv_cache=torch.full((2, 4352), 0x77, dtype=torch.uint8),
             query_start_loc=torch.tensor([0, 1, 2]), context_lens=torch.tensor([64, 10]),
             block_table=torch.tensor([[0], [1]]), row_ends=torch.tensor([64, 10]), page_size=64, shuffle=[32, 16, 2])
    a.update(over)
    return a


def nan_state():
    s = torch.randn(4, 16, 512)
    s[0, 3, 0] = NAN
    return s


K, Q, P, S = (reference.k_norm_rope_mxfp4_cache, reference.q_rope_mxfp4_quant, reference.compress_pool,
              reference.paged_mxfp4_mqa_logits)
K8, Q8 = reference.k_norm_rope_fp8_cache, reference.q_rope_fp8_quant

VALUE_ERRORS = [  # op, arguments, the argument the message must start with
    (K, k_args(k=torch.randn(8, 128).half()), "k"),
    (K, k_args(k=torch.randn(8, 1, 128).bfloat16()), "k"),
    (K, k_args(k=torch.randn(8, 100).bfloat16(), norm_weight=torch.ones(100).bfloat16()), "k"),
    (K, k_args(slot_mapping=torch.arange(8) + 60), "slot_mapping"),
    (K, k_args(slot_mapping=torch.arange(8).float()), "slot_mapping"),
    (K, k_args(positions=torch.arange(7)), "positions"),
    (K, k_args(positions=torch.arange(8) + 60), "positions"),
    (K, k_args(kv_cache=torch.zeros(1, 4352)), "kv_cache"),
    (K, k_args(kv_cache=torch.zeros(1, 4000, dtype=torch.uint8)), "kv_cache"),
    (K, k_args(page_size=64.0), "page_size"),
    (K, k_args(page_size=48), "page_size"),
    (K, k_args(shuffle=[32, 16]), "shuffle"),
    (K, k_args(rounding="hip"), "rounding"),
    (K, k_args(scale_rule="nearest"), "scale_rule"),
    (K, k_args(norm_weight=torch.ones(64)), "norm_weight"),
    (K8, {k: v for k, v in k_args(fp8_dtype="e5m2").items() if k != "shuffle"}, "fp8_dtype"),
    (Q, q_args(q=torch.randn(3, 4, 128)), "q"),
    (Q, q_args(q=torch.randn(3, 4, 48).bfloat16()), "q"),
    (Q, q_args(weights=torch.randn(3, 5)), "weights"),
    (Q, q_args(weights_scale="a"), "weights_scale"),
    (Q, q_args(positions=torch.tensor([0, 1, 99])), "positions"),
    (Q8, q_args(positions=torch.tensor([0, 1, 99])), "positions"),
    (P, pool_args(state_cache=torch.randn(4, 16, 512).double()), "state_cache"),
    (P, pool_args(state_cache=torch.randn(4, 16, 80)), "state_cache"),
    (P, pool_args(block_table=torch.tensor([[9, 1], [2, 3]])), "block_table"),
    (P, pool_args(req_index=torch.full((8,), 2)), "req_index"),
    (P, pool_args(positions=torch.arange(8) + 40), "block_table"),
    (P, pool_args(positions=torch.arange(8) - 1), "positions"),
    (P, pool_args(compress_ratio=0), "compress_ratio"),
    (S, score_args(block_table=torch.tensor([[0], [2]])), "block_table"),
    (S, score_args(block_table=torch.tensor([[0], [-1]])), "block_table"),
    (S, score_args(context_lens=torch.tensor([65, 10])), "context_lens"),
    (S, score_args(row_ends=torch.tensor([64, 11])), "row_ends"),
    (S, score_args(query_start_loc=torch.tensor([0, 2, 1])), "query_start_loc"),
    (S, score_args(q_scale=torch.zeros(2, 4, 3, dtype=torch.uint8)), "q_scale"),
    (S, score_args(q_fp4=torch.zeros(2, 4, 20, dtype=torch.uint8), q_scale=torch.zeros(2, 4, 1, dtype=torch.uint8)), "q_fp4"),
    (S, score_args(kv_cache=torch.zeros(2, 4352)), "kv_cache"),
    (S, score_args(width=10), "width"),
    (S, score_args(weights=torch.randn(2, 4).double()), "weights"),
    (reference.topk, dict(logits=torch.randn(2, 5), lengths=torch.tensor([1, 2]), k=0), "k"),
    (reference.topk, dict(logits=torch.randn(2, 5), lengths=torch.tensor([1, 6]), k=2), "lengths"),
    (reference.topk, dict(logits=torch.zeros(2, 5, dtype=torch.int32), lengths=torch.tensor([1, 2]), k=2), "logits"),
]

NON_FINITE = [
    (K, k_args(k=torch.full((8, 128), NAN).bfloat16()), "k"),
    (K, k_args(norm_weight=torch.full((128,), NAN)), "norm_weight"),
    (K, k_args(cos_sin_cache=torch.full((64, 64), NAN)), "cos_sin_cache"),
    (Q, q_args(q=torch.full((3, 4, 128), float("inf")).bfloat16()), "q"),
    (Q, q_args(weights=torch.full((3, 4), NAN)), "weights"),
    (Q, q_args(weights_scale=float("inf")), "weights_scale"),
    (Q, q_args(cos_sin_cache=torch.full((64, 64), NAN)), "cos_sin_cache"),
    (Q8, q_args(q=torch.full((3, 4, 128), NAN).bfloat16()), "q"),
    (P, pool_args(state_cache=nan_state()), "state_cache"),
    (S, score_args(weights=torch.full((2, 4), NAN)), "weights"),
    (S, score_args(q_scale=torch.full((2, 4, 4), 255, dtype=torch.uint8)), "q_scale"),
    (S, score_args(kv_cache=torch.full((2, 4352), 255, dtype=torch.uint8)), "kv_cache"),
    (reference.paged_fp8_mqa_logits,
     {k: v for k, v in score_args(kv_cache=torch.full((2, 64 * 132), 0x7F, dtype=torch.uint8)).items()
      if k not in ("q_fp4", "q_scale", "shuffle")} | {"q_fp8": torch.zeros(2, 4, 128, dtype=torch.uint8)}, "kv_cache"),
    (reference.topk, dict(logits=torch.full((2, 5), float("inf")), lengths=torch.tensor([5, 5]), k=2), "logits"),
]


def _id(case):
    return f"{case[0].__name__}-{case[2]}"


@pytest.mark.parametrize("op,args,arg", VALUE_ERRORS, ids=[f"{i}-{_id(c)}" for i, c in enumerate(VALUE_ERRORS)])
def test_bad_arguments_raise_one_clear_value_error(op, args, arg):
    with pytest.raises(ValueError) as err:
        op(**args)
    msg = str(err.value)
    assert msg.startswith(arg) and "\n" not in msg, msg
    assert not isinstance(err.value, reference.NonFiniteInput)


@pytest.mark.parametrize("op,args,arg", NON_FINITE, ids=[f"{i}-{_id(c)}" for i, c in enumerate(NON_FINITE)])
def test_non_finite_inputs_are_reported(op, args, arg):
    with pytest.raises(reference.NonFiniteInput) as err:
        op(**args)
    assert err.value.arg.startswith(arg) and err.value.count > 0


def test_good_arguments_pass():
    """Teeth for the tables above: the unmodified arguments are accepted."""
    K(**k_args())
    Q(**q_args())
    P(**pool_args())
    S(**score_args())
    with pytest.raises(ValueError, match="^x: last dimension 33"):
        mxfp4.quantize_mxfp4(torch.zeros(33))
