"""The benchmark: FLOP counting, grids, ratios, record schema, the commit field, the time
estimate and its split into commands, merging runs, the Markdown tables, and the tiny CPU
path end to end."""

from __future__ import annotations

import json
import math
import os
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch

from flash_attn_hub.bench import env as bench_env
from flash_attn_hub.bench import markdown, plan, report, runner
from flash_attn_hub.bench.providers import Ours, Prepared, Sdpa, hub_benchmark, make_providers
from flash_attn_hub.bench.workloads import (ALL_GRIDS, Workload, attention_flops, grid_names, grid_workloads,
                                            packed_lengths, visible_pairs)
from flash_attn_hub.reference import attention_reference, visible_mask

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


@pytest.mark.kernels_ci
def test_grids_cover_the_issue_workloads():
    assert grid_names("all") == list(ALL_GRIDS) == ["standard", "gqa", "varlen", "decode", "window",
                                                    "wide"]
    assert grid_names("gqa, decode,gqa") == ["gqa", "decode"]
    with pytest.raises(ValueError, match="'nope' is not one of"):
        grid_names("gqa,nope")
    every = grid_workloads("all")
    assert len({w.name for w in every}) == len(every)  # names key the merge of split runs
    gqa = grid_workloads("gqa")
    assert {(w.heads_q, w.heads_kv, w.head_dim) for w in gqa} == {(32, 8, 128), (32, 1, 128)}
    varlen = grid_workloads("varlen")
    assert {w.mix for w in varlen} == {"sft", "longtail"} and all(w.total_tokens_q == 16384 for w in varlen)
    assert any(w.gqa for w in varlen) and max(w.seqlen_q for w in varlen if w.mix == "longtail") > 4096
    decode = grid_workloads("decode")
    assert all(w.seqlen_q == 1 and w.gqa and w.modes == ("fwd",) for w in decode)
    assert max(w.seqlen_k for w in decode) == 131072
    assert {w.batch for w in decode} == {4, 64}  # small batch, and a serving-sized one
    assert all(w.windowed for w in grid_workloads("window"))
    assert {(w.head_dim, w.heads_q, w.heads_kv) for w in grid_workloads("wide")} == {
        (192, 16, 16), (256, 16, 8)}
    picked = grid_workloads("gqa,window", seqlens=[16384], head_dims=[128], match="h32-8")
    assert [w.name for w in picked] == ["gqa-d128-h32-8-b1-s16384-full", "gqa-d128-h32-8-b1-s16384-causal",
                                        "window-d128-h32-8-b1-s16384-causal-w4095.0"]


@pytest.mark.kernels_ci
def test_ours_providers_force_their_backend():
    """ours-cuda / ours-triton force the dispatch; ours-auto sets it to auto (the package's own
    choice); an unknown ours-* name is refused."""
    providers = make_providers(["ours-cuda", "ours-triton", "ours-auto"], None)
    assert [p.name for p in providers] == ["ours-cuda", "ours-triton", "ours-auto"]
    for provider in providers:
        with provider.context():
            assert os.environ["FLASH_ATTN_HUB_BACKEND"] == provider.name.removeprefix("ours-")
    with pytest.raises(ValueError, match="unknown provider"):
        make_providers(["ours-fastest"], None)


