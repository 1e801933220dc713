"""`mxval upstream fetch` and `mxval upstream check`: the upstream table against real sources.

    mxval upstream fetch [--vllm VERSION]        # pip-download the wheel, extract the table's files
    mxval upstream check [--vllm DIR|WHEEL|VERSION] [--aiter DIR]

`check` parses every target of `optimized.upstream.TABLE` with `ast` (nothing is imported:
vLLM needs a CUDA torch and sixty packages, aiter a ROCm build) and prints, per target,
where it was found, the parameters mxval binds against the ones upstream has, the return
convention and a verdict. Exit status: 0 every target binds, 1 drift (a target missing,
a parameter renamed or moved, a return convention changed), 2 unusable input.

The cache is `$XDG_CACHE_HOME/mxval/upstream/` (default `~/.cache/mxval/upstream/`):
`dl/` holds the downloaded wheels, `vllm-<version>/` the extracted source files (only the
modules the table names, plus `vllm/_version.py`) and a manifest; a second fetch of the
same version with the same table is a no-op.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from harness.errors import InputError
from harness.io import atomic, safe_input
from optimized import upstream
from optimized.vllm_kernels.reader import (
    MAX_SOURCE_CHARS,
    Param,
    ReadError,
    dotted_name,
    imported_name,
    is_jit,
    params_of,
    parse,
    resolve_from,
    top_level_defs,
)

EXIT_OK, EXIT_DRIFT, EXIT_USAGE = 0, 1, 2
COMMAND = "upstream"


class UpstreamError(InputError):
    """Unusable input: the one line printed before exit 2."""


# --- where sources come from --------------------------------------------------------------

def module_files(module: str) -> tuple[str, str]:
    base = module.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


class Source:
    """A package's source files: a directory tree or a wheel, read as text."""

    def __init__(self, package: str, label: str):
        self.package, self.label = package, label

    def read(self, rel: str) -> Optional[str]:
        raise NotImplementedError

    def module_source(self, module: str) -> tuple[Optional[str], Optional[str]]:
        """(relative path, text) of `module`, or (None, None)."""
        for rel in module_files(module):
            text = self.read(rel)
            if text is not None:
                return rel, text
        return None, None

    @property
    def version(self) -> str:
        text = self.read(f"{self.package}/_version.py") or self.read(f"{self.package}/version.py") or ""
        return upstream.version_in(text) or "version unknown"


def _too_large(where: str, size: int) -> UpstreamError:
    return UpstreamError(f"{where}: {size} bytes, more than {MAX_SOURCE_CHARS}: not an upstream source "
                         "file; not read")


class DirSource(Source):
    def __init__(self, package: str, root: Path, label: Optional[str] = None):
        super().__init__(package, label or str(root))
        self.root = root

    def read(self, rel: str) -> Optional[str]:
        from optimized.vllm_kernels.source import SourceError, read_bounded
        p = self.root / rel
        if not p.is_file():
            return None
        try:
            data = read_bounded(p)
        except OSError:
            return None
        except SourceError as e:
            raise UpstreamError(str(e)) from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return None


MAX_WHEEL_MEMBERS = 200_000          # vLLM's wheels hold ~5k


class WheelSource(Source):
    """A wheel read as a zip of text files: each member read is bounded (MAX_SOURCE_CHARS,
    whatever its header says), never extracted or imported."""

    def __init__(self, package: str, path: Path):
        super().__init__(package, str(path))
        try:
            self.zip = zipfile.ZipFile(path)
            infos = self.zip.infolist()
        except (OSError, zipfile.BadZipFile, ValueError) as e:
            raise UpstreamError(f"{path}: not a readable wheel ({e})") from None
        if len(infos) > MAX_WHEEL_MEMBERS:
            raise UpstreamError(f"{path}: {len(infos)} members, more than {MAX_WHEEL_MEMBERS}: not a wheel mxval reads")
        self.names = {i.filename for i in infos}
        m = re.match(rf"{package}-([^-]+)-", path.name)
        self._wheel_version = m[1] if m else None

    def read(self, rel: str) -> Optional[str]:
        return None if rel not in self.names else _zip_text(self.zip, rel, self.label)

    @property
    def version(self) -> str:
        v = super().version
        return self._wheel_version if v == "version unknown" and self._wheel_version else v


