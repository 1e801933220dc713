"""GPU memory of a case: its peak against the size of its tensors, and a per-process cap.

A report row carries `gpu_peak_bytes` (the most GPU memory allocated while the case ran,
above what was allocated when it started, less what the process still holds once the
case's tensors are released: cuBLAS workspaces and caches made during the case are the
process's, not the case's, and are listed as `details.gpu_kept_bytes`; None on the CPU)
and `tensor_bytes` (the case's inputs plus the tensors one step's comparisons read: each
stage's inputs and both sides' outputs, the whole chain's too; the largest step's, counted
once per storage and on a GPU in the allocator's 512-byte blocks). Their ratio is the case's
memory overhead: the harness's copies of the pool, the reference's intermediates, the diffs.

`MXVAL_GPU_MEMORY_FRACTION` (a number in (0, 1]) caps every mxval process that sets it at
that share of the GPU's memory (`torch.cuda.set_per_process_memory_fraction`): several
processes side by side on one GPU then cannot take each other's memory, and a case over
its share is one case's out-of-memory error, not another process's.
"""
from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Optional

import torch

from harness.io import env

FRACTION_ENV = "MXVAL_GPU_MEMORY_FRACTION"
_applied: set = set()


def fraction() -> Optional[float]:
    """The cap from the environment, None when unset; ValueError when it is not in (0, 1]."""
    return env.number(FRACTION_ENV, 0.0, 1.0)


def apply_fraction(device) -> None:
    """Cap this process on `device` (a CUDA device) once, when FRACTION_ENV is set."""
    f = fraction()
    dev = torch.device(device)
    if f is None or dev.type != "cuda" or not torch.cuda.is_available():
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _applied:
        torch.cuda.set_per_process_memory_fraction(f, index)
        _applied.add(index)


BLOCK = 512                 # the CUDA caching allocator's smallest block and its rounding


def _tensors(objs):
    """The tensors reachable from `objs` (tensors, dataclasses, dicts, lists, tuples)."""
    stack = list(objs)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def _nbytes(x: torch.Tensor) -> int:
    """A tensor's storage bytes; on a GPU, the allocator's blocks it takes (BLOCK multiples)."""
    n = x.untyped_storage().nbytes()
    return -(-n // BLOCK) * BLOCK if x.device.type == "cuda" else n


class StorageSet:
    """Distinct tensor storages seen over a span of time, each counted once: a storage still
    alive is recognized by identity (torch keeps one Python object per live storage), and a
    new one at a freed one's address is another storage, so the count does not depend on
    where the allocator put things."""

    def __init__(self, *objs):
        self._at: dict = {}              # (device, address) -> [(weakref to the storage, bytes)]
        self.add(*objs)

    def add(self, *objs) -> "StorageSet":
        for x in _tensors(objs):
            st = x.untyped_storage()
            refs = self._at.setdefault((str(x.device), st.data_ptr()), [])
            if any(r is None or r() is st for r, _ in refs):
                continue
            ref = None                   # no lasting storage object here: the address alone identifies it
            if st is x.untyped_storage():
                try:
                    ref = weakref.ref(st)
                except TypeError:
                    pass
            refs.append((ref, _nbytes(x)))
        return self

    def bytes(self) -> int:
        return sum(n for refs in self._at.values() for _, n in refs)


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct tensor storages reachable from `objs` (tensors, dataclasses,
    dicts, lists, tuples); a view counts its storage once; a GPU storage counts the
    allocator's blocks it takes (rounded up to BLOCK bytes)."""
    return StorageSet(*objs).bytes()


class Peak:
    """`p = Peak(device).start()` ... `p.stop()`; then `p.bytes`: the peak GPU memory
    allocated between the two above what was allocated at the start; None on the CPU."""

    def __init__(self, device):
        dev = torch.device(device)
        self.cuda = dev.type == "cuda" and torch.cuda.is_available()
        self.device = dev
        self.base = 0
        self.bytes: Optional[int] = None
        self.kept = 0

    def start(self) -> "Peak":
        if self.cuda:
            apply_fraction(self.device)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def stop(self) -> Optional[int]:
        if self.cuda:
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:          # a device fault: the row says so, the peak stays unknown
                return None
            self.bytes = int(torch.cuda.max_memory_allocated(self.device) - self.base)
        return self.bytes

    def own(self) -> Optional[int]:
        """After `stop`, once the block's own tensors are released: the peak less what is
        still allocated above the start (`kept`: workspaces and caches the block created,
        which outlive it; the peak counts them whenever they came, so this is the block's
        peak at most)."""
        if self.bytes is None:
            return None
        try:
            kept = torch.cuda.memory_allocated(self.device) - self.base
            if kept > 0:                 # a cycle may still hold a tensor of the block (a young
                gc.collect(1)            # one: the whole heap's collection costs ~0.1 s a case)
                kept = torch.cuda.memory_allocated(self.device) - self.base
        except RuntimeError:
            return self.bytes
        self.kept = max(0, int(kept))
        return max(0, self.bytes - self.kept)
