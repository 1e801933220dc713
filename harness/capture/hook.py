"""The capture hook's state and wrappers: eager calls are cloned at the call; calls made
while a CUDA/HIP graph is captured become device-to-device copies into staging buffers
that every replay refills, copied after each chosen replay into a preallocated ring and
drained from it to dumps (harness.capture's docstring says how to use it)."""
from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from harness.io import env
from harness.io.dumps import write_dump
from harness.run.replay import record_op
from optimized import upstream

from . import nodes as graph_nodes
from . import shadow as shadow_mode
from .maps import CACHED_LOOKUPS, LAST, TARGETS, ArgMap, Selection, Staged, _get

ENV_DIR = "MXVAL_CAPTURE_DIR"
ENV_LAYERS = "MXVAL_CAPTURE_LAYERS"
ENV_STEPS = "MXVAL_CAPTURE_STEPS"
ENV_AUTO = "MXVAL_CAPTURE_AUTO_LAYERS"
ENV_ANCHOR = "MXVAL_CAPTURE_ANCHOR"
ENV_MODEL = "MXVAL_CAPTURE_MODEL"
ENV_RING = "MXVAL_CAPTURE_RING"
RING_DEFAULT = 4
GRAPH_ATTR = "_mxval_capture"          # a captured graph's record set, on the CUDAGraph object
KEPT_ATTR = "_mxval_kept"              # on a CUDAGraph the hook made keep its graph (its nodes can be switched)


# --- state --------------------------------------------------------------------------------

def _positive_int(name: str, default: Optional[int]) -> Optional[int]:
    return env.integer(name, default, 1, 2 ** 31)


@dataclass
class _Config:
    directory: Optional[str]
    layers: Selection
    steps: Selection
    auto_layers: Optional[int]
    anchor: str
    model: str
    ring: int = RING_DEFAULT              # graph steps held on the device between drains

    @classmethod
    def from_env(cls) -> "_Config":
        return cls(env.text(ENV_DIR) or None, Selection(env.text(ENV_LAYERS, "all"), name=ENV_LAYERS),
                   Selection(env.text(ENV_STEPS, "all"), name=ENV_STEPS),
                   _positive_int(ENV_AUTO, None),
                   env.text(ENV_ANCHOR, "compress_pool") or "compress_pool",
                   env.text(ENV_MODEL, "deepseek-v4-pro") or "deepseek-v4-pro",
                   _positive_int(ENV_RING, RING_DEFAULT))


@dataclass
class _GraphCall:
    """One op call recorded in a graph: per field a staging buffer that the graph's own
    copy refills at every replay, and a ring of buffers [ring, *shape] (allocated when the
    capture ends, outside the graph's memory pool) that a chosen replay is copied into."""
    op: str
    layer: Optional[int]
    scalars: dict
    inputs: dict                                        # name -> staging buffer
    outputs: dict
    ring_inputs: dict = field(default_factory=dict)     # name -> ring buffer
    ring_outputs: dict = field(default_factory=dict)
    finish: dict = field(default_factory=dict)          # input name -> what makes the field of its staged view

    def at(self, pos: int) -> tuple[dict, dict, dict]:
        """(inputs, scalars, outputs) of ring position `pos`, each input finished (maps.Staged)."""
        ins = {n: (self.finish[n](b[pos]) if n in self.finish else b[pos]) for n, b in self.ring_inputs.items()}
        return ins, self.scalars, {n: b[pos] for n, b in self.ring_outputs.items()}


