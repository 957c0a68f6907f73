"""A cached launcher for Triton kernels: once a call has compiled (or found) its kernel through
``kernel[grid](...)``, later calls Triton would specialise the same way launch that compiled
kernel directly, skipping ``JITFunction.run``'s argument binding, specialisation and cache-key
work (most of a short call's host time, next to the launch itself).

[Note: what JITFunction.run does] (Triton 3.6, ``runtime/jit.py``) per launch:

1. options: the call's keywords that are not parameters (``num_warps``, ``num_stages``, ...)
   plus ``debug`` (``kwargs.get("debug", fn.debug) or knobs.runtime.debug``) and
   ``instrumentation_mode`` (``knobs.compilation.instrumentation_mode``);
2. device and stream: ``driver.active.get_current_device()`` and ``get_current_stream``;
3. ``fn.pre_run_hooks``, each called with the arguments;
4. the binder (``create_function_from_signature``): every parameter becomes a
   ``(type, attribute)`` pair by ``native_specialize_impl``: a constexpr is ``("constexpr",
   value)``; ``None`` is ``("constexpr", None)``; a bool ``("u1", None)``; a float
   ``("fp32", None)``; an int ``("constexpr", 1)`` when it equals 1, else ``i32``, ``i64`` or
   ``u64`` by range with ``"D"`` when divisible by 16; a tensor ``("*<dtype>", "D")`` when its
   data pointer is 16-byte aligned, else ``""``;
5. the kernel: ``device_caches[device]``'s compiled kernel for ``(specialization, str(options))``,
   compiled on a miss; then a check that the globals the kernel read have not changed;
6. the launch: ``kernel.run(grid_x, grid_y, grid_z, stream, kernel.function,
   kernel.packed_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, *every
   argument in signature order)``; ``launch_metadata`` is built for the hooks, and ``run`` (a
   ``CudaLauncher``) allocates the kernel's global and profile scratch, if any, then calls its
   compiled ``launch(grid_x, grid_y, grid_z, stream, function, cooperative, pdl,
   global_scratch, profile_scratch, packed_metadata, launch_metadata, enter, exit, *args)``.

Use: ``launcher.bind(*trailing, **constexprs_and_options)[grid](*leading)``. A kernel's
parameters are its leading arguments (tensors or None: the pointers, which change from call to
call), then its trailing runtime arguments, then its constexprs, every one by keyword. A
:class:`Bound` holds the trailing arguments, constexprs and options, so a caller that keeps one
(a memoised launch plan) pays only for the leading arguments' part of the key.

The key never is coarser than Triton's, so a kernel is reused only for a call Triton would
serve with the same kernel. It is the :class:`Bound`'s ``spec`` (one token per trailing types,
trailing int values, constexpr and option names, values and types: what fixes steps 1 and 4 for
them, by exact type and value; a float, bool or None counts by its type alone, which is all
Triton reads of it), then each leading argument's type, each tensor's dtype and whether its
data pointer is 16-byte aligned, the device, ``fn.debug``, ``knobs.runtime.debug`` and the
instrumentation mode. It is built by C-level calls (``map``, ``operator`` getters), not a
Python function per argument.

Everything else takes Triton's own path, ``kernel[grid](...)``, which also fills this cache:
the interpreter (``TRITON_INTERPRET=1``: the kernel is no ``JITFunction``), a launch hook or a
pre-run hook, a callable grid, an argument of another type (a tensor subclass, a numpy scalar, a
leading int), arguments that do not match the parameters that way, an option other than
``OPTIONS``, a kernel whose source changed (``fn.hash``) or whose globals are no longer the
objects they were when it was cached (Triton then compares their values), an asynchronously
compiled kernel, and any exception (Triton then raises its own error). With no scratch to
allocate, the compiled ``launch`` is called directly; else ``run``. No launch hook is set on
the cached path, so no launch metadata is built and None stands for it and both hooks (the
launcher calls neither). A launcher keeps at most ``MAX_ENTRIES`` kernels and bound forms
(Triton keeps every kernel anyway); past that it starts afresh.
"""

from __future__ import annotations

import functools
import operator

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

# Launch options a call may pass besides the kernel's parameters (others take Triton's path).
OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl"))
MAX_ENTRIES = 256

_SCALARS = frozenset((int, bool, float, type(None)))
_POINTERS = frozenset((torch.Tensor, type(None)))
_MISSING = object()
_dtype = operator.attrgetter("dtype")
_data_ptr = operator.methodcaller("data_ptr")
_low_bits = (15).__and__  # p -> p & 15
_is_zero = (0).__eq__


def alignment(tensors) -> tuple:
    """For each tensor, whether its data pointer is 16-byte aligned (what Triton specialises
    a pointer on)."""
    return pointer_alignment(map(_data_ptr, tensors))


def pointer_alignment(pointers) -> tuple:
    """For each data pointer (an int), whether it is 16-byte aligned."""
    return tuple(map(_is_zero, map(_low_bits, pointers)))


