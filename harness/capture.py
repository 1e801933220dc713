"""Capture hook: record the indexer's op calls in a running vLLM (ROCm) as mxval dumps.

Each wrapped op, on a chosen layer and step, clones its inputs before the call (in-place
outputs such as the K pool are cloned BEFORE and AFTER), calls the real op with the very
same arguments, and returns its result untouched; the clones become one dump per (layer,
step) (harness.dumps format), which `mxval diff FILE` replays anywhere. Capture problems
are logged once and never reach the op: capturing cannot change what the op computes.

Enable it (the environment is read at install() time):

    export MXVAL_CAPTURE_DIR=/data/mxval-dumps     # required; nothing is wrapped without it
    export MXVAL_CAPTURE_LAYERS=12,20              # or "all" (default)
    export MXVAL_CAPTURE_STEPS=0-3,300             # or "all" (default); ranges inclusive
    # then, before vLLM imports its model code, in every process that runs the model:
    #   a sitecustomize.py on PYTHONPATH holding
    #       import harness.capture; harness.capture.install()
    #   or for one process:
    python -c "import harness.capture as c; c.install(); from vllm.entrypoints.cli.main import main; main()" \
        serve deepseek-ai/DeepSeek-V4-Pro --enforce-eager ...

Run with `--enforce-eager`: a replayed HIP/CUDA graph never enters the Python wrappers
(calls made while a graph is being captured are skipped, with one warning).

Layer and step. The model integration says where it is:

    import harness.capture as capture
    capture.set_context(layer=self.layer_idx, step=step)     # before the indexer runs

Without that, `MXVAL_CAPTURE_AUTO_LAYERS=N` (N indexer layers per forward: 30 in V4-Pro)
counts calls of the anchor op (`MXVAL_CAPTURE_ANCHOR`, default compress_pool): call c is
indexer layer c % N of forward step c // N (layer = the indexer layer's ordinal, not the
model layer number). Dumps are written when the context moves on, by flush(), and at exit,
as `layer<L>_step<S>[_rank<R>].safetensors` (R from RANK or LOCAL_RANK under TP/DP).

Targets. TARGETS lists (module, attribute, dump op, argument map); install() replaces each
attribute with `wrap(fn, op, arg_map)` and rebinds every loaded module that imported the
original by name. The argument maps follow the signatures of aiter@689b79d5/5677775a and
vLLM@8e4f5df9 as read from their sources; for another version, pass your own targets:
`install([Target(module, attr, op, ArgMap(...))])`. The pool is large: each captured K
writer call clones it twice (choose few layers and steps).
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
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

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
    an inspectable signature (Triton launchers)."""
    inputs: dict[str, Getter]
    outputs: dict[str, Union[str, Callable[[dict, Any], Any]]]
    scalars: dict[str, Any] = field(default_factory=dict)
    params: Optional[list[str]] = None


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


def _scorer_qsl(bound: dict) -> torch.Tensor:
    if bound.get("query_start_loc") is not None:
        return bound["query_start_loc"]
    b = bound["context_lens"].numel()
    per = _scorer_rows(bound) // b                  # next_n rows per sequence
    return torch.arange(b + 1, device=bound["q"].device, dtype=torch.int32) * per


def _scorer_row_ends(bound: dict) -> torch.Tensor:
    if bound.get("row_ends") is not None:
        return bound["row_ends"]
    per = _scorer_rows(bound) // bound["context_lens"].numel()
    if per != 1:
        raise ValueError("row_ends not passed and next_n > 1: the rows' bounds are not recorded")
    return bound["context_lens"]


def _scorer_logits(bound: dict, result):
    out = result[0] if isinstance(result, tuple) else result
    if out is None:
        out = bound["out_logits"]
    return out.reshape(_scorer_rows(bound), -1)


def _scorer_shuffle(bound: dict):
    from reference.layout import choose_shuffle
    if not bound.get("preshuffle"):
        return None
    return choose_shuffle(bound["q"].shape[-1] * 2, bound["q"].shape[-2]).as_list()


AITER_SCORER = ArgMap(
    inputs={"q_fp4": lambda b: b["q"].reshape(-1, *b["q"].shape[-2:]),
            "q_scale": lambda b: b["q_scales"].reshape(-1, *b["q_scales"].shape[-2:]),
            "weights": lambda b: b["weights"].reshape(_scorer_rows(b), -1).float(),
            "kv_cache": lambda b: _pool_2d(b["kv_cache"]), "query_start_loc": _scorer_qsl,
            "context_lens": "context_lens", "block_table": "block_table", "row_ends": _scorer_row_ends},
    outputs={"logits": _scorer_logits},
    scalars={"page_size": lambda b: int(b["kv_cache"].shape[1]), "shuffle": _scorer_shuffle,
             "clean_logits": lambda b: bool(b["clean_logits"])})


