"""The upstream functions and kernels mxval calls or wraps, in one table.

The aiter and vLLM adapters (`optimized.aiter_backend`, `optimized.vllm_backend`), the
capture hook (`harness.capture`) and `mxval upstream check` all read this table; no other
module names an upstream module path. When aiter or vLLM moves or changes a function,
the fix is an entry here, and `mxval upstream check` says which entry drifted.

Entry fields:

* key: mxval's stable name, `<package>.<area>.<op>` (for instance "aiter.k_writer",
  "vllm.rocm.compress_pool"). A key names one calling convention: where a parameter list
  changed between versions, the older one gets its own key with an `@<version>` suffix.
* module, name: where the newest release it is known for defines it; alt_modules: older
  module paths with the same parameters (tried after `module`, in order).
* kind: "function", "triton_jit" (a `@triton.jit` kernel, launched `kernel[grid](...)`;
  its parameters include the constexprs), "class" or "method" (`Class.method` in `name`).
* params: the parameters mxval binds, in the upstream order. A "*" marks where the
  keyword-only ones start. Upstream may have more parameters after them, with defaults.
* returns: the return convention. Its first clause is compared by the checker with the
  return annotation, or, without one, with the shape of the return statements ("None",
  "N-tuple", "value"). Further clauses, separated by "; ", are expressions that must
  occur in the function's body (how a convention that no annotation states is pinned,
  e.g. a scale returned as int32).
* versions: the upstream versions the entry was read from: "vllm==0.33.0",
  "vllm@8e4f5df9" (the vLLM change the DeepSeek-V4 ROCm path first landed in),
  "aiter:cu_ends" / "aiter:row_ends" (the two API generations of aiter's paged MXFP4
  scorer; "aiter" where both agree).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    key: str                 # stable mxval name, e.g. "aiter.k_writer", "vllm.rocm.compress_pool"
    package: str             # "vllm" | "aiter"
    module: str              # dotted module path in the newest release it is known for
    name: str                # function / Triton kernel / class name
    kind: str                # "function" | "triton_jit" | "class" | "method"
    params: tuple[str, ...]  # the parameters mxval binds, in order
    returns: str             # return convention (text that the checker can compare where possible)
    versions: tuple[str, ...]          # e.g. ("vllm==0.33.0",), ("aiter:row_ends",)
    alt_modules: tuple[str, ...] = ()  # older layouts, e.g. the vLLM 8e4f5df9 module path

    @property
    def modules(self) -> tuple[str, ...]:
        return (self.module, *self.alt_modules)

    @property
    def spec(self) -> str:
        """"module:name" as the importers take it."""
        return f"{self.module}:{self.name}"

    def bound_params(self) -> tuple[str, ...]:
        """params without the "*" marker."""
        return tuple(p for p in self.params if p != "*")


KINDS = ("function", "triton_jit", "class", "method")
PACKAGES = ("vllm", "aiter")

VLLM_033 = "vllm==0.33.0"
VLLM_8E4F = "vllm@8e4f5df9"
AITER_CU_ENDS = "aiter:cu_ends"
AITER_ROW_ENDS = "aiter:row_ends"

_VLLM_OPS = "vllm.v1.attention.ops.rocm_paged_mxfp4_indexer"
_VLLM_ROCM = "vllm.models.deepseek_v4.amd.rocm"
_VLLM_ROCM_8E4F = "vllm.models.deepseek_v4.amd.mxfp4_indexer"

_POOL_KERNEL_HEAD = ("state_cache_ptr", "state_cache_stride0", "state_cache_stride1",
                     "token_to_req_indices_ptr", "positions_ptr", "kv_slot_mapping_ptr",
                     "block_table_ptr", "block_table_stride", "block_size")
_POOL_KERNEL_TAIL = ("HEAD_SIZE", "STATE_WIDTH", "COMPRESS_RATIO", "OVERLAP")


# --- vLLM's DeepSeek-V4 ROCm indexer (the vLLM adapter and the capture hook) ---------------

VLLM_ROCM: tuple[Target, ...] = (
    # 0.33.0 launches the pooling kernel only through this dispatcher (grid: pooled_k rows).
    Target("vllm.rocm.compress_pool", "vllm", _VLLM_ROCM, "compress_pool", "function",
           ("state_cache", "token_to_req_indices", "positions", "kv_slot_mapping", "block_table",
            "block_size", "pooled_k", "state_width", "compress_ratio", "overlap"),
           "DispatchSpec; (pooled_k.shape[0],)", (VLLM_033,)),
    Target("vllm.rocm.compress_pool_kernel", "vllm", _VLLM_ROCM, "_compress_pool_kernel", "triton_jit",
           _POOL_KERNEL_HEAD + ("pooled_k_ptr", "pooled_k_stride") + _POOL_KERNEL_TAIL,
           "None", (VLLM_033,)),
    # the first layout: the model file launched the kernel itself
    Target("vllm.rocm.compress_pool_kernel@8e4f5df9", "vllm", _VLLM_ROCM_8E4F, "_compress_pool_kernel",
           "triton_jit", _POOL_KERNEL_HEAD + ("out_ptr", "out_stride") + _POOL_KERNEL_TAIL,
           "None", (VLLM_8E4F,)),
    Target("vllm.ops.k_store", "vllm", _VLLM_OPS, "rocm_mxfp4_indexer_k_store", "function",
           ("k_pre", "positions", "cos_sin_cache", "rms_norm_weight", "rms_norm_eps", "k_cache",
            "kv_slot_mapping", "compress_ratio", "use_fp4_cache", "*", "num_heads"),
           "None", (VLLM_033,)),
    # the scale comes back as one int32 per head, [T, H]: its bytes are the D/32 e8m0 scales
    Target("vllm.ops.q_quant", "vllm", _VLLM_OPS, "rocm_mxfp4_indexer_q_quant", "function",
           ("positions", "index_q", "index_q_cos_sin_cache", "index_weights",
            "index_weights_softmax_scale", "index_weights_head_scale"),
           "tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]; q_scale.view(torch.int32).squeeze(-1)",
           (VLLM_033,)),
)


# --- vLLM's Triton kernels run outside vLLM (the Triton-from-upstream backend) --------------

VLLM_TRITON: tuple[Target, ...] = ()


TABLE: tuple[Target, ...] = VLLM_ROCM + VLLM_TRITON
_BY_KEY = {t.key: t for t in TABLE}


def target(key: str) -> Target:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no upstream target {key!r} (known: {', '.join(sorted(_BY_KEY))})") from None


def targets(package: str | None = None, *, kind: str | None = None) -> tuple[Target, ...]:
    return tuple(t for t in TABLE if (package is None or t.package == package)
                 and (kind is None or t.kind == kind))


def validate(table: tuple[Target, ...] = TABLE) -> list[str]:
    """Problems with the table itself (duplicate keys, unknown kinds): [] when sound."""
    errs, seen = [], set()
    for t in table:
        if t.key in seen:
            errs.append(f"{t.key}: duplicate key")
        seen.add(t.key)
        if t.package not in PACKAGES:
            errs.append(f"{t.key}: package {t.package!r} is not one of {PACKAGES}")
        if t.kind not in KINDS:
            errs.append(f"{t.key}: kind {t.kind!r} is not one of {KINDS}")
        if not t.module.startswith(t.package + ".") and t.module != t.package:
            errs.append(f"{t.key}: module {t.module} is not in package {t.package}")
        if not t.versions:
            errs.append(f"{t.key}: no versions")
        if t.params.count("*") > 1:
            errs.append(f"{t.key}: more than one '*' in params")
    return errs
