"""Adapter: aiter's ROCm ops (gfx950) behind the mxval backend interface.

Thin by design: arguments are checked with the reference's own checks, moved to the GPU,
and mapped onto aiter's signatures, which `optimized.upstream` pins (keys below; `mxval
upstream check --aiter DIR` compares them with a checkout):

    aiter.k_writer  (k, positions, cos_sin_cache, norm_weight, norm_eps, kv_cache,
                     slot_mapping, compress_ratio, shuffle) -> None, the pool in place
    aiter.q_quant   (q, positions, cos_sin_cache, weights, weights_scale)
                     -> (q_fp4, q_scale u8 [T, H, D/32], weights)
    aiter.scorer    two API generations, told apart by the signature at call time:
                     row_ends: one varlen launch, q [Rw, H, D/2] with query_start_loc= and
                               row_ends= (what vLLM launches per prefill chunk);
                     cu_ends:  q [B, next_n, H, D/2] per run of equal row counts, cu_ends=
    aiter.topk      (logits, next_n, seqLens, indices, numRows, stride0, stride1, k)

The pool is cloned first (the mxval op returns a new pool; aiter writes in place).
"""
from __future__ import annotations

import inspect

import torch

from reference import layout
from reference.k_writer import check_mxfp4_k_writer
from reference.q_quant import check_q_args
from reference.scoring import check_mxfp4_scorer

from . import DECLARED, Backend, BackendUnavailable, upstream
from .common import (
    equal_row_groups,
    import_targets,
    on_device,
    paged_view,
    require_production,
    rocm_gfx950_reason,
    topk_on_device,
)

NAME = "aiter"
FUNCTIONS = {
    "k_norm_rope_mxfp4_cache": "aiter.k_writer",
    "q_rope_mxfp4_quant": "aiter.q_quant",
    "paged_mxfp4_mqa_logits": "aiter.scorer",
    "topk": "aiter.topk",
}


def scorer_generation(fn) -> upstream.Target:
    """The table entry of aiter's scorer that `fn`'s signature binds (row_ends before cu_ends)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise BackendUnavailable(f"aiter's paged_mxfp4_mqa_logits: signature unreadable ({e})") from None
    for t in upstream.group("aiter.scorer"):
        if all(p in params for p in t.bound_params()):
            return t
    need = "; ".join("/".join(n for n in t.keyword() if n in ("row_ends", "query_start_loc", "cu_ends"))
                     for t in upstream.group("aiter.scorer"))
    raise BackendUnavailable(f"aiter's paged_mxfp4_mqa_logits has none of the parameters mxval binds ({need}): "
                             "an API generation mxval does not know (run `mxval upstream check --aiter DIR`)")


def _own_rope(op: str, rope: str | None, numerics: dict) -> None:
    """`rope`: the reference option the runner passes when the backend declares it
    (Backend.numerics); aiter's kernel computes that one, and only that one."""
    want = numerics.get(op, {}).get("rope", "separate")
    if rope is not None and rope != want:
        raise ValueError(f"rope: aiter's {op} computes rope={want!r} here, got {rope!r}")


def _k_norm_rope_mxfp4_cache(fn: dict, device: str, numerics: dict):
    def k_norm_rope_mxfp4_cache(*, k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                norm_eps: float = 1e-6, compress_ratio: int = 4, page_size: int = 64,
                                shuffle=(32, 16, 2), rounding: str = "rocm", hadamard: bool = False,
                                scale_rule: str = "ceil", rope: str | None = None) -> dict:
        require_production(rounding=rounding, scale_rule=scale_rule, hadamard=hadamard, who="aiter's K writer")
        _own_rope("k_norm_rope_mxfp4_cache", rope, numerics)
        shuf = check_mxfp4_k_writer(k, positions, cos_sin_cache, norm_weight, slot_mapping, kv_cache,
                                    norm_eps, compress_ratio, page_size, shuffle, rounding)
        (kd, pd, cd, wd, sd), back = on_device(device, k, positions, cos_sin_cache, norm_weight, slot_mapping)
        out = kv_cache.to(device, copy=True)
        fn["k_norm_rope_mxfp4_cache"](kd.contiguous(), pd.contiguous(), cd, wd, float(norm_eps),
                                      paged_view(out, page_size, layout.entry_bytes(k.shape[1])),
                                      sd.contiguous(), compress_ratio,
                                      tuple(shuf.as_list()) if shuf else None)
        return {"kv_cache": back(out, kv_cache)}
    return k_norm_rope_mxfp4_cache


