"""harness.bench.resources: a kernel's registers, spills and residency on an NVIDIA SM or an
AMD CU, from a compile on any machine (Triton's ptxas; Triton's AMD backend)."""
from helpers import fresh_json

from harness.bench import resources as R


def test_residency_arithmetic():
    # registers go to a warp in units of 256 (170 * 32 = 5440 -> 5632: 11 per 64k, not 12); at most 32 programs
    assert [R.programs_per_sm(r, 1) for r in (159, 170, 128, 96, 64, 32)] == [12, 11, 16, 21, 32, 32]
    assert R.programs_per_sm(128, 2) == 8 and R.programs_per_sm(255, 8) == 1
    assert [R.waves(4096, n) for n in (12, 16, 32)] == [3, 2, 1] and R.waves(4224, 32) == 1 and R.waves(4225, 32) == 2


def test_the_fused_kernel_compiles_for_sm90_and_a_cap_holds():
    """In a fresh interpreter (this one may hold the kernels in interpreter mode)."""
    free, capped = fresh_json("import json; from harness.bench.resources import fused_k_rows; "
                          "print(json.dumps(fused_k_rows([(4, 1, 4, 1), (4, 1, 4, 1, 96)])))")
    assert 96 < free["registers"] <= 255 and free["spill_stores"] == 0
    assert capped["registers"] <= 96 and capped["spill_stores"] > 0          # the cap is what ptxas obeyed
    assert capped["programs_per_sm"] > free["programs_per_sm"]


def test_the_compile_takes_the_launchs_alignment():
    """A launch passes 16-byte-aligned pointers and strides, and Triton specializes on them:
    the state rows are then read four floats a load. Compiled without saying so, every float is
    its own load and the register counts are not the launch's."""
    got = fresh_json("""
import json, re
from harness.bench import resources as R
from triton.backends.compiler import GPUTarget
from optimized.triton_kernels import fused_k
cx = R._fused_k_constexprs((8, 1, 2), 1)
def v4(aligned):
    k = R._compiled(fused_k._fused_k_kernel, R.FUSED_K_SIGNATURE, cx, GPUTarget("cuda", 90, 32),
                    {"num_warps": 1, "enable_fp_fusion": False}, aligned)
    return len(re.findall(r"ld\\.global(?:\\.\\w+)*\\.v4\\.b32", k.asm["ptx"]))
print(json.dumps([v4(R.FUSED_K_ALIGNED), v4(())]))
""")
    assert got[0] >= 16 and got[1] == 0      # the [8, 128] kv and score tiles: 8 x 4 floats a lane each


def test_the_fused_kernel_compiles_for_gfx950_and_waves_per_eu_holds():
    """The ROCm path's target: LLVM's own counts; asking 4 waves a SIMD of a kernel that
    holds 3 trades VGPRs spilled to scratch for the fourth."""
    free, asked = fresh_json("import json; from harness.bench.resources import fused_k_rows_rocm; "
                         "print(json.dumps(fused_k_rows_rocm([((8, 1, 2, 1), None), ((8, 1, 2, 1), 4)])))")
    assert free["device"] == "MI355X" and 64 < free["vgprs"] <= 512 and free["scratch_bytes"] == 0
    assert free["occupancy"] == 512 // (-(-(free["vgprs"] + free["agprs"]) // 8) * 8)      # VGPRs bind here
    assert free["resident"] == free["occupancy"] * 4 * 256 and free["waves"] == -(-2048 // free["resident"])
    assert asked["occupancy"] >= 4 > free["occupancy"] and asked["vgprs"] <= 128 < free["vgprs"]
    assert asked["vgpr_spills"] > 0 and asked["scratch_bytes"] > 0


def test_an_unknown_amd_target_is_refused():
    import pytest
    with pytest.raises(RuntimeError, match="not an AMD target compiled for here"):
        R.compile_resources_rocm(None, {}, {}, num_warps=1, arch="gfx1100")


def test_a_triton_without_its_amd_backend_keeps_the_cuda_table(tmp_path, monkeypatch):
    row = {"tile": (8, 1, 2, 1, 128), "certify": 1, "registers": 128, "spill_stores": 0, "spill_loads": 0,
           "programs_per_sm": 16, "waves": 1}
    monkeypatch.setattr(R, "fused_k_rows", lambda tiles, certify=1, arch=90: [dict(row, certify=certify)])

    def no_amd(*a, **k):
        raise RuntimeError("compiling for gfx950: no AMD backend")
    monkeypatch.setattr(R, "fused_k_rows_rocm", no_amd)
    out = tmp_path / "r.md"
    assert R.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert "| (8, 1, 2, 1, 128) | certified | 128 |" in text
    assert "## Fused K kernel resources (gfx950, MI355X)\n\nNot compiled: compiling for gfx950: no AMD backend" in text


def test_bench_gpu_notes_the_sweeps_registers_as_its_gpu_compiles_them(monkeypatch):
    import torch

    from harness.bench import gpu
    notes = []
    b = type("B", (), {"note": lambda self, h, t: notes.append(t)})()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"multi_processor_count": 114}))
    monkeypatch.setattr(torch.version, "hip", None)
    seen = []

    def rows(tiles, certify=1, arch=90, sms=0):
        seen.append((list(tiles), arch, sms))
        return [{"tile": t, "registers": 128, "spill_stores": 56, "programs_per_sm": 16, "waves": 1} for t in tiles]
    monkeypatch.setattr(R, "fused_k_rows", rows)
    gpu._fused_k_residency(b, "h")
    assert seen == [(gpu.FUSED_TILES, 90, 114)] and "on this GPU's 114 SMs" in notes[-1]
    assert notes[-1].startswith("registers per tiling, as this Triton compiles them for sm_90")
    assert f"{gpu.FUSED_TILES[0]}: 128, 56 B, 16, 1" in notes[-1]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    gpu._fused_k_residency(b, "h")
    assert "not compiled for this GPU (sm_100" in notes[-1] and len(seen) == 1


def test_a_compiler_report_without_a_count_is_an_error_not_a_zero():
    import pytest
    assert R._field("ptxas info: Used 128 registers, 56 bytes spill stores", r"Used (\d+) registers", "x") == 128
    with pytest.raises(RuntimeError, match="says nothing matching"):
        R._field("ptxas info: 0 bytes stack frame", r"Used (\d+) registers", "ptxas -v for sm_90")
