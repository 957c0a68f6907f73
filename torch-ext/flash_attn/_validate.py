"""Input checks for the public API, and the one place that builds :class:`AttnParams`.

Every check runs before any kernel launches and raises ``TypeError`` (wrong kind of value:
not a tensor, wrong dtype, a float where an int belongs) or ``ValueError`` (right kind, bad
value: shape, stride, device, range) with a message that names the argument, says what was
given and what is accepted. Backends never re-validate.

[Note: checks that read tensor values] ``cu_seqlens_*`` must start at 0, never decrease, end at
the token count, and no sequence may be longer than ``max_seqlen_*``; ``max_seqlen_*`` may also
arrive as a 0-d tensor. These need the values on the host:

* CPU tensors are read directly.
* CUDA tensors are copied to the host once per distinct tensor (``_host_values``): a model passes
  the same ``cu_seqlens`` object to every layer, so a forward pass pays one small device-to-host
  copy, not one per layer. The cache holds weak references, and an in-place write to the tensor
  (its version counter moves) invalidates the entry.
* Inside a ``torch.compile`` trace the value checks are skipped: reading values there would
  break the graph, and the compiled graph re-runs with new values it never traced. Shape, dtype,
  device and stride checks still run (they become guards). A 0-d ``max_seqlen`` tensor is still
  converted with ``int()``, which compiles with ``fullgraph=True`` and follows the value from
  call to call (tests/test_ops.py).
"""

from __future__ import annotations

import math
import operator
import weakref

import torch

from ._params import AttnParams

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8

_HOST_CACHE_SIZE = 8
# id(tensor) -> (weakref to it, its _version when read, its values as a list)
_host_cache: dict[int, tuple[weakref.ref, int, list]] = {}


def _fail(exc, name: str, given, accepted: str):
    raise exc(f"{name}: got {given}; expected {accepted}")


def _describe(t: torch.Tensor) -> str:
    return f"tensor of shape {tuple(t.shape)}, dtype {t.dtype} on {t.device}"


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _host_values(t: torch.Tensor) -> list:
    """``t.tolist()``, copied from the device at most once per distinct tensor (see Note)."""
    if t.device.type == "cpu":
        return t.tolist()
    entry = _host_cache.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == t._version:
        return entry[2]
    values = t.tolist()
    if len(_host_cache) >= _HOST_CACHE_SIZE:
        _host_cache.pop(next(iter(_host_cache)))
    _host_cache[id(t)] = (weakref.ref(t), t._version, values)
    return values


# -- scalars -------------------------------------------------------------------------------

def flag(name: str, value) -> bool:
    """``value`` if it is a bool, else a TypeError naming ``name``."""
    if not isinstance(value, bool):
        _fail(TypeError, name, f"{type(value).__name__} {value!r}", "a bool")
    return value


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        _fail(TypeError, name, f"{type(value).__name__} {value!r}", "an int")
    try:
        return operator.index(value)
    except TypeError:
        _fail(TypeError, name, f"{type(value).__name__} {value!r}", "an int")


def _as_float(name: str, value) -> float:
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, (int, float)):
        _fail(TypeError, name, f"{type(value).__name__} {value!r}", "a float")
    return float(value)


def _window(window_size, causal: bool) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        _fail(TypeError, "window_size", repr(window_size), "a pair (left, right) of ints")
    left = _as_int("window_size[0]", window_size[0])
    right = _as_int("window_size[1]", window_size[1])
    for side, value in (("window_size[0]", left), ("window_size[1]", right)):
        if value < -1:
            _fail(ValueError, side, value, "-1 (unbounded) or an int >= 0")
    if causal:
        right = 0
    return left, right


