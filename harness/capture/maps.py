"""What the capture hook wraps and how one call becomes a dump record: the selections, the
argument maps (one per upstream calling convention) and the targets, read from the
upstream table (`optimized.upstream`)."""
from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from optimized import upstream
from reference.layout import choose_shuffle

# the block scores of the last scorer launch that wrote some (DeepSeek-V4.1): a top-k over
# them is not the indexer's top-k
LAST = {"block_scores": None}

# --- selections ---------------------------------------------------------------------------

def _cut(s: str) -> str:
    return s if len(s) <= 40 else s[:37] + "..."


class Selection:
    """A set of non-negative integers from "all" or "12,20" or "0-3,300" (ranges inclusive)."""

    def __init__(self, text: str = "all", name: str = "selection"):
        self.text = text.strip() or "all"
        self.all = self.text.lower() == "all"
        self.ranges: list[tuple[int, int]] = []
        if not self.all:
            for part in self.text.split(","):
                m = re.fullmatch(r"\s*(\d{1,12})\s*(?:-\s*(\d{1,12})\s*)?", part)
                if not m:
                    raise ValueError(f"{name}: cannot read {_cut(part.strip())!r} in {_cut(text)!r} "
                                     "(expected 'all' or numbers of at most 12 digits and ranges like 0-3,300)")
                lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
                if hi < lo:
                    raise ValueError(f"{name}: range {part.strip()!r} runs backwards")
                self.ranges.append((lo, hi))

    def __contains__(self, n) -> bool:
        if self.all:
            return True
        if n is None:
            return False
        for lo, hi in self.ranges:
            if lo <= n <= hi:
                return True
        return False

    def __repr__(self) -> str:
        return f"Selection({self.text!r})"


# --- argument maps -------------------------------------------------------------------------

@dataclass(frozen=True)
class Staged:
    """An input getter in two parts: `view(bound)`, the call's tensor as it is (no device
    work), and `finish(tensor, bound)`, the dump's field made from it (a cat, a cast: device
    work). Called, it is both, as any getter: an eager call is recorded that way. Under a
    CUDA/HIP graph the capture stages the view alone and applies `finish` when a sampled
    replay is read from the ring: a getter that computed would put its work into the graph,
    to run at every replay."""
    view: Callable[[dict], Any]
    finish: Callable[[Any, dict], Any]

    def __call__(self, bound: dict):
        return self.finish(self.view(bound), bound)

    def finisher(self, bound: dict) -> Callable[[Any], Any]:
        """`finish` for the call `bound`, as a function of the staged view alone."""
        return lambda view: self.finish(view, bound)


Getter = Union[str, Callable[[dict], Any], Staged]


def _as_float(name: str) -> Staged:
    """The parameter `name` as fp32 (a cast where it is not: a RoPE table in bf16)."""
    return Staged(lambda b: b[name], lambda t, b: t.float())


def _state_rows(name: str, head: Callable[[dict], int], width: Callable[[dict], int]) -> Staged:
    """The state rows (`_pool_rows`) of the pool passed as `name`: staged as the pool is."""
    return Staged(lambda b: b[name], lambda s, b: _pool_rows(s, head(b), width(b)))


@dataclass
class ArgMap:
    """How one op call becomes a dump record.

    inputs / scalars: dump name -> the call's parameter name, or a function of the bound
    arguments (a dict of parameter name -> value, `__grid__` for Triton launches).
    outputs: dump name -> a parameter name (an out-argument, read after the call), or a
    function `(bound, result) -> tensor`. params: positional names, for callables without
    an inspectable signature (Triton launchers). classify: None to record the call, or the
    reason it is not this op (the call then passes unrecorded, with one warning)."""
    inputs: dict[str, Getter]
    outputs: dict[str, Union[str, Callable[[dict, Any], Any]]]
    scalars: dict[str, Any] = field(default_factory=dict)
    params: Optional[list[str]] = None
    classify: Optional[Callable[[dict], Optional[str]]] = None   # -> why the call is not the op


def _get(getter, bound: dict):
    return bound[getter] if isinstance(getter, str) else getter(bound)


def _result(i: int):
    return lambda bound, result: result[i]


def _pool_2d(t: torch.Tensor) -> torch.Tensor:
    """aiter pools are [P, page_size, (1,) entry_bytes]: the dump's view is [P, page_bytes]."""
    return t.reshape(t.shape[0], -1)


def _aiter_page_size(bound: dict) -> int:
    t = bound["kv_cache"]
    d = bound["k"].shape[-1]
    return t.shape[1] if t.dim() >= 3 else t.shape[1] // (d // 2 + d // 32)


def _tokens(bound: dict) -> int:
    return bound["slot_mapping"].numel()


