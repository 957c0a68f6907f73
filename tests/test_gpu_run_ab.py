"""`scripts/gpu_run.sh ab`: the A/B of a CUDA change, run on a copy of the repository with the
GPU steps replaced by stand-ins (the build copies the backward's tile table into build/, the
timing reads it back), so that the shell logic is what is tested: the base build moved aside,
the patch applied and regenerated, the builds timed alternately, and the table."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Stands in for python3: `-m flash_attn_hub build` "builds" by copying the generated tile table;
# scripts/kernel_times.py prints the real script's lines, 10% slower for a 3-stage table.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [[ $1 == -m && $2 == flash_attn_hub && $3 == build ]]; then
  mkdir -p build/variant && cp csrc/hopper/bwd_tile_sizes.h build/variant/ && echo build/variant
  exit 0
fi
if [[ $1 == scripts/kernel_times.py ]]; then
  us=1000; grep -q "kBlockN = 128, kStages = 3" "$3/variant/bwd_tile_sizes.h" && us=1100
  echo "B=4 S=4096 H=16/16 D=128 causal=False bf16, 10 calls each; GPU stand-in"
  echo "ours-cuda bwd: $((us + 50)).0 us of kernels per call (1 TFLOP/s), 1 us per call timed"
  echo "     $us.0 us    1x   95.0%  void flash::hopper::bwd_kernel<stand-in>"
  echo "         50.0 us    1x    5.0%  void flash::hopper::bwd_prep<stand-in>"
  echo "sdpa-cudnn bwd: 900.0 us of kernels per call (1 TFLOP/s), 1 us per call timed"
  echo "       900.0 us    1x  100.0%  cudnn_stand_in"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (diff, apply)")
def test_ab_phase(tmp_path):
    tree = tmp_path / "tree"
    for part in ("scripts", "csrc", "torch-ext"):
        shutil.copytree(REPO / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "build.toml", tree / "build.toml")
    # the change: three pipeline stages at D=128 in generate.py's table only (the generated
    # header is left to the phase's regeneration)
    gen = tree / "csrc/hopper/generate.py"
    original = gen.read_text()
    assert "128: (64, 64, 128, 2," in original
    changed = tmp_path / "changed.py"
    changed.write_text(original.replace("128: (64, 64, 128, 2,", "128: (64, 64, 128, 3,"))
    diff = subprocess.run(["git", "diff", "--no-index", "--", str(gen), str(changed)],
                          capture_output=True, text=True).stdout
    # paths relative to the repository root, as `git diff main branch` writes them
    diff = diff.replace(f"a{gen}", "a/csrc/hopper/generate.py").replace(
        f"b{changed}", "b/csrc/hopper/generate.py")
    patch = tmp_path / "change.patch"
    patch.write_text(diff)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text(FAKE_PYTHON)
    (fake_bin / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
           "REAL_PYTHON": sys.executable, "OUT": str(out), "AB_PATCH": str(patch),
           "AB_BASE_DIR": str(tmp_path / "base"), "AB_REPS": "2",
           "KT_ARGS": "--head-dim 128; --head-dim 128 --causal"}
    run = subprocess.run(["bash", str(tree / "scripts/gpu_run.sh"), "ab"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    table = (out / "ab-table.md").read_text().splitlines()
    assert len(table) == 2 + 2, table  # header, rule, one row per workload
    assert table[2] == ("| --head-dim 128 | bwd | 1050 / 1000 | 1150 / 1100 | +10.0% "
                        "| 900-900 |")
    assert table[3].startswith("| --head-dim 128 --causal | bwd |")
    # the tree stays patched and build/ holds the patched build; the base build moved aside
    assert "kStages = 3" in (tree / "csrc/hopper/bwd_tile_sizes.h").read_text()
    assert "kBlockN = 128, kStages = 3" in (tree / "build/variant/bwd_tile_sizes.h").read_text()
    assert "kBlockN = 128, kStages = 3" not in \
        (tmp_path / "base/build/variant/bwd_tile_sizes.h").read_text()
    with tarfile.open(out / "logs.tgz") as tar:
        log = tar.extractfile("ab.log").read().decode()
    assert log.count("== exp rep") == log.count("== base rep") == 4


def test_ab_phase_without_patch(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "AB_PATCH": str(tmp_path / "missing.patch")}
    run = subprocess.run(["bash", str(REPO / "scripts/gpu_run.sh"), "ab"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "AB_PATCH names no file" in run.stdout
