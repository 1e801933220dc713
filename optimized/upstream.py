"""The upstream functions and kernels mxval calls or wraps, in one table.

The aiter and vLLM adapters (`optimized.aiter_backend`, `optimized.vllm_backend`), the
capture hook (`harness.capture`) and `mxval upstream check` all read this table; no other
module names an upstream module path. When aiter or vLLM moves or changes a function,
the fix is an entry here, and `mxval upstream check` says which entry drifted.

Entry fields:

* key: mxval's stable name, `<package>.<area>.<op>` (for instance "aiter.k_writer",
  "vllm.rocm.compress_pool"). A key names one calling convention. Where another version
  reaches the same op differently (other parameters, another module, a kernel instead of
  a dispatcher), that one is an alternative keyed `<key>@<version>`: the adapters and the
  hook take the first of a group that is present, and `mxval upstream check` passes a
  group when one of its entries binds.
* module, name: where the newest release it is known for defines it; alt_modules: older
  module paths with the same parameters (tried after `module`, in order).
* kind: "function", "triton_jit" (a `@triton.jit` kernel, launched `kernel[grid](...)`),
  "class" or "method" (`Class.method` in `name`).
* params: the parameters mxval binds, in the upstream order. A "*" marks where the ones
  passed by keyword start (the upstream may take them positionally too); after them the
  upstream may have more parameters, with defaults. A Triton kernel lists all of them,
  constexprs marked "NAME:constexpr".
* returns: the return convention. Its first clause is compared by the checker with the
  return annotation, or, without one, with the shape of the return statements ("None",
  "N-tuple", "value"). Further clauses, separated by "; ", are expressions that must
  occur in the function's body: how a convention that no annotation states is pinned
  (a scale returned as int32, the rule that picks a kernel).
* versions: the upstream versions the entry was read from: "vllm==0.33.0",
  "vllm@8e4f5df9" (the vLLM change the DeepSeek-V4 ROCm path first landed in),
  "aiter:cu_ends" / "aiter:row_ends" (the two API generations of aiter's paged MXFP4
  scorer; the ops that did not change list both).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


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

    @property
    def group(self) -> str:
        """The key this entry is an alternative of (itself when it has no "@")."""
        return self.key.split("@", 1)[0]

    def bound_params(self) -> tuple[str, ...]:
        """The parameter names, without the "*" marker and the constexpr marks."""
        return tuple(p.split(":", 1)[0] for p in self.params if p != "*")

    def positional(self) -> tuple[str, ...]:
        """The names passed by position (before "*")."""
        names = self.params[:self.params.index("*")] if "*" in self.params else self.params
        return tuple(p.split(":", 1)[0] for p in names)

    def keyword(self) -> tuple[str, ...]:
        """The names passed by keyword (after "*")."""
        return self.params[self.params.index("*") + 1:] if "*" in self.params else ()

    def constexprs(self) -> tuple[str, ...]:
        return tuple(p.split(":", 1)[0] for p in self.params if p.endswith(":constexpr"))


KINDS = ("function", "triton_jit", "class", "method")
PACKAGES = ("vllm", "aiter")

VLLM_033 = "vllm==0.33.0"
VLLM_034 = "vllm==0.34.0"
VLLM_8E4F = "vllm@8e4f5df9"
AITER_CU_ENDS = "aiter:cu_ends"
AITER_ROW_ENDS = "aiter:row_ends"

_VLLM_OPS = "vllm.v1.attention.ops.rocm_paged_mxfp4_indexer"
_VLLM_ROCM = "vllm.models.deepseek_v4.amd.rocm"
_VLLM_ROCM_8E4F = "vllm.models.deepseek_v4.amd.mxfp4_indexer"

_POOL_KERNEL_HEAD = ("state_cache_ptr", "state_cache_stride0", "state_cache_stride1",
                     "token_to_req_indices_ptr", "positions_ptr", "kv_slot_mapping_ptr",
                     "block_table_ptr", "block_table_stride", "block_size")
_POOL_KERNEL_TAIL = ("HEAD_SIZE:constexpr", "STATE_WIDTH:constexpr", "COMPRESS_RATIO:constexpr",
                     "OVERLAP:constexpr")


# --- vLLM's DeepSeek-V4 ROCm indexer (the vLLM adapter and the capture hook) ---------------

VLLM_ROCM: tuple[Target, ...] = (
    # 0.33.0 launches the pooling kernel only through this dispatcher (a callable object with
    # register_warmup, kernel, ...): one program per pooled_k row, constexprs from its args.
    Target("vllm.rocm.compress_pool", "vllm", _VLLM_ROCM, "compress_pool", "function",
           ("state_cache", "token_to_req_indices", "positions", "kv_slot_mapping", "block_table",
            "block_size", "pooled_k", "state_width", "compress_ratio", "overlap"),
           "DispatchSpec; (pooled_k.shape[0],); HEAD_SIZE=pooled_k.shape[1]; STATE_WIDTH=state_width; "
           "OVERLAP=overlap", (VLLM_033, VLLM_034)),
    # 8e4f5df9: the model file launched the kernel itself, kernel[(num_tokens,)](...)
    Target("vllm.rocm.compress_pool@8e4f5df9", "vllm", _VLLM_ROCM_8E4F, "_compress_pool_kernel",
           "triton_jit", _POOL_KERNEL_HEAD + ("out_ptr", "out_stride") + _POOL_KERNEL_TAIL,
           "None", (VLLM_8E4F,)),
    Target("vllm.rocm.compress_pool_kernel", "vllm", _VLLM_ROCM, "_compress_pool_kernel", "triton_jit",
           _POOL_KERNEL_HEAD + ("pooled_k_ptr", "pooled_k_stride") + _POOL_KERNEL_TAIL,
           "None", (VLLM_033, VLLM_034)),
    Target("vllm.rocm.compress_pool_kernel@8e4f5df9", "vllm", _VLLM_ROCM_8E4F, "_compress_pool_kernel",
           "triton_jit", _POOL_KERNEL_HEAD + ("out_ptr", "out_stride") + _POOL_KERNEL_TAIL,
           "None", (VLLM_8E4F,)),
    # 8e4f5df9's model file calls the K store and the Q quant with these same arguments.
    Target("vllm.ops.k_store", "vllm", _VLLM_OPS, "rocm_mxfp4_indexer_k_store", "function",
           ("k_pre", "positions", "cos_sin_cache", "rms_norm_weight", "rms_norm_eps", "k_cache",
            "kv_slot_mapping", "compress_ratio", "use_fp4_cache", "*", "num_heads"),
           "None", (VLLM_033, VLLM_034, VLLM_8E4F)),
    # the scale comes back as one int32 per head, [T, H]: its bytes are the D/32 e8m0 scales
    Target("vllm.ops.q_quant", "vllm", _VLLM_OPS, "rocm_mxfp4_indexer_q_quant", "function",
           ("positions", "index_q", "index_q_cos_sin_cache", "index_weights",
            "index_weights_softmax_scale", "index_weights_head_scale"),
           "tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]; q_scale.view(torch.int32).squeeze(-1)",
           (VLLM_033, VLLM_034, VLLM_8E4F)),
    # vLLM's top-k: aiter's kernel where its rule says so, else torch.ops._C's; -1 pads rows
    # shorter than k either way. 0.34.0 states the rule in _vllm_topk (the same rule) and stops
    # pre-filling -1 the decode rows vLLM's own kernel writes (that kernel pads them itself;
    # the rows aiter's kernel gets are still pre-filled): the padding is unchanged.
    Target("vllm.ops.topk", "vllm", _VLLM_OPS, "_topk", "function",
           ("logits", "lengths", "out", "k"),
           "None; width >= k and not _vllm_topk(rows, k); torch.ops._C.top_k_per_row_decode",
           (VLLM_034,)),
    Target("vllm.ops.topk@0.33.0", "vllm", _VLLM_OPS, "_topk", "function",
           ("logits", "lengths", "out", "k"),
           "None; width >= k and (k >= 2048 or rows >= 128); torch.ops._C.top_k_per_row_decode",
           (VLLM_033,)),
    # the rule itself: vLLM's kernel below 128 rows and k < 2048 (0.33.0: inline in _topk)
    Target("vllm.ops.vllm_topk", "vllm", _VLLM_OPS, "_vllm_topk", "function", ("rows", "k"),
           "bool; rows < 128 and k < 2048", (VLLM_034,)),
    Target("vllm.ops.vllm_topk@0.33.0", "vllm", _VLLM_OPS, "_topk", "function",
           ("logits", "lengths", "out", "k"),
           "None; width >= k and (k >= 2048 or rows >= 128); torch.ops._C.top_k_per_row_decode", (VLLM_033,)),
    # a functools.cache of aiter's K writer and Q quant: a hook installed after the first
    # call must clear it, or the cached originals keep running
    Target("vllm.ops.aiter_cache_ops", "vllm", _VLLM_OPS, "_aiter_indexer_cache_ops", "function",
           (), "tuple[Callable[..., None], Callable[..., tuple]]", (VLLM_033, VLLM_034)),
)


# --- aiter's ops (the aiter adapter, the scorer and top-k of the vLLM adapter, the hook) ----

_AITER_PA = "aiter.ops.triton.attention.pa_mqa_logits_mxfp4"
_SCORER_HEAD = ("q", "q_scales", "kv_cache", "weights", "context_lens", "block_table", "max_model_len",
                "*", "out_logits", "clean_logits", "preshuffle")
_SCORER_RETURNS = "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"

AITER: tuple[Target, ...] = (
    Target("aiter.k_writer", "aiter", "aiter.ops.triton.fusions.k_norm_rope_mxfp4_cache",
           "k_norm_rope_mxfp4_cache", "function",
           ("k", "positions", "cos_sin_cache", "norm_weight", "norm_eps", "kv_cache", "slot_mapping",
            "compress_ratio", "shuffle"),
           "None", (AITER_CU_ENDS, AITER_ROW_ENDS)),
    # q_scale comes back as u8 [T, H, D/32]
    Target("aiter.q_quant", "aiter", "aiter.ops.triton.rope.q_rope_mxfp4_quant", "q_rope_mxfp4_quant",
           "function", ("q", "positions", "cos_sin_cache", "weights", "weights_scale"),
           "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]", (AITER_CU_ENDS, AITER_ROW_ENDS)),
    # the generation vLLM 0.33.0 calls: one varlen launch per prefill chunk, q [T, H, D/2]
    # with query_start_loc and per-row row_ends; decode as [B, next_n, H, D/2]
    Target("aiter.scorer", "aiter", _AITER_PA, "paged_mxfp4_mqa_logits", "function",
           _SCORER_HEAD + ("row_ends", "query_start_loc", "next_n", "use_gather", "block_scores",
                           "calc_logits", "calc_block_scores"),
           _SCORER_RETURNS, (AITER_ROW_ENDS,)),
    # the generation before: q [B, next_n, H, D/2] only, per-row bounds as cu_ends
    Target("aiter.scorer@cu_ends", "aiter", _AITER_PA, "paged_mxfp4_mqa_logits", "function",
           _SCORER_HEAD + ("cu_ends",), _SCORER_RETURNS, (AITER_CU_ENDS,)),
    Target("aiter.topk", "aiter", "aiter.ops.topk", "top_k_per_row_decode", "function",
           ("logits", "next_n", "seqLens", "indices", "numRows", "stride0", "stride1", "k"),
           "None", (AITER_CU_ENDS, AITER_ROW_ENDS)),
    # the page-size rule of the scorer's preshuffled cache (what the K writer's shuffle must tile)
    Target("aiter.cache_format", "aiter", _AITER_PA, "cache_format", "function",
           ("num_heads", "head_size", "page_size"), "dict; kv_tile(page_size); page_size % bkv",
           (AITER_CU_ENDS, AITER_ROW_ENDS)),
    # what the aiter-triton backends replace when they load the K writer and Q quant from
    # source: the wrappers' logger (shapes only, nothing numeric) and the kernels' repr=
    # decorator argument (the compiled kernel's name)
    Target("aiter.triton.logger", "aiter", "aiter.ops.triton.utils.logger", "AiterTritonLogger", "class",
           (), "value", (AITER_CU_ENDS, AITER_ROW_ENDS)),
    Target("aiter.triton.kernel_repr", "aiter", "aiter.ops.triton.utils._triton.kernel_repr",
           "make_kernel_repr", "function", ("base_name", "config_keys", "name_key"), "value",
           (AITER_CU_ENDS, AITER_ROW_ENDS)),
)


# --- vLLM's Triton kernels run outside vLLM (the Triton-from-upstream backend) --------------
# (the ROCm pooling kernel is vllm.rocm.compress_pool_kernel above)

_VLLM_FUSED_K = "vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache"
_VLLM_FUSED_Q = "vllm.models.deepseek_v4.common.ops.fused_indexer_q"
_VLLM_ATTN_COMMON = "vllm.v1.attention.ops.common"
_C = ":constexpr"
_FUSED_K_PARAMS = ("state_cache_ptr", "state_cache_stride0", "state_cache_stride1", "token_to_req_indices_ptr",
                   "positions_ptr", "slot_mapping_ptr", "block_table_ptr", "block_table_stride", "block_size",
                   "rms_norm_weight_ptr", "rms_norm_eps", "cos_sin_cache_ptr", "cos_sin_stride", "k_cache_ptr",
                   "kv_slot_mapping_ptr", "kv_cache_block_size",
                   *(n + _C for n in ("HEAD_SIZE", "TRITON_BLOCK_SIZE", "STATE_WIDTH", "COMPRESS_RATIO", "OVERLAP",
                                      "ROPE_HEAD_DIM", "FP8_MAX", "QUANT_BLOCK", "TOKEN_STRIDE", "SCALE_DIM",
                                      "KV_BLOCK_STRIDE", "MX_SCALE")))
_Q_HEAD = ("pos_ptr", "index_q_ptr", "index_q_stride0", "index_q_stride1", "index_q_cos_sin_ptr",
           "index_q_cos_sin_stride", "INDEX_Q_HALF_ROT_DIM" + _C)
_Q_WEIGHTS = ("index_weights_ptr", "index_weights_stride", "index_weights_softmax_scale",
              "index_weights_head_scale", "index_weights_out_ptr", "index_weights_out_stride")
_Q_LAUNCH = ("positions", "index_q", "index_q_cos_sin_cache", "index_weights", "index_weights_softmax_scale",
             "index_weights_head_scale")
_K_LAUNCH_CLASS = "FusedKVCompressNormRopeInsertIndexerTritonKernel"

# vLLM's CUDA indexer path: the kernels mxval loads from source (optimized.vllm_kernels) and
# the launcher code its launch arguments are written from (pinned, so a changed launch rule
# is drift in `mxval upstream check`, not a silent wrong launch).
VLLM_TRITON: tuple[Target, ...] = (
    Target("vllm.cuda.k_mxfp4", "vllm", _VLLM_FUSED_K, "_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn",
           "triton_jit", _FUSED_K_PARAMS, "None", (VLLM_033, VLLM_034)),
    Target("vllm.cuda.k_fp8", "vllm", _VLLM_FUSED_K, "_fused_kv_compress_norm_rope_insert_indexer_attn",
           "triton_jit", _FUSED_K_PARAMS, "None", (VLLM_033, VLLM_034)),
    Target("vllm.cuda.k_launch", "vllm", _VLLM_FUSED_K, f"{_K_LAUNCH_CLASS}.__call__", "method",
           ("*", "state_cache", "num_actual", "token_to_req_indices", "positions", "slot_mapping", "block_table",
            "block_size", "state_width", "cos_sin_cache", "kv_cache", "k_cache_metadata", "pdl_kwargs", "head_dim",
            "rope_head_dim", "compress_ratio", "overlap", "use_fp4_cache", "rms_norm_weight", "rms_norm_eps",
            "quant_block", "token_stride", "scale_dim"),
           "LaunchSpec; (num_actual,); TRITON_BLOCK_SIZE=triton.next_power_of_2(head_dim); FP8_MAX=448.0; "
           "KV_BLOCK_STRIDE=kv_cache.stride(0); kv_cache_block_size=kv_cache.shape[1]; "
           "kv_slot_mapping_ptr=k_cache_metadata.slot_mapping; num_warps=1", (VLLM_033, VLLM_034)),
    Target("vllm.cuda.k_dispatch", "vllm", _VLLM_FUSED_K, f"{_K_LAUNCH_CLASS}.dispatch", "method",
           ("*", "dtype", "use_fp4_cache", "head_dim", "rope_head_dim", "compress_ratio", "cache_block_size",
            "cache_alignment"),
           "CompileKey; compress_ratio == 4; 32 if use_fp4_cache else 128; "
           "head_dim // 2 if use_fp4_cache else head_dim; head_dim // quant_block if use_fp4_cache else 4; "
           "head_dim * (1 + overlap); "
           "mx_scale=not use_fp4_cache and mqa_logits_use_mx_scales()", (VLLM_033, VLLM_034)),
    Target("vllm.cuda.q_mxfp4", "vllm", _VLLM_FUSED_Q, "FusedIndexerQRopeMxFp4TritonKernel.kernel", "triton_jit",
           _Q_HEAD + ("index_q_mxfp4_ptr", "index_q_mxfp4_stride0", "index_q_mxfp4_stride1", "index_q_scale_ptr",
                      "index_q_scale_stride0", "index_q_scale_stride1", "INDEX_Q_HEAD_DIM" + _C,
                      "MXFP4_BLOCK" + _C) + _Q_WEIGHTS, "None", (VLLM_033, VLLM_034)),
    Target("vllm.cuda.q_mxfp4_launch", "vllm", _VLLM_FUSED_Q, "FusedIndexerQRopeMxFp4TritonKernel.__call__",
           "method", _Q_LAUNCH + ("index_q_packed", "index_q_scale", "index_weights_out"),
           "LaunchSpec; (num_tokens, num_index_q_heads); INDEX_Q_HALF_ROT_DIM=index_q_cos_sin_cache.shape[-1] // 2; "
           "MXFP4_BLOCK=MXFP4_BLOCK_SIZE; enable_fp_fusion=True; num_warps=1", (VLLM_033, VLLM_034)),
    Target("vllm.cuda.q_fp8", "vllm", _VLLM_FUSED_Q, "FusedIndexerQRopeQuantTritonKernel.kernel", "triton_jit",
           _Q_HEAD + ("index_q_fp8_ptr", "index_q_fp8_stride0", "index_q_fp8_stride1", "INDEX_Q_HEAD_DIM" + _C)
           + _Q_WEIGHTS + ("FP8_MAX" + _C, "USE_FNUZ" + _C, "USE_EXPLICIT_FMA" + _C), "None", (VLLM_033, VLLM_034)),
    Target("vllm.cuda.q_fp8_launch", "vllm", _VLLM_FUSED_Q, "FusedIndexerQRopeQuantTritonKernel.__call__",
           "method", _Q_LAUNCH + ("index_q_fp8", "index_weights_out", "*", "fp8_max", "use_fnuz"),
           "LaunchSpec; (num_tokens, num_index_q_heads); USE_EXPLICIT_FMA=current_platform.is_rocm(); "
           "enable_fp_fusion=True; num_warps=1", (VLLM_033, VLLM_034)),
    # the jit helper the FP8 writer calls with MX_SCALE (imported from another module)
    Target("vllm.cuda.pack_ue8m0_x4", "vllm", _VLLM_ATTN_COMMON, "pack_ue8m0_x4", "triton_jit", ("scale",),
           "value", (VLLM_033, VLLM_034)),
)


TABLE: tuple[Target, ...] = VLLM_ROCM + AITER + VLLM_TRITON
_BY_KEY = {t.key: t for t in TABLE}


def target(key: str) -> Target:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no upstream target {key!r} (known: {', '.join(sorted(_BY_KEY))})") from None


def targets(package: str | None = None, *, kind: str | None = None) -> tuple[Target, ...]:
    return tuple(t for t in TABLE if (package is None or t.package == package)
                 and (kind is None or t.kind == kind))


def group(key: str) -> tuple[Target, ...]:
    """`key` and its alternatives (`key@...`), in table order: the first present wins."""
    members = tuple(t for t in TABLE if t.group == key.split("@", 1)[0])
    if not members:
        raise KeyError(f"no upstream target {key!r} (known: {', '.join(sorted(_BY_KEY))})")
    return members


def newest(package: str) -> str:
    """The newest release of `package` the table was read from ("0.33.0")."""
    tags = known_releases(package)
    if not tags:
        raise KeyError(f"the table names no {package} release")
    return tags[-1]


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
        if any(p.endswith(":constexpr") for p in t.params) and t.kind != "triton_jit":
            errs.append(f"{t.key}: constexpr marks on a {t.kind}")
        if "@" in t.key and t.group not in seen | {u.key for u in table}:
            errs.append(f"{t.key}: an alternative of {t.group}, which is not in the table")
    return errs


# --- where fetched trees live, and what a release's version looks like ----------------------

VERSION_RE = re.compile(r"\d+(\.\d+)*([a-z0-9.+!-]*)", re.I)        # a release as pip spells it
_VERSION_ASSIGN = re.compile(r"""__version__\s*(?:=\s*version\s*)?=\s*['"]([^'"]{1,64})['"]""")


def cache_root() -> Path:
    """$XDG_CACHE_HOME/mxval/upstream (default ~/.cache/mxval/upstream): fetched wheels and trees."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mxval" / "upstream"