def _zip_text(z: zipfile.ZipFile, rel: str, label: str) -> Optional[str]:
    """A member's text, read at most MAX_SOURCE_CHARS + 1 bytes (a zip bomb stops there)."""
    info = z.getinfo(rel)
    if info.file_size > MAX_SOURCE_CHARS:
        raise _too_large(f"{label}:{rel}", info.file_size)
    try:
        with z.open(info) as f:
            data = f.read(MAX_SOURCE_CHARS + 1)
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return None
    if len(data) > MAX_SOURCE_CHARS:
        raise _too_large(f"{label}:{rel}", len(data))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def open_source(package: str, path: str) -> Source:
    """A checkout, an installed package directory, a tree that holds `<package>/`, or a wheel."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".whl":
            raise UpstreamError(f"--{package} {path}: neither a directory nor a .whl")
        return WheelSource(package, p)
    if not p.is_dir():
        raise UpstreamError(f"--{package} {path}: no such file or directory")
    if (p / package).is_dir():
        return DirSource(package, p)
    if p.name == package and (p / "__init__.py").is_file():
        return DirSource(package, p.parent)
    raise UpstreamError(f"--{package} {path}: holds no {package}/ (pass the directory "
                        f"that contains the {package} package, or the package itself)")


# --- reading a definition ---------------------------------------------------------------

@dataclass
class Found:
    path: str
    line: int
    kind: str                 # "function", "triton_jit", "class", "method", "assignment"
    params: list[Param]
    annotation: Optional[str]
    return_shape: str
    body: str                 # the definition, unparsed (normalized formatting)




def _return_shape(fn: ast.AST) -> str:
    shapes = set()

    def visit(node, top):
        if not top and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return
        if isinstance(node, ast.Return):
            v = node.value
            if v is None or isinstance(v, ast.Constant) and v.value is None:
                shapes.add("None")
            elif isinstance(v, ast.Tuple):
                shapes.add(f"{len(v.elts)}-tuple")
            else:
                shapes.add("value")
        for child in ast.iter_child_nodes(node):
            visit(child, False)
    visit(fn, True)
    if not shapes:
        return "None"
    return shapes.pop() if len(shapes) == 1 else "value"


def read_definition(node: ast.AST, path: str, name: str) -> Found:
    """What a definition node says: its kind, parameters, annotation and return shape."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return Found(path, node.lineno, "triton_jit" if is_jit(node) else "function", params_of(node),
                     ast.unparse(node.returns) if node.returns is not None else None,
                     _return_shape(node), ast.unparse(node))
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        return Found(path, node.lineno, "class", params_of(init, drop_self=True) if init else [], None, "value",
                     ast.unparse(node))
    return Found(path, node.lineno, "assignment", [], None, "value", ast.unparse(node))


def find_definition(source: Source, t: upstream.Target) -> tuple[Optional[Found], str]:
    """The definition of `t` in `source` (following re-exports), or (None, why not)."""
    tried = []
    for module in t.modules:
        rel, text = source.module_source(module)
        if text is None:
            tried.append(module)
            continue
        found, why = _find_in(source, module, rel, text, t, depth=0)
        if found is not None:
            return found, ""
        return None, why
    return None, "module not found: " + ", ".join(tried)


def _find_in(source, module, rel, text, t, depth):
    try:
        tree = parse(text, rel)
    except ReadError as e:
        return None, str(e)
    cls_name, _, meth = t.name.partition(".") if t.kind == "method" or "." in t.name else (t.name, "", "")
    node = top_level_defs(tree).get(cls_name)
    if isinstance(node, ast.Import):
        node = None
    if isinstance(node, ast.ImportFrom) and depth < 4:
        target_mod = resolve_from(module, rel.endswith("__init__.py"), node)
        target_name = imported_name(node, cls_name)
        rel2, text2 = source.module_source(target_mod)
        if text2 is None:
            return None, f"{rel}: {cls_name} is imported from {target_mod}, which is not in the source"
        sub = upstream.Target(t.key, t.package, target_mod, f"{target_name}.{meth}" if meth else target_name,
                              t.kind, t.params, t.returns, t.versions)
        return _find_in(source, target_mod, rel2, text2, sub, depth + 1)
    if node is None:
        return None, f"{rel} defines no {cls_name}"
    if meth:
        if not isinstance(node, ast.ClassDef):
            return None, f"{rel}: {cls_name} is not a class"
        fn = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and n.name == meth), None)
        if fn is None:
            return None, f"{rel}: class {cls_name} has no method {meth}"
        found = read_definition(fn, rel, meth)
        is_static = any(dotted_name(d) == "staticmethod" for d in fn.decorator_list)
        found.params = params_of(fn, drop_self=not is_static)
        if found.kind != "triton_jit":            # a class's @staticmethod @triton.jit kernel stays one
            found.kind = "method"
        return found, ""
    return read_definition(node, rel, t.name), ""


