"""Load upstream Triton kernels (vLLM's, aiter's) from source text without importing the package.

For each kernel asked for (`KernelRef(module, name)`, `name` may be `Class.kernel` for a
`@staticmethod @triton.jit` in a class), the loader parses the module (reader.py) and
follows every global name it uses: a `@triton.jit` helper of the same module, a module
constant, a name imported from another upstream module (followed there), `tl` / `triton`
(bound to the real triton, `import triton.language as tl` included) or one of triton's own
functions (TRITON_NAMES). A `KernelRef(..., host=True)` is a Python launcher (aiter's
wrappers): it may also call plain functions of the tree and use torch. A name that resolves
to nothing, or to something that is not a jit function or a constant, is a `LoadError` naming
the kernel, the name and the line: nothing runs half-resolved.

`resolve` only parses and resolves. `materialize` compiles the selected definitions in one
fresh namespace per upstream module, at their upstream line numbers (the other lines blank,
so tracebacks point at upstream's lines), under a pseudo file registered in `linecache`
(triton reads a kernel's source with `inspect`). A definition listed in `replace` (a jit
helper, a function or a class) is not taken from upstream: the given source is compiled in
its place, after checking that upstream still defines it as expected.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import linecache
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Optional

from .reader import (
    Param,
    ReadError,
    dotted_name,
    import_target,
    imported_name,
    is_jit,
    parse,
    resolve_from,
    top_level_defs,
)
from .reader import params_of as _all_params

TRITON_MODULES = ("triton", "triton.language", "vllm.triton_utils")
# names a kernel may import from triton itself besides `triton` / `tl` (bound to the real ones)
TRITON_NAMES = {("triton.language.target_info", "is_hip_cdna4")}
# modules a host function (a launcher loaded with `KernelRef(..., host=True)`) may use
HOST_MODULES = ("torch", "triton")
NS_PREFIX = "mxval_upstream"        # __name__ of every namespace the loader compiles into


class LoadError(RuntimeError):
    """A kernel cannot be loaded as written: one line saying which name and where."""


@dataclass(frozen=True)
class KernelRef:
    module: str
    name: str                        # "fn" or "Class.fn"
    host: bool = False               # a plain Python launcher (wrapper), not a @triton.jit kernel

    def __str__(self) -> str:
        return f"{self.module}:{self.name}"


@dataclass(frozen=True)
class Replacement:
    source: str                      # Python source defining `name` (and any helpers it needs)
    label: str                       # where it comes from, for the pseudo file name
    params: tuple[str, ...]          # the upstream parameters it stands in for (a class: its methods)
    must_contain: str = ""           # text the upstream body must still hold (what is replaced)
    kind: str = "jit"                # what upstream defines: "jit", "function" or "class"


@dataclass
class Loaded:
    kernels: dict                    # KernelRef -> JITFunction
    params: dict                     # KernelRef -> tuple[Param, ...]
    files: dict                      # module -> relative path it was read from
    replaced: list                   # "module:name" replaced by our source


def params_of(fn: ast.FunctionDef) -> tuple[Param, ...]:
    """A kernel's named parameters (positional and keyword-only), as the launch binds them."""
    return tuple(p for p in _all_params(fn) if p.kind in ("pos", "kw"))


__all__ = ["KernelRef", "Loader", "LoadError", "Loaded", "Param", "Replacement", "dotted_name", "free_names",
           "is_jit", "params_of"]


def free_names(fn: ast.AST) -> dict[str, int]:
    """Global names a function (or a constant's value) reads -> first line using it."""
    local: set[str] = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = fn.args
        local |= {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
        local |= {p.arg for p in (a.vararg, a.kwarg) if p is not None}
        roots = list(fn.body) + list(fn.decorator_list) + list(a.defaults) + [d for d in a.kw_defaults if d]
        roots += [p.annotation for p in a.posonlyargs + a.args + a.kwonlyargs if p.annotation is not None]
    else:
        roots = [fn]
    loads: dict[str, int] = {}
    for root in roots:
        for node in ast.walk(root):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Store) or isinstance(node.ctx, ast.Del):
                    local.add(node.id)
                else:
                    loads.setdefault(node.id, node.lineno)
            elif isinstance(node, (ast.FunctionDef, ast.Lambda)) and node is not fn:
                raise LoadError(f"line {node.lineno}: nested functions are not supported by the loader")
    return {n: ln for n, ln in loads.items() if n not in local}


