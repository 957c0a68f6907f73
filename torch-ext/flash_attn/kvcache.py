"""Inference entry points: ``flash_attn_with_kvcache`` (flash-attn 2's signature, plus ``s_aux``)
and the paged form of ``flash_attn_varlen_func`` (``block_table=``), their checks and their op.

Layers: backend ``kvcache_forward`` (destination-passing, chosen by
``_dispatch.select_kvcache_backend``) <- the custom op ``kvcache_fwd`` below, which allocates
``out``/``lse``, mutates ``k_cache``/``v_cache`` and calls the backend <- the public functions.
There is no autograd formula: like flash-attn 2's, these calls are forward only.

Caches: contiguous ``(B_cache, S_cache, Hkv, D)``, sequence ``b`` in row
``cache_batch_idx[b]`` (or ``b``); or paged ``(num_blocks, page_size, Hkv, D)`` with an int32
``block_table (B, max_blocks)``: key position ``n`` of sequence ``b`` lives in block
``block_table[b, n // page_size]``, slot ``n % page_size``, for any page size >= 1. The capacity
of a sequence is ``S_cache``, or ``max_blocks * page_size``.

A sequence's keys are cache positions ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)``
(new keys appended first), causal masks aligned bottom-right on that count.
``cache_seqlens[b] == -1`` marks a padding slot (transformers' continuous batching pads its
CUDA-graph batches with them): nothing is appended for it and its rows see no key (out 0, lse
-inf, or ``s_aux`` with sinks).

Checks: shapes, dtypes, devices, head counts, the page size of ``v_cache`` against ``k_cache``
and index dtypes are checked on the host, before any launch, from metadata alone; the checks
that need values are in ``_kvcache_values`` ([Note: value checks] there: when they run and what
they cost).

Unchecked calls stay memory-safe: the kernels mask every cache write and read to the cache's
pages (a position past the capacity, a negative or out-of-range block or batch index is
skipped), so a bad value gives a wrong result for its sequence, never a write outside the cache.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
from torch import Tensor

from . import _custom_ops, _dispatch, _validate
from ._ops import add_op_namespace_prefix
from ._kvcache_values import (ENV_CHECK_VALUES, _check_cache_values, _check_paged_varlen_values,
                              _checking_values)
from ._params import KvCacheParams
from ._validate import _fail

PARAM_FIELDS = ("softmax_scale", "causal", "window_left", "window_right", "softcap",
                "rotary_interleaved", "num_splits", "max_seqlen_q", "max_seqlen_k")
TENSORS = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
           "cache_batch_idx", "cache_leftpad", "block_table", "cu_seqlens_q", "cu_seqlens_k",
           "alibi_slopes", "s_aux")


# -- the op --------------------------------------------------------------------------------

def _kvcache_body(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                  v: Optional[Tensor], rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
                  cache_seqlens: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                  cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                  cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                  alibi_slopes: Optional[Tensor], s_aux: Optional[Tensor], softmax_scale: float,
                  causal: bool, window_left: int, window_right: int, softcap: float,
                  rotary_interleaved: bool, num_splits: int, max_seqlen_q: int,
                  max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    """Appends ``k``/``v`` (rotated) to the caches in place, then attends: ``(out, lse)``."""
    params = KvCacheParams(softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                           window_right=window_right, softcap=softcap,
                           rotary_interleaved=rotary_interleaved, num_splits=num_splits,
                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return _body_with_params(params, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                             cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                             cu_seqlens_q, cu_seqlens_k, alibi_slopes, s_aux)


def _body_with_params(params: KvCacheParams, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                      cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q,
                      cu_seqlens_k, alibi_slopes, s_aux) -> tuple[Tensor, Tensor]:
    """The op's body with its scalars as one :class:`KvCacheParams` (tensors in the op's
    order): allocates ``out``/``lse`` and runs the chosen backend."""
    out = _custom_ops._new_output(q.shape, q.dtype, q.device)
    lse = _custom_ops._new_output(_lse_shape(q, cu_seqlens_q), torch.float32, q.device)
    if q.shape[0] == 0 or q.shape[-2] == 0:
        return out, lse
    forward = _dispatch.select_kvcache_backend(q, paged=block_table is not None,
                                               varlen=cu_seqlens_q is not None)
    with _custom_ops._on_device_of(q):
        forward(q, k_cache, v_cache, out, lse, k=k, v=v, rotary_cos=rotary_cos,
                rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                block_table=block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                alibi_slopes=alibi_slopes, s_aux=s_aux, params=params)
    return out, lse


kvcache_fwd = torch.library.custom_op(add_op_namespace_prefix("kvcache_fwd"),
                                      mutates_args=("k_cache", "v_cache"))(_kvcache_body)


@torch.library.register_fake(add_op_namespace_prefix("kvcache_fwd"))
def _kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                  cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k,
                  alibi_slopes, s_aux, softmax_scale, causal, window_left, window_right, softcap,
                  rotary_interleaved, num_splits, max_seqlen_q, max_seqlen_k):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor]):
    if cu_seqlens_q is None:
        batch, seqlen_q, num_heads_q, _ = q.shape
        return (batch, num_heads_q, seqlen_q)
    return (q.shape[1], q.shape[0])


def _run(params: KvCacheParams, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, k=None, v=None,
         rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
         cache_leftpad=None, block_table=None, cu_seqlens_q=None, cu_seqlens_k=None,
         alibi_slopes=None, s_aux=None) -> tuple[Tensor, Tensor]:
    """The op, or its body when nothing could observe the difference (see ``_custom_ops``'
    [Note: direct eager calls])."""
    inputs = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
              cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k, alibi_slopes, s_aux)
    if _custom_ops._direct(inputs):
        return _body_with_params(params, *inputs)
    return kvcache_fwd(*inputs, *(getattr(params, name) for name in PARAM_FIELDS))


# -- checks --------------------------------------------------------------------------------

def _tensor(name: str, t, rank: int, layout) -> Tensor:
    """``t`` when it is a ``rank``-d tensor; ``layout``: its shape in words, or a function
    that spells it (only a failing call pays for the text)."""
    if not isinstance(t, torch.Tensor) or t.dim() != rank:
        layout = layout() if callable(layout) else layout
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, type(t).__name__, f"a torch.Tensor of shape {layout}")
        _fail(ValueError, name, f"a {t.dim()}-d tensor of shape {tuple(t.shape)}",
              f"a {rank}-d tensor {layout}")
    return t


def _same_device(name: str, t: Tensor, device: torch.device) -> None:
    """``t`` is on ``device``, q's."""
    if t.device != device:
        _fail(ValueError, name, f"device {t.device}", f"the device of q ({device})")