def _pool_state(b: dict) -> torch.Tensor:
    """vLLM's state rows hold kv (2D) at 0 and scores (2D) at STATE_WIDTH: the dump's row is
    [kv_a | kv_b | score_a | score_b]."""
    s, d, sw = b["state_cache"], b["HEAD_SIZE"], b["STATE_WIDTH"]
    rows = s.reshape(s.shape[0], s.shape[1], -1)
    return torch.cat((rows[..., :2 * d], rows[..., sw:sw + 2 * d]), -1).float()


def _grid_tokens(b: dict) -> int:
    g = b["__grid__"]
    return int(g[0] if isinstance(g, (tuple, list)) else g)


VLLM_COMPRESS_POOL = ArgMap(
    params=["state_cache", "state_cache_stride0", "state_cache_stride1", "token_to_req_indices",
            "positions", "kv_slot_mapping", "block_table", "block_table_stride", "block_size", "out",
            "out_stride"],
    inputs={"state_cache": _pool_state, "block_table": "block_table",
            "positions": lambda b: b["positions"][:_grid_tokens(b)],
            "req_index": lambda b: b["token_to_req_indices"][:_grid_tokens(b)],
            "kv_slot_mapping": lambda b: b["kv_slot_mapping"][:_grid_tokens(b)]},
    outputs={"pooled": lambda b, r: b["out"][:_grid_tokens(b)]},
    scalars={"compress_ratio": lambda b: int(b["COMPRESS_RATIO"])})


@dataclass(frozen=True)
class Target:
    module: str
    attr: str
    op: str
    arg_map: ArgMap
    launcher: bool = False            # a Triton kernel launched as kernel[grid](...)


TARGETS = [
    Target("vllm.models.deepseek_v4.amd.mxfp4_indexer", "_compress_pool_kernel", "compress_pool",
           VLLM_COMPRESS_POOL, launcher=True),
    Target("aiter.ops.triton.fusions.k_norm_rope_mxfp4_cache", "k_norm_rope_mxfp4_cache",
           "k_norm_rope_mxfp4_cache", AITER_K_WRITER),
    Target("aiter.ops.triton.rope.q_rope_mxfp4_quant", "q_rope_mxfp4_quant", "q_rope_mxfp4_quant",
           AITER_Q_QUANT),
    Target("aiter.ops.triton.attention.pa_mqa_logits_mxfp4", "paged_mxfp4_mqa_logits",
           "paged_mxfp4_mqa_logits", AITER_SCORER),
]


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
    from .dumps import write_dump
    from .replay import record_op
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


def wrap(fn: Callable, op: str, arg_map: ArgMap, *, extra: Optional[Callable[[], dict]] = None) -> Callable:
    """`fn` with capture around it. The call itself is `fn(*args, **kwargs)`, unchanged; the
    capture only ever reads (clones) the arguments and the result."""
    bind = _binder(fn, arg_map)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _S.lock:
            key = _active(op)
        if key is None:
            return fn(*args, **kwargs)
        try:
            bound = bind(args, kwargs)
            if extra is not None:
                bound.update(extra())
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

    wrapper.__mxval_capture__ = op
    return wrapper


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


def install(targets: Optional[list[Target]] = None, *, quiet: bool = False,
            rebind_prefixes: tuple = REBIND_PREFIXES) -> list[str]:
    """Wrap every importable target when MXVAL_CAPTURE_DIR is set (else do nothing).
    Returns the `module.attr` names wrapped; targets that cannot be imported are skipped.
    Loaded modules under `rebind_prefixes` that imported a target by name get the wrapper too."""
    cfg = _Config.from_env()
    if cfg.directory is None:
        return []
    os.makedirs(cfg.directory, exist_ok=True)
    done, skipped = [], []
    with _S.lock:
        _S.config = cfg
        _S.written = []
        for t in TARGETS if targets is None else targets:
            try:
                mod = importlib.import_module(t.module)
                orig = getattr(mod, t.attr)
            except Exception as e:
                skipped.append(f"{t.module}.{t.attr} ({type(e).__name__})")
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
        _S.config = None
        _S.layer = _S.step = None
        _S.explicit = False
        _S.anchor_calls = 0