def _getter(positions):
    """A C-level function of a sequence returning the tuple of its items at ``positions``."""
    if len(positions) == 1:
        (only,) = positions
        return lambda seq: (seq[only],)
    return operator.itemgetter(*positions) if positions else (lambda seq: ())


class CachedLauncher:
    """Launches ``fn`` like ``fn[grid](...)`` ([Note: what JITFunction.run does]), through
    :meth:`bind`."""

    def __init__(self, fn):
        self.fn = fn
        self.enabled = isinstance(fn, JITFunction) and all(
            p.is_constexpr or not (p.annotation or p.do_not_specialize
                                   or p.do_not_specialize_on_alignment) for p in fn.params)
        self._bound: dict = {}
        self._specs: dict = {}  # what Triton reads of a Bound's arguments -> a token for it
        self._tensors: dict = {}  # leading argument types -> getter of the tensors among them
        self._kernels: dict = {}

    def clear(self) -> None:
        """Forgets every cached kernel (the next call of each kind takes Triton's path)."""
        self._kernels.clear()

    def __len__(self) -> int:
        """The number of cached kernels."""
        return len(self._kernels)

    def bind(self, *trailing, **constexprs) -> Bound:
        """The launch with its trailing runtime arguments and its constexprs and options fixed:
        the same :class:`Bound` for the same ones (by exact type and value)."""
        types = tuple(map(type, trailing))
        values = tuple(constexprs.values())
        kinds = tuple(map(type, values))
        if not (self.enabled and _SCALARS.issuperset(types) and _SCALARS.issuperset(kinds)):
            return Bound(self, trailing, constexprs, None, None)
        key = (types, trailing, tuple(constexprs), values, kinds)
        bound = self._bound.get(key)
        if bound is None:
            if len(self._bound) >= MAX_ENTRIES:
                self._bound.clear()
                self._specs.clear()
            # What Triton reads of these arguments: all but the values of floats and bools.
            spec = (types, tuple(v for v, t in zip(trailing, types) if t is int), key[2:])
            bound = self._bound[key] = Bound(self, trailing, constexprs,
                                             self._tail(trailing, constexprs),
                                             self._specs.setdefault(spec, object()))
        return bound

    def _tail(self, trailing: tuple, constexprs: dict):
        """``(leading count, tail)``: how many leading arguments the kernel takes before
        ``trailing``, and the arguments after them in parameter order; None when the
        arguments do not fit the parameters that way."""
        params = self.fn.params
        options = set(constexprs) - {p.name for p in params}
        count = len(params) - (len(constexprs) - len(options)) - len(trailing)
        named = params[count + len(trailing):]
        if (not options <= OPTIONS or count < 0
                or any(p.is_constexpr for p in params[:count + len(trailing)])
                or not all(p.is_constexpr and p.name in constexprs for p in named)):
            return None
        return count, trailing + tuple(constexprs[p.name] for p in named)

    def key(self, bound: Bound, leading: tuple, device: int):
        """The cache key of ``bound`` launched with ``leading``, or None for a call that must
        take Triton's path ([Note: what JITFunction.run does])."""
        types = tuple(map(type, leading))
        tensors = self._tensors.get(types)
        if tensors is None:
            tensors = self._tensors[types] = (
                _POINTERS.issuperset(types)
                and _getter([i for i, t in enumerate(types) if t is torch.Tensor]))
        if not tensors or bound.tail is None or len(leading) != bound.tail[0]:
            return None
        pointers = tensors(leading)
        return (bound.spec, types, tuple(map(_dtype, pointers)), alignment(pointers), device,
                self.fn.debug, knobs.runtime.debug, knobs.compilation.instrumentation_mode)

    def ready(self, bound: Bound, leading: tuple) -> Ready | None:
        """The launch ``bound[grid](*leading)`` would make now through a cached kernel, held
        for repeating ([Note: ready launches]); None when it would take Triton's path."""
        fn = self.fn
        if (bound.tail is None or fn.pre_run_hooks or triton_state() is None
                or len(leading) != bound.tail[0]):
            return None
        key = self.key(bound, leading, driver.active.get_current_device())
        entry = self._kernels.get(key) if key is not None else None
        if entry is None or not entry.current(fn):
            return None
        return Ready(fn, entry, bound.tail[1])

    def launch(self, bound: Bound, grid, leading: tuple):
        key = None
        fn = self.fn
        try:
            if (bound.tail is not None and not fn.pre_run_hooks and not callable(grid)
                    and _hooks_unset()):
                active = driver.active
                device = active.get_current_device()
                key = self.key(bound, leading, device)
                entry = self._kernels.get(key) if key is not None else None
                if entry is not None and entry.current(fn):
                    size = len(grid)
                    entry.start(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1,
                                active.get_current_stream(device), *entry.prefix, *leading,
                                *bound.tail[1])
                    return entry.kernel
        except Exception:  # Triton's path below raises Triton's own error, if any
            key = None
        kernel = fn[grid](*leading, *bound.trailing, **bound.constexprs)
        if key is not None and _cacheable(kernel):
            if len(self._kernels) >= MAX_ENTRIES:
                self._kernels.clear()
            self._kernels[key] = _Entry(kernel, fn)
        return kernel


