"""The layers, checked: every import of every module (at module level and inside functions)
goes to the module's own layer or below, and no import cycle exists.

The order, lowest first (README's tour says the same):

    reference < optimized < harness.errors < harness.diff < harness.io < harness.run
      < harness.capture < {harness.study, harness.bench} < harness.commands

`reference/` is pure torch: it imports no Triton. A module imports only from its own layer or
below; the two peers of the eighth layer do not import each other (the capture hook is below
them: the bench measures its cost).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "optimized", "harness")

# (prefix, rank): the longest matching prefix names a module's layer.
LAYERS = (
    ("reference", 0),
    ("optimized", 1),
    ("harness.errors", 2),
    ("harness.diff", 3),
    ("harness.io", 4),
    ("harness.run", 5),
    ("harness.capture", 6),
    ("harness.study", 7), ("harness.bench", 7),
    ("harness.commands", 8), ("harness.__main__", 8), ("harness", 8),
)

def layer(module: str) -> tuple[int, str]:
    """(rank, name) of the layer a module belongs to."""
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best], best


def modules(root: Path = ROOT, packages=PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """[(imported module, line)] of every import statement in the file, wherever it stands;
    `from P import x` counts as P.x when that is a module, else as P."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in known else mod, node.lineno))
    return out


def graph(mods: dict[str, Path]) -> dict[str, list[tuple[str, int]]]:
    """Edges between the project's own modules (third-party imports left out)."""
    known = set(mods)
    return {m: [(t, line) for t, line in imports(m, p, known) if t in known] for m, p in mods.items()}


def upward(g: dict, mods: dict[str, Path]) -> list[str]:
    out = []
    for m, edges in g.items():
        rank, name = layer(m)
        for t, line in edges:
            trank, tname = layer(t)
            if trank > rank or (trank == rank and tname != name and rank == 7):
                out.append(f"{m} -> {t} ({mods[m].relative_to(ROOT) if mods[m].is_relative_to(ROOT) else mods[m]}"
                           f":{line}: {name} imports {tname})")
    return out


def cycles(g: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-imports."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or any(t == v for t, _ in g.get(v, ())):
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def _pair(text: str) -> tuple[str, str]:
    a, _, rest = text.partition(" -> ")
    return a, rest.partition(" ")[0]


def test_no_upward_import_and_no_cycle():
    mods = modules()
    g = graph(mods)
    bad = upward(g, mods)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)
    assert cycles(g) == [], "import cycles"


def test_reference_imports_no_triton():
    for m, p in modules(packages=("reference",)).items():
        names = {n for n, _ in imports(m, p, set())}
        assert not {n for n in names if n == "triton" or n.startswith("triton.")}, m


def test_the_checker_sees_upward_imports_and_cycles_inside_functions(tmp_path):
    """The check has teeth: a function-local upward import and a two-module cycle, each
    written inside a function body, are both found."""
    files = {
        "harness/__init__.py": "",
        "harness/diff/__init__.py": "",
        "harness/diff/a.py": "def f():\n    from harness.run import b\n",
        "harness/run/__init__.py": "",
        "harness/run/b.py": "def g():\n    from . import c\n",
        "harness/run/c.py": "import os\n\ndef h():\n    import harness.run.b\n",
        "reference/__init__.py": "",
        "reference/x.py": "from .y import z\n",
        "reference/y.py": "z = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    mods = modules(tmp_path, ("reference", "harness"))
    g = graph(mods)
    up = upward(g, mods)
    assert [_pair(u) for u in up] == [("harness.diff.a", "harness.run.b")]
    assert cycles(g) == [["harness.run.b", "harness.run.c"]]
    assert ("reference.y", 1) in g["reference.x"]


@pytest.mark.parametrize("module,rank", [("reference.ops", 0), ("optimized.faults", 1), ("harness.errors", 2),
                                         ("harness.run.pipeline", 5), ("harness.capture.hook", 6),
                                         ("harness.bench.gpu", 7), ("harness.commands.cli", 8), ("harness", 8)])
def test_layer_of(module, rank):
    assert layer(module)[0] == rank
