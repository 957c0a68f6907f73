"""The multi-GPU training path on two CPU processes: ``tools/multi_gpu.sh --cpu --local``
builds the noarch CPU variant, and ``accelerate launch`` (benchmarks/fsdp2.yaml, gloo) runs
TRL's SFTTrainer in two ranks that each load the kernel through transformers
(``attn_implementation="<repo>@v3"``, LOCAL_KERNELS) -- the launcher, the config and the
distributed bookkeeping of benchmarks/train_trl.py that the 2-GPU FSDP2 run uses.

[Note] Tolerance. ours, sdpa and eager (transformers' matmul-softmax attention) train from
the same initial weights on the same shards, so their loss curves differ only by attention
numerics compounded through bf16 training. The curve of ours may stray from sdpa's by at
most twice as far as eager's does, plus a floor of a few bf16 rounding steps of the loss.
A wrong document mask or a broken backward moves the first loss by ~1e-2 and the later ones
by far more.

[Note] CPU time. On a 2-core CPU without bf16 matrix instructions (AVX2 only) a --tiny run
trains at ~12 tokens/s in bf16: six steps of 256-token rows took ~270 s in one process, and
the first of the three runs alone outlasted the former 240 s guard for all three. With rows
of 128 tokens the whole test took 442 s there; the 600 s guard only catches a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

for _module in ("trl", "accelerate", "datasets"):
    pytest.importorskip(_module, reason=f"the SFT training path needs {_module}")

REPO = Path(__file__).resolve().parent.parent
STEPS = 6
MAX_LENGTH = 128  # packed row length: half of --tiny's, for CPUs without bf16 matmul units
FLOOR = 1e-4  # nats/token


def _gap(curves: dict, impl: str) -> float:
    return max(abs(curves[impl][s] - curves["sdpa"][s]) for s in curves["sdpa"])


def test_two_cpu_processes_ours_trains_like_sdpa(tmp_path):
    out, build = tmp_path / "out", tmp_path / "build"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), BUILD_DIR=str(build), NPROC="2",
               IMPLS="ours,sdpa,eager", OMP_NUM_THREADS="1", TRAIN_TIMEOUT="600")
    # [Note] CPU time: rows of 128 tokens, and a hang guard, not a speed bound, for the three runs
    proc = subprocess.run(["bash", "tools/multi_gpu.sh", "--cpu", "--local", "--", "--steps", str(STEPS),
                           "--max-length", str(MAX_LENGTH)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=660)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"

    data = json.loads((out / "train" / "train.json").read_text())
    assert data["env"]["world_size"] == 2 and data["env"]["backend"] == "gloo"
    results = {r["impl"]: r for r in data["results"]}
    assert sorted(results) == ["eager", "ours", "sdpa"]
    for impl, r in results.items():
        assert "error" not in r, f"{impl}: {r['error']}\n{r.get('traceback', '')}"
        assert r["distributed"] == "MULTI_CPU"  # accelerate has no FSDP without an accelerator
        assert [m["rank"] for m in r["ranks"]] == [0, 1]
        assert [s for s, _ in r["losses"]] == list(range(1, STEPS + 1))
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
    for m in results["ours"]["ranks"]:  # every rank ran the kernel from the fresh build
        assert [Path(k["path"]).parent for k in m["kernel"]] == [build], m
    assert results["ours"]["kernel_module"][0].startswith("_flash_attn_cpu_")

    curves = {impl: dict(r["losses"]) for impl, r in results.items()}
    ours, eager = _gap(curves, "ours"), _gap(curves, "eager")
    assert ours <= 2 * eager + FLOOR, (
        f"max |loss(ours) - loss(sdpa)| = {ours:.2e} over {STEPS} steps; eager's is {eager:.2e} "
        f"(bound 2 * eager + {FLOOR:g})")
    assert (out / "train" / "TRAIN.md").is_file() and (out / "train" / "loss.png").is_file()
