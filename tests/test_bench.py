"""The benchmark: FLOP counting, grids, ratios, record schema, the commit field, the timer,
the results page (written, read back, added to), the Markdown tables, the softcap plumbing
(every provider caps or skips, verification refuses a dropped cap), and the tiny CPU path
end to end."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from flash_attn_hub.bench import env as bench_env
from flash_attn_hub.bench import report, runner, timing
from flash_attn_hub.bench import verify as bench_verify
from flash_attn_hub.bench.providers import (KV_CHECK_VALUES_ENV, FlashAttention4, FlashAttnPackage, FlashInfer,
                                            Flex, Ours, Prepared, Sdpa, make_providers, paged_kv_indices,
                                            sdpa_forward)
from flash_attn_hub.bench.workloads import (ALL_GRIDS, Workload, attention_flops, cpu_stand_ins, grid_names,
                                            grid_workloads, make_inputs, packed_lengths, visible_pairs)
from flash_attn_hub.reference import attention_reference, kvcache_reference, visible_mask

REQUIRED = ("provider", "workload", "mode", "dtype", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv",
            "head_dim", "causal", "ms_p20", "ms_p50", "ms_p80", "tflops", "ratio_to_best_peer", "peak_mem_bytes",
            "gpu", "driver", "torch", "cuda", "cudnn", "triton", "fa4", "flashinfer", "git_sha", "date")
KV_COLUMNS = ("kv_cache", "page_size", "gbps", "copy_gbps", "pct_copy", "host_us")


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
def test_main_grid_is_the_release_grid():
    """D 64/128/256 x MHA 32/32, GQA 32/8, Llama 64/8 x full/causal x S 512..16k, 16k tokens."""
    grid = grid_workloads("main")
    assert len(grid) == 3 * 3 * 2 * 5
    assert all(w.batch * w.seqlen_q == 16384 and w.seqlen_q == w.seqlen_k for w in grid)
    assert {(w.head_dim, w.heads_q, w.heads_kv) for w in grid} == {
        (d, hq, hkv) for d in (64, 128, 256) for hq, hkv in ((32, 32), (32, 8), (64, 8))}
    assert {w.seqlen_q for w in grid} == {512, 1024, 4096, 8192, 16384}
    llama = [w for w in grid if w.heads_q == 64 and w.seqlen_q == 8192]
    assert {w.batch for w in llama} == {2}
    assert {w.seqlen_q for w in grid_workloads("main", seqlens=[1024, 4096], head_dims=[128])} == {1024, 4096}


@pytest.mark.kernels_ci
def test_grids_cover_the_issue_workloads():
    assert grid_names("all") == list(ALL_GRIDS) == ["main", "varlen", "decode", "window", "softcap", "kvcache"]
    assert grid_names("varlen, decode,varlen") == ["varlen", "decode"]
    with pytest.raises(ValueError, match="'nope' is not one of"):
        grid_names("varlen,nope")
    every = grid_workloads("all")
    assert len({w.name for w in every}) == len(every)  # names key the rows of a page added to
    varlen = grid_workloads("varlen")
    assert {w.mix for w in varlen} == {"sft", "longtail"} and all(w.total_tokens_q == 16384 for w in varlen)
    assert any(w.gqa for w in varlen) and max(w.seqlen_q for w in varlen if w.mix == "longtail") > 4096
    decode = grid_workloads("decode")
    assert all(w.seqlen_q == 1 and w.gqa and w.modes == ("fwd",) for w in decode)
    assert max(w.seqlen_k for w in decode) == 131072
    assert {w.batch for w in decode} == {4, 64}  # small batch, and a serving-sized one
    assert all(w.windowed for w in grid_workloads("window"))
    picked = grid_workloads("main,window", seqlens=[16384], head_dims=[128], match="h32-8")
    assert [w.name for w in picked] == ["main-d128-h32-8-b1-s16384-full", "main-d128-h32-8-b1-s16384-causal",
                                        "window-d128-h32-8-b1-s16384-causal-w4095.0"]


@pytest.mark.kernels_ci
def test_kvcache_grid_holds_the_decode_cells():
    """GQA 32/8 and 64/8 at D=128; contiguous, page 16 and page 64 caches; B 1..128 over 4k..128k
    keys; multi-token decode Sq 4/8/16 at 32/8. The quick grid is its corners, by name."""
    full = grid_workloads("kvcache")
    assert all(w.kv_cache and w.causal and w.head_dim == 128 and w.modes == ("fwd",) for w in full)
    single = [w for w in full if w.seqlen_q == 1]
    assert {(w.heads_q, w.heads_kv, w.page_size, w.batch, w.seqlen_k) for w in single} == {
        (hq, hkv, page, b, sk) for hq, hkv in ((32, 8), (64, 8)) for page in (16, 64, 0)
        for b in (1, 8, 32, 128) for sk in (4096, 32768, 131072)}
    multi = [w for w in full if w.seqlen_q > 1]
    assert {(w.seqlen_q, w.page_size, w.batch, w.seqlen_k, w.heads_q) for w in multi} == {
        (sq, page, b, sk, 32) for sq in (4, 8, 16) for page in (16, 0) for b in (1, 8) for sk in (4096, 32768)}
    assert len(full) == len(single) + len(multi) == 72 + 24 and len({w.name for w in full}) == len(full)
    quick = grid_workloads("kvcache-quick")
    assert {w.name for w in quick} < {w.name for w in full} and len(quick) == 8 + 16
    assert {(w.heads_q, w.page_size) for w in quick} == {(32, 16), (32, 0)}
    assert {w.seqlen_q for w in quick} == {1, 4, 16} and {w.seqlen_k for w in quick} == {4096, 32768}
    assert len(grid_workloads("kvcache,kvcache-quick")) == len(full)  # one cell, one row
    assert full[0].name == "kvcache-d128-h32-8-b1-sq1-sk4096-page16-causal"
    assert [w.name for w in full if w.host_timed] == [
        f"kvcache-d128-h{hq}-8-b1-sq1-sk4096-{cache}-causal" for hq in (32, 64)
        for cache in ("page16", "page64", "contiguous")]
    assert full[0].cache_elements == 2 * 4096 * 8 * 128
    assert attention_flops(full[0]) == 4 * 32 * 128 * 4096  # one query row sees every key
    assert cpu_stand_ins(["main", "kvcache-quick", "window"]) == ["cpu", "cpu-kvcache"]
    assert cpu_stand_ins(["kvcache"]) == ["cpu-kvcache"] and cpu_stand_ins(["cpu"]) == ["cpu"]


@pytest.mark.kernels_ci
def test_softcap_grid_is_gemma2_attention():
    """Gemma 2 9B (D=256, 16/8) and 27B (D=128, 32/16) heads, logits capped at 50, causal at 4k
    and 8k, a 4k window at 8k, 16k tokens; the cap is in the name and family, not in the FLOPs,
    and the names of cells without a cap are unchanged."""
    grid = grid_workloads("softcap")
    assert len(grid) == 6 and len({w.name for w in grid}) == 6
    assert all(w.softcap == 50.0 and w.causal and w.batch * w.seqlen_q == 16384 and w.seqlen_q == w.seqlen_k
               for w in grid)
    assert {(w.head_dim, w.heads_q, w.heads_kv, w.seqlen_q, w.window_left) for w in grid} == {
        (d, hq, hkv, s, left) for d, hq, hkv in ((256, 16, 8), (128, 32, 16))
        for s, left in ((4096, -1), (8192, -1), (8192, 4095))}
    assert [w.name for w in grid if w.head_dim == 256] == [
        "softcap-d256-h16-8-b4-s4096-causal-cap50", "softcap-d256-h16-8-b2-s8192-causal-cap50",
        "softcap-d256-h16-8-b2-s8192-causal-w4095.0-cap50"]
    assert grid[0].family == "softcap D=256 Hq/Hkv=16/8 softcap=50"
    for w in grid:  # a tanh per score is no matmul
        assert attention_flops(w, "fwd_bwd") == attention_flops(dataclasses.replace(w, softcap=0.0), "fwd_bwd")
    assert Workload("t", 2, 64, 64, 4, 2, 32, True, softcap=2.5).name == "t-d32-h4-2-b2-s64-causal-cap2.5"
    assert not any("cap" in w.name or "softcap" in w.family for w in grid_workloads("all") if w.softcap == 0)
    assert cpu_stand_ins(["softcap"]) == ["cpu-softcap"]
    assert cpu_stand_ins(grid_names("all")) == ["cpu", "cpu-softcap", "cpu-kvcache"]
    tiny = grid_workloads("cpu-softcap")
    assert all(w.softcap == 50.0 for w in tiny) and any(w.varlen for w in tiny) and any(w.windowed for w in tiny)


@pytest.mark.kernels_ci
def test_softcap_inputs_spread_q_to_the_cap():
    """q is drawn with standard deviation ``softcap`` (k and v as without the cap), so the scores
    reach the cap; a workload without a cap keeps its standard-normal q."""
    w = Workload("t", 2, 64, 64, 4, 2, 32, True)
    plain = make_inputs(w, device="cpu", dtype=torch.float32, seed=3)
    capped = make_inputs(dataclasses.replace(w, softcap=50.0), device="cpu", dtype=torch.float32, seed=3)
    assert torch.equal(capped.q, plain.q * 50.0) and torch.equal(capped.k, plain.k) and torch.equal(capped.v, plain.v)
    assert 0.9 < float(plain.q.std()) < 1.1
    varlen = make_inputs(Workload("t", 2, 40, 40, 4, 2, 32, True, seqlens=(40, 24), softcap=30.0), device="cpu",
                         dtype=torch.float32, seed=0)
    assert 27 < float(varlen.q.std()) < 33 and float(varlen.k.std()) < 1.1


@pytest.mark.kernels_ci
def test_kvcache_inputs_are_a_shuffled_paged_or_a_contiguous_cache():
    paged = Workload("t", 3, 2, 40, 4, 2, 8, True, kv_cache=True, page_size=16)
    x = make_inputs(paged, device="cpu", dtype=torch.float32, seed=0)
    assert x.q.shape == (3, 2, 4, 8) and x.k.shape == x.v.shape == (9, 16, 2, 8)  # 3 pages a sequence
    assert x.block_table.dtype == torch.int32 and x.block_table.shape == (3, 3)
    assert sorted(x.block_table.flatten().tolist()) == list(range(9))
    assert x.block_table.flatten().tolist() != list(range(9))  # blocks handed out in a random order
    assert x.cache_seqlens.tolist() == [40, 40, 40] and x.cache_seqlens.dtype == torch.int32
    assert not torch.equal(x.k, x.v) and bool((x.k != 0).all())
    contiguous = make_inputs(dataclasses.replace(paged, page_size=0), device="cpu", dtype=torch.float32, seed=0)
    assert contiguous.k.shape == (3, 40, 2, 8) and contiguous.block_table is None


@pytest.mark.kernels_ci
def test_kvcache_providers_call_flash_attn_with_kvcache_and_sdpa_in_place(monkeypatch):
    """Ours: flash_attn_with_kvcache with the cache's seqlens and block table, value checks off;
    SDPA reads the contiguous cache in place with the oracle's semantics (Sq > 1: causal
    lower-right) and skips a paged one; the CUDA backend, FlexAttention and FA4 skip kv-cache
    steps with their reason."""
    calls = []
    module = types.SimpleNamespace(flash_attn_with_kvcache=lambda q, k, v, **kw: calls.append(kw) or q)
    w = Workload("t", 2, 3, 37, 4, 2, 16, True, modes=("fwd",), kv_cache=True, page_size=16)
    x = make_inputs(w, device="cpu", dtype=torch.float64, seed=0)
    ours = Ours(module, "triton")
    assert ours.unsupported(w) is None and ours.prepare(w, x).fwd() is x.q
    assert calls[0]["cache_seqlens"] is x.cache_seqlens and calls[0]["block_table"] is x.block_table
    assert calls[0]["causal"] is True and calls[0]["window_size"] == (-1, 0)
    monkeypatch.delenv(KV_CHECK_VALUES_ENV, raising=False)
    with ours.context():
        assert os.environ[KV_CHECK_VALUES_ENV] == "0" and os.environ["FLASH_ATTN_HUB_BACKEND"] == "triton"
    assert KV_CHECK_VALUES_ENV not in os.environ  # restored
    assert "no kv-cache kernel" in Ours(module, "cuda").unsupported(w)
    assert "no flash_attn_with_kvcache" in Ours(types.SimpleNamespace(), "triton").unsupported(w)
    assert "paged" in Sdpa("cudnn").unsupported(w)
    assert Flex().unsupported(w) and FlashAttention4().unsupported(w)
    assert FlashAttnPackage("fa3", "flash_attn_interface").unsupported(w)
    contiguous = dataclasses.replace(w, page_size=0)
    xc = make_inputs(contiguous, device="cpu", dtype=torch.float64, seed=1)
    assert Sdpa("cudnn").unsupported(contiguous) is None
    got = Sdpa("math").prepare(contiguous, xc).fwd()
    want = kvcache_reference(xc.q, xc.k, xc.v, cache_seqlens=xc.cache_seqlens, causal=True)["out"]
    torch.testing.assert_close(got, want)


@pytest.mark.kernels_ci
def test_kvcache_cells_too_large_for_the_gpu_are_skipped(monkeypatch):
    w = grid_workloads("kvcache", match="h32-8-b128-sq1-sk131072-contiguous")[0]  # 64 GiB of K+V
    small = grid_workloads("kvcache", match="h32-8-b1-sq1-sk4096-contiguous")[0]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        total_memory=80 << 30))
    cuda = torch.device("cuda")
    assert "K+V over 33%" in runner.too_large(w, cuda, torch.bfloat16)
    assert runner.too_large(small, cuda, torch.bfloat16) is None
    assert runner.too_large(w, torch.device("cpu"), torch.bfloat16) is None
    assert runner.too_large(grid_workloads("main")[0], cuda, torch.bfloat16) is None


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
def test_cpu_timer_reports_ordered_quantiles_and_clears_gradients():
    leaf = torch.ones(3, requires_grad=True)
    calls = []

    def fn():
        assert leaf.grad is None  # cleared before every timed call
        calls.append(1)
        (leaf * 2).sum().backward()

    p20, p50, p80 = timing.quantiles(fn, device="cpu", grad_to_none=[leaf],
                                     timing=timing.Timing(warmup_ms=0, rep_ms=0))
    assert 0 <= p20 <= p50 <= p80 and len(calls) >= 6  # one untimed call, then at least five
    assert timing.median_ms(lambda: None, device=torch.device("cpu")) >= 0


@pytest.mark.kernels_ci
def test_cpu_graph_timer_host_timer_and_copy_fall_back_to_the_wall_clock():
    calls = []
    fast = timing.Timing(warmup_ms=0, rep_ms=0, host_calls=10, host_batches=2)
    p20, p50, p80 = timing.graph_quantiles(lambda: calls.append(1), device="cpu", timing=fast)
    assert 0 <= p20 <= p50 <= p80 and len(calls) >= 6
    calls.clear()
    assert timing.host_ms(lambda: calls.append(1), device="cpu", timing=fast) >= 0
    assert len(calls) == 20 + 10  # untimed warm-up, then two timed batches of 5
    assert timing.copy_gbps("cpu", nbytes=1 << 20, timing=fast) > 0


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
def test_sdpa_call_has_flash_attn_semantics(sq, sk, hq, hkv):
    """The SDPA peers' call: bottom-right causal, GQA by head index."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, h, 32, generator=gen, dtype=torch.float64)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    got = sdpa_forward(q, k, v, causal=True)
    want, _ = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(got, want)


