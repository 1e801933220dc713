"""The vLLM kernel loader on a small synthetic vLLM tree written by the test (no download):
name resolution and its errors, parameter drift, the e2m1 emulation against an independent
table on every fp32 edge value, and the interpreter's cast patch."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from optimized import triton_kernels
from optimized.vllm_kernels import e2m1, interp_patch, launch
from optimized.vllm_kernels.loader import KernelRef, Loader, LoadError, Replacement
from optimized.vllm_kernels.source import SourceError, find_source
from reference.mxfp4 import e2m1_codes


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    """The synthetic kernels run interpreted (set when the tests run, not at collection, so
    a `-m gpu` session that collects this file keeps compiled Triton)."""
    triton_kernels._triton_for_interpreter()

A = '''\
from vllm.triton_utils import tl, triton
from .b import _imported_helper

SCALE = 3.0
UNUSED_HOST_THING = object()


@triton.jit
def _helper(x):
    return x * SCALE


def host_function(x):
    return x


@triton.jit(do_not_specialize=["n"])
def kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    for i in tl.static_range(1):
        x = _imported_helper(_helper(x))
    tl.store(y_ptr + offs, x, mask=m)


class Launcher:
    @staticmethod
    @triton.jit
    def kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)


class Other:
    @staticmethod
    @triton.jit
    def kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) - 1.0)


@triton.jit
def uses_unknown(x_ptr):
    tl.store(x_ptr, NOT_DEFINED_ANYWHERE)


@triton.jit
def uses_host(x_ptr):
    tl.store(x_ptr, host_function(1.0))


@triton.jit
def pack(x_lo, x_hi):
    return tl.inline_asm_elementwise("e2m1x2", "=r,f,f", [x_hi, x_lo], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def e2m1_kernel(lo_ptr, hi_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, pack(tl.load(lo_ptr + offs), tl.load(hi_ptr + offs)))
'''

B = '''\
from vllm.triton_utils import tl, triton

OFFSET = 0.5


@triton.jit
def _imported_helper(x):
    return x + OFFSET
'''


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "src"
    (root / "vllm" / "kern").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "_version.py").write_text("__version__ = version = '9.9.9'\n")
    (root / "vllm" / "kern" / "__init__.py").write_text("")
    (root / "vllm" / "kern" / "a.py").write_text(A)
    (root / "vllm" / "kern" / "b.py").write_text(B)
    return root


def _loader(tree, **kw):
    src = find_source(str(tree), trusted=True)          # the test's own tree, named and trusted
    return Loader(src.read, label="test", **kw)


def test_source_explicit_dir_and_version(tree, monkeypatch):
    src = find_source(str(tree))
    assert src.kind == "dir" and src.version == "9.9.9" and str(tree) in src.describe()
    monkeypatch.setenv("MXVAL_VLLM_SRC", str(tree / "vllm"))       # the package dir itself works too
    assert find_source().root == tree
    with pytest.raises(SourceError, match="no such directory"):
        find_source(str(tree / "nope"))
    with pytest.raises(SourceError, match="no module vllm.kern.zzz"):
        src.read("vllm.kern.zzz")


def test_fetched_source_missing_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.delenv("MXVAL_VLLM_SRC", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(SourceError, match="mxval upstream fetch"):
        find_source(use_installed=False, version="0.33.0")


def test_loads_kernels_helpers_constants_and_imports(tree):
    ld = _loader(tree).load([KernelRef("vllm.kern.a", "kernel"), KernelRef("vllm.kern.a", "Launcher.kernel"),
                             KernelRef("vllm.kern.a", "Other.kernel")])
    k = ld.kernels[KernelRef("vllm.kern.a", "kernel")]
    x = torch.arange(8, dtype=torch.float32)
    y = torch.zeros(8)
    k[(1,)](x, y, 6, BLOCK=8)
    assert torch.equal(y[:6], x[:6] * 3.0 + 0.5) and torch.equal(y[6:], torch.zeros(2))
    y2 = torch.zeros(8)
    ld.kernels[KernelRef("vllm.kern.a", "Launcher.kernel")][(1,)](x, y2, BLOCK=8)
    y3 = torch.zeros(8)
    ld.kernels[KernelRef("vllm.kern.a", "Other.kernel")][(1,)](x, y3, BLOCK=8)
    assert torch.equal(y2, x + 1) and torch.equal(y3, x - 1)          # two classes' `kernel`, kept apart
    assert [p.name for p in ld.params[KernelRef("vllm.kern.a", "kernel")]] == ["x_ptr", "y_ptr", "n", "BLOCK"]
    assert ld.params[KernelRef("vllm.kern.a", "kernel")][3].constexpr
    assert set(ld.files) == {"vllm.kern.a", "vllm.kern.b"}
    # nothing but the selected definitions was compiled (the host-side object is not there)
    import inspect
    assert hasattr(k, "fn"), type(k)                                   # a triton.jit function (either mode)
    assert "UNUSED_HOST_THING" not in k.fn.__globals__
    assert "tl.static_range" in inspect.getsource(k.fn)


def test_unresolved_name_is_an_error_with_its_line(tree):
    with pytest.raises(LoadError, match=r"a.py:\d+: .*NOT_DEFINED_ANYWHERE.*unresolved"):
        _loader(tree).load([KernelRef("vllm.kern.a", "uses_unknown")])


def test_a_plain_python_helper_is_an_error(tree):
    with pytest.raises(LoadError, match="host_function, which is not a @triton.jit function"):
        _loader(tree).load([KernelRef("vllm.kern.a", "uses_host")])


def test_missing_kernel_and_missing_class_member(tree):
    with pytest.raises(LoadError, match="gone is not defined"):
        _loader(tree).load([KernelRef("vllm.kern.a", "gone")])
    with pytest.raises(LoadError, match="class Launcher has no other"):
        _loader(tree).load([KernelRef("vllm.kern.a", "Launcher.other")])
    with pytest.raises(LoadError, match="host_function is not a @triton.jit kernel"):
        _loader(tree).load([KernelRef("vllm.kern.a", "host_function")])


def test_a_broken_import_chain_is_an_error(tree):
    (tree / "vllm" / "kern" / "b.py").write_text(B.replace("OFFSET = 0.5", ""))
    with pytest.raises(LoadError, match="OFFSET"):
        _loader(tree).load([KernelRef("vllm.kern.a", "kernel")])


def _replacement(params=e2m1.HELPER_PARAMS, mark=e2m1.PTX_MARK):
    return {("vllm.kern.a", "pack"): Replacement(e2m1.EMULATION_SOURCE.replace("_fp32x2_to_fp4x2", "pack"),
                                                 "e2m1 emulation", params, mark)}


def test_replacing_a_helper_that_changed_upstream_is_an_error(tree):
    with pytest.raises(LoadError, match="no longer the helper mxval replaces"):
        _loader(tree, replace=_replacement(params=("a", "b"))).load([KernelRef("vllm.kern.a", "e2m1_kernel")])
    with pytest.raises(LoadError, match="no longer the helper mxval replaces"):
        _loader(tree, replace=_replacement(mark="cvt.something.else")).load([KernelRef("vllm.kern.a", "e2m1_kernel")])


def _edge_values() -> torch.Tensor:
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.5, 7.0, 1e30, float("inf"), float("nan"),
            1e-45, 1e-39, 2.0 ** -126, 3e-38]
    t = torch.tensor(mids + vals, dtype=torch.float32)
    up = torch.nextafter(t, torch.full_like(t, float("inf")))
    dn = torch.nextafter(t, torch.full_like(t, -float("inf")))
    t = torch.cat([t, up, dn])
    t = torch.cat([t, -t, torch.tensor([-float("nan")])])
    g = torch.Generator().manual_seed(0)
    rnd = (torch.rand(4000, generator=g) * 14 - 7).float()
    return torch.cat([t, rnd])


def test_e2m1_table_agrees_with_the_reference_encoder():
    x = _edge_values()
    fin = ~torch.isnan(x)
    assert torch.equal(e2m1.e2m1_code_table(x[fin]), e2m1_codes(x[fin].clamp(-6, 6)))
    assert set(e2m1.e2m1_code_table(torch.tensor([float("nan"), -float("nan")])).tolist()) == {e2m1.NAN_CODE}


def test_e2m1_emulation_exact_on_every_edge_value(tree):
    ld = _loader(tree, replace=_replacement()).load([KernelRef("vllm.kern.a", "e2m1_kernel")])
    assert ld.replaced == ["vllm.kern.a:pack"]
    x = _edge_values()
    n = 1 << (x.numel() - 1).bit_length()
    lo = torch.zeros(n)
    lo[:x.numel()] = x
    hi = lo.flip(0).contiguous()
    out = torch.zeros(n, dtype=torch.uint8)
    ld.kernels[KernelRef("vllm.kern.a", "e2m1_kernel")][(1,)](lo, hi, out, BLOCK=n)
    want = e2m1.pack_table(lo, hi)
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(lo[i]), float(hi[i]), int(out[i]), int(want[i])) for i in bad[:5]]
    # ties to even, signed zero and saturation, spelled out
    assert e2m1.pack_table(torch.tensor([0.25, -0.0, 5.0, 7.0]), torch.tensor([0.75, 1.25, 2.5, -1e30])).tolist() == \
        [0x2 << 4 | 0x0, 0x2 << 4 | 0x8, 0x4 << 4 | 0x6, 0xF << 4 | 0x7]


def test_without_the_replacement_the_ptx_helper_cannot_run_interpreted(tree):
    ld = _loader(tree).load([KernelRef("vllm.kern.a", "e2m1_kernel")])
    z = torch.zeros(8)
    with pytest.raises(Exception, match="inline_asm"):
        ld.kernels[KernelRef("vllm.kern.a", "e2m1_kernel")][(1,)](z, z, torch.zeros(8, dtype=torch.uint8), BLOCK=8)


# --- launch: drift between the kernel's parameters and what mxval passes ---------------------

def _table_as_params(key):
    from optimized.vllm_kernels.loader import Param
    return [Param(n, "pos", False, c) for n, c in launch.table_params(key)]


@pytest.mark.parametrize("key", ["vllm.cuda.k_mxfp4", "vllm.cuda.q_mxfp4", "vllm.rocm.compress_pool_kernel"])
def test_param_drift_is_an_error(key):
    from optimized.vllm_kernels.loader import Param
    ps = _table_as_params(key)
    launch.check_kernel(key, ps)                                   # the table itself passes
    renamed = ps[:2] + [Param(ps[2].name + "_v2", "pos", False, ps[2].constexpr)] + ps[3:]
    with pytest.raises(launch.LaunchDrift, match="new upstream: .*_v2.*gone upstream"):
        launch.check_kernel(key, renamed)
    with pytest.raises(launch.LaunchDrift, match="new upstream: EXTRA"):
        launch.check_kernel(key, ps + [Param("EXTRA", "pos", False, True)])
    with pytest.raises(launch.LaunchDrift, match="reordered"):
        launch.check_kernel(key, [ps[1], ps[0], *ps[2:]])
    last = ps[-1]
    with pytest.raises(launch.LaunchDrift, match="constexpr changed"):
        launch.check_kernel(key, ps[:-1] + [Param(last.name, "pos", False, not last.constexpr)])


def test_launch_builders_bind_exactly_the_kernel_parameters():
    d, t = 128, 5
    sc = torch.zeros(4, 8, 4 * d)
    common = dict(block_table=torch.zeros(1, 4, dtype=torch.int32), positions=torch.arange(t),
                  req_index=torch.zeros(t, dtype=torch.int64), kv_slot_mapping=torch.arange(t))
    for fmt in ("mxfp4", "fp8"):
        grid, kw, opts = launch.fused_k(fmt, state_cache=sc, cos_sin_cache=torch.zeros(8, 64), norm_weight=torch.ones(d),
                                        norm_eps=1e-6, kv_cache=torch.zeros(2, 5000, dtype=torch.uint8), page_size=32,
                                        compress_ratio=4, **common)
        assert grid == (t,) and opts == {"num_warps": 1} and kw["OVERLAP"] and kw["STATE_WIDTH"] == 2 * d
        assert (kw["QUANT_BLOCK"], kw["TOKEN_STRIDE"], kw["SCALE_DIM"]) == ((32, 64, 4) if fmt == "mxfp4" else (128, 128, 4))
        assert kw["KV_BLOCK_STRIDE"] == 5000 and kw["kv_cache_block_size"] == 32
    with pytest.raises(launch.LaunchDrift, match="misses"):
        launch.check_args("vllm.cuda.k_mxfp4", {"state_cache_ptr": 0})


# --- the interpreter patch -------------------------------------------------------------------

def test_interp_patch_rounds_like_the_gpu_where_the_interpreter_does_not():
    import triton.language as tl
    from triton.runtime import interpreter as interp
    orig = interp._convert_float
    with interp_patch.active():
        _check_casts(interp, orig, tl)
    assert interp._convert_float is orig                  # restored after the block


def _check_casts(interp, orig, tl):
    # fp32 -> bf16: a value just above a tie rounds up; the interpreter's own routine truncates
    x = np.array([1.0 + 2 ** -8 + 2 ** -20, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8 + 2 ** -20), 1e-39],
                 dtype=np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = interp._convert_float(x, tl.float32, tl.bfloat16, None)
    assert np.array_equal(got.view(np.uint16), want)
    assert not np.array_equal(orig(x, tl.float32, tl.bfloat16, None).view(np.uint16), want)
    # fp32 -> e4m3fn, round to nearest even and saturating like cvt.rn.satfinite
    y = np.array([17.0, 18.0, 19.0, 500.0, -1e9, 0.0137, -0.0], dtype=np.float32)
    f8 = interp._convert_float(y, tl.float32, tl.float8e4nv, None)
    w8 = torch.from_numpy(y).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(f8.view(np.uint8), w8)
    # bf16 subnormal widened exactly
    b = torch.tensor([1e-39, -3e-40], dtype=torch.bfloat16)
    wide = interp._convert_float(b.view(torch.int16).numpy().view(np.uint16), tl.bfloat16, tl.float32, None)
    assert np.array_equal(wide.view(np.float32), b.float().numpy())


def test_interp_patch_keeps_the_sign_of_an_all_negative_zero_sum(tree):
    (tree / "vllm" / "kern" / "c.py").write_text(textwrap.dedent('''\
        from vllm.triton_utils import tl, triton


        @triton.jit
        def colsum(x_ptr, y_ptr, R: tl.constexpr, C: tl.constexpr):
            r = tl.arange(0, R)
            c = tl.arange(0, C)
            x = tl.load(x_ptr + r[:, None] * C + c[None, :])
            tl.store(y_ptr + c, tl.sum(x, axis=0))
        '''))
    k = _loader(tree).load([KernelRef("vllm.kern.c", "colsum")]).kernels[KernelRef("vllm.kern.c", "colsum")]
    x = torch.tensor([[-0.0, -0.0, 1.0, -0.0], [-0.0, 0.0, -1.0, -0.0]])
    y = torch.ones(4)
    k[(1,)](x, y, R=2, C=4)
    assert torch.signbit(y).tolist() == [False] * 4                # the interpreter as it is: +0.0
    with interp_patch.active():
        k[(1,)](x, y, R=2, C=4)
    assert torch.signbit(y).tolist() == [True, False, False, True] and torch.equal(y, torch.zeros(4))


# --- what a backend cannot do is skipped with its reason -------------------------------------

def test_the_runner_skips_a_case_the_backend_cannot_do():
    import reference
    from harness.run.cases import Catalog
    from harness.run.runner import run_case
    from optimized import Backend, register

    def limits(op, scalars):
        return "no FP8 here" if "fp8_dtype" in scalars else None

    register("test-limited", lambda: Backend("test-limited", "reference with a limit", dict(reference.FUNCTIONS),
                                             limits=limits))
    cat = Catalog()
    row = run_case(cat.case("smoke-fp8"), "test-limited")
    assert row["outcome"] == "skipped" and row["reason"] == "backend test-limited: no FP8 here"
    row = run_case(cat.case("smoke-inf-q"), "test-limited")          # an MXFP4 case runs
    assert row["outcome"] == "nonfinite_input"
