"""Kernel nodes of an instantiated CUDA/HIP graph switched off and on from the host.

A graph replays every kernel captured into it. The capture hook's recording copies
(optimized.triton_kernels.copy_if) are needed on a sampled replay only, and even with their
device flag clear each is a kernel node that every replay launches: 1.24 µs each between
small kernels on an H100, and in the bench's decode loop 10 of them added 55 % to a 0.22 ms
replay, the hook's whole cost there. Disabled, a node cost 0.29 µs. The
driver can disable a kernel node of an instantiated graph (`cuGraphNodeSetEnabled`,
`hipGraphNodeSetEnabled`): a disabled node acts as an empty node until it is enabled
again, and the change applies from the next launch of the graph, never to one already
enqueued. The hook disables its copies after instantiation and enables them for a
sampled replay only.

Two driver calls are needed, both on handles torch gives out:
* while capturing, `last(stream)`: the node the stream's next captured work will depend
  on, i.e. the kernel just launched (`cuStreamGetCaptureInfo`: its dependency set, when it
  holds exactly one node);
* after instantiation, `set_enabled(exec, node, on)` with the graph's exec
  (`torch.cuda.CUDAGraph.raw_cuda_graph_exec()`). The node handle must belong to the graph
  the exec was instantiated from, so that graph must be kept: `torch.cuda.CUDAGraph(
  keep_graph=True)` (measured with torch 2.11; 2.13 has the same API), which the hook asks for while it
  is installed.

Anything missing (no driver library, an older torch, a symbol the driver lacks, a call
that fails) makes `api()` None or raises NodeError: the hook then leaves the copies
enabled and relies on their device flag, as before.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

CAPTURE_ACTIVE = 1        # cudaStreamCaptureStatusActive / hipStreamCaptureStatusActive


# runtime -> (libraries to try, capture-info symbols to try (name, takes the edge-data
# argument), the node switch): the symbols come from the drivers' headers (CUDA 11.6+, the
# v3 form from CUDA 12.3; HIP 5.3+)
API = {
    "cuda": (("libcuda.so.1", "libcuda.so"),
             (("cuStreamGetCaptureInfo_v2", False), ("cuStreamGetCaptureInfo_v3", True)),
             "cuGraphNodeSetEnabled"),
    "hip": (("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"),
            (("hipStreamGetCaptureInfo_v2", False),),
            "hipGraphNodeSetEnabled"),
}


class NodeError(RuntimeError):
    pass


class Nodes:
    """The two driver calls of one runtime, loaded once."""

    def __init__(self, runtime: str):
        libs, infos, switch = API[runtime]
        self.runtime = runtime
        self.lib = None
        for name in libs:
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if self.lib is None:
            raise NodeError(f"none of {', '.join(libs)} loads")
        self._info = self._edge = None
        for name, edge in infos:
            fn = getattr(self.lib, name, None)
            if fn is not None:
                self._info, self._edge = fn, edge
                break
        if self._info is None:
            raise NodeError(f"the driver has none of {', '.join(n for n, _ in infos)}")
        args = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p))]
        if self._edge:
            args.append(ctypes.POINTER(ctypes.c_void_p))
        self._info.argtypes = args + [ctypes.POINTER(ctypes.c_size_t)]
        self._info.restype = ctypes.c_int
        self._switch = getattr(self.lib, switch, None)
        if self._switch is None:
            raise NodeError(f"the driver has no {switch}")
        self._switch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._switch.restype = ctypes.c_int

    def last(self, stream: Optional[int] = None) -> int:
        """The one node the capturing `stream` (default: the current one)'s next work will
        depend on (the work just captured on it); NodeError when the stream is not
        capturing or depends on more or fewer than one node."""
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        status, ident, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
        deps, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
        args = [ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
                ctypes.byref(deps)]
        if self._edge:
            args.append(ctypes.byref(ctypes.c_void_p()))
        rc = self._info(*args, ctypes.byref(n))
        if rc != 0:
            raise NodeError(f"capture info: error {rc}")
        if status.value != CAPTURE_ACTIVE:
            raise NodeError("the stream is not capturing")
        if n.value != 1:
            raise NodeError(f"the stream depends on {n.value} nodes, not 1")
        return int(deps[0])

    def set_enabled(self, exec_: int, node: int, on: bool) -> None:
        """Node `node` of the graph `exec_` was instantiated from, enabled or disabled from
        the exec's next launch on."""
        rc = self._switch(ctypes.c_void_p(exec_), ctypes.c_void_p(node), ctypes.c_uint(int(bool(on))))
        if rc != 0:
            raise NodeError(f"node switch: error {rc}")


_API: dict = {}


def reason() -> Optional[str]:
    """Why graph nodes cannot be switched in this process, or None when they can."""
    api()
    return _API.get("why")


def api() -> Optional[Nodes]:
    """This process's Nodes (its GPU runtime's), or None where nodes cannot be switched: no
    GPU, a torch without kept graphs, a driver without the calls (`reason()` says which)."""
    if "api" not in _API:
        got, why = None, None
        try:
            cls = getattr(torch.cuda, "CUDAGraph", None)
            if not torch.cuda.is_available():
                why = "no GPU"
            elif cls is None or not all(hasattr(cls, m) for m in ("instantiate", "raw_cuda_graph_exec")):
                why = f"torch {torch.__version__} does not keep graphs"
            else:
                got = Nodes("hip" if getattr(torch.version, "hip", None) else "cuda")
        except Exception as e:
            got, why = None, f"{type(e).__name__}: {e}"
        _API["api"], _API["why"] = got, why
    return _API["api"]