@pytest.mark.kernels_ci
def test_fa4_is_called_with_its_own_conventions(monkeypatch):
    """FlashAttention-4 takes unbounded window sides as None, returns (out, lse), and names its
    varlen arguments; without the package it is unavailable with the reason."""
    calls = []
    fake = types.SimpleNamespace(
        flash_attn_func=lambda q, k, v, **kw: calls.append(("batched", kw)) or (q, None),
        flash_attn_varlen_func=lambda q, k, v, **kw: calls.append(("varlen", kw)) or (q, None))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake)
    fa4 = FlashAttention4()
    assert fa4.unavailable() is None
    w = Workload("t", 1, 4, 4, 2, 2, 8, True, window_left=2)
    x = make_inputs(w, device="cpu", dtype=torch.float32, seed=0)
    assert fa4.prepare(w, x).fwd() is x.q
    assert calls[-1] == ("batched", {"causal": True, "window_size": (2, 0)})
    v = Workload("t", 2, 5, 5, 2, 1, 8, False, seqlens=(3, 5))
    xv = make_inputs(v, device="cpu", dtype=torch.float32, seed=0)
    assert fa4.prepare(v, xv).fwd() is xv.q
    kind, kw = calls[-1]
    assert kind == "varlen" and kw["window_size"] == (None, None) and kw["max_seqlen_q"] == 5
    assert kw["cu_seqlens_q"].tolist() == [0, 3, 8]
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # not installed
    assert "flash-attn-4" in FlashAttention4().unavailable()