@pytest.mark.kernels_ci
def test_split_commands_fit_the_limit_and_select_exactly_their_workloads():
    workloads = grid_workloads("all")
    providers = make_providers(["ours-triton", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex"], None)
    cost = {w.name: plan.workload_s(w, providers, ["fwd", "bwd", "fwd_bwd"]) for w in workloads}
    assert all(cost[w.name] > 0 for w in workloads)
    limit = 0.3 * sum(cost.values())  # forces whole grids, head dims and lengths to be split
    chunks = plan.split(workloads, cost, limit)
    seen = []
    for chunk in chunks:
        assert chunk.seconds <= limit
        args = chunk.args()
        picked = grid_workloads(args[1], head_dims=chunk.head_dims, seqlens=chunk.seqlens)
        assert [w.name for w in picked] == [w.name for w in chunk.workloads], args
        seen += [w.name for w in picked]
    assert sorted(seen) == sorted(cost)
    small = plan.split(workloads, {n: 1.0 for n in cost}, limit_s=1e9)
    assert [c.args() for c in small] == [["--grid", ",".join(ALL_GRIDS)]]


def test_dry_run_prints_the_estimate_and_the_split(capsys):
    from flash_attn_hub.cli import main
    assert main(["bench", "--grid", "all", "--head-dims", "128", "--modes", "fwd,bwd", "--dry-run",
                 "--split-s", "120"]) == 0
    out = capsys.readouterr().out
    assert "on an H200" in out and "as commands of at most ~2.0 min" in out
    commands = [line for line in out.splitlines() if line.startswith("  python -m flash_attn_hub bench")]
    assert len(commands) > 1 and all("--modes fwd,bwd" in c and "--head-dims 128" in c for c in commands)
    assert "bench merge" in out


@pytest.mark.kernels_ci
def test_git_sha_comes_from_the_env_then_the_file_then_git_else_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_env, "REPO_ROOT", tmp_path)  # a copy of the tree without .git
    monkeypatch.setenv(bench_env.GIT_SHA_ENV, "abc123def456")
    (tmp_path / bench_env.GIT_SHA_FILE).write_text("fedcba987654\n")
    assert bench_env.git_sha() == ("abc123def456", f"${bench_env.GIT_SHA_ENV}")
    monkeypatch.delenv(bench_env.GIT_SHA_ENV)
    assert bench_env.git_sha()[0] == "fedcba987654"
    (tmp_path / bench_env.GIT_SHA_FILE).unlink()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    with pytest.warns(UserWarning, match=bench_env.GIT_SHA_ENV):
        assert bench_env.git_sha()[0] == "unknown"
    assert bench_env.environment(torch.device("cpu"), sha="0123abc")["git_sha"] == "0123abc"
    assert bench_env.cudnn_version(91900) == "9.19.0" and bench_env.cudnn_version(8902) == "8.9.2"


@pytest.mark.kernels_ci
def test_unvalidated_cuda_backend_is_skipped_unless_asked_for(monkeypatch):
    package = types.ModuleType("fake_ours")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "fake_ours", package)
    monkeypatch.setitem(sys.modules, "fake_ours._cuda", types.SimpleNamespace(VALIDATED=False))
    assert "not validated" in Ours(package, "cuda").unavailable()
    assert Ours(package, "cuda", explicit=True).unavailable() is None
    monkeypatch.setitem(sys.modules, "fake_ours._cuda", types.SimpleNamespace(VALIDATED=True))
    assert Ours(package, "cuda").unavailable() is None


@pytest.mark.kernels_ci
@pytest.mark.parametrize("sq, sk, hq, hkv", [(1, 300, 8, 2), (37, 90, 4, 4), (64, 64, 6, 1)])
def test_shared_sdpa_call_has_flash_attn_semantics(sq, sk, hq, hkv):
    """The SDPA call both benchmarks use (benchmarks/benchmark.py): bottom-right causal, GQA."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, h, 32, generator=gen, dtype=torch.float64)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    got = hub_benchmark().sdpa_forward(q, k, v, causal=True)
    want, _ = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(got, want)


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


class _Altered(Sdpa):
    """SDPA math with ``alter`` applied to its forward's output, under another name."""

    def __init__(self, name, alter):
        super().__init__("math")
        self.name = name
        self.alter = alter

    def label(self, w):
        return self.name

    def prepare(self, w, x):
        inner = super().prepare(w, x)
        return Prepared(inner.leaves, lambda: self.alter(inner.fwd()), inner.to_canonical, inner.to_provider)


