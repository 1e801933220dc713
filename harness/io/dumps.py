"""Captured dumps (`mxval-dump` version 1, docs/spec/DUMPS.md): strict reader and writer.

A dump is one safetensors file: tensors `<op>/in/<arg>` and `<op>/out/<name>`, and one
metadata key `mxval` holding JSON (format, version, source, model, layer, step, and the
scalar arguments of each op). the op table (`reference.ops.OPS`, its `fields`) says what each op carries; the
reader and the writer both validate against it, so a file that `read_dump` accepts can be
handed to `reference.OPS[op].fn(**inputs, **scalars)` as it is.

    dump = read_dump("layer12_step300.safetensors")     # DumpError: one line, file + problem
    rec = dump.ops["k_norm_rope_mxfp4_cache"]           # OpRecord(op, scalars, inputs, outputs)
    write_dump("out.safetensors", {rec.op: rec}, source="my kernel @abc123")
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from harness.errors import InputError
from harness.io import atomic, safe_input
from reference import checks
from reference.ops import OPS, OpSpec

FORMAT = "mxval-dump"
VERSION = 1
META_KEY = "mxval"
# Bounds of the file's fields (half-open ranges, reference/checks.py): an integer scalar
# (page_size, compress_ratio, k, a shuffle group) at most MAX_INT_SCALAR, layer and step
# below 2**31, a safetensors header of at most MAX_HEADER_BYTES (the library's own limit).
MAX_INT_SCALAR = 2 ** 16
MAX_INDEX = 2 ** 31
MAX_EMPTY_DIM = 2 ** 24          # a dimension of a tensor with no elements (the full suite's widest is 2^20)
MAX_HEADER_BYTES = 100 * 2 ** 20


class DumpError(InputError):
    """A dump that cannot be used; the message is one line naming the file and the problem."""


@dataclass
class OpRecord:
    op: str
    scalars: dict
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


@dataclass
class Dump:
    path: Optional[str]
    meta: dict                       # the whole `mxval` JSON object
    ops: dict[str, OpRecord] = field(default_factory=dict)


# --- scalars --------------------------------------------------------------------------

_is_int = checks.is_int


def _check_scalar(kind: str, v) -> Optional[str]:
    """None when `v` is a valid scalar of `kind`, else what is wrong."""
    from reference.formats import FP8_FLAVOURS, ROUNDING_PATHS
    from reference.mxfp4 import SCALE_RULES
    from reference.pooling import SOFTMAX_MODES
    from reference.rope import ROPE_MODES
    if kind == "float":
        ok = (_is_int(v) or isinstance(v, float)) and v == v and abs(v) != float("inf")
        return None if ok else f"expected a finite number, got {v!r}"
    if kind == "float+":            # used in fp32 by the ops: finite and > 0 there too
        ok = (_is_int(v) or isinstance(v, float)) and v == v and abs(v) != float("inf") and v > 0
        ok = ok and 1.4e-45 <= v <= 3.4028234663852886e38
        return None if ok else f"expected a finite number > 0 (and within fp32), got {v!r}"
    if kind == "int+":
        ok = _is_int(v) and 0 < v <= MAX_INT_SCALAR
        return None if ok else f"expected an integer in [1, {MAX_INT_SCALAR + 1}), got {checks._show(v)}"
    if kind == "bool":
        return None if isinstance(v, bool) else f"expected true or false, got {v!r}"
    if kind == "shuffle":
        ok = v is None or (isinstance(v, list) and len(v) == 3
                           and all(_is_int(x) and 0 < x <= MAX_INT_SCALAR for x in v))
        return None if ok else f"expected [N, Dt, L] (integers in [1, {MAX_INT_SCALAR + 1})) or null, got {v!r:.80}"
    options = {"fp8_dtype": tuple(FP8_FLAVOURS), "rounding": ROUNDING_PATHS,
               "scale_rule": tuple(SCALE_RULES), "rope": ROPE_MODES,
               "softmax": tuple(SOFTMAX_MODES)}[kind]
    ok = isinstance(v, str) and v in options
    return None if ok else f"expected one of {', '.join(options)}, got {v!r:.80}"


def json_scalar(v):
    """Python value as JSON keeps it (tuples -> lists, 0-d tensors -> numbers)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, tuple):
        return [json_scalar(x) for x in v]
    if isinstance(v, list):
        return [json_scalar(x) for x in v]
    return v


