"""The upstream table and `mxval upstream fetch/check`, on small synthetic source trees
written from the table itself (no download, nothing imported)."""
from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from harness.commands import upstream_cmd as uc
from harness.commands.cli import main
from optimized import upstream
from optimized.upstream import Target


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")


# --- the table ---------------------------------------------------------------------------

def test_the_table_is_sound():
    assert upstream.validate() == []
    assert upstream.target("vllm.ops.q_quant").package == "vllm"
    assert [t.key for t in upstream.group("aiter.scorer@cu_ends")] == ["aiter.scorer", "aiter.scorer@cu_ends"]
    assert upstream.newest("vllm") == "0.34.0" and upstream.known_releases("vllm") == ["0.33.0", "0.34.0"]
    assert all(t.package == "aiter" for t in upstream.targets("aiter"))
    with pytest.raises(KeyError, match="no upstream target 'vllm.nope'"):
        upstream.target("vllm.nope")


def test_validate_catches_a_broken_table():
    t = upstream.target("vllm.ops.topk")
    bad = (t, t, Target("x.y", "torch", "torch.x", "f", "lambda", ("a:constexpr",), "None", ()),
           Target("vllm.gone@old", "vllm", "vllm.a", "f", "function", (), "None", ("vllm==1",)))
    errs = upstream.validate(bad)
    assert "vllm.ops.topk: duplicate key" in errs
    assert any("package 'torch'" in e for e in errs) and any("kind 'lambda'" in e for e in errs)
    assert any("no versions" in e for e in errs) and any("constexpr marks on a lambda" in e for e in errs)
    assert "vllm.gone@old: an alternative of vllm.gone, which is not in the table" in errs


# --- synthetic sources written from the table ----------------------------------------------------

def _def_text(t: Target, *, drop_clause: bool = False) -> str:
    if t.kind == "class":
        init = f"    def __init__(self, {', '.join(t.bound_params())}):\n        pass\n" if t.params else "    pass\n"
        return f"class {t.name}:\n{init}"
    pos, kw = t.positional(), t.keyword()
    marks = {p.split(":")[0] for p in t.params if p.endswith(":constexpr")}
    args = [f"{p}: tl.constexpr" if p in marks else p for p in pos] + [f"{p}=None" for p in kw]
    clauses = [c.strip() for c in t.returns.split(";") if c.strip()]
    head = clauses[0] if clauses else ""
    ann = f" -> {head}" if head and head not in ("value",) and "-tuple" not in head else ""
    body = []
    for c in clauses[1:len(clauses) - (1 if drop_clause else 0)]:
        try:
            ast.parse(c, mode="eval")
            body.append(f"    _ = {c}")
        except SyntaxError:
            body.append(f"    f({c})")
    if head == "value":
        body.append("    return 0")
    deco = "@triton.jit\n" if t.kind == "triton_jit" else ""
    cls, _, name = t.name.rpartition(".")
    if cls:                                  # a class member: a method, or a @staticmethod kernel
        deco = "@staticmethod\n" + deco if t.kind == "triton_jit" else deco
        args = args if t.kind == "triton_jit" else ["self", *args]
    return f"{deco}def {name}({', '.join(args)}){ann}:\n" + "\n".join(body or ["    pass"]) + "\n"


def write_tree(root: Path, package: str, versions: tuple[str, ...], *, edit=None, skip=()) -> Path:
    """A `package` tree with every table target known for `versions`; `edit(key, text)`
    may rewrite a definition."""
    files: dict[str, list[str]] = {}
    for t in upstream.targets(package):
        if t.key in skip or not set(t.versions) & set(versions):
            continue
        text = _def_text(t)
        if edit is not None:
            text = edit(t.key, text)
        cls = t.name.rpartition(".")[0]
        defs = files.setdefault(uc.module_files(t.module)[0], [])
        if cls:                              # members of one class go into one class statement
            at = next((i for i, d in enumerate(defs) if d.startswith(f"class {cls}:")), None)
            member = "".join("    " + ln if ln.strip() else ln for ln in text.splitlines(keepends=True))
            if at is None:
                defs.append(f"class {cls}:\n" + member)
            else:
                defs[at] += "\n" + member
        else:
            defs.append(text)
    for rel, defs in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("import triton\n\n" + "\n\n".join(defs))
    for d in {root / package, *(p.parent for p in root.rglob("*.py"))}:
        if d.is_relative_to(root / package):
            (d / "__init__.py").touch()
    if package == "vllm":
        (root / "vllm" / "_version.py").write_text("__version__ = version = '0.33.0'\n")
    return root


