"""``flash_attn_with_kvcache`` and the paged ``flash_attn_varlen_func`` against the kv-cache oracle
(``flash_attn_hub.reference.kvcache_reference``), through the built package as users call it.

Every case builds its caches poisoned: every position no sequence owns (pages no table row
uses, slots past a sequence's end, rows before ``cache_leftpad``, the slots the append must
fill) holds NaN, so a kernel that reads one without masking it returns NaN, and after the call
every position but the appended ones must be bit-for-bit unchanged. Outputs follow the tolerance
rule (``assert_close_to_reference``: our error against float64 within twice PyTorch's own error
in the input dtype); appended values must equal the new ``v`` exactly and the new ``k`` exactly,
or, rotated, within the rule.

The CPU backend runs the matrix in bf16 and fp16. The Triton kernels run a subset in fp16 under
Triton's interpreter (``TRITON_INTERPRET=1``, set before the kernel module is imported; bf16 is
broken there), or compiled on a GPU. ``test_kvcache_gpu.py`` adds realistic sizes, CUDA-graph
capture and the no-host-sync check on a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated (its module is imported lazily by
# the dispatcher, after collection). Without CUDA the interpreter is the only way to run it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from flash_attn_hub.reference import (assert_close_to_reference, kvcache_reference,  # noqa: E402
                                      paged_varlen_reference)
from helpers import cu_seqlens, submodule  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")

# flash-attn 2.8's flash_attn_with_kvcache, in order, plus `s_aux` last.
KVCACHE_PARAMS = [
    ("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None),
    ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
    ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
    ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
    ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
    ("return_softmax_lse", False), ("s_aux", None),
]


# ---------------------------------------------------------------------------------------------
# One case: poisoned caches, a call, the oracle in float64 and in the input dtype.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    lengths: tuple = (5, 0, 9)  # cache_seqlens before the append; -1 is a padding slot
    seqlen_q: int = 1
    seqlen_new: int = 1  # 0: no k/v
    heads: tuple = (8, 2)
    head_dim: int = 32
    page_size: int | None = None  # None: a contiguous cache
    leftpad: tuple | None = None
    batch_idx: bool = False  # contiguous cache rows in a shuffled order, plus a spare row
    rotary: str | None = None  # "interleaved" or "neox"
    rotary_dim: int | None = None  # default: the head dim
    causal: bool = True
    window: tuple = (-1, -1)
    softcap: float = 0.0
    sink: bool = False
    alibi: str | None = None  # "heads": (Hq,), "batch": (B, Hq)
    int_seqlens: bool = False  # cache_seqlens passed as an int (all lengths equal)
    odd_layouts: bool = False  # strided q/k/v/caches, a column-major table, strided seqlens,
    #                            rotary_sin with another row stride than rotary_cos
    dtype: torch.dtype = torch.float16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build(case: Case, device) -> tuple[dict, list]:
    """The call's keyword arguments (poisoned caches) and the appended slots, as
    ``(b, j, (block or row, slot))`` for new token ``j`` of sequence ``b``."""
    batch, (heads_q, heads_kv) = len(case.lengths), case.heads
    dim, dtype = case.head_dim, case.dtype
    new = case.seqlen_new
    starts = case.leftpad or (0,) * batch
    ends = [n + new if n >= 0 else 0 for n in case.lengths]
    randn = dict(dtype=dtype, device=device)
    args = dict(q=torch.randn(batch, case.seqlen_q, heads_q, dim, **randn))
    if new:
        args.update(k=torch.randn(batch, new, heads_kv, dim, **randn),
                    v=torch.randn(batch, new, heads_kv, dim, **randn))
    if case.page_size is not None:
        size = case.page_size
        max_blocks = _cdiv(max(ends), size) + 1  # always a trailing -1 entry
        pages = [range(starts[b] // size, _cdiv(ends[b], size)) for b in range(batch)]
        num_blocks = sum(len(p) for p in pages) + 2  # two blocks nobody owns
        order = iter(torch.randperm(num_blocks).tolist())
        table = [[-1] * max_blocks for _ in range(batch)]
        for b, span in enumerate(pages):
            for p in span:
                table[b][p] = next(order)
        shape = (num_blocks, size, heads_kv, dim)
        args["block_table"] = torch.tensor(table, dtype=torch.int32, device=device)

        def locate(b, n):
            return table[b][n // size], n % size
        capacity = max_blocks * size
    else:
        rows = torch.randperm(batch + 1).tolist()[:batch] if case.batch_idx else list(range(batch))
        capacity = max(ends) + 3
        shape = (batch + case.batch_idx, capacity, heads_kv, dim)
        if case.batch_idx:
            args["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32, device=device)

        def locate(b, n):
            return rows[b], n
    k_cache = torch.full(shape, math.nan, **randn)
    v_cache = torch.full(shape, math.nan, **randn)
    for b, n in enumerate(case.lengths):
        for pos in range(starts[b], max(n, 0)):
            k_cache[locate(b, pos)] = torch.randn(heads_kv, dim, **randn)
            v_cache[locate(b, pos)] = torch.randn(heads_kv, dim, **randn)
    args.update(k_cache=k_cache, v_cache=v_cache)
    if case.int_seqlens:
        (args["cache_seqlens"],) = set(case.lengths)
    else:
        args["cache_seqlens"] = torch.tensor(case.lengths, dtype=torch.int32, device=device)
    if case.leftpad is not None:
        args["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32, device=device)
    if case.rotary is not None:
        half = (case.rotary_dim or dim) // 2
        angles = torch.rand(capacity, half, device=device) * (2 * math.pi)
        args.update(rotary_cos=angles.cos().to(dtype), rotary_sin=angles.sin().to(dtype),
                    rotary_interleaved=case.rotary == "interleaved")
    args.update(causal=case.causal, window_size=case.window, softcap=case.softcap)
    if case.sink:
        args["s_aux"] = torch.randn(heads_q, device=device)
    if case.alibi is not None:
        shape = (heads_q,) if case.alibi == "heads" else (batch, heads_q)
        args["alibi_slopes"] = torch.rand(*shape, device=device) * 0.5
    written = [(b, j, locate(b, n + j)) for b, n in enumerate(case.lengths) if n >= 0
               for j in range(new)]
    if case.odd_layouts:
        for name in ("q", "k", "v", "k_cache", "v_cache"):
            if name in args:  # the last D columns of a (.., 2 D) allocation
                wide = torch.full((*args[name].shape[:-1], 2 * dim), math.nan, **randn)
                wide[..., dim:] = args[name]
                args[name] = wide[..., dim:]
        if "block_table" in args:
            args["block_table"] = args["block_table"].t().contiguous().t()
        if "rotary_sin" in args:  # a row stride of its own: the middle third of a wider table
            sin = args["rotary_sin"]
            wide = torch.full((sin.shape[0], 3 * sin.shape[1]), math.nan, dtype=sin.dtype,
                              device=sin.device)
            wide[:, sin.shape[1]:2 * sin.shape[1]] = sin
            args["rotary_sin"] = wide[:, sin.shape[1]:2 * sin.shape[1]]
        if isinstance(args["cache_seqlens"], torch.Tensor):
            args["cache_seqlens"] = args["cache_seqlens"].repeat_interleave(2)[::2]
    return args, written


def _copy_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (``clone`` makes non-dense views contiguous)."""
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return copy.copy_(t)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def check_writes(args: dict, caches: tuple, written: list, ref64: dict, lowp: dict) -> None:
    """Only the appended slots changed; they hold the new v exactly and the new k exactly, or
    (rotated) within the tolerance rule."""
    for name, new, ours in (("k_cache", "k", caches[0]), ("v_cache", "v", caches[1])):
        before = args[name]
        untouched = torch.ones(before.shape[:2], dtype=torch.bool, device=before.device)
        for _, _, slot in written:
            untouched[slot] = False
        assert torch.equal(_bits(ours)[untouched], _bits(before)[untouched]), (
            f"{name}: a position outside the appended tokens changed")
        if not written:
            continue
        got = torch.stack([ours[slot] for _, _, slot in written])
        given = torch.stack([args[new][b, j] for b, j, _ in written])
        if name == "k_cache" and "rotary_cos" in args:
            expect64 = torch.stack([ref64["k_new"][b, j] for b, j, _ in written])
            expect_lowp = torch.stack([lowp["k_new"][b, j] for b, j, _ in written])
            assert_close_to_reference(f"{name} appended", got, expect64, expect_lowp)
        else:
            assert torch.equal(got, given), f"{name}: the appended values differ from {new}"