@pytest.mark.kernels_ci
def test_providers_pass_softcap_or_skip_with_a_reason(monkeypatch):
    """Ours and flash-attn 2 / 3 (batched, varlen, kv-cache) and FA4 get ``softcap`` when the
    workload caps, and no such argument otherwise (flash-attn 2 before 2.6 has none); SDPA
    skips every softcap cell and FlashInfer a softcap decode step, each with the reason."""
    calls = []
    module = types.SimpleNamespace(
        flash_attn_func=lambda q, k, v, **kw: calls.append(kw) or q,
        flash_attn_varlen_func=lambda q, k, v, cu_q, cu_k, max_q, max_k, **kw: calls.append(kw) or q,
        flash_attn_with_kvcache=lambda q, k, v, **kw: calls.append(kw) or q)
    batched = Workload("t", 1, 4, 4, 2, 2, 8, True, softcap=50.0)
    varlen = Workload("t", 2, 5, 5, 2, 1, 8, True, seqlens=(3, 5), softcap=50.0)
    decode = Workload("t", 2, 1, 40, 4, 2, 8, True, modes=("fwd",), kv_cache=True, softcap=50.0)
    package = FlashAttnPackage("flash-attn2", "flash_attn")
    package.module = module
    for provider in (Ours(module, "triton"), package):
        for w in (batched, varlen, decode):
            x = make_inputs(w, device="cpu", dtype=torch.float32, seed=0)
            assert provider.prepare(w, x).fwd() is x.q
            assert calls[-1]["softcap"] == 50.0 and calls[-1]["causal"] is True, (provider.name, w)
        x = make_inputs(dataclasses.replace(batched, softcap=0.0), device="cpu", dtype=torch.float32, seed=0)
        provider.prepare(dataclasses.replace(batched, softcap=0.0), x).fwd()
        assert "softcap" not in calls[-1]

    fa4_calls = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.SimpleNamespace(
        flash_attn_func=lambda q, k, v, **kw: fa4_calls.append(kw) or (q, None),
        flash_attn_varlen_func=lambda q, k, v, **kw: fa4_calls.append(kw) or (q, None)))
    fa4 = FlashAttention4()
    assert fa4.unavailable() is None and fa4.unsupported(batched) is None
    for w in (batched, varlen):
        fa4.prepare(w, make_inputs(w, device="cpu", dtype=torch.float32, seed=0)).fwd()
        assert fa4_calls[-1]["softcap"] == 50.0
    assert fa4_calls[0] == {"causal": True, "window_size": (None, 0), "softcap": 50.0}

    for kind in Sdpa.KINDS:
        for w in (batched, varlen, decode, dataclasses.replace(batched, window_left=2)):
            assert Sdpa(kind).unsupported(w) == "SDPA has no logit soft-capping"
    assert Sdpa("math").unsupported(dataclasses.replace(batched, softcap=0.0)) is None
    assert "logits_soft_cap" in FlashInfer().unsupported(decode)
    assert FlashInfer().unsupported(dataclasses.replace(decode, softcap=0.0)) is None
    assert Flex().unsupported(batched) is None


