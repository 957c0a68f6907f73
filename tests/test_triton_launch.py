"""The cached Triton launcher (``_triton/launch.py``) on a machine without a GPU.

* Its key against Triton's own: for calls over a grid of arguments (ints 0, 1, 16, 17, 32 and
  past 32 bits, tensors of several dtypes at aligned and unaligned addresses, None, bools,
  floats, constexprs, options), two calls with the same launcher key must have the same key
  in Triton's kernel cache (Triton 3.6's binder, ``create_function_from_signature``, and
  ``compute_cache_key``, for an sm90 target), and calls that differ only where Triton does not
  look (another tensor at an address of the same alignment, another float) must share a key.
* Its launch, with a stand-in driver and compiled kernel: the first call of a kind takes
  Triton's path, later ones call the compiled kernel's launcher with Triton's argument order;
  every case the launcher does not handle, and any exception, takes Triton's path.
* Under the interpreter (``TRITON_INTERPRET=1``) it always takes Triton's path.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import (JITFunction, compute_cache_key,  # noqa: E402
                                create_function_from_signature)

from helpers import submodule  # noqa: E402

tl = triton.language


def _kernel(X, Y, n, stride, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs * stride, mask=offs < n)
    if MODE:
        x = x * scale
    if flag:
        tl.store(Y + offs, x, mask=offs < n)


@pytest.fixture(scope="module")
def launch(flash_attn):
    return submodule(flash_attn, "_triton.launch")


@pytest.fixture
def kernel():
    """A compiled-path kernel object (a ``JITFunction`` whatever ``TRITON_INTERPRET`` says)."""
    return JITFunction(_kernel)


LEADING = 2  # X, Y: the kernel's pointer parameters, passed per call


def _our_key(launcher, args, kwargs, device=0):
    """The launcher's key of ``kernel[grid](*args, **kwargs)`` made as the package makes it:
    ``launcher.bind(*args[LEADING:], **kwargs)[grid](*args[:LEADING])``."""
    return launcher.key(launcher.bind(*args[LEADING:], **kwargs), args[:LEADING], device)


def _triton_key(fn: JITFunction, args, kwargs) -> str:
    """The key of Triton 3.6's kernel cache for a launch (``JITFunction.run``'s steps)."""
    binder = create_function_from_signature(fn.signature, fn.params,
                                            CUDABackend(GPUTarget("cuda", 90, 32)))
    options = dict(kwargs, debug=fn.debug or knobs.runtime.debug,
                   instrumentation_mode=knobs.compilation.instrumentation_mode)
    _, specialization, options = binder(*args, **options)
    return compute_cache_key({}, specialization, options)


def _tensor(dtype, offset: int, storage: dict) -> torch.Tensor:
    """A 1-d tensor ``offset`` elements into a fresh allocation (kept alive in ``storage``)."""
    base = torch.zeros(64, dtype=dtype)
    storage.setdefault("keep", []).append(base)
    return base[offset:offset + 32]


def _calls():
    """Launches over a grid of argument values, as ``(args, kwargs)``."""
    storage = {}
    pointers = [_tensor(torch.float16, 0, storage), _tensor(torch.float16, 0, storage),
                _tensor(torch.float16, 1, storage), _tensor(torch.float16, 8, storage),
                _tensor(torch.float32, 0, storage), _tensor(torch.float32, 2, storage),
                _tensor(torch.int32, 4, storage), None]
    ints = [0, 1, 16, 17, 32, -16, 2 ** 31 - 1, 2 ** 31, 2 ** 32 + 16, True, 1.0]
    floats = [0.5, 2.0, 1, 1.0, True, None]
    flags = [True, False, 1, 0]
    constexprs = [dict(BLOCK=32, MODE=True), dict(BLOCK=32, MODE=1), dict(BLOCK=64, MODE=False)]
    options = [dict(num_warps=4), dict(num_warps=8), dict(num_warps=4, num_stages=2)]
    calls = []
    for x, stride, scale in itertools.product(pointers, ints, floats):
        calls.append(((x, pointers[0], 17, stride, scale, True), {**constexprs[0], **options[0]}))
    for y, n, flag, constexpr, option in itertools.product(pointers[:3], ints[:5], flags,
                                                           constexprs, options):
        calls.append(((pointers[1], y, n, 16, 0.5, flag), {**constexpr, **option}))
    return calls, storage


def test_key_is_never_coarser_than_tritons(launch, kernel):
    launcher = launch.CachedLauncher(kernel)
    assert launcher.enabled
    calls, _ = _calls()
    seen: dict = {}
    for args, kwargs in calls:
        ours = _our_key(launcher, args, kwargs)
        assert ours is not None, (args, kwargs)
        theirs = _triton_key(kernel, args, kwargs)
        first = seen.setdefault(ours, (theirs, args, kwargs))
        assert first[0] == theirs, (f"one launcher key for two Triton keys:\n{first[1:]}\n"
                                    f"{(args, kwargs)}")
    # Calls Triton tells apart are in the grid (a key that merged them fails above).
    assert len({value[0] for value in seen.values()}) > len(calls) // 20


def test_key_ignores_what_triton_ignores(launch, kernel):
    """Another tensor at an address of the same alignment and another float value reuse the
    kernel; a tensor at another alignment, an int that is 1 or not a multiple of 16, a
    constexpr or an option do not."""
    launcher = launch.CachedLauncher(kernel)
    storage = {}
    x, x2 = _tensor(torch.float16, 0, storage), _tensor(torch.float16, 8, storage)
    unaligned = _tensor(torch.float16, 1, storage)
    y = _tensor(torch.float16, 0, storage)
    kwargs = dict(BLOCK=32, MODE=True, num_warps=4)

    def key(*args, **changes):
        return _our_key(launcher, args, {**kwargs, **changes})

    base = key(x, y, 17, 16, 0.5, True)
    assert key(x2, y, 17, 16, 0.25, True) == base
    assert key(x2, y, 17, 16, 0.25, False) == base  # a runtime bool is not specialised on
    for other in (key(unaligned, y, 17, 16, 0.5, True), key(x, y, 1, 16, 0.5, True),
                  key(x, y, 17, 17, 0.5, True), key(x, None, 17, 16, 0.5, True),
                  key(x, y, 17, 16, 0.5, True, BLOCK=64), key(x, y, 17, 16, 0.5, True,
                                                               num_warps=8),
                  _our_key(launcher, (x, y, 17, 16, 0.5, True), kwargs, device=1)):
        assert other != base


class _Compiled:
    """A stand-in for Triton's CompiledKernel: records its launcher's calls."""
    function = 1234
    packed_metadata = (4, 1, 0)

    def __init__(self, launches: list, fail: bool = False):
        self.launches, self.fail = launches, fail

    def run(self, *args):
        if self.fail:
            raise RuntimeError("launch failed")
        self.launches.append(args)


@pytest.fixture
def stand_in(launch, kernel, monkeypatch):
    """The launcher of a kernel whose Triton path records its call and returns a
    :class:`_Compiled`, with a driver that reports device 0 and stream 77: a namespace of
    ``launcher``, ``compiled``, ``jit_calls`` and ``launches`` (the compiled kernel's)."""
    jit_calls, launches = [], []
    compiled = _Compiled(launches)

    def run(*args, grid, warmup, **kwargs):
        jit_calls.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(kernel, "run", run)
    kernel.hash = "source hash"
    active = types.SimpleNamespace(get_current_device=lambda: 0,
                                   get_current_stream=lambda device: 77)
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=active))
    return types.SimpleNamespace(launcher=launch.CachedLauncher(kernel), compiled=compiled,
                                 jit_calls=jit_calls, launches=launches)


