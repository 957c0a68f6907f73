"""The benchmark: FLOP counting, ratios, record schema, and the tiny CPU path end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flash_attn_hub.bench import report, runner
from flash_attn_hub.bench.providers import Prepared, Sdpa, make_providers
from flash_attn_hub.bench.workloads import Workload, attention_flops, grid_workloads, packed_lengths, visible_pairs
from reference import visible_mask

REQUIRED = ("provider", "workload", "mode", "dtype", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv",
            "head_dim", "causal", "ms_p20", "ms_p50", "ms_p80", "tflops", "ratio_to_best_peer", "peak_mem_bytes",
            "gpu", "driver", "torch", "cuda", "cudnn", "triton", "git_sha", "date")


@pytest.mark.kernels_ci
def test_flops_follow_the_anchor_rule():
    full = Workload("t", 2, 1024, 1024, 16, 4, 128, False)
    assert attention_flops(full) == 4 * 2 * 16 * 1024 * 1024 * 128  # GQA counts query heads
    causal = Workload("t", 2, 1024, 1024, 16, 4, 128, True)
    assert attention_flops(causal) == attention_flops(full) / 2
    assert attention_flops(causal, "bwd") == 2.5 * attention_flops(causal)
    assert attention_flops(causal, "fwd_bwd") == 3.5 * attention_flops(causal)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("sq, sk, pairs", [(1, 100, 100), (2, 5, 9), (5, 2, 3), (3, 3, 6)])
def test_causal_with_unequal_lengths_counts_visible_pairs(sq, sk, pairs):
    assert visible_pairs(sq, sk, -1, 0) == pairs
    w = Workload("t", 3, sq, sk, 8, 8, 64, True)
    expected = 4 * 3 * 8 * 64 * (pairs if sq != sk else sq * sk / 2)  # square causal: the halving convention
    assert attention_flops(w) == expected


@pytest.mark.kernels_ci
@pytest.mark.parametrize("sq, sk, left, right", [(7, 19, 4, 0), (19, 7, 3, 2), (64, 64, 10, -1), (33, 50, -1, 5),
                                                 (1, 128, 31, 0)])
def test_visible_pairs_match_the_oracle_mask(sq, sk, left, right):
    assert visible_pairs(sq, sk, left, right) == int(visible_mask(sq, sk, left, right).sum())


@pytest.mark.kernels_ci
def test_windowed_and_varlen_flops():
    w = Workload("t", 2, 2048, 2048, 16, 16, 128, True, window_left=511)
    assert attention_flops(w) == 4 * 2 * 16 * 128 * int(visible_mask(2048, 2048, 511, 0).sum())
    lengths = packed_lengths(16384, seed=3)
    assert sum(lengths) == 16384 and min(lengths) >= 1
    v = Workload("t", len(lengths), max(lengths), max(lengths), 16, 16, 128, True, seqlens=lengths)
    assert attention_flops(v) == sum(4 * 16 * 128 * n * n / 2 for n in lengths)


@pytest.mark.kernels_ci
def test_standard_grid_is_the_anchor_grid():
    grid = grid_workloads("standard")
    assert len(grid) == 6 * 3 * 2
    assert all(w.batch * w.seqlen_q == 16384 for w in grid)
    assert {(w.head_dim, w.heads_q) for w in grid} == {(64, 32), (128, 16), (256, 8)}
    assert {w.seqlen_q for w in grid_workloads("standard", seqlens=[1024, 4096], head_dims=[128])} == {1024, 4096}


def _record(provider, tflops, workload="w", mode="fwd"):
    return {"provider": provider, "workload": workload, "mode": mode, "dtype": "bf16", "tflops": tflops}


@pytest.mark.kernels_ci
def test_ratio_is_against_the_best_peer_of_the_same_workload_and_mode():
    records = [_record("ours-cuda", 500.0), _record("ours-triton", 300.0), _record("sdpa-cudnn", 400.0),
               _record("sdpa-flash", 250.0), _record("sdpa-flash", 100.0, mode="bwd"),
               _record("ours-cuda", 50.0, mode="bwd"), _record("ours-cuda", 9.0, workload="alone")]
    runner.add_ratios(records)
    by = {(r["provider"], r["workload"], r["mode"]): r for r in records}
    assert by["ours-cuda", "w", "fwd"]["ratio_to_best_peer"] == pytest.approx(1.25)
    assert by["ours-cuda", "w", "fwd"]["best_peer"] == "sdpa-cudnn"  # ours are never peers
    assert by["ours-triton", "w", "fwd"]["ratio_to_best_peer"] == pytest.approx(0.75)
    assert by["sdpa-cudnn", "w", "fwd"]["ratio_to_best_peer"] == pytest.approx(1.0)
    assert by["ours-cuda", "w", "bwd"]["ratio_to_best_peer"] == pytest.approx(0.5)
    assert by["ours-cuda", "alone", "fwd"]["ratio_to_best_peer"] is None


@pytest.mark.kernels_ci
def test_merge_replaces_remeasured_groups_whole():
    old = [_record("ours-cuda", 1.0), _record("sdpa-cudnn", 2.0), _record("sdpa-cudnn", 3.0, workload="x")]
    new = [_record("ours-cuda", 5.0)]
    merged = report.merge(old, new)
    assert [(r["provider"], r["workload"]) for r in merged] == [("sdpa-cudnn", "x"), ("ours-cuda", "w")]


class _Wrong(Sdpa):
    """SDPA math with its output off by 5%: verification must refuse to time it."""

    def __init__(self):
        super().__init__("math")
        self.name = "wrong"

    def label(self, w):
        return self.name

    def prepare(self, w, x):
        inner = super().prepare(w, x)
        return Prepared(inner.leaves, lambda: inner.fwd() * 1.05, inner.to_canonical, inner.to_provider)


class _ForwardOnly(Sdpa):
    """SDPA math without a backward: its forward is timed, its backward modes skipped."""

    def __init__(self):
        super().__init__("math")
        self.name = "fwd-only"

    def label(self, w):
        return self.name

    def prepare(self, w, x):
        inner = super().prepare(w, x)
        return Prepared(inner.leaves, lambda: inner.fwd().detach(), inner.to_canonical, inner.to_provider)


def test_tiny_cpu_suite_end_to_end(flash_attn, tmp_path):
    workloads = grid_workloads("cpu", match="s128-causal|sq64|varlen")  # square, Sq != Sk with GQA, varlen
    assert len(workloads) == 3
    providers = make_providers(["ours-cpu", "sdpa-math"], flash_attn) + [_Wrong(), _ForwardOnly()]
    timing = runner.Timing(warmup_ms=1, rep_ms=3)
    records, skips, env = runner.run_suite(workloads, providers, ["fwd", "bwd", "fwd_bwd"],
                                           device=torch.device("cpu"), timing=timing, ours_module=flash_attn,
                                           progress=False)
    assert {r["provider"] for r in records} == {"ours-cpu", "sdpa-math", "sdpa-math-padded", "fwd-only"}
    assert len(records) == 2 * 3 * len(workloads) + len(workloads)
    assert {r["mode"] for r in records if r["provider"] == "fwd-only"} == {"fwd"}
    wrong = [s for s in skips if s.provider == "wrong"]
    assert len(wrong) == len(workloads) and all("exceeds" in s.reason and s.mode == "all" for s in wrong)
    assert {s.mode for s in skips if s.provider == "fwd-only"} == {"bwd,fwd_bwd"}
    records = [r for r in records if r["provider"] != "fwd-only"]
    for r in records:
        assert all(k in r for k in REQUIRED), [k for k in REQUIRED if k not in r]
        assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
        w = next(w for w in workloads if w.name == r["workload"])
        assert r["tflops"] == pytest.approx(attention_flops(w, r["mode"]) / (r["ms_p50"] * 1e-3) / 1e12)
        assert r["ratio_to_best_peer"] > 0 and not r["best_peer"].startswith("ours")
        assert math.isfinite(r["verify_err_out"]) and math.isfinite(r["verify_err_grad"])
    summary = report.write_run(tmp_path / "run", records, skips, env, grids=["cpu"])
    assert "GPU numbers need a GPU" in summary.read_text()
    assert len(json.loads((tmp_path / "run" / "results.json").read_text())) == len(records)
    assert (tmp_path / "run" / "results.csv").read_text().count("\n") == len(records) + 1
    assert list((tmp_path / "run" / "plots").glob("*.png"))
    assert (tmp_path / "INDEX.md").exists()


def test_cli_on_cpu(flash_attn, tmp_path, capsys):
    from flash_attn_hub.cli import main
    variant = Path(flash_attn.__file__).parent
    code = main(["bench", "--kernel-dir", str(variant), "--out", str(tmp_path), "--run-name", "cli",
                 "--modes", "fwd", "--warmup-ms", "1", "--rep-ms", "2", "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "GPU numbers need a GPU" in out
    records = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert {r["provider"] for r in records} >= {"ours-cpu", "sdpa-math"}
    assert {r["mode"] for r in records} == {"fwd"}