def _scalar_params(head_dim, *, dropout_p, softmax_scale, causal, window_size, softcap,
                   deterministic, max_seqlen_q: int, max_seqlen_k: int) -> AttnParams:
    causal = flag("causal", causal)
    deterministic = flag("deterministic", deterministic)
    dropout_p = _as_float("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        _fail(ValueError, "dropout_p", dropout_p, "a float in [0, 1)")
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    else:
        softmax_scale = _as_float("softmax_scale", softmax_scale)
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            _fail(ValueError, "softmax_scale", softmax_scale, "None or a finite float > 0")
    softcap = _as_float("softcap", softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        _fail(ValueError, "softcap", softcap, "0.0 (off) or a finite float > 0")
    window_left, window_right = _window(window_size, causal)
    return AttnParams(softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                      window_right=window_right, softcap=softcap, dropout_p=dropout_p, seed=0,
                      deterministic=deterministic, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k)


# -- tensors -------------------------------------------------------------------------------

def _check_qkv(q, k, v, rank: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, type(t).__name__, f"a torch.Tensor of shape {layout}")
        if t.dim() != rank:
            _fail(ValueError, name, f"a {t.dim()}-d tensor of shape {tuple(t.shape)}",
                  f"a {rank}-d tensor {layout}")
    if q.dtype not in SUPPORTED_DTYPES:
        _fail(TypeError, "q", f"dtype {q.dtype}", "torch.float16 or torch.bfloat16")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            _fail(TypeError, name, f"dtype {t.dtype}", f"the dtype of q ({q.dtype})")
        if t.device != q.device:
            _fail(ValueError, name, f"device {t.device}", f"the device of q ({q.device})")
    if v.shape != k.shape:
        _fail(ValueError, "v", f"shape {tuple(v.shape)}", f"the shape of k {tuple(k.shape)}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        _fail(ValueError, "k", f"head dim {k.shape[-1]} (shape {tuple(k.shape)})",
              f"the head dim of q ({head_dim})")
    if head_dim % HEAD_DIM_MULTIPLE != 0 or not 0 < head_dim <= MAX_HEAD_DIM:
        _fail(ValueError, "q", f"head dim {head_dim}",
              f"a multiple of {HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]")
    num_heads_q, num_heads_kv = q.shape[-2], k.shape[-2]
    if num_heads_kv == 0 or num_heads_q % num_heads_kv != 0:
        _fail(ValueError, "k", f"{num_heads_kv} heads for {num_heads_q} query heads",
              "a number of kv heads that divides the number of query heads (GQA/MQA)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            _fail(ValueError, name, f"stride {tuple(t.stride())}",
                  "a last (head-dim) stride of 1; call .contiguous() first")


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
    return s_aux.to(torch.float32).contiguous()


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
    if _compiling():
        return None
    values = _host_values(cu)
    if values[0] != 0:
        _fail(ValueError, name, f"first element {values[0]}", "0")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            _fail(ValueError, name, f"a decrease at index {b + 1} ({values[b]} -> {values[b + 1]})",
                  "non-decreasing cumulative sequence lengths")
    if values[-1] != total:
        _fail(ValueError, name, f"last element {values[-1]}",
              f"the total number of tokens ({total})")
    return values


def _max_seqlen(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype == torch.bool:
            _fail(TypeError, name, _describe(value), "an int or a 0-d integer tensor")
        value = int(value) if value.device.type == "cpu" or _compiling() else _host_values(value)
    result = _as_int(name, value)
    if result < 0:
        _fail(ValueError, name, result, "an int >= 0")
    return result


def _check_longest(name: str, values: list | None, max_seqlen: int) -> None:
    if values is None:
        return
    longest = max(values[b + 1] - values[b] for b in range(len(values) - 1))
    if longest > max_seqlen:
        _fail(ValueError, name, max_seqlen,
              f"at least the longest sequence in the cu_seqlens ({longest})")


# -- entry points --------------------------------------------------------------------------

def batched(q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            deterministic, s_aux):
    """Checks a ``flash_attn_func`` call; returns ``(params, s_aux_f32, alibi_slopes)``."""
    _check_qkv(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    if k.shape[0] != q.shape[0]:
        _fail(ValueError, "k", f"batch size {k.shape[0]} (shape {tuple(k.shape)})",
              f"the batch size of q ({q.shape[0]})")
    params = _scalar_params(q.shape[-1], dropout_p=dropout_p, softmax_scale=softmax_scale,
                            causal=causal, window_size=window_size, softcap=softcap,
                            deterministic=deterministic, max_seqlen_q=q.shape[1],
                            max_seqlen_k=k.shape[1])
    return params, _check_s_aux(s_aux, q), _check_alibi(alibi_slopes, q, q.shape[0])


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dropout_p,
           softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, s_aux):
    """Checks a ``flash_attn_varlen_func`` call; returns ``(params, s_aux_f32, alibi_slopes)``."""
    _check_qkv(q, k, v, 3, "(total_tokens, heads, head_dim)")
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
