"""Reading upstream Python source as data, with `ast`: the one reader the kernel loader
(loader.py) and `mxval upstream check` both use. Nothing here imports or runs what it reads.

* `parse`: text -> module AST, bounded (MAX_SOURCE_CHARS, MAX_AST_DEPTH); a source that is
  too large, too deep (a 200k-term expression) or not Python is a ReadError, one line;
* `top_level_defs`: the module's top-level names -> the statement that binds them, the last
  one winning as at import;
* `params_of`: a function's parameters (kind, default, constexpr mark);
* `is_jit`, `is_constexpr`, `dotted_name`, `resolve_from`, `import_target`.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Optional

MAX_SOURCE_CHARS = 4 << 20          # one source file (upstream's largest table file is ~60 kB)
MAX_AST_DEPTH = 400                 # nesting of one module's AST (upstream's deepest is ~30)
CONSTEXPR_NAMES = ("tl.constexpr", "triton.language.constexpr", "constexpr", "gl.constexpr",
                   "gluon.constexpr")


class ReadError(ValueError):
    """Source that cannot be read as data: one line saying where and why."""


def parse(text: str, filename: str) -> ast.Module:
    if len(text) > MAX_SOURCE_CHARS:
        raise ReadError(f"{filename}: {len(text)} characters, more than {MAX_SOURCE_CHARS}: not read")
    try:
        tree = ast.parse(text, filename=filename)
    except SyntaxError as e:
        raise ReadError(f"{filename}: cannot parse ({e.msg}, line {e.lineno})") from None
    except (RecursionError, MemoryError):
        raise ReadError(f"{filename}: nested too deeply to parse (more than {MAX_AST_DEPTH} levels)") from None
    depth = _depth(tree)
    if depth > MAX_AST_DEPTH:
        raise ReadError(f"{filename}: nested {depth} levels deep, more than {MAX_AST_DEPTH}: not read")
    return tree


def _depth(tree: ast.AST) -> int:
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if d <= MAX_AST_DEPTH:
            stack.extend((c, d + 1) for c in ast.iter_child_nodes(node))
    return deepest


def top_level_defs(tree: ast.Module) -> dict[str, ast.AST]:
    """Top-level name -> the statement binding it (def, class, assignment, import)."""
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            defs[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                defs[a.asname or a.name] = node
        elif isinstance(node, ast.Import):
            for a in node.names:
                defs[(a.asname or a.name).split(".")[0]] = node
    return defs


def dotted_name(node: ast.AST) -> str:
    """`a.b.c` of a Name/Attribute chain (of a call's callee for a Call); "" otherwise."""
    if isinstance(node, ast.Call):
        return dotted_name(node.func)
    if isinstance(node, ast.Attribute):
        return f"{dotted_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return ""


def is_jit(fn: ast.AST) -> bool:
    """A `@triton.jit` / `@gluon.jit` kernel (also under `@triton.heuristics` / `@autotune`)."""
    return any(dotted_name(d).split(".")[-1] == "jit" for d in getattr(fn, "decorator_list", []))


def is_constexpr(ann: Optional[ast.AST]) -> bool:
    return ann is not None and ast.unparse(ann).strip("'\"") in CONSTEXPR_NAMES


@dataclass(frozen=True)
class Param:
    name: str
    kind: str                 # "pos", "kw" (keyword-only), "var" (*args), "varkw" (**kwargs)
    default: bool
    constexpr: bool = False


def params_of(fn: ast.AST, drop_self: bool = False) -> list[Param]:
    """The parameters of a def (or of an `ast.arguments`), in order."""
    args = fn if isinstance(fn, ast.arguments) else fn.args
    pos = args.posonlyargs + args.args
    n_def = len(args.defaults)
    out = [Param(a.arg, "pos", i >= len(pos) - n_def, is_constexpr(a.annotation)) for i, a in enumerate(pos)]
    if drop_self and out and out[0].name in ("self", "cls"):
        out = out[1:]
    if args.vararg:
        out.append(Param(args.vararg.arg, "var", True))
    out += [Param(a.arg, "kw", d is not None, is_constexpr(a.annotation))
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append(Param(args.kwarg.arg, "varkw", True))
    return out


def resolve_from(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` in `module` reads from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    if node.level > 1:
        base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_name(node: ast.ImportFrom, alias: str) -> str:
    """The name `from m import name as alias` takes from m."""
    return next(a.name for a in node.names if (a.asname or a.name) == alias)


def import_target(node: ast.Import, alias: str) -> str:
    """The module an `import` statement binds to `alias` (`import a.b as x` -> "a.b" for x;
    `import a.b` -> "a" for a)."""
    for a in node.names:
        if a.asname == alias:
            return a.name
        if a.asname is None and a.name.split(".")[0] == alias:
            return alias
    return alias
