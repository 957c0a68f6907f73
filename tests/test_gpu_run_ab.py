"""`scripts/gpu_run.sh ab` and `abbuild`: the A/B of a stack of CUDA changes, run on copies of
the repository with the GPU steps replaced by stand-ins (the build copies the tile table into
its folder, the timing reads it back), so that the shell logic is what is tested: each patch
applied and regenerated, each build in its folder, builds made ahead reused only where their
sources match, the builds timed alternately, and the table."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Stands in for python3: `-m flash_attn_hub build --backend cuda --out DIR` "builds" by copying
# generate.py and the backward tile header it generates into DIR/variant (and notes the build in
# builds.txt); scripts/kernel_times.py prints the real script's lines, 100 us slower for each
# change the test's patches mark at the end of generate.py ("# stand-in: stages": +100,
# "# stand-in: keys": +200).
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [[ $1 == -m && $2 == flash_attn_hub && $3 == build ]]; then
  out=build; [[ $6 == --out ]] && out=$7
  mkdir -p "$out/variant" && cp csrc/hopper/generate.py csrc/hopper/bwd_tile_sizes.h "$out/variant/"
  echo "$out/variant"
  echo "$out" >>"$BUILD_LOG"
  exit 0
fi
if [[ $1 == scripts/kernel_times.py ]]; then
  us=1000
  grep -q "# stand-in: stages" "$3/variant/generate.py" && us=$((us + 100))
  grep -q "# stand-in: keys" "$3/variant/generate.py" && us=$((us + 200))
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


def _tree(tmp_path: Path, name: str = "tree") -> Path:
    tree = tmp_path / name
    for part in ("scripts", "csrc", "torch-ext", "flash_attn_hub"):
        shutil.copytree(REPO / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "build.toml", tree / "build.toml")
    return tree


def _bwd_row(text: str, head_dim: int) -> str:
    """The numbers that open BWD_TILES's row of ``head_dim`` in generate.py, e.g.
    "128: (64, 64, 128, 2," (the last number is the stages, the one before it kBlockN)."""
    table = text[text.index("BWD_TILES = {"):]
    return re.search(rf"^ *{head_dim}: \((\d+, )+", table, re.M).group(0).strip()


def _with(row: str, index: int, value: int) -> str:
    """``row`` with its number at ``index`` (from the end, as -1 for the stages) set to ``value``."""
    key, numbers = row.split(": (")
    parts = numbers.rstrip(", ").split(", ")
    parts[index] = str(value)
    return f"{key}: ({', '.join(parts)},"


def _patch(tmp_path: Path, name: str, old: str, new: str, base: str | None = None) -> Path:
    """A diff of generate.py with ``old`` replaced by ``new`` (in ``base``, default the
    repository's file) and the line "# stand-in: <name>" added at its end, with paths as
    `git diff main branch` writes them."""
    gen = tmp_path / f"{name}-a.py"
    gen.write_text(base if base is not None else (REPO / "csrc/hopper/generate.py").read_text())
    assert gen.read_text().count(old) == 1
    changed = tmp_path / f"{name}-b.py"
    changed.write_text(gen.read_text().replace(old, new) + f"# stand-in: {name}\n")
    diff = subprocess.run(["git", "diff", "--no-index", "--", str(gen), str(changed)],
                          capture_output=True, text=True).stdout
    diff = diff.replace(f"a{gen}", "a/csrc/hopper/generate.py").replace(
        f"b{changed}", "b/csrc/hopper/generate.py")
    patch = tmp_path / f"{name}.patch"
    patch.write_text(diff)
    return patch


def _run(tmp_path: Path, tree: Path, phases: list[str], **env) -> subprocess.CompletedProcess:
    fake_bin = tmp_path / "bin"
    if not fake_bin.is_dir():
        fake_bin.mkdir()
        (fake_bin / "python3").write_text(FAKE_PYTHON)
        (fake_bin / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
           "REAL_PYTHON": sys.executable, "BUILD_LOG": str(tmp_path / "builds.txt"),
           "AB_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run(["bash", str(tree / "scripts/gpu_run.sh"), *phases], env=env,
                          capture_output=True, text=True, timeout=120)


def _builds(tmp_path: Path) -> list[str]:
    log = tmp_path / "builds.txt"
    return log.read_text().split() if log.is_file() else []


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (diff, apply)")
def test_ab_phase(tmp_path):
    tree = _tree(tmp_path)
    # the change: three pipeline stages at D=128 in generate.py's table only (the generated
    # header is left to the phase's regeneration)
    row = _bwd_row((REPO / "csrc/hopper/generate.py").read_text(), 128)
    patch = _patch(tmp_path, "stages", row, _with(row, -1, 3))
    out = tmp_path / "out"
    run = _run(tmp_path, tree, ["ab"], OUT=str(out), AB_PATCH=str(patch),
               AB_DIR=str(tmp_path / "ab"), AB_REPS="2",
               KT_ARGS="--head-dim 128; --head-dim 128 --causal")
    assert run.returncode == 0, run.stdout + run.stderr
    table = (out / "ab-table.md").read_text().splitlines()
    assert len(table) == 2 + 2, table  # header, rule, one row per workload
    assert table[0].startswith("| workload | mode | base total / main | exp total / main | exp vs")
    assert table[2] == ("| --head-dim 128 | bwd | 1050 / 1000 | 1150 / 1100 | +10.0% "
                        "| 900-900 |")
    assert table[3].startswith("| --head-dim 128 --causal | bwd |")
    # the tree stays patched and build/ holds the patched build; each build has its folder
    assert "kStages = 3" in (tree / "csrc/hopper/bwd_tile_sizes.h").read_text()
    assert "kStages = 3" in (tree / "build/variant/bwd_tile_sizes.h").read_text()
    assert "kStages = 3" in (tmp_path / "ab/exp/build/variant/bwd_tile_sizes.h").read_text()
    assert "kStages = 3" not in (tmp_path / "ab/base/build/variant/bwd_tile_sizes.h").read_text()
    with tarfile.open(out / "logs.tgz") as tar:
        log = tar.extractfile("ab.log").read().decode()
    assert log.count("== exp rep") == log.count("== base rep") == 4
    assert len(_builds(tmp_path)) == 2


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (diff, apply)")
def test_ab_stack_built_ahead(tmp_path):
    """abbuild makes a stack's builds; ab on a fresh copy of the tree reuses those whose sources
    match and rebuilds the others."""
    row = _bwd_row((REPO / "csrc/hopper/generate.py").read_text(), 128)
    stages = _patch(tmp_path, "stages", row, _with(row, -1, 3))
    staged = (tmp_path / "stages-b.py").read_text()
    row = _bwd_row(staged, 64)
    keys = _patch(tmp_path, "keys", row, _with(row, -2, 96), base=staged)
    ab_dir = tmp_path / "ab"
    ahead = _run(tmp_path, _tree(tmp_path, "here"), ["abbuild"], OUT=str(tmp_path / "out1"),
                 AB_PATCH=f"{stages} {keys}", AB_DIR=str(ab_dir))
    assert ahead.returncode == 0, ahead.stdout + ahead.stderr
    assert len(_builds(tmp_path)) == 3
    assert not (tmp_path / "out1" / "ab-table.md").exists()  # abbuild times nothing
    assert {p.name for p in ab_dir.iterdir()} == {"base", "stages", "keys"}

    # the same sources elsewhere: nothing is compiled again
    out = tmp_path / "out2"
    run = _run(tmp_path, _tree(tmp_path, "there"), ["ab"], OUT=str(out),
               AB_PATCH=f"{stages} {keys}", AB_DIR=str(ab_dir), AB_REPS="1",
               KT_ARGS="--head-dim 128")
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(_builds(tmp_path)) == 3, run.stdout
    table = (out / "ab-table.md").read_text().splitlines()
    assert table[0] == ("| workload | mode | base total / main | stages total / main | keys total "
                        "/ main | stages vs base (main) | keys vs stages (main) | cuDNN total |")
    assert table[2] == ("| --head-dim 128 | bwd | 1050 / 1000 | 1150 / 1100 | 1350 / 1300 "
                        "| +10.0% | +18.2% | 900-900 |")

    # a build whose recorded sources differ is made again, and only that one
    (ab_dir / "keys" / "SOURCES").write_text("stale\n")
    run = _run(tmp_path, _tree(tmp_path, "third"), ["ab"], OUT=str(tmp_path / "out3"),
               AB_PATCH=f"{stages} {keys}", AB_DIR=str(ab_dir), AB_REPS="1",
               KT_ARGS="--head-dim 128")
    assert run.returncode == 0, run.stdout + run.stderr
    assert _builds(tmp_path)[3:] == [str(ab_dir / "keys" / "build")]

    # AB_REPS=0: the tree patched and the top build in build/, nothing timed or built
    fifth = _tree(tmp_path, "fifth")
    run = _run(tmp_path, fifth, ["ab"], OUT=str(tmp_path / "out5"),
               AB_PATCH=f"{stages} {keys}", AB_DIR=str(ab_dir), AB_REPS="0")
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(_builds(tmp_path)) == 4
    assert not (tmp_path / "out5" / "ab-table.md").exists()
    assert "# stand-in: keys" in (fifth / "build/variant/generate.py").read_text()
    assert "# stand-in: keys" in (fifth / "csrc/hopper/generate.py").read_text()

    # a source edited below every patch: every build is made again
    fourth = _tree(tmp_path, "fourth")
    kernel = fourth / "csrc/hopper/bwd_kernel.h"
    kernel.write_text(kernel.read_text() + "\n")
    run = _run(tmp_path, fourth, ["ab"], OUT=str(tmp_path / "out4"),
               AB_PATCH=f"{stages} {keys}", AB_DIR=str(ab_dir), AB_REPS="1",
               KT_ARGS="--head-dim 128")
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(_builds(tmp_path)) == 4 + 3
    assert "# stand-in: keys" in (fourth / "build/variant/generate.py").read_text()


def test_ab_phase_without_patch(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "AB_PATCH": str(tmp_path / "missing.patch")}
    run = subprocess.run(["bash", str(REPO / "scripts/gpu_run.sh"), "ab"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert f"AB_PATCH names no file {tmp_path / 'missing.patch'}" in run.stdout


def test_ab_phase_refuses_patches_of_one_name(tmp_path):
    """Builds are named after their patch files, so two of one name (or one called base) would
    share a folder: refused before anything is applied."""
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "fix.patch").write_text("")
    (tmp_path / "base.patch").write_text("")
    for patches in (f"{tmp_path}/a/fix.patch {tmp_path}/b/fix.patch",
                    f"{tmp_path}/base.patch {tmp_path}/a/fix.patch"):
        env = {**os.environ, "OUT": str(tmp_path / "out"), "AB_PATCH": patches}
        run = subprocess.run(["bash", str(REPO / "scripts/gpu_run.sh"), "abbuild"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and "file names must differ" in run.stdout, run.stdout