def version_in(text: str) -> str | None:
    """The `__version__ = "..."` of a package's _version.py text (read as text, never run)."""
    m = _VERSION_ASSIGN.search(text)
    return m[1] if m else None


# --- the pinned sources: upstream trees are data until verified ------------------------------
# For each known release, the sha256 of every file the loaders (optimized.vllm_kernels) may
# execute. A file whose hash is not pinned here is refused unless the user names the tree and
# says it is trusted (`--trust-upstream`). `mxval upstream fetch` records the hashes it
# extracted and says which files match.

# aiter: the DeepSeek-V4 MXFP4 indexer ops are not in one public aiter commit. The pinned set
# is ROCm/aiter 689b79d5 (the two Triton kernels), ROCm/aiter 5677775a (their Python
# wrappers), nsakkine/aiter e1dc7564 (the quant helper with SCALING_MODE / USE_ASM), and the
# kernel_repr / logger helpers as ROCm/aiter 063c0719 has them (docs/upstream.md).
AITER_DSV4 = "aiter@dsv4-mxfp4"
AITER_REF = "689b79d557ba9bee086307ce10aba5ccda960530"       # the default `fetch --aiter` ref
AITER_GIT = "https://github.com/ROCm/aiter.git"

_VLLM_PINS_COMMON = {
    "vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py":
        "853cee0aa1c27fc02cd17834c64eb28ee8b4f2f2762af317a816c42ba0b8168b",
    "vllm/v1/attention/ops/common.py": "f4da48b60dc4774acf9f05c59ae4219a611ad1af506994bf681b4e157c664209",
}

