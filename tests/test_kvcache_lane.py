"""The kv-cache lane ([Note: lanes] in ``kvcache.py``, [Note: kv-cache lane] in
``_triton/kvcache.py``) on a machine without a GPU: the package's Triton kernels as compiled-path
kernels whose compile is a stand-in that records each launch, and a stand-in driver.

* A repeated call shape goes through its lane, which makes exactly the launches the full path
  makes for it (grid, stream, kernel, every argument: the caller's tensors themselves, new
  outputs of the same shape, strides, dtype and alignment), without the checks.
* Every condition the lane rests on, when it changes, sends the call back to the full path.
* Calls whose full path converts an argument get no lane.

On a GPU, ``test_kvcache_gpu.py`` compares the lane's outputs with the full path's bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from helpers import submodule  # noqa: E402
from test_kvcache import CASES, Case, build  # noqa: E402


class _Runner:
    """A stand-in for a compiled kernel's launcher with nothing to allocate."""
    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self, launches: list):
        self.launches = launches

    def launch(self, *args):
        self.launches.append(args)


class _Compiled:
    packed_metadata = (4, 1, 0)

    def __init__(self, function: int, launches: list):
        self.function = function
        self.run = _Runner(launches)


@pytest.fixture
def lanes(flash_attn, monkeypatch):
    """The package with stand-in compiled kernels on CPU tensors: a namespace of the modules,
    ``launches`` (the compiled launches made), ``compiles`` (Triton-path launches),
    ``checks`` (full-path calls) and ``device`` (the stand-in driver's current device, a
    one-item list)."""
    kvcache = submodule(flash_attn, "kvcache")
    tk = submodule(flash_attn, "_triton.kvcache")
    common = submodule(flash_attn, "_triton.common")
    launch = submodule(flash_attn, "_triton.launch")
    dispatch = submodule(flash_attn, "_dispatch")
    ns = types.SimpleNamespace(kvcache=kvcache, tk=tk, launch=launch, launches=[],
                               compiles=[], checks=[], device=[0])
    for number, (module, name) in enumerate(((tk, "_attend"), (common, "_combine"))):
        fn = getattr(module, name).fn
        jit = JITFunction(fn if not hasattr(fn, "fn") else fn.fn)
        jit.hash = f"source of {name}"
        compiled = _Compiled(1000 + number, ns.launches)

        def run(*args, grid, warmup, _compiled=compiled, **kwargs):
            ns.compiles.append(_compiled.function)
            return _compiled

        jit.run = run
        monkeypatch.setattr(module, name, launch.CachedLauncher(jit))
    active = types.SimpleNamespace(get_current_device=lambda: ns.device[0],
                                   get_current_stream=lambda device: 77 + device)
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(dispatch, "_choose_kvcache", lambda requested, q: ("triton", "test"))
    monkeypatch.setattr(tk, "_plans", {})
    monkeypatch.setattr(kvcache, "_calls", {})
    monkeypatch.setattr(kvcache, "_lanes", {})
    monkeypatch.setattr(kvcache, "_LANE_DEVICES", ("cpu",))
    real = kvcache._checked_call
    monkeypatch.setattr(kvcache, "_checked_call",
                        lambda *a: ns.checks.append(1) or real(*a))
    monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", "0")
    return ns


def _described(launch_args: tuple, inputs: dict) -> tuple:
    """A launch's arguments with each pointer (a tensor, or an int address as the lane passes
    it) as the caller's argument it points to (by name), or, for memory the call allocated,
    ``("new", 16-byte aligned)``. Ints that are no address stay as they are."""
    names = {t.data_ptr(): name for name, t in inputs.items()
             if isinstance(t, torch.Tensor) and t.numel()}
    described = []
    for a in launch_args:
        if isinstance(a, torch.Tensor):
            a = a.data_ptr()
        if isinstance(a, int) and not isinstance(a, bool) and a > 1 << 20:  # an address
            a = names.get(a, ("new", a % 16 == 0))
        described.append(a)
    return tuple(described)


LEADING = 13  # the compiled launch's arguments before the kernel's own
INPUTS = 15  # _attend_kernel's pointer parameters before out, lse and the partials


def _partials_lse_offset(launch_args: tuple):
    """The attention launch's partial lse address minus its partial outputs' (None: no
    split)."""
    o_part, lse_part = (a.data_ptr() if isinstance(a, torch.Tensor) else a
                        for a in launch_args[LEADING + INPUTS + 2:LEADING + INPUTS + 4])
    return None if o_part is None else lse_part - o_part