AITER_K_WRITER = ArgMap(
    inputs={"k": lambda b: b["k"][:_tokens(b)], "positions": lambda b: b["positions"][:_tokens(b)],
            "cos_sin_cache": _as_float("cos_sin_cache"), "norm_weight": "norm_weight",
            "slot_mapping": "slot_mapping", "kv_cache": lambda b: _pool_2d(b["kv_cache"])},
    outputs={"kv_cache": lambda b, r: _pool_2d(b["kv_cache"])},
    scalars={"norm_eps": lambda b: float(b["norm_eps"]), "compress_ratio": lambda b: int(b["compress_ratio"]),
             "page_size": _aiter_page_size,
             "shuffle": lambda b: None if b["shuffle"] is None else [int(v) for v in b["shuffle"]]})

AITER_Q_QUANT = ArgMap(
    inputs={"q": "q", "positions": "positions", "cos_sin_cache": _as_float("cos_sin_cache"),
            "weights": "weights"},
    outputs={"q_fp4": _result(0), "q_scale": _result(1), "weights": _result(2)},
    scalars={"weights_scale": lambda b: float(b["weights_scale"])})


def _scorer_rows(bound: dict) -> int:
    return bound["q"].numel() // (bound["q"].shape[-1] * bound["q"].shape[-2])


def _next_n(bound: dict) -> int:
    """Rows per sequence of a batched launch (q [B, next_n, H, D/2])."""
    return bound["q"].shape[1] if bound["q"].dim() == 4 else 1


def _scorer_qsl(bound: dict) -> torch.Tensor:
    if bound.get("query_start_loc") is not None:
        return bound["query_start_loc"]
    b = bound["context_lens"].numel()
    return torch.arange(b + 1, device=bound["q"].device, dtype=torch.int32) * _next_n(bound)


def _scorer_row_ends(bound: dict) -> torch.Tensor:
    """row_ends (newer aiter) or cu_ends (older), else aiter's default: row n of sequence b
    sees context_lens[b] - next_n + n + 1 entries."""
    for name in ("row_ends", "cu_ends"):
        if bound.get(name) is not None:
            return bound[name]
    if bound.get("query_start_loc") is not None:
        raise ValueError("a varlen launch without row_ends: the rows' bounds are not recorded")
    n = _next_n(bound)
    cl = bound["context_lens"].long()
    i = torch.arange(n, device=cl.device).repeat(cl.numel())
    return (cl.repeat_interleave(n) - n + i + 1).clamp_min(0).to(torch.int32)


def _scorer_logits(bound: dict, result):
    out = result[0] if isinstance(result, tuple) else result
    if bound.get("out_logits") is not None:
        out = bound["out_logits"]
    return out.reshape(_scorer_rows(bound), -1)


def _scorer_shuffle(bound: dict):
    if not bound.get("preshuffle"):
        return None
    return choose_shuffle(bound["q"].shape[-1] * 2, bound["q"].shape[-2]).as_list()


def _classify_scorer(bound: dict) -> Optional[str]:
    if bound.get("use_gather"):
        return "a candidate gather launch (use_gather, DeepSeek-V4.1) scores candidate slots, not the context"
    if bound.get("calc_block_scores") and bound.get("block_scores") is not None:
        LAST["block_scores"] = weakref.ref(bound["block_scores"])   # the top-k over them is not mxval's
    if bound.get("calc_logits") is False:
        return "a block-score-only launch (calc_logits=False) writes no logits"
    return None


AITER_SCORER = ArgMap(
    inputs={"q_fp4": lambda b: b["q"].reshape(-1, *b["q"].shape[-2:]),
            "q_scale": lambda b: b["q_scales"].reshape(-1, *b["q_scales"].shape[-2:]),
            "weights": Staged(lambda b: b["weights"].reshape(_scorer_rows(b), -1), lambda t, b: t.float()),
            "kv_cache": lambda b: _pool_2d(b["kv_cache"]), "query_start_loc": _scorer_qsl,
            "context_lens": "context_lens", "block_table": "block_table", "row_ends": _scorer_row_ends},
    outputs={"logits": _scorer_logits},
    scalars={"page_size": lambda b: int(b["kv_cache"].shape[1]), "shuffle": _scorer_shuffle,
             "clean_logits": lambda b: bool(b["clean_logits"])},
    classify=_classify_scorer)


def _pool_rows(s: torch.Tensor, d: int, sw: int) -> torch.Tensor:
    """vLLM's state rows hold kv (2D) at 0 and scores (2D) at STATE_WIDTH: the dump's row is
    [kv_a | kv_b | score_a | score_b]."""
    rows = s.reshape(s.shape[0], s.shape[1], -1)
    return torch.cat((rows[..., :2 * d], rows[..., sw:sw + 2 * d]), -1).float()


