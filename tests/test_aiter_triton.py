"""The aiter-triton backends' source loading on a small synthetic tree shaped like aiter's
(tests/fake_upstream.py AITER_TREE; no aiter code): wrappers loaded as host functions, the
import forms aiter's kernels use, the logger and repr= replacements, the interpreter's
`not <tensor>`, the sha256 pins, and nothing upstream run before an op is called."""
from __future__ import annotations

import fake_upstream as F
import pytest
import torch

from optimized import triton_kernels, upstream
from optimized.vllm_kernels import aiter_set as A
from optimized.vllm_kernels import interp_patch
from optimized.vllm_kernels.kernelset import KernelSetError
from optimized.vllm_kernels.loader import KernelRef, Loader, LoadError
from optimized.vllm_kernels.source import find_source


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    triton_kernels._triton_for_interpreter()


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("MXVAL_AITER_SRC", raising=False)
    monkeypatch.delenv("MXVAL_TRUST_UPSTREAM", raising=False)
    A._CACHE.clear()
    yield
    A._CACHE.clear()


@pytest.fixture
def tree(tmp_path):
    return F.write_aiter_tree(tmp_path / "aiter-src")


def _set(tree, **kw):
    return A.aiter_set(interpreted=True, path=str(tree), **kw)


def test_loads_the_wrappers_and_runs_them_interpreted(tree):
    s = _set(tree, trusted=True)
    k = torch.tensor([[1.0, -2.0, 0.0, 3.0], [-1.0, -1.0, 5.0, -0.5]])
    pool = torch.full((3, 4), 9, dtype=torch.uint8)
    with interp_patch.active():
        s.wrappers[A.K_KEY](k, None, None, None, 1e-6, pool, torch.tensor([2, -1]), 1, None)
        q_out, _, w = s.wrappers[A.Q_KEY](k, None, None, "w", 1.0)
    assert pool.tolist() == [[9] * 4, [9] * 4, [0, 1, 1, 0]]          # row 2 written, slot -1 skipped
    assert q_out.tolist() == [[0, 1, 1, 0], [1, 1, 0, 1]] and w == "w"
    assert "aiter tree" in s.note() and "interpreter" in s.note()


def test_not_on_a_tensor_is_element_wise_only_with_the_patch(tree):
    """The interpreter evaluates `not mask` as one Python bool; the patch makes it element-wise
    (for upstream-loaded functions only, while active)."""
    s = _set(tree, trusted=True)
    q = torch.tensor([[1.0, -2.0, 0.0, 3.0]])
    wrong, _, _ = s.wrappers[A.Q_KEY](q, None, None)
    with interp_patch.active():
        right, _, _ = s.wrappers[A.Q_KEY](q, None, None)
    assert right.tolist() == [[0, 1, 1, 0]] and wrong.tolist() != right.tolist()


def test_the_import_forms_aiters_kernels_use(tree):
    """`import triton.language as tl`, is_hip_cdna4 from triton.language.target_info, a module
    constant made by make_kernel_repr in `@triton.jit(repr=...)`; torch only in a launcher."""
    ld = Loader(find_source(str(tree), package="aiter", trusted=True).read, label="t", replace=A.replacements())
    ref = KernelRef(upstream.target(A.K_KEY).module, upstream.target(A.K_KEY).name, host=True)
    ld.resolve([ref])
    assert sorted(ld.replaced) == ["aiter.ops.triton.utils._triton.kernel_repr:make_kernel_repr",
                                   "aiter.ops.triton.utils.logger:AiterTritonLogger"]
    bad = F.write_aiter_tree(tree.parent / "bad", {"aiter/ops/triton/_triton_kernels/quant/quant.py":
                             F.AITER_TREE["aiter/ops/triton/_triton_kernels/quant/quant.py"]
                             .replace("import triton\n", "import triton\nimport torch\n")
                             .replace("positive = x > 0", "positive = torch.zeros(1)")})
    with pytest.raises(LoadError, match="uses module 'torch'; only triton / tl may be used by a kernel"):
        Loader(find_source(str(bad), package="aiter", trusted=True).read, replace=A.replacements()).resolve([ref])
    with pytest.raises(LoadError, match="is a @triton.jit kernel, not a launcher"):
        Loader(find_source(str(tree), package="aiter", trusted=True).read, replace=A.replacements()).resolve(
            [KernelRef("aiter.ops.triton._triton_kernels.rope.q_rope_mxfp4_quant", "_q_kernel", host=True)])


