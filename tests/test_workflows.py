"""Repository checks of the GitHub workflows: linters, the build trigger, the GPU test matrix.

* ``actionlint`` and ``zizmor --offline`` pass on ``.github/workflows/`` (skipped, with the
  reason, only when a binary is missing);
* the build workflow's ``paths:`` filter matches every file ``build.toml`` compiles
  (``[torch].src`` and every ``[kernel.*].src``), so no source change skips the build;
* the GPU test matrix lists exactly the CUDA variants ``build.toml`` produces, named the way
  the build tooling names them (``flash_attn_hub.variant``);
* ``flake.nix`` stays kernel-builder's template (parsed, not compared byte for byte);
* every script the workflows and ``.ci/run`` run exists, and every ``python -m flash_attn_hub``
  command they call is one the CLI has (a moved or renamed tool fails here, not in CI).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flash_attn_hub import REPO_ROOT, build_config, cli, variant

WORKFLOWS = REPO_ROOT / ".github" / "workflows"
BUILD_WORKFLOW = WORKFLOWS / "build.yml"
TEST_WORKFLOW = WORKFLOWS / "gpu-test.yml"
# The CUDA toolkit kernel-builder builds the CUDA variants with (build.toml does not name
# it; the stable-ABI variant built with 13.0 loads on any CUDA 13.x system).
BUILD_CUDA_VERSIONS = ("13.0",)


def _tool(name: str) -> str | None:
    """``name`` from the running interpreter's bin folder (the venv), else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.is_file() else shutil.which(name)


def _load(path: Path) -> dict:
    # YAML 1.1 reads the key `on` as True; normalise it back.
    data = yaml.safe_load(path.read_text())
    if True in data:
        data["on"] = data.pop(True)
    return data


def _glob_matches(pattern: str, path: str) -> bool:
    """GitHub's ``paths:`` filter semantics for the patterns we use: ``**`` spans folders,
    ``*`` stays within one."""
    regex = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            regex += ".*"
            i += 2
        elif pattern[i] == "*":
            regex += "[^/]*"
            i += 1
        else:
            regex += re.escape(pattern[i])
            i += 1
    return re.fullmatch(regex, path) is not None


def expected_cuda_variants(config: build_config.BuildConfig) -> list[str]:
    """The CUDA variant names a build of ``config`` publishes, as ``build.build_variant``
    names them: the stable-ABI name when there is a CUDA kernel and a stable-ABI version,
    else the noarch ``torch-cuda``."""
    if "cuda" not in config.backends:
        return []
    abi = config.stable_abi.get("cuda")
    if config.kernels_for("cuda") and abi:
        return sorted(variant.stable_abi_name(abi, cuda) for cuda in BUILD_CUDA_VERSIONS)
    return [variant.noarch_name("cuda")]


