"""What a Triton kernel costs an NVIDIA SM or an AMD CU, on any machine: compiled for the
target with Triton's own compiler (and, for CUDA, its bundled `ptxas`), no GPU needed.

A short, latency-bound kernel of one-warp programs (the fused K path) runs as fast as its
programs are resident. NVIDIA: an SM holds 64k registers, so a kernel that takes R registers
per thread fits floor(65536 / (ceil(R * 32 / 256) * 256 * warps)) programs (at most 32), and
a launch of P programs on S SMs takes ceil(P / (that * S)) waves; `ptxas -v` says R and the
bytes spilled; a register cap (`maxnreg`) trades spills for residency. AMD (CDNA, wave64):
LLVM's AMDGPU backend reports the waves a SIMD holds of this kernel (its occupancy, from
VGPRs, AGPRs, SGPRs and LDS), 4 SIMDs a CU; `waves_per_eu` asks it for more, trading spills
(to scratch) for residency. That is the ROCm path's own target: the fused K kernel is meant
for aiter on gfx950.

    python -m harness.bench.resources          # the fused K path's tilings, sm_90 (H100) and gfx950 (MI355X)
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional

from harness.errors import Parser, parse_or_exit

REGS_PER_SM = 65536
ALLOC_UNIT = 256                  # registers are given to a warp in units of this many
MAX_PROGRAMS_PER_SM = 32          # resident thread blocks per SM (sm_80 .. sm_90)
H100_SMS = 132
ARCHS = (80, 86, 89, 90)          # NVIDIA targets compiled for here (sm_90: its `a` form, as Triton does)
CHUNK_TOKENS = 16384              # make bench-gpu's fused-k chunk
# The fused K path's tilings, the default first: `make bench-gpu` times them, `main` compiles
# them. (tokens per program, writing tokens pooled at once, undecided values refined at once,
# warps[, registers per thread at most]). What sets the time is residency: a 16k-token chunk
# has 16384 / TPP one-warp programs, an SM's 64k registers hold 65536 // (32 x registers, in
# units of 256) of them, on 132 SMs. The certified kernel fits 128 registers (Triton 3.7.1: 4
# bytes spilled at the default), so 16 programs a SM and 8 tokens per program are one wave; uncapped,
# some tilings take 150 to 170 and run in two or three. Caps below 128 spill hundreds of
# bytes (measured 2 to 3.5x slower with an earlier form of the kernel)
FUSED_TILES = [(8, 1, 1, 1, 128), (8, 1, 2, 1, 128), (8, 1, 4, 1, 128), (8, 1, 1, 1), (8, 1, 2, 1), (8, 1, 4, 1),
               (16, 1, 1, 1, 128), (4, 1, 1, 1, 128), (4, 1, 4, 1), (4, 1, 1, 1), (1, 1, 4, 1)]
# AMD targets compiled for here: (device, compute units); wave64, 4 SIMDs a CU
ROCM_TARGETS = {"gfx950": ("MI355X", 256), "gfx942": ("MI300X", 304)}
SIMDS_PER_CU = 4
# the fused K kernel's ROCm rows: (tile without CUDA's register cap, waves_per_eu asked or None)
ROCM_TILES = [((8, 1, 1, 1), None), ((8, 1, 2, 1), None), ((8, 1, 1, 1), 4), ((8, 1, 1, 2), None),
              ((4, 1, 1, 1), None), ((16, 1, 1, 1), None)]


def ptxas() -> str:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(path):
        raise RuntimeError(f"no ptxas in this Triton ({path}): install Triton with its NVIDIA backend")
    return path


def _compiled(fn, signature: dict, constexprs: dict, target, options: dict, aligned=()):
    """`fn` compiled by Triton for `target` with these argument types, constexprs and options.
    `aligned`: the arguments a launch passes as multiples of 16 (pointers from allocations,
    strides): Triton's launcher specializes on that, and its vector loads (so its register
    counts) follow from it, so a compile that is to predict a launch says so too."""
    import triton
    from triton.compiler import ASTSource
    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=target, options=options)


def compile_resources(fn, signature: dict, constexprs: dict, *, num_warps: int, maxnreg: Optional[int] = None,
                      arch: int = 90, options: Optional[dict] = None, aligned=()) -> dict:
    """{registers, spill_stores, spill_loads} of `fn` (a @triton.jit function, not in
    interpreter mode) compiled for sm_`arch` (one of ARCHS) with these argument types and
    constexprs, the `aligned` ones multiples of 16 (`_compiled`)."""
    if arch not in ARCHS:
        raise RuntimeError(f"sm_{arch}: not a target compiled for here ({', '.join(map(str, ARCHS))})")
    from triton.backends.compiler import GPUTarget
    opts = {"num_warps": num_warps, **(options or {}), **({"maxnreg": maxnreg} if maxnreg else {})}
    k = _compiled(fn, signature, constexprs, GPUTarget("cuda", arch, 32), opts, aligned)
    with tempfile.TemporaryDirectory(prefix="mxval-ptxas-") as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(k.asm["ptx"])
        out = subprocess.run([ptxas(), "-v", "--gpu-name", f"sm_{arch}a" if arch == 90 else f"sm_{arch}", src,
                              "-o", os.path.join(tmp, "k.o")], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed: {out.stderr.strip()[-500:]}")
    return {"registers": _field(out.stderr, r"Used (\d+) registers", f"ptxas -v for sm_{arch}"),
            "spill_stores": _field(out.stderr, r"(\d+) bytes spill stores", f"ptxas -v for sm_{arch}"),
            "spill_loads": _field(out.stderr, r"(\d+) bytes spill loads", f"ptxas -v for sm_{arch}")}


def _field(text: str, pattern: str, where: str) -> int:
    """The last number `pattern` finds in `text`; a report without it is an error, not a 0."""
    found = re.findall(pattern, text)
    if not found:
        raise RuntimeError(f"{where} says nothing matching {pattern!r}")
    return int(found[-1])


def compile_resources_rocm(fn, signature: dict, constexprs: dict, *, num_warps: int, arch: str = "gfx950",
                           waves_per_eu: Optional[int] = None, options: Optional[dict] = None, aligned=()) -> dict:
    """{vgprs, agprs, sgprs, vgpr_spills, sgpr_spills, scratch_bytes, occupancy} of `fn`
    compiled for AMD `arch` (one of ROCM_TARGETS), as the AMDGPU backend reports them in the
    kernel's assembly: registers per lane, registers spilled (VGPRs to scratch memory; SGPRs
    mostly to VGPR lanes), scratch bytes per lane, waves a SIMD holds."""
    if arch not in ROCM_TARGETS:
        raise RuntimeError(f"{arch}: not an AMD target compiled for here ({', '.join(ROCM_TARGETS)})")
    from triton.backends.compiler import GPUTarget
    opts = {"num_warps": num_warps, **(options or {}), **({"waves_per_eu": waves_per_eu} if waves_per_eu else {})}
    try:
        k = _compiled(fn, signature, constexprs, GPUTarget("hip", arch, 64), opts, aligned)
    except Exception as e:            # noqa: BLE001 - no AMD backend in this Triton, or it failed
        raise RuntimeError(f"compiling for {arch}: {type(e).__name__}: {str(e).strip()[-300:]}") from None
    asm, where = k.asm.get("amdgcn", ""), f"the {arch} assembly"
    fields = {"vgprs": r"\.vgpr_count:\s*(\d+)", "agprs": r"\.agpr_count:\s*(\d+)", "sgprs": r"\.sgpr_count:\s*(\d+)",
              "vgpr_spills": r"\.vgpr_spill_count:\s*(\d+)", "sgpr_spills": r"\.sgpr_spill_count:\s*(\d+)",
              "scratch_bytes": r"; ScratchSize:\s*(\d+)", "occupancy": r"; Occupancy:\s*(\d+)"}
    return {name: _field(asm, pattern, where) for name, pattern in fields.items()}


def programs_per_sm(registers: int, num_warps: int) -> int:
    per_warp = math.ceil(registers * 32 / ALLOC_UNIT) * ALLOC_UNIT
    return max(0, min(MAX_PROGRAMS_PER_SM, REGS_PER_SM // (per_warp * num_warps)))


def waves(programs: int, per_sm: int, sms: int = H100_SMS) -> int:
    return math.ceil(programs / (per_sm * sms)) if per_sm else 0


# the fused K kernel's argument types as the harness launches it (fp32 state and RoPE table,
# int32 tables, int64 positions and slots, byte pages) and its V4-Pro constexprs
FUSED_K_SIGNATURE = dict(state_ptr="*fp32", table_ptr="*i32", pos_ptr="*i64", req_ptr="*i32", slot_ptr="*i64",
                         cs_ptr="*fp32", w_ptr="*fp32", cache_ptr="*u8", pooled_ptr="*u8", T="i32",
                         block_size="i32", table_stride="i32", row_stride="i32", block_stride="i32",
                         page_stride="i32", cs_stride="i32", eps="fp32")
# what the chunk's launch passes as multiples of 16, which Triton's launcher specializes on
# (every pointer; the state cache's 256-row blocks of 512 floats, the 4,352-byte pages, the
# 64-float RoPE rows): without it the state rows are read one float at a time, not four, and
# the register counts are not the launch's
FUSED_K_ALIGNED = ("state_ptr", "table_ptr", "pos_ptr", "req_ptr", "slot_ptr", "cs_ptr", "w_ptr", "cache_ptr",
                   "pooled_ptr", "block_size", "row_stride", "block_stride", "page_stride", "cs_stride")
FUSED_K_CONSTEXPRS = dict(D=128, R=64, RATIO=4, WP=8, PAGE=64, SHUF_N=32, SHUF_DT=16, SHUF_L=2, ROUNDING=0, RULE=0,
                          STORE_POOLED=False, SPAN2=True)


def _fused_k_constexprs(tile, certify: int) -> dict:
    """The fused K kernel's constexprs for a tile (its first three numbers); refused in
    interpreter mode, where its @triton.jit functions cannot be compiled."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: the kernels are in interpreter mode; compile without it")
    tpp, bt, u = tile[:3]
    return dict(FUSED_K_CONSTEXPRS, TPP=tpp, BT=bt, U=u, CERTIFY=certify)


