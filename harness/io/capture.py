"""Capture hook: record the indexer's op calls in a running vLLM (ROCm) as mxval dumps.

Each wrapped op, on a chosen layer and step, clones its inputs before the call (in-place
outputs such as the K pool are cloned BEFORE and AFTER), calls the real op with the very
same arguments, and returns its result untouched; the clones become one dump per (layer,
step) (harness.io.dumps format), which `mxval diff FILE` replays anywhere. Capture problems
are logged once and never reach the op: capturing cannot change what the op computes.

Enable it (the environment is read at install() time):

    export MXVAL_CAPTURE_DIR=/data/mxval-dumps     # required; nothing is wrapped without it
    export MXVAL_CAPTURE_LAYERS=12,20              # or "all" (default)
    export MXVAL_CAPTURE_STEPS=0-3,300             # or "all" (default); ranges inclusive
    # then, before vLLM imports its model code, in every process that runs the model:
    #   a sitecustomize.py on PYTHONPATH holding
    #       import harness.io.capture; harness.io.capture.install()
    #   or for one process:
    python -c "import harness.io.capture as c; c.install(); from vllm.entrypoints.cli.main import main; main()" \
        serve deepseek-ai/DeepSeek-V4-Pro --enforce-eager ...

Run with `--enforce-eager`: a replayed HIP/CUDA graph never enters the Python wrappers
(calls made while a graph is being captured are skipped, with one warning).

Layer and step. The model integration says where it is:

    import harness.io.capture as capture
    capture.set_context(layer=self.layer_idx, step=step)     # before the indexer runs

Without that, `MXVAL_CAPTURE_AUTO_LAYERS=N` (N indexer layers per forward: 30 in V4-Pro)
counts calls of the anchor op (`MXVAL_CAPTURE_ANCHOR`, default compress_pool): call c is
indexer layer c % N of forward step c // N (layer = the indexer layer's ordinal, not the
model layer number). Dumps are written when the context moves on, by flush(), and at exit,
as `layer<L>_step<S>[_rank<R>].safetensors` (R from RANK or LOCAL_RANK under TP/DP).

Targets. The hook wraps, per mxval op, the first upstream function of its list in
`optimized.upstream` that is present (vLLM 0.33.0 first, then older layouts):

    compress_pool            vLLM's pooling dispatcher (0.33.0) or its kernel launch (8e4f5df9)
    k_norm_rope_mxfp4_cache  aiter's K writer          q_rope_mxfp4_quant  aiter's Q quant
    paged_mxfp4_mqa_logits   aiter's scorer (row_ends or cu_ends generation)
    topk                     vLLM's top-k choice (aiter's or its own kernel), else aiter's

install() replaces each attribute, rebinds every loaded module that imported the original
by name, and clears vLLM's cached look-up of aiter's K writer and Q quant, so it may run
after the first call too (installing before vLLM imports its model code is still the way).
A wrapper passes every attribute of what it wraps through (vLLM's dispatcher keeps
`register_warmup`, `kernel`, ...). Calls that are not one of mxval's ops are passed through
unrecorded, with one warning: DeepSeek-V4.1's candidate gather (`use_gather`), its
block-score-only launches and the top-k over block scores, pooling without overlap. For
another version, pass your own targets: `install([Target(module, attr, op, ArgMap(...))])`.
The pool is large: each captured K writer call clones it twice (choose few layers and steps).
"""
from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import os
import re
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from optimized import upstream

ENV_DIR = "MXVAL_CAPTURE_DIR"
ENV_LAYERS = "MXVAL_CAPTURE_LAYERS"
ENV_STEPS = "MXVAL_CAPTURE_STEPS"
ENV_AUTO = "MXVAL_CAPTURE_AUTO_LAYERS"
ENV_ANCHOR = "MXVAL_CAPTURE_ANCHOR"
ENV_MODEL = "MXVAL_CAPTURE_MODEL"


# --- selections ---------------------------------------------------------------------------

