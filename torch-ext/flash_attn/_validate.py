"""Input checks for the public API, and the one place that builds :class:`AttnParams`.

Every check runs before any kernel launches and raises ``TypeError`` (wrong kind of value:
not a tensor, wrong dtype, a float where an int belongs) or ``ValueError`` (right kind, bad
value: shape, device, range) with a message that names the argument, says what was given and
what is accepted. Backends never re-validate.

Arguments are accepted the ways flash-attn 2 accepts them: scalars as Python numbers, numpy
scalars, 0-d tensors or 0-d arrays (converted to Python numbers); ``window_size`` as any pair (a
tuple, a list, a tensor or array of two integers); a ``softcap <= 0`` as off; any head dim up to
``MAX_HEAD_DIM`` and any last stride: the public API pads a head dim that is not a multiple of
``HEAD_DIM_MULTIPLE`` and copies a tensor whose last stride is not 1 (``interface.py``), so
neither reaches a backend.

[Note: checks that read tensor values] ``cu_seqlens_*`` must start at 0, never decrease, end at
the token count, and no sequence may be longer than ``max_seqlen_*``; ``max_seqlen_*`` may also
arrive as a 0-d tensor. These need the values on the host:

* CPU tensors are read directly.
* CUDA tensors are copied to the host once per distinct tensor (``_host_values``): a model passes
  the same ``cu_seqlens`` object to every layer, so a forward pass pays one small device-to-host
  copy, not one per layer. The cache holds weak references, and an in-place write to the tensor
  (its version counter moves) invalidates the entry (``tensor_version``). Inference tensors
  (made under ``torch.inference_mode``) have no version counter, so they are read every call.
* Inside a ``torch.compile`` trace the value checks are skipped: reading values there would
  break the graph, and the compiled graph re-runs with new values it never traced. Shape, dtype
  and device checks still run (they become guards). A 0-d ``max_seqlen`` tensor is converted
  with ``int()``, which compiles with ``fullgraph=True`` and follows the value from call to call.

[Note: symbolic scalars] Inside a trace an int or a float may be symbolic (``torch.SymInt`` /
``torch.SymFloat``): an int argument whose value changed between calls (dynamo then traces it as
a symbol), every int with ``dynamic=True``, floats, and values read with ``.item()`` or
``.tolist()`` under ``capture_scalar_outputs``. Converting one with ``operator.index``, ``int``
or ``float``, or branching on it in Python, would specialise the graph on its value: one
recompilation per new ``max_seqlen`` (and ``FailOnRecompileLimitHit`` after eight), or a
data-dependent error for a value read from a tensor. Symbolic values therefore pass through
unconverted, and their range checks become ``torch._check`` assertions (:func:`_require`): a
guard for a value the graph was traced with, a runtime check for one read from a tensor.
``max_seqlen_*`` is only a hint to the kernels' launch grid (no output shape depends on it), so
one compiled graph serves every value.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import weakref

import torch

from ._params import AttnParams

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8

_HOST_CACHE_SIZE = 8
# id(tensor) -> (tensor_version of it when read, its values as a list)
_host_cache: dict[int, tuple[tuple, list]] = {}


def _fail(exc, name: str, given, accepted: str):
    raise exc(f"{name}: got {given}; expected {accepted}")


def _describe(t: torch.Tensor) -> str:
    return f"tensor of shape {tuple(t.shape)}, dtype {t.dtype} on {t.device}"


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device is capturing a CUDA graph on the current stream (no value of a
    device tensor can be read then)."""
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def tensor_version(t: torch.Tensor) -> tuple | None:
    """``(weak reference to t, t's version)``: what stands for t's values until torch writes
    into it in place (through a view too); None for an inference tensor, which has no version
    (reading its ``_version`` raises)."""
    if t.is_inference():
        return None
    return weakref.ref(t), t._version


def same_version(held: tuple | None, t: torch.Tensor) -> bool:
    """Whether ``held`` (a :func:`tensor_version`) is of ``t`` itself, unchanged since."""
    return held is not None and held[0]() is t and held[1] == t._version