@pytest.mark.kernels_ci
@pytest.mark.parametrize("w", [Workload("t", 2, 32, 48, 4, 2, 16, True, softcap=5.0),
                               Workload("t", 3, 40, 40, 4, 2, 16, True, window_left=7, softcap=5.0,
                                        seqlens=(9, 40, 21))], ids=["batched", "varlen-window"])
def test_flex_caps_the_scaled_score_as_flash_attn_does(w):
    """FlexAttention's score_mod receives ``scale * q.k`` and masks after it: capping that score
    is flash-attn's softcap exactly (eager FlexAttention on CPU, forward only, float64)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention
    flex = Flex()
    flex._compiled = flex_attention  # eager: the same semantics without a compile
    x = make_inputs(w, device="cpu", dtype=torch.float64, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        got = flex.prepare(w, x).fwd()
    varlen = dict(cu_seqlens_q=x.cu_seqlens, cu_seqlens_k=x.cu_seqlens) if w.varlen else {}
    want, _ = attention_reference(x.q, x.k, x.v, causal=True, window_size=w.window_size, softcap=5.0, **varlen)
    torch.testing.assert_close(got, want)
    uncapped, _ = attention_reference(x.q, x.k, x.v, causal=True, window_size=w.window_size, **varlen)
    assert (uncapped - want).abs().max() > 0.1


@pytest.mark.kernels_ci
def test_flashinfer_page_table_from_a_block_table():
    """indptr / indices / last_page_len, FlashInfer's CSR page table: the used pages of each
    sequence in order (the padding past them dropped), keys in each last page 1..page."""
    table = torch.tensor([[7, 2, -1], [0, -1, -1], [3, 1, 5]], dtype=torch.int32)
    indptr, indices, last = paged_kv_indices(table, torch.tensor([5, 4, 9], dtype=torch.int32), 4)
    assert indptr.tolist() == [0, 2, 3, 6] and indices.tolist() == [7, 2, 0, 3, 1, 5]
    assert last.tolist() == [1, 4, 1] and {t.dtype for t in (indptr, indices, last)} == {torch.int32}
    with pytest.raises(ValueError, match="cache_seqlens"):
        paged_kv_indices(table, torch.tensor([5, 0, 9], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="block_table"):
        paged_kv_indices(table, torch.tensor([5, 4, 13], dtype=torch.int32), 4)


class _FakeDecodeWrapper:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper as its documentation defines it, on the
    CPU: sequence b's keys are its pages ``indices[indptr[b]:indptr[b + 1]]`` in order, the last
    one holding ``last_page_len[b]`` keys; q is ``(B * q_len_per_req, Hq, D)``, several new
    tokens causal (bottom-right)."""
    made = []

    def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False, backend="auto"):
        self.init = dict(workspace=workspace, kv_layout=kv_layout, use_tensor_cores=use_tensor_cores,
                         backend=backend)
        _FakeDecodeWrapper.made.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        self.planned = dict(indptr=indptr, indices=indices, last_page_len=last_page_len, heads=(num_qo_heads,
                            num_kv_heads, head_dim), page_size=page_size, **kw)

    def run(self, q, paged_kv_cache):
        self.cache = k_cache, v_cache = paged_kv_cache
        plan = self.planned
        sq = plan.get("q_len_per_req", 1)
        assert k_cache.shape[1] == plan["page_size"]  # NHD: (pages, page_size, Hkv, D)
        ptr, idx, last = (plan[n].tolist() for n in ("indptr", "indices", "last_page_len"))
        outs = []
        for b in range(len(last)):
            pages = idx[ptr[b]:ptr[b + 1]]
            n = (len(pages) - 1) * plan["page_size"] + last[b]
            k, v = (c[pages].flatten(0, 1)[:n].unsqueeze(0) for c in (k_cache, v_cache))
            out, _ = attention_reference(q[b * sq:(b + 1) * sq].unsqueeze(0), k, v, causal=sq > 1)
            outs.append(out[0].to(q.dtype))
        return torch.cat(outs)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("page, sq", [(16, 1), (16, 4), (0, 1), (0, 4)])
