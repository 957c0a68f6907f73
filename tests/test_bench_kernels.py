"""``benchmarks/benchmark.py`` runs under the ``kernels benchmark`` runner (kernels 0.17.2),
here on CPU with the shapes the script shrinks for a CPU."""

from __future__ import annotations

from pathlib import Path

from flash_attn_hub import REPO_ROOT


def test_kernels_benchmark_script_runs_and_verifies(flash_attn):
    from kernels.cli.benchmark import run_benchmark_script
    variant = Path(flash_attn.__file__).parent
    results, _ = run_benchmark_script(REPO_ROOT / "benchmarks" / "benchmark.py", iterations=2, warmup=1,
                                      cwd=REPO_ROOT, repo_id=str(variant), is_local=True, revision="local")
    classes = {name.split(".")[0] for name in results}
    assert classes == {"FlashAttentionBenchmark", "FlashAttentionCausalBenchmark", "FlashAttentionGQABenchmark",
                       "FlashAttentionVarlenBenchmark", "FlashAttentionBackwardBenchmark"}
    assert all(timing.verified for timing in results.values())