def run_case(fa, case: Case, device="cpu", seed=0, **call) -> None:
    """Builds ``case``, calls ``flash_attn_with_kvcache`` on copies of its caches (``call``:
    extra keywords such as ``num_splits``) and checks out, lse and the caches."""
    torch.manual_seed(seed)
    args, written = build(case, device)
    caches = (_copy_layout(args["k_cache"]), _copy_layout(args["v_cache"]))
    out, lse = fa.flash_attn_with_kvcache(**{**args, "k_cache": caches[0], "v_cache": caches[1]},
                                          return_softmax_lse=True, **call)
    ref64 = kvcache_reference(**args)
    lowp = kvcache_reference(**args, dtype=case.dtype)
    assert out.is_contiguous() and out.dtype == case.dtype and lse.dtype == torch.float32
    assert_close_to_reference("out", out, ref64["out"], lowp["out"])
    assert_close_to_reference("lse", lse, ref64["lse"], lowp["lse"])
    check_writes(args, caches, written, ref64, lowp)


CASES = {
    "contiguous_gqa": Case(),
    "contiguous_mha": Case(heads=(4, 4)),
    "page1_mqa": Case(page_size=1, heads=(4, 1)),
    "page16_append_crosses_page": Case(page_size=16, lengths=(14, 30, 3), seqlen_new=5,
                                       seqlen_q=3),
    "page64_sq16": Case(page_size=64, lengths=(70, 5), seqlen_new=16, seqlen_q=16,
                        heads=(4, 2)),
    "page256": Case(page_size=256, lengths=(300, 17), heads=(4, 1)),
    "page3_sq3_more_queries_than_new_keys": Case(page_size=3, lengths=(7, 2), seqlen_q=3),
    "empty_caches_with_new": Case(page_size=16, lengths=(0, 0), seqlen_new=2, seqlen_q=2),
    "empty_caches_no_new_sink": Case(lengths=(0, 4), seqlen_new=0, sink=True),
    "padding_slot": Case(page_size=16, lengths=(4, -1, 6)),
    "no_new_keys": Case(page_size=16, lengths=(7, 12), seqlen_new=0, seqlen_q=2),
    "window_softcap": Case(page_size=8, lengths=(20, 11), seqlen_q=3, seqlen_new=3,
                           window=(4, 0), softcap=5.0),
    "window_both_sides_not_causal": Case(lengths=(12, 9), seqlen_q=2, seqlen_new=2,
                                         causal=False, window=(3, 2)),
    "sinks_alibi": Case(page_size=4, lengths=(9, 3), causal=False, sink=True, alibi="heads"),
    "alibi_per_sequence_causal": Case(lengths=(6, 10), seqlen_q=2, seqlen_new=2, alibi="batch"),
    "leftpad_contiguous": Case(lengths=(5, 3, 9), leftpad=(2, 0, 4), seqlen_q=2, seqlen_new=2),
    "leftpad_paged": Case(page_size=4, lengths=(10, 6), leftpad=(5, 0)),
    "cache_batch_idx": Case(lengths=(4, 8, 2), batch_idx=True, seqlen_new=2, seqlen_q=2),
    "rotary_interleaved_causal": Case(page_size=16, lengths=(10, 3), seqlen_q=3, seqlen_new=3,
                                      rotary="interleaved"),
    "rotary_neox_partial_not_causal": Case(lengths=(6, 2), seqlen_q=2, seqlen_new=2,
                                           rotary="neox", rotary_dim=16, causal=False),
    "rotary_leftpad_window": Case(lengths=(9, 5), leftpad=(3, 1), seqlen_q=2, seqlen_new=2,
                                  rotary="neox", causal=False, window=(4, 1)),
    "int_cache_seqlens": Case(page_size=5, lengths=(6, 6), int_seqlens=True, seqlen_new=2),
    "head_dim_72": Case(head_dim=72, lengths=(5, 2)),
    "odd_layouts_paged": Case(page_size=8, lengths=(9, 20), seqlen_q=2, seqlen_new=2,
                              rotary="interleaved", odd_layouts=True),
    "odd_layouts_contiguous": Case(lengths=(6, 3, 8), leftpad=(1, 0, 3), batch_idx=True,
                                   odd_layouts=True),
    "empty_query_appends": Case(page_size=4, lengths=(3, 6), seqlen_q=0, seqlen_new=2),
}
# The Triton subset (the interpreter is slow): every page-size branch, GQA/MQA, Sq > 1 across
# packed-row blocks, band edges, sinks, ALiBi, rotary, leftpad, batch index, padding slots.
TRITON_CASES = ["contiguous_gqa", "page1_mqa", "page16_append_crosses_page", "page64_sq16",
                "page256", "empty_caches_with_new", "empty_caches_no_new_sink", "padding_slot",
                "window_softcap", "sinks_alibi", "leftpad_paged", "cache_batch_idx",
                "rotary_interleaved_causal", "rotary_neox_partial_not_causal", "head_dim_72",
                "odd_layouts_paged", "odd_layouts_contiguous", "empty_query_appends"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_matches_oracle(flash_attn, name, dtype):
    run_case(flash_attn, dataclasses.replace(CASES[name], dtype=dtype))


@pytest.fixture
def triton_device(monkeypatch):
    """Runs the calls on the Triton kernels: compiled on CUDA tensors, else interpreted on CPU
    tensors (skipped when the kernels were compiled for a GPU that is not there)."""
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("no CUDA device and TRITON_INTERPRET is off")
    return "cpu"


@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_matches_oracle(flash_attn, triton_device, name):
    run_case(flash_attn, CASES[name], device=triton_device)


@pytest.mark.parametrize("num_splits, combine_chunk", [(1, None), (2, None), (5, None), (5, 2)])
def test_triton_splits_match_oracle_and_repeat_bitwise(flash_attn, triton_device, monkeypatch,
                                                       num_splits, combine_chunk):
    """Forced splits (more splits than some sequences have key blocks, too), each combined in
    a fixed order: the same call twice gives the same bits. ``combine_chunk`` narrows the
    combine's split tile so that it reads the splits in several chunks."""
    if combine_chunk:
        monkeypatch.setattr(submodule(flash_attn, "_triton.common"), "COMBINE_BLOCK_S",
                            combine_chunk)
        # launch plans read the constant when they are made: none made without it is reused
        monkeypatch.setattr(submodule(flash_attn, "_triton.kvcache"), "_plans", {})
    case = Case(page_size=16, lengths=(40, 3, 70), seqlen_new=2, seqlen_q=2, sink=True)
    run_case(flash_attn, case, device=triton_device, num_splits=num_splits)
    torch.manual_seed(1)
    args, _ = build(case, triton_device)
    first = flash_attn.flash_attn_with_kvcache(**{**args, "k_cache": args["k_cache"].clone(),
                                                  "v_cache": args["v_cache"].clone()},
                                               num_splits=num_splits)
    second = flash_attn.flash_attn_with_kvcache(**{**args, "k_cache": args["k_cache"].clone(),
                                                   "v_cache": args["v_cache"].clone()},
                                                num_splits=num_splits)
    assert torch.equal(first, second)


def test_split_rule_fills_two_programs_per_sm_only_for_small_gathers(flash_attn, monkeypatch):
    """The kv-cache split rule on a Hopper-sized GPU (132 SMs; CPU tensors, so the capability
    and SM count are patched): a tile of up to 32 rows over 16-key pages (the per-key gather)
    fills two programs per SM, so B=1 over 32k keys at GQA 32/8 takes 33 splits instead of 16
    (Sq=1 and Sq=8); a 64-row gather tile, a page that holds whole key blocks and a contiguous
    cache keep one. A split may hold 256 keys, two of the gather's 128-key steps, so one
    sequence of 4k keys splits 16 ways as a contiguous cache does (not 8)."""
    kv = submodule(flash_attn, "_triton.kvcache")
    heuristics = submodule(flash_attn, "_heuristics")
    monkeypatch.setattr(kv, "hopper_or_later", lambda device: True)
    monkeypatch.setattr(heuristics, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")

    def splits(packed_rows, page_size, max_keys=32768, batch=1):
        tiles = kv.tiles_for(128, packed_rows, gpu, page_size=page_size)
        return tiles.block_n, heuristics.kvcache_splits(
            batch=batch, heads_kv=8, row_blocks=max(1, packed_rows // tiles.block_m),
            max_keys=max_keys, block_n=tiles.block_n, device=gpu,
            programs_per_sm=tiles.programs_per_sm)

    assert splits(4, 16) == (128, 33)
    assert splits(32, 16) == (128, 33)
    assert splits(32, 16, batch=8) == (128, 4)
    assert splits(64, 16) == (128, 16)
    assert splits(4, 64) == (64, 16)
    assert splits(4, 0) == (64, 16)
    assert splits(32, 0, batch=8) == (64, 2)
    assert splits(4, 16, max_keys=4096) == (128, 16)
    assert splits(64, 16, max_keys=4096) == (128, 16)
    assert splits(4, 0, max_keys=4096) == (64, 16)
    assert splits(4, 0, max_keys=512) == (64, 2)


# Appends of many new keys (chunked prefill): new-key tiles across key blocks, row blocks and
# splits, the queries fewer than the new keys or as many, with each rotary layout.
LONG_APPENDS = {
    "paged_gather_neox": Case(page_size=8, lengths=(21, 0, -1, 50), seqlen_new=40, seqlen_q=40,
                              heads=(4, 2), rotary="neox"),
    "page_aligned_interleaved_partial_window": Case(page_size=16, lengths=(16, 5), seqlen_new=37,
                                                    seqlen_q=3, rotary="interleaved",
                                                    rotary_dim=16, window=(20, 0)),
    "contiguous_leftpad_batch_idx_not_causal": Case(lengths=(30, 7), leftpad=(9, 0),
                                                    batch_idx=True, seqlen_new=33, seqlen_q=2,
                                                    rotary="neox", rotary_dim=16, causal=False),
}


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("name", list(LONG_APPENDS))
def test_triton_long_appends_match_oracle(flash_attn, triton_device, name, num_splits):
    run_case(flash_attn, LONG_APPENDS[name], device=triton_device, num_splits=num_splits)


def _record_launches(flash_attn, monkeypatch) -> list:
    """The names of the kernels launched through a cached launcher (``_triton/launch.py``)
    from now on, in order."""
    launcher_type = submodule(flash_attn, "_triton.launch").CachedLauncher
    launched, launch = [], launcher_type.launch

    def recording(launcher, bound, grid, leading):
        launched.append(launcher.fn.fn.__name__)
        return launch(launcher, bound, grid, leading)

    monkeypatch.setattr(launcher_type, "launch", recording)
    return launched


def test_triton_appends_inside_the_attention_launch(flash_attn, triton_device, monkeypatch):
    """The attention kernel writes the new keys itself: a call with new keys launches it alone,
    or with the combine when the keys are split, and no append kernel (after the value checks'
    gather). Every launch goes through a cached launcher (``_triton/launch.py``), whether or
    not it reuses a compiled kernel."""
    launched = _record_launches(flash_attn, monkeypatch)
    # over 128 keys of capacity: a GPU's 128-key steps (pages of 4) have two blocks to split
    case = Case(page_size=4, lengths=(140, 9), seqlen_new=3, seqlen_q=2, rotary="interleaved")
    for num_splits, kernels in ((1, ["_values_kernel", "_attend_kernel"]),
                                (2, ["_values_kernel", "_attend_kernel", "combine_kernel"])):
        launched.clear()
        run_case(flash_attn, case, device=triton_device, num_splits=num_splits)
        assert launched == kernels


# ---------------------------------------------------------------------------------------------
# Signature, return values, logging.
# ---------------------------------------------------------------------------------------------

@pytest.mark.kernels_ci
def test_signature_is_flash_attn_2_plus_sinks(flash_attn):
    import inspect

    params = inspect.signature(flash_attn.flash_attn_with_kvcache).parameters.values()
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in params] == KVCACHE_PARAMS
    assert "flash_attn_with_kvcache" in flash_attn.__all__


@pytest.mark.kernels_ci
def test_returns_out_or_out_and_lse(flash_attn):
    torch.manual_seed(0)
    args, _ = build(Case(page_size=16), "cpu")
    out = flash_attn.flash_attn_with_kvcache(**args)
    assert isinstance(out, torch.Tensor) and out.shape == args["q"].shape
    torch.manual_seed(0)
    args, _ = build(Case(page_size=16), "cpu")
    out2, lse = flash_attn.flash_attn_with_kvcache(**args, return_softmax_lse=True)
    assert torch.equal(out, out2) and lse.shape == (3, 8, 1)


def test_positional_call_as_transformers_makes_it(flash_attn):
    """transformers' decode fast path: ``fn(q, k_cache, v_cache, k, v, **kwargs)`` with
    q/k/v ``(B, 1, H, D)`` and ``block_table``/``cache_seqlens`` keywords; it takes ``out[0]``
    of a tuple, or the tensor."""
    torch.manual_seed(0)
    case = Case(page_size=16, lengths=(3, 17, -1), heads=(4, 2))
    args, _ = build(case, "cpu")
    out = flash_attn.flash_attn_with_kvcache(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], causal=True,
        softmax_scale=0.25, window_size=(-1, -1), block_table=args["block_table"],
        cache_seqlens=args["cache_seqlens"])
    ref = kvcache_reference(**{**args, "softmax_scale": 0.25})
    assert out.shape == args["q"].shape
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # the padding slot sees no key
    assert_close_to_reference("out", out, ref["out"],
                              kvcache_reference(**{**args, "softmax_scale": 0.25},
                                                dtype=case.dtype)["out"])


def test_dispatch_logs_the_backend_once(flash_attn, caplog):
    dispatch = submodule(flash_attn, "_dispatch")
    dispatch._logged.clear()
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="flash_attn"):
        for _ in range(2):
            args, _ = build(Case(page_size=4), "cpu")
            flash_attn.flash_attn_with_kvcache(**args)
    lines = [r.getMessage() for r in caplog.records if "kv-cache" in r.getMessage()]
    assert lines == ["flash_attn kv-cache paged on cpu: cpu backend (tensors on cpu)"]


