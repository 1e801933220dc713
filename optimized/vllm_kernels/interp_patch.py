"""What the Triton interpreter needs to run vLLM's kernels unmodified.

mxval's own kernels avoid the interpreter's faulty casts (optimized/triton_kernels/interp.py);
vLLM's kernels use them: `x.to(tl.bfloat16).to(tl.float32)` (the bf16 round trips),
`.to(tl.float8e4nv)` (the FP8 writers), bf16 loads widened to fp32. The interpreter
(triton 3.6 / 3.7) converts floats with its own bit routine `_convert_float`, which
truncates fp32 -> bf16 (no round to nearest even), mangles bf16 subnormals and gets ~2% of
fp32 -> fp8 conversions wrong; `tl.sum` of all -0.0 terms gives +0.0 (numpy's sum starts
from +0.0). `active()` replaces that routine, for the float pairs
below, by torch's conversions (IEEE round to nearest even; fp8 e4m3fn saturating to +-448
for finite inputs, as the GPU's cvt.rn.satfinite does), and leaves every other pair to the
original, and makes `tl.sum` keep the sign of an all -0.0 sum. inline_asm (the e2m1 helper) is replaced by the loader, not here.

`not <tensor>`: compiled Triton negates a tensor element by element (`tensor.__not__`); the
interpreter runs the kernel as Python, where `not` asks the tensor for one truth value, so a
mask comes out as one Python bool (aiter's `_mxfp4_pack_bits` writes
`(not saturate_mask) & ...`: every nibble off by +-6). While `active()` is in force, the
interpreter's source rewriter also turns `not X` into mxval's `_mxval_not(X)` (element-wise
for a tensor, Python's `not` otherwise), for functions the upstream loader compiled only
(their module name starts with loader.NS_PREFIX).

The patch is scoped: `active()` puts it in for the duration of a block (the vLLM backends
launch their kernels inside it) and restores the interpreter afterwards; it only changes
the interpreter (compiled kernels never call it).
"""
from __future__ import annotations

import ast
import contextlib

import numpy as np
import torch

_STATE: dict = {}


def _torch_dtype(tt) -> "torch.dtype | None":
    import triton.language as tl
    return {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
            tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
            tl.float8e4b8: torch.float8_e4m3fnuz}.get(tt)


_INT_VIEW = {32: torch.int32, 16: torch.int16, 8: torch.uint8}
_NP_UINT = {32: np.uint32, 16: np.uint16, 8: np.uint8}
_SAT = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0, torch.float8_e5m2: 57344.0}


def convert(data: np.ndarray, src, dst) -> "np.ndarray | None":
    """Exact conversion of the raw bits `data` (numpy, the interpreter's storage) from triton
    float type `src` to `dst`; None for a pair this module does not handle."""
    ts, td = _torch_dtype(src), _torch_dtype(dst)
    if ts is None or td is None or ts == td:
        return None
    sb, db = src.primitive_bitwidth, dst.primitive_bitwidth
    raw = np.ascontiguousarray(data).view(_NP_UINT[sb])
    t = torch.from_numpy(raw.astype(np.int64)).to(_INT_VIEW[sb]).view(ts) if sb != 8 else \
        torch.from_numpy(raw.copy()).view(ts)
    x = t.to(torch.float32) if ts != torch.float32 else t
    if td in _SAT:
        m = _SAT[td]
        x = torch.where(torch.isfinite(x), x.clamp(-m, m), x)
    y = x.to(td).contiguous()
    out = y.view(_INT_VIEW[db]).numpy()
    return out.view(_NP_UINT[db]).reshape(data.shape)


NOT_HELPER = "_mxval_not"


def _not(x):
    """`not x` as compiled Triton evaluates it: element-wise for a tensor."""
    import triton.language as tl
    from triton.runtime import interpreter as interp
    if isinstance(x, tl.core.tensor):
        return interp.interpreter_semantic.not_(x)
    return not x


class _NotToCall(ast.NodeTransformer):
    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            return ast.copy_location(ast.Call(func=ast.Name(id=NOT_HELPER, ctx=ast.Load()),
                                              args=[node.operand], keywords=[]), node)
        return node


def _rewriter_patch(interp):
    from .loader import NS_PREFIX
    orig = interp.FunctionRewriter._transform_ast

    def _transform_ast(self, src):
        tree = orig(self, src)
        g = getattr(self.fn, "__globals__", {})
        if str(g.get("__name__", "")).startswith(NS_PREFIX + "."):
            g[NOT_HELPER] = _not
            tree = ast.fix_missing_locations(_NotToCall().visit(tree))
        return tree
    return orig, _transform_ast


def _forget_upstream_rewrites(interp) -> None:
    """Drop the interpreter's cached source rewrites of upstream-loaded functions, so the next
    launch rewrites them with (or, after the block, without) the `not` transform."""
    from .loader import NS_PREFIX
    cache = interp.InterpretedFunction.rewritten_fn
    for fn in [f for f in cache if str(getattr(f, "__globals__", {}).get("__name__", "")).startswith(NS_PREFIX + ".")]:
        del cache[fn]


def _patched():
    from triton.runtime import interpreter as interp
    orig, orig_sum = interp._convert_float, interp.ReduceOps.sum

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        rtz = rounding_mode is not None and "RTZ" in str(rounding_mode)
        if not rtz:
            out = convert(np.asarray(input), input_dtype, output_dtype)
            if out is not None:
                return out
        return orig(input, input_dtype, output_dtype, rounding_mode)

    # tl.sum: the interpreter calls np.sum, which starts from +0.0, so a sum whose terms
    # are all -0.0 comes out +0.0; IEEE addition (and the GPU's reduction, which starts
    # from the first term) gives -0.0 (vLLM's pooling of an all -0.0 window).
    def _sum(self, input):
        out = orig_sum(self, input)
        data = input.handle.data
        if data.dtype.kind == "f" and data.size:
            neg0 = np.all((data == 0) & np.signbit(data), axis=self.axis, keepdims=self.keep_dims)
            if np.any(neg0):
                res = np.where(neg0, np.array(-0.0, dtype=out.handle.data.dtype), out.handle.data)
                out = self.to_tensor(np.asarray(res, dtype=out.handle.data.dtype), input.dtype)
        return out

    return interp, (orig, orig_sum), (_convert_float, _sum)


@contextlib.contextmanager
def active():
    """The patch, in force while the block runs (vLLM's kernels are launched inside it;
    mxval's own interpreter kernels, which work around the faults themselves, and their
    tests see the interpreter as it is)."""
    interp, (orig, orig_sum), (conv, sm) = _patched()
    if _STATE.get("depth", 0):
        yield
        return
    orig_rw, rw = _rewriter_patch(interp)
    interp._convert_float, interp.ReduceOps.sum = conv, sm
    interp.FunctionRewriter._transform_ast = rw
    _forget_upstream_rewrites(interp)
    _STATE["depth"] = 1
    try:
        yield
    finally:
        interp._convert_float, interp.ReduceOps.sum = orig, orig_sum
        interp.FunctionRewriter._transform_ast = orig_rw
        _forget_upstream_rewrites(interp)
        _STATE["depth"] = 0


def installed() -> bool:
    return bool(_STATE.get("depth"))
