"""The op table is complete: every layer that handles an op reads it, and every op has a
reference, dump fields, a chain place, a differ and a label."""
import subprocess
import sys
from pathlib import Path

import optimized
import reference
from harness.diff.ops import STAGE_VIEWS, label
from harness.io import dumps
from reference.ops import OPS, PATHS, STAGES, chain, format_of, op_of, path_of

ROOT = Path(__file__).resolve().parents[1]


def test_every_op_has_every_column():
    assert set(reference.FUNCTIONS) == set(OPS) == set(optimized.OP_NAMES)
    for name, op in OPS.items():
        assert op.stage in STAGES and op.stage in STAGE_VIEWS
        assert callable(op.fn) and op.fields.outputs, name
        assert (op.fp64 is not None) == (op.stage == "scorer"), name
        assert label(name)


def test_each_chain_has_one_op_per_stage_in_order():
    stages = {"rocm": [s for s in STAGES if s != "pool_k"],
              "cuda": [s for s in STAGES if s not in ("pooling", "k_writer")]}
    for path in PATHS:
        for fmt in ("mxfp4", "fp8"):
            ops = chain(fmt, path)
            assert [OPS[o].stage for o in ops] == stages[path]
            assert format_of(ops) == fmt and all(op_of(fmt, OPS[o].stage, path) == o for o in ops)
            assert path_of(ops) == path
    assert chain("mxfp4") == chain("mxfp4", "rocm")
    assert set(chain("mxfp4", "rocm")) | set(chain("mxfp4", "cuda")) | set(chain("fp8", "rocm")) \
        | set(chain("fp8", "cuda")) == set(OPS)


def test_the_reference_backend_serves_exactly_the_table():
    be = optimized.get_backend("reference")
    assert all(be.supports(o) for o in OPS)


def test_an_op_missing_from_the_table_is_unknown_to_the_dump_reader():
    rec = dumps.OpRecord("k_norm_rope_mxfp4_cache_v2", {}, {}, {})
    assert "unknown op" in dumps.record_problem(rec)


def test_reference_topk_is_the_function_once_its_module_is_imported():
    """The op `reference.topk` shares its name with its module reference/topk.py: importing
    the module first (as optimized/ does) leaves the package's attribute the function."""
    code = ("import reference.topk\nfrom reference.topk import check_topk_args\nimport torch, reference\n"
            "assert reference.topk is reference.FUNCTIONS['topk'] is sys.modules['reference.topk'].topk\n"
            "out = reference.topk(logits=torch.tensor([[0.0, 2.0, 1.0]]), lengths=torch.tensor([3]), k=2)\n"
            "assert out['indices'].tolist() == [[1, 2]]\n")
    r = subprocess.run([sys.executable, "-c", "import sys\n" + code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