def test_flashinfer_decodes_the_workloads_cache_through_its_page_table(monkeypatch, page, sq):
    """The FlashInfer peer on a stand-in module: planned once in prepare (NHD, the workload's page
    size, a contiguous cache as pages of gcd(Sk, 16) keys in place), its output the oracle's for
    uneven cache lengths; several new tokens through q_len_per_req on the tensor-core path."""
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_FakeDecodeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(_FakeDecodeWrapper, "made", [])
    provider = make_providers(["flashinfer"], None)[0]
    assert isinstance(provider, FlashInfer) and provider.unavailable() is None
    w = Workload("t", 3, sq, 40, 4, 2, 16, True, modes=("fwd",), kv_cache=True, page_size=page)
    assert provider.unsupported(w) is None
    x = make_inputs(w, device="cpu", dtype=torch.float64, seed=3)
    x = dataclasses.replace(x, cache_seqlens=torch.tensor([40, 17, 33], dtype=torch.int32))
    prepared = provider.prepare(w, x)
    wrapper, = _FakeDecodeWrapper.made
    assert wrapper.init["kv_layout"] == "NHD" and wrapper.init["backend"] == "fa2"
    assert wrapper.init["use_tensor_cores"] is (sq > 1) and wrapper.planned["q_len_per_req"] == sq
    assert wrapper.planned["heads"] == (4, 2, 16) and wrapper.planned["q_data_type"] == torch.float64
    assert wrapper.planned["page_size"] == (page or 8)  # gcd(40, 16)
    pages = [3, 2, 3] if page else [5, 3, 5]
    assert wrapper.planned["indptr"].tolist() == [0, *torch.tensor(pages).cumsum(0).tolist()]
    assert wrapper.planned["last_page_len"].tolist() == [8, 1, 1]  # 40, 17, 33 keys in pages of 16 or 8
    got = prepared.fwd()
    want = kvcache_reference(x.q, x.k, x.v, cache_seqlens=x.cache_seqlens, block_table=x.block_table,
                             causal=True)["out"]
    assert got.shape == x.q.shape
    torch.testing.assert_close(got, want)
    if page:  # the used pages, in the block table's order
        assert wrapper.planned["indices"].tolist() == [p for row, n in zip(x.block_table.tolist(), pages)
                                                       for p in row[:n]]
    else:  # a contiguous cache, read in place: sequence b's pages are 5b .. 5b + 4
        assert wrapper.planned["indices"].tolist() == [b * 5 + i for b, n in enumerate(pages) for i in range(n)]
        assert wrapper.cache[0].shape == (15, 8, 2, 16) and wrapper.cache[0].data_ptr() == x.k.data_ptr()


@pytest.mark.kernels_ci
def test_flashinfer_skips_what_it_cannot_run_with_a_reason(monkeypatch):
    provider = FlashInfer()
    assert "kv-cache" in provider.unsupported(Workload("t", 2, 64, 64, 4, 4, 64, True))
    multi = Workload("t", 1, 4, 64, 4, 2, 64, False, modes=("fwd",), kv_cache=True, page_size=16)
    assert "causal only" in provider.unsupported(multi)
    assert provider.unsupported(dataclasses.replace(multi, seqlen_q=1)) is None  # one query: no mask
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    assert "`import flashinfer` (flashinfer-python) failed" in FlashInfer().unavailable()
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace())
    assert "no BatchDecodeWithPagedKVCacheWrapper" in FlashInfer().unavailable()


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
def test_append_replaces_remeasured_groups_whole():
    old = [_record("ours-cuda", 1.0), _record("sdpa-cudnn", 2.0), _record("sdpa-cudnn", 3.0, workload="x")]
    old_skips = [{"provider": "flex", "workload": "w", "mode": "all", "reason": "old"},
                 {"provider": "flex", "workload": "y", "mode": "all", "reason": "kept"}]
    records, skips = report.combine(old, old_skips, [_record("ours-cuda", 5.0)], [])
    assert [(r["provider"], r["workload"]) for r in records] == [("sdpa-cudnn", "x"), ("ours-cuda", "w")]
    assert [s["reason"] for s in skips] == ["kept"]  # w was measured again


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
    saved = []
    result = runner.run_suite(workloads, providers, ["fwd", "bwd", "fwd_bwd"], device=torch.device("cpu"),
                              timing=timing.Timing(warmup_ms=1, rep_ms=3), ours_module=flash_attn,
                              progress=False, on_workload=lambda r: saved.append(len(r.records)))
    records, skips = result.records, result.skips
    assert saved == [7, 14, 21] and set(result.seconds) == {w.name for w in workloads}
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
    skip_rows = [{"provider": s.provider, "workload": s.workload, "mode": s.mode, "reason": s.reason}
                 for s in skips]
    summary = report.write_page(tmp_path / "page", records, skip_rows)
    assert "GPU numbers need a GPU" in summary.read_text()
    assert report.load(tmp_path / "page") == (records, skip_rows)  # the CSV reads back exactly
    assert [p.name for p in (tmp_path / "page" / "plots").glob("*.png")] == ["cpu-d64.png"]


class _AlteredOurs(Ours):
    """Our CPU backend under another name (a peer), its kv-cache call changed by ``alter(w, x)``:
    the ``(x, block_table)`` it is given instead; ``paged_only``: it skips contiguous caches."""

    def __init__(self, module, name, alter, paged_only=False):
        super().__init__(module, "cpu")
        self.name = name
        self.alter = alter
        self.paged_only = paged_only

    def unsupported(self, w):
        return "a contiguous cache" if self.paged_only and not w.page_size else super().unsupported(w)

    def prepare(self, w, x):
        x, table = self.alter(w, x)
        return super().prepare(w, dataclasses.replace(x, block_table=table))


def _scaled_q(w, x):
    return dataclasses.replace(x, q=x.q * 1.05), x.block_table


def _blocks_in_storage_order(w, x):
    return x, torch.arange(x.block_table.numel(), dtype=torch.int32).view(x.block_table.shape)