def host_values(t: torch.Tensor) -> list:
    """The public name of :func:`_host_values` (for the ops, after validation)."""
    return _host_values(t)


def _host_values(t: torch.Tensor) -> list:
    """``t.tolist()``, copied from the device at most once per distinct tensor (see Note)."""
    if t.device.type == "cpu":
        return t.tolist()
    entry = _host_cache.get(id(t))
    if entry is not None and same_version(entry[0], t):
        return entry[1]
    values = t.tolist()
    version = tensor_version(t)
    if version is not None:
        if len(_host_cache) >= _HOST_CACHE_SIZE:
            _host_cache.pop(next(iter(_host_cache)))
        _host_cache[id(t)] = (version, values)
    return values


# -- scalars -------------------------------------------------------------------------------

def _require(ok, exc, name: str, given, accepted: str) -> None:
    """Fails unless ``ok``. A symbolic ``ok`` (neither ``True`` nor ``False`` itself) becomes a
    ``torch._check``: a guard or a runtime assertion, whose message dynamo cannot trace
    ([Note: symbolic scalars])."""
    if ok is True:
        return
    if ok is False:
        _fail(exc, name, given, accepted)
    torch._check(ok)


@torch.compiler.disable
def _host_float(t: torch.Tensor) -> float:
    """``float(t)`` outside any graph: the ops take Python floats, and a float read inside a
    graph would be a symbol they cannot take, so a compiled caller breaks the graph here and
    resumes with a constant."""
    return float(t)


def _item(name: str, value, accepted: str, *, integral: bool):
    """``value`` as a Python number when it is a 0-d tensor or a 0-d array (numpy), else as is."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex() or (
                integral and value.dtype.is_floating_point):
            _fail(TypeError, name, _describe(value), accepted)
        return int(value) if integral else _host_float(value)
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return value.item()  # a numpy scalar or 0-d array
    return value


def flag(name: str, value) -> bool:
    """``value`` as a bool (a Python or numpy bool, or a 0-d bool tensor), else a TypeError
    naming ``name``."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.bool:
        return bool(value)
    if not isinstance(value, torch.Tensor) and getattr(value, "ndim", None) == 0:
        value = value.item() if callable(getattr(value, "item", None)) else value
    if not isinstance(value, bool):
        _fail(TypeError, name, f"{type(value).__name__} {value!r}", "a bool")
    return value