def test_a_changed_logger_or_repr_helper_is_an_error(tree):
    F.write_aiter_tree(tree, {"aiter/ops/triton/utils/_triton/kernel_repr.py":
                              "def make_kernel_repr(base_name, keys):\n    return base_name\n"})
    with pytest.raises(KernelSetError, match="make_kernel_repr is no longer the function mxval replaces"):
        _set(tree, trusted=True)


def test_an_unpinned_tree_is_refused_unless_named_trusted(tree, monkeypatch):
    with pytest.raises(KernelSetError, match=r"refused: its sha256 .* is not the one pinned for aiter@dsv4-mxfp4.*--trust-upstream"):
        _set(tree)
    monkeypatch.setitem(upstream.PINS, "aiter@test", F.aiter_pins(tree))
    assert _set(tree).source.trusted is False                     # every file pinned: loads
    A._CACHE.clear()
    f = tree / "aiter/ops/triton/_triton_kernels/quant/quant.py"
    f.write_text(f.read_text().replace("1e30", "1e29"))           # one byte changed
    with pytest.raises(KernelSetError, match=r"quant\.py: refused: its sha256 .* is not the one pinned for "
                                             r"aiter@dsv4-mxfp4, aiter@test"):
        _set(tree)
    assert _set(tree, trusted=True).source.trusted                # named and trusted: read anyway


def test_building_the_backend_runs_nothing_from_the_tree(tree, tmp_path, monkeypatch, capsys):
    """`mxval backends` and building the backend parse and resolve only; the tree's module
    text (here a repr= argument that writes a file) runs when an op first launches."""
    marker = tmp_path / "ran"
    F.write_aiter_tree(tree, {"aiter/ops/triton/_triton_kernels/rope/q_rope_mxfp4_quant.py":
                              F.AITER_TREE["aiter/ops/triton/_triton_kernels/rope/q_rope_mxfp4_quant.py"]
                              .replace("@triton.jit\n", f"@triton.jit(repr=open({str(marker)!r}, 'w').close())\n")})
    monkeypatch.setenv("MXVAL_AITER_SRC", str(tree))
    monkeypatch.setenv("MXVAL_TRUST_UPSTREAM", "1")
    from harness.commands.cli import main
    from optimized import get_backend
    assert main(["backends", "--check"]) == 0
    assert "aiter-triton-interpret" in capsys.readouterr().out
    be = get_backend("aiter-triton-interpret")
    assert not marker.exists()
    with interp_patch.active():
        A.aiter_set(interpreted=True).wrappers[A.Q_KEY](torch.ones(1, 4), None, None)
    assert be.available() is None and marker.exists()


def test_the_backend_says_how_to_get_a_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from optimized import get_backend
    be = get_backend("aiter-triton-interpret", require=False)
    assert "mxval upstream fetch --aiter" in be.available()
    assert "Gluon" in be.description and "HIP" in be.description


@pytest.mark.parametrize("page_size,ok", [(32, True), (64, True), (128, True), (96, False), (160, False)])
def test_preshuffled_pages_follow_aiters_cache_format(page_size, ok):
    """A preshuffled page must be a whole number of BLOCK_KV = min(64, page) entries (aiter's
    cache_format, which vLLM calls); natural pages take any size."""
    from reference import layout
    if ok:
        layout.check_layout(page_size, 128, layout.Shuffle(32, 16, 2))
    else:
        with pytest.raises(ValueError, match=r"not a multiple of aiter's BLOCK_KV = min\(64, page_size\) = 64"):
            layout.check_layout(page_size, 128, layout.Shuffle(32, 16, 2))
    layout.check_layout(page_size, 128, None)
    if not ok:                                                    # the fake applies aiter's rule too
        with pytest.raises(ValueError, match="BLOCK_KV"):
            F.cache_format(64, 128, page_size)