# --- comparing it with the table ----------------------------------------------------------

def _normalize_expr(text: str) -> str:
    text = text.strip()
    try:
        return ast.unparse(ast.parse(text, mode="eval"))
    except SyntaxError:
        pass
    try:                                          # keyword-argument form: NAME=expr
        call = ast.parse(f"f({text})", mode="eval").body
        return ast.unparse(call)[2:-1]
    except SyntaxError:
        return " ".join(text.split())


@dataclass
class Comparison:
    params: list[str] = field(default_factory=list)      # problems with the parameters
    returns: list[str] = field(default_factory=list)     # problems with the return convention
    params_note: str = ""
    returns_note: str = ""

    @property
    def ok(self) -> bool:
        return not self.params and not self.returns


def compare(t: upstream.Target, f: Found, *, check_kind: bool = True) -> Comparison:
    """How a definition departs from its table entry ([] problems: mxval binds it)."""
    c = Comparison()
    if f.kind == "assignment":
        c.params.append(f"{t.name} is assigned, not defined: its signature cannot be read")
        return c
    if check_kind and f.kind != t.kind:
        c.params.append(f"a {f.kind}, the table says {t.kind}")
    positional = [p for p in f.params if p.kind == "pos"]
    by_name = {p.name: p for p in f.params}
    has_varkw = any(p.kind == "varkw" for p in f.params)
    want_pos, want_kw = t.positional(), t.keyword()
    for i, name in enumerate(want_pos):
        have = positional[i].name if i < len(positional) else None
        if have == name:
            continue
        if name in by_name and by_name[name].kind == "kw":
            c.params.append(f"{name} is keyword-only upstream, mxval passes it at position {i}")
        elif name in by_name:
            c.params.append(f"{name} is at position {positional.index(by_name[name])}, mxval passes it at {i}")
        else:
            c.params.append(f"no parameter {name} (position {i} is {have or 'absent'})")
    for name in want_kw:
        if name not in by_name:
            c.params.append(f"no parameter {name}" + (" (it would land in **kwargs)" if has_varkw else ""))
        elif by_name[name].kind in ("var", "varkw"):
            c.params.append(f"{name} is *{name}, not a named parameter")
    bound = set(t.bound_params())
    for p in f.params:
        if p.kind in ("pos", "kw") and not p.default and p.name not in bound:
            c.params.append(f"upstream requires {p.name}, which mxval does not pass")
    if t.kind == "triton_jit":
        extra = [p.name for p in positional if p.name not in bound]
        if extra:
            c.params.append("kernel parameters mxval does not list: " + ", ".join(extra))
        marked = set(t.constexprs())
        if marked:
            have = {p.name for p in f.params if p.constexpr}
            for name in sorted(marked - have):
                if name in by_name:
                    c.params.append(f"{name} is not a constexpr upstream")
            for name in sorted((have - marked) & bound):
                c.params.append(f"{name} is a constexpr upstream, the table does not mark it")
    n_up = len([p for p in f.params if p.kind in ("pos", "kw")])
    c.params_note = f"{len(t.bound_params())} bound of {n_up}"
    if t.constexprs():
        c.params_note += f", {len(t.constexprs())} constexpr"

    clauses = [s.strip() for s in t.returns.split(";") if s.strip()]
    if clauses:
        want = clauses[0]
        shapes = {"None", "value"}
        if f.annotation is not None:
            if _normalize_expr(want) != _normalize_expr(f.annotation):
                c.returns.append(f"returns {f.annotation}, the table says {want}")
            c.returns_note = f.annotation
        elif want in shapes or re.fullmatch(r"\d+-tuple", want):
            if want != f.return_shape:
                c.returns.append(f"returns {f.return_shape}, the table says {want}")
            c.returns_note = f.return_shape
        else:
            c.returns_note = f"not annotated ({f.return_shape})"
        body = f.body
        missing = [s for s in clauses[1:] if _normalize_expr(s) not in body]
        for s in missing:
            c.returns.append(f"no `{s}` in its body")
        if len(clauses) > 1 and not missing:
            c.returns_note += f" +{len(clauses) - 1} pinned"
    return c


