"""The build: variant names kernels accepts, metadata and digest through kernels' own API, a
unique ops namespace per build, a no-op rebuild, and (with nvcc) a compile of the CUDA sources."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flash_attn_hub import REPO_ROOT, build, build_config, build_cuda, variant

PACKAGE = REPO_ROOT / "torch-ext" / "flash_attn"
NAMESPACE_RE = re.compile(r"^_flash_attn_cpu_[0-9a-f]{7}(_dirty)?$")


def _quiet(_line: str) -> None:
    pass


@pytest.fixture(scope="module")
def cpu_build(tmp_path_factory):
    """The noarch CPU variant of the repository, built once for this module."""
    out = tmp_path_factory.mktemp("repo") / "build"
    return build.build_variant(out, backend="cpu", log=_quiet)


def _repo_copy(tmp_path: Path) -> Path:
    """A copy of the sources a noarch build reads (not a git checkout)."""
    root = tmp_path / "src"
    shutil.copytree(PACKAGE, root / "torch-ext" / "flash_attn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "build.toml", root / "build.toml")
    return root


@pytest.mark.kernels_ci
def test_noarch_variant_layout(cpu_build):
    assert cpu_build.name == "torch-cpu"
    def files(root):
        return {p.relative_to(root).as_posix() for p in root.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    expected = {name for name in files(PACKAGE) if name.endswith((".py", ".json"))}
    assert "_triton/fwd.py" in expected and "_triton/triton_fwd_configs.json" in expected
    assert files(cpu_build) == expected | {"_ops.py", "metadata.json"}
    assert not list(cpu_build.rglob("*.so"))


@pytest.mark.kernels_ci
def test_metadata_and_digest_read_by_kernels(cpu_build):
    from kernels._rust import Digest, DigestAlgorithm, Metadata

    raw = json.loads((cpu_build / "metadata.json").read_text())
    for key in ("name", "id", "version", "license", "python-depends", "backend", "digest", "provenance"):
        assert key in raw, key
    meta = Metadata.read_from_file(cpu_build / "metadata.json")
    config = build_config.load()
    assert str(meta.name) == "flash-attn" and meta.version == config.version == 3
    assert meta.license == "BSD-3-Clause"
    assert meta.python_depends == []
    assert str(meta.backend.backend_type) in ("cpu", "CPU") and meta.backend.archs is None
    assert NAMESPACE_RE.match(meta.id), meta.id
    meta.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, cpu_build))
    shipped = {p.relative_to(cpu_build).as_posix() for p in cpu_build.rglob("*") if p.is_file()}
    assert set(meta.digest.files) == shipped - {"metadata.json"}
    git = variant.git_state(REPO_ROOT)
    assert meta.provenance.kernel.commit == git.commit
    assert meta.provenance.kernel.dirty == git.dirty


@pytest.mark.kernels_ci
def test_ops_module_names_the_build_namespace(cpu_build):
    meta = json.loads((cpu_build / "metadata.json").read_text())
    namespace = meta["id"]
    git = variant.git_state(REPO_ROOT)
    assert namespace == f"_flash_attn_cpu_{git.uid}"
    assert namespace.endswith("_dirty") == git.dirty
    text = (cpu_build / "_ops.py").read_text()
    assert f"ops = torch.ops.{namespace}\n" in text
    assert "from . import" not in text  # no compiled extension in a noarch build
    scope: dict = {}
    exec(compile(text, "_ops.py", "exec"), scope)
    assert scope["add_op_namespace_prefix"]("fwd") == f"{namespace}::fwd"


@pytest.mark.kernels_ci
def test_rebuild_of_unchanged_sources_is_a_noop(cpu_build):
    before = {p.name: p.stat().st_mtime_ns for p in cpu_build.iterdir()}
    lines: list[str] = []
    again = build.build_variant(cpu_build.parent, backend="cpu", log=lines.append)
    assert again == cpu_build
    assert any("up to date" in line for line in lines), lines
    assert {p.name: p.stat().st_mtime_ns for p in cpu_build.iterdir()} == before
    assert not [p for p in cpu_build.parent.iterdir() if p.name.startswith(".")]


def test_changed_source_rebuilds_and_redigests(tmp_path):
    from kernels._rust import Metadata

    root = _repo_copy(tmp_path)
    out = tmp_path / "out"
    first = build.build_variant(out, backend="cpu", config_path=root / "build.toml", log=_quiet)
    digest_before = dict(Metadata.read_from_file(first / "metadata.json").digest.files)
    # Outside a git checkout the id is unknown, hence dirty.
    assert json.loads((first / "metadata.json").read_text())["id"] == "_flash_attn_cpu_0000000_dirty"
    (root / "torch-ext" / "flash_attn" / "tuning.json").write_text('{"block": 64}\n')
    second = build.build_variant(out, backend="cpu", config_path=root / "build.toml", log=_quiet)
    assert (second / "tuning.json").read_text() == '{"block": 64}\n'
    digest_after = Metadata.read_from_file(second / "metadata.json").digest.files
    assert set(digest_after) == set(digest_before) | {"tuning.json"}


def test_source_tree_must_not_hold_ops_module(tmp_path):
    root = _repo_copy(tmp_path)
    (root / "torch-ext" / "flash_attn" / "_ops.py").write_text("")
    with pytest.raises(build.BuildError, match="_ops.py"):
        build.build_variant(tmp_path / "out", backend="cpu", config_path=root / "build.toml", log=_quiet)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
                   check=True, capture_output=True)


def test_unique_id_follows_the_git_tree(tmp_path):
    repo = _repo_copy(tmp_path)
    (repo / "notes.txt").write_text("not a build input\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "build.toml", "torch-ext")
    _git(repo, "commit", "-q", "-m", "one")
    clean = variant.git_state(repo)
    tree = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD^{tree}"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert not clean.dirty and clean.uid == tree[:7]  # an untracked non-input file is ignored
    assert len(clean.commit) == 40

    init = repo / "torch-ext" / "flash_attn" / "__init__.py"
    init.write_text(init.read_text() + "\n")
    assert variant.git_state(repo).uid == f"{tree[:7]}_dirty"
    _git(repo, "commit", "-q", "-am", "two")
    second = variant.git_state(repo)
    assert not second.dirty and second.uid != clean.uid

    (repo / "torch-ext" / "flash_attn" / "_new.py").write_text("")  # untracked build input
    assert variant.git_state(repo).dirty


@pytest.mark.kernels_ci
def test_variant_names_are_what_kernels_parses_and_prefers():
    from kernels.backends import CUDA
    from kernels.variants import _resolve_variant_for_system, parse_variant
    from packaging.version import Version

    assert variant.noarch_name("cpu") == "torch-cpu"
    assert variant.noarch_name("cuda") == "torch-cuda"
    name = variant.stable_abi_name("2.11", "13.0")
    cpu, os_name = platform.machine(), platform.system().lower()
    assert name == f"torch-stable-abi211-cu130-{cpu}-{os_name}"
    variants = [parse_variant(n) for n in (name, "torch-cuda", "torch-cpu")]
    accepted, _ = _resolve_variant_for_system(
        variants, selected_backend=CUDA(version=Version("13.0")), cpu=cpu, os=os_name,
        torch_version=Version("2.11"), torch_cxx11_abi=True, tvm_ffi_version=None)
    assert [v.variant_str for v in accepted] == [name, "torch-cuda"]
    with pytest.raises(ValueError):
        variant.parse("torch211-cxx11-cu130")


@pytest.mark.kernels_ci
def test_compile_flags():
    assert build_cuda.gencode_flags(["8.0", "9.0a"]) == [
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a"]
    assert build_cuda.gencode_flags(["10.0+PTX"])[-1] == "arch=compute_100,code=compute_100"
    assert build_cuda.torch_target_version("2.11") == "0x020b000000000000"


def test_forced_cuda_build_names_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(build_cuda, "find_nvcc", lambda: None)
    monkeypatch.setattr(build_cuda, "find_cutlass_include", lambda: None)
    with pytest.raises(build.BuildError) as info:
        build.build_variant(tmp_path, backend="cuda", log=_quiet)
    message = str(info.value)
    assert "nvcc" in message and "CUTLASS" in message and "nvidia-cutlass" in message
    assert not list(tmp_path.iterdir())


def test_auto_build_without_toolkit_falls_back_to_noarch(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "torch_backend", lambda: "cuda")
    monkeypatch.setattr(build_cuda, "find_nvcc", lambda: None)
    lines: list[str] = []
    path = build.build_variant(tmp_path, log=lines.append)
    assert path.name == "torch-cuda"
    assert any("nvcc" in line for line in lines), lines
    assert json.loads((path / "metadata.json").read_text())["backend"] == {"type": "cuda"}


def test_invalid_backend_is_named(tmp_path):
    with pytest.raises(build.BuildError, match="backend"):
        build.build_variant(tmp_path, backend="rocm", log=_quiet)


needs_toolkit = pytest.mark.skipif(
    bool(build_cuda.missing_requirements(build_config.load())),
    reason="needs nvcc, CUTLASS headers and torch stable-ABI headers")


def _smoke_subset(config) -> set[str]:
    """The binding, every non-instantiation source and the first and last instantiation of each
    kernel kind (forward, backward: the ``fwd_``/``bwd_`` prefix), i.e. the smallest and the
    largest head dim, which for the backward are its two decompositions (the head-dim split
    above D=128): each kind of translation unit once (all of them take ~2 min each on 2 cores)."""
    compiled = [s for s in config.source_files() if s.endswith(build_cuda.COMPILED_SUFFIXES)]
    instantiations = [s for s in compiled if "/instantiations/" in s]
    ends_of_kind: dict[str, list[str]] = {}
    for s in instantiations:
        ends_of_kind.setdefault(s.rsplit("/", 1)[-1].split("_", 1)[0], []).append(s)
    chosen = {s for kind in ends_of_kind.values() for s in (kind[0], kind[-1])}
    return {s for s in compiled if s not in instantiations} | chosen


@needs_toolkit
def test_cuda_sources_compile_for_sm90a(tmp_path, monkeypatch):
    """Compiles (fresh cache) the binding, the dispatchers and one forward and one backward
    kernel instantiation for sm_90a, links them, and checks the library's symbol versions. Set
    FLASH_ATTN_HUB_TEST_FULL_CUDA=1 to compile every source for every capability instead."""
    from flash_attn_hub import check_abi

    full = os.environ.get("FLASH_ATTN_HUB_TEST_FULL_CUDA") == "1"
    monkeypatch.setenv("FLASH_ATTN_HUB_CACHE", str(tmp_path / "cache"))
    config = build_config.load()
    toolkit = build_cuda.Toolkit.find(config)
    generated = tmp_path / "cache" / "generated"
    build_cuda._write_generated(generated)
    namespace = "_flash_attn_cuda_compiletest"
    steps = build_cuda.compile_steps(
        config, toolkit, namespace=namespace, abi=config.stable_abi["cuda"], generated=generated,
        capabilities=None if full else ("9.0a",), only=None if full else _smoke_subset(config))
    lines: list[str] = []
    objects = build_cuda.compile_all(steps, toolkit, tmp_path / "cache", jobs=None, log=lines.append)
    assert all(o.is_file() for o in objects)
    library = build_cuda.link(objects, toolkit, tmp_path / "cache", name=namespace, log=lines.append)
    assert [p.rule for p in check_abi.check_library(library)] == []
    # A second pass finds every object cached.
    lines.clear()
    build_cuda.compile_all(steps, toolkit, tmp_path / "cache", jobs=None, log=lines.append)
    assert lines == [f"[build] {len(steps)}/{len(steps)} objects up to date, compiling 0"]