@pytest.mark.parametrize("tool,args", [
    ("actionlint", []),
    ("zizmor", ["--offline", "--persona", "pedantic"]),
])
def test_linter_passes(tool, args):
    binary = _tool(tool)
    if binary is None:
        pytest.skip(f"{tool} is not installed (in the venv's bin or on PATH)")
    files = sorted(str(p) for p in WORKFLOWS.glob("*.yml"))
    result = subprocess.run([binary, *args, *files], capture_output=True, text=True, timeout=60,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, f"{tool} failed:\n{result.stdout}\n{result.stderr}"


def test_build_trigger_covers_every_compiled_source():
    config = build_config.load()
    push = _load(BUILD_WORKFLOW)["on"]["push"]
    patterns = push["paths"]
    sources = config.source_files()
    assert sources, "build.toml names no source files"
    uncovered = [src for src in sources if not any(_glob_matches(p, src) for p in patterns)]
    assert not uncovered, f"build.yml push.paths {patterns} miss build.toml sources {uncovered}"
    for path in ("build.toml", "flake.nix", "flake.lock", "torch-ext/flash_attn/__init__.py"):
        assert any(_glob_matches(p, path) for p in patterns), f"build.yml push.paths miss {path}"
    assert push["branches"] == ["main"]
    assert "workflow_dispatch" in _load(BUILD_WORKFLOW)["on"]


def test_glob_semantics():
    assert _glob_matches("csrc/**", "csrc/hopper/instantiations/fwd_bf16_d64.cu")
    assert not _glob_matches("csrc/*", "csrc/hopper/fwd_run.h")
    assert not _glob_matches("build.toml", "sub/build.toml")


def test_gpu_matrix_equals_published_cuda_variants():
    config = build_config.load()
    matrix = _load(TEST_WORKFLOW)["jobs"]["test"]["strategy"]["matrix"]["variant"]
    expected = expected_cuda_variants(config)
    assert sorted(matrix) == expected, (
        f"gpu-test.yml matrix {sorted(matrix)} != the CUDA variants build.toml produces {expected}")
    for name in matrix:
        variant.parse(name)


def test_build_passes_published_sha_to_gpu_test():
    build = _load(BUILD_WORKFLOW)["jobs"]
    assert "sha" in build["build"]["outputs"]
    call = build["gpu-test"]
    assert call["needs"] == "build"
    assert call["uses"] == "./.github/workflows/gpu-test.yml"
    assert call["with"]["revision"] == "${{ needs.build.outputs.sha }}"
    assert call["secrets"] == {"HF_TOKEN": "${{ secrets.HF_TOKEN }}"}


def test_workflows_keep_secrets_and_credentials_tight():
    for path in WORKFLOWS.glob("*.yml"):
        data = _load(path)
        text = path.read_text()
        assert data.get("permissions") == {}, f"{path.name}: top-level permissions must be {{}}"
        assert "set -x" not in text, f"{path.name}: set -x would echo secrets"
        used = set(re.findall(r"secrets\.(\w+)", text))
        assert used <= {"HF_TOKEN"}, f"{path.name}: only secrets.HF_TOKEN may be used, found {sorted(used)}"
        for job_name, job in data["jobs"].items():
            for step in job.get("steps", []):
                run = step.get("run", "")
                assert "secrets." not in run, f"{path.name}:{job_name}: pass secrets through env"
                if step.get("uses", "").startswith("actions/checkout@"):
                    assert re.fullmatch(r"actions/checkout@[0-9a-f]{40}", step["uses"])
                    assert step.get("with", {}).get("persist-credentials") is False


def _nix_tokens(text: str) -> str:
    """flake.nix without comments, whitespace collapsed."""
    text = re.sub(r"#[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"\s+", " ", text).strip()


def test_flake_is_the_kernel_builder_template():
    path = REPO_ROOT / "flake.nix"
    if not path.is_file():
        pytest.fail("flake.nix is missing (kernel-builder's template is required)")
    flake = _nix_tokens(path.read_text())
    url = re.search(r'kernel-builder\.url\s*=\s*"([^"]+)"\s*;', flake) or re.search(
        r'kernel-builder\s*=\s*\{[^}]*url\s*=\s*"([^"]+)"', flake)
    assert url, "flake.nix: no input kernel-builder.url"
    assert url.group(1) == "github:huggingface/kernels", f"flake.nix: kernel-builder.url = {url.group(1)!r}"
    call = re.search(r"kernel-builder\.lib\.genKernelFlakeOutputs\s*\{([^}]*)\}", flake)
    assert call, "flake.nix: outputs must come from kernel-builder.lib.genKernelFlakeOutputs { ... }"
    args = {a.strip() for a in call.group(1).split(";") if a.strip()}
    assert "inherit self" in args, f"flake.nix: genKernelFlakeOutputs args {sorted(args)} lack `inherit self`"
    assert any(re.fullmatch(r"path\s*=\s*\./\.", a) for a in args), \
        f"flake.nix: genKernelFlakeOutputs args {sorted(args)} lack `path = ./.`"
    assert re.search(r"outputs\s*=\s*\{[^}]*\bself\b[^}]*\bkernel-builder\b[^}]*\}\s*:", flake), \
        "flake.nix: outputs must take { self, kernel-builder, ... }"


def test_workflows_run_only_files_and_commands_that_exist():
    texts = {path.relative_to(REPO_ROOT).as_posix(): path.read_text()
             for path in [*sorted(WORKFLOWS.glob("*.yml")), REPO_ROOT / ".ci" / "run"]}
    scripts, commands = set(), set()
    for name, text in texts.items():
        scripts |= {(name, m) for m in re.findall(r"(?:bash|python3?|/python)\s+([\w./-]+\.(?:sh|py))\b", text)}
        commands |= {(name, m) for m in re.findall(r"-m flash_attn_hub\s+(\w+)", text)}
    assert scripts and commands, "the patterns found nothing: they no longer match how the files call things"
    missing = sorted((name, path) for name, path in scripts if not (REPO_ROOT / path).is_file())
    assert not missing, f"workflows run files that do not exist: {missing}"
    unknown = sorted((name, cmd) for name, cmd in commands if cmd not in cli.COMMANDS)
    assert not unknown, f"workflows call flash_attn_hub commands that do not exist: {unknown}"