def test_tiny_cpu_kvcache_suite_end_to_end(flash_attn, tmp_path):
    """The kv-cache grid's path on CPU: verified against kvcache_reference (a wrong output and a
    reader that ignores the shuffled block table are refused), graph timer (its CPU fallback),
    GB/s and %copy against the run's copy, host time on the smallest cells, the page's kvcache
    tables, and the CSV read back exactly."""
    workloads = grid_workloads("cpu-kvcache")
    providers = make_providers(["ours-cpu", "sdpa-math"], flash_attn) + [
        _AlteredOurs(flash_attn, "wrong", _scaled_q),
        _AlteredOurs(flash_attn, "unshuffled", _blocks_in_storage_order, paged_only=True)]
    result = runner.run_suite(workloads, providers, ["fwd", "bwd"], device=torch.device("cpu"),
                              timing=timing.Timing(warmup_ms=1, rep_ms=3, host_calls=5), ours_module=flash_attn,
                              progress=False)
    records, skips = result.records, result.skips
    paged = {w.name for w in workloads if w.page_size}
    assert paged and result.copy_gbps > 0
    assert sorted((r["provider"], r["workload"]) for r in records) == sorted(
        [("ours-cpu", w.name) for w in workloads] + [("sdpa-math", w.name) for w in workloads if not w.page_size])
    assert {s.workload for s in skips if s.provider == "sdpa-math" and "paged" in s.reason} == paged
    assert {s.workload for s in skips if s.provider == "wrong" and "exceeds" in s.reason} == {w.name for w in workloads}
    assert {s.workload for s in skips if s.provider == "unshuffled" and "exceeds" in s.reason} == paged
    for r in records:
        w = next(w for w in workloads if w.name == r["workload"])
        assert all(k in r for k in REQUIRED + KV_COLUMNS) and r["mode"] == "fwd" and r["kv_cache"]
        assert r["page_size"] == w.page_size and r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
        assert r["gbps"] == pytest.approx(w.cache_elements * 2 / (r["ms_p50"] * 1e-3) / 1e9)  # bf16 K+V read
        assert r["copy_gbps"] == result.copy_gbps and r["pct_copy"] == pytest.approx(100 * r["gbps"] / r["copy_gbps"])
        assert (r["host_us"] is not None) == w.host_timed and (r["host_us"] is None or r["host_us"] > 0)
        assert math.isfinite(r["verify_err_out"]) and r["verify_err_grad"] is None
        assert (r["best_peer"] == "sdpa-math") == (not w.page_size)  # SDPA: contiguous caches only
    assert any(r["host_us"] for r in records if r["provider"] == "sdpa-math")
    skip_rows = [{"provider": s.provider, "workload": s.workload, "mode": s.mode, "reason": s.reason} for s in skips]
    text = report.write_page(tmp_path / "page", records, skip_rows).read_text()
    assert "## cpu-kvcache" in text and "### Device time (us, median), K+V read (GB/s) and %copy" in text
    assert ("| cache | Hq/Hkv | B | Sk | Sq | ours-cpu us | sdpa-math us | ours-cpu GB/s | ours-cpu %copy "
            "| best peer | ours-cpu / best |") in text
    assert "| page 16 | 4/2 | 3 | 100 | 1 |" in text and "| contiguous | 4/2 | 2 | 150 | 4 |" in text
    assert "### Host time per eager call (us)" in text and "| ours-cpu / fastest peer |" in text
    assert "TFLOP/s (median)" not in text  # a kv-cache grid has its own tables
    assert report.load(tmp_path / "page") == (records, skip_rows)
    assert not list((tmp_path / "page").rglob("*.png"))


class _Uncapped(Ours):
    """Our CPU backend under another name (a peer), called without the workload's softcap."""

    def __init__(self, module):
        super().__init__(module, "cpu")
        self.name = "uncapped"

    def prepare(self, w, x):
        return super().prepare(dataclasses.replace(w, softcap=0.0), x)


@pytest.mark.parametrize("index", range(3), ids=["batched", "window", "varlen"])
def test_verification_refuses_a_dropped_softcap(flash_attn, index):
    """On each tiny softcap cell, ours matches the capped oracle (output and gradients) and the
    same call without the cap is refused, output and gradients both: the q spread of
    ``make_inputs`` puts the uncapped output well outside the tolerance."""
    w = grid_workloads("cpu-softcap")[index]
    x = make_inputs(w, device="cpu", dtype=torch.bfloat16, seed=0)
    for t in (x.q, x.k, x.v):
        t.requires_grad_()
    exp = bench_verify.expected(w, x, with_grads=True)
    ours, uncapped = Ours(flash_attn, "cpu"), _Uncapped(flash_attn)
    with ours.context():
        prepared = ours.prepare(w, x)
        errors = bench_verify.verify("ours-cpu", prepared, exp, grads=False)
        errors.update(bench_verify.verify("ours-cpu", prepared, exp, grads=True))
        assert set(errors) == {"out", "dq", "dk", "dv"}
        prepared = uncapped.prepare(w, x)
        with pytest.raises(bench_verify.VerificationError, match="uncapped out: error .* exceeds"):
            bench_verify.verify("uncapped", prepared, exp, grads=False)
        with pytest.raises(bench_verify.VerificationError, match="uncapped d[qkv]: error .* exceeds"):
            bench_verify.verify("uncapped", prepared, exp, grads=True)


def test_tiny_cpu_softcap_suite_end_to_end(flash_attn, tmp_path):
    """The softcap stand-in on CPU: ours measured with its cap, SDPA math skipped with its reason
    (every label: plain, dense mask, padded), a provider that drops the cap refused; the page
    shows the cap in the mask column and the CSV reads the softcap column back, also from a page
    measured before that column existed."""
    workloads = grid_workloads("cpu-softcap")
    providers = make_providers(["ours-cpu", "sdpa-math"], flash_attn) + [_Uncapped(flash_attn)]
    result = runner.run_suite(workloads, providers, ["fwd", "bwd"], device=torch.device("cpu"),
                              timing=timing.Timing(warmup_ms=1, rep_ms=3), ours_module=flash_attn, progress=False)
    records, skips = result.records, result.skips
    assert sorted((r["provider"], r["workload"], r["mode"]) for r in records) == sorted(
        ("ours-cpu", w.name, m) for w in workloads for m in ("fwd", "bwd"))
    assert all(r["softcap"] == 50.0 and r["ratio_to_best_peer"] is None for r in records)
    assert all(math.isfinite(r["verify_err_out"]) and math.isfinite(r["verify_err_grad"]) for r in records)
    sdpa = [s for s in skips if s.provider.startswith("sdpa-math")]
    assert {s.provider for s in sdpa} == {"sdpa-math", "sdpa-math-densemask", "sdpa-math-padded"}
    assert all(s.reason == "SDPA has no logit soft-capping" and s.mode == "all" for s in sdpa)
    assert {s.workload for s in skips if s.provider == "uncapped" and "exceeds" in s.reason} == {
        w.name for w in workloads}
    skip_rows = [{"provider": s.provider, "workload": s.workload, "mode": s.mode, "reason": s.reason} for s in skips]
    page = tmp_path / "page"
    text = report.write_page(page, records, skip_rows).read_text()
    assert "## cpu-softcap" in text and "| causal cap50 |" in text and "| causal w95 cap50 |" in text
    assert "| causal cap50 varlen docs x3 |" in text and "SDPA has no logit soft-capping" in text
    assert "**Softcap**" in text
    assert [p.name for p in (page / "plots").glob("*.png")] == ["cpu-softcap-d64.png"]
    assert report.load(page) == (records, skip_rows)  # softcap read back as a float
    old = [{k: v for k, v in r.items() if k != "softcap"} for r in report.load(page)[0]]
    old = [dict(r, grid="cpu", workload=r["workload"].replace("-cap50", "")) for r in old]
    report.write_page(page, *report.combine(old, [], records, []))  # an older page, appended to
    loaded, _ = report.load(page)
    assert {r["softcap"] for r in loaded} == {None, 50.0}
    text = (page / "RESULTS.md").read_text()
    assert "| causal |" in text and "| causal cap50 |" in text


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