class Bound:
    """A launch of one kernel with its trailing runtime arguments, constexprs and options fixed;
    ``bound[grid](*leading)`` launches it."""
    __slots__ = ("launcher", "trailing", "constexprs", "tail", "spec")

    def __init__(self, launcher: CachedLauncher, trailing: tuple, constexprs: dict, tail, spec):
        self.launcher = launcher
        self.trailing = trailing
        self.constexprs = dict(constexprs)
        self.tail = tail  # (leading count, the arguments after the leading ones), or None
        self.spec = spec  # one token for every Bound Triton specialises alike

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *leading):
        return self.launcher.launch(self, grid, leading)


# [Note: ready launches] A caller that repeats one launch shape (the kv-cache lane,
# ``_triton/kvcache.py``) can hold the launch itself instead of its :class:`Bound`: a
# :class:`Ready` is a cached kernel with its trailing arguments, made by
# :meth:`CachedLauncher.ready` from a launch that has just gone through the cache. It skips the
# launcher key, so it holds only while the key's other parts stay as they were, which its
# holder checks before each launch: the same current device and :func:`triton_state` (launch
# hooks, debug knobs) as when it was made, leading arguments of the same types, dtypes and
# 16-byte alignment, and :meth:`Ready.holds` (the kernel's source, the globals it read, its
# debug flag, no pre-run hook). Anything else goes back to :meth:`CachedLauncher.launch`. The
# holder makes the launch itself, ``start(grid_x, grid_y, grid_z, stream, *prefix, *leading,
# *tail)``: on a hot path a method call in between would cost a frame per launch.


def triton_state():
    """What a launch reads of Triton's global state besides its kernel and arguments: the
    debug and instrumentation knobs, or None while a launch hook is set (Triton's path)."""
    if not _hooks_unset():
        return None
    return knobs.runtime.debug, knobs.compilation.instrumentation_mode


class Ready:
    """A cached kernel's launch with everything but the grid, the stream and the leading
    arguments fixed, launched as ``start(grid_x, grid_y, grid_z, stream, *prefix, *leading,
    *tail)`` ([Note: ready launches])."""
    __slots__ = ("fn", "entry", "start", "prefix", "tail", "debug")

    def __init__(self, fn, entry: _Entry, tail: tuple):
        self.fn = fn
        self.entry = entry
        self.start = entry.start
        self.prefix = entry.prefix
        self.tail = tail
        self.debug = fn.debug

    def holds(self) -> bool:
        """The kernel is still the one Triton would launch for these arguments."""
        fn = self.fn
        return not fn.pre_run_hooks and fn.debug == self.debug and self.entry.current(fn)


class _Entry:
    """A cached compiled kernel and how to launch it."""
    __slots__ = ("kernel", "start", "prefix", "source", "scopes")

    def __init__(self, kernel, fn):
        self.kernel = kernel
        run = kernel.run
        if (getattr(run, "global_scratch_size", None) == 0
                and getattr(run, "profile_scratch_size", None) == 0 and hasattr(run, "launch")):
            # CudaLauncher.__call__ with nothing to allocate: its compiled launch, directly.
            self.start = run.launch
            self.prefix = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None,
                           None, kernel.packed_metadata, None, None, None)
        else:
            self.start = run
            self.prefix = (kernel.function, kernel.packed_metadata, None, None, None)
        self.source = fn.hash
        # The global objects the kernel read, as they were when Triton last checked them.
        self.scopes = tuple((scope, name, scope.get(name, _MISSING))
                            for (name, _), (_, scope) in fn.used_global_vals.items())

    def current(self, fn) -> bool:
        """The kernel's source and the globals it read are the ones it was cached with."""
        if fn.hash is not self.source and fn.hash != self.source:
            return False
        for scope, name, value in self.scopes:
            if scope.get(name, _MISSING) is not value:
                return False
        return True


def _hooks_unset() -> bool:
    """Neither launch hook is set (a set one sends every launch through Triton's path)."""
    runtime = knobs.runtime
    return _no_hooks(runtime.launch_enter_hook) and _no_hooks(runtime.launch_exit_hook)


def _no_hooks(hook) -> bool:
    """An unset launch hook: None, or Triton 3.6's hook chain with nothing in it."""
    return hook is None or (type(hook) is knobs.HookChain and not hook.calls)


def _cacheable(kernel) -> bool:
    """A compiled kernel with its launcher loaded (not a future of an asynchronous compile)."""
    return (kernel is not None and not hasattr(kernel, "result")
            and getattr(kernel, "function", None) is not None)