def check_definition(t: upstream.Target, fn) -> Comparison:
    """Compare a Python function (a test's fake) with its table entry, as `check` compares
    upstream: the fake's own source, parsed."""
    import inspect
    import textwrap
    src = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(src)
    node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    found = read_definition(node, inspect.getsourcefile(fn) or "?", t.name)
    return compare(t, found, check_kind=False)


@dataclass
class Result:
    target: upstream.Target
    found: Optional[Found]
    why: str = ""
    comparison: Optional[Comparison] = None
    verdict: str = ""             # "bound", "drift", "missing", "alternative", "not checked"
    package_label: str = ""

    @property
    def bound(self) -> bool:
        return self.found is not None and self.comparison is not None and self.comparison.ok


def check(sources: dict[str, Source], table: tuple[upstream.Target, ...] = upstream.TABLE) -> list[Result]:
    """One Result per table entry; a group binds when one of its entries binds."""
    results = []
    for t in table:
        src = sources.get(t.package)
        if src is None:
            results.append(Result(t, None, f"no --{t.package} given", verdict="not checked"))
            continue
        found, why = find_definition(src, t)
        r = Result(t, found, why, compare(t, found) if found else None)
        results.append(r)
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.target.group, []).append(r)
    for members in groups.values():
        any_bound = any(m.bound for m in members)
        for m in members:
            if m.verdict:
                continue
            if m.bound:
                m.verdict = "bound"
            elif any_bound:
                m.verdict = "alternative"
            else:
                m.verdict = "missing" if m.found is None else "drift"
    return results


def exit_status(results: list[Result]) -> int:
    return EXIT_DRIFT if any(r.verdict in ("drift", "missing") for r in results) else EXIT_OK


def render(results: list[Result], sources: dict[str, Source], console) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table
    for pkg, src in sources.items():
        console.print(escape(f"{pkg} {src.version}: {src.label}"))
    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
    for col in ("target", "found", "parameters (table vs upstream)", "returns", "verdict"):
        table.add_column(col, overflow="fold", no_wrap=col in ("target", "found"))
    style = {"bound": "green", "alternative": "dim", "not checked": "dim", "drift": "red", "missing": "red"}
    for r in results:
        t = r.target
        if r.found is None:
            where, params, returns = r.why, "", ""
        else:
            where = f"{r.found.path}:{r.found.line}"
            c = r.comparison
            params = "; ".join(c.params) if c.params else f"ok ({c.params_note})"
            returns = "; ".join(c.returns) if c.returns else (c.returns_note or "ok")
        verdict = r.verdict
        if verdict == "alternative":
            bound = next((m.target.key for m in results if m.target.group == t.group and m.verdict == "bound"), "")
            verdict = f"alternative ({bound} bound)"
        table.add_row(escape(t.key), escape(where), escape(params), escape(returns),
                      f"[{style.get(r.verdict, 'default')}]{escape(verdict)}[/]")
    console.print(table)
    bad = [r for r in results if r.verdict in ("drift", "missing")]
    groups = {r.target.group for r in results if r.verdict != "not checked"}
    if bad:
        console.print(f"[red]drift[/]: {len({r.target.group for r in bad})} of {len(groups)} target(s) "
                      "do not bind; fix optimized/upstream.py (and the adapters) before trusting a run")
    else:
        console.print(f"[green]ok[/]: all {len(groups)} checked target(s) bind")


