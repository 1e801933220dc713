"""Device copies that run only when a device flag says so: the capture hook's recording
copies inside a CUDA/HIP graph.

A graph repeats every copy captured into it at every replay. The capture hook records a
chosen layer's op fields by copying them into staging buffers inside the graph, and only
a sampled replay needs them (one in a thousand in shadow mode). `copy_if` is one launch
for up to SEGMENTS contiguous (source, destination) pairs that reads one int32 flag on
the device first: 0, and the launch ends at once (a replay pays one near-empty kernel per
recorded call, not the copies); non-zero, and every pair is copied byte for byte. The
hook sets the flag before a chosen replay and clears it after (harness.capture.hook).
Where the driver allows, the hook also switches these launches' graph nodes off between
chosen replays (harness.capture.nodes), and a replay does not launch them at all; the
flag is what holds where it cannot.

Bytes, not elements: each pair is copied as uint8, so any dtype and shape copies exactly.
The grid is small (PROGRAMS) on purpose: a sampled replay is rare, and a wide grid would
cost every replay more launch time for nothing.

    python -m pytest tests/test_copy_if.py      # the interpreter; the compiled kernel runs in test_shadow_gpu.py
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from .interp import INTERPRETED  # noqa: F401  (imported: this process's Triton mode is then known)

SEGMENTS = 8          # (source, destination) pairs per launch; more pairs take more launches
PROGRAMS = 64         # programs per launch (each loops over its share of every pair)
BLOCK = 4096          # bytes per program per loop step
PIECE = 1 << 30       # a pair longer than this is copied as several (int32 offsets in the kernel)


@triton.jit
def _segment(src, dst, n, pid, nprog, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        o = start + offs
        m = o < n
        tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


_ARGS = ["flag"] + [f"{k}{i}" for i in range(SEGMENTS) for k in "sdn"]


# not specialized on values or alignment: one compiled kernel for every field, so that the
# launch `warm` makes before a capture is the only compilation (none inside a capture)
@triton.jit(**{k: _ARGS for k in ("do_not_specialize", "do_not_specialize_on_alignment")
               if k in inspect.signature(triton.jit).parameters})
def _copy_if_kernel(flag, s0, d0, n0, s1, d1, n1, s2, d2, n2, s3, d3, n3,
                    s4, d4, n4, s5, d5, n5, s6, d6, n6, s7, d7, n7, BLOCK: tl.constexpr):
    if tl.load(flag) != 0:                       # the whole launch is this test when the flag is 0
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        _segment(s0, d0, n0, pid, nprog, BLOCK)
        _segment(s1, d1, n1, pid, nprog, BLOCK)
        _segment(s2, d2, n2, pid, nprog, BLOCK)
        _segment(s3, d3, n3, pid, nprog, BLOCK)
        _segment(s4, d4, n4, pid, nprog, BLOCK)
        _segment(s5, d5, n5, pid, nprog, BLOCK)
        _segment(s6, d6, n6, pid, nprog, BLOCK)
        _segment(s7, d7, n7, pid, nprog, BLOCK)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError("copy_if copies contiguous tensors only")
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def copy_if(flag: torch.Tensor, pairs: list, launched=None) -> None:
    """dst = src for every (src, dst) in `pairs` (same shape and dtype, both contiguous, on
    flag's device) when flag[0] != 0 at the time the launch runs; nothing otherwise.
    `launched()`, when given, is called after each launch (a graph capture notes the node)."""
    if flag.dtype != torch.int32 or flag.numel() != 1:
        raise ValueError("the flag is one int32 element")
    segs = []
    for src, dst in pairs:
        if src.shape != dst.shape or src.dtype != dst.dtype or src.device != flag.device or dst.device != flag.device:
            raise ValueError(f"copy_if: {tuple(src.shape)} {src.dtype} on {src.device} -> {tuple(dst.shape)} "
                             f"{dst.dtype} on {dst.device} (flag on {flag.device})")
        s, d = flat_bytes(src), flat_bytes(dst)
        segs += [(s[i:i + PIECE], d[i:i + PIECE], min(PIECE, s.numel() - i)) for i in range(0, s.numel(), PIECE)]
    none = flat_bytes(flag)
    for i in range(0, len(segs), SEGMENTS):
        chunk = segs[i:i + SEGMENTS]
        chunk += [(none, none, 0)] * (SEGMENTS - len(chunk))      # unused slots copy nothing
        args = [a for seg in chunk for a in seg]
        _copy_if_kernel[(PROGRAMS,)](flag, *args, BLOCK=BLOCK)
        if launched is not None:
            launched()


def warm(device) -> None:
    """Compile and load the kernel on `device` (one launch with the flag clear): called
    before a graph capture, where a compilation would be a device call the capture forbids."""
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    buf = torch.zeros(3, dtype=torch.uint8, device=device)
    copy_if(flag, [(buf, buf)])