def test_tiny_cpu_suite_end_to_end(flash_attn, tmp_path):
    workloads = grid_workloads("cpu", match="s128-causal|sq64|docs")  # square, Sq != Sk with GQA, varlen
    assert len(workloads) == 3
    providers = make_providers(["ours-cpu", "sdpa-math"], flash_attn) + [
        _Altered("wrong", lambda out: out * 1.05),  # 5% off: verification must refuse to time it
        _Altered("fwd-only", torch.Tensor.detach),  # no backward: forward timed, backward modes skipped
    ]
    timing = runner.Timing(warmup_ms=1, rep_ms=3)
    saved = []
    result = runner.run_suite(workloads, providers, ["fwd", "bwd", "fwd_bwd"], device=torch.device("cpu"),
                              timing=timing, ours_module=flash_attn, progress=False,
                              on_workload=lambda r: saved.append(len(r.records)))
    records, skips, env = result.records, result.skips, result.env
    assert saved == [7, 14, 21] and set(result.seconds) == {w.name for w in workloads} and not result.not_run
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
        assert r["git_sha"]  # never empty: a sha or "unknown"
    run = report.Run(records, [report.skip_dict(s) for s in skips], [{"grids": ["cpu"], "env": env}])
    summary = report.write_run(tmp_path / "run", run)
    assert "GPU numbers need a GPU" in summary.read_text()
    assert len(json.loads((tmp_path / "run" / "results.json").read_text())) == len(records)
    assert (tmp_path / "run" / "results.csv").read_text().count("\n") == len(records) + 1
    assert list((tmp_path / "run" / "plots").glob("*.png"))
    assert (tmp_path / "INDEX.md").exists()

    stopped = runner.run_suite(workloads, make_providers(["sdpa-math"], None), ["fwd"], device=torch.device("cpu"),
                               timing=timing, progress=False, keep_going=lambda w, elapsed: w is workloads[0])
    assert stopped.not_run == [w.name for w in workloads[1:]] and len(stopped.records) == 1


def _gqa_records(env, *, ours_mib, flash_mib, ours_tflops=300.0):
    """Records of one GQA workload as the runner makes them (bwd: ours and SDPA flash)."""
    w = Workload("gqa", 4, 4096, 4096, 32, 8, 128, True)
    flops = attention_flops(w, "bwd")

    def ms(tflops):
        t = flops / (tflops * 1e12) * 1e3
        return (t, t, t)
    return runner.add_ratios([
        runner.make_record(w, "ours-triton", "bwd", "bf16", ms(ours_tflops), ours_mib << 20, {}, env),
        runner.make_record(w, "sdpa-flash", "bwd", "bf16", ms(250.0), flash_mib << 20, {}, env),
        runner.make_record(w, "sdpa-cudnn", "bwd", "bf16", ms(400.0), 2 * flash_mib << 20, {}, env),
    ])


def _write(run_dir, records, env, argv):
    run = report.Run(records, [], [{"argv": argv, "grids": ["gqa"], "env": env}])
    report.write_data(run_dir, run)
    return run