def _launch(launcher, grid, args, kwargs):
    return launcher.bind(*args[LEADING:], **kwargs)[grid](*args[:LEADING])


def _args(offset: int = 0):
    storage = {}
    return (_tensor(torch.float16, offset, storage), _tensor(torch.float16, 0, storage), 17, 16,
            0.5, True), storage


def test_launch_reuses_the_compiled_kernel_in_tritons_argument_order(stand_in):
    launcher, jit_calls, launches = stand_in.launcher, stand_in.jit_calls, stand_in.launches
    kwargs = dict(BLOCK=32, MODE=True, num_warps=4)
    args, _ = _args()
    _launch(launcher, (3, 2), args, kwargs)
    assert len(jit_calls) == 1 and not launches and len(launcher) == 1
    assert jit_calls[0] == ((3, 2), args, kwargs)
    again, _ = _args()  # new tensors, same alignment
    _launch(launcher, (5,), again, kwargs)
    assert len(jit_calls) == 1
    assert launches == [(5, 1, 1, 77, 1234, (4, 1, 0), None, None, None, *again, 32, True)]
    unaligned, _ = _args(offset=1)
    _launch(launcher, (5,), unaligned, kwargs)
    assert len(jit_calls) == 2 and len(launches) == 1 and len(launcher) == 2
    launcher.clear()
    _launch(launcher, (5,), again, kwargs)
    assert len(jit_calls) == 3


def _grid(meta):
    return (1,)


