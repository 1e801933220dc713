"""Function length, checked: no function in reference/, optimized/ or harness/ runs past
MAX_LINES lines, except the Triton kernels (@triton.jit bodies are one launch each: splitting
them changes what the compiler sees)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "optimized", "harness")
MAX_LINES = 80


def _is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def long_functions(source: str, where: str) -> dict[str, int]:
    """{"where:name": lines} of every function over MAX_LINES lines that is no Triton kernel."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_LINES:
                out[f"{where}:{node.name}"] = n
    return out


def _tree() -> dict[str, int]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out.update(long_functions(path.read_text(), path.relative_to(ROOT).as_posix()))
    return out


def test_no_function_is_over_the_limit():
    over = _tree()
    assert not over, f"functions over {MAX_LINES} lines (split them): {over}"


def test_the_check_finds_a_long_function_and_spares_kernels():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    src = ("import triton\n"
           f"def long():\n{body}"
           f"def short():\n{body[:-len('    x79 = 79')-1]}"
           f"@triton.jit\ndef kernel(X):\n{body}"
           f"@triton.jit(do_not_specialize=['X'])\ndef kernel2(X):\n{body}"
           f"class C:\n    def method(self):\n    {body.replace(chr(10), chr(10) + '    ')[:-4]}")
    assert long_functions(src, "m.py") == {"m.py:long": MAX_LINES + 1, "m.py:method": MAX_LINES + 1}