def test_backend_choice_follows_the_environment(flash_attn, monkeypatch):
    """``cpu`` runs anywhere; ``cuda`` (no compiled kv-cache kernel) needs CUDA tensors and then
    runs Triton; ``triton`` on CPU tensors only under the interpreter."""
    dispatch = submodule(flash_attn, "_dispatch")
    q = torch.zeros(1, 1, 2, 16, dtype=torch.float16)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cpu")
    assert dispatch.select_kvcache_backend(q, paged=True, varlen=False).__name__ == (
        "kvcache_forward")
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FLASH_ATTN_HUB_BACKEND=cuda: got tensors on cpu"):
        dispatch.select_kvcache_backend(q, paged=True, varlen=False)
    if torch.cuda.is_available():
        assert dispatch.select_kvcache_backend(q.cuda(), paged=True, varlen=False).__module__ \
            .endswith("_triton.kvcache")


# ---------------------------------------------------------------------------------------------
# Bad input: an error naming the argument, raised before anything is written.
# ---------------------------------------------------------------------------------------------

def _with(**changes):
    return lambda args: {**args, **changes}


def _tensor_edit(name, fn):
    return lambda args: {**args, name: fn(args[name])}


def _table_entry(value):
    def edit(args):
        table = args["block_table"].clone()
        table[1, 0] = value if value != "num_blocks" else args["k_cache"].shape[0]
        return {**args, "block_table": table}
    return edit


