"""vLLM's CUDA indexer path, stage by stage, against the reference chain, on a suite's inputs.

    python tools/vllm_cuda_stages.py --suite full --backend vllm-cuda [--json out.json]

Until the harness runs the `cuda` path itself (the fused stage `compress_norm_rope_*_cache`,
branch `cudaref`), this is how the fused K writers and the Q quants of `vllm-cuda` are
compared: for each case and step, the backend's fused op against
`compress_pool(rounding="cuda")` -> `k_norm_rope_*_cache(rounding="cuda", natural order)`
on the same pool (the backend's pool is fed forward, as the runner does), and the backend's
Q quant against the reference Q quant. Prints bytes that differ per stage; exit 0.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import reference  # noqa: E402
from reference import fp8 as ref_fp8, layout  # noqa: E402


def owned_bytes(slots, positions, d, fmt):
    w = slots[((positions + 1) % 4 == 0) & (slots >= 0)]
    return int(w.unique().numel()) * (layout.entry_bytes(d) if fmt == "mxfp4" else ref_fp8.entry_bytes(d))


def run_case(case, be, device):
    from harness.run.inputs import build
    inp = build(case, device)
    geo = inp.geo
    fmt = geo.fmt
    fused = be.ops[f"compress_norm_rope_{fmt}_cache"]
    qop = f"q_rope_{fmt}_quant"
    kref = reference.OPS[f"k_norm_rope_{fmt}_cache"].fn
    row = {"case": case.name, "fmt": fmt, "k_bytes_differ": 0, "k_bytes_owned": 0, "k_outside_changed": 0,
           "q_bytes_differ": 0, "q_bytes": 0, "weights_differ": 0, "steps": len(inp.steps), "first_k_diffs": []}
    why = be.cannot(f"compress_norm_rope_{fmt}_cache", {"fp8_dtype": case.fp8_dtype, "compress_ratio": geo.ratio})
    if why:
        row["skipped"] = why
        return row
    pool = inp.kv_cache
    ks = {"norm_eps": geo.preset.rms_eps, "compress_ratio": geo.ratio, "page_size": geo.page_size}
    if fmt == "fp8":
        ks["fp8_dtype"] = case.fp8_dtype
    try:
        for st in inp.steps:
            ins = dict(state_cache=inp.state_cache, block_table=inp.state_block_table, positions=st.positions,
                       req_index=st.req_index, kv_slot_mapping=st.slot_mapping)
            if "compress_pool" in case.ops:
                got = fused(**ins, cos_sin_cache=inp.cos_sin_cache, norm_weight=inp.norm_weight, kv_cache=pool.clone(),
                            **ks)["kv_cache"]
                pooled = reference.compress_pool(**ins, compress_ratio=geo.ratio, rounding="cuda")["pooled"]
                kw = dict(k=pooled, positions=st.positions, cos_sin_cache=inp.cos_sin_cache,
                          norm_weight=inp.norm_weight, slot_mapping=st.slot_mapping, kv_cache=pool, rounding="cuda", **ks)
                if fmt == "mxfp4":
                    kw["shuffle"] = None
                want = kref(**kw)["kv_cache"]
                diff = (got.cpu() != want.cpu())
                row["k_bytes_differ"] += int(diff.sum())
                row["k_bytes_owned"] += owned_bytes(st.slot_mapping.cpu(), st.positions.cpu(), geo.head_dim, fmt)
                row["k_outside_changed"] += int(((got.cpu() != pool.cpu()) & (want.cpu() == pool.cpu())).sum())
                for p, o in diff.nonzero()[:4].tolist():
                    row["first_k_diffs"].append([p, o, int(got[p, o]), int(want[p, o])])
                pool = got
            if st.q is not None and (qop in case.ops or "compress_pool" in case.ops):
                qins = dict(q=st.q, positions=st.positions, cos_sin_cache=inp.cos_sin_cache, weights=st.weights)
                qs = {"weights_scale": geo.weights_scale}
                if fmt == "fp8":
                    qs["fp8_dtype"] = case.fp8_dtype
                got = be.ops[qop](**qins, **qs)
                want = reference.OPS[qop].fn(**qins, **qs)
                for k in want:
                    if k == "weights":
                        row["weights_differ"] += int((got[k].cpu() != want[k].cpu()).sum())
                    else:
                        row["q_bytes_differ"] += int((got[k].cpu().view(torch.uint8) != want[k].cpu().view(torch.uint8)).sum())
                        row["q_bytes"] += want[k].numel()
    except reference.checks.NonFiniteInput as e:
        row["nonfinite"] = str(e).splitlines()[0]
    except ValueError as e:
        row["error"] = str(e).splitlines()[0]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="smoke")
    ap.add_argument("--backend", default="vllm-cuda-interpret")
    ap.add_argument("--case", action="append")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from harness.run.cases import Catalog
    from optimized import get_backend
    be = get_backend(a.backend)
    print(f"backend {be.name}: {be.description}")
    _, cases = Catalog().select(a.suite, a.case)
    rows = []
    tot = {"k_bytes_differ": 0, "k_bytes_owned": 0, "q_bytes_differ": 0, "q_bytes": 0, "weights_differ": 0}
    for c in cases:
        t0 = time.time()
        r = run_case(c, be, be.device)
        r["seconds"] = round(time.time() - t0, 2)
        rows.append(r)
        for k in tot:
            tot[k] += r.get(k, 0)
        extra = r.get("skipped") or r.get("nonfinite") or r.get("error") or ""
        print(f"{c.name:32s} {r['fmt']:5s} K {r['k_bytes_differ']:6d}/{r['k_bytes_owned']:<8d} outside {r['k_outside_changed']:3d}"
              f"  Q {r['q_bytes_differ']:5d}/{r['q_bytes']:<8d} w {r['weights_differ']:3d}  {r['seconds']:6.1f}s  {extra}"
              + (f"  first: {r['first_k_diffs'][:2]}" if r["first_k_diffs"] else ""))
    print("total", json.dumps(tot))
    if a.json:
        Path(a.json).write_text(json.dumps({"backend": be.name, "description": be.description, "rows": rows,
                                            "total": tot}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
