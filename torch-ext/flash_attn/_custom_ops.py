"""The package's two PyTorch operators, their fakes and their autograd formula.

Layers (STYLE.md): backend ``forward``/``backward`` (destination-passing, chosen by
``_dispatch``) <- the custom ops ``fwd``/``bwd`` below, which allocate the outputs and call the
backend <- :func:`attention`, the allocating function the public API calls <- the autograd
formula registered on ``fwd``, which calls ``bwd``.

The ops take :class:`AttnParams` flattened into plain ints/floats/bools (a custom op's schema
cannot hold a dataclass), in the dataclass's field order, after the tensors.

Outputs come from :func:`_new_output`: uninitialised memory, or NaN when the environment variable
``FLASH_ATTN_HUB_POISON=1`` is set (tests set it), so an element a backend fails to write shows
up as NaN instead of a plausible stale value.
"""

import dataclasses
import math
import os
from typing import Optional

import torch
from torch import Tensor

from . import _dispatch
from ._ops import add_op_namespace_prefix
from ._params import AttnParams

ENV_POISON = "FLASH_ATTN_HUB_POISON"
PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(AttnParams))
FWD_TENSORS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "s_aux", "alibi_slopes")
BWD_TENSORS = ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "s_aux",
               "alibi_slopes")


def _new_output(shape, dtype, device) -> Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get(ENV_POISON) == "1":
        t.fill_(math.nan)
    return t


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor]):
    if cu_seqlens_q is None:
        batch, seqlen_q, num_heads_q, _ = q.shape
        return (batch, num_heads_q, seqlen_q)
    total_q, num_heads_q, _ = q.shape
    return (num_heads_q, total_q)


def _params(softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed,
            deterministic, max_seqlen_q, max_seqlen_k) -> AttnParams:
    return AttnParams(softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                      window_right=window_right, softcap=softcap, dropout_p=dropout_p, seed=seed,
                      deterministic=deterministic, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k)


def _select(direction, q, k, cu_seqlens_q, s_aux, alibi_slopes, params):
    return _dispatch.select_backend(direction, q, k, params, varlen=cu_seqlens_q is not None,
                                    alibi=alibi_slopes is not None, sink=s_aux is not None)


@torch.library.custom_op(add_op_namespace_prefix("fwd"), mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
        cu_seqlens_k: Optional[Tensor], s_aux: Optional[Tensor], alibi_slopes: Optional[Tensor],
        softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
        dropout_p: float, seed: int, deterministic: bool, max_seqlen_q: int,
        max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    """Attention forward: ``(out, lse)``; out contiguous like q, lse float32."""
    params = _params(softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed,
                     deterministic, max_seqlen_q, max_seqlen_k)
    out = _new_output(q.shape, q.dtype, q.device)
    lse = _new_output(_lse_shape(q, cu_seqlens_q), torch.float32, q.device)
    if q.numel() == 0:
        return out, lse
    backend = _select("forward", q, k, cu_seqlens_q, s_aux, alibi_slopes, params)
    backend.forward(q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    s_aux=s_aux, alibi_slopes=alibi_slopes, params=params)
    return out, lse


@torch.library.register_fake(add_op_namespace_prefix("fwd"))
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes, softmax_scale, causal,
              window_left, window_right, softcap, dropout_p, seed, deterministic, max_seqlen_q,
              max_seqlen_k):
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op(add_op_namespace_prefix("bwd"), mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], s_aux: Optional[Tensor],
        alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, dropout_p: float, seed: int, deterministic: bool,
        max_seqlen_q: int, max_seqlen_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Attention backward: ``(dq, dk, dv, ds_aux)``, contiguous, in q's dtype; ``ds_aux`` is
    float32 ``(Hq,)``, or empty ``(0,)`` when there is no sink."""
    params = _params(softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed,
                     deterministic, max_seqlen_q, max_seqlen_k)
    dq = _new_output(q.shape, q.dtype, q.device)
    dk = _new_output(k.shape, q.dtype, q.device)
    dv = _new_output(v.shape, q.dtype, q.device)
    ds_aux = _new_output((0,) if s_aux is None else s_aux.shape, torch.float32, q.device)
    if q.numel() == 0:
        for grad in (dq, dk, dv, ds_aux):
            grad.zero_()
        return dq, dk, dv, ds_aux
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    backend = _select("backward", q, k, cu_seqlens_q, s_aux, alibi_slopes, params)
    backend.backward(dout, q, k, v, out, lse, dq, dk, dv, None if s_aux is None else ds_aux,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, s_aux=s_aux,
                     alibi_slopes=alibi_slopes, params=params)
    return dq, dk, dv, ds_aux


@torch.library.register_fake(add_op_namespace_prefix("bwd"))
def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
              softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed,
              deterministic, max_seqlen_q, max_seqlen_k):
    ds_aux_shape = (0,) if s_aux is None else s_aux.shape
    return (q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape),
            q.new_empty(ds_aux_shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    named = dict(zip(FWD_TENSORS + PARAM_FIELDS, inputs))
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(*(named[name] for name in FWD_TENSORS), out, lse)
    ctx.param_values = tuple(named[name] for name in PARAM_FIELDS)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes, out, lse = ctx.saved_tensors
    dq, dk, dv, ds_aux = bwd(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, s_aux,
                             alibi_slopes, *ctx.param_values)
    grads = {"q": dq, "k": dk, "v": dv, "s_aux": None if s_aux is None else ds_aux}
    return tuple(grads.get(name) for name in FWD_TENSORS) + (None,) * len(PARAM_FIELDS)


torch.library.register_autograd(add_op_namespace_prefix("fwd"), _backward,
                                setup_context=_setup_context)


def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
              params: AttnParams):
    """``(out, lse)`` for validated inputs: the allocating, differentiable entry point."""
    param_values = tuple(getattr(params, name) for name in PARAM_FIELDS)
    return fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes, *param_values)