# --- fetch --------------------------------------------------------------------------------
# Fetched trees are data: files are read from the wheel / git objects / archive with bounds,
# written only inside the cache (never through a symlink), and recorded with their sha256;
# the loaders check them against optimized.upstream.PINS before anything runs.

def tree_dir(version: str) -> Path:
    return upstream.cache_root() / f"vllm-{version}"


def _safe_write(root: Path, rel: str, data: bytes) -> None:
    """Write root/rel, refusing to follow a symlink anywhere from the cache down (a cache whose
    vllm/ links elsewhere would otherwise be written through)."""
    cache = upstream.cache_root()
    dest = root / rel
    parts = dest.relative_to(cache).parts if dest.is_relative_to(cache) else ()
    if not parts or ".." in parts:
        raise UpstreamError(f"{dest}: outside the cache {cache}; not written")
    here = cache
    for part in parts:
        here = here / part
        if here.is_symlink():
            raise UpstreamError(f"{here}: a symlink inside the upstream cache; not written through "
                                "(remove it and fetch again)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(dest, data, within=cache)          # synced, renamed; never through a link


def _record(root: Path, package: str, files: dict[str, bytes], extra: dict, console) -> None:
    """Write the manifest (every file's sha256) and say which files the table's pins know."""
    from optimized.vllm_kernels.source import sha256
    digests = {rel: sha256(data) for rel, data in files.items()}
    pinned = {rel: upstream.pinned_releases(package, rel, d) for rel, d in digests.items()}
    loadable = [rel for rel in digests if upstream.pinned_releases(package, rel)]
    unknown = [rel for rel in loadable if not pinned[rel]]
    _safe_write(root, ".mxval-manifest.json", json.dumps(
        {**extra, "files": sorted(files), "sha256": digests,
         "pinned": {rel: r for rel, r in pinned.items() if r}}, indent=1).encode())
    releases = sorted({r for rs in pinned.values() for r in rs})
    if unknown:
        console.print(f"{package}: {len(unknown)} loaded file(s) not pinned by optimized/upstream.py "
                      f"({', '.join(unknown)}): the loader refuses them unless the tree is named and "
                      "--trust-upstream given")
    elif loadable:
        console.print(f"{package}: the {len(loadable)} loaded file(s) match the pins of {', '.join(releases)}")


def _pip_download(version: str, dest: Path) -> None:
    """`pip download vllm==VERSION --no-deps` into dest; UpstreamError with one line on failure.
    pip's own progress bar shows on the terminal."""
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--timeout", "30", "--retries", "1", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise UpstreamError(f"cannot run pip ({e})") from None
    if proc.returncode == 0:
        return
    err = proc.stderr or ""
    offline = _OFFLINE.search(err)
    last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip().startswith("ERROR")), "")
    if offline:
        raise UpstreamError(f"vllm=={version}: cannot reach the package index (offline?): {last or 'pip failed'}")
    if "No matching distribution" in err or "Could not find a version" in err:
        raise UpstreamError(f"vllm=={version}: no such release on the package index ({last})")
    raise UpstreamError(f"vllm=={version}: pip download failed: {last or f'exit {proc.returncode}'}")


_OFFLINE = re.compile(r"NewConnectionError|Network is unreachable|Temporary failure in name resolution|"
                      r"Name or service not known|Max retries exceeded|ConnectTimeout|ReadTimeout")