class Selection:
    """A set of non-negative integers from "all" or "12,20" or "0-3,300" (ranges inclusive)."""

    def __init__(self, text: str = "all"):
        self.text = text.strip() or "all"
        self.all = self.text.lower() == "all"
        self.ranges: list[tuple[int, int]] = []
        if not self.all:
            for part in self.text.split(","):
                m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
                if not m:
                    raise ValueError(f"selection: cannot read {part.strip()!r} in {text!r} "
                                     "(expected 'all' or numbers and ranges like 0-3,300)")
                lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
                if hi < lo:
                    raise ValueError(f"selection: range {part.strip()!r} runs backwards")
                self.ranges.append((lo, hi))

    def __contains__(self, n) -> bool:
        if self.all:
            return True
        return n is not None and any(lo <= n <= hi for lo, hi in self.ranges)

    def __repr__(self) -> str:
        return f"Selection({self.text!r})"


# --- argument maps -------------------------------------------------------------------------

Getter = Union[str, Callable[[dict], Any]]


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
            "cos_sin_cache": lambda b: b["cos_sin_cache"].float(), "norm_weight": "norm_weight",
            "slot_mapping": "slot_mapping", "kv_cache": lambda b: _pool_2d(b["kv_cache"])},
    outputs={"kv_cache": lambda b, r: _pool_2d(b["kv_cache"])},
    scalars={"norm_eps": lambda b: float(b["norm_eps"]), "compress_ratio": lambda b: int(b["compress_ratio"]),
             "page_size": _aiter_page_size,
             "shuffle": lambda b: None if b["shuffle"] is None else [int(v) for v in b["shuffle"]]})

