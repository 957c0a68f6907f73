"""``flash_attn_with_kvcache`` and the paged ``flash_attn_varlen_func`` on a GPU: realistic sizes
against the kv-cache oracle (the cases and checks of ``test_kvcache.py``), decode steps captured
in a CUDA graph and replayed, and calls that never synchronise with the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flash_attn_hub.reference import assert_close_to_reference, kvcache_reference
from helpers import submodule
from test_kvcache import (POISON_INT, Case, _copy_layout, build, build_paged_varlen,
                          gather_reference, run_case)

GPU_CASES = {
    "decode_gqa_page16": Case(page_size=16, lengths=(1000, 17, 2500, 0), heads=(32, 8),
                              head_dim=128),
    "decode_gqa_contiguous_sinks": Case(lengths=(3000, 64, 700), heads=(32, 8), head_dim=128,
                                        sink=True),
    "multi_token_gqa_page64": Case(page_size=64, lengths=(1500, 900), seqlen_q=8, seqlen_new=8,
                                   heads=(64, 8), head_dim=128),
    "chunked_prefill_page1_window": Case(page_size=1, lengths=(300, 40), seqlen_q=16,
                                         seqlen_new=16, heads=(8, 1), head_dim=64,
                                         window=(128, 0), softcap=30.0),
    "rotary_leftpad_d256": Case(lengths=(500, 90), leftpad=(33, 0), seqlen_q=4, seqlen_new=4,
                                heads=(8, 2), head_dim=256, rotary="neox"),
    "page256_alibi_padding_slot": Case(page_size=256, lengths=(600, -1, 1200), heads=(16, 4),
                                       head_dim=128, alibi="batch"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_oracle(flash_attn, name, dtype):
    run_case(flash_attn, dataclasses.replace(GPU_CASES[name], dtype=dtype), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, num_splits", [(None, 0), (16, 0), (16, 4)])
def test_gpu_cuda_graph_replays_decode_steps(flash_attn, page_size, num_splits):
    """A decode step (append one token per sequence, attend) captured once and replayed with new
    tokens and lengths written into the captured tensors, checked against the oracle at every
    step; one batch slot stays a padding slot (cache_seqlens -1), as transformers pads."""
    steps = 3
    case = Case(page_size=page_size, lengths=(100, 37, 250, -1), seqlen_new=steps,
                heads=(32, 8), head_dim=128, dtype=torch.bfloat16)
    torch.manual_seed(0)
    args, _ = build(case, "cuda")  # capacity for `steps` appended tokens
    q = torch.empty_like(args["q"])
    k = torch.empty_like(args["k"][:, :1])
    v = torch.empty_like(k)
    seqlens = args["cache_seqlens"].clone()
    call = dict(k_cache=args["k_cache"], v_cache=args["v_cache"], cache_seqlens=seqlens,
                block_table=args.get("block_table"), causal=True, num_splits=num_splits)
    for t in (q, k, v):
        t.normal_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn.flash_attn_with_kvcache(q, k=k, v=v, **call)  # compiles the kernels
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn.flash_attn_with_kvcache(q, k=k, v=v, **call)
    for step in range(steps):
        for t in (q, k, v):
            t.normal_()
        lengths = torch.tensor(case.lengths, dtype=torch.int32, device="cuda")
        seqlens.copy_(torch.where(lengths >= 0, lengths + step, lengths))
        before = {name: call[name].clone() for name in ("k_cache", "v_cache")}
        graph.replay()
        torch.cuda.synchronize()
        ref_args = dict(q=q, k=k, v=v, **{**call, **before})
        ref_args.pop("num_splits")
        ref64 = kvcache_reference(**ref_args)
        lowp = kvcache_reference(**ref_args, dtype=case.dtype)
        assert_close_to_reference(f"out, step {step}", out, ref64["out"], lowp["out"])
        for b, n in enumerate(seqlens.tolist()):
            if n < 0:
                continue
            where = ((args["block_table"][b, n // page_size].item(), n % page_size) if page_size
                     else (b, n))
            assert torch.equal(call["k_cache"][where], k[b, 0])
            assert torch.equal(call["v_cache"][where], v[b, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_gpu_unchecked_call_never_syncs(flash_attn, monkeypatch, page_size):
    """With the value checks off (as under graph capture), a call performs no host
    synchronisation: no ``.item()``, no device-to-host copy, no value-sized allocation; the
    paged varlen call neither (its lengths come as ints, as transformers sends them)."""
    monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", "0")
    case = Case(page_size=page_size, lengths=(100, 3), seqlen_q=4, seqlen_new=4, heads=(16, 4),
                head_dim=128, dtype=torch.bfloat16, rotary="interleaved", sink=True)
    torch.manual_seed(0)
    args, _ = build(case, "cuda")
    for splits in (0, 3):  # compile first (a first launch may sync)
        flash_attn.flash_attn_with_kvcache(**args, num_splits=splits)
    torch.cuda.synchronize()
    q, k_cache, v_cache, cq, ck, mq, mk, table = build_paged_varlen(
        [5, 1, 12], [9, 1, 30], page_size=16, dtype=torch.bfloat16, device="cuda")
    flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, mq, mk, block_table=table,
                                      causal=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash_attn.flash_attn_with_kvcache(**args, num_splits=0)
        flash_attn.flash_attn_with_kvcache(**args, num_splits=3)
        flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, mq, mk, block_table=table,
                                          causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _launchers(flash_attn):
    """The cached launchers (``_triton/launch.py``) of the attention kernel and the combine."""
    return (submodule(flash_attn, "_triton.kvcache")._attend,
            submodule(flash_attn, "_triton.common")._combine)


def _triton_path_disabled(*args, **kwargs):
    raise AssertionError("a launch took Triton's path (JITFunction.run)")


@pytest.mark.gpu
def test_gpu_decode_step_reuses_its_compiled_kernels_bitwise(flash_attn, monkeypatch):
    """The decode step of tools/host_overhead.py (B=1, 4k keys, GQA 32/8, D=128, one new token,
    value checks off) twice: first through Triton's launch, then through the cached launchers
    with Triton's path disabled. Output, lse and caches come out bitwise equal."""
    monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", "0")
    case = Case(lengths=(4095,), heads=(32, 8), head_dim=128, dtype=torch.bfloat16)
    torch.manual_seed(0)
    args, _ = build(case, "cuda")
    launchers = _launchers(flash_attn)
    for launcher in launchers:
        assert launcher.enabled
        launcher.clear()

    def step():
        caches = {name: args[name].clone() for name in ("k_cache", "v_cache")}
        out, lse = flash_attn.flash_attn_with_kvcache(**{**args, **caches}, num_splits=4,
                                                      return_softmax_lse=True)
        return out, lse, caches["k_cache"], caches["v_cache"]

    first = step()
    assert [len(launcher) for launcher in launchers] == [1, 1]  # split: attention + combine
    for launcher in launchers:
        monkeypatch.setattr(launcher.fn, "run", _triton_path_disabled)
    second = step()
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), first, second):
        bits = {2: torch.int16, 4: torch.int32}[a.element_size()]  # (the caches hold NaN)
        assert torch.equal(a.view(bits), b.view(bits)), (
            f"{name} differs between Triton's launch and the cached one")