def _as_int(name: str, value):
    """An int from an int, a numpy integer or a 0-d integer tensor/array. An int is returned as
    is: inside a trace it may be symbolic, and ``operator.index`` would specialise it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    accepted = "an int"
    value = _item(name, value, accepted, integral=True)
    if isinstance(value, int) and not isinstance(value, bool):
        return value  # possibly symbolic: read from a 0-d tensor inside a trace
    if isinstance(value, (bool, torch.Tensor)):
        _fail(TypeError, name, f"{type(value).__name__} {value!r}", accepted)
    try:
        return operator.index(value)
    except TypeError:
        _fail(TypeError, name, f"{type(value).__name__} {value!r}", accepted)


def _as_float(name: str, value):
    """A float from a real number, a numpy scalar or a 0-d tensor/array. Inside a trace a float
    is returned as is (it may be symbolic)."""
    if isinstance(value, float) and _compiling():
        return value
    accepted = "a float"
    if not isinstance(value, (int, float)):
        value = _item(name, value, accepted, integral=False)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(TypeError, name, f"{type(value).__name__} {value!r}", accepted)
    return float(value)


def _finite(value):
    """``value`` is finite; a SymBool for a symbolic value (NaN fails both comparisons)."""
    if _compiling():
        return (value > -math.inf) & (value < math.inf)
    return math.isfinite(value)


def _window(window_size, causal: bool) -> tuple:
    """``(left, right)`` from any pair: a tuple or list, or a tensor or array of two integers
    (flash-attn 2 indexes it). A tensor's values are read on the host (a device-to-host copy
    for a CUDA tensor); inside a torch.compile graph ``.tolist()`` gives symbolic ints read at
    run time, so new values need no recompilation (docs/compile.md)."""
    accepted = "a pair (left, right) of ints"
    if isinstance(window_size, torch.Tensor) or (
            hasattr(window_size, "tolist") and hasattr(window_size, "shape")):
        if tuple(window_size.shape) != (2,):
            _fail(TypeError, "window_size", f"{type(window_size).__name__} of shape "
                  f"{tuple(window_size.shape)}", accepted)
        pair = window_size.tolist()
    elif isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        pair = window_size
    else:
        _fail(TypeError, "window_size", repr(window_size), accepted)
    left = _as_int("window_size[0]", pair[0])
    right = _as_int("window_size[1]", pair[1])
    for side, value in (("window_size[0]", left), ("window_size[1]", right)):
        _require(value >= -1, ValueError, side, value, "-1 (unbounded) or an int >= 0")
    if causal:
        right = 0
    return left, right


# [Note: scalar memo] A training step or a decode loop passes the same plain Python scalars on
# every call; their checks (~20 frames) are a measurable share of a short call's host time. A
# call whose scalars are all plain (exactly bool, int, float, None, or a tuple/list of ints)
# reuses the checked result of an earlier call with the same values and types. Anything else
# (a tensor, a numpy scalar, a symbolic value inside a trace) is checked every time, and a
# rejected value is never stored, so every bad input still raises.
_PLAIN = frozenset((bool, int, float, type(None)))
_SEQUENCES = frozenset((tuple, list))  # of ints
_PLAIN_OR_SEQUENCES = _PLAIN | _SEQUENCES
_MEMO_SIZE = 512


def _plain_key(values: tuple):
    """A hashable, type-exact key of ``values``, or None when one is not plain."""
    kinds = tuple(map(type, values))
    if _PLAIN.issuperset(kinds):
        return kinds, values
    if not _PLAIN_OR_SEQUENCES.issuperset(kinds):
        return None
    key = []
    for value, kind in zip(values, kinds):
        if kind in _SEQUENCES:
            if not all(type(x) is int for x in value):
                return None
            value = tuple(value)
        key.append(value)
    return kinds, tuple(key)


def memo_plain_scalars(fn):
    """``fn`` (of scalars only, positional or keyword) memoised on plain values ([Note: scalar
    memo]); outside a torch.compile trace only. Keywords in another order are another key."""
    memo: dict = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        key = None if _compiling() else _plain_key(args + tuple(kwargs.values()))
        if key is None:
            return fn(*args, **kwargs)
        key = (tuple(kwargs), key)
        hit = memo.get(key)
        if hit is None:
            hit = fn(*args, **kwargs)
            if len(memo) >= _MEMO_SIZE:
                memo.clear()
            memo[key] = hit
        return hit

    return wrapper


@memo_plain_scalars
def _scalar_params(head_dim, *, dropout_p, softmax_scale, causal, window_size, softcap,
                   deterministic, max_seqlen_q: int, max_seqlen_k: int) -> AttnParams:
    causal = flag("causal", causal)
    deterministic = flag("deterministic", deterministic)
    dropout_p = _as_float("dropout_p", dropout_p)
    _require(dropout_p >= 0.0, ValueError, "dropout_p", dropout_p, "a float in [0, 1)")
    _require(dropout_p < 1.0, ValueError, "dropout_p", dropout_p, "a float in [0, 1)")
    if softmax_scale is None:
        # The head dim the caller passed: an API that pads the head dim scales by the original.
        softmax_scale = head_dim ** -0.5
    else:
        softmax_scale = _as_float("softmax_scale", softmax_scale)
        accepted = "None or a finite float > 0"
        _require(_finite(softmax_scale), ValueError, "softmax_scale", softmax_scale, accepted)
        _require(softmax_scale > 0, ValueError, "softmax_scale", softmax_scale, accepted)
    softcap = _as_float("softcap", softcap)
    _require(_finite(softcap), ValueError, "softcap", softcap,
             "a finite float (> 0 caps the scores; <= 0 is off, as in flash-attn 2)")
    if softcap < 0:
        softcap = 0.0
    window_left, window_right = _window(window_size, causal)
    return AttnParams(softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                      window_right=window_right, softcap=softcap, dropout_p=dropout_p, seed=0,
                      deterministic=deterministic, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k)


# -- tensors -------------------------------------------------------------------------------

def _check_qkv(q, k, v, rank: int, layout: str, names=("q", "k", "v")) -> None:
    """Types, ranks, dtypes, devices, shapes and head counts of q, k, v; ``names`` are the
    arguments the messages name (a packed entry point names its packed tensor)."""
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, type(t).__name__, f"a torch.Tensor of shape {layout}")
        if t.dim() != rank:
            _fail(ValueError, name, f"a {t.dim()}-d tensor of shape {tuple(t.shape)}",
                  f"a {rank}-d tensor {layout}")
    name_q, name_k, name_v = names
    if q.dtype not in SUPPORTED_DTYPES:
        _fail(TypeError, name_q, f"dtype {q.dtype}", "torch.float16 or torch.bfloat16")
    for name, t in ((name_k, k), (name_v, v)):
        if t.dtype != q.dtype:
            _fail(TypeError, name, f"dtype {t.dtype}", f"the dtype of q ({q.dtype})")
        if t.device != q.device:
            _fail(ValueError, name, f"device {t.device}", f"the device of q ({q.device})")
    if v.shape != k.shape:
        _fail(ValueError, name_v, f"shape {tuple(v.shape)}", f"the shape of k {tuple(k.shape)}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        _fail(ValueError, name_k, f"head dim {k.shape[-1]} (shape {tuple(k.shape)})",
              f"the head dim of q ({head_dim})")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        _fail(ValueError, name_q, f"head dim {head_dim}", f"a head dim in [1, {MAX_HEAD_DIM}]")
    num_heads_q, num_heads_kv = q.shape[-2], k.shape[-2]
    if num_heads_kv == 0 or num_heads_q % num_heads_kv != 0:
        _fail(ValueError, name_k, f"{num_heads_kv} heads for {num_heads_q} query heads",
              "a number of kv heads that divides the number of query heads (GQA/MQA)")


def _check_alibi(alibi_slopes, q, batch: int):
    if alibi_slopes is None:
        return None
    num_heads_q = q.shape[-2]
    accepted = f"float32 slopes of shape ({num_heads_q},) or ({batch}, {num_heads_q})"
    if not isinstance(alibi_slopes, torch.Tensor):
        _fail(TypeError, "alibi_slopes", type(alibi_slopes).__name__, "None or " + accepted)
    if alibi_slopes.dtype != torch.float32:
        _fail(TypeError, "alibi_slopes", f"dtype {alibi_slopes.dtype}", accepted)
    if tuple(alibi_slopes.shape) not in ((num_heads_q,), (batch, num_heads_q)):
        _fail(ValueError, "alibi_slopes", f"shape {tuple(alibi_slopes.shape)}", accepted)
    if alibi_slopes.device != q.device:
        _fail(ValueError, "alibi_slopes", f"device {alibi_slopes.device}",
              f"the device of q ({q.device})")
    return alibi_slopes.contiguous()


def _check_s_aux(s_aux, q):
    """Returns the sinks as contiguous float32 (a differentiable conversion)."""
    if s_aux is None:
        return None
    num_heads_q = q.shape[-2]
    accepted = f"a floating tensor of shape ({num_heads_q},), one logit per query head"
    if not isinstance(s_aux, torch.Tensor):
        _fail(TypeError, "s_aux", type(s_aux).__name__, "None or " + accepted)
    if not s_aux.dtype.is_floating_point:
        _fail(TypeError, "s_aux", f"dtype {s_aux.dtype}", accepted)
    if tuple(s_aux.shape) != (num_heads_q,):
        _fail(ValueError, "s_aux", f"shape {tuple(s_aux.shape)}", accepted)
    if s_aux.device != q.device:
        _fail(ValueError, "s_aux", f"device {s_aux.device}", f"the device of q ({q.device})")
    return sinks_float32(s_aux)


def sinks_float32(s_aux):
    """Checked sinks (or None) as the kernels read them: contiguous float32."""
    return None if s_aux is None else s_aux.to(torch.float32).contiguous()


def _check_cu_seqlens(name: str, cu, total: int, q) -> list | None:
    """Checks ``cu`` and returns its values (None inside a compile trace)."""
    if not isinstance(cu, torch.Tensor):
        _fail(TypeError, name, type(cu).__name__, "an int32 torch.Tensor of shape (batch + 1,)")
    if cu.dtype != torch.int32:
        _fail(TypeError, name, f"dtype {cu.dtype}", "torch.int32")
    if cu.dim() != 1 or cu.shape[0] < 2:
        _fail(ValueError, name, f"shape {tuple(cu.shape)}", "a 1-d tensor of shape (batch + 1,)")
    if cu.device != q.device:
        _fail(ValueError, name, f"device {cu.device}", f"the device of q ({q.device})")
    if _compiling() or capturing(cu):
        return None
    values = _host_values(cu)
    if values[0] != 0:
        _fail(ValueError, name, f"first element {values[0]}", "0")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            _fail(ValueError, name, f"a decrease at index {b + 1} ({values[b]} -> {values[b + 1]})",
                  "non-decreasing cumulative sequence lengths")
    if values[-1] > total:
        _fail(ValueError, name, f"last element {values[-1]}",
              f"at most the number of rows ({total}); rows past it belong to no sequence")
    return values


def _max_seqlen(name: str, value):
    """An int from an int or a 0-d integer tensor; symbolic inside a trace, where it is a hint
    that is never specialised on ([Note: symbolic scalars])."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype == torch.bool:
            _fail(TypeError, name, _describe(value), "an int or a 0-d integer tensor")
        if value.device.type != "cpu" and not _compiling():
            value = _host_values(value)
    result = _as_int(name, value)
    _require(result >= 0, ValueError, name, result, "an int >= 0")
    return result