PAGED = Case(page_size=4, lengths=(5, 6, 2), seqlen_new=2, seqlen_q=2, rotary="neox")
CONTIGUOUS = Case(lengths=(5, 6, 2), seqlen_new=2, seqlen_q=2, leftpad=(1, 0, 2))
BAD_INPUTS = {  # label: (case, edit of the valid arguments, exception, argument named)
    "q_dtype": (PAGED, _tensor_edit("q", lambda t: t.float()), TypeError, "q"),
    "q_rank": (PAGED, _tensor_edit("q", lambda t: t[0]), ValueError, "q"),
    "q_head_dim": (PAGED, _tensor_edit("q", lambda t: t[..., :12]), ValueError, "q"),
    "q_stride": (PAGED, _tensor_edit("q", lambda t: t.transpose(-1, -2).contiguous()
                                     .transpose(-1, -2)), ValueError, "q"),
    "k_cache_dtype": (PAGED, _tensor_edit("k_cache", lambda t: t.bfloat16()), TypeError,
                      "k_cache"),
    "k_cache_heads": (PAGED, _tensor_edit("k_cache", lambda t: t.repeat(1, 1, 3, 1)[:, :, :3]),
                      ValueError, "k_cache"),
    "v_cache_page_size": (PAGED, _tensor_edit("v_cache", lambda t: t[:, :2]), ValueError,
                          "v_cache"),
    "v_cache_shape": (PAGED, _tensor_edit("v_cache", lambda t: t[:-1]), ValueError, "v_cache"),
    "k_without_v": (PAGED, _with(v=None, rotary_cos=None, rotary_sin=None), ValueError, "v"),
    "k_heads": (PAGED, _tensor_edit("k", lambda t: t[:, :, :1]), ValueError, "k"),
    "v_dtype": (PAGED, _tensor_edit("v", lambda t: t.bfloat16()), TypeError, "v"),
    "cache_seqlens_dtype": (PAGED, _tensor_edit("cache_seqlens", lambda t: t.long()), TypeError,
                            "cache_seqlens"),
    "cache_seqlens_shape": (PAGED, _tensor_edit("cache_seqlens", lambda t: t[:2]), ValueError,
                            "cache_seqlens"),
    "cache_seqlens_device": (PAGED, _tensor_edit("cache_seqlens", lambda t: t.to("meta")),
                             ValueError, "cache_seqlens"),
    "cache_seqlens_past_capacity": (PAGED, _tensor_edit("cache_seqlens", lambda t: t + 7),
                                    ValueError, "cache_seqlens"),
    "cache_seqlens_below_padding": (PAGED, _tensor_edit("cache_seqlens", lambda t: t - 7),
                                    ValueError, "cache_seqlens"),
    "cache_seqlens_none_leaves_no_room": (PAGED, _with(cache_seqlens=None), ValueError,
                                          "cache_seqlens"),
    "block_table_dtype": (PAGED, _tensor_edit("block_table", lambda t: t.long()), TypeError,
                          "block_table"),
    "block_table_rows": (PAGED, _tensor_edit("block_table", lambda t: t[:2]), ValueError,
                         "block_table"),
    "block_table_past_num_blocks": (PAGED, _table_entry("num_blocks"), ValueError,
                                    "block_table"),
    "block_table_used_entry_negative": (PAGED, _table_entry(-1), ValueError, "block_table"),
    "cache_batch_idx_with_pages": (PAGED, _with(cache_batch_idx=torch.arange(3,
                                                dtype=torch.int32)), ValueError,
                                   "cache_batch_idx"),
    "rotary_sin_missing": (PAGED, _with(rotary_sin=None), ValueError, "rotary_sin"),
    "rotary_without_new_keys": (PAGED, _with(k=None, v=None), ValueError, "rotary_cos"),
    "rotary_too_short": (PAGED, lambda a: {**a, "rotary_cos": a["rotary_cos"][:5],
                                           "rotary_sin": a["rotary_sin"][:5]}, ValueError,
                         "rotary_cos"),
    "rotary_dim_past_head_dim": (PAGED, lambda a: {**a, "rotary_cos": a["rotary_cos"].repeat(1, 2),
                                                   "rotary_sin": a["rotary_sin"].repeat(1, 2)},
                                 ValueError, "rotary_cos"),
    "rotary_dtype": (PAGED, _tensor_edit("rotary_sin", lambda t: t.double()), TypeError,
                     "rotary_sin"),
    "num_splits_negative": (PAGED, _with(num_splits=-1), ValueError, "num_splits"),
    "window": (PAGED, _with(window_size=(-2, 0)), ValueError, "window_size[0]"),
    "s_aux_shape": (PAGED, _with(s_aux=torch.zeros(3)), ValueError, "s_aux"),
    "alibi_dtype": (PAGED, _with(alibi_slopes=torch.zeros(8, dtype=torch.float64)), TypeError,
                    "alibi_slopes"),
    "return_softmax_lse": (PAGED, _with(return_softmax_lse=1), TypeError, "return_softmax_lse"),
    "cache_rows": (CONTIGUOUS, lambda a: {**a, "k_cache": a["k_cache"][:2],
                                          "v_cache": a["v_cache"][:2]}, ValueError, "k_cache"),
    "cache_leftpad_past_seqlens": (CONTIGUOUS, _tensor_edit("cache_leftpad", lambda t: t + 5),
                                   ValueError, "cache_leftpad"),
    "cache_batch_idx_range": (CONTIGUOUS, _with(cache_batch_idx=torch.tensor(
        [0, 3, 1], dtype=torch.int32)), ValueError, "cache_batch_idx"),
    "cache_batch_idx_repeated": (CONTIGUOUS, _with(cache_batch_idx=torch.tensor(
        [0, 0, 1], dtype=torch.int32)), ValueError, "cache_batch_idx"),
}


@pytest.mark.parametrize("label", list(BAD_INPUTS))
def test_bad_input_names_the_argument_and_writes_nothing(flash_attn, label):
    """Each bad input raises naming its argument, also right after a valid call of the same
    case (whose checks the call memo keeps) and again when repeated."""
    case, edit, exc, name = BAD_INPUTS[label]
    torch.manual_seed(0)
    args, _ = build(case, "cpu")
    flash_attn.flash_attn_with_kvcache(**args)
    bad = edit(args)
    caches = [t.clone() for t in (bad["k_cache"], bad["v_cache"])]
    for _ in range(2):
        with pytest.raises(exc) as info:
            flash_attn.flash_attn_with_kvcache(**bad)
        assert str(info.value).startswith(f"{name}: got "), str(info.value)
    for before, after in zip(caches, (bad["k_cache"], bad["v_cache"])):
        assert torch.equal(_bits(before), _bits(after))


