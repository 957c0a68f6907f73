"""``flash_attn.flash_attn_interface`` as flash-attn 2.8.3 lays it out: the public functions,
and the private forward/backward wrappers that libraries call directly to build their own
autograd (diffusers' context-parallel attention reads ``flash_attn_interface.
_wrapped_flash_attn_forward`` / ``_wrapped_flash_attn_backward`` off a Hub kernel).

The wrappers keep flash-attn 2.8.3's signatures and results:

* :func:`_flash_attn_forward` returns ``(out, softmax_lse, S_dmask, rng_state)`` and records no
  autograd graph;
* :func:`_flash_attn_backward` writes the gradients into the ``dq``, ``dk``, ``dv`` it is given
  and returns ``softmax_d``;

with these differences, each a superset of what flash-attn 2 accepts:

* any head dim in ``[1, 256]`` (padded for the kernels as the public API does; ``out`` and the
  gradients are the caller's width);
* ``rng_state`` is ``int64 (2,)`` ``[dropout seed, 0]``; the backward of a dropout forward needs
  it (flash-attn 2 would silently draw a new mask without it; here it is a ValueError);
* ``S_dmask`` is empty unless ``return_softmax`` and dropout are both on; then it is the matrix
  of ``_attn_probs`` (exact probabilities, dropped entries negated, shape ``(B, Hq, Sq, Sk)``
  where flash-attn 2 rounds the last two sizes up to multiples of 128) when it has at most
  ``_attn_probs.MAX_ELEMENTS`` entries, else an empty tensor and a warning on the
  ``flash_attn`` logger (diffusers passes ``return_lse`` in this slot, with a tiny dropout, and
  never reads the matrix);
* ``softmax_lse`` of a row that sees no key is ``+inf`` as in flash-attn 2; the backward accepts
  ``+inf`` or ``-inf`` there;
* ``softmax_d`` (the row sums of ``dout * out``) is ``(B, Hq, Sq)``, without flash-attn 2's
  padding of ``Sq`` to a multiple of 128.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from . import _attn_probs, _custom_ops, _validate
from .interface import (_with_seed, flash_attn_func, flash_attn_kvpacked_func,
                        flash_attn_qkvpacked_func, flash_attn_varlen_func,
                        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                        head_dim_padding, kernel_layout, public_lse)
from .kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]

logger = logging.getLogger("flash_attn")


def _params(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
            softcap, alibi_slopes, deterministic):
    params, _, alibi_slopes = _validate.batched(
        q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_size_left, window_size_right), softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, s_aux=None)
    return params, alibi_slopes


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax):
    """flash-attn 2's low-level forward on batched q ``(B, Sq, Hq, D)``, k/v
    ``(B, Sk, Hkv, D)``: ``(out, softmax_lse, S_dmask, rng_state)``, no autograd graph."""
    params, alibi_slopes = _params(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                                   window_size_right, softcap, alibi_slopes, False)
    return_softmax = _validate.flag("return_softmax", return_softmax)
    head_dim = q.shape[-1]
    pad = head_dim_padding(head_dim)
    params = _with_seed(params)
    with torch.no_grad():
        q, k, v = (kernel_layout(t, pad) for t in (q, k, v))
        out, lse = _custom_ops.attention(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None,
                                         s_aux=None, alibi_slopes=alibi_slopes, params=params)
        s_dmask = q.new_empty((0,))
        if return_softmax and params.dropout_p > 0:
            if _attn_probs.fits(q, k, None, params):
                s_dmask = _attn_probs.dropout_encoded(q, k, lse, cu_seqlens_q=None,
                                                      cu_seqlens_k=None,
                                                      alibi_slopes=alibi_slopes, params=params)
            else:
                logger.warning(
                    "flash_attn _flash_attn_forward: return_softmax=True asks for a %d-entry "
                    "S_dmask, over the %d-entry limit; returning an empty S_dmask",
                    _attn_probs.num_elements(q, k, None, params), _attn_probs.MAX_ELEMENTS)
        rng_state = torch.tensor([params.seed, 0], dtype=torch.int64, device=q.device)
    if pad:
        out = out[..., :head_dim].contiguous()
    return out, public_lse(lse), s_dmask, rng_state


def _check_like(name: str, t, like: torch.Tensor, like_name: str, *, optional=False):
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        _validate._fail(TypeError, name, type(t).__name__,
                        f"a tensor shaped like {like_name} {tuple(like.shape)}")
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        _validate._fail(ValueError, name, _validate._describe(t),
                        f"the shape, dtype and device of {like_name} ({_validate._describe(like)})")


def _seed_of(rng_state, params):
    if params.dropout_p == 0:
        return params
    if not isinstance(rng_state, torch.Tensor) or rng_state.numel() < 1 or (
            rng_state.dtype != torch.int64):
        _validate._fail(ValueError, "rng_state", repr(rng_state) if rng_state is None else
                        _validate._describe(rng_state),
                        "the int64 rng_state _flash_attn_forward returned (dropout_p > 0)")
    return dataclasses.replace(params, seed=int(rng_state.reshape(-1)[0]))


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left, window_size_right, softcap, alibi_slopes,
                         deterministic, rng_state=None):
    """flash-attn 2's low-level backward: writes the gradients into ``dq``, ``dk``, ``dv``
    (each may be None, then that gradient is dropped) and returns ``softmax_d`` float32
    ``(B, Hq, Sq)``, the row sums of ``dout * out``."""
    params, alibi_slopes = _params(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                                   window_size_right, softcap, alibi_slopes, deterministic)
    _check_like("dout", dout, q, "q")
    _check_like("out", out, q, "q")
    for name, grad, like, like_name in (("dq", dq, q, "q"), ("dk", dk, k, "k"),
                                        ("dv", dv, v, "v")):
        _check_like(name, grad, like, like_name, optional=True)
    batch, seqlen_q, num_heads_q, head_dim = q.shape
    lse_shape = (batch, num_heads_q, seqlen_q)
    if not isinstance(softmax_lse, torch.Tensor) or tuple(softmax_lse.shape) != lse_shape or (
            softmax_lse.dtype != torch.float32):
        _validate._fail(ValueError, "softmax_lse", repr(softmax_lse) if not isinstance(
            softmax_lse, torch.Tensor) else _validate._describe(softmax_lse),
            f"float32 of shape {lse_shape}")
    params = _seed_of(rng_state, params)
    pad = head_dim_padding(head_dim)
    with torch.no_grad():
        tensors = [kernel_layout(t, pad) for t in (dout, q, k, v, out)]
        lse = softmax_lse.masked_fill(softmax_lse == math.inf, -math.inf)
        grads = _custom_ops.gradients(*tensors[:5], lse, cu_seqlens_q=None, cu_seqlens_k=None,
                                      s_aux=None, alibi_slopes=alibi_slopes, params=params)
        for dst, grad in zip((dq, dk, dv), grads):
            if dst is not None:
                dst.copy_(grad[..., :head_dim])
        softmax_d = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    return softmax_d


# The names flash-attn 2 gives its torch.library-wrapped versions of the same functions.
_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_backward = _flash_attn_backward