# --- shapes ---------------------------------------------------------------------------

_DIM_RE = re.compile(r"^(?:(\d+)\*)?([A-Za-z_][A-Za-z_0-9]*)(?:/(\d+))?(?:\+(\d+))?$")


class _Dims:
    """Binds the named dims of one op across its fields (solving "D/2", "4*D", "B+1")."""

    def __init__(self):
        self.values: dict[str, tuple[int, str]] = {}

    def bind(self, expr, value: int, where: str) -> Optional[str]:
        if isinstance(expr, int):
            return None if value == expr else f"{where}: dimension must be {expr}, got {value}"
        m = _DIM_RE.match(expr)
        mul, name, div, add = int(m[1] or 1), m[2], int(m[3] or 1), int(m[4] or 0)
        num = (value - add) * div
        if num < 0 or num % mul:
            return f"{where}: dimension {expr} cannot be {value}"
        x = num // mul
        if (mul * x) % div:
            return f"{where}: dimension {expr} cannot be {value}"
        if name in self.values and self.values[name][0] != x:
            v, first = self.values[name]
            return f"{where}: dimension {name} is {x} here but {v} in {first}"
        self.values.setdefault(name, (x, where))
        return None

    def get(self, name: str) -> Optional[int]:
        return self.values.get(name, (None,))[0]


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _op_problem(op: str, spec: OpSpec, dims: _Dims, scalars: dict) -> Optional[str]:
    """Cross-field rules the table cannot say (head dim, rope dim, page size)."""
    d, r, pb = dims.get("D"), dims.get("R"), dims.get("page_bytes")
    if d is not None and d % 32:
        return f"{op}: head dim D={d} is not a multiple of 32"
    if r is not None and d is not None and (r % 2 or r > d):
        return f"{op}/in/cos_sin_cache: rope dim R={r} must be even and at most D={d}"
    if pb is not None and d is not None and "page_size" in scalars:
        entry = d + 4 if "fp8" in op else d // 2 + d // 32     # fp8 ops: [D fp8 | f32 scale]
        need = scalars["page_size"] * entry
        if pb < need:
            return (f"{op}/in/kv_cache: page stride {pb} is below the {need} bytes of "
                    f"{scalars['page_size']} entries")
    if d is not None and scalars.get("shuffle") is not None:
        from reference import layout
        try:
            layout.check_layout(scalars["page_size"], d, layout.as_shuffle(scalars["shuffle"]))
        except ValueError as e:
            return f"{op}: {e}"
    return None


def record_problem(rec: OpRecord) -> Optional[str]:
    """None when the record fits the op table, else the first problem (one line, no file name)."""
    op = rec.op
    if op not in OPS:
        return f"unknown op {op!r} (known: {', '.join(OPS)})"
    spec = OPS[op].fields
    if not isinstance(rec.scalars, dict):
        return f"{META_KEY}.ops.{op}: expected an object of scalars, got {rec.scalars!r}"
    for name, kind in spec.scalars.items():
        if name not in rec.scalars:
            return f"{META_KEY}.ops.{op}: missing scalar {name!r}"
    for name, v in rec.scalars.items():
        kind = spec.scalars.get(name) or spec.optional.get(name)
        if kind is None:
            return f"{META_KEY}.ops.{op}: unknown scalar {name!r} (expected {', '.join(spec.scalars)})"
        bad = _check_scalar(kind, v)
        if bad:
            return f"{META_KEY}.ops.{op}.{name}: {bad}"
    dims = _Dims()
    for name, v in rec.scalars.items():          # a dim named like an int scalar (topk's k)
        if _is_int(v):
            dims.values[name] = (v, f"{META_KEY}.ops.{op}.{name}")
    for io, table, given in (("in", spec.inputs, rec.inputs), ("out", spec.outputs, rec.outputs)):
        for name in given:
            if name not in table:
                return (f"unexpected tensor {op}/{io}/{name} (op {op} has {io}/"
                        f"{', {io}/'.join(table)})".replace("{io}", io))
        for name, f in table.items():
            where = f"{op}/{io}/{name}"
            if name not in given:
                return f"missing tensor {where}"
            t = given[name]
            if not isinstance(t, torch.Tensor):
                return f"{where}: expected a tensor, got {type(t).__name__}"
            if _dtype_name(t.dtype) not in f.dtypes:
                return f"{where}: dtype {_dtype_name(t.dtype)}, expected {' or '.join(f.dtypes)}"
            if t.dim() != len(f.shape):
                return f"{where}: shape {list(t.shape)}, expected {_shape_str(f.shape)}"
            if t.numel() == 0 and max(t.shape, default=0) > MAX_EMPTY_DIM:
                return (f"{where}: shape {list(t.shape)} holds no data, yet declares a dimension of "
                        f"{max(t.shape)} (an empty tensor's dimensions are at most {MAX_EMPTY_DIM}: no data backs more)")
            for expr, n in zip(f.shape, t.shape):
                bad = dims.bind(expr, int(n), where)
                if bad:
                    return f"{bad} (expected shape {_shape_str(f.shape)}, got {list(t.shape)})"
    return _op_problem(op, spec, dims, rec.scalars)