# (case, num_splits): long enough caches that the splits asked for are taken.
LANE_CASES = {
    "contiguous_split": (Case(lengths=(150, 7, 60)), 3),
    "contiguous_one_split": (Case(lengths=(150, 7, 60)), 1),
    "page16_append": (Case(page_size=16, lengths=(140, 30), seqlen_new=5, seqlen_q=3), 2),
    "no_new_keys": (Case(page_size=16, lengths=(140, 12), seqlen_new=0, seqlen_q=2), 2),
    "sinks_alibi": (Case(page_size=4, lengths=(150, 3), causal=False, sink=True,
                         alibi="heads"), 2),
    "leftpad_paged": (Case(page_size=4, lengths=(150, 6), leftpad=(5, 0)), 1),
    "cache_batch_idx": (Case(lengths=(140, 8, 2), batch_idx=True, seqlen_new=2,
                             seqlen_q=2), 2),
    "rotary_window": (Case(lengths=(140, 5), leftpad=(3, 1), seqlen_q=2, seqlen_new=2,
                           rotary="neox", causal=False, window=(4, 1)), 2),
    "empty_query_appends": (CASES["empty_query_appends"], 1),
    "zero_new_keys_given": (Case(page_size=16, lengths=(140, 12), seqlen_q=2), 2),
}


def _call(fa, args: dict, splits: int, return_lse: bool = True):
    result = fa.flash_attn_with_kvcache(**args, num_splits=splits,
                                        return_softmax_lse=return_lse)
    return result if return_lse else (result, None)


@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "out"])
@pytest.mark.parametrize("name", list(LANE_CASES))
def test_lane_launches_what_the_full_path_launches(flash_attn, lanes, monkeypatch, name,
                                                   return_lse):
    """Without ``return_softmax_lse`` a split call's lane keeps lse in the partials' buffer
    (16-byte aligned, as a fresh allocation is): the same launches but for that address."""
    case, splits = LANE_CASES[name]
    torch.manual_seed(0)
    args, _ = build(case, "cpu")
    if name == "zero_new_keys_given":  # k and v with no rows: nothing to append
        args.update(k=args["k"][:, :0], v=args["v"][:, :0])
    monkeypatch.setattr(lanes.kvcache, "_LANE_DEVICES", ())  # no lane: the full path
    _call(flash_attn, args, splits, return_lse)
    lanes.launches.clear()
    _call(flash_attn, args, splits, return_lse)
    full = [_described(a, args) for a in lanes.launches]
    offset = _partials_lse_offset(lanes.launches[0])
    assert len(full) == (2 if splits > 1 and case.seqlen_q else 1)
    assert not lanes.kvcache._lanes
    monkeypatch.setattr(lanes.kvcache, "_LANE_DEVICES", ("cpu",))
    _call(flash_attn, args, splits, return_lse)  # the full path, which makes the lane
    assert len(lanes.kvcache._lanes) == 1
    lanes.launches.clear()
    lanes.checks.clear()
    lanes.compiles.clear()
    out, lse = _call(flash_attn, args, splits, return_lse)
    assert not lanes.checks and not lanes.compiles  # through the lane
    assert [_described(a, args) for a in lanes.launches] == full
    assert _partials_lse_offset(lanes.launches[0]) == offset
    attend_out, attend_lse = lanes.launches[0][LEADING + INPUTS:LEADING + INPUTS + 2]
    assert attend_out == out.data_ptr() and out.shape == args["q"].shape
    if return_lse:
        assert attend_lse == lse.data_ptr() and lse.dtype == torch.float32
    else:
        assert lse is None
        if offset is not None:  # in the partials' buffer, past the partials' lse
            o_part = lanes.launches[0][LEADING + INPUTS + 2]
            assert attend_lse % 16 == 0 and attend_lse >= o_part + offset


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    base = torch.empty(t.numel() + 8, dtype=t.dtype)
    return base[1:1 + t.numel()].view(t.shape).copy_(t)


class _NoOpMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


CHANGES = ["check_values_on", "backend_variable", "poison_variable", "unaligned_q",
           "current_device", "launch_hook", "debug_knob", "source_changed", "function_mode"]


@pytest.mark.parametrize("change", CHANGES)
def test_lane_gives_way(flash_attn, lanes, monkeypatch, change):
    """After the lane is made, one thing it rests on changes: the call takes the full path."""
    torch.manual_seed(0)
    args, _ = build(Case(page_size=16, lengths=(14, 30), seqlen_new=1), "cpu")
    _call(flash_attn, args, 2)
    lanes.checks.clear()
    _call(flash_attn, args, 2)
    assert not lanes.checks  # the lane
    mode = None
    if change == "check_values_on":
        monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", "1")
    elif change == "backend_variable":
        monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "triton")
    elif change == "poison_variable":
        monkeypatch.setenv("FLASH_ATTN_HUB_POISON", "0" if
                           os.environ.get("FLASH_ATTN_HUB_POISON") == "1" else "1")
    elif change == "unaligned_q":
        args = dict(args, q=_unaligned(args["q"]))
    elif change == "current_device":
        lanes.device[0] = 1
    elif change == "launch_hook":
        chain = knobs.HookChain()
        chain.add(lambda metadata: None)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    elif change == "debug_knob":
        monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    elif change == "source_changed":
        lanes.tk._attend.fn.hash = "another source"
    elif change == "function_mode":
        mode = _NoOpMode()
    lanes.launches.clear()
    if mode is not None:
        with mode:
            _call(flash_attn, args, 2)
    else:
        _call(flash_attn, args, 2)
    assert lanes.checks, "the call went through the lane"