def run_check(capsys, *args) -> tuple[int, str]:
    rc = main(["upstream", "check", *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture
def vllm_tree(tmp_path):
    return write_tree(tmp_path / "v", "vllm", (upstream.VLLM_033,))


def test_check_passes_on_sources_that_match_the_table(tmp_path, vllm_tree, capsys):
    aiter = write_tree(tmp_path / "a", "aiter", (upstream.AITER_ROW_ENDS,), skip=("aiter.scorer@cu_ends",))
    rc, out = run_check(capsys, "--vllm", str(vllm_tree), "--aiter", str(aiter))
    assert rc == 0, out
    assert "vllm 0.33.0" in out and "ok: all" in out and "drift" not in out
    assert "alternative (vllm.rocm.compress_pool bound)" in out
    results = uc.check({"vllm": uc.DirSource("vllm", vllm_tree), "aiter": uc.DirSource("aiter", aiter)})
    groups: dict = {}
    for r in results:
        groups.setdefault(r.target.group, []).append(r.verdict)
    assert all(v.count("bound") >= 1 and set(v) <= {"bound", "alternative"} for v in groups.values()), groups


def test_the_older_generations_bind_as_alternatives(tmp_path, capsys):
    v = write_tree(tmp_path / "v", "vllm", (upstream.VLLM_8E4F,))
    (v / "vllm/v1/attention/ops/rocm_paged_mxfp4_indexer.py").unlink()
    write_tree(tmp_path / "v", "vllm", (upstream.VLLM_033,), skip=tuple(
        t.key for t in upstream.targets("vllm") if t.module != "vllm.v1.attention.ops.rocm_paged_mxfp4_indexer"
        and t not in upstream.VLLM_TRITON))
    a = write_tree(tmp_path / "a", "aiter", (upstream.AITER_CU_ENDS,), skip=("aiter.scorer",))
    res = {r.target.key: r.verdict for r in uc.check({"vllm": uc.DirSource("vllm", v),
                                                      "aiter": uc.DirSource("aiter", a)})}
    assert res["vllm.rocm.compress_pool@8e4f5df9"] == "bound" and res["vllm.rocm.compress_pool"] == "alternative"
    assert res["aiter.scorer@cu_ends"] == "bound" and res["aiter.scorer"] == "alternative"
    assert run_check(capsys, "--vllm", str(v), "--aiter", str(a))[0] == 0


@pytest.mark.parametrize("key,edit,says", [
    ("vllm.ops.k_store", lambda s: s.replace("k_pre", "k"), "no parameter k_pre (position 0 is k)"),
    ("vllm.ops.k_store", lambda s: s.replace("num_heads=None", "*, num_heads=None"), None),
    ("vllm.ops.k_store", lambda s: s.replace("compress_ratio, use_fp4_cache", "compress_ratio, *, use_fp4_cache"),
     "use_fp4_cache is keyword-only upstream, mxval passes it at position 8"),
    ("vllm.ops.topk@0.33.0", lambda s: s.replace("k)", "k, extra)"), "upstream requires extra"),
    ("vllm.ops.topk@0.33.0", lambda s: s.replace("rows >= 128", "rows >= 64"),
     "no `width >= k and (k >= 2048 or rows >= 128)` in its body"),
    ("vllm.ops.q_quant", lambda s: s.replace("-> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]",
                                             "-> tuple"), "returns tuple, the table says"),
    ("vllm.rocm.compress_pool_kernel", lambda s: s.replace("STATE_WIDTH: tl.constexpr", "STATE_WIDTH"),
     "STATE_WIDTH is not a constexpr upstream"),
    ("vllm.rocm.compress_pool_kernel", lambda s: s.replace("@triton.jit\n", ""), "a function, the table says triton_jit"),
    ("vllm.rocm.compress_pool_kernel", lambda s: s.replace("pooled_k_stride,", "pooled_k_stride, EXTRA: tl.constexpr,"),
     "upstream requires EXTRA"),
    ("vllm.ops.q_quant", lambda s: s.replace("def rocm_mxfp4_indexer_q_quant(", "def rocm_mxfp4_indexer_q_quant_v2("),
     "defines no rocm_mxfp4_indexer_q_quant"),
])
def test_check_reports_drift(tmp_path, capsys, key, edit, says):
    same = (upstream.target(key).module, upstream.target(key).name)     # every entry naming that function
    tree = write_tree(tmp_path / "v", "vllm", (upstream.VLLM_033,),
                      edit=lambda k, text: edit(text) if (upstream.target(k).module, upstream.target(k).name) == same
                      else text)
    rc, out = run_check(capsys, "--vllm", str(tree))
    results = {r.target.key: r for r in uc.check({"vllm": uc.DirSource("vllm", tree)})}
    if says is None:                                    # still binds: a kw-only parameter passed by keyword
        assert rc == 0 and results[key].verdict == "bound", out
        return
    assert rc == 1 and "drift" in out, out
    r = results[key]
    assert r.verdict in ("drift", "missing")
    problems = (r.comparison.params + r.comparison.returns) if r.comparison else [r.why]
    assert any(says in p for p in problems), problems


def test_a_missing_target_and_its_missing_alternative_are_drift(tmp_path, capsys):
    tree = write_tree(tmp_path / "v", "vllm", (upstream.VLLM_033,),
                      skip=("vllm.rocm.compress_pool",))
    rc, out = run_check(capsys, "--vllm", str(tree))
    assert rc == 1
    r = {r.target.key: r for r in uc.check({"vllm": uc.DirSource("vllm", tree)})}
    assert r["vllm.rocm.compress_pool"].verdict == "missing"   # the module is there, the function is not
    assert "defines no compress_pool" in r["vllm.rocm.compress_pool"].why
    assert r["vllm.rocm.compress_pool@8e4f5df9"].verdict == "missing"
    assert "module not found: vllm.models.deepseek_v4.amd.mxfp4_indexer" in r["vllm.rocm.compress_pool@8e4f5df9"].why


def test_re_exports_and_retired_keywords(tmp_path):
    """A name imported from a submodule is followed there; a keyword that only **kwargs
    would swallow does not bind."""
    root = write_tree(tmp_path / "a", "aiter", (upstream.AITER_ROW_ENDS,), skip=("aiter.scorer@cu_ends",))
    scorer = upstream.target("aiter.scorer")
    path = root / uc.module_files(scorer.module)[0]
    impl = path.with_name("_impl.py")
    impl.write_text(path.read_text())
    path.write_text("from ._impl import paged_mxfp4_mqa_logits\n")
    res = {r.target.key: r for r in uc.check({"aiter": uc.DirSource("aiter", root)})}
    assert res["aiter.scorer"].verdict == "bound" and res["aiter.scorer"].found.path.endswith("_impl.py")
    impl.write_text(impl.read_text().replace("row_ends=None, ", "").replace(
        "calc_block_scores=None)", "calc_block_scores=None, **kwargs)"))
    res = {r.target.key: r for r in uc.check({"aiter": uc.DirSource("aiter", root)})}
    assert "no parameter row_ends (it would land in **kwargs)" in res["aiter.scorer"].comparison.params


def test_a_file_that_does_not_parse_is_drift(tmp_path, capsys):
    tree = write_tree(tmp_path / "v", "vllm", (upstream.VLLM_033,))
    (tree / "vllm/v1/attention/ops/rocm_paged_mxfp4_indexer.py").write_text("def broken(:\n")
    rc, out = run_check(capsys, "--vllm", str(tree))
    assert rc == 1 and "cannot parse" in out


def test_check_reads_a_wheel_without_extracting_it(tmp_path, vllm_tree, capsys):
    whl = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for p in vllm_tree.rglob("*.py"):
            z.write(p, p.relative_to(vllm_tree).as_posix())
    rc, out = run_check(capsys, "--vllm", str(whl))
    assert rc == 0, out
    assert "vllm 0.33.0" in out                        # the _version.py inside wins over the name


@pytest.mark.parametrize("make,says", [
    (lambda tmp: str(tmp / "nowhere"), "no such file or directory"),
    (lambda tmp: str((tmp / "empty").mkdir() or tmp / "empty"), "holds no vllm/"),
    (lambda tmp: str((tmp / "x.whl").write_bytes(b"not a zip") and tmp / "x.whl"), "not a readable wheel"),
    (lambda tmp: str((tmp / "x.txt").write_text("") or tmp / "x.txt"), "neither a directory nor a .whl"),
])
def test_unusable_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, make, says):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rc, out = run_check(capsys, "--vllm", make(tmp_path))
    assert rc == 2 and says in out and len(out.strip().splitlines()) == 1, out


def test_check_without_a_fetch_says_how_to_get_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rc, out = run_check(capsys)
    assert rc == 2 and "run `mxval upstream fetch --vllm 0.34.0`" in out and len(out.strip().splitlines()) == 1


# --- fetch ---------------------------------------------------------------------------------

@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """pip download, replaced: writes a wheel of a synthetic vLLM (plus files the table does
    not name) into the destination; `calls` counts the downloads."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tree = write_tree(tmp_path / "src", "vllm", (upstream.VLLM_033,))
    (tree / "vllm" / "big_unrelated.py").write_text("x = 1\n")
    calls = []

    def pip(version, dest):
        calls.append(version)
        if version != "0.33.0":
            raise uc.UpstreamError(f"vllm=={version}: no such release on the package index (ERROR: ...)")
        with zipfile.ZipFile(Path(dest) / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as z:
            for p in tree.rglob("*.py"):
                z.write(p, p.relative_to(tree).as_posix())
    monkeypatch.setattr(uc, "_pip_download", pip)
    monkeypatch.setattr(uc, "_pip_versions", lambda: ["0.33.0", "0.32.1", "0.33.0rc1"])
    return calls


def test_fetch_extracts_only_the_table_files_and_is_a_no_op_when_cached(fake_index, capsys, tmp_path):
    assert main(["upstream", "fetch"]) == 0
    root = tmp_path / "cache" / "mxval" / "upstream" / "vllm-0.33.0"
    got = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    want = sorted({uc.module_files(t.module)[0] for t in upstream.targets("vllm")
                   if upstream.VLLM_033 in t.versions} | {"vllm/_version.py"})
    assert got == want and fake_index == ["0.33.0"]
    manifest = json.loads((root / ".mxval-manifest.json").read_text())
    assert manifest["modules"]["vllm.models.deepseek_v4.amd.mxfp4_indexer"] is None    # not in this release
    capsys.readouterr()
    assert main(["upstream", "fetch", "--vllm", "0.33.0"]) == 0
    assert fake_index == ["0.33.0"] and "cached" in capsys.readouterr().out
    assert run_check(capsys, "--vllm", "0.33.0")[0] == 0      # check reads the fetched tree
    (root / "vllm/_version.py").unlink()                # a damaged cache is fetched again, from the wheel
    assert main(["upstream", "fetch"]) == 0 and (root / "vllm/_version.py").is_file() and fake_index == ["0.33.0"]


def test_fetch_without_a_version_takes_the_newest_release_and_says_what_the_table_knows(monkeypatch):
    from rich.console import Console
    con = Console(record=True, width=300)
    newer = ["0.99.0", "0.33.0", "0.100.0rc1"]
    assert uc.newest_release(con, versions=lambda: newer) == "0.99.0"
    out = con.export_text()
    assert f"the table knows {', '.join(upstream.known_releases('vllm'))}" in out
    assert "0.99.0 is newer: `mxval upstream check --vllm 0.99.0` says what moved" in out
    assert uc.newest_release(con, versions=lambda: [upstream.newest("vllm")]) == upstream.newest("vllm")


def test_fetch_of_an_unknown_or_malformed_version_is_one_line(fake_index, capsys):
    assert main(["upstream", "fetch", "--vllm", "9.9.9"]) == 2
    err = capsys.readouterr().err
    assert "vllm==9.9.9: no such release" in err and len(err.strip().splitlines()) == 1
    assert main(["upstream", "fetch", "--vllm", "latest; rm -rf /"]) == 2
    assert "not a version" in capsys.readouterr().err


@pytest.mark.parametrize("stderr,says", [
    ("WARNING: Retrying ... NewConnectionError('Failed to establish a new connection')\n"
     "ERROR: Could not find a version that satisfies the requirement vllm==0.33.0 (from versions: none)\n",
     "cannot reach the package index (offline?)"),
    ("ERROR: Could not find a version that satisfies the requirement vllm==0.0.1 (from versions: 0.33.0)\n"
     "ERROR: No matching distribution found for vllm==0.0.1\n", "no such release on the package index"),
    ("ERROR: Exception: disk full\n", "pip download failed: ERROR: Exception: disk full"),
])
def test_pip_failures_are_named(monkeypatch, tmp_path, stderr, says):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, None, stderr))
    with pytest.raises(uc.UpstreamError, match=says.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        uc._pip_download("0.33.0", tmp_path)


# --- upstream trees are data until verified ---------------------------------------------------

def _git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin"})


@pytest.mark.skipif(__import__("shutil").which("git") is None, reason="needs git")
def test_fetch_aiter_takes_a_pinned_ref_from_git_and_records_the_hashes(tmp_path, monkeypatch, capsys):
    import fake_upstream as F
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MXVAL_AITER_SRC", raising=False)
    repo = F.write_aiter_tree(tmp_path / "repo")
    (repo / "aiter" / "unrelated.py").write_text("raise SystemExit('never read')\n")
    _git("init", "-q", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("commit", "-qm", "one", cwd=repo)
    first = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    (repo / "aiter/ops/triton/utils/logger.py").write_text("# moved on\n")
    _git("commit", "-qam", "two", cwd=repo)
    assert main(["upstream", "fetch", "--aiter", first, "--aiter-url", str(repo)]) == 0
    out = capsys.readouterr().out
    root = tmp_path / "cache" / "mxval" / "upstream" / f"aiter-{first}"
    assert (root / "aiter/ops/triton/utils/logger.py").read_text() == F.AITER_TREE["aiter/ops/triton/utils/logger.py"]
    assert not (root / "aiter/unrelated.py").exists()
    manifest = json.loads((root / ".mxval-manifest.json").read_text())
    assert manifest["commit"] == first and manifest["git"] == str(repo)
    assert manifest["sha256"] == {rel: hashlib.sha256(text.encode()).hexdigest()       # the first commit's files
                                  for rel, text in F.AITER_TREE.items() if rel.endswith(".py")}
    assert "not pinned by optimized/upstream.py" in out and "--trust-upstream" in out
    from optimized.vllm_kernels.source import find_source
    assert find_source(package="aiter", version=first).root == root
    assert find_source(package="aiter").root == root            # the tree fetched last is the default
    assert main(["upstream", "fetch", "--aiter", "no-such-ref", "--aiter-url", str(repo)]) == 2
    assert "cannot fetch" in capsys.readouterr().err
    marker = tmp_path / "ran"
    assert main(["upstream", "fetch", f"--aiter=--upload-pack=touch {marker}", "--aiter-url", str(repo)]) == 2
    assert "not a git ref or an archive file" in capsys.readouterr().err and not marker.exists()


def test_fetch_never_writes_through_a_symlinked_cache_dir(fake_index, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "cache" / "mxval" / "upstream" / "vllm-0.33.0"
    root.mkdir(parents=True)
    (root / "vllm").symlink_to(outside)
    assert main(["upstream", "fetch", "--vllm", "0.33.0"]) == 2
    assert "a symlink inside the upstream cache" in capsys.readouterr().err
    assert list(outside.iterdir()) == []


def test_a_zip_bomb_version_file_is_refused_unread(tmp_path, capsys):
    whl = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("vllm/__init__.py", "")
        with z.open("vllm/_version.py", "w", force_zip64=True) as f:
            chunk = b"#" * (1 << 20)
            for _ in range(64):                       # 64 MiB of comment, a few kB compressed
                f.write(chunk)
    rc, out = run_check(capsys, "--vllm", str(whl))
    assert rc == 2 and "more than" in out and "not read" in out and len(out.strip().splitlines()) == 1


def test_a_deep_expression_is_refused_not_a_crash(tmp_path, capsys):
    tree = write_tree(tmp_path / "v", "vllm", (upstream.VLLM_033,))
    f = tree / "vllm/v1/attention/ops/common.py"
    f.write_text("x = " + "+".join(["1"] * 200_000) + "\n" + f.read_text())
    rc, out = run_check(capsys, "--vllm", str(tree))
    assert rc == 1 and "nested too deeply to parse" in out
    from optimized.vllm_kernels.loader import KernelRef, Loader, LoadError
    from optimized.vllm_kernels.source import find_source
    with pytest.raises(LoadError, match="nested too deeply to parse"):
        Loader(find_source(str(tree), trusted=True).read).resolve([KernelRef("vllm.v1.attention.ops.common",
                                                                             "pack_ue8m0_x4")])


def test_check_runs_nothing_it_reads(tmp_path, capsys):
    marker = tmp_path / "ran"
    hostile = f"import os\nos.system('touch {marker}')\nopen({str(marker)!r}, 'w').close()\n"
    tree = write_tree(tmp_path / "v", "vllm", (upstream.VLLM_033,))
    for p in tree.rglob("*.py"):
        p.write_text(hostile + p.read_text())
    rc, _ = run_check(capsys, "--vllm", str(tree))
    assert rc == 0 and not marker.exists()


def test_backends_runs_nothing_from_a_named_vllm_tree(tmp_path, monkeypatch, capsys):
    """A kernel decorator that runs a command: `mxval backends` (which builds every backend)
    must not run it, trusted or not; an untrusted tree is refused outright."""
    from optimized.vllm_kernels import kernelset
    marker = tmp_path / "ran"
    tree = write_tree(tmp_path / "v", "vllm", (upstream.VLLM_033,))
    for p in tree.rglob("*.py"):
        p.write_text(p.read_text().replace("import triton\n", "import triton\nimport triton.language as tl\n", 1))
    f = tree / (upstream.target("vllm.cuda.k_mxfp4").module.replace(".", "/") + ".py")
    f.write_text(f.read_text().replace("@triton.jit\n", f"@triton.jit(repr=open({str(marker)!r}, 'w').close())\n", 1))
    monkeypatch.setenv("MXVAL_VLLM_SRC", str(tree))
    kernelset._CACHE.clear()
    assert main(["backends", "--check"]) == 0
    assert "refused" in capsys.readouterr().out and not marker.exists()
    monkeypatch.setenv("MXVAL_TRUST_UPSTREAM", "1")
    kernelset._CACHE.clear()
    assert main(["backends", "--check"]) == 0
    capsys.readouterr()
    assert not marker.exists()
    ks = kernelset.kernel_set(interpreted=True)
    assert not marker.exists()
    ks.kernels["vllm.cuda.k_mxfp4"]                  # first use compiles the selected definitions
    assert marker.exists()
    kernelset._CACHE.clear()