# --- reading --------------------------------------------------------------------------

def _fail(path, problem: str):
    raise DumpError(f"{path}: {problem}")


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def _check_container(path: str) -> dict:
    """Parse the safetensors header ourselves so that a truncated or foreign file gets a
    precise line (the library's own errors are terse and vary by version)."""
    try:
        with safe_input.open_regular(path, error=DumpError) as f:       # never a FIFO or a device
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                _fail(path, f"not a safetensors file ({size} bytes, too short for a header)")
            n = int.from_bytes(head, "little")
            if n == 0 or n > size - 8:
                _fail(path, f"truncated or not a safetensors file (header length {n}, file size {size})")
            if n > MAX_HEADER_BYTES:
                _fail(path, f"safetensors header of {n} bytes, more than the {MAX_HEADER_BYTES} allowed")
            raw = f.read(n)
    except OSError as e:
        _fail(path, f"cannot read: {e.strerror or _first_line(e)}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        _fail(path, "not a safetensors file (its header is not UTF-8 JSON)")
    not_object = "not a safetensors file (its header is not a JSON object)"
    header = safe_input.loads_json(text, f"{path}: safetensors header", error=DumpError, unusable=f"{path}: {not_object}")
    if not isinstance(header, dict):
        _fail(path, not_object)
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                _fail(path, "corrupt safetensors header (__metadata__ must map names to strings)")
            continue
        try:
            off = info["data_offsets"][1]
            if not _is_int(off) or off < 0:
                raise ValueError
            end = max(end, off)
        except (TypeError, KeyError, IndexError, ValueError):
            _fail(path, f"corrupt safetensors header (tensor {name!r:.80} has no data_offsets)")
    if 8 + n + end > size:
        _fail(path, f"truncated: tensor data needs {8 + n + end} bytes, the file has {size}")
    return header


def _parse_meta(path, header: dict) -> dict:
    meta = header.get("__metadata__") or {}
    if META_KEY not in meta:
        _fail(path, f"no {META_KEY!r} metadata key (not an mxval dump)")
    m = safe_input.loads_json(meta[META_KEY], f"{path}: metadata key {META_KEY!r}", error=DumpError)
    if not isinstance(m, dict):
        _fail(path, f"metadata key {META_KEY!r} is not a JSON object")
    if m.get("format") != FORMAT:
        _fail(path, f"{META_KEY}.format is {m.get('format')!r}, expected {FORMAT!r}")
    if "version" not in m:
        _fail(path, f"{META_KEY}.version is missing")
    if m["version"] != VERSION or not _is_int(m["version"]):
        _fail(path, f"unknown version {m['version']!r} (this reader knows version {VERSION})")
    for key, kinds in (("source", (str,)), ("model", (str,))):
        if not isinstance(m.get(key), kinds):
            _fail(path, f"{META_KEY}.{key}: expected a string, got {m.get(key)!r}")
    for key in ("layer", "step"):
        if m.get(key) is not None and not (_is_int(m[key]) and 0 <= m[key] < MAX_INDEX):
            _fail(path, f"{META_KEY}.{key}: expected an integer in [0, {MAX_INDEX}) or null, "
                        f"got {checks._show(m[key])}")
    ops = m.get("ops")
    if not isinstance(ops, dict) or not ops:
        _fail(path, f"{META_KEY}.ops: expected a non-empty object of op scalars, got {ops!r}")
    for op in ops:
        if op not in OPS:
            _fail(path, f"unknown op {op!r} (known: {', '.join(OPS)})")
    return m


def read_dump(path) -> Dump:
    """Read and validate a dump. Raises DumpError (one line: file and problem) on any
    malformed, truncated, foreign or inconsistent file. Never writes to the file."""
    path = os.fspath(path)
    header = _check_container(path)
    meta = _parse_meta(path, header)
    records = {op: OpRecord(op, dict(sc) if isinstance(sc, dict) else sc, {}, {})
               for op, sc in meta["ops"].items()}
    try:
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            for name in names:
                parts = name.split("/")
                if len(parts) != 3 or parts[1] not in ("in", "out") or not parts[2]:
                    _fail(path, f"unexpected tensor name {name!r} (expected <op>/in/<arg> or <op>/out/<name>)")
                op, io, arg = parts
                if op not in records:
                    if op in OPS:
                        _fail(path, f"tensor {name} belongs to op {op}, which {META_KEY}.ops does not list")
                    _fail(path, f"unknown op {op!r} in tensor {name}")
                (records[op].inputs if io == "in" else records[op].outputs)[arg] = f.get_tensor(name)
    except DumpError:
        raise
    except Exception as e:  # the library's own complaint about a damaged file
        _fail(path, f"not a readable safetensors file ({_first_line(e)})")
    for rec in records.values():
        problem = record_problem(rec)
        if problem:
            _fail(path, problem)
    return Dump(path, meta, records)


# --- writing --------------------------------------------------------------------------

def write_dump(path, ops: dict[str, OpRecord], *, source: str, model: str = "deepseek-v4-pro",
               layer: Optional[int] = None, step: Optional[int] = None, within=None) -> str:
    """Validate `ops` against the op table and write them as one dump through
    harness/io/atomic.py (a reader never sees half a file; a link, a device or a directory at
    `path` is refused, never replaced; `within`: a directory `path` must stay inside).
    Returns the path."""
    from safetensors.torch import save_file
    path = os.fspath(path)
    if not ops:
        _fail(path, "nothing to write (no ops)")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    meta_ops = {}
    for key, rec in ops.items():
        rec = OpRecord(rec.op, {k: json_scalar(v) for k, v in rec.scalars.items()},
                       rec.inputs, rec.outputs)
        if key != rec.op:
            _fail(path, f"ops key {key!r} differs from its record's op {rec.op!r}")
        problem = record_problem(rec)
        if problem:
            _fail(path, problem)
        meta_ops[rec.op] = rec.scalars
        for io, group in (("in", rec.inputs), ("out", rec.outputs)):
            for name, t in group.items():
                t = t.detach().to("cpu").contiguous()
                if t.untyped_storage().data_ptr() in seen:      # safetensors refuses shared storage
                    t = t.clone()
                seen.add(t.untyped_storage().data_ptr())
                tensors[f"{rec.op}/{io}/{name}"] = t
    meta = {"format": FORMAT, "version": VERSION, "source": str(source), "model": str(model),
            "layer": layer, "step": step, "ops": meta_ops}
    for key in ("layer", "step"):
        if meta[key] is not None and not (_is_int(meta[key]) and 0 <= meta[key] < MAX_INDEX):
            _fail(path, f"{key}: expected an integer in [0, {MAX_INDEX}) or None, got {meta[key]!r}")
    text = json.dumps(meta)
    def fill(tmp: str) -> None:
        try:
            save_file(tensors, tmp, metadata={META_KEY: text})
        except OSError:
            raise
        except Exception as e:          # safetensors' own error for an I/O failure: the OSError it wraps
            code = re.search(r"IoError\(Os \{ code: (\d+)|\(os error (\d+)\)", str(e))
            if code is None:
                raise
            n = int(code[1] or code[2])
            raise OSError(n, os.strerror(n)) from None
    atomic.write_via(path, fill, within=within, make_parent=True)
    return path