def test_call_memo_checks_a_call_shape_once(flash_attn, monkeypatch):
    """[Note: call memo] in kvcache.py: a repeated call shape skips the metadata checks (a
    decode loop's cache_seqlens int may change), and its results equal a fully checked call's;
    a call with a scalar that is not plain, or inside no memo at all, is checked every time."""
    kvcache = submodule(flash_attn, "kvcache")
    checks = []
    real = kvcache._check_call
    monkeypatch.setattr(kvcache, "_check_call", lambda *a: checks.append(1) or real(*a))
    monkeypatch.setattr(kvcache, "_calls", {})
    torch.manual_seed(0)
    args, _ = build(Case(lengths=(5, 5, 5), int_seqlens=True, sink=True), "cpu")
    assert isinstance(args["cache_seqlens"], int)
    first = flash_attn.flash_attn_with_kvcache(**args, return_softmax_lse=True)
    assert len(checks) == 1
    again = flash_attn.flash_attn_with_kvcache(**args, return_softmax_lse=True)
    assert len(checks) == 1  # the same shape: no second check
    for a, b in zip(first, again):  # the same new key appended at the same place again
        assert torch.equal(_bits(a), _bits(b))
    monkeypatch.setattr(kvcache, "_calls", {})
    args["cache_seqlens"] += 1  # what the memo hit computed, checked in full
    full = flash_attn.flash_attn_with_kvcache(**args, return_softmax_lse=True)
    assert len(checks) == 2
    args["cache_seqlens"] -= 1
    hit = flash_attn.flash_attn_with_kvcache(**args, return_softmax_lse=True)  # a new int value
    assert len(checks) == 2
    args["cache_seqlens"] += 1
    for a, b in zip(full, flash_attn.flash_attn_with_kvcache(**args, return_softmax_lse=True)):
        assert torch.equal(_bits(a), _bits(b))
    assert len(checks) == 2 and hit[0].shape == full[0].shape
    for _ in range(2):  # a numpy scalar is not plain: checked every time
        flash_attn.flash_attn_with_kvcache(**{**args, "softcap": torch.tensor(0.0).numpy()})
    assert len(checks) == 4


def test_value_checks_skip_when_told(flash_attn, monkeypatch):
    """``FLASH_ATTN_HUB_CHECK_VALUES=0`` turns the value checks off on CUDA tensors only: CPU
    tensors are always checked (reading them costs nothing)."""
    value_checks = submodule(flash_attn, "_kvcache_values")
    monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", "0")
    assert value_checks._checking_values(torch.zeros(1, dtype=torch.int32))
    if torch.cuda.is_available():
        assert not value_checks._checking_values(torch.zeros(1, dtype=torch.int32, device="cuda"))


def test_value_checks_run_once_per_version(flash_attn, monkeypatch):
    """[Note: value checks], once per version: the layers of a decode step (the same
    cache_seqlens and block_table objects, unchanged) are checked once; an in-place change
    through torch, through a view too, or another tensor of the same values is checked again,
    and a value made bad in place raises naming its argument; inference tensors are checked
    every call."""
    value_checks = submodule(flash_attn, "_kvcache_values")
    checks = []
    real = value_checks._used_entry_range
    monkeypatch.setattr(value_checks, "_used_entry_range", lambda *a: checks.append(1) or real(*a))
    torch.manual_seed(0)
    args, _ = build(Case(page_size=4, lengths=(5, 6, 2)), "cpu")
    base = args["cache_seqlens"].repeat(2)
    args["cache_seqlens"] = lengths = base[:3]  # a view, as a batch slot's slice of a buffer
    for _ in range(3):  # three layers of one step
        flash_attn.flash_attn_with_kvcache(**args)
    assert len(checks) == 1
    base[0] += 1  # the next step, through the buffer the lengths are a view of
    flash_attn.flash_attn_with_kvcache(**args)
    flash_attn.flash_attn_with_kvcache(**args)
    assert len(checks) == 2
    flash_attn.flash_attn_with_kvcache(**{**args, "cache_seqlens": lengths.clone()})
    assert len(checks) == 3
    flash_attn.flash_attn_with_kvcache(**args)  # not the tensor of the last passed call
    flash_attn.flash_attn_with_kvcache(**{**args, "num_splits": 2})  # sizes unchanged
    assert len(checks) == 4
    flash_attn.flash_attn_with_kvcache(**{**args, "k": None, "v": None})  # no new keys
    assert len(checks) == 5
    capacity = args["block_table"].shape[1] * args["k_cache"].shape[1]
    lengths[1] = capacity + 1
    for _ in range(2):
        with pytest.raises(ValueError, match="^cache_seqlens: got "):
            flash_attn.flash_attn_with_kvcache(**args)
    lengths[1] = 6
    args["block_table"][0, 0] = args["k_cache"].shape[0]
    with pytest.raises(ValueError, match="^block_table: got "):
        flash_attn.flash_attn_with_kvcache(**args)
    with torch.inference_mode():
        lengths = args["cache_seqlens"].clone()
        table = args["block_table"].clone()
        table[0, 0] = 0
        before = len(checks)
        for _ in range(2):
            flash_attn.flash_attn_with_kvcache(**{**args, "cache_seqlens": lengths,
                                                  "block_table": table})
        assert len(checks) == before + 2