@pytest.mark.gpu
def test_gpu_value_checks_gather_in_one_cached_launch(flash_attn, monkeypatch):
    """Under ``auto`` on CUDA the value checks read their numbers through the one launch of
    ``_triton.kvcache_checks``, never the torch ops of ``_used_entry_range``, and from the
    second checked call on through the cached launcher (Triton's path disabled); a bad used
    entry still raises naming it. At decode sizes (64 sequences over 32k keys in 16-key pages:
    2048 columns, several column steps; pages of 1 and 256 too) the gather's numbers are the
    torch path's."""
    value_checks = submodule(flash_attn, "_kvcache_values")
    checks = submodule(flash_attn, "_triton.kvcache_checks")
    monkeypatch.delenv("FLASH_ATTN_HUB_BACKEND", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ints = dict(generator=gen, device="cuda", dtype=torch.int32)
    for page_size, batch, capacity in ((16, 64, 32768), (1, 8, 4096), (256, 32, 131072)):
        cols = capacity // page_size
        lengths = torch.randint(-1, capacity, (batch,), **ints)
        leftpad = (torch.rand(batch, generator=gen, device="cuda") * lengths.clamp(min=0)).int()
        table = torch.randint(0, 1 << 20, (batch, cols), **ints)
        pages = torch.arange(cols, device="cuda") * page_size
        table[pages[None, :] > lengths[:, None]] = -1  # -1 past each row's pages (+ 1 new key)
        table[batch // 2, 0] = -7  # a bad entry, used unless that row's left pad skips it
        expected = gather_reference(value_checks, lengths, leftpad, None, table, 1, page_size)
        out = torch.full((len(expected),), POISON_INT, device="cuda", dtype=torch.int32)
        checks.gather_values(out, lengths, leftpad, None, table, seqlen_new=1,
                             page_size=page_size)
        assert out.tolist() == expected, (page_size, batch, capacity)

    monkeypatch.setattr(value_checks, "_used_entry_range", None)  # calling it fails
    case = Case(page_size=16, lengths=(1000, 17, -1, 2500), heads=(32, 8), head_dim=128,
                dtype=torch.bfloat16)
    torch.manual_seed(0)
    args, _ = build(case, "cuda")
    flash_attn.flash_attn_with_kvcache(**args)
    monkeypatch.setattr(checks._values.fn, "run", _triton_path_disabled)
    args["cache_seqlens"][0] += 1  # a new version: checked again
    flash_attn.flash_attn_with_kvcache(**args)
    args["block_table"][3, 1] = args["k_cache"].shape[0]
    with pytest.raises(ValueError, match=r"^block_table: got block_table\[3, 1\] = "):
        flash_attn.flash_attn_with_kvcache(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, num_splits, sink, check_values",
                         [(None, 0, False, "0"), (None, 4, True, "0"), (16, 0, False, "0"),
                          (16, 3, True, "0"), (None, 4, True, "1"), (16, 3, True, "1")])
def test_gpu_lane_matches_the_full_path_bitwise(flash_attn, monkeypatch, page_size, num_splits,
                                                sink, check_values):
    """[Note: lanes] in kvcache.py: a decode step through the full path (lanes off), then the
    same step twice with lanes on, the second through the lane (no metadata checks run; with
    the value checks on, the lane runs those). Output, lse and caches come out bitwise equal,
    and the lane's output matches the oracle."""
    monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", check_values)
    kvcache = submodule(flash_attn, "kvcache")
    monkeypatch.setattr(kvcache, "_lanes", {})
    checks, real = [], kvcache._checked_call
    monkeypatch.setattr(kvcache, "_checked_call", lambda *a: checks.append(1) or real(*a))
    case = Case(page_size=page_size, lengths=(1000, 17, 2500), heads=(32, 8), head_dim=128,
                sink=sink, dtype=torch.bfloat16)
    torch.manual_seed(0)
    args, _ = build(case, "cuda")

    def step():
        caches = {name: _copy_layout(args[name]) for name in ("k_cache", "v_cache")}
        out, lse = flash_attn.flash_attn_with_kvcache(**{**args, **caches},
                                                      num_splits=num_splits,
                                                      return_softmax_lse=True)
        return out, lse, caches["k_cache"], caches["v_cache"]

    monkeypatch.setattr(kvcache, "_LANE_DEVICES", ())
    full = step()
    assert not kvcache._lanes
    monkeypatch.setattr(kvcache, "_LANE_DEVICES", ("cuda",))
    step()
    assert len(kvcache._lanes) == 1
    checks.clear()
    lane = step()
    assert not checks, "the repeated call did not go through its lane"
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), full, lane):
        bits = {2: torch.int16, 4: torch.int32}[a.element_size()]  # (the caches hold NaN)
        assert torch.equal(a.view(bits), b.view(bits)), f"{name}: the lane differs"
    ref64, lowp = kvcache_reference(**args), kvcache_reference(**args, dtype=case.dtype)
    assert_close_to_reference("out", lane[0], ref64["out"], lowp["out"])


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("page_size", [None, 16])
def test_gpu_sanitize_decode_steps(flash_attn, monkeypatch, page_size):
    """A small decode step with split keys and sinks, through the full path and then the lane
    (the set compute-sanitizer runs on the kv-cache kernels); the oracle runs on the CPU, so
    that no cuBLAS kernel is in the run."""
    monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", "0")
    kvcache = submodule(flash_attn, "kvcache")
    monkeypatch.setattr(kvcache, "_lanes", {})
    case = Case(page_size=page_size, lengths=(300, 17, -1), heads=(8, 2), head_dim=128,
                sink=True, dtype=torch.bfloat16)
    torch.manual_seed(0)
    args, _ = build(case, "cpu")
    ref64, lowp = kvcache_reference(**args), kvcache_reference(**args, dtype=case.dtype)
    on_gpu = {name: value.cuda() if isinstance(value, torch.Tensor) else value
              for name, value in args.items()}
    for _ in range(2):  # the second call goes through the lane the first made
        out = flash_attn.flash_attn_with_kvcache(**{**on_gpu,
                                                    "k_cache": on_gpu["k_cache"].clone(),
                                                    "v_cache": on_gpu["v_cache"].clone()},
                                                 num_splits=3)
        assert_close_to_reference("out", out.cpu(), ref64["out"], lowp["out"])
    assert len(kvcache._lanes) == 1


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (contiguous) whose data pointer is 2 bytes past a 16-byte boundary."""
    base = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    return base[1:1 + t.numel()].view(t.shape).copy_(t)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` as the first D columns of a ``(.., D + 8)`` allocation: its head stride
    (D + 8 elements) is no multiple of 16, which Triton specialises on."""
    wide = torch.full((*t.shape[:-1], t.shape[-1] + 8), float("nan"), dtype=t.dtype,
                      device=t.device)
    return wide[..., :t.shape[-1]].copy_(t)