def _q_rope_mxfp4_quant(fn: dict, device: str, numerics: dict):
    def q_rope_mxfp4_quant(*, q, positions, cos_sin_cache, weights, weights_scale: float,
                           hadamard: bool = False, scale_rule: str = "ceil", rope: str | None = None) -> dict:
        require_production(scale_rule=scale_rule, hadamard=hadamard, who="aiter's Q quant")
        _own_rope("q_rope_mxfp4_quant", rope, numerics)
        check_q_args(q, positions, cos_sin_cache, weights, weights_scale)
        (qd, pd, cd, wd), back = on_device(device, q, positions, cos_sin_cache, weights)
        q_fp4, q_scale, w = fn["q_rope_mxfp4_quant"](qd, pd.contiguous(), cd, wd.contiguous(),
                                                      float(weights_scale))
        return {"q_fp4": back(q_fp4, q), "q_scale": back(q_scale, q), "weights": back(w, weights)}
    return q_rope_mxfp4_quant


def _paged_mxfp4_mqa_logits(fn: dict, device: str, numerics: dict):
    def paged_mxfp4_mqa_logits(*, q_fp4, q_scale, weights, kv_cache, query_start_loc, context_lens,
                               block_table, row_ends, page_size: int = 64, shuffle=(32, 16, 2),
                               clean_logits: bool = False, width: int | None = None) -> dict:
        shuf, d, width, _ = check_mxfp4_scorer(q_fp4, q_scale, weights, kv_cache, query_start_loc,
                                            context_lens, block_table, row_ends, page_size, shuffle, width)
        rw, h, tb = q_fp4.shape
        if shuf is not None and shuf != layout.choose_shuffle(d, h):
            raise ValueError(f"shuffle: aiter's scorer reads {layout.choose_shuffle(d, h).as_list()} "
                             f"pages for H={h}, D={d}; got {shuf.as_list()}")
        (qv, qs, w, kc, bt, cl, ends, qsl), back = on_device(device, q_fp4, q_scale, weights, kv_cache,
                                                             block_table, context_lens, row_ends,
                                                             query_start_loc)
        fill = float("-inf") if clean_logits else 0.0
        out = torch.full((rw, width), fill, dtype=torch.float32, device=device)
        pages = paged_view(kc, page_size, layout.entry_bytes(d))
        scorer = fn["paged_mxfp4_mqa_logits"]
        common = dict(clean_logits=clean_logits, preshuffle=int(shuf is not None))
        i32 = lambda t: t.to(torch.int32).contiguous()
        if scorer_generation(scorer).key == "aiter.scorer":
            if rw:
                scorer(qv.contiguous(), qs.contiguous(), pages, w.contiguous(), i32(cl), i32(bt), width,
                       out_logits=out, row_ends=i32(ends), query_start_loc=i32(qsl), **common)
        else:
            for s0, s1, r0, n in equal_row_groups(query_start_loc):
                r1 = r0 + (s1 - s0) * n
                scorer(qv[r0:r1].reshape(s1 - s0, n, h, tb), qs[r0:r1].reshape(s1 - s0, n, h, d // 32),
                       pages, w[r0:r1].contiguous(), i32(cl[s0:s1]), i32(bt[s0:s1]), width,
                       out_logits=out[r0:r1], cu_ends=i32(ends[r0:r1]), **common)
        return {"logits": back(out, weights)}
    return paged_mxfp4_mqa_logits


def _topk(fn: dict, device: str, numerics: dict):
    def topk(*, logits, lengths, k: int) -> dict:
        x, ln, idx, back = topk_on_device("aiter's", device, logits, lengths, k)
        rows, width = x.shape
        if width < k:
            # vLLM never hands aiter's kernel rows narrower than k (it takes its own
            # kernel then); such rows are all shorter than k, so -inf columns change
            # nothing but give the kernel the shape it is used at.
            x = torch.cat((x, x.new_full((rows, k - width), float("-inf"))), dim=1)
        # next_n = 1 and seqLens = the row lengths: row r sees [0, lengths[r])
        if rows:
            fn["topk"](x, 1, ln.to(torch.int32).contiguous(), idx, rows, x.stride(0), x.stride(1), k)
        return {"indices": back(idx, logits)}
    return topk


# op name -> factory of the op over aiter's functions (made where `fn` holds the function)
_OPS = {"k_norm_rope_mxfp4_cache": _k_norm_rope_mxfp4_cache, "q_rope_mxfp4_quant": _q_rope_mxfp4_quant,
        "paged_mxfp4_mqa_logits": _paged_mxfp4_mqa_logits, "topk": _topk}


def make_ops(fn: dict, device: str = "cuda", numerics: dict | None = None) -> dict:
    """mxval ops over aiter's functions `fn` (by FUNCTIONS label). Tests pass fakes.
    `numerics`: the backend's declared reference options (how the compiled kernels contract
    their rotation), checked against what the runner passes."""
    return {name: make(fn, device, numerics or {}) for name, make in _OPS.items() if name in fn}


def make_backend() -> Backend:
    desc = DECLARED[NAME].summary
    fn, _, missing = import_targets(FUNCTIONS)
    platform = rocm_gfx950_reason()
    reason = "; ".join(missing + ([platform] if platform else [])) or None
    if reason:
        return Backend(NAME, desc, reason=reason)
    return Backend(NAME, desc, make_ops(fn), device="cuda")
