"""CPU checks of the CUDA sources: generated files are in sync with the tile table, and the
shared-memory layouts the GEMMs read match what the copy engine writes (host-only program)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "csrc" / "hopper" / "generate.py"


@pytest.mark.kernels_ci
def test_generated_sources_are_current():
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, f"run `python {GENERATOR.relative_to(ROOT)}`:\n{result.stdout}"


def _cutlass_include() -> Path | None:
    try:
        import cutlass_library
    except ImportError:
        return None
    path = Path(cutlass_library.__file__).parent / "source" / "include"
    return path if path.is_dir() else None


@pytest.mark.skipif(shutil.which("nvcc") is None or _cutlass_include() is None,
                    reason="needs nvcc and the nvidia-cutlass headers")
def test_smem_layouts_match_copy_engine_boxes(tmp_path):
    exe = tmp_path / "layout_check"
    build = subprocess.run(["nvcc", "-std=c++17", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
                            f"-I{_cutlass_include()}",
                            str(ROOT / "csrc" / "hopper" / "layout_check.cu"), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