@pytest.mark.gpu
def test_gpu_cached_launch_respecialises(flash_attn, monkeypatch):
    """A call Triton would compile differently (q not 16-byte aligned; cache head strides no
    multiple of 16) goes through Triton's path and its own kernel, never a cached kernel of
    another specialisation; a repeat of the first call does not. Each result is checked
    against the oracle."""
    monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", "0")
    case = Case(lengths=(1000, 17), heads=(32, 8), head_dim=128, dtype=torch.bfloat16)
    torch.manual_seed(0)
    args, _ = build(case, "cuda")
    ref64, lowp = kvcache_reference(**args), kvcache_reference(**args, dtype=case.dtype)
    attend = _launchers(flash_attn)[0]
    attend.clear()
    compiles, jit_run = [], attend.fn.run

    def counted(*a, **kw):
        compiles.append(1)
        return jit_run(*a, **kw)

    monkeypatch.setattr(attend.fn, "run", counted)
    layouts = {"contiguous": {}, "repeat": {}, "q unaligned": {"q": _unaligned(args["q"])},
               "wide caches": {"k_cache": _wide(args["k_cache"]),
                               "v_cache": _wide(args["v_cache"])}}
    expected = {"contiguous": 1, "repeat": 1, "q unaligned": 2, "wide caches": 3}
    for label, changes in layouts.items():
        call = {**args, **changes}
        call.update(k_cache=_copy_layout(call["k_cache"]), v_cache=_copy_layout(call["v_cache"]))
        out = flash_attn.flash_attn_with_kvcache(**call)
        torch.cuda.synchronize()
        assert len(compiles) == expected[label], label
        assert_close_to_reference(f"out, {label}", out, ref64["out"], lowp["out"])