def _last_stride_one(name: str, t: Tensor) -> None:
    if t.stride(-1) != 1:
        _fail(ValueError, name, f"stride {tuple(t.stride())}",
              "a last (head-dim) stride of 1; call .contiguous() first")


def _index_vector(name: str, t, batch: int, q: Tensor, what: str) -> Optional[Tensor]:
    """None, or an int32 ``(batch,)`` tensor on q's device (made contiguous: kernels read it
    with unit stride)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (batch,):
        accepted = f"None or an int32 tensor of shape ({batch},): {what}"
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, type(t).__name__, accepted)
        if t.dtype != torch.int32:
            _fail(TypeError, name, f"dtype {t.dtype}", accepted)
        _fail(ValueError, name, f"shape {tuple(t.shape)}", accepted)
    _same_device(name, t, q.device)
    return t.contiguous()


def _unit_stride_rows(block_table):
    """The block table with a unit stride along each row (the kernels' layout)."""
    if block_table is None or block_table.stride(-1) == 1:
        return block_table
    return block_table.contiguous()


def _check_caches(q: Tensor, k_cache, v_cache, block_table, *, k_name: str, v_name: str):
    """Checks the caches and the block table against q; returns ``(capacity, paged)``."""
    layout = ("(num_blocks, page_size, heads_kv, head_dim)" if block_table is not None
              else "(batch_cache, seqlen_cache, heads_kv, head_dim)")
    _tensor(k_name, k_cache, 4, layout)
    _tensor(v_name, v_cache, 4, layout)
    device = q.device
    for name, t in ((k_name, k_cache), (v_name, v_cache)):
        if t.dtype != q.dtype:
            _fail(TypeError, name, f"dtype {t.dtype}", f"the dtype of q ({q.dtype})")
        _same_device(name, t, device)
    head_dim, heads_q = q.shape[-1], q.shape[-2]
    if k_cache.shape[-1] != head_dim:
        _fail(ValueError, k_name, f"head dim {k_cache.shape[-1]} (shape {tuple(k_cache.shape)})",
              f"the head dim of q ({head_dim})")
    heads_kv = k_cache.shape[2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        _fail(ValueError, k_name, f"{heads_kv} heads for {heads_q} query heads",
              "a number of kv heads that divides the number of query heads (GQA/MQA)")
    if block_table is not None and v_cache.shape[1] != k_cache.shape[1]:
        _fail(ValueError, v_name, f"page size {v_cache.shape[1]} (shape {tuple(v_cache.shape)})",
              f"the page size of {k_name} ({k_cache.shape[1]})")
    if v_cache.shape != k_cache.shape:
        _fail(ValueError, v_name, f"shape {tuple(v_cache.shape)}",
              f"the shape of {k_name} {tuple(k_cache.shape)}")
    for name, t in ((k_name, k_cache), (v_name, v_cache)):
        _last_stride_one(name, t)
    if block_table is None:
        return k_cache.shape[1], False
    accepted = "an int32 tensor of shape (batch, max_blocks_per_sequence)"
    if not isinstance(block_table, torch.Tensor):
        _fail(TypeError, "block_table", type(block_table).__name__, "None or " + accepted)
    if block_table.dtype != torch.int32:
        _fail(TypeError, "block_table", f"dtype {block_table.dtype}", accepted)
    if block_table.dim() != 2 or block_table.shape[1] == 0:
        _fail(ValueError, "block_table", f"shape {tuple(block_table.shape)}", accepted)
    _same_device("block_table", block_table, device)
    if k_cache.shape[1] == 0:
        _fail(ValueError, k_name, f"page size 0 (shape {tuple(k_cache.shape)})",
              "a page size (dim 1) >= 1")
    return block_table.shape[1] * k_cache.shape[1], True


def _check_rotary(rotary_cos, rotary_sin, q: Tensor, has_new: bool, capacity: int) -> None:
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        given, missing = (("rotary_cos", "rotary_sin") if rotary_sin is None
                          else ("rotary_sin", "rotary_cos"))
        _fail(ValueError, missing, "None", f"a tensor, since {given} is given")
    if not has_new:
        _fail(ValueError, "rotary_cos", "a rotary table without k and v",
              "rotary tables only together with new keys k and v (they are rotated on append)")
    head_dim = q.shape[-1]
    layout = f"(seqlen_rotary, rotary_dim / 2) with rotary_dim <= head dim {head_dim}"
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _tensor(name, t, 2, layout)
        if t.dtype not in (q.dtype, torch.float32):
            _fail(TypeError, name, f"dtype {t.dtype}", f"the dtype of q ({q.dtype}) or float32")
        _same_device(name, t, q.device)
        _last_stride_one(name, t)
    if rotary_sin.shape != rotary_cos.shape:
        _fail(ValueError, "rotary_sin", f"shape {tuple(rotary_sin.shape)}",
              f"the shape of rotary_cos {tuple(rotary_cos.shape)}")
    if not 0 < 2 * rotary_cos.shape[1] <= head_dim:
        _fail(ValueError, "rotary_cos", f"shape {tuple(rotary_cos.shape)}", layout)
    if rotary_cos.shape[0] < capacity:
        _fail(ValueError, "rotary_cos", f"{rotary_cos.shape[0]} positions",
              f"at least the cache capacity ({capacity})")


@_validate.memo_plain_scalars
def _scalars(head_dim: int, *, softmax_scale, causal, window_size, softcap, rotary_interleaved,
             num_splits, max_seqlen_q: int, max_seqlen_k: int) -> KvCacheParams:
    attn = _validate._scalar_params(head_dim, dropout_p=0.0, softmax_scale=softmax_scale,
                                    causal=causal, window_size=window_size, softcap=softcap,
                                    deterministic=False, max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k)
    rotary_interleaved = _validate.flag("rotary_interleaved", rotary_interleaved)
    num_splits = _validate._as_int("num_splits", num_splits)
    if num_splits < 0:
        _fail(ValueError, "num_splits", num_splits, "0 (chosen per call) or a count >= 1")
    return KvCacheParams(softmax_scale=attn.softmax_scale, causal=attn.causal,
                         window_left=attn.window_left, window_right=attn.window_right,
                         softcap=attn.softcap, rotary_interleaved=rotary_interleaved,
                         num_splits=num_splits, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k)


def _check_query(q, rank: int, layout: str) -> None:
    _tensor("q", q, rank, layout)
    if q.dtype not in _validate.SUPPORTED_DTYPES:
        _fail(TypeError, "q", f"dtype {q.dtype}", "torch.float16 or torch.bfloat16")
    head_dim = q.shape[-1]
    if (head_dim % _validate.HEAD_DIM_MULTIPLE != 0
            or not 0 < head_dim <= _validate.MAX_HEAD_DIM):
        _fail(ValueError, "q", f"head dim {head_dim}",
              f"a multiple of {_validate.HEAD_DIM_MULTIPLE} in "
              f"[{_validate.HEAD_DIM_MULTIPLE}, {_validate.MAX_HEAD_DIM}]")
    _last_stride_one("q", q)


def _check_new(k, v, q: Tensor, k_cache: Tensor) -> int:
    """Checks the new keys/values; returns their count per sequence (0 without them)."""
    if k is None and v is None:
        return 0
    if k is None or v is None:
        given, missing = ("k", "v") if v is None else ("v", "k")
        _fail(ValueError, missing, "None", f"a tensor, since {given} is given (new keys and "
              "values are appended together)")
    batch, heads_kv, head_dim = q.shape[0], k_cache.shape[2], q.shape[-1]

    def layout():
        return f"(batch={batch}, seqlen_new, heads_kv={heads_kv}, head_dim={head_dim})"

    device = q.device
    for name, t in (("k", k), ("v", v)):
        _tensor(name, t, 4, layout)
        if t.dtype != q.dtype:
            _fail(TypeError, name, f"dtype {t.dtype}", f"the dtype of q ({q.dtype})")
        _same_device(name, t, device)
        if (t.shape[0], t.shape[2], t.shape[3]) != (batch, heads_kv, head_dim):
            _fail(ValueError, name, f"shape {tuple(t.shape)}", layout())
        _last_stride_one(name, t)
    if v.shape != k.shape:
        _fail(ValueError, "v", f"shape {tuple(v.shape)}", f"the shape of k {tuple(k.shape)}")
    return k.shape[1]


def _seqlens_tensor(cache_seqlens, q: Tensor, capacity: int) -> Tensor:
    """``cache_seqlens`` (checked by :func:`_check_call`) as the int32 ``(B,)`` tensor the
    kernels read; None means every sequence fills the cache."""
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens.contiguous()
    value = capacity if cache_seqlens is None else _validate._as_int("cache_seqlens",
                                                                      cache_seqlens)
    return torch.full((q.shape[0],), value, dtype=torch.int32, device=q.device)


@dataclasses.dataclass(frozen=True)
class _Call:
    """What the metadata checks of one ``flash_attn_with_kvcache`` call derive."""
    capacity: int  # keys a sequence can hold
    paged: bool
    seqlen_new: int  # new keys per sequence (0 without k/v)
    params: KvCacheParams
    return_lse: bool


def _check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, alibi_slopes, s_aux, softmax_scale,
                causal, window_size, softcap, rotary_interleaved, num_splits,
                return_softmax_lse) -> _Call:
    """Every check of a ``flash_attn_with_kvcache`` call that reads no tensor value: raises
    an error naming the argument, else returns what the call derives from its metadata."""
    _check_query(q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    capacity, paged = _check_caches(q, k_cache, v_cache, block_table, k_name="k_cache",
                                    v_name="v_cache")
    batch = q.shape[0]
    if paged and block_table.shape[0] != batch:
        _fail(ValueError, "block_table", f"{block_table.shape[0]} rows",
              f"one row per sequence of q ({batch})")
    seqlen_new = _check_new(k, v, q, k_cache)
    _check_rotary(rotary_cos, rotary_sin, q, k is not None, capacity)
    if isinstance(cache_seqlens, torch.Tensor):
        _index_vector("cache_seqlens", cache_seqlens, batch, q,
                      "each sequence's cached length before the new keys")
    elif cache_seqlens is not None:
        _validate._as_int("cache_seqlens", cache_seqlens)
    if cache_batch_idx is not None and paged:
        _fail(ValueError, "cache_batch_idx", "a tensor together with block_table",
              "None with a paged cache (block_table's rows select each sequence's blocks)")
    _index_vector("cache_batch_idx", cache_batch_idx, batch, q, "each sequence's row of the cache")
    _index_vector("cache_leftpad", cache_leftpad, batch, q, "each sequence's first cache position")
    if not paged and cache_batch_idx is None and k_cache.shape[0] < batch:
        _fail(ValueError, "k_cache", f"{k_cache.shape[0]} cache rows",
              f"at least one per sequence of q ({batch}), or cache_batch_idx")
    params = _scalars(q.shape[-1], softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap,
                      rotary_interleaved=rotary_interleaved,
                      num_splits=num_splits, max_seqlen_q=q.shape[1], max_seqlen_k=capacity)
    return_lse = _validate.flag("return_softmax_lse", return_softmax_lse)
    _validate._check_s_aux(s_aux, q)
    _validate._check_alibi(alibi_slopes, q, batch)
    return _Call(capacity=capacity, paged=paged, seqlen_new=seqlen_new, params=params,
                 return_lse=return_lse)


# [Note: call memo] A decode loop repeats one call: the same shapes, strides, dtypes and devices,
# the same scalars, new values. :func:`_check_call` reads only the former, and its ~30 Python
# frames were about half of the Python layer's time per call (CPU, GQA 32/8 decode: ~23 of
# ~48 us). A call whose tensors are all exactly ``torch.Tensor`` (or None; ``cache_seqlens``
# may also be a plain int, whose value only the value checks read) and whose scalars are plain
# (``_validate._plain_key``) reuses the ``_Call`` of an earlier call with the same key; anything
# else, and every call inside a torch.compile trace, is checked in full. A call that fails its
# checks is never stored, so every bad input still raises, every time. The conversions
# (contiguous index vectors, float32 sinks, the int ``cache_seqlens`` as a tensor) and the
# value checks run on every call.
_calls: dict = {}
_MAX_CALLS = 512
_SEQLENS_SLOT = 7  # cache_seqlens' position in the key's tensors
_PLAIN_TENSORS = frozenset((Tensor, type(None)))  # exactly: no subclass


def _call_key(tensors: tuple, scalars: tuple):
    """The memo key of a call ([Note: call memo]), or None when it must be checked in full."""
    if _validate._compiling():
        return None
    kinds = tuple(map(type, tensors))  # which slots are None fixes which ones are tensors
    if not _PLAIN_TENSORS.issuperset(kinds) and not (
            kinds[_SEQLENS_SLOT] is int
            and _PLAIN_TENSORS.issuperset(kinds[:_SEQLENS_SLOT] + kinds[_SEQLENS_SLOT + 1:])):
        return None
    plain = _validate._plain_key(scalars)
    if plain is None:
        return None
    return kinds, tuple([(t.shape, t.stride(), t.dtype, t.device)
                         for t in tensors if type(t) is Tensor]), plain


def _checked_call(tensors: tuple, scalars: tuple, key) -> _Call:
    """:func:`_check_call` of ``tensors`` and ``scalars``, memoised under ``key`` (their
    :func:`_call_key`; [Note: call memo])."""
    call = None if key is None else _calls.get(key)
    if call is None:
        call = _check_call(*tensors, *scalars)
        if key is not None:
            if len(_calls) >= _MAX_CALLS:
                _calls.clear()
            _calls[key] = call
    return call


# [Note: lanes] A call shape whose checked call ran on a backend that can repeat its launches
# (``_triton.kvcache``'s [Note: kv-cache lane]) keeps that backend's lane under its call key.
# The next call with that key goes through the lane instead of the checks' conversions, the
# dispatch, the op and the backend's launch path, when nothing they read differs:
#
# * the call memo's own conditions (plain tensors and scalars, not compiling: the key exists);
# * the environment variables the full path reads (backend choice, value checks, poisoned
#   outputs), as they were when the lane was made;
# * no torch-function or dispatch mode and no functorch transform (``_custom_ops._direct``).
#
# Where the full path would check values (``_kvcache_values``' [Note: value checks]: an eager
# call, unless ``FLASH_ATTN_HUB_CHECK_VALUES=0``), the lane runs the same checks on the same
# tensors first, so a bad value raises before any launch either way.
#
# A lane is made only when every conversion of the full path was a no-op for the call
# (``cache_seqlens`` a tensor, index vectors contiguous, float32 sinks, unit-stride table
# rows), which the key's dtypes, shapes and strides then fix for every call with that key.
# What the launches read besides (device, Triton's state, alignment) the lane checks itself,
# returning None when the call must take the full path. ``_lanes[key]`` is ``(environment,
# whether values are checked, the call's checked metadata, lane)``. A call under another
# environment than its lane's takes the full path, which then replaces the lane with one made
# under the environment of now: a loop that sets a variable after its first steps (value
# checks off once the first step has passed them, say) gets a lane again on its next call.
_lanes: dict = {}
_LANE_DEVICES = ("cuda",)
_LANE_ENV = (_dispatch.ENV_BACKEND, ENV_CHECK_VALUES, _custom_ops.ENV_POISON)


# [Note: reading the environment] ``os.environ.get`` of an unset variable raises and catches a
# KeyError inside ``os._Environ`` (~0.9 us a variable), a tenth of a lane's Python time for
# three variables. CPython's ``os.environ`` keeps its values in the dict ``_data`` under
# encoded keys, and every change through ``os.environ`` (what ``putenv`` callers and pytest's
# monkeypatch use) updates that dict in place, so the lane reads the raw values there. Should
# ``os.environ`` be another object (replaced, or another Python), the lane reads it through
# ``get``; a variable set reads as bytes one way and as str the other, which never compare
# equal, so a lane made under one and called under the other takes the full path (correct,
# only slower).
def _environment_reader():
    environ = os.environ
    data, encode = getattr(environ, "_data", None), getattr(environ, "encodekey", None)
    if type(data) is not dict or not callable(encode):
        return lambda: tuple(map(os.environ.get, _LANE_ENV))
    keys = tuple(map(encode, _LANE_ENV))

    def environment() -> tuple:
        if os.environ is not environ:
            return tuple(map(os.environ.get, _LANE_ENV))
        return tuple(map(data.get, keys))

    return environment


_environment = _environment_reader()


# Whether a CUDA graph is being captured on the current stream (never, on a build without CUDA).
_capturing = (torch.cuda.is_current_stream_capturing if torch.backends.cuda.is_built()
              else (lambda: False))


def _keep_lane(key, tensors: tuple, converted: tuple, call: _Call, out: Tensor,
               lse: Tensor) -> None:
    """Makes and keeps the lane of a call that has just run ([Note: lanes]), unless its key
    holds one made under the same environment."""
    if key is None:
        return
    held = _lanes.get(key)
    if (held is not None and held[0] == _environment()
            or tensors[0].device.type not in _LANE_DEVICES
            or any(a is not b for a, b in zip(tensors, converted))
            or not _custom_ops._direct(tensors)):
        return
    make = _dispatch.select_kvcache_lane(tensors[0])
    if make is None:
        return
    (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
     cache_leftpad, block_table, alibi_slopes, s_aux) = tensors
    lane = make(q, k_cache, v_cache, out, lse, k=k, v=v, rotary_cos=rotary_cos,
                rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                block_table=block_table, alibi_slopes=alibi_slopes, s_aux=s_aux,
                params=call.params, poison=os.environ.get(_custom_ops.ENV_POISON) == "1",
                return_lse=call.return_lse)
    if lane is not None:
        if held is None and len(_lanes) >= _MAX_CALLS:
            _lanes.clear()
        _lanes[key] = (_environment(),
                       os.environ.get(ENV_CHECK_VALUES) != "0",  # whether values are checked
                       call, lane)


def _check_call_values(call: _Call, tensors: tuple, gated: bool = False) -> None:
    """:func:`_check_cache_values` of a checked call's converted tensors (in the entry point's
    order). A lane's caller passes its own tensors: a lane is made only where the conversions
    are no-ops."""
    (q, k_cache, _, _, _, _, _, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
     _, _) = tensors
    _check_cache_values(batch=q.shape[0], seqlen_new=call.seqlen_new, capacity=call.capacity,
                        cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                        cache_batch_idx=cache_batch_idx, batch_cache=k_cache.shape[0],
                        block_table=block_table, page_size=k_cache.shape[1],
                        num_blocks=k_cache.shape[0], gated=gated)


# -- entry points --------------------------------------------------------------------------

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, s_aux=None):
    """Attention of new queries over a KV cache, after appending new keys/values to it in place
    (incremental decoding, speculative/multi-token decoding, chunked prefill). Forward only.

    Args:
        q: ``(batch, seqlen_q, num_heads_q, head_dim)``, float16 or bfloat16.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, num_heads_kv, head_dim)``, or with
            ``block_table`` a paged cache ``(num_blocks, page_size, num_heads_kv, head_dim)``
            (any page size >= 1). Written in place when ``k``/``v`` are given.
        k, v: optional new keys/values ``(batch, seqlen_new, num_heads_kv, head_dim)``,
            written at cache positions ``cache_seqlens .. cache_seqlens + seqlen_new - 1``
            (after rotary) before attending.
        rotary_cos, rotary_sin: optional ``(seqlen_rotary, rotary_dim / 2)`` tables (q's dtype
            or float32, ``seqlen_rotary`` at least the cache capacity; only with ``k``/``v``).
            New key ``j`` is rotated at position ``cache_seqlens + j``; query row ``i`` at
            ``cache_seqlens + i`` when causal or local, else every row at ``cache_seqlens``.
            Pairs are ``(2i, 2i + 1)`` when ``rotary_interleaved``, else
            ``(i, i + rotary_dim / 2)`` (GPT-NeoX); dims past ``rotary_dim`` are unchanged.
            Rotation is computed in float32 and rounded to q's dtype.
        cache_seqlens: int or int32 ``(batch,)``: each sequence's cached length before the new
            keys; -1 marks a padding slot (nothing appended, no key seen). None means the
            whole cache (then there is no room for new keys).
        cache_batch_idx: optional int32 ``(batch,)``: the cache row of each sequence
            (contiguous caches only; a paged cache is indexed by ``block_table``'s rows).
        cache_leftpad: optional int32 ``(batch,)``: the first cache position of each sequence.
        block_table: optional int32 ``(batch, max_blocks)``: the blocks of each sequence, in
            order; entries past a sequence's last used page may be -1.
        softmax_scale, causal, window_size, softcap, alibi_slopes, s_aux: as in
            ``flash_attn_func``; causal and the window are aligned bottom-right on each
            sequence's key count ``cache_seqlens - cache_leftpad + seqlen_new``.
        num_splits: key splits per (sequence, kv head): 0 chooses from the batch, the heads,
            the cache capacity and the GPU's SM count; 1 never splits. Splits are combined in a
            fixed order, so results do not depend on timing.
        return_softmax_lse: also return ``softmax_lse``.

    Returns:
        ``out`` ``(batch, seqlen_q, num_heads_q, head_dim)`` (contiguous), or ``(out,
        softmax_lse)`` with ``softmax_lse`` float32 ``(batch, num_heads_q, seqlen_q)``.

    Value checks (lengths against the capacity, block-table entries in range) run on CPU
    tensors and on eager CUDA calls; CUDA-graph capture skips them (module notes).
    """
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
               cache_batch_idx, cache_leftpad, block_table, alibi_slopes, s_aux)
    scalars = (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
               return_softmax_lse)
    key = _call_key(tensors, scalars)
    held = None if key is None else _lanes.get(key)
    if (held is not None and _environment() == held[0]  # [Note: lanes]
            and not _custom_ops._modes_or_transforms_active()):
        if held[1] and not _capturing():
            _check_call_values(held[2], tensors, gated=True)
        result = held[3](*tensors)
        if result is not None:
            return result if scalars[-1] else result[0]  # return_softmax_lse, plain (the key)
    call = _checked_call(tensors, scalars, key)
    block_table = _unit_stride_rows(block_table)
    cache_seqlens = _seqlens_tensor(cache_seqlens, q, call.capacity)
    cache_batch_idx = None if cache_batch_idx is None else cache_batch_idx.contiguous()
    cache_leftpad = None if cache_leftpad is None else cache_leftpad.contiguous()
    s_aux = _validate.sinks_float32(s_aux)
    alibi_slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
    converted = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, s_aux)
    _check_call_values(call, converted)
    out, lse = _run(call.params, q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos,
                    rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                    cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                    block_table=block_table, alibi_slopes=alibi_slopes, s_aux=s_aux)
    if key is not None:
        _keep_lane(key, tensors, converted, call, out, lse)
    return (out, lse) if call.return_lse else out


def paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 block_table, dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, deterministic, return_attn_probs, s_aux):
    """``flash_attn_varlen_func`` with ``block_table``: k/v are paged caches
    ``(num_blocks, page_size, Hkv, D)`` and sequence ``b`` has ``cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]`` keys at positions ``0..`` of its pages. Forward only."""
    _check_query(q, 3, "(total_tokens, heads_q, head_dim)")
    capacity, _ = _check_caches(q, k_cache, v_cache, block_table, k_name="k", v_name="v")
    accepted = "an int32 tensor of shape (batch + 1,)"
    if not isinstance(cu_seqlens_q, torch.Tensor):
        _fail(TypeError, "cu_seqlens_q", type(cu_seqlens_q).__name__, accepted)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
        _fail(ValueError, "cu_seqlens_q", f"shape {tuple(cu_seqlens_q.shape)}", accepted)
    batch = cu_seqlens_q.shape[0] - 1
    cu_seqlens_q = _index_vector("cu_seqlens_q", cu_seqlens_q, batch + 1, q,
                                 "cumulative query counts, one entry per sequence + 1")
    cu_seqlens_k = _index_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, q,
                                 "cumulative key counts, one entry per sequence + 1")
    if block_table.shape[0] != batch:
        _fail(ValueError, "block_table", f"{block_table.shape[0]} rows",
              f"one row per sequence ({batch}, from cu_seqlens_q)")
    block_table = _unit_stride_rows(block_table)
    max_q = _validate._max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _validate._max_seqlen("max_seqlen_k", max_seqlen_k)
    dropout_p = _validate._as_float("dropout_p", dropout_p)
    if dropout_p != 0.0:
        _fail(ValueError, "dropout_p", dropout_p, "0.0 with block_table (paged attention has "
              "no dropout)")
    _validate.flag("deterministic", deterministic)
    return_attn_probs = _validate.flag("return_attn_probs", return_attn_probs)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k_cache, v_cache, s_aux)):
        _fail(ValueError, "block_table", "a paged call on tensors that require grad",
              "no gradient: paged attention is forward only (run it under torch.no_grad())")
    params = _scalars(q.shape[-1], softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, rotary_interleaved=True,
                      num_splits=0,
                      max_seqlen_q=max_q, max_seqlen_k=min(max_k, capacity))
    s_aux = _validate._check_s_aux(s_aux, q)
    alibi_slopes = _validate._check_alibi(alibi_slopes, q, batch)
    if _checking_values(cu_seqlens_q, cu_seqlens_k, block_table):
        values_q = _validate._check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q)
        _validate._check_longest("max_seqlen_q", values_q, max_q)
        _check_paged_varlen_values(cu_seqlens_k, block_table, max_k=max_k, capacity=capacity,
                                   page_size=k_cache.shape[1], num_blocks=k_cache.shape[0])
    out, lse = _run(params, q, k_cache, v_cache, block_table=block_table,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    alibi_slopes=alibi_slopes, s_aux=s_aux)
    return (out, lse, None) if return_attn_probs else out