AITER_Q_QUANT = ArgMap(
    inputs={"q": "q", "positions": "positions", "cos_sin_cache": lambda b: b["cos_sin_cache"].float(),
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
    from reference.layout import choose_shuffle
    if not bound.get("preshuffle"):
        return None
    return choose_shuffle(bound["q"].shape[-1] * 2, bound["q"].shape[-2]).as_list()


def _classify_scorer(bound: dict) -> Optional[str]:
    if bound.get("use_gather"):
        return "a candidate gather launch (use_gather, DeepSeek-V4.1) scores candidate slots, not the context"
    if bound.get("calc_block_scores") and bound.get("block_scores") is not None:
        _S.block_scores = weakref.ref(bound["block_scores"])   # the top-k over them is not mxval's
    if bound.get("calc_logits") is False:
        return "a block-score-only launch (calc_logits=False) writes no logits"
    return None


AITER_SCORER = ArgMap(
    inputs={"q_fp4": lambda b: b["q"].reshape(-1, *b["q"].shape[-2:]),
            "q_scale": lambda b: b["q_scales"].reshape(-1, *b["q_scales"].shape[-2:]),
            "weights": lambda b: b["weights"].reshape(_scorer_rows(b), -1).float(),
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
    inputs={"state_cache": lambda b: _pool_rows(b["state_cache"], b["pooled_k"].shape[1], int(b["state_width"])),
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
    inputs={"state_cache": lambda b: _pool_rows(b["state_cache_ptr"], int(b["HEAD_SIZE"]), int(b["STATE_WIDTH"])),
            "block_table": "block_table_ptr",
            "positions": lambda b: b["positions_ptr"][:_grid_tokens(b)],
            "req_index": lambda b: b["token_to_req_indices_ptr"][:_grid_tokens(b)],
            "kv_slot_mapping": lambda b: b["kv_slot_mapping_ptr"][:_grid_tokens(b)]},
    outputs={"pooled": lambda b, r: b["out_ptr"][:_grid_tokens(b)]},
    scalars={"compress_ratio": lambda b: int(b["COMPRESS_RATIO"])},
    classify=lambda b: _no_overlap(b["COMPRESS_RATIO"], b["OVERLAP"]))


def _classify_topk(logits) -> Optional[str]:
    ref = _S.block_scores
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


# --- state --------------------------------------------------------------------------------

@dataclass
class _Config:
    directory: Optional[str]
    layers: Selection
    steps: Selection
    auto_layers: Optional[int]
    anchor: str
    model: str

    @classmethod
    def from_env(cls) -> "_Config":
        auto = os.environ.get(ENV_AUTO)
        return cls(os.environ.get(ENV_DIR) or None, Selection(os.environ.get(ENV_LAYERS, "all")),
                   Selection(os.environ.get(ENV_STEPS, "all")), int(auto) if auto else None,
                   os.environ.get(ENV_ANCHOR, "compress_pool"),
                   os.environ.get(ENV_MODEL, "deepseek-v4-pro"))


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.config: Optional[_Config] = None
        self.layer: Optional[int] = None
        self.step: Optional[int] = None
        self.explicit = False                 # set_context was called: no auto counting
        self.anchor_calls = 0
        self.pending: dict[tuple, dict] = {}
        self.installed: list[tuple[Any, str, Any]] = []
        self.rebound: list[tuple[Any, str, Any]] = []
        self.written: list[str] = []
        self.warned: set[str] = set()
        self.block_scores = None              # weakref to the last scorer call's block scores


_S = _State()


def _warn_once(key: str, msg: str) -> None:
    if key not in _S.warned:
        _S.warned.add(key)
        warnings.warn(f"mxval capture: {msg}", RuntimeWarning, stacklevel=3)


def set_context(layer: Optional[int] = None, step: Optional[int] = None) -> None:
    """Where the model is now; records of the previous (layer, step) are written."""
    with _S.lock:
        _S.explicit = True
        if (layer, step) != (_S.layer, _S.step):
            _flush_except((layer, step))
        _S.layer, _S.step = layer, step


def context() -> tuple[Optional[int], Optional[int]]:
    return _S.layer, _S.step


def written() -> list[str]:
    """Paths of the dumps written since install()."""
    return list(_S.written)


def flush() -> list[str]:
    """Write every pending record; returns the paths written by this call."""
    with _S.lock:
        before = len(_S.written)
        _flush_except(None)
        return _S.written[before:]


def _flush_except(keep) -> None:
    for key in [k for k in _S.pending if k != keep]:
        _write(key, _S.pending.pop(key))


def _source() -> str:
    parts = [f"mxval capture pid {os.getpid()}", f"torch {torch.__version__}"]
    for mod in ("vllm", "aiter", "triton"):
        m = sys.modules.get(mod)
        if m is not None:
            parts.append(f"{mod} {getattr(m, '__version__', '?')}")
    if torch.cuda.is_available():
        try:
            parts.append(torch.cuda.get_device_name())
        except Exception:
            pass
    return "; ".join(parts)


def _write(key: tuple, calls: dict) -> None:
    from harness.io.dumps import write_dump
    from harness.run.replay import record_op
    layer, step = key
    records = {}
    for op, (ins, scalars, outs) in calls.items():
        try:
            records[op] = record_op(op, ins, scalars, outs)
        except Exception as e:
            _warn_once(f"record:{op}", f"{op} not recorded: {e}")
    if not records:
        return
    cfg = _S.config
    tag = lambda v: "x" if v is None else str(v)
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")   # one file per rank under TP/DP
    base = os.path.join(cfg.directory, f"layer{tag(layer)}_step{tag(step)}" + (f"_rank{rank}" if rank else ""))
    path, n = base + ".safetensors", 1
    while os.path.exists(path) or path in _S.written:
        path, n = f"{base}_{n}.safetensors", n + 1
    try:
        _S.written.append(write_dump(path, records, source=_source(), model=cfg.model, layer=layer,
                                     step=step))
    except Exception as e:
        _warn_once(f"write:{path}", f"cannot write {path}: {e}")


def _graph_capturing() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


def _active(op: str) -> Optional[tuple]:
    """The (layer, step) to record this call under, or None to let it pass untouched."""
    cfg = _S.config
    if cfg is None or cfg.directory is None:
        return None
    if not _S.explicit and cfg.auto_layers and op == cfg.anchor:
        c = _S.anchor_calls
        _S.anchor_calls += 1
        key = (c % cfg.auto_layers, c // cfg.auto_layers)
        if key != (_S.layer, _S.step):
            _flush_except(key)
            _S.layer, _S.step = key
    if _S.layer not in cfg.layers or _S.step not in cfg.steps:
        return None
    if _graph_capturing():
        _warn_once("graph", "skipping calls made during graph capture (run vLLM with --enforce-eager)")
        return None
    return _S.layer, _S.step


def _clone(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


# --- wrapping -------------------------------------------------------------------------------

def _binder(fn, arg_map: ArgMap):
    if arg_map.params is not None:
        names = arg_map.params

        def bind(args, kwargs):
            bound = dict(zip(names, args))
            bound.update(kwargs)
            return bound
        return bind
    sig = inspect.signature(fn)

    def bind(args, kwargs):
        b = sig.bind(*args, **kwargs)
        b.apply_defaults()
        return dict(b.arguments)
    return bind


class _Wrapped:
    """Stands in for a callable object (vLLM's kernel dispatcher, a functools cache, ...):
    calls go through the capture, every attribute and `[...]` reach the original."""

    def __init__(self, wrapped, call, op: str):
        functools.update_wrapper(self, wrapped, updated=())
        self._mxval_call = call
        self.__mxval_capture__ = op

    def __call__(self, *args, **kwargs):
        return self._mxval_call(*args, **kwargs)

    def __getattr__(self, name):
        if name == "__wrapped__":
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __getitem__(self, key):
        return self.__wrapped__[key]

    def __repr__(self) -> str:
        return f"<mxval capture of {self.__wrapped__!r}>"


def wrap(fn: Callable, op: str, arg_map: ArgMap, *, extra: Optional[Callable[[], dict]] = None) -> Callable:
    """`fn` with capture around it. The call itself is `fn(*args, **kwargs)`, unchanged; the
    capture only ever reads (clones) the arguments and the result. A plain function gets a
    function (functools.wraps); any other callable an object that passes its attributes on."""
    bind = _binder(fn, arg_map)

    def wrapper(*args, **kwargs):
        with _S.lock:
            key = _active(op)
        if key is None:
            return fn(*args, **kwargs)
        try:
            bound = bind(args, kwargs)
            if extra is not None:
                bound.update(extra())
            why = arg_map.classify(bound) if arg_map.classify is not None else None
            if why:
                _warn_once(f"skip:{op}:{why}", f"{op}: {why}; passed through, not recorded")
                return fn(*args, **kwargs)
            ins = {name: _clone(_get(g, bound)) for name, g in arg_map.inputs.items()}
            scalars = {name: (_get(g, bound) if callable(g) or isinstance(g, str) and g in bound else g)
                       for name, g in arg_map.scalars.items()}
        except Exception as e:
            _warn_once(f"in:{op}", f"{op}: cannot read the call's inputs ({type(e).__name__}: {e}); not captured")
            return fn(*args, **kwargs)
        result = fn(*args, **kwargs)
        try:
            outs = {name: _clone(bound[g] if isinstance(g, str) else g(bound, result))
                    for name, g in arg_map.outputs.items()}
            with _S.lock:
                calls = _S.pending.setdefault(key, {})
                if op in calls:                   # a second call in the same (layer, step)
                    _write(key, _S.pending.pop(key))
                    calls = _S.pending.setdefault(key, {})
                calls[op] = (ins, scalars, outs)
        except Exception as e:
            _warn_once(f"out:{op}", f"{op}: cannot read the call's outputs ({type(e).__name__}: {e}); not captured")
        return result

    if inspect.isfunction(fn) or inspect.ismethod(fn):
        wrapper = functools.wraps(fn)(wrapper)
        wrapper.__mxval_capture__ = op
        return wrapper
    return _Wrapped(fn, wrapper, op)


class _Launcher:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches through the capture."""

    def __init__(self, kernel, op: str, arg_map: ArgMap):
        self.__wrapped__ = kernel
        self.__mxval_capture__ = op
        self._op, self._map = op, arg_map

    def __getitem__(self, grid):
        launch = self.__wrapped__[grid]
        return wrap(lambda *a, **k: launch(*a, **k), self._op, self._map,
                    extra=lambda: {"__grid__": grid})

    def __getattr__(self, name):
        return getattr(self.__wrapped__, name)


def wrap_launcher(kernel, op: str, arg_map: ArgMap) -> _Launcher:
    return _Launcher(kernel, op, arg_map)


REBIND_PREFIXES = ("vllm", "aiter")


def _clear_cached_lookups() -> None:
    """vLLM fetches aiter's K writer and Q quant once, through a functools cache: clear it so
    the next call fetches the attribute as it is now (wrapped, or restored)."""
    for key in CACHED_LOOKUPS:
        t = upstream.target(key)
        for mname in t.modules:
            fn = getattr(sys.modules.get(mname), t.name, None)
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()


def install(targets: Optional[list] = None, *, quiet: bool = False,
            rebind_prefixes: tuple = REBIND_PREFIXES) -> list[str]:
    """Wrap every importable target when MXVAL_CAPTURE_DIR is set (else do nothing).
    `targets`: Targets, or tuples of alternative Targets of which the first that imports is
    wrapped (default: TARGETS, read from optimized.upstream). Returns the `module.attr`
    names wrapped; targets that cannot be imported are skipped. Loaded modules under
    `rebind_prefixes` that imported a target by name get the wrapper too."""
    cfg = _Config.from_env()
    if cfg.directory is None:
        return []
    os.makedirs(cfg.directory, exist_ok=True)
    done, skipped = [], []
    with _S.lock:
        _S.config = cfg
        _S.written = []
        for alts in TARGETS if targets is None else targets:
            alts = alts if isinstance(alts, (tuple, list)) else (alts,)
            tried = []
            for t in alts:
                try:
                    mod = importlib.import_module(t.module)
                    orig = getattr(mod, t.attr)
                except Exception as e:
                    tried.append(f"{t.module}.{t.attr} ({type(e).__name__})")
                    continue
                break
            else:
                skipped.append(" or ".join(dict.fromkeys(tried)) if tried else "?")
                continue
            if getattr(orig, "__mxval_capture__", None):
                continue
            new = wrap_launcher(orig, t.op, t.arg_map) if t.launcher else wrap(orig, t.op, t.arg_map)
            setattr(mod, t.attr, new)
            _S.installed.append((mod, t.attr, orig))
            for mname, m in list(sys.modules.items()):   # modules that did `from x import fn`
                d = getattr(m, "__dict__", None)
                if m is mod or not isinstance(d, dict) or not mname.startswith(rebind_prefixes):
                    continue
                for name, v in list(d.items()):
                    if v is orig:
                        setattr(m, name, new)
                        _S.rebound.append((m, name, orig))
            done.append(f"{t.module}.{t.attr}")
        _clear_cached_lookups()
    if not _S.__dict__.get("atexit"):
        atexit.register(flush)
        _S.atexit = True
    if not quiet:
        print(f"mxval capture: {len(done)} op(s) wrapped ({', '.join(done) or 'none'}); "
              f"layers {cfg.layers.text}, steps {cfg.steps.text} -> {cfg.directory}"
              + (f"; skipped {', '.join(skipped)}" if skipped else ""), file=sys.stderr)
    return done


def uninstall() -> None:
    """Flush, restore every wrapped attribute, and forget the context."""
    with _S.lock:
        if _S.config is not None:
            _flush_except(None)
        for mod, name, orig in reversed(_S.rebound + _S.installed):
            setattr(mod, name, orig)
        _S.installed.clear()
        _S.rebound.clear()
        _clear_cached_lookups()
        _S.block_scores = None
        _S.config = None
        _S.layer = _S.step = None
        _S.explicit = False
        _S.anchor_calls = 0