ENVIRONMENT_CHANGES = {"FLASH_ATTN_HUB_CHECK_VALUES": "1", "FLASH_ATTN_HUB_BACKEND": "triton",
                       "FLASH_ATTN_HUB_POISON": "1"}


@pytest.mark.parametrize("name", list(ENVIRONMENT_CHANGES))
def test_lane_follows_the_environment(flash_attn, lanes, monkeypatch, name):
    """After a variable the lane reads changes, the first call takes the full path and makes
    the shape's lane again under the new environment: the next call goes through it, and so
    after the variable changes back. The shape keeps one lane."""
    torch.manual_seed(0)
    args, _ = build(Case(page_size=16, lengths=(14, 30), seqlen_new=1), "cpu")
    monkeypatch.delenv(name, raising=False)
    _call(flash_attn, args, 2)
    for value in (ENVIRONMENT_CHANGES[name], None):
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
        lanes.checks.clear()
        _call(flash_attn, args, 2)
        assert len(lanes.checks) == 1, "the first call under the new environment: full path"
        lanes.launches.clear()
        _call(flash_attn, args, 2)
        assert len(lanes.checks) == 1, "the next call: through the lane made under it"
        assert lanes.launches and len(lanes.kvcache._lanes) == 1


@pytest.mark.parametrize("edit", ["int_seqlens", "column_major_table", "strided_seqlens",
                                  "sinks_bf16"])
def test_no_lane_when_the_full_path_converts(flash_attn, lanes, edit):
    torch.manual_seed(0)
    case = Case(page_size=8, lengths=(6, 6), sink=True, int_seqlens=edit == "int_seqlens")
    args, _ = build(case, "cpu")
    if edit == "column_major_table":
        args["block_table"] = args["block_table"].t().contiguous().t()
    elif edit == "strided_seqlens":
        args["cache_seqlens"] = args["cache_seqlens"].repeat_interleave(2)[::2]
    elif edit == "sinks_bf16":
        args["s_aux"] = args["s_aux"].to(torch.bfloat16)
    for _ in range(2):
        _call(flash_attn, args, 1)
    assert not lanes.kvcache._lanes
    assert len(lanes.checks) == 2


def test_lane_checks_values_where_the_full_path_would(flash_attn, lanes, monkeypatch):
    """With the value checks on, an eager call through the lane runs the full path's value
    checks first: a bad value raises, naming the argument, before any launch. During CUDA-graph
    capture (which skips them) the lane launches without them."""
    monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", "1")
    checked = []
    real = lanes.kvcache._check_cache_values
    monkeypatch.setattr(lanes.kvcache, "_check_cache_values",
                        lambda **kw: checked.append(kw["cache_seqlens"]) or real(**kw))
    torch.manual_seed(0)
    args, _ = build(dataclasses.replace(CASES["contiguous_gqa"]), "cpu")
    _call(flash_attn, args, 2)
    assert len(lanes.kvcache._lanes) == 1
    lanes.checks.clear()
    checked.clear()
    _call(flash_attn, args, 2)
    assert not lanes.checks  # the lane ...
    assert checked == [args["cache_seqlens"]]  # ... after the value checks
    capacity = args["k_cache"].shape[1]
    bad = dict(args, cache_seqlens=torch.full_like(args["cache_seqlens"], capacity))
    launches = len(lanes.launches)
    with pytest.raises(ValueError, match="cache_seqlens"):
        _call(flash_attn, bad, 2)
    assert len(lanes.launches) == launches and not lanes.checks
    monkeypatch.setattr(lanes.kvcache, "_capturing", lambda: True)
    checked.clear()
    _call(flash_attn, args, 2)
    assert not checked and not lanes.checks and len(lanes.launches) > launches


@pytest.mark.parametrize("name", ["FLASH_ATTN_HUB_BACKEND", "FLASH_ATTN_HUB_CHECK_VALUES",
                                  "FLASH_ATTN_HUB_POISON"])
def test_environment_reader_sees_every_change(flash_attn, lanes, monkeypatch, name):
    """The lane's reading of the environment ([Note: reading the environment]) changes with
    every set and unset of each variable, and reads a replaced ``os.environ`` through it."""
    read = lanes.kvcache._environment
    monkeypatch.delenv(name, raising=False)
    unset = read()
    monkeypatch.setenv(name, "1")
    one = read()
    monkeypatch.setenv(name, "0")
    zero = read()
    assert len({unset, one, zero}) == 3
    monkeypatch.delenv(name)
    assert read() == unset
    monkeypatch.setattr(os, "environ", {name: "2"})
    assert read() == tuple("2" if n == name else None for n in lanes.kvcache._LANE_ENV)