PINS: dict[str, dict[str, str]] = {
    VLLM_033: {
        **_VLLM_PINS_COMMON,
        "vllm/models/deepseek_v4/amd/rocm.py": "ca6de9cd2a96a97fe3a4ecdf17df34f2704eb8b28a450afe58141055d31addce",
        "vllm/models/deepseek_v4/common/ops/fused_indexer_q.py":
            "5d27632f3b1fc67a407393221ba06f72a8cbc2a138bc8ee5076423000d56e7eb",
        "vllm/v1/attention/ops/rocm_paged_mxfp4_indexer.py":
            "701fcf47ce5b927d72dbb6b53db3c81e55711a3465a4f13b19d889b06ed02cec",
    },
    VLLM_034: {
        **_VLLM_PINS_COMMON,
        "vllm/models/deepseek_v4/amd/rocm.py": "1ab740acee633c1df275c19b3c1dfccdbacdeedd531b29a1c3b34f92bac5fba8",
        "vllm/models/deepseek_v4/common/ops/fused_indexer_q.py":
            "f055adf37a44d0e9597b080f144b9bc63f23c9fcff45ee5ccd34960258c775e6",
        "vllm/v1/attention/ops/rocm_paged_mxfp4_indexer.py":
            "7648f1160b7a171de11547f7cc3e34cc039a55e0373d4fc2ed9caef7efe2ca44",
    },
    AITER_DSV4: {
        "aiter/ops/triton/fusions/k_norm_rope_mxfp4_cache.py":
            "ccdbb2f2d9d4471934e9cd777cfffeadcdd8f250c624452f2d23b68e674e7277",
        "aiter/ops/triton/rope/q_rope_mxfp4_quant.py":
            "0fc95ba625bd5873c3b9804a6812e7cdc7feb00f1cd960407df8661d3d0f2a8e",
        "aiter/ops/triton/_triton_kernels/fusions/k_norm_rope_mxfp4_cache.py":
            "3958ff2ca8db33c1b4fc86825114666cef97b1b708147e7d6eecc24433be4ef6",
        "aiter/ops/triton/_triton_kernels/rope/q_rope_mxfp4_quant.py":
            "c1b58821deafa6d4ef7a4a83b9a94bdd55d4263e8b9c993e90070c852b25da31",
        "aiter/ops/triton/_triton_kernels/quant/quant.py":
            "9285fd0d85cd9670eb1bad2d4ba26284b64048a5839eaa1709a3bce7ef601b89",
        "aiter/ops/triton/utils/_triton/kernel_repr.py":
            "60f3f9d561ac72d5cbf0403184e5d6fe9c966602422dd06a9c7df05988613e07",
        "aiter/ops/triton/utils/logger.py": "bced7276a0ea4e875386f77b3cb2c3b3a9be9b6a6cb66808401072d161eb5dd2",
    },
}


def _release_package(release: str) -> str:
    return re.split(r"[=@:]", release, maxsplit=1)[0]


def pinned_releases(package: str, rel: str, digest: str | None = None) -> list[str]:
    """The known releases of `package` that pin file `rel` (with sha256 `digest`, when given)."""
    return [r for r, files in PINS.items() if _release_package(r) == package and rel in files
            and (digest is None or files[rel] == digest)]


def known_releases(package: str) -> list[str]:
    """The releases of `package` the table was read from ("0.33.0", ...), oldest first."""
    tags = {v.split("==", 1)[1] for t in TABLE for v in t.versions if v.startswith(package + "==")}
    return sorted(tags, key=version_key)


def version_key(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", v))