@dataclass
class _Module:
    name: str
    rel: str
    text: str
    tree: ast.Module
    defs: dict = field(default_factory=dict)      # top-level name -> node
    needed: dict = field(default_factory=dict)    # name -> node (or Replacement)
    imports: dict = field(default_factory=dict)   # alias -> (module, name)
    ns: Optional[dict] = None


class Loader:
    """`read(module) -> (relative path, text)`; `replace`: {(module, name): Replacement}."""

    def __init__(self, read: Callable[[str], tuple[str, str]], *, label: str = "vllm",
                 replace: Optional[dict] = None):
        import triton
        import triton.language as tl
        self.triton, self.tl = triton, tl
        self.read, self.label = read, label
        self.replace = dict(replace or {})
        self.mods: dict[str, _Module] = {}
        self.replaced: list[str] = []

    # --- parsing and resolution --------------------------------------------------------

    def _module(self, name: str) -> _Module:
        if name not in self.mods:
            try:
                rel, text = self.read(name)
            except LoadError:
                raise
            except Exception as e:
                raise LoadError(f"{name}: cannot read its source ({e})") from None
            try:
                tree = parse(text, rel)
            except ReadError as e:
                raise LoadError(str(e)) from None
            m = _Module(name, rel, text, tree)
            m.defs = top_level_defs(tree)     # the last definition wins, as at import
            self.mods[name] = m
        return self.mods[name]

    def _function(self, m: _Module, name: str) -> ast.FunctionDef:
        cls, _, meth = name.rpartition(".")
        node = m.defs.get(cls or name)
        if cls:
            if not isinstance(node, ast.ClassDef):
                raise LoadError(f"{m.rel}: no class {cls} (looking for {name})")
            fn = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == meth), None)
            if fn is None:
                raise LoadError(f"{m.rel}: class {cls} has no {meth}")
            return fn
        if not isinstance(node, ast.FunctionDef):
            what = "is not defined" if node is None else f"is a {type(node).__name__}, not a function"
            raise LoadError(f"{m.rel}: {name} {what}")
        return node

    def _need(self, module: str, name: str, used_by: str, line: int, host: bool = False) -> None:
        """Resolve `name` as `module` sees it. `host`: needed by a plain Python launcher, which
        may also call plain functions and use torch; a kernel may not."""
        m = self._module(module)
        if name in m.needed or name in m.imports:
            return
        if name in ("tl", "triton") and name not in m.defs:
            raise LoadError(f"{m.rel}:{line}: {used_by} uses {name}, which {m.rel} does not import")
        node = m.defs.get(name)
        if node is None:
            if hasattr(builtins, name):
                return
            raise LoadError(f"{m.rel}:{line}: {used_by} uses {name!r}, which {m.rel} does not define "
                            "(unresolved name)")
        if isinstance(node, ast.ImportFrom):
            target = resolve_from(module, m.rel.endswith("__init__.py"), node)
            orig = imported_name(node, name)
            if target in TRITON_MODULES and orig in ("tl", "triton", "language"):
                m.imports[name] = ("<triton>", orig)
                return
            if (target, orig) in TRITON_NAMES:
                m.imports[name] = ("<object>", f"{target}:{orig}")
                return
            if name in ("tl", "triton"):
                raise LoadError(f"{m.rel}:{node.lineno}: {name} is imported from {target}, not from triton")
            m.imports[name] = (target, orig)
            self._need(target, orig, f"{module}:{name}", node.lineno, host)
            return
        if isinstance(node, ast.Import):
            full = import_target(node, name)
            if full in ("triton", "triton.language"):
                m.imports[name] = ("<triton>", "language" if full == "triton.language" else "triton")
                return
            if host and full in HOST_MODULES:
                m.imports[name] = ("<module>", full)
                return
            allowed = "triton / tl" + (" / torch" if host else "")
            raise LoadError(f"{m.rel}:{line}: {used_by} uses module {full!r}; only {allowed} may be "
                            f"used by a {'launcher' if host else 'kernel'}")
        key = (module, name)
        if key in self.replace:
            self._replace(m, name, node, self.replace[key])
            return
        if isinstance(node, ast.FunctionDef):
            if not is_jit(node) and not host:
                raise LoadError(f"{m.rel}:{node.lineno}: {used_by} calls {name}, which is not a "
                                "@triton.jit function")
            m.needed[name] = node
            for n, ln in free_names(node).items():
                self._need(module, n, f"{module}:{name}", ln, host and not is_jit(node))
            return
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            m.needed[name] = node
            for n, ln in free_names(node.value).items():
                self._need(module, n, f"{module}:{name}", ln, host)
            return
        raise LoadError(f"{m.rel}:{line}: {used_by} uses {name}, a {type(node).__name__}: only jit "
                        "functions" + (", launchers" if host else "") + " and constants can be loaded")

    def _replace(self, m: _Module, name: str, node: ast.AST, rep: Replacement) -> None:
        """Check that upstream still defines `name` as the replacement expects, then take it."""
        if rep.kind == "class":
            methods = {n.name for n in getattr(node, "body", []) if isinstance(n, ast.FunctionDef)}
            ok = isinstance(node, ast.ClassDef) and set(rep.params) <= methods
            want = f"class {name} with {', '.join(rep.params)}"
        else:
            ok = (isinstance(node, ast.FunctionDef) and is_jit(node) == (rep.kind == "jit")
                  and tuple(p.name for p in params_of(node)) == rep.params)
            want = f"{'@triton.jit ' if rep.kind == 'jit' else ''}{name}({', '.join(rep.params)})"
        if ok and rep.must_contain:
            ok = rep.must_contain in (ast.get_source_segment(m.text, node) or "")
        if not ok:
            what = {"jit": "helper", "function": "function", "class": "class"}[rep.kind]
            raise LoadError(f"{m.rel}:{node.lineno}: {name} is no longer the {what} mxval replaces "
                            f"(expected {want}" + (f" holding {rep.must_contain!r}" if rep.must_contain else "")
                            + ")")
        m.needed[name] = rep
        self.replaced.append(f"{m.name}:{name}")

    # --- compiling -------------------------------------------------------------------

    def _materialize(self, m: _Module, stack=()) -> dict:
        if m.ns is not None:
            return m.ns
        if m.name in stack:
            raise LoadError(f"{m.rel}: circular imports between kernel modules ({' -> '.join(stack)})")
        ns: dict = {"__name__": f"{NS_PREFIX}.{m.name}", "__builtins__": builtins}
        # triton's interpreter wants triton.language among every jit function's globals,
        # used or not: bind tl / triton wherever the module imports them
        for alias in ("tl", "triton"):
            node = m.defs.get(alias)
            if isinstance(node, ast.ImportFrom) and resolve_from(m.name, False, node) in TRITON_MODULES:
                ns[alias] = self.tl if alias == "tl" else self.triton
            elif isinstance(node, ast.Import) and import_target(node, alias) in ("triton", "triton.language"):
                ns[alias] = self.tl if import_target(node, alias) == "triton.language" else self.triton
        for alias, (target, orig) in m.imports.items():
            if target == "<triton>":
                ns[alias] = self.tl if orig in ("tl", "language") else self.triton
            elif target == "<module>":
                ns[alias] = importlib.import_module(orig)
            elif target == "<object>":
                mod, _, attr = orig.partition(":")
                ns[alias] = getattr(importlib.import_module(mod), attr)
            else:
                other = self.mods[target]
                ns[alias] = self._materialize(other, stack + (m.name,))[orig]
        lines = m.text.splitlines(keepends=True)
        out = ["\n"] * len(lines)
        reps = []
        for name, node in m.needed.items():
            if isinstance(node, Replacement):
                reps.append((name, node))
                continue
            if isinstance(node, _Segment):
                first, seg = node.lineno, node.text.splitlines(keepends=True)
            else:
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                seg = lines[first - 1:node.end_lineno]
            out[first - 1:first - 1 + len(seg)] = seg
        # replacements first: an upstream constant may call one when the module text runs
        # (`_repr = make_kernel_repr(...)`)
        for name, rep in reps:
            rfile = f"<mxval {rep.label} (replaces {m.rel}:{name})>"
            linecache.cache[rfile] = (len(rep.source), None, rep.source.splitlines(keepends=True), rfile)
            exec(compile(rep.source, rfile, "exec"), ns)
            if name not in ns:
                raise LoadError(f"{rep.label}: defines no {name}")
        filename = f"<mxval {self.label}: {m.rel}>"
        text = "".join(out)
        linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
        try:
            exec(compile(text, filename, "exec"), ns)
        except Exception as e:
            raise LoadError(f"{m.rel}: the selected definitions do not compile ({type(e).__name__}: {e})") from None
        m.ns = ns
        return ns

    def resolve(self, refs) -> dict:
        """Parse and resolve every name the kernels (and launchers) `refs` use; nothing is
        compiled or run. -> {ref: its parameters}."""
        refs = list(refs)
        params = {}
        for ref in refs:
            m = self._module(ref.module)
            fn = self._function(m, ref.name)
            if ref.host and is_jit(fn):
                raise LoadError(f"{m.rel}:{fn.lineno}: {ref.name} is a @triton.jit kernel, not a launcher")
            if not ref.host and not is_jit(fn):
                raise LoadError(f"{m.rel}:{fn.lineno}: {ref.name} is not a @triton.jit kernel")
            params[ref] = params_of(fn)
            for n, ln in free_names(fn).items():
                self._need(ref.module, n, str(ref), ln, ref.host)
            if "." in ref.name:
                self._class_kernels(m, ref.name, fn)
            else:
                m.needed[ref.name] = fn
        return params

    def materialize(self, refs) -> dict:
        """Compile what `resolve` selected (this runs upstream module text: the selected
        definitions only) -> {ref: the function object}."""
        kernels = {}
        for ref in refs:
            ns = self._materialize(self.mods[ref.module])
            kernels[ref] = ns[ref.name.replace(".", "__")] if "." in ref.name else ns[ref.name]
        return kernels

    def load(self, refs) -> Loaded:
        refs = list(refs)
        params = self.resolve(refs)
        kernels = self.materialize(refs)
        return Loaded(kernels, params, {k: v.rel for k, v in self.mods.items()}, list(self.replaced))

    def _class_kernels(self, m: _Module, qualname: str, fn: ast.FunctionDef) -> None:
        """A `@staticmethod @triton.jit def kernel(...)` in a class: compiled at module level
        as `Class__kernel` (two classes of one module both call theirs `kernel`)."""
        flat = qualname.replace(".", "__")
        lines = m.text.splitlines(keepends=True)
        first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        seg = textwrap.dedent("".join(lines[first - 1:fn.end_lineno])).splitlines(keepends=True)
        seg = ["\n" if s.strip() == "@staticmethod" else s for s in seg]
        i = next(i for i, s in enumerate(seg) if s.lstrip().startswith("def "))
        seg[i] = seg[i].replace(f"def {fn.name}(", f"def {flat}(", 1)
        m.needed[flat] = _Segment(first, fn.end_lineno, "".join(seg))


@dataclass
class _Segment:
    """Pre-cut source lines (a class's kernel, dedented and renamed) at their upstream lines."""
    lineno: int
    end_lineno: int
    text: str