ENV = dict(gpu="NVIDIA H200", driver="580.95", torch="2.11.0+cu130", cuda="13.0", cudnn="9.19.0", triton="3.6.0",
           kernels="0.17.2", fa4="4.0.0b36", kernel_build="_flash_attn_x", git_sha="1234567",
           date="2026-12-02T10:00:00+00:00")


def test_page_is_replaced_or_added_to(tmp_path):
    """A page holds one run: writing replaces it (plots too); a second command adds its workloads,
    re-measured groups replacing the old ones whole; rows from another GPU are refused."""
    into = tmp_path / "benchmarks"
    stale = into / "plots" / "old-grid-d64.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"")
    first = _gqa_records(ENV, ours_mib=100, flash_mib=400)
    report.write_page(into, first, [{"provider": "fa4", "workload": "all", "mode": "all", "reason": "no FA4"}])
    assert not stale.exists() and [p.name for p in (into / "plots").glob("*.png")] == ["gqa-d128.png"]
    records, skips = report.load(into)
    assert records == first and skips[0]["reason"] == "no FA4"
    assert records[0]["driver"] == "580.95" and records[0]["git_sha"] == "1234567"  # strings stay strings

    later = dict(ENV, git_sha="89abcde", date="2026-12-02T11:00:00+00:00")
    page = report.combine(records, skips, _gqa_records(later, ours_mib=120, flash_mib=400, ours_tflops=500.0), [])
    text = report.write_page(into, *page).read_text()
    merged, _ = report.load(into)
    assert len(merged) == 3 and {r["git_sha"] for r in merged} == {"89abcde"}  # the group came whole
    ours = next(r for r in merged if r["provider"] == "ours-triton")
    assert ours["ratio_to_best_peer"] == pytest.approx(500 / 400) and ours["peak_mem_bytes"] == 120 << 20
    assert "## GQA / MQA backward: peak memory" in text
    assert "| `gqa-d128-h32-8-b4-s4096-causal` | backward | 120 | 800 | 400 | 0.30x |" in text
    assert "| ours-triton / best |" in text and "1.25x" in text and "![gqa-d128](plots/gqa-d128.png)" in text
    assert "NVIDIA H200" in text and "cuDNN 9.19.0" in text and "triton 3.6.0" in text and "89abcde" in text
    assert "(flash-attn-4) 4.0" not in text  # installed, but not measured on this page
    assert report.mismatches(merged, [dict(ENV, gpu="NVIDIA A100")]) == {"gpu": ["NVIDIA H200", "NVIDIA A100"]}
    # a peer's version clashes only where that peer is measured: on the page or in the command
    assert report.mismatches(merged, [dict(ENV, flashinfer="0.7.4")], ["ours-triton"]) == {}
    assert report.mismatches(merged, [dict(ENV, flashinfer="0.7.4")], ["flashinfer"]) == {
        "flashinfer": ["", "0.7.4"]}
    assert report.mismatches(merged, [dict(ENV, fa4="4.0.0b40")], ["ours-triton"]) == {}
    with_fa4 = merged + [dict(merged[-1], provider="fa4")]
    assert report.mismatches(with_fa4, [dict(ENV, fa4="4.0.0b40")], ["ours-triton"]) == {
        "fa4": ["4.0.0b36", "4.0.0b40"]}
    with pytest.raises(report.PageError, match="no results.csv"):
        report.load(tmp_path / "nothing")


def test_page_names_the_fa4_version_it_measured(tmp_path):
    records = _gqa_records(dict(ENV, flashinfer="0.7.4"), ours_mib=100, flash_mib=400)
    records.append(dict(records[-1], provider="fa4"))
    text = report.write_page(tmp_path, runner.add_ratios(records), []).read_text()
    assert "FlashAttention-4 (flash-attn-4) 4.0.0b36" in text
    assert "FlashInfer (flashinfer-python)" not in text  # installed, but not measured on this page
    records.append(dict(records[-1], provider="flashinfer"))
    text = report.write_page(tmp_path, runner.add_ratios(records), []).read_text()
    assert "FlashInfer (flashinfer-python) 0.7.4" in text


def test_cli_on_cpu(flash_attn, tmp_path, capsys, monkeypatch):
    from flash_attn_hub.cli import main
    monkeypatch.setenv(bench_env.GIT_SHA_ENV, "0123456789ab")
    variant = Path(flash_attn.__file__).parent
    into = tmp_path / "page"
    args = ["bench", "--grid", "all", "--kernel-dir", str(variant), "--into", str(into),
            "--warmup-ms", "1", "--rep-ms", "2", "--no-progress"]
    assert main([*args, "--modes", "fwd", "--match", "s128"]) == 0
    out = capsys.readouterr().out
    assert "instead of --grid all, the tiny CPU grid runs" in out and "GPU numbers need a GPU" in out
    records, _ = report.load(into)
    assert {r["provider"] for r in records} >= {"ours-cpu", "sdpa-math"}
    assert {r["mode"] for r in records} == {"fwd"} and {r["git_sha"] for r in records} == {"0123456789ab"}
    assert main([*args, "--modes", "bwd", "--match", "s256-full", "--append"]) == 0
    records, _ = report.load(into)
    assert {(r["mode"], r["seqlen_k"]) for r in records} == {("fwd", 128), ("bwd", 256)}
    (into / "notes.txt").write_text("not the page's")
    assert main([*args, "--modes", "fwd", "--match", "s256-full"]) == 0  # without --append: replaced
    records, _ = report.load(into)
    assert {(r["mode"], r["seqlen_k"]) for r in records} == {("fwd", 256)}
    assert (into / "notes.txt").exists() and (into / "RESULTS.md").exists()
    report.clear_page(into)
    assert sorted(p.name for p in into.rglob("*") if p.is_file()) == ["notes.txt"]
    assert main([*args, "--append", "--into", str(tmp_path / "empty")]) == 2
    assert "no results.csv" in capsys.readouterr().out
    assert main(["bench", "--kernel-dir", str(tmp_path / "no-build"), "--into", str(tmp_path / "x")]) == 2
    assert "could not load our kernel" in capsys.readouterr().out