def _check_longest(name: str, values: list | None, max_seqlen) -> None:
    if values is None:
        return
    longest = max(values[b + 1] - values[b] for b in range(len(values) - 1))
    if longest > max_seqlen:
        _fail(ValueError, name, max_seqlen,
              f"at least the longest sequence in the cu_seqlens ({longest})")


# -- entry points --------------------------------------------------------------------------

def batched(q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            deterministic, s_aux, names=("q", "k", "v")):
    """Checks a ``flash_attn_func`` call; returns ``(params, s_aux_f32, alibi_slopes)``."""
    _check_qkv(q, k, v, 4, "(batch, seqlen, heads, head_dim)", names)
    if k.shape[0] != q.shape[0]:
        _fail(ValueError, names[1], f"batch size {k.shape[0]} (shape {tuple(k.shape)})",
              f"the batch size of q ({q.shape[0]})")
    params = _scalar_params(q.shape[-1], dropout_p=dropout_p, softmax_scale=softmax_scale,
                            causal=causal, window_size=window_size, softcap=softcap,
                            deterministic=deterministic, max_seqlen_q=q.shape[1],
                            max_seqlen_k=k.shape[1])
    return params, _check_s_aux(s_aux, q), _check_alibi(alibi_slopes, q, q.shape[0])


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dropout_p,
           softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, s_aux,
           names=("q", "k", "v")):
    """Checks a ``flash_attn_varlen_func`` call; returns ``(params, s_aux_f32, alibi_slopes)``."""
    _check_qkv(q, k, v, 3, "(total_tokens, heads, head_dim)", names)
    values_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q)
    values_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        _fail(ValueError, "cu_seqlens_k", f"shape {tuple(cu_seqlens_k.shape)}",
              f"the shape of cu_seqlens_q {tuple(cu_seqlens_q.shape)} (one entry per sequence + 1)")
    max_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    _check_longest("max_seqlen_q", values_q, max_q)
    _check_longest("max_seqlen_k", values_k, max_k)
    params = _scalar_params(q.shape[-1], dropout_p=dropout_p, softmax_scale=softmax_scale,
                            causal=causal, window_size=window_size, softcap=softcap,
                            deterministic=deterministic, max_seqlen_q=max_q, max_seqlen_k=max_k)
    batch = cu_seqlens_q.shape[0] - 1
    return params, _check_s_aux(s_aux, q), _check_alibi(alibi_slopes, q, batch)