def test_merge_runs_markdown_and_index(tmp_path):
    env = dict(gpu="NVIDIA H200", driver="580", torch="2.11.0+cu130", cuda="13.0", cudnn="9.19.0", triton="3.6.0",
               kernels="0.17.2", kernel_build="_flash_attn_x", git_sha="abc", date="2026-12-02T10:00:00+00:00")
    later = dict(env, git_sha="def", date="2026-12-02T11:00:00+00:00")
    _write(tmp_path / "gpu" / "a", _gqa_records(env, ours_mib=100, flash_mib=400), env, ["bench", "--grid", "gqa"])
    _write(tmp_path / "gpu" / "b", _gqa_records(later, ours_mib=120, flash_mib=400, ours_tflops=500.0), later,
           ["bench", "--grid", "gqa", "--seqlens", "4k"])
    archive = tmp_path / "bench.tgz"  # what a GPU machine returns
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "gpu" / "b", arcname="bench/b")
    into = tmp_path / "results" / "merged"
    summary = report.merge_sources([tmp_path / "gpu" / "a", archive], into, log=lambda _: None)
    merged = report.load_run(into)
    assert len(merged.records) == 3 and {r["git_sha"] for r in merged.records} == {"def"}  # newer run wins whole
    assert [p["source"] for p in merged.parts] == ["a", "b"]
    ours = next(r for r in merged.records if r["provider"] == "ours-triton")
    assert ours["ratio_to_best_peer"] == pytest.approx(500 / 400) and ours["peak_mem_bytes"] == 120 << 20
    text = summary.read_text()
    assert "## GQA / MQA backward: peak memory" in text
    assert "| `gqa-d128-h32-8-b4-s4096-causal` | backward | 120 | 800 | 400 | 0.30x |" in text
    assert "#### `gqa-d128-h32-8-b4-s4096-causal`" in text and "| sdpa-flash | 250 |" in text
    assert "Measured in 2 commands" in text and "--seqlens 4k" in text
    assert "| ours-triton / best |" in text and "1.25x" in text
    index = (tmp_path / "results" / "INDEX.md").read_text()
    assert "[merged](merged/RESULTS.md)" in index and "cuDNN 9.19.0" in index
    assert list((into / "plots").glob("*.png"))

    other = dict(env, gpu="NVIDIA A100")
    _write(tmp_path / "a100", _gqa_records(other, ours_mib=1, flash_mib=1), other, ["bench"])
    with pytest.raises(report.MergeError, match="gpu"):
        report.merge_sources([tmp_path / "a100"], into, log=lambda _: None)
    with pytest.raises(report.MergeError, match="no run folder"):
        report.find_runs(tmp_path / "results" / "merged" / "plots", tmp_path)


@pytest.mark.kernels_ci
def test_side_by_side_table_gives_our_ratio_to_every_peer():
    env = dict(gpu="g", git_sha="s", date="d")
    lines = markdown.workload_table(_gqa_records(env, ours_mib=100, flash_mib=400))
    assert lines[4].startswith("| provider | bwd TFLOP/s | bwd ms | peak MiB bwd | ours-triton vs this (bwd) |")
    rows = {line.split(" | ")[0].strip("| "): line for line in lines[6:] if line}
    assert rows["sdpa-flash"].endswith("| 1.20x |") and rows["sdpa-cudnn"].endswith("| 0.75x |")


def test_cli_on_cpu(flash_attn, tmp_path, capsys, monkeypatch):
    from flash_attn_hub.cli import main
    monkeypatch.setenv(bench_env.GIT_SHA_ENV, "0123456789ab")
    variant = Path(flash_attn.__file__).parent
    args = ["bench", "--grid", "all", "--kernel-dir", str(variant), "--out", str(tmp_path), "--run-name", "cli",
            "--warmup-ms", "1", "--rep-ms", "2", "--no-progress"]
    assert main([*args, "--modes", "fwd", "--match", "s128"]) == 0
    out = capsys.readouterr().out
    assert "instead of --grid all, the tiny CPU grid runs" in out and "GPU numbers need a GPU" in out
    records = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert {r["provider"] for r in records} >= {"ours-cpu", "sdpa-math"}
    assert {r["mode"] for r in records} == {"fwd"} and {r["git_sha"] for r in records} == {"0123456789ab"}
    assert main([*args, "--modes", "fwd"]) == 2  # the folder holds a run: refuse to overwrite it
    assert "--append" in capsys.readouterr().out
    assert main([*args, "--modes", "bwd", "--match", "s256-full", "--append"]) == 0
    run = report.load_run(tmp_path / "cli")
    assert {(r["mode"], r["seqlen_k"]) for r in run.records} == {("fwd", 128), ("bwd", 256)}
    assert len(run.parts) == 2 and all(p["seconds"] for p in run.parts)
    assert "[cli](cli/RESULTS.md)" in (tmp_path / "INDEX.md").read_text()
    assert main(["bench", "--kernel-dir", str(tmp_path / "no-build"), "--out", str(tmp_path)]) == 2
    assert "could not load our kernel" in capsys.readouterr().out