def _no_overlap(ratio, overlap) -> Optional[str]:
    if not overlap or int(ratio) != 4:
        return (f"pooling at ratio {int(ratio)} without overlap is not mxval's compress_pool "
                "(the overlap pooling of the ratio-4 indexer)")
    return None


def _grid_tokens(b: dict) -> int:
    g = b["__grid__"]
    return int(g[0] if isinstance(g, (tuple, list)) else g)


def _launch_params(key: str) -> list[str]:
    return list(upstream.target(key).bound_params())


# 0.33.0: compress_pool(state_cache, token_to_req_indices, positions, kv_slot_mapping,
# block_table, block_size, pooled_k, state_width, compress_ratio, overlap), T = pooled_k rows
VLLM_COMPRESS_POOL = ArgMap(
    params=_launch_params("vllm.rocm.compress_pool"),
    inputs={"state_cache": _state_rows("state_cache", lambda b: b["pooled_k"].shape[1],
                                       lambda b: int(b["state_width"])),
            "block_table": "block_table",
            "positions": lambda b: b["positions"][:b["pooled_k"].shape[0]],
            "req_index": lambda b: b["token_to_req_indices"][:b["pooled_k"].shape[0]],
            "kv_slot_mapping": lambda b: b["kv_slot_mapping"][:b["pooled_k"].shape[0]]},
    outputs={"pooled": "pooled_k"},
    scalars={"compress_ratio": lambda b: int(b["compress_ratio"])},
    classify=lambda b: _no_overlap(b["compress_ratio"], b["overlap"]))

# 8e4f5df9: _compress_pool_kernel[(T,)](state_cache_ptr, ..., out_ptr, out_stride, HEAD_SIZE=, ...)
VLLM_COMPRESS_POOL_KERNEL = ArgMap(
    params=_launch_params("vllm.rocm.compress_pool@8e4f5df9"),
    inputs={"state_cache": _state_rows("state_cache_ptr", lambda b: int(b["HEAD_SIZE"]),
                                       lambda b: int(b["STATE_WIDTH"])),
            "block_table": "block_table_ptr",
            "positions": lambda b: b["positions_ptr"][:_grid_tokens(b)],
            "req_index": lambda b: b["token_to_req_indices_ptr"][:_grid_tokens(b)],
            "kv_slot_mapping": lambda b: b["kv_slot_mapping_ptr"][:_grid_tokens(b)]},
    outputs={"pooled": lambda b, r: b["out_ptr"][:_grid_tokens(b)]},
    scalars={"compress_ratio": lambda b: int(b["COMPRESS_RATIO"])},
    classify=lambda b: _no_overlap(b["COMPRESS_RATIO"], b["OVERLAP"]))


def _classify_topk(logits) -> Optional[str]:
    ref = LAST["block_scores"]
    if ref is not None and ref() is logits:
        return "a top-k over block scores (DeepSeek-V4.1's candidate blocks) is not the indexer's top-k"
    return None


# vLLM's _topk(logits, lengths, out, k): whichever kernel vLLM picks, -1 padded
VLLM_TOPK = ArgMap(
    inputs={"logits": "logits", "lengths": lambda b: b["lengths"].reshape(-1)},
    outputs={"indices": "out"}, scalars={"k": lambda b: int(b["k"])},
    classify=lambda b: _classify_topk(b["logits"]))


