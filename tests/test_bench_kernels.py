"""``benchmarks/benchmark.py`` runs under the ``kernels benchmark`` runner (kernels 0.17.2),
here on CPU with the shapes the script shrinks for a CPU; it stays runnable from a Hub
snapshot, where it stands alone. The project's harness calls our API with the same
conventions, through its own code."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import torch

from flash_attn_hub import REPO_ROOT
from flash_attn_hub.bench import providers
from flash_attn_hub.bench.workloads import Workload, make_inputs

SCRIPT = REPO_ROOT / "benchmarks" / "benchmark.py"


def test_kernels_benchmark_script_runs_and_verifies(flash_attn):
    from kernels.cli.benchmark import run_benchmark_script
    variant = Path(flash_attn.__file__).parent
    results, _ = run_benchmark_script(SCRIPT, iterations=2, warmup=1, cwd=REPO_ROOT, repo_id=str(variant),
                                      is_local=True, revision="local")
    classes = {name.split(".")[0] for name in results}
    assert classes == {"FlashAttentionBenchmark", "FlashAttentionCausalBenchmark", "FlashAttentionGQABenchmark",
                       "FlashAttentionVarlenBenchmark", "FlashAttentionBackwardBenchmark"}
    assert all(timing.verified for timing in results.values())


def test_script_imports_only_what_a_hub_snapshot_has():
    """A Hub snapshot holds build/ and benchmarks/ only: no flash_attn_hub, no tests/."""
    tree = ast.parse(SCRIPT.read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module}
    assert roots <= {"__future__", "torch", "kernels"} | set(sys.stdlib_module_names), roots


def test_harness_calls_our_flash_attn_2_api(monkeypatch):
    calls = []
    module = types.SimpleNamespace(
        flash_attn_func=lambda q, k, v, **kw: calls.append(kw) or (q, None),
        flash_attn_varlen_func=lambda q, k, v, cu_q, cu_k, max_q, max_k, **kw: calls.append((max_q, max_k, kw)) or q)
    w = Workload("t", 1, 4, 4, 2, 2, 8, True)
    x = make_inputs(w, device="cpu", dtype=torch.float32, seed=0)
    assert providers.Ours(module, "triton").prepare(w, x).fwd() is x.q  # the tuple's first element
    assert calls == [{"causal": True, "window_size": (-1, 0)}]
    v = Workload("t", 2, 5, 5, 2, 1, 8, True, seqlens=(3, 5))
    xv = make_inputs(v, device="cpu", dtype=torch.float32, seed=0)
    assert providers.Ours(module, "triton").prepare(v, xv).fwd() is xv.q
    assert calls[-1] == (5, 5, {"causal": True, "window_size": (-1, 0)})