def _pip_versions() -> list[str]:
    """vLLM's releases on the package index, newest first (`pip index versions vllm`)."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "vllm", "--disable-pip-version-check",
           "--timeout", "30", "--retries", "1"]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UpstreamError(f"cannot ask the package index for vLLM's releases ({e})") from None
    m = re.search(r"Available versions:\s*(.+)", proc.stdout or "")
    if proc.returncode or not m:
        err = (proc.stderr or "").strip().splitlines()
        raise UpstreamError("cannot ask the package index for vLLM's releases"
                            + (" (offline?)" if _OFFLINE.search(proc.stderr or "") else "")
                            + (f": {err[-1]}" if err else ""))
    return [v.strip() for v in m[1].split(",") if upstream.VERSION_RE.fullmatch(v.strip())]


def newest_release(console, *, versions=None) -> str:
    """The newest vLLM release on the index, saying which releases the table knows."""
    known = upstream.known_releases("vllm")
    listed = (versions or _pip_versions)()
    final = [v for v in listed if re.fullmatch(r"\d+(\.\d+)*", v)]
    if not final:
        raise UpstreamError("the package index lists no vLLM release")
    newest = max(final, key=upstream.version_key)
    console.print(f"vllm: newest release on the index {newest}; the table knows {', '.join(known)}"
                  + ("" if newest in known else f" ({newest} is newer: `mxval upstream check --vllm {newest}` "
                                                  "says what moved)"))
    return newest


def _wheel(version: str) -> Optional[Path]:
    hits = sorted((upstream.cache_root() / "dl").glob(f"vllm-{version}-*.whl"))
    return hits[0] if hits else None


def wanted_files(names: set[str], table=upstream.TABLE, package: str = "vllm") -> dict[str, Optional[str]]:
    """module -> the file of it that `names` holds (None when it has none)."""
    out = {}
    for t in table:
        if t.package != package:
            continue
        for m in t.modules:
            out[m] = next((f for f in module_files(m) if f in names), None)
    return out


def _cached(have, root: Path, modules: set) -> bool:
    """Whether a cached manifest (untrusted: any field may have been edited) names every table
    module and lists files that are all there, inside the tree. Anything else: not cached."""
    if not isinstance(have, dict):
        return False
    files, mods, digests = have.get("files"), have.get("modules"), have.get("sha256")
    if not (isinstance(files, list) and isinstance(mods, dict) and isinstance(digests, dict)):
        return False
    if not all(isinstance(f, str) and f and not Path(f).is_absolute() and ".." not in Path(f).parts for f in files):
        return False
    return modules <= set(mods) and all((root / f).is_file() and not (root / f).is_symlink() for f in files)


def fetch(version: str, console, *, pip=None, table=upstream.TABLE) -> Path:
    """The extracted tree of vLLM `version`'s table files (downloading the wheel if needed)."""
    if not upstream.VERSION_RE.fullmatch(version):
        raise UpstreamError(f"--vllm {version}: not a version (e.g. {upstream.newest('vllm')})")
    root = tree_dir(version)
    manifest = root / ".mxval-manifest.json"
    modules = {m for t in table if t.package == "vllm" for m in t.modules}
    try:
        have = safe_input.load_json(manifest) if manifest.is_file() and not manifest.is_symlink() else None
    except InputError:
        have = None
    if _cached(have, root, modules):
        console.print(f"vllm {version}: cached, {len(have['files'])} source files in {root}")
        return root
    wheel = _wheel(version)
    if wheel is None:
        dl = upstream.cache_root() / "dl"
        dl.mkdir(parents=True, exist_ok=True)
        console.print(f"vllm {version}: downloading the wheel (no dependencies) into {dl}")
        (pip or _pip_download)(version, dl)
        wheel = _wheel(version)
        if wheel is None:
            raise UpstreamError(f"vllm=={version}: pip left no vllm-{version}-*.whl in {dl}")
    src = WheelSource("vllm", wheel)
    where = wanted_files(src.names, table)
    names = sorted({f for f in where.values() if f} | ({"vllm/_version.py"} & src.names))
    files = {}
    for f in names:
        text = src.read(f)
        if text is None:
            raise UpstreamError(f"{wheel}: cannot read {f}; delete the wheel and fetch again")
        files[f] = text.encode("utf-8")
    for f, data in files.items():
        _safe_write(root, f, data)
    absent = sorted(m for m, f in where.items() if f is None)
    console.print(f"vllm {version}: {len(files)} source files in {root}"
                  + (f" ({len(absent)} table module(s) not in this release: {', '.join(absent)})" if absent else ""))
    _record(root, "vllm", files, {"wheel": wheel.name, "modules": where}, console)
    return root


# --- fetch --aiter: a pinned aiter ref, from git or an archive -----------------------------

def aiter_wanted() -> list[str]:
    """The aiter files the table names (modules and the loaders' pinned files)."""
    rels = {rel for files in upstream.PINS.values() for rel in files if rel.startswith("aiter/")}
    for t in upstream.targets("aiter"):
        rels.update(module_files(t.module))
    return sorted(rels | {"aiter/__init__.py", "aiter/_version.py"})