def test_used_entry_range_finds_every_bad_used_entry(flash_attn):
    """The block-table filter of the value checks trips exactly when a page a sequence uses
    holds an entry outside [0, num_blocks) (a plain-Python count of the used pages): random
    tables with bad entries inside and outside the pages that lengths, left pads, padding slots
    (-1) and new keys make used, page sizes 1 to 7."""
    value_checks = submodule(flash_attn, "_kvcache_values")
    gen = torch.Generator().manual_seed(0)
    tripped = 0
    for trial in range(300):
        batch, cols, page_size, num_blocks = (int(torch.randint(1, n, (1,), generator=gen))
                                              for n in (5, 9, 8, 12))
        new = trial % 3
        capacity = cols * page_size
        seqlens = torch.randint(-1, capacity - new + 1, (batch,), generator=gen,
                                dtype=torch.int32)
        leftpad = (None if trial % 2 else
                   (torch.rand(batch, generator=gen) * (seqlens.clamp(min=0) + 1)).int())
        table = torch.randint(0, num_blocks, (batch, cols), generator=gen, dtype=torch.int32)
        bad = torch.rand(batch, cols, generator=gen) < 0.05
        table[bad] = torch.where(torch.rand(batch, cols, generator=gen) < 0.5, -1,
                                 num_blocks)[bad].int()
        least, greatest = value_checks._used_entry_range(table, seqlens, leftpad, new, page_size)
        expected = False
        for b in range(batch):
            n = int(seqlens[b])
            first, end = (0 if leftpad is None else int(leftpad[b])), (0 if n < 0 else n + new)
            pages = range(first // page_size, -(-end // page_size))
            expected |= any(not 0 <= int(table[b, j]) < num_blocks for j in pages)
        trips = least.item() < 0 or greatest.item() >= num_blocks
        assert trips == expected, (trial, table, seqlens, leftpad, new, page_size)
        tripped += trips
    assert 30 < tripped < 270  # both outcomes were exercised


POISON_INT = -123456789  # what an element of the gather's output holds until it is written


def gather_reference(value_checks, lengths, leftpad, batch_idx, table, new, page_size,
                     cumulative=False) -> list:
    """What ``_triton.kvcache_checks.gather_values`` must write, from the torch path: the
    index vectors (with ``cumulative``, the B + 1 values of ``cu_seqlens_k`` themselves), then
    per row ``_used_entry_range`` of that row alone ((0, 0) for a table of no column), least
    entries first."""
    values = lengths.tolist()
    if cumulative:
        lengths = lengths[1:] - lengths[:-1]
    values += [] if leftpad is None else leftpad.tolist()
    values += [] if batch_idx is None else batch_idx.tolist()
    if table is None:
        return values
    ranges = [value_checks._used_entry_range(table[b:b + 1], lengths[b:b + 1],
                                             None if leftpad is None else leftpad[b:b + 1],
                                             new, page_size) if table.shape[1] else (0, 0)
              for b in range(len(lengths))]
    return values + [int(r[0]) for r in ranges] + [int(r[1]) for r in ranges]


def test_device_gather_matches_the_torch_path(flash_attn, triton_device):
    """``_triton.kvcache_checks`` ([Note: value checks]): its one launch, written over a
    poisoned buffer, holds the index vectors and per row the range ``_used_entry_range`` gives
    for that row alone, so the least and the greatest over rows are the whole table's. Random
    cases: 1-6 rows, tables 0 to over three column steps wide with -1 past each row's pages,
    stray bad entries (-1, num_blocks, the int32 extremes), page sizes 1-7 and 16, left pads
    (past the length too), padding slots (-1), lengths below -1, zero lengths and lengths past
    the capacity, new keys 0-2, and lengths as ``cu_seqlens_k`` differences."""
    value_checks = submodule(flash_attn, "_kvcache_values")
    checks = submodule(flash_attn, "_triton.kvcache_checks")
    device = torch.device(triton_device)
    step = checks._columns_per_step(device)
    gen = torch.Generator().manual_seed(0)

    def draw(low, high):  # an int in [low, high]
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    def ints(values):
        return None if values is None else torch.tensor(values, dtype=torch.int32)

    seen = dict(no_page=0, every_page=0, some_pages=0, past_a_step=0, no_column=0, tripped=0)
    for trial in range(300):
        batch, cols = draw(1, 6), draw(0, 3 * step + 1) if trial % 25 else 0
        page_size = (1, 2, 3, 4, 5, 7, 16)[draw(0, 6)]
        num_blocks, cumulative = draw(1, 40), trial % 4 == 3
        new = 0 if cumulative else draw(0, 2)
        capacity = cols * page_size
        lengths = [draw(0, max(capacity - new, 0)) if draw(0, 3) else
                   (-1, 0, capacity - new, draw(-3, capacity + 2))[draw(0, 3)]
                   for _ in range(batch)]
        if cumulative:  # cu_seqlens_k: non-decreasing, no left pad, no batch index
            lengths = [max(n, 0) for n in lengths]
        pads = None if cumulative or trial % 3 == 0 else [
            draw(-1, max(n, 0) + 2) if draw(0, 4) == 0 else draw(0, max(n, 0)) for n in lengths]
        rows = None if cumulative or trial % 2 else [draw(-2, 8) for _ in range(batch)]
        table = torch.randint(0, num_blocks, (batch, cols), generator=gen, dtype=torch.int32)
        for b, n in enumerate(lengths):  # -1 past the row's pages, as callers pad
            table[b, -(-max(n, 0) // page_size) + draw(0, 1):] = -1
        stray = torch.rand(batch, cols, generator=gen) < 0.05
        picks = ints([-1, num_blocks, 2**31 - 1, -2**31])
        table[stray] = picks[torch.randint(0, 4, (batch, cols), generator=gen)][stray]
        with_table = trial % 7 != 6
        given = [ints([0, *lengths]).cumsum(0).int() if cumulative else ints(lengths), ints(pads),
                 ints(rows), table if with_table else None]
        expected = gather_reference(value_checks, *given, new, page_size, cumulative)
        on_device = [None if t is None else t.to(device) for t in given]
        out = torch.full((len(expected),), POISON_INT, dtype=torch.int32, device=device)
        checks.gather_values(out, *on_device, seqlen_new=new, page_size=page_size,
                             cumulative=cumulative)
        label = (trial, lengths, pads, table, new, page_size, cumulative)
        assert out.tolist() == expected, label
        if trial % 10 == 0:  # the allocating form
            allocated = checks.check_values(*on_device, seqlen_new=new, page_size=page_size,
                                            cumulative=cumulative)
            assert allocated.tolist() == expected, label
        if not with_table:
            continue
        seen["no_column"] += cols == 0
        if cols == 0:
            continue
        for b, n in enumerate(lengths):
            first = 0 if pads is None else max(pads[b], 0) // page_size
            used = max(min(-(-max(n + new, 0) // page_size) if n >= 0 else 0, cols) - first, 0)
            seen["no_page" if used == 0 else "every_page" if used == cols else
                 "some_pages"] += 1
            seen["past_a_step"] += used > step
        least, greatest = min(expected[-2 * batch:-batch]), max(expected[-batch:])
        whole = value_checks._used_entry_range(table, ints(lengths), ints(pads), new, page_size)
        assert (least, greatest) == tuple(map(int, whole)), label
        seen["tripped"] += least < 0 or greatest >= num_blocks
    assert all(count >= 10 for count in seen.values()), seen  # every kind of row was drawn
    empty = checks.check_values(torch.tensor([3], dtype=torch.int32, device=device), None, None,
                                torch.zeros(0, 2, dtype=torch.int32, device=device),
                                seqlen_new=0, page_size=4, cumulative=True)
    assert empty.tolist() == [3]  # no sequence: the one cumulative value, copied


BAD_VALUES = ["cache_seqlens_past_capacity", "cache_seqlens_below_padding",
              "block_table_past_num_blocks", "block_table_used_entry_negative",
              "cache_leftpad_past_seqlens", "cache_batch_idx_range", "cache_batch_idx_repeated"]
BAD_PAGED_VARLEN_VALUES = {  # label: an edit of the call's arguments
    "table_entry": lambda a: {**a, "block_table": a["block_table"].fill_(-1)},
    "table_entry_past_num_blocks": lambda a: {**a, "block_table": torch.where(
        a["block_table"] == 0, a["k"].shape[0], a["block_table"])},
}


def _errors_on_both_paths(flash_attn, monkeypatch, device, call, args) -> tuple[str, str]:
    """The message of ``call(**args)`` on CPU tensors through the torch ops and on ``device``
    through the one launch of ``_triton.kvcache_checks`` (which must run once, with no torch
    op of the checks' range)."""
    value_checks = submodule(flash_attn, "_kvcache_values")
    checks = submodule(flash_attn, "_triton.kvcache_checks")
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cpu")
    with pytest.raises(ValueError) as torch_ops:
        call(**args)
    gathered, gather = [], checks.check_values
    monkeypatch.setattr(checks, "check_values", lambda *a, **k: gathered.append(1) or
                        gather(*a, **k))
    monkeypatch.setattr(value_checks, "_used_entry_range", None)  # calling it fails
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "triton")
    with pytest.raises(ValueError) as one_launch:
        call(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    assert gathered == [1]
    return str(torch_ops.value), str(one_launch.value)


@pytest.mark.parametrize("label", BAD_VALUES)
def test_device_gather_raises_the_torch_paths_errors(flash_attn, triton_device, monkeypatch,
                                                     label):
    """A bad value raises the same message, byte for byte, whether the checks read their
    numbers through torch ops (CPU tensors) or through the device gather."""
    case, edit, _, name = BAD_INPUTS[label]
    torch.manual_seed(0)
    args, _ = build(case, "cpu")
    expected, got = _errors_on_both_paths(flash_attn, monkeypatch, triton_device,
                                          flash_attn.flash_attn_with_kvcache, edit(args))
    assert expected.startswith(f"{name}: got ") and got == expected


@pytest.mark.parametrize("label", list(BAD_PAGED_VARLEN_VALUES))
def test_device_gather_raises_the_torch_paths_paged_varlen_errors(flash_attn, triton_device,
                                                                  monkeypatch, label):
    torch.manual_seed(0)
    q, k_cache, v_cache, cq, ck, mq, mk, table = build_paged_varlen([2, 3], [5, 9], page_size=4)
    args = BAD_PAGED_VARLEN_VALUES[label](dict(
        q=q, k=k_cache, v=v_cache, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
        max_seqlen_k=mk, block_table=table))
    expected, got = _errors_on_both_paths(flash_attn, monkeypatch, triton_device,
                                          flash_attn.flash_attn_varlen_func, args)
    assert expected.startswith("block_table: got ") and got == expected


def test_checked_triton_call_gathers_in_one_launch(flash_attn, triton_device, monkeypatch):
    """A checked paged call on the Triton kernels makes two launches, the checks' gather and
    the attention, each through a cached launcher; a repeated call with the same unchanged
    index tensors skips the checks ([Note: value checks], once per version; on a GPU its
    attention may go through the lane, which launches without the launcher's ``launch``)."""
    monkeypatch.setattr(submodule(flash_attn, "kvcache"), "_lanes", {})
    launched = _record_launches(flash_attn, monkeypatch)
    torch.manual_seed(0)
    args, _ = build(Case(page_size=4, lengths=(5, -1, 9), leftpad=(1, 0, 6)), triton_device)
    flash_attn.flash_attn_with_kvcache(**args, num_splits=1)
    assert launched == ["_values_kernel", "_attend_kernel"]
    launched.clear()
    flash_attn.flash_attn_with_kvcache(**args, num_splits=1)
    assert "_values_kernel" not in launched


# ---------------------------------------------------------------------------------------------
# Paged prefill: flash_attn_varlen_func(..., block_table=).
# ---------------------------------------------------------------------------------------------

def build_paged_varlen(seqlens_q, seqlens_k, *, page_size, heads=(4, 2), head_dim=32,
                       dtype=torch.float16, device="cpu"):
    """Packed q, NaN-poisoned paged caches holding each sequence's keys at positions 0..,
    cu_seqlens and the block table (-1 past each sequence's pages)."""
    heads_q, heads_kv = heads
    pages = [_cdiv(n, page_size) for n in seqlens_k]
    max_blocks = max(pages) + 1
    num_blocks = sum(pages) + 2
    order = iter(torch.randperm(num_blocks).tolist())
    table = [[next(order) if p < used else -1 for p in range(max_blocks)] for used in pages]
    shape = (num_blocks, page_size, heads_kv, head_dim)
    k_cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    v_cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    for b, n in enumerate(seqlens_k):
        for pos in range(n):
            slot = table[b][pos // page_size], pos % page_size
            k_cache[slot] = torch.randn(heads_kv, head_dim, dtype=dtype, device=device)
            v_cache[slot] = torch.randn(heads_kv, head_dim, dtype=dtype, device=device)
    q = torch.randn(sum(seqlens_q), heads_q, head_dim, dtype=dtype, device=device)
    return (q, k_cache, v_cache, cu_seqlens(seqlens_q, device), cu_seqlens(seqlens_k, device),
            max(seqlens_q), max(seqlens_k),
            torch.tensor(table, dtype=torch.int32, device=device))


PAGED_VARLEN = {  # label: (seqlens_q, seqlens_k, page_size, keywords)
    "chunked_prefill_causal": ([5, 1, 12], [9, 1, 30], 4, dict(causal=True)),
    "page1_window_sink": ([3, 2], [3, 7], 1, dict(causal=True, window_size=(2, 0), sink=True)),
    "page16_empty_sequence": ([4, 0, 6], [20, 0, 6], 16, dict(softcap=3.0)),
}


def _run_paged_varlen(fa, label, device):
    seqlens_q, seqlens_k, page_size, kw = PAGED_VARLEN[label]
    kw = dict(kw)
    torch.manual_seed(0)
    q, k_cache, v_cache, cq, ck, mq, mk, table = build_paged_varlen(
        seqlens_q, seqlens_k, page_size=page_size, device=device)
    if kw.pop("sink", False):
        kw["s_aux"] = torch.randn(q.shape[1], device=device)
    before = [_bits(t).clone() for t in (k_cache, v_cache)]
    out, lse, probs = fa.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, mq, mk,
                                                block_table=table, return_attn_probs=True, **kw)
    assert probs is None and out.is_contiguous()
    ref = paged_varlen_reference(q, k_cache, v_cache, cq, ck, table, **kw)
    lowp = paged_varlen_reference(q, k_cache, v_cache, cq, ck, table, dtype=q.dtype, **kw)
    assert_close_to_reference("out", out, ref[0], lowp[0])
    assert_close_to_reference("lse", lse, ref[1], lowp[1])
    assert all(torch.equal(b, _bits(t)) for b, t in zip(before, (k_cache, v_cache)))


@pytest.mark.parametrize("label", list(PAGED_VARLEN))
def test_paged_varlen_cpu(flash_attn, label):
    _run_paged_varlen(flash_attn, label, "cpu")


@pytest.mark.parametrize("label", list(PAGED_VARLEN))
def test_paged_varlen_triton(flash_attn, triton_device, label):
    _run_paged_varlen(flash_attn, label, triton_device)


@pytest.mark.kernels_ci
def test_paged_varlen_signature_ends_with_block_table(flash_attn):
    import inspect

    names = list(inspect.signature(flash_attn.flash_attn_varlen_func).parameters)
    assert names[-2:] == ["s_aux", "block_table"]


@pytest.mark.parametrize("label, edit, exc, name", [
    ("grad", lambda a: {**a, "q": a["q"].requires_grad_()}, ValueError, "block_table"),
    ("dropout", lambda a: {**a, "dropout_p": 0.1}, ValueError, "dropout_p"),
    ("past_capacity", lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"] * 4,
                                 "max_seqlen_k": 4 * a["max_seqlen_k"]}, ValueError,
     "cu_seqlens_k"),
    ("table_entry", lambda a: {**a, "block_table": a["block_table"].fill_(-1)}, ValueError,
     "block_table"),
    ("table_entry_past_num_blocks", lambda a: {**a, "block_table": torch.where(
        a["block_table"] == 0, a["k"].shape[0], a["block_table"])}, ValueError, "block_table"),
    ("max_seqlen_k", lambda a: {**a, "max_seqlen_k": 1}, ValueError, "max_seqlen_k"),
    ("cu_seqlens_k_dtype", lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"].long()},
     TypeError, "cu_seqlens_k"),
    ("cache_heads", lambda a: {**a, "k": a["k"].repeat(1, 1, 2, 1)[:, :, :3],
                               "v": a["v"].repeat(1, 1, 2, 1)[:, :, :3]}, ValueError, "k"),
])
def test_paged_varlen_bad_input(flash_attn, label, edit, exc, name):
    torch.manual_seed(0)
    q, k_cache, v_cache, cq, ck, mq, mk, table = build_paged_varlen([2, 3], [5, 9], page_size=4)
    args = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
                max_seqlen_k=mk, block_table=table)
    args = edit(args)
    with pytest.raises(exc) as info:
        flash_attn.flash_attn_varlen_func(**args)
    assert str(info.value).startswith(f"{name}: got "), str(info.value)


@pytest.mark.parametrize("path", ["torch_ops", "one_launch"])
def test_paged_varlen_value_checks_run_once_per_version(flash_attn, monkeypatch, request, path):
    """[Note: value checks], once per version, for a paged ``flash_attn_varlen_func`` call: the
    layers of a prefill step (the same ``cu_seqlens_k`` and ``block_table`` objects, unchanged,
    and sizes) are checked once, a ``flash_attn_with_kvcache`` call in between too (each entry
    point remembers its own call); an in-place change of either tensor, or other sizes, make
    it check again, and a value made bad in place raises, call after call; a bad call after a
    good one raises; inference tensors are checked every call. Through the one launch the check reads
    the host once: ``cu_seqlens_k`` comes back with the ranges, never through
    ``_validate._host_values``."""
    value_checks = submodule(flash_attn, "_kvcache_values")
    validate = submodule(flash_attn, "_validate")
    if path == "one_launch":
        device = request.getfixturevalue("triton_device")
        module, name = submodule(flash_attn, "_triton.kvcache_checks"), "check_values"
    else:
        device = "cpu"
        monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cpu")
        module, name = value_checks, "_used_entry_range"
    checks, check = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: checks.append(1) or check(*a, **k))
    torch.manual_seed(0)
    q, k_cache, v_cache, cq, ck, mq, mk, table = build_paged_varlen([2, 3], [5, 9], page_size=4,
                                                                    device=device)
    read, host_values = [], validate._host_values
    monkeypatch.setattr(validate, "_host_values", lambda t: read.append(t) or host_values(t))
    args = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
                max_seqlen_k=mk, block_table=table)
    call = flash_attn.flash_attn_varlen_func
    for _ in range(3):  # three layers of one step
        call(**args)
    assert len(checks) == 1
    decode, _ = build(Case(page_size=4, lengths=(5, 6, 2)), device)
    flash_attn.flash_attn_with_kvcache(**decode)  # checked: its own entry point's call
    call(**args)
    assert len(checks) == 2
    ck[-1] -= 1  # the next step, in place: the last sequence one key shorter
    call(**args)
    call(**args)
    assert len(checks) == 3
    table[0, -1] = -1  # the value it held, written in place: a new version
    call(**args)
    call(**args)
    assert len(checks) == 4
    call(**{**args, "max_seqlen_k": mk + 1})  # the same tensors, other sizes
    assert len(checks) == 5
    with pytest.raises(ValueError, match="^max_seqlen_k: got 1; "):
        call(**{**args, "max_seqlen_k": 1})
    call(**args)
    ck[-1] = ck[-2] - 1  # bad in place, after a call that passed
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^cu_seqlens_k: got a decrease at index 2 "):
            call(**args)
    ck[-1] = ck[-2] + 8
    call(**args)
    good = table[1, 0].item()
    table[1, 0] = k_cache.shape[0]
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^block_table: got block_table\[1, 0\] = "):
            call(**args)
    table[1, 0] = good
    call(**args)
    with pytest.raises(ValueError, match="^cu_seqlens_k: got 20 keys for sequence 0; "):
        call(**{**args, "cu_seqlens_k": ck * 4, "max_seqlen_k": 4 * mk})  # past the capacity
    checks.clear()
    call(**args)  # the bad call cleared what the good one before it left
    call(**args)
    assert len(checks) == 1
    with torch.inference_mode():
        lengths, rows = ck.clone(), table.clone()
        for _ in range(2):
            call(**{**args, "cu_seqlens_k": lengths, "block_table": rows})
    assert len(checks) == 3
    if path == "one_launch":
        assert all(t is cq for t in read), "cu_seqlens_k was read apart from the gather"


# ---------------------------------------------------------------------------------------------
# The op: schema and fake for torch.compile.
# ---------------------------------------------------------------------------------------------

def test_opcheck(flash_attn):
    kvcache = submodule(flash_attn, "kvcache")
    torch.manual_seed(0)
    args, _ = build(Case(page_size=4, lengths=(3, 6), rotary="interleaved", sink=True), "cpu")
    for name in ("k_cache", "v_cache"):
        args[name] = torch.randn_like(args[name])  # opcheck compares outputs: no NaN here
    params = submodule(flash_attn, "_params").KvCacheParams(
        softmax_scale=0.2, causal=True, window_left=-1, window_right=0, softcap=0.0,
        rotary_interleaved=True, num_splits=0, max_seqlen_q=1,
        max_seqlen_k=args["block_table"].shape[1] * 4)
    tensors = [args.get(name) for name in kvcache.TENSORS]
    values = [getattr(params, name) for name in kvcache.PARAM_FIELDS]
    torch.library.opcheck(kvcache.kvcache_fwd, (*tensors, *values),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# Unchecked calls (CUDA-graph capture skips the value checks): bad values must stay inside the
# cache. The Triton launcher is called directly, past the checks, on caches that are views into
# the middle of a larger guarded buffer.
# ---------------------------------------------------------------------------------------------

def _guarded(shape, dtype, device):
    """A NaN tensor of ``shape`` inside a buffer with 4096 guard elements on each side."""
    count = math.prod(shape)
    buffer = torch.full((count + 8192,), 1234.0, dtype=dtype, device=device)
    view = buffer[4096:4096 + count].view(shape)
    view.fill_(math.nan)
    return buffer, view


def _select(args: dict, rows: list) -> dict:
    """The call's arguments for the sequences ``rows`` alone (caches shared)."""
    picked = {}
    for name, value in args.items():
        per_sequence = name in ("q", "k", "v", "block_table", "cache_seqlens", "cache_leftpad",
                                "cache_batch_idx")
        picked[name] = value[rows] if per_sequence and isinstance(value, torch.Tensor) else value
    return picked


@pytest.mark.parametrize("bad", ["table_past_num_blocks", "table_negative",
                                 "seqlens_past_capacity", "batch_idx_out_of_range",
                                 "leftpad_past_seqlens"])
def test_triton_unchecked_bad_values_stay_inside_the_cache(flash_attn, triton_device, bad):
    paged = bad.startswith("table") or bad == "seqlens_past_capacity"
    case = Case(page_size=4 if paged else None, lengths=(5, 6, 2), seqlen_new=3, seqlen_q=2,
                leftpad=None if paged else (1, 0, 2), batch_idx=bad == "batch_idx_out_of_range")
    torch.manual_seed(0)
    good, _ = build(case, triton_device)
    args = dict(good)
    buffers = []
    for name in ("k_cache", "v_cache"):
        buffer, view = _guarded(good[name].shape, case.dtype, triton_device)
        view.copy_(good[name])
        args[name] = view
        buffers.append(buffer)
    edits = {"table_past_num_blocks": ("block_table", (1, 1), good["k_cache"].shape[0] + 3),
             "table_negative": ("block_table", (1, 0), -7),
             "seqlens_past_capacity": ("cache_seqlens", 1, 4 * case_capacity(good) - 1),
             "batch_idx_out_of_range": ("cache_batch_idx", 1, 9),
             "leftpad_past_seqlens": ("cache_leftpad", 1, 100)}
    name, index, value = edits[bad]
    args[name] = args[name].clone()
    args[name][index] = value
    kvcache = submodule(flash_attn, "kvcache")
    params = submodule(flash_attn, "_params").KvCacheParams(
        softmax_scale=case.head_dim ** -0.5, causal=True, window_left=-1, window_right=0,
        softcap=0.0, rotary_interleaved=True, num_splits=0, max_seqlen_q=case.seqlen_q,
        max_seqlen_k=case_capacity(good))
    forward = submodule(flash_attn, "_dispatch").select_kvcache_backend(
        args["q"], paged=paged, varlen=False)
    out = torch.full_like(args["q"], math.nan)
    lse = torch.full((3, case.heads[0], case.seqlen_q), math.nan, device=triton_device)
    forward(args["q"], args["k_cache"], args["v_cache"], out, lse, params=params,
            **{name: args.get(name) for name in kvcache.TENSORS[3:]})
    for buffer in buffers:
        assert (buffer[:4096] == 1234.0).all() and (buffer[-4096:] == 1234.0).all(), (
            "a write outside the cache")
    rows = [0, 2]  # the sequences with good values are unaffected
    ref64 = kvcache_reference(**_select(good, rows))
    lowp = kvcache_reference(**_select(good, rows), dtype=case.dtype)
    assert_close_to_reference("out", out[rows], ref64["out"], lowp["out"])
    assert_close_to_reference("lse", lse[rows], ref64["lse"], lowp["lse"])


def case_capacity(args: dict) -> int:
    """A built case's capacity: block-table width times page size, or the cache length."""
    if "block_table" in args:
        return args["block_table"].shape[1] * args["k_cache"].shape[1]
    return args["k_cache"].shape[1]