def fused_k_rows(tiles, *, certify: int = 1, arch: int = 90, sms: int = H100_SMS) -> list[dict]:
    """Per tile (tokens per program, pooled at once, refined at once, warps[, maxnreg]) of
    the fused K kernel: its registers, spills, programs per SM and waves for the chunk on
    `sms` SMs."""
    from optimized.triton_kernels import fused_k
    rows = []
    for tile in tiles:
        warps, cap = tile[3], (tile[4] if len(tile) > 4 else None)
        r = compile_resources(fused_k._fused_k_kernel, FUSED_K_SIGNATURE, _fused_k_constexprs(tile, certify),
                              num_warps=warps, maxnreg=cap, arch=arch, options={"enable_fp_fusion": False},
                              aligned=FUSED_K_ALIGNED)
        per_sm = programs_per_sm(r["registers"], warps)
        rows.append({"tile": tile, "certify": certify, **r, "programs_per_sm": per_sm,
                     "waves": waves(-(-CHUNK_TOKENS // tile[0]), per_sm, sms)})
    return rows


def fused_k_rows_rocm(tiles, *, certify: int = 1, arch: str = "gfx950") -> list[dict]:
    """Per (tile, waves_per_eu) of ROCM_TILES' form: the fused K kernel's registers, spills and
    occupancy on `arch`, the programs (one per `warps` waves) resident on the device at once,
    and the waves a 16k-token chunk takes."""
    from optimized.triton_kernels import fused_k
    if arch not in ROCM_TARGETS:
        raise RuntimeError(f"{arch}: not an AMD target compiled for here ({', '.join(ROCM_TARGETS)})")
    device, cus = ROCM_TARGETS[arch]
    rows = []
    for tile, wpe in tiles:
        warps = tile[3]
        r = compile_resources_rocm(fused_k._fused_k_kernel, FUSED_K_SIGNATURE, _fused_k_constexprs(tile, certify),
                                   num_warps=warps, arch=arch, waves_per_eu=wpe, options={"enable_fp_fusion": False},
                                   aligned=FUSED_K_ALIGNED)
        resident = r["occupancy"] * SIMDS_PER_CU * cus // warps
        rows.append({"tile": tile, "waves_per_eu": wpe, "certify": certify, "arch": arch, "device": device, **r,
                     "resident": resident, "waves": waves(-(-CHUNK_TOKENS // tile[0]), resident, 1)})
    return rows


def main(argv=None) -> int:
    ap = Parser(prog="python -m harness.bench.resources", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="the CUDA compute capability compiled for (90: H100)")
    ap.add_argument("--rocm-arch", default="gfx950", choices=sorted(ROCM_TARGETS),
                    help="the AMD target compiled for (gfx950: MI355X, the ROCm path's)")
    ap.add_argument("--out", default=None, help="also write the tables to this Markdown file")
    a = parse_or_exit(ap, argv, "bench resources")
    if a.arch not in ARCHS:                       # an unknown target aborts inside LLVM
        print(f"mxval: bench resources: --arch {a.arch}: not a target compiled for here "
              f"({', '.join(map(str, ARCHS))})", file=sys.stderr)
        return 2
    try:
        rows = fused_k_rows(FUSED_TILES, arch=a.arch) + fused_k_rows([(8, 1, 1, 1, 128), (4, 1, 4, 1)], certify=2,
                                                                     arch=a.arch)
    except RuntimeError as e:
        print(f"mxval: bench resources: {e}", file=sys.stderr)
        return 2
    try:                                          # a Triton without its AMD backend keeps the CUDA table
        amd, amd_missing = (fused_k_rows_rocm(ROCM_TILES, arch=a.rocm_arch)
                            + fused_k_rows_rocm([((8, 1, 1, 1), None), ((4, 1, 4, 1), None)], certify=2,
                                                arch=a.rocm_arch)), None
    except RuntimeError as e:
        amd, amd_missing = [], str(e)
    import triton
    lines = [f"## Fused K kernel resources (sm_{a.arch})", "",
             f"Compiled with Triton {triton.__version__} and its ptxas for sm_{a.arch} (no GPU needed); a "
             f"{CHUNK_TOKENS}-token prefill chunk on {H100_SMS} SMs (an H100). Tile: tokens per program, writing "
             f"tokens pooled at once, undecided values refined at once, warps[, register cap]. Compiled as the "
             f"chunk's launch specializes it (its pointers and strides multiples of 16: four-float loads of the "
             f"state rows); the counts are this Triton's, so a wave count is a prediction for this compiler "
             f"(`make bench-gpu` notes what the GPU's own Triton compiles); the times are "
             f"`make bench-gpu`'s.", "",
             "| tile | pooling | registers | spilled (stores/loads, bytes) | programs per SM | waves |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tile']} | {'certified' if r['certify'] == 1 else 'fp32 only'} | {r['registers']} | "
                     f"{r['spill_stores']}/{r['spill_loads']} | {r['programs_per_sm']} | {r['waves']} |")
    device, cus = ROCM_TARGETS[a.rocm_arch]
    lines += ["", f"## Fused K kernel resources ({a.rocm_arch}, {device})", ""]
    if amd_missing is not None:
        lines.append(f"Not compiled: {amd_missing}")
    else:
        lines += [f"Compiled with Triton {triton.__version__}'s AMD backend for {a.rocm_arch} (wave64; no GPU "
                  f"needed), the counts as LLVM's AMDGPU backend reports them; a {CHUNK_TOKENS}-token prefill chunk "
                  f"on {cus} CUs of {SIMDS_PER_CU} SIMDs. Occupancy: the waves one SIMD holds of this kernel (VGPRs, "
                  f"AGPRs, SGPRs and LDS counted); a program is `warps` waves. `waves_per_eu`: the occupancy asked of "
                  f"the register allocator (ROCm's counterpart of a register cap; the launch does not ask it). SGPR "
                  f"spills go to VGPR lanes, VGPR spills to scratch memory. Programs resident: occupancy x SIMDs / "
                  f"warps, by registers and LDS alone (a CU's cap on resident workgroups may bind first for one-wave "
                  f"programs at a high occupancy). Not timed: no AMD GPU here.", "",
                  "| tile | waves_per_eu | pooling | VGPRs | SGPRs | spilled VGPRs / SGPRs | scratch (bytes per lane) | "
                  "occupancy (waves per SIMD) | programs resident | waves |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in amd:
            lines.append(f"| {r['tile']} | {r['waves_per_eu'] or '-'} | "
                         f"{'certified' if r['certify'] == 1 else 'fp32 only'} | {r['vgprs'] + r['agprs']} | "
                         f"{r['sgprs']} | {r['vgpr_spills']} / {r['sgpr_spills']} | {r['scratch_bytes']} | "
                         f"{r['occupancy']} | {r['resident']} | {r['waves']} |")
    print("\n".join(lines))
    if a.out:
        from harness.io import atomic
        atomic.write_text(a.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