@pytest.mark.parametrize("case", ["pre_run_hook", "enter_hook", "exit_hook", "callable_grid",
                                  "numpy_scalar", "tensor_subclass", "leading_int",
                                  "keyword_runtime_argument", "positional_constexpr",
                                  "unknown_option", "source_changed", "global_replaced",
                                  "launch_raises"])
def test_every_other_case_takes_tritons_path(stand_in, kernel, monkeypatch, case):
    launcher, jit_calls, launches = stand_in.launcher, stand_in.jit_calls, stand_in.launches
    kwargs = dict(BLOCK=32, MODE=True, num_warps=4)
    args, _ = _args()
    _launch(launcher, (1,), args, kwargs)
    grid, leading = (1,), LEADING
    if case == "pre_run_hook":
        monkeypatch.setattr(kernel, "pre_run_hooks", [lambda *a, **k: None])
    elif case in ("enter_hook", "exit_hook"):
        chain = knobs.HookChain()
        chain.add(lambda metadata: None)
        monkeypatch.setattr(knobs.runtime, f"launch_{case.split('_')[0]}_hook", chain)
    elif case == "callable_grid":
        grid = _grid
    elif case == "numpy_scalar":
        np = pytest.importorskip("numpy")
        args = (*args[:2], np.int32(17), *args[3:])
    elif case == "tensor_subclass":
        args = (torch.nn.Parameter(args[0], requires_grad=False), *args[1:])
    elif case == "leading_int":
        leading = LEADING + 1
    elif case == "keyword_runtime_argument":
        kwargs = dict(kwargs, flag=args[-1])
        args = args[:-1]
    elif case == "positional_constexpr":
        args = (*args, 32)
        kwargs = dict(MODE=True, num_warps=4)
    elif case == "unknown_option":
        kwargs = dict(kwargs, debug=True)
    elif case == "source_changed":
        kernel.hash = "another source hash"
    elif case == "global_replaced":
        scope = {"LIMIT": 1}
        monkeypatch.setattr(kernel, "used_global_vals", {("LIMIT", id(scope)): (1, scope)})
        launcher.clear()
        _launch(launcher, grid, args, kwargs)  # cached with LIMIT's object
        scope["LIMIT"] = 2
    elif case == "launch_raises":
        stand_in.compiled.fail = True
    jit_calls.clear()
    launcher.bind(*args[leading:], **kwargs)[grid](*args[:leading])
    assert len(jit_calls) == 1 and not launches


def test_compiled_launch_is_called_directly_without_scratch(stand_in):
    """A compiled kernel whose launcher allocates nothing is launched through its compiled
    ``launch``, with the arguments ``CudaLauncher.__call__`` would pass it."""
    calls = []
    launcher_object = types.SimpleNamespace(
        launch=lambda *a: calls.append(a), global_scratch_size=0, profile_scratch_size=0,
        launch_cooperative_grid=False, launch_pdl=True)
    stand_in.compiled.run = launcher_object
    kwargs = dict(BLOCK=32, MODE=False, num_warps=4)
    args, _ = _args()
    _launch(stand_in.launcher, (2, 3, 4), args, kwargs)
    _launch(stand_in.launcher, (2, 3, 4), args, kwargs)
    assert calls == [(2, 3, 4, 77, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                      *args, 32, False)]


def test_interpreter_always_takes_tritons_path(launch):
    """An interpreted kernel (what ``triton.jit`` gives under ``TRITON_INTERPRET=1``) is
    launched by Triton's path, and computes."""
    interpreted = InterpretedFunction(_kernel)
    launcher = launch.CachedLauncher(interpreted)
    assert not launcher.enabled
    x = torch.arange(32, dtype=torch.float32)
    for _ in range(2):
        y = torch.full((32,), float("nan"))
        launcher.bind(20, 1, 2.0, 1, BLOCK=32, MODE=True)[(1,)](x, y)  # (its bools are broken)
        assert torch.equal(y[:20], 2 * x[:20]) and y[20:].isnan().all()
    assert len(launcher) == 0


def test_package_launchers_follow_the_interpreter(flash_attn, launch):
    """The package's kv-cache launchers wrap its kernels: enabled exactly when those are
    compiled-path kernels (not under the interpreter)."""
    for module, name in (("_triton.kvcache", "_attend"), ("_triton.common", "_combine")):
        launcher = getattr(submodule(flash_attn, module), name)
        assert isinstance(launcher, launch.CachedLauncher)
        assert launcher.enabled == isinstance(launcher.fn, JITFunction)
        assert launcher.enabled == (not knobs.runtime.interpret)