@dataclass(eq=False)                   # a record is itself (hashable: the hook keeps a weak set of them)
class _GraphRecord:
    """What one graph capture recorded."""
    calls: list = field(default_factory=list)
    anchor_calls: int = 0
    layer: Optional[int] = None                         # auto counting inside the capture
    busy: set = field(default_factory=set)              # shadow mode: ring positions not yet checked
    flag: Optional[torch.Tensor] = None                 # int32 on the device: the replay's step is chosen
    flag_on: Optional[bool] = None                      # what the flag holds now (None: not yet set)
    # the recording copies' kernel nodes (harness.capture.nodes), switched on for chosen
    # replays only; None: not switchable (the copies run at every replay, their flag decides)
    nodes: Optional[list] = None
    exec_: Optional[int] = None                         # the instantiated graph the nodes are switched in
    nodes_on: bool = True                               # what the nodes are now (enabled when captured)


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.config: Optional[_Config] = None
        self.layer: Optional[int] = None
        self.step: Optional[int] = None
        self.selected = False                 # (layer, step) is a chosen one
        self.explicit = False                 # set_context was called: no auto counting
        self.busy = False                     # a call may have to be looked at: selected, capturing
        self.counted: Optional[str] = None    # the op whose calls auto counting counts
        self.anchor_calls = 0
        self.pending: dict[tuple, dict] = {}
        self.installed: list[tuple[Any, str, Any]] = []
        self.rebound: list[tuple[Any, str, Any]] = []
        self.written: list[str] = []
        self.warned: set[str] = set()
        self.capture: Optional[_GraphRecord] = None    # between capture_begin and capture_end
        self.ring: list[dict] = []                     # position -> {"step", "records"}
        self.replays = 0                               # replays of recording graphs (step without context)
        self.atexit = False
        self.shadow: Optional[shadow_mode.Shadow] = None   # shadow mode: records go to its checker
        self.kernels: dict = {}                        # device kernels the hook uses, looked up once
        self.records = weakref.WeakSet()               # recording graphs' records (disarmed at uninstall)


_S = _State()


def _warn_once(key: str, msg: str) -> None:
    if key not in _S.warned:
        _S.warned.add(key)
        warnings.warn(f"mxval capture: {msg}", RuntimeWarning, stacklevel=3)


def _trouble(key: str, msg: str) -> None:
    """A failure inside the recording path: warned once; in shadow mode it switches the
    shadow off (serving goes on)."""
    _warn_once(key, msg)
    sh = _S.shadow
    if sh is not None:
        sh.fail(msg)


def _move_to(layer: Optional[int], step: Optional[int]) -> None:
    if layer != _S.layer or step != _S.step:
        if _S.pending:
            with _S.lock:
                _flush_except((layer, step))
        _S.layer, _S.step = layer, step
    cfg = _S.config
    _S.selected = cfg is not None and layer in cfg.layers and step in cfg.steps
    _refresh()


def _refresh() -> None:
    """What the wrappers' fast path reads: a call of any op other than `counted` passes
    straight through unless `busy`."""
    cfg = _S.config
    _S.counted = cfg.anchor if cfg is not None and cfg.auto_layers and not _S.explicit else None
    _S.busy = cfg is not None and (_S.selected or _S.capture is not None)


def set_context(layer: Optional[int] = None, step: Optional[int] = None) -> None:
    """Where the model is now; records of the previous (layer, step) are written. Under
    CUDA graphs: set the layer while the graph is captured, the step before each replay."""
    with _S.lock:
        _S.explicit = True
        _move_to(layer, step)                 # refreshes the fast path with `explicit` set


def context() -> tuple[Optional[int], Optional[int]]:
    return _S.layer, _S.step


def written() -> list[str]:
    """Paths of the dumps written since install()."""
    return list(_S.written)


def flush() -> list[str]:
    """Write every pending record and drain the graph ring; returns the paths written."""
    with _S.lock:
        before = len(_S.written)
        _drain_locked()
        _flush_except(None)
        return _S.written[before:]


def drain() -> list[str]:
    """Move the ring's recorded graph steps to the host and write them as dumps (the model
    runner may call it after a replay, e.g. between requests; it synchronizes the device).
    Returns the paths written."""
    with _S.lock:
        before = len(_S.written)
        _drain_locked()
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
    layer, step = key
    if _S.shadow is not None:                 # shadow mode: checked off the serving path, not written
        _S.shadow.submit(layer, step, calls)
        return
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


EAGER, GRAPH = "eager", "graph"