def _aiter_topk_lengths(b: dict) -> torch.Tensor:
    n, rows, seq = int(b["next_n"]), int(b["numRows"]), b["seqLens"]
    if n == 1:
        return seq.reshape(-1)[:rows]
    r = torch.arange(rows, device=seq.device)
    return (seq.long()[r // n] - n + r % n + 1).clamp_min(0).to(torch.int32)


# aiter's top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k)
AITER_TOPK = ArgMap(
    inputs={"logits": lambda b: b["logits"][:int(b["numRows"])], "lengths": _aiter_topk_lengths},
    outputs={"indices": lambda b, r: b["indices"][:int(b["numRows"])]}, scalars={"k": lambda b: int(b["k"])},
    classify=lambda b: _classify_topk(b["logits"]))


# vLLM's CUDA path: the fused K writers, launched kernel[(T,)](state_cache_ptr, ...,
# k_cache_ptr, kv_slot_mapping_ptr, kv_cache_block_size, HEAD_SIZE=, ...) by the fused
# compressor's launcher; T = num_actual tokens, one program each
def _bytes_2d(t: torch.Tensor) -> torch.Tensor:
    """A pool as the dump's [P, page_bytes] bytes."""
    return _pool_2d(t if t.dtype == torch.uint8 else t.view(torch.uint8))


def _fused_slots(b: dict) -> torch.Tensor:
    """A token writes an entry when its compressor slot (slot_mapping_ptr, negative for a
    padding token) and its cache slot are both set: mxval's op has one slot mapping."""
    t = _grid_tokens(b)
    return b["kv_slot_mapping_ptr"][:t].masked_fill(b["slot_mapping_ptr"][:t] < 0, -1)


def _classify_fused(b: dict) -> Optional[str]:
    d = int(b["HEAD_SIZE"])
    if d & (d - 1) or d != int(b["TRITON_BLOCK_SIZE"]):
        return f"a fused K launch with HEAD_SIZE={d} (not a power of two) is outside compress_norm_rope's contract"
    if b.get("MX_SCALE"):
        return "an FP8 fused K launch with MX scales (MX_SCALE) stores ue8m0 scales, not compress_norm_rope_fp8_cache's fp32"
    return _no_overlap(b["COMPRESS_RATIO"], b["OVERLAP"])


def _fused_map(key: str, fp8: bool) -> ArgMap:
    return ArgMap(
        params=_launch_params(key),
        inputs={"state_cache": _state_rows("state_cache_ptr", lambda b: int(b["HEAD_SIZE"]),
                                           lambda b: int(b["STATE_WIDTH"])),
                "block_table": "block_table_ptr",
                "positions": lambda b: b["positions_ptr"][:_grid_tokens(b)],
                "req_index": lambda b: b["token_to_req_indices_ptr"][:_grid_tokens(b)],
                "kv_slot_mapping": _fused_slots,
                "cos_sin_cache": _as_float("cos_sin_cache_ptr"),
                "norm_weight": "rms_norm_weight_ptr",
                "kv_cache": lambda b: _bytes_2d(b["k_cache_ptr"])},
        outputs={"kv_cache": lambda b, r: _bytes_2d(b["k_cache_ptr"])},
        scalars={"compress_ratio": lambda b: int(b["COMPRESS_RATIO"]), "norm_eps": lambda b: float(b["rms_norm_eps"]),
                 "page_size": lambda b: int(b["kv_cache_block_size"]), **({"fp8_dtype": "e4m3fn"} if fp8 else {})},
        classify=_classify_fused)


VLLM_FUSED_K_MXFP4 = _fused_map("vllm.cuda.k_mxfp4", fp8=False)
VLLM_FUSED_K_FP8 = _fused_map("vllm.cuda.k_fp8", fp8=True)


def _fused_maps(base: ArgMap, key: str, fp8: bool) -> tuple:
    """The kernel's table entry and its alternatives (`key@version`, a release that changed
    the launch), each bound by its own parameter list."""
    return tuple((t.key, base if t.key == key else _fused_map(t.key, fp8)) for t in upstream.group(key))


@dataclass(frozen=True)
class Hook:
    """One mxval op and, in order, the upstream table keys it may be reached through."""
    op: str
    maps: tuple[tuple[str, ArgMap], ...]


HOOKS = (
    Hook("compress_pool", (("vllm.rocm.compress_pool", VLLM_COMPRESS_POOL),
                           ("vllm.rocm.compress_pool@8e4f5df9", VLLM_COMPRESS_POOL_KERNEL))),
    Hook("k_norm_rope_mxfp4_cache", (("aiter.k_writer", AITER_K_WRITER),)),
    Hook("q_rope_mxfp4_quant", (("aiter.q_quant", AITER_Q_QUANT),)),
    Hook("paged_mxfp4_mqa_logits", (("aiter.scorer", AITER_SCORER),)),     # both generations
    Hook("topk", (("vllm.ops.topk", VLLM_TOPK), ("aiter.topk", AITER_TOPK))),
    # vLLM's CUDA path: the fused K writers (pool, norm, RoPE, quantize, insert in one kernel)
    Hook("compress_norm_rope_mxfp4_cache", _fused_maps(VLLM_FUSED_K_MXFP4, "vllm.cuda.k_mxfp4", fp8=False)),
    Hook("compress_norm_rope_fp8_cache", _fused_maps(VLLM_FUSED_K_FP8, "vllm.cuda.k_fp8", fp8=True)),
)
# functools caches in vLLM that hold aiter functions fetched at their first call
CACHED_LOOKUPS = ("vllm.ops.aiter_cache_ops",)


@dataclass(frozen=True)
class Target:
    module: str
    attr: str
    op: str
    arg_map: ArgMap
    launcher: bool = False            # a Triton kernel launched as kernel[grid](...)


def _targets_of(hook: Hook) -> tuple[Target, ...]:
    out = []
    for key, amap in hook.maps:
        t = upstream.target(key)
        out += [Target(m, t.name, hook.op, amap, launcher=t.kind == "triton_jit") for m in t.modules]
    return tuple(out)


# per op, its alternatives: install() wraps the first one that imports
TARGETS: list[tuple[Target, ...]] = [_targets_of(h) for h in HOOKS]