def _git(*args: str, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UpstreamError(f"cannot run git ({e})") from None


def _from_git(url: str, ref: str, work: Path, wanted: list[str]) -> dict[str, bytes]:
    """Fetch `ref` of `url` (depth 1) into a bare scratch repository; the wanted blobs, bounded."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if _git("init", "-q", "--bare", str(work)).returncode:
        raise UpstreamError(f"{work}: git init failed")
    proc = _git("fetch", "-q", "--depth", "1", url, ref, cwd=work)
    if proc.returncode:
        last = (proc.stderr.decode("utf-8", "replace").strip().splitlines() or ["git fetch failed"])[-1]
        raise UpstreamError(f"aiter {ref} from {url}: cannot fetch ({last})")
    out = {}
    for rel in wanted:
        size = _git("cat-file", "-s", f"FETCH_HEAD:{rel}", cwd=work)
        if size.returncode:
            continue
        if int(size.stdout or 0) > MAX_SOURCE_CHARS:
            raise _too_large(f"{url}@{ref}:{rel}", int(size.stdout))
        out[rel] = _git("cat-file", "blob", f"FETCH_HEAD:{rel}", cwd=work).stdout
    commit = _git("rev-parse", "FETCH_HEAD", cwd=work).stdout.decode().strip()
    shutil.rmtree(work, ignore_errors=True)
    out[".commit"] = commit.encode()
    return out


def _from_archive(path: Path, wanted: list[str]) -> dict[str, bytes]:
    """The wanted files of a .zip / .tar.gz of an aiter checkout (one top folder allowed)."""
    import tarfile
    out: dict[str, bytes] = {}

    def rel_of(name: str) -> Optional[str]:
        while name.startswith("./"):        # a prefix, not characters: ".x/..." keeps its dot
            name = name[2:]
        name = name.lstrip("/")
        if name in wanted:
            return name
        tail = name.split("/", 1)[1] if "/" in name else ""
        return tail if tail in wanted else None

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    rel = rel_of(info.filename)
                    if rel:
                        text = _zip_text(z, info.filename, str(path))
                        if text is not None:
                            out[rel] = text.encode("utf-8")
        else:
            with tarfile.open(path) as t:
                for m in t:
                    rel = rel_of(m.name)
                    if rel and m.isfile():
                        if m.size > MAX_SOURCE_CHARS:
                            raise _too_large(f"{path}:{m.name}", m.size)
                        f = t.extractfile(m)
                        out[rel] = f.read(MAX_SOURCE_CHARS + 1) if f else b""
    except (OSError, zipfile.BadZipFile, tarfile.TarError, EOFError) as e:
        raise UpstreamError(f"{path}: not a readable archive ({e})") from None
    return out


def fetch_aiter(ref: str, console, *, url: str = upstream.AITER_GIT) -> Path:
    """The table's aiter files at `ref` (a commit, tag or branch of `url`, or an archive
    file) in the cache, aiter-<ref>/, with their sha256 recorded."""
    archive = Path(ref).expanduser()
    if archive.is_file():
        name = re.sub(r"(\.tar\.gz|\.tgz|\.tar|\.zip)$", "", archive.name)
        files, what = _from_archive(archive, aiter_wanted()), {"archive": str(archive)}
    else:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}", ref) or ".." in ref:
            raise UpstreamError(f"--aiter {ref}: not a git ref or an archive file")
        name = ref.replace("/", "-")
        console.print(f"aiter {ref}: fetching from {url}")
        files = _from_git(url, ref, upstream.cache_root() / ".aiter-git", aiter_wanted())
        what = {"git": url, "ref": ref, "commit": files.pop(".commit").decode()}
    if not any(rel.startswith("aiter/") for rel in files):
        raise UpstreamError(f"aiter {ref}: none of the table's files are there (is it an aiter tree?)")
    root = upstream.cache_root() / f"aiter-{name}"
    files.setdefault("aiter/__init__.py", b"")
    for rel, data in files.items():
        _safe_write(root, rel, data)
    missing = [r for r in aiter_wanted() if r not in files and not r.endswith(("__init__.py", "_version.py"))]
    console.print(f"aiter {ref}: {len(files)} files in {root}"
                  + (f" ({len(missing)} the table names are not there: {', '.join(missing)})" if missing else ""))
    _record(root, "aiter", files, what, console)
    return root


# --- the command ------------------------------------------------------------------------

def apply_tree_args(args) -> None:
    """Hand the named trees to the backends (through the environment, so -j workers see them)."""
    from optimized.vllm_kernels import source
    aiter = getattr(args, "aiter", None)
    if aiter is not None:
        if not Path(aiter).expanduser().is_dir():
            raise UpstreamError(f"--aiter {aiter}: no such directory")
        os.environ[source.ENVS["aiter"]] = str(Path(aiter).expanduser().resolve())
    if getattr(args, "trust_upstream", False):
        if not any(os.environ.get(v) for v in source.ENVS.values()):
            raise UpstreamError("--trust-upstream: name the tree it applies to (--aiter DIR, $MXVAL_AITER_SRC "
                                "or $MXVAL_VLLM_SRC); fetched and installed sources are never trusted blind")
        os.environ[source.TRUST_ENV] = "1"


def add_parser(sub) -> None:
    p = sub.add_parser(COMMAND, help="fetch upstream sources and check the adapters' targets against them")
    s = p.add_subparsers(dest="upstream_cmd", required=True, parser_class=type(p))
    f = s.add_parser("fetch", help="pip-download vLLM's wheel (no deps) and extract the files the table names; "
                                   "--aiter: a pinned aiter ref from git or an archive")
    f.add_argument("--vllm", default=None, metavar="VERSION",
                   help="vLLM release (default: the newest on the package index; the table knows "
                        f"{', '.join(upstream.known_releases('vllm'))})")
    f.add_argument("--aiter", nargs="?", const=upstream.AITER_REF, default=None, metavar="REF",
                   help=f"fetch aiter instead: a git ref (default {upstream.AITER_REF[:12]}) or an archive file")
    f.add_argument("--aiter-url", default=upstream.AITER_GIT, metavar="URL",
                   help=f"the aiter git repository (default {upstream.AITER_GIT})")
    c = s.add_parser("check", help="parse every upstream target with ast and compare it with the table "
                                   "(nothing is imported or run)")
    c.add_argument("--vllm", default=None, metavar="DIR|WHEEL|VERSION",
                   help="vLLM sources: a directory, a wheel, or a fetched version (default: the newest "
                        "fetched one)")
    c.add_argument("--aiter", default=None, metavar="DIR", help="an aiter checkout (not checked without it)")


def _console():
    from harness.io.console import rich_console
    return rich_console(stderr=False, highlight=False)


def _newest_fetched() -> Optional[str]:
    """The newest vLLM release with a tree in the cache (what `fetch` last brought, usually)."""
    root = upstream.cache_root()
    have = [d.name[len("vllm-"):] for d in root.glob("vllm-*") if (d / "vllm").is_dir()] if root.is_dir() else []
    have = [v for v in have if upstream.VERSION_RE.fullmatch(v)]
    return max(have, key=upstream.version_key) if have else None


def resolve_vllm(arg: Optional[str]) -> Source:
    if arg is not None and (os.path.sep in arg or os.path.exists(arg) or arg.endswith(".whl")):
        return open_source("vllm", arg)
    version = arg or _newest_fetched() or upstream.newest("vllm")
    root = tree_dir(version)
    if not (root / "vllm").is_dir():
        raise UpstreamError(f"vllm {version}: not fetched ({root} is missing); run "
                            f"`mxval upstream fetch --vllm {version}` or pass --vllm DIR|WHEEL")
    return DirSource("vllm", root)


def run(args) -> int:
    console = _console()
    if args.upstream_cmd == "fetch":
        if args.aiter is not None:
            fetch_aiter(args.aiter, console, url=args.aiter_url)
            return EXIT_OK
        fetch(args.vllm or newest_release(console), console)
        return EXIT_OK
    sources = {"vllm": resolve_vllm(args.vllm)}
    if args.aiter:
        sources["aiter"] = open_source("aiter", args.aiter)
    results = check(sources)
    render(results, sources, console)
    return exit_status(results)