def _active(op: str) -> Optional[tuple]:
    """(EAGER, (layer, step)) or (GRAPH, layer) to record this call under, or None to let it
    pass untouched."""
    cfg = _S.config
    if cfg is None:
        return None
    if _S.capture is not None and _graph_capturing():
        return _graph_layer(op, cfg, _S.capture)
    if not _S.explicit and cfg.auto_layers and op == cfg.anchor:
        c = _S.anchor_calls
        _S.anchor_calls += 1
        _move_to(c % cfg.auto_layers, c // cfg.auto_layers)
    if not _S.selected:
        return None
    if _graph_capturing():
        _warn_once("graph", "a graph capture not begun through torch.cuda.CUDAGraph: its calls are not recorded")
        return None
    return EAGER, (_S.layer, _S.step)


def _idle_anchor() -> bool:
    """An anchor call while nothing is recorded (not busy), counted here when the (layer,
    step) it moves to is not chosen and no record is pending: True, the call passes
    untouched. False: `_active` counts it. The idle path of every serving step, so it stays
    this short (a wrapped call runs cold, between the launches of the ops around it)."""
    cfg = _S.config
    if cfg is None or not cfg.auto_layers:            # uninstalled meanwhile: _active decides
        return False
    c = _S.anchor_calls
    layer, step = c % cfg.auto_layers, c // cfg.auto_layers
    if _S.pending or layer in cfg.layers and step in cfg.steps:
        return False                                  # chosen: _active asks again (a shadow's
    _S.anchor_calls = c + 1                           # Steps answers a step once)
    _S.layer, _S.step, _S.selected = layer, step, False
    return True


def _graph_layer(op: str, cfg: _Config, rec: _GraphRecord) -> Optional[tuple]:
    """Inside a capture the layer is set_context's, or counted from the anchor calls of this
    capture (every capture is one whole forward); steps are chosen at replay."""
    if _S.explicit:
        layer = _S.layer
    else:
        if cfg.auto_layers and op == cfg.anchor:
            rec.layer = rec.anchor_calls % cfg.auto_layers
            rec.anchor_calls += 1
        layer = rec.layer
    return (GRAPH, layer) if layer in cfg.layers else None


def _clone(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _stage_copies(flag: torch.Tensor, pairs: list, launched: Optional[Callable[[], None]] = None) -> None:
    """stage = src for every (src, stage) pair, on the device, when `flag` is set at the time
    the copies run (captured: the graph repeats this at every replay, and a replay whose
    step is not chosen, its flag clear, copies nothing). On a GPU one launch of
    optimized.triton_kernels.copy_if per call, `launched()` called after each (the capture
    notes its node); where that kernel cannot run (no compiled Triton, a field that is not
    contiguous) plain copies that run at every replay."""
    if flag.device.type == "cpu":                 # read when it runs (graphs on the host: the tests')
        if int(flag):
            for src, stage in pairs:
                stage.copy_(src)
        return
    fast = _copy_if()
    flagged = []
    for src, stage in pairs:
        if fast is not None and src.is_contiguous() and src.device == flag.device:
            flagged.append((src, stage))
        else:
            stage.copy_(src)
    if flagged:
        fast(flag, flagged, launched)


def _copy_if():
    """optimized.triton_kernels.copy_if.copy_if as a function of (flag, pairs), or None where
    mxval's compiled Triton kernels cannot run (no triton, the interpreter, no GPU: importing
    the kernel there would fix this process's Triton mode as compiled)."""
    if "copy_if" not in _S.kernels:
        fn = None
        try:
            from optimized.triton_kernels import compiled_reason
            if compiled_reason() is None:
                from optimized.triton_kernels.copy_if import copy_if as fn
        except Exception:
            fn = None
        _S.kernels["copy_if"] = fn
    return _S.kernels["copy_if"]


def _warm_copy_if() -> None:
    """The flagged copy compiled and loaded on the current device before a capture begins
    (inside one, compiling would be a device call the capture forbids); where that fails,
    the capture's recording copies are plain ones (they then run at every replay)."""
    if _copy_if() is None:
        return
    dev = torch.cuda.current_device()
    if ("warm", dev) in _S.kernels:
        return
    try:
        from optimized.triton_kernels.copy_if import warm
        warm(dev)
        _S.kernels[("warm", dev)] = True
    except Exception as e:
        _S.kernels["copy_if"] = None
        _warn_once("copy_if", f"flagged graph copies unavailable ({type(e).__name__}: {e}); "
                   "recording copies run at every replay")


def _stage_all(values: dict, rec: "_GraphRecord") -> dict:
    """Staging buffers holding `values` at this point of the graph, filled only on replays
    whose step is chosen (the record's flag). They come from the graph's memory pool, where
    kernels earlier in the graph may use the same bytes: each holds its field from this
    point to the end of a replay, which is when the replay hook copies it into the ring
    (never across replays)."""
    pairs, stages = [], {}
    for name, v in values.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"a recorded field is a {type(v).__name__}, not a tensor")
        stages[name] = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        pairs.append((v.detach(), stages[name]))
        if rec.flag is None:                   # torch.empty launches nothing into the graph
            rec.flag = torch.empty(1, dtype=torch.int32, device=v.device)
    if pairs:
        _stage_copies(rec.flag, pairs, None if rec.nodes is None else lambda: _note_node(rec))
    return stages


def _note_node(rec: "_GraphRecord") -> None:
    """The recording copy just captured noted as a node to switch (harness.capture.nodes);
    where it cannot be told, the record's copies are not switched (they stay in the graph,
    their flag deciding)."""
    if rec.nodes is None:
        return
    try:
        rec.nodes.append(graph_nodes.api().last())
    except Exception as e:
        rec.nodes = None
        _warn_once("nodes", f"recording copies left on at every replay: their graph nodes are not known "
                            f"({type(e).__name__}: {e})")


# --- graphs: capture, replay, drain ----------------------------------------------------------

def _capture_begin(orig):
    @functools.wraps(orig)
    def capture_begin(self, *args, **kwargs):
        with _S.lock:
            _S.capture = _GraphRecord() if _S.config is not None else None
            if _S.capture is not None and getattr(self, KEPT_ATTR, False):
                _S.capture.nodes = []          # its copies' nodes are noted, to be switched off
            _refresh()
            sh = _S.shadow
        if _S.capture is not None:
            _warm_copy_if()
        gated = _shadow_gate(sh, "capture_begins")   # no checker device call during the capture
        try:
            return orig(self, *args, **kwargs)
        except BaseException:
            if gated:
                _shadow_gate(sh, "capture_ends")
            raise
    return capture_begin


def _shadow_gate(sh, what: str) -> bool:
    """Tell the shadow a capture begins or ends (never raises: a failure switches it off)."""
    if sh is None:
        return False
    try:
        getattr(sh, what)()
        return True
    except Exception as e:
        _trouble(f"shadow:{what}", f"shadow: {what} failed ({type(e).__name__}: {e})")
        return False


def _ring_buffers(rec: _GraphRecord, ring: int) -> None:
    """The ring, allocated after the capture (the graph never writes it)."""
    for c in rec.calls:
        for stages, rings in ((c.inputs, c.ring_inputs), (c.outputs, c.ring_outputs)):
            for name, t in stages.items():
                rings[name] = torch.empty((ring, *t.shape), dtype=t.dtype, device=t.device)


def _capture_end(orig):
    @functools.wraps(orig)
    def capture_end(self, *args, **kwargs):
        try:
            out = orig(self, *args, **kwargs)
            if getattr(self, KEPT_ATTR, False):
                self.instantiate()            # what capture_end does for a graph not kept
        finally:
            with _S.lock:
                rec, _S.capture = _S.capture, None
                _refresh()
                sh = _S.shadow
            _shadow_gate(sh, "capture_ends")
        with _S.lock:
            if rec is not None and rec.calls and _S.config is not None:
                try:
                    _ring_buffers(rec, _S.config.ring)
                except Exception as e:        # out of memory, say: the graph runs unrecorded
                    _warn_once("ring", f"graph not recorded: cannot allocate its ring ({type(e).__name__}: {e})")
                    return out
                if _switch_off(self, rec):
                    setattr(self, GRAPH_ATTR, rec)
                    _S.records.add(rec)
        return out
    return capture_end


def _set_nodes(rec: _GraphRecord, on: bool) -> None:
    """Every recording copy node of `rec` enabled or disabled from the graph's next launch."""
    for n in rec.nodes:
        graph_nodes.api().set_enabled(rec.exec_, n, on)


def _switch_off(graph, rec: _GraphRecord) -> bool:
    """The record's copy nodes disabled in the instantiated graph (a replay whose step is
    not chosen then launches none of them). False when the graph must run unrecorded: a
    node left off by a failure could not be switched on again, and a chosen replay would
    record stale staging buffers."""
    if not rec.nodes:
        rec.nodes = None
        if torch.cuda.is_available() and not getattr(graph, KEPT_ATTR, False):
            _warn_once("nodes-kept", "recording copies stay in the graph at every replay (a near-empty kernel "
                                     f"each): {graph_nodes.reason() or 'the graph was not made by the hook'}")
        return True
    try:
        rec.exec_ = graph.raw_cuda_graph_exec()
        _set_nodes(rec, False)
        rec.nodes_on = False
        return True
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
    try:
        _set_nodes(rec, True)                 # idempotent: the ones switched off come back on
    except Exception as e:
        _warn_once("nodes", f"graph not recorded: its recording copies cannot be switched on again "
                            f"({why}; then {type(e).__name__}: {e})")
        return False
    rec.nodes = None
    _warn_once("nodes", f"recording copies left on at every replay: their graph nodes cannot be switched ({why})")
    return True


def _replay(orig):
    @functools.wraps(orig)
    def replay(self, *args, **kwargs):
        rec = getattr(self, GRAPH_ATTR, None)
        if rec is None or _S.config is None:
            return orig(self, *args, **kwargs)
        try:
            with _S.lock:
                pos = _ring_position(rec)
        except Exception as e:
            if _S.shadow is None:
                raise
            _trouble("shadow:replay", f"shadow: replay not recorded ({type(e).__name__}: {e})")
            pos = None
        if not _arm(rec, pos is not None) and pos is not None:
            rec.busy.discard(pos[0] if isinstance(pos, tuple) else pos)   # the copies would not run
            pos = None
        out = orig(self, *args, **kwargs)
        if pos is None:
            return out
        step = None
        if isinstance(pos, tuple):            # shadow mode: (position, step)
            pos, step = pos
        try:                                  # after the replay, in its stream's order
            for c in rec.calls:
                for stages, rings in ((c.inputs, c.ring_inputs), (c.outputs, c.ring_outputs)):
                    for name, t in stages.items():
                        rings[name][pos].copy_(t)
            if _S.shadow is not None:
                _shadow_submit(rec, pos, step)
        except Exception as e:
            if _S.shadow is None:
                raise
            rec.busy.discard(pos)
            _trouble("shadow:replay", f"shadow: replay not recorded ({type(e).__name__}: {e})")
        return out
    return replay


def _arm(rec: _GraphRecord, on: bool) -> bool:
    """The record's recording copies armed for the coming replay (on) or not: their flag
    written on the replay's stream before it, and their graph nodes switched (from the
    graph's next launch), each only when it changes. False when the copies would not run
    on a chosen replay (in shadow mode: logged, the shadow switched off); a failure to
    switch the nodes off leaves them on (the flag still keeps them from copying)."""
    try:
        if rec.flag is not None and rec.flag_on is not on:
            rec.flag_on = None
            rec.flag.fill_(int(on))
            rec.flag_on = on
        if rec.nodes is not None and rec.nodes_on is not on:
            try:
                _set_nodes(rec, on)
            except Exception as e:
                if on:
                    raise
                rec.nodes = None                      # on for good: the flag decides
                _warn_once("nodes", f"recording copies left on at every replay ({type(e).__name__}: {e})")
            rec.nodes_on = on
        return True
    except Exception as e:
        if _S.shadow is None:
            raise
        _trouble("shadow:replay", f"shadow: replay copies not armed ({type(e).__name__}: {e})")
        return False


INHERITED = object()                   # a wrapped method the class had from its base: deleted again
GRAPH_METHODS = {"capture_begin": _capture_begin, "capture_end": _capture_end, "replay": _replay}


def _graph_step(cfg: _Config) -> Optional[int]:
    """The step a replay stands for: set_context's; with auto counting the next whole
    forward (a replay is one); else the number of recording replays so far."""
    if _S.explicit:
        return _S.step
    if cfg.auto_layers:
        n = cfg.auto_layers
        step = -(-_S.anchor_calls // n)
        _S.anchor_calls = (step + 1) * n
        _move_to(None, step)
        return step
    step = _S.replays
    _S.replays += 1
    return step


def _ring_position(rec: _GraphRecord) -> Optional[int]:
    """The ring position this replay's step is copied into, None when the step is not
    chosen; the ring is drained first when it is full."""
    cfg = _S.config
    step = _graph_step(cfg)
    pos = None
    if _S.shadow is not None:
        return _shadow_position(rec, step, cfg)
    if step in cfg.steps:
        last = _S.ring[-1] if _S.ring else None
        if last is not None and last["step"] == step and all(r is not rec for r in last["records"]):
            last["records"].append(rec)                   # another graph of the same step
        else:
            if len(_S.ring) >= cfg.ring:
                _drain_locked()
            _S.ring.append({"step": step, "records": [rec]})
        pos = len(_S.ring) - 1
    return pos


def _shadow_position(rec: _GraphRecord, step, cfg: _Config):
    """Shadow mode: (position, step) of a free ring position of `rec` for a sampled step
    (held until the checker has copied it out), None when the step is not sampled or the
    ring is full (counted as skipped; the serving thread never waits)."""
    if step not in cfg.steps:
        return None
    free = next((p for p in range(cfg.ring) if p not in rec.busy), None)
    if free is None:
        _S.shadow.behind()
        return None
    rec.busy.add(free)
    return free, step


def _shadow_submit(rec: _GraphRecord, pos: int, step) -> None:
    """Hand a replayed step's ring position to the checker, one item per (layer, op set);
    the position is free again when every item of it is checked (or dropped)."""
    items = []
    for layer in dict.fromkeys(c.layer for c in rec.calls):
        calls: dict = {}
        for c in rec.calls:
            if c.layer != layer:
                continue
            if c.op in calls:
                items.append((layer, calls))
                calls = {}
            calls[c.op] = c.at(pos)
        if calls:
            items.append((layer, calls))
    left = [len(items)]
    lock = threading.Lock()

    def release():
        with lock:
            left[0] -= 1
            if left[0] == 0:
                rec.busy.discard(pos)
    for layer, calls in items:
        _S.shadow.submit(layer, step, calls, release=release, mode="graph")


def _drain_locked() -> None:
    ring, _S.ring = _S.ring, []
    if not ring:
        return
    devices = {t.device for e in ring for r in e["records"] for c in r.calls for t in c.ring_inputs.values()}
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
    for pos, entry in enumerate(ring):
        for rec in entry["records"]:
            for layer in dict.fromkeys(c.layer for c in rec.calls):
                calls: dict = {}
                for c in rec.calls:
                    if c.layer != layer:
                        continue
                    if c.op in calls:                 # a second call in the same (layer, step)
                        _write((layer, entry["step"]), calls)
                        calls = {}
                    calls[c.op] = c.at(pos)
                if calls:
                    _write((layer, entry["step"]), calls)


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


def _capture_call(fn, op: str, arg_map: ArgMap, bind, args, kwargs, extra: Optional[dict] = None):
    """One call of `fn` through the capture."""
    key = _active(op)              # the model's thread: counting and selection need no lock
    if key is None:
        return fn(*args, **kwargs)
    mode, where = key
    try:
        bound = bind(args, kwargs)
        if extra is not None:
            bound.update(extra)
        why = arg_map.classify(bound) if arg_map.classify is not None else None
        if why:
            _warn_once(f"skip:{op}:{why}", f"{op}: {why}; passed through, not recorded")
            return fn(*args, **kwargs)
        finish = {}
        if mode == GRAPH:                      # copies captured into the graph, before the call
            # a Staged input is staged as its view: its finishing work (a cat, a cast) runs
            # when a sampled replay is read, not in the graph at every replay
            views = {}
            for name, g in arg_map.inputs.items():
                if isinstance(g, Staged):
                    views[name] = g.view(bound)
                    finish[name] = g.finisher(bound)
                else:
                    views[name] = _get(g, bound)
            ins = _stage_all(views, _S.capture)
        else:
            ins = {name: _clone(_get(g, bound)) for name, g in arg_map.inputs.items()}
        scalars = {name: (_get(g, bound) if callable(g) or isinstance(g, str) and g in bound else g)
                   for name, g in arg_map.scalars.items()}
    except Exception as e:
        _trouble(f"in:{op}", f"{op}: cannot read the call's inputs ({type(e).__name__}: {e}); not captured")
        return fn(*args, **kwargs)
    result = fn(*args, **kwargs)
    try:
        got = {name: bound[g] if isinstance(g, str) else g(bound, result) for name, g in arg_map.outputs.items()}
        with _S.lock:
            if mode == GRAPH:
                outs = _stage_all(got, _S.capture)
                _S.capture.calls.append(_GraphCall(op, where, scalars, ins, outs, finish=finish))
            else:
                outs = {name: _clone(v) for name, v in got.items()}
                calls = _S.pending.setdefault(where, {})
                if op in calls:                   # a second call in the same (layer, step)
                    _write(where, _S.pending.pop(where))
                    calls = _S.pending.setdefault(where, {})
                calls[op] = (ins, scalars, outs)
    except Exception as e:
        _trouble(f"out:{op}", f"{op}: cannot read the call's outputs ({type(e).__name__}: {e}); not captured")
    return result


def wrap(fn: Callable, op: str, arg_map: ArgMap, *, extra: Optional[Callable[[], dict]] = None) -> Callable:
    """`fn` with capture around it. The call itself is `fn(*args, **kwargs)`, unchanged; the
    capture only ever reads the arguments and the result (clones them; inside a graph
    capture, copies them into ring buffers). A plain function gets a
    function (functools.wraps); any other callable an object that passes its attributes on."""
    bind = _binder(fn, arg_map)

    def wrapper(*args, **kwargs):
        if not _S.busy and (op != _S.counted or _idle_anchor()):    # the idle path: nothing to look at
            return fn(*args, **kwargs)
        return _capture_call(fn, op, arg_map, bind, args, kwargs, extra() if extra is not None else None)

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
        self._bind = _binder(kernel, arg_map)

    def __getitem__(self, grid):
        launch = self.__wrapped__[grid]
        if not _S.busy and self._op != _S.counted:
            return launch
        op, amap, bind = self._op, self._map, self._bind

        def call(*args, **kwargs):
            return _capture_call(launch, op, amap, bind, args, kwargs, {"__grid__": grid})
        return call

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


def _rebind(mod, orig, new, prefixes) -> None:
    """Loaded modules under `prefixes` that did `from x import fn`, and the classes they
    define that hold `fn` as an attribute (a launcher's kernel), get the wrapper too."""
    for mname, m in list(sys.modules.items()):
        d = getattr(m, "__dict__", None)
        if not isinstance(d, dict) or not mname.startswith(prefixes):
            continue
        holders = [] if m is mod else [m]
        holders += [v for v in list(d.values()) if isinstance(v, type) and getattr(v, "__module__", None) == mname]
        for h in holders:
            for name, v in list(vars(h).items()):
                if v is orig:
                    setattr(h, name, new)
                    _S.rebound.append((h, name, orig))


def _graph_init(orig):
    """CUDAGraph.__init__ that keeps the graph a capture builds (keep_graph=True) where the
    caller did not ask to and graph nodes can be switched in this process: the recording
    copies' nodes are handles into that graph (harness.capture.nodes). The hook's
    capture_end instantiates such a graph, as torch's does for a graph not kept."""
    def __init__(self, *args, **kwargs):
        asked = bool(args[0] if args else kwargs.get("keep_graph", False))
        if asked or len(args) + len(kwargs) > 1 or _S.config is None or graph_nodes.api() is None:
            return orig(self, *args, **kwargs)
        orig(self, True)
        setattr(self, KEPT_ATTR, True)
    return __init__


def _wrap_graph_init(cls) -> None:
    """Wrap cls.__init__ with _graph_init where the class keeps graphs on request (torch's
    `instantiate` and `raw_cuda_graph_exec`, with its keep_graph argument); removed again
    (or restored) by uninstall."""
    orig = getattr(cls, "__init__", None)
    if orig is None or getattr(orig, "__mxval_capture__", None) or \
            not all(hasattr(cls, m) for m in ("instantiate", "raw_cuda_graph_exec")):
        return
    new = _graph_init(orig)
    new.__mxval_capture__ = "__init__"
    own = "__init__" in cls.__dict__
    cls.__init__ = new
    _S.installed.append((cls, "__init__", orig if own else INHERITED))


def _wrap_graphs() -> None:
    """Wrap torch.cuda.CUDAGraph's capture_begin, capture_end and replay (once), and its
    __init__ (harness.capture.nodes: graphs kept, their recording copies switched)."""
    cls = getattr(torch.cuda, "CUDAGraph", None)
    if cls is None:
        return
    _wrap_graph_init(cls)
    for name, make in GRAPH_METHODS.items():
        orig = getattr(cls, name, None)
        if orig is None or getattr(orig, "__mxval_capture__", None):
            continue
        new = make(orig)
        new.__mxval_capture__ = name
        own = name in cls.__dict__
        setattr(cls, name, new)
        _S.installed.append((cls, name, orig if own else INHERITED))


def install(targets: Optional[list] = None, *, quiet: bool = False,
            rebind_prefixes: tuple = REBIND_PREFIXES, shadow: Optional[shadow_mode.Shadow] = None) -> list[str]:
    """Wrap every importable target when MXVAL_CAPTURE_DIR is set, or in shadow mode
    (`shadow`, or MXVAL_SHADOW=RATE: harness.capture.shadow) (else do nothing). In shadow
    mode the chosen layers' sampled steps go to the shadow's checker instead of dumps.
    `targets`: Targets, or tuples of alternative Targets of which the first that imports is
    wrapped (default: TARGETS, read from optimized.upstream). Returns the `module.attr`
    names wrapped; targets that cannot be imported are skipped. Loaded modules under
    `rebind_prefixes` that imported a target by name get the wrapper too."""
    cfg = _Config.from_env()
    if shadow is None:
        shadow = shadow_mode.from_env(model=cfg.model, source=_source())
    if cfg.directory is None and shadow is None:
        return []
    if shadow is not None:
        cfg.steps = shadow_mode.Steps(shadow, cfg.steps)
        cfg.ring = shadow.ring
    else:
        env.directory(ENV_DIR, cfg.directory)
    done, skipped = [], []
    with _S.lock:
        _S.config = cfg
        _S.shadow = shadow
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
            _rebind(mod, orig, new, rebind_prefixes)
            done.append(f"{t.module}.{t.attr}")
        _clear_cached_lookups()
        _wrap_graphs()
        _move_to(_S.layer, _S.step)
    if not _S.atexit:
        atexit.register(_at_exit)
        _S.atexit = True
    if not quiet:
        print(f"mxval {'shadow' if shadow else 'capture'}: {len(done)} op(s) wrapped ({', '.join(done) or 'none'}); "
              f"layers {cfg.layers.text}, steps {cfg.steps.text} -> {shadow.directory if shadow else cfg.directory}"
              + (f"; skipped {', '.join(skipped)}" if skipped else ""), file=sys.stderr)
    return done


def boot() -> list[str]:
    """install() from the environment, as a serving process's start-up calls it (a
    sitecustomize.py). A variable it cannot use is one line on stderr, `mxval: <variable>:
    <problem>`, and the process exits with status 2 at once: serving on while the check
    the user asked for is off would be a silent pass, and from site's import of
    sitecustomize a raised exception, SystemExit included, ends the interpreter with a
    traceback (hence os._exit, before anything else has started)."""
    try:
        return install()
    except (ValueError, OSError) as e:        # env.EnvError is a ValueError too
        msg = " ".join(str(e).split())
        for prefix in ("mxval shadow: ", "mxval capture: "):
            msg = msg.removeprefix(prefix)
        where = "" if msg.startswith("MXVAL_") else "capture: "
        try:
            sys.stderr.write(f"mxval: {where}{msg}\n")
            sys.stderr.flush()
        finally:
            os._exit(2)


def _at_exit() -> None:
    flush()
    _close_shadow()


def _close_shadow() -> None:
    sh, _S.shadow = _S.shadow, None
    if sh is not None:
        sh.close()


def current_shadow() -> Optional[shadow_mode.Shadow]:
    """The running shadow (its counters: `.snapshot()`), or None."""
    return _S.shadow


def uninstall() -> None:
    """Flush (the graph ring too), restore every wrapped attribute, and forget the context.
    Graphs captured while installed keep their in-graph staging copies, disarmed (flag
    clear, nodes off): replayed afterwards they copy nothing."""
    with _S.lock:
        if _S.config is not None:
            _drain_locked()
            _flush_except(None)
        _close_shadow()
        for rec in list(_S.records):          # a graph replayed after uninstall copies nothing
            try:
                _arm(rec, False)
            except Exception:
                pass
        _S.records = weakref.WeakSet()
        for mod, name, orig in reversed(_S.rebound + _S.installed):
            if orig is INHERITED:
                delattr(mod, name)
            else:
                setattr(mod, name, orig)
        _S.installed.clear()
        _S.rebound.clear()
        _clear_cached_lookups()
        LAST["block_scores"] = None
        _S.config = None
        _S.layer = _S.step = None
        _S.selected = _S.explicit = _S.busy = False
        _S.counted = None
        _S.anchor_calls = _S.replays = 0
        _S.capture = None
        _S.ring.clear()