def test_cli_softcap_grid_on_cpu(flash_attn, tmp_path, capsys, monkeypatch):
    """``--grid softcap`` runs its CPU stand-in: ours with its cap, SDPA skipped with the reason."""
    from flash_attn_hub.cli import main
    monkeypatch.setenv(bench_env.GIT_SHA_ENV, "0123456789ab")
    into = tmp_path / "page"
    assert main(["bench", "--kernel-dir", str(Path(flash_attn.__file__).parent), "--into", str(into),
                 "--warmup-ms", "1", "--rep-ms", "2", "--no-progress", "--grid", "softcap", "--modes", "fwd",
                 "--match", "s128"]) == 0
    out = capsys.readouterr().out
    assert "instead of --grid softcap, the tiny CPU grid runs (cpu-softcap:" in out
    assert "SDPA has no logit soft-capping" in out
    records, skips = report.load(into)
    assert {(r["provider"], r["grid"], r["softcap"]) for r in records} == {("ours-cpu", "cpu-softcap", 50.0)}
    assert [s["reason"] for s in skips] == ["SDPA has no logit soft-capping"]
    assert "causal cap50" in (into / "RESULTS.md").read_text()


def test_cli_kvcache_grid_on_cpu(flash_attn, tmp_path, capsys, monkeypatch):
    """``--grid kvcache`` alone runs its CPU stand-in; ``--append`` adds another grid to the page."""
    from flash_attn_hub.cli import main
    monkeypatch.setenv(bench_env.GIT_SHA_ENV, "0123456789ab")
    into = tmp_path / "page"
    args = ["bench", "--kernel-dir", str(Path(flash_attn.__file__).parent), "--into", str(into),
            "--warmup-ms", "1", "--rep-ms", "2", "--no-progress"]
    assert main([*args, "--grid", "kvcache", "--match", "b3-"]) == 0
    out = capsys.readouterr().out
    assert "instead of --grid kvcache, the tiny CPU grid runs (cpu-kvcache:" in out and "device copy:" in out
    records, _ = report.load(into)
    assert {(r["provider"], r["page_size"]) for r in records} == {("ours-cpu", 16), ("ours-cpu", 0), ("sdpa-math", 0)}
    assert all(r["gbps"] > 0 and r["pct_copy"] > 0 for r in records)
    assert main([*args, "--grid", "main", "--modes", "fwd", "--match", "s128-causal", "--append"]) == 0
    records, _ = report.load(into)
    assert {r["grid"] for r in records} == {"cpu-kvcache", "cpu"}
    text = (into / "RESULTS.md").read_text()
    assert "## cpu-kvcache" in text and "## cpu\n" in text and "ours-cpu %copy" in text
    # the page names the commands that measured it, the appended one too
    assert "Measured by these commands" in text
    assert "- `python -m flash_attn_hub bench " in text and "--grid kvcache" in text and "--append`" in text


def test_resume_measures_only_what_the_page_lacks(flash_attn, tmp_path, capsys, monkeypatch):
    """``--resume`` (a command stopped by a time limit, run again) leaves out the workloads on the
    page in every requested mode, and starts a page where there is none."""
    from flash_attn_hub.cli import main
    monkeypatch.setenv(bench_env.GIT_SHA_ENV, "0123456789ab")
    into = tmp_path / "page"
    args = ["bench", "--kernel-dir", str(Path(flash_attn.__file__).parent), "--into", str(into),
            "--warmup-ms", "1", "--rep-ms", "2", "--no-progress", "--resume"]
    assert main([*args, "--modes", "fwd", "--match", "s128-full"]) == 0  # no page yet: a new one
    records, _ = report.load(into)
    first = {(r["workload"], r["mode"]) for r in records}
    assert first and {m for _, m in first} == {"fwd"}
    capsys.readouterr()
    assert main([*args, "--modes", "fwd,bwd", "--match", "s128-full|s256-full"]) == 0
    out = capsys.readouterr().out
    assert "--resume: 0 of 2 workloads are on the page already" in out  # s128-full lacks bwd
    records, _ = report.load(into)
    assert {(r["seqlen_k"], r["mode"]) for r in records} == {(128, "fwd"), (128, "bwd"),
                                                              (256, "fwd"), (256, "bwd")}
    assert main([*args, "--modes", "fwd", "--match", "s128-full|s256-full|s128-causal"]) == 0
    out = capsys.readouterr().out
    assert "--resume: 2 of 3 workloads are on the page already" in out
    measured = {(r["workload"], r["mode"]) for r in report.load(into)[0]}
    assert len(measured) == 5 and any("s128-causal" in w for w, _ in measured)
    assert main([*args, "--modes", "fwd"]) == 0  # the whole CPU grid: measures the rest
    before = {(r["workload"], r["mode"], r["ms_p50"]) for r in report.load(into)[0]}
    assert main([*args, "--modes", "fwd"]) == 0
    assert "nothing left to measure" in capsys.readouterr().out
    assert {(r["workload"], r["mode"], r["ms_p50"]) for r in report.load(into)[0]} == before
    assert (into / "RESULTS.md").exists()
    assert main([*args, "--modes", "fwd", "--match", "s128-full", "--dtype", "fp16"]) == 0  # another dtype
    assert "--resume: 0 of 1 workloads are on the page already" in capsys.readouterr().out
    assert {r["dtype"] for r in report.load(into)[0]} == {"bf16", "fp16"}
