"""Graph mode (`mxval validate --graph`, a case's `graph = true`): every backend op of a
decode step replayed from a CUDA/HIP graph, as vLLM serves decode (`FULL_DECODE_ONLY`, and
the decode batches of `FULL_AND_PIECEWISE`).

vLLM captures each op once per padded batch size of its capture sizes (`CAPTURE_SIZES`),
with the metadata of a short dummy step, and every later decode step replays that capture
with its tensors copied into the captured buffers. Whatever the op's Python decided on the
host at capture (a branch, a grid or split count, a pointer, a scalar read with `.item()`) is
replayed on every step. Here, per op and padded size:

    capture  the op's inputs are static buffers of the padded size, filled with a dummy
             decode step (`dummy_value`: one token per request at the first pooling boundary,
             a context of one entry, no slot); the op runs twice eagerly (Triton compiles),
             then under `HostReads` recording every host read of device data, then is
             captured with those reads answered from the record (a real capture cannot read
             the device, and every decision it took is the dummy step's);
    replay   each uniform decode step of at most `MAX_CAPTURE_SIZE` tokens copies its
             tensors into the buffers (padding rows: position 0, slot -1, row end 0, context
             0, one token per padding request), runs the op's metadata builder when it has
             one (`op.build`, outside the graph, as vLLM's attention metadata builders run
             every step) and replays; outputs are cloned and cut to the step's rows.

Other steps (prefill chunks, mixed batches, batches past the largest size) run eagerly, as
vLLM runs them. Each replayed step is also run eagerly on the same inputs: the replay's
outputs are what the diff and budgets judge, and the bytes where they differ from the eager
run are `graph_eager_bytes_differ` (always failing; its stage is shown as "graph ≠ eager").

`HostGraph` is the graph of a backend on the CPU (tests): capture is the same record, and a
replay runs the op's Python again with every host read answered from the capture's record,
so every host-side decision is the capture's, as in a real graph. On ROCm,
`torch.cuda.CUDAGraph` is a HIP graph and the same code runs; what is CUDA-only is said where
it is (`sync_debug`).
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

import optimized
from reference.ops import OPS

# vLLM's default capture sizes (vllm/config/compilation.py, `cudagraph_capture_sizes`):
# 1, 2, 4, multiples of 8 below 256, then multiples of 16 up to the largest size,
# min(max_num_seqs * 2, 512) (512 with the default max_num_seqs).
MAX_CAPTURE_SIZE = 512
CAPTURE_SIZES = tuple([1, 2, 4] + list(range(8, 256, 8)) + list(range(256, MAX_CAPTURE_SIZE + 1, 16)))
METRIC = "graph_eager_bytes_differ"
REPLAYS = "graph_replays"
# Python-valued reads of a tensor's data: on a GPU each waits for the device (a sync); every
# one, on any device, is a decision the host takes from the data.
HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__",
                        "numpy", "equal", "allclose", "is_nonzero"})
# Which dim of an op field the padding fills (reference/op_table.py names the dims).
ROW_DIMS, SEQ_DIMS, QSL_DIMS = ("T", "Rw"), ("B",), ("B+1",)


class GraphError(ValueError):
    """The op cannot be captured (or its capture did not repeat its warm-up's host path)."""


def padded_size(n: int) -> Optional[int]:
    """The capture size a batch of n tokens pads to; None past the largest (eager, as vLLM)."""
    return next((s for s in CAPTURE_SIZES if s >= n), None) if n > 0 else None


def uniform_decode(step) -> bool:
    """One query token per request: the batches vLLM's FULL decode graphs serve."""
    qsl = step.query_start_loc.long().cpu()
    return qsl.numel() > 1 and bool(((qsl[1:] - qsl[:-1]) == 1).all())


def role(fields: dict, name: str) -> str:
    """"row" (a token or query row per entry), "seq" (a request per entry), "qsl" (request
    starts) or "whole" (the same tensor every step: pools, caches, tables)."""
    f = fields.get(name)
    dim = f.shape[0] if f is not None and f.shape else None
    return "row" if dim in ROW_DIMS else "seq" if dim in SEQ_DIMS else "qsl" if dim in QSL_DIMS else "whole"


# --- host reads: recorded during a warm-up, answered from the record at capture --------------

def _sync_messages(caught) -> bool:
    return any("synchroniz" in str(w.message) for w in caught)


class HostReads(TorchFunctionMode):
    """Without `log`: runs every torch call and records its host reads (a Python value read
    from a tensor, `HOST_READS`; on a GPU with `sync_debug`, also any call that waited for
    the device: a copy to or from the host, a data-dependent shape), each under the code
    location that made it (file, line, function), in order. With `log`: the same calls run,
    but those recorded are answered from the record, location by location: code that only
    runs under a capture (the capture hook's staging copies) shifts nothing. A location read
    more or fewer times than recorded (a `HOST_READS` call the warm-up did not make, too) is a
    GraphError: the host code took another path.
    `scope`: only calls made from files under these prefixes are looked at."""

    def __init__(self, log: Optional[dict] = None, *, sync_debug: bool = False, scope: tuple = ()):
        super().__init__()
        self.replaying = log is not None
        self.log: dict = log if log is not None else {}
        self.sync_debug = sync_debug
        self.scope = scope
        self.used: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        code = sys._getframe(1)
        if self.scope and not code.f_code.co_filename.startswith(self.scope):
            return func(*args, **kwargs)          # outside the scope: live
        name = getattr(func, "__name__", repr(func))
        key = (code.f_code.co_filename, code.f_lineno, name)
        if self.replaying:
            recorded = self.log.get(key)
            if recorded is None and name not in HOST_READS:
                return func(*args, **kwargs)
            n = self.used.get(key, 0)
            if n >= len(recorded or ()):
                raise GraphError(f"its host code took another path at capture than in its warm-up ({name} at "
                                 f"{os.path.basename(key[0])}:{key[1]} read {n + 1} times, {len(recorded or ())} "
                                 f"in the warm-up)")
            self.used[key] = n + 1
            return recorded[n]
        if self.sync_debug:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = func(*args, **kwargs)
            synced = _sync_messages(caught)
            for w in caught:
                if "synchroniz" not in str(w.message):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        else:
            result, synced = func(*args, **kwargs), False
        if synced or name in HOST_READS:
            self.log.setdefault(key, []).append(result)
        return result

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self.replaying and exc[0] is None:
            short = [k for k, v in self.log.items() if self.used.get(k, 0) != len(v)]
            if short:
                f, line, name = short[0]
                raise GraphError(f"its host code took another path at capture than in its warm-up ({name} at "
                                 f"{os.path.basename(f)}:{line} read {self.used.get(short[0], 0)} times, "
                                 f"{len(self.log[short[0]])} in the warm-up)")


def _sync_debug(mode: int) -> None:
    """torch's sync debug mode (it warns, once per call, that it is a prototype: not shown)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode(mode)


class CudaGraph:
    """A CUDA graph (a HIP graph on ROCm: torch.cuda.CUDAGraph is one there)."""

    def __init__(self, device):
        self.device = device
        self.log: dict = {}

    def capture(self, fn: Callable[[], dict]) -> dict:
        fn()
        fn()                                    # two warm-ups: Triton compiles in the first
        prev = torch.cuda.get_sync_debug_mode()
        _sync_debug(1)                          # warn: HostReads sees every wait for the device
        try:
            with HostReads(sync_debug=True) as rec:
                fn()
        finally:
            _sync_debug(prev)
        self.log = rec.log
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            with HostReads(self.log):
                out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class HostGraph:
    """The CPU's stand-in for a graph: replay runs the op's Python again with the host reads of
    the backends' own code (optimized/: where a backend decides on the host) answered from the
    capture's record, its outputs copied into the captured ones. The reference's ops stand in
    for device kernels: their reads run again at every replay."""

    SCOPE = (str(Path(optimized.__file__).resolve().parent) + os.sep,)

    def __init__(self, device="cpu"):
        self.device = device

    def capture(self, fn: Callable[[], dict]) -> dict:
        fn()
        with HostReads(scope=self.SCOPE) as rec:
            self.out = fn()
        self.fn, self.log = fn, rec.log
        return self.out

    def replay(self) -> None:
        with HostReads(self.log, scope=self.SCOPE):
            new = self.fn()
        for name, t in self.out.items():
            if isinstance(t, torch.Tensor):
                if new[name].shape != t.shape:
                    raise GraphError(f"output {name}: shape {tuple(new[name].shape)} at replay, "
                                     f"{tuple(t.shape)} at capture")
                t.copy_(new[name])


# Tests set this to HostGraph to run graph mode on the CPU; None: CudaGraph on a GPU.
FACTORY: Optional[Callable] = None


def factory_for(device) -> Callable:
    if FACTORY is not None:
        return FACTORY
    if str(device) == "cpu" or not torch.cuda.is_available():
        raise GraphError(f"graph mode needs a GPU (the backend runs on {device})")
    return CudaGraph


# --- dummy step and padding ---------------------------------------------------------------------

def dummy_value(name: str, r: int):
    """A padded row of the capture's dummy step: one token per request at position r - 1
    (the first pooling boundary), no slot, a row end and context of one entry."""
    return {"positions": r - 1, "slot_mapping": -1, "kv_slot_mapping": -1, "row_ends": 1, "lengths": 1,
            "context_lens": 1}.get(name, 0)


def pad_value(name: str):
    """A padding row of a replayed step: position 0, no slot, no entries."""
    return {"slot_mapping": -1, "kv_slot_mapping": -1}.get(name, 0)


class _Captured:
    """One op captured at one padded size: its static input buffers, graph and outputs."""

    def __init__(self, op: str, fn, ins: dict, scalars: dict, size: int, ratio: int, make):
        self.op, self.size = op, size
        fields = OPS[op].fields
        self.roles = {k: role(fields.inputs, k) for k in ins}
        self.out_roles = {k: role(fields.outputs, k) for k in fields.outputs}
        self.static = {}
        for k, v in ins.items():
            shape = {"row": (size, *v.shape[1:]), "seq": (size, *v.shape[1:]), "qsl": (size + 1,),
                     "whole": v.shape}[self.roles[k]]
            self.static[k] = torch.empty(shape, dtype=v.dtype, device=v.device)
        for k, v in ins.items():
            ro = self.roles[k]
            if ro == "whole":
                self.static[k].copy_(v)
            elif ro == "qsl":
                self.static[k].copy_(torch.arange(size + 1, dtype=v.dtype, device=v.device))
            else:
                self.static[k].fill_(dummy_value(k, ratio))
        self.build = getattr(fn, "build", None) if hasattr(fn, "kernel") else None
        if self.build is not None:
            meta = self.build(**self.static, **scalars)        # the builder: outside the graph

            def run():
                return fn.kernel(meta, **self.static, **scalars)
        else:
            def run():
                return fn(**self.static, **scalars)
        self.scalars = scalars
        self.graph = make(str(next(iter(ins.values())).device) if ins else "cpu")
        try:
            self.out = self.graph.capture(run)
        except GraphError:
            raise
        except Exception as e:
            raise GraphError(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") \
                from None
        if not isinstance(self.out, dict):
            raise GraphError(f"captured op returned {type(self.out).__name__}, not a dict of outputs")

    def replay(self, ins: dict, n: int, seqs: int) -> dict:
        for k, v in ins.items():
            buf, ro = self.static[k], self.roles[k]
            if ro == "whole":
                if buf.data_ptr() != v.data_ptr():
                    buf.copy_(v)
            elif ro == "qsl":
                buf[:seqs + 1].copy_(v)
                buf[seqs + 1:].copy_(v[-1] + torch.arange(1, self.size - seqs + 1, dtype=buf.dtype,
                                                          device=buf.device))
            else:
                m = n if ro == "row" else seqs
                buf[:m].copy_(v)
                buf[m:].fill_(pad_value(k))
        if self.build is not None:
            self.build(**self.static, **self.scalars)
        self.graph.replay()
        out = {}
        for k, t in self.out.items():
            ro = self.out_roles.get(k, "whole")
            out[k] = (t[:n] if ro == "row" else t[:seqs] if ro == "seq" else t).clone() \
                if isinstance(t, torch.Tensor) else t
        return out


class Graphs:
    """A case's graphs: each op captured at the first decode step that needs its padded size,
    replayed at every later one (`call` is how a ChainRun invokes a backend op in graph mode)."""

    def __init__(self, backend, inputs, make: Optional[Callable] = None):
        self.be, self.inp = backend, inputs
        self.make = make or factory_for(backend.device)
        self.captured: dict[tuple, _Captured] = {}

    def step_size(self, step: int) -> Optional[int]:
        st = self.inp.steps[step]
        return padded_size(st.n) if uniform_decode(st) else None

    def call(self, run, op: str, step: int, ins: dict, scalars: dict) -> dict:
        fn = getattr(self.be, op)
        eager = fn(**{k: v.clone() for k, v in ins.items()}, **scalars)
        size = self.step_size(step) if 0 <= step < len(self.inp.steps) else None
        if size is None:
            return eager
        st = self.inp.steps[step]
        key = (op, size)
        try:
            if key not in self.captured:
                self.captured[key] = _Captured(op, fn, {k: v for k, v in ins.items()}, scalars, size,
                                               self.inp.geo.ratio, self.make)
            replayed = self.captured[key].replay(ins, st.n, len(st.seqs))
        except GraphError as e:
            raise GraphError(f"backend {self.be.name} cannot be captured in a graph: {op}: {e}") from None
        run.col.metrics.setdefault(f"{op}.{REPLAYS}", []).append(1)
        differ, where = compare(eager, replayed, ins, scalars)
        run.col.metrics.setdefault(f"{op}.{METRIC}", []).append(differ)
        if differ:
            run.col.findings.append({"stage": op, "step": step, "class": "graph_ne_eager",
                                     "where": f"graph ≠ eager: {op} (step {step}, padded to {size}): {where}"})
        return replayed


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare(eager: dict, replayed: dict, ins: dict, scalars: dict) -> tuple[int, str]:
    """(bytes of the replay's outputs that differ from the eager run's, where the first is).
    Logits past a row's end are unspecified without `clean_logits` (NUMERICS.md §6): only
    each row's valid columns are compared there."""
    total, first = 0, ""
    for name, a in replayed.items():
        b = eager.get(name) if isinstance(eager, dict) else None
        if not isinstance(a, torch.Tensor):
            continue
        if not isinstance(b, torch.Tensor) or b.shape != a.shape or b.dtype != a.dtype:
            n = a.numel() * a.element_size()
            total += n
            first = first or (f"output {name}: shape {tuple(a.shape)} {a.dtype} replayed, "
                              f"{None if not isinstance(b, torch.Tensor) else tuple(b.shape)} eagerly")
            continue
        b = b.to(a.device)
        if name == "logits" and a.dim() == 2 and not scalars.get("clean_logits") and "row_ends" in ins:
            cols = torch.arange(a.shape[1], device=a.device)
            valid = cols[None, :] < ins["row_ends"].to(a.device).long()[:, None]
            x, y = _bytes(a[valid]), _bytes(b[valid])
        else:
            x, y = _bytes(a), _bytes(b)
        ne = x != y
        n = int(ne.sum())
        if n and not first:
            i = int(ne.nonzero()[0])
            first = f"output {name}: {n} of {x.numel()} bytes differ, first at byte {i}: " \
                    f"0x{int(x[i]):02x} replayed, 0x{int(y[i]):02x} eagerly"
        total += n
    return total, first
