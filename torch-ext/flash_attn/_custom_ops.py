"""The package's two PyTorch operators, their fakes and their autograd formula.

Layers (STYLE.md): backend ``forward``/``backward`` (destination-passing, chosen by
``_dispatch``) <- the custom ops ``fwd``/``bwd`` below, which allocate the outputs and call the
backend <- :func:`attention`, the allocating function the public API calls <- the autograd
formula registered on ``fwd``, which calls ``bwd``. :func:`gradients` runs ``bwd`` alone, for
``flash_attn_interface``'s low-level backward, which callers drive from their own autograd.

The ops take :class:`AttnParams` flattened into plain ints/floats/bools (a custom op's schema
cannot hold a dataclass), in the dataclass's field order, after the tensors.

[Note: direct eager calls] The custom ops are what torch.compile, export, fake tensors, modes
and functorch transforms see. A plain eager call does not need them, and their Python dispatch
(boxing 17 arguments through the dispatcher twice, the autograd wrapper, the aliasing check)
cost more host time than the rest of a call: on the H200 host, ~96 us per forward against
SDPA's ~35. :func:`attention` therefore calls the op bodies directly when nothing could observe
the difference (:func:`_direct`: not compiling, plain ``torch.Tensor`` inputs, no torch-function
or dispatch mode, no functorch transform), through :class:`_Attention` when autograd records
the call. Both routes run the same bodies and the same gradient formula (:func:`_gradients`).

Outputs come from :func:`_new_output`: uninitialised memory, or NaN when the environment variable
``FLASH_ATTN_HUB_POISON=1`` is set (tests set it), so an element a backend fails to write shows
up as NaN instead of a plausible stale value.
"""

import contextlib
import dataclasses
import math
import os
from typing import Optional

import torch
from torch import Tensor

from . import _dispatch, _validate
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


# [Note: the launching device] Triton launches a kernel on the current CUDA device and its
# current stream, whatever device the tensors are on. A model spread over several GPUs
# (transformers' ``device_map="auto"``) calls layers on ``cuda:1`` while ``cuda:0`` stays
# current, so every backend runs inside :func:`_on_device_of`, which makes the tensors' device
# current for the call (as the compiled ops' own device guard does).
_NO_GUARD = contextlib.nullcontext()


def _on_device_of(t: Tensor):
    """A context in which ``t``'s CUDA device is the current one ([Note: the launching
    device])."""
    device = t.device
    index = device.index
    if index is None or device.type != "cuda" or index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(index)


# [Note: rows past the last sequence] A varlen call may hand q (k, v) more rows than its last
# cu_seqlens entry covers: transformers' continuous batching pads its batches to a fixed token
# count so one CUDA graph serves every step, as flash-attn 2 allows. No sequence owns those
# rows, so no backend writes them: here they become rows that see no key (out 0, lse -inf
# before the public conversion) and their gradients 0. Eager calls read the last entry from the
# validation's host copy (no extra sync) and clear nothing when the rows are all owned; inside
# a compile trace or a CUDA-graph capture the value is unknown and a device-side mask clears
# the tail.
def _clear_rows_past(cu: Optional[Tensor], pairs) -> None:
    """Fills rows ``>= cu[-1]`` (dim ``dim``) of each ``(tensor, dim, value)`` in place."""
    if cu is None:
        return
    rows = pairs[0][0].shape[pairs[0][1]]
    if not (torch.compiler.is_compiling() or _validate.capturing(cu)):
        last = _validate.host_values(cu)[-1]
        if last >= rows:
            return
        for t, dim, value in pairs:
            t.narrow(dim, last, rows - last).fill_(value)
        return
    past = torch.arange(rows, device=cu.device) >= cu[-1]
    for t, dim, value in pairs:
        shape = [1] * t.dim()
        shape[dim] = rows
        t.masked_fill_(past.view(shape), value)


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


def _select(direction, q, k, v, cu_seqlens_q, s_aux, alibi_slopes, params, dout=None):
    return _dispatch.select_backend(direction, q, k, v, params, dout=dout,
                                    varlen=cu_seqlens_q is not None,
                                    alibi=alibi_slopes is not None, sink=s_aux is not None)


def _fwd_body(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
              cu_seqlens_k: Optional[Tensor], s_aux: Optional[Tensor],
              alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
              window_left: int, window_right: int, softcap: float, dropout_p: float, seed: int,
              deterministic: bool, max_seqlen_q: int, max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    """Attention forward: ``(out, lse)``; out contiguous like q, lse float32."""
    params = _params(softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed,
                     deterministic, max_seqlen_q, max_seqlen_k)
    out = _new_output(q.shape, q.dtype, q.device)
    lse = _new_output(_lse_shape(q, cu_seqlens_q), torch.float32, q.device)
    if q.numel() == 0:
        return out, lse
    forward = _select("forward", q, k, v, cu_seqlens_q, s_aux, alibi_slopes, params)
    with _on_device_of(q):
        forward(q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                s_aux=s_aux, alibi_slopes=alibi_slopes, params=params)
    _clear_rows_past(cu_seqlens_q, [(out, 0, 0.0), (lse, 1, -math.inf)])
    return out, lse


fwd = torch.library.custom_op(add_op_namespace_prefix("fwd"), mutates_args=())(_fwd_body)


@torch.library.register_fake(add_op_namespace_prefix("fwd"))
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes, softmax_scale, causal,
              window_left, window_right, softcap, dropout_p, seed, deterministic, max_seqlen_q,
              max_seqlen_k):
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    return out, lse


def _bwd_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
              s_aux: Optional[Tensor], alibi_slopes: Optional[Tensor], softmax_scale: float,
              causal: bool, window_left: int, window_right: int, softcap: float,
              dropout_p: float, seed: int, deterministic: bool, max_seqlen_q: int,
              max_seqlen_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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
    backward = _select("backward", q, k, v, cu_seqlens_q, s_aux, alibi_slopes, params, dout)
    with _on_device_of(q):
        backward(dout, q, k, v, out, lse, dq, dk, dv, None if s_aux is None else ds_aux,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, s_aux=s_aux,
                 alibi_slopes=alibi_slopes, params=params)
    _clear_rows_past(cu_seqlens_q, [(dq, 0, 0.0)])
    _clear_rows_past(cu_seqlens_k, [(dk, 0, 0.0), (dv, 0, 0.0)])
    return dq, dk, dv, ds_aux


bwd = torch.library.custom_op(add_op_namespace_prefix("bwd"), mutates_args=())(_bwd_body)


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


def _gradients(saved, param_values, grad_out, bwd_fn):
    """The gradients of ``fwd``'s inputs, in its argument order (None for the non-tensor and
    non-differentiable ones); ``bwd_fn`` is the ``bwd`` op or its body."""
    q, k, v, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes, out, lse = saved
    dq, dk, dv, ds_aux = bwd_fn(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, s_aux,
                                alibi_slopes, *param_values)
    grads = {"q": dq, "k": dk, "v": dv, "s_aux": None if s_aux is None else ds_aux}
    return tuple(grads.get(name) for name in FWD_TENSORS) + (None,) * len(PARAM_FIELDS)


def _backward(ctx, grad_out, grad_lse):
    return _gradients(ctx.saved_tensors, ctx.param_values, grad_out, bwd)


torch.library.register_autograd(add_op_namespace_prefix("fwd"), _backward,
                                setup_context=_setup_context)


def _modes_or_transforms_active() -> bool:
    return bool(torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()
                or torch._C._functorch.maybe_current_level() is not None)


_PLAIN_INPUTS = frozenset((Tensor, type(None)))  # exactly: no subclass


def _direct(tensors) -> bool:
    """True when calling the op bodies directly is indistinguishable from calling the ops
    ([Note: direct eager calls])."""
    return (not torch.compiler.is_compiling() and _PLAIN_INPUTS.issuperset(map(type, tensors))
            and not _modes_or_transforms_active())


class _Attention(torch.autograd.Function):
    """``fwd``'s body with ``fwd``'s gradient formula, for direct calls that autograd records."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = _fwd_body(*inputs)
        _setup_context(ctx, inputs, (out, lse))
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # as the op: no double backward
    def backward(ctx, grad_out, grad_lse):
        saved = ctx.saved_tensors
        bwd_fn = _bwd_body if _direct((grad_out, *saved)) else bwd
        return _gradients(saved, ctx.param_values, grad_out, bwd_fn)


def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
              params: AttnParams):
    """``(out, lse)`` for validated inputs: the allocating, differentiable entry point."""
    param_values = tuple(getattr(params, name) for name in PARAM_FIELDS)
    inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes)
    if not _direct(inputs):
        return fwd(*inputs, *param_values)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, s_aux)):
        return _Attention.apply(*inputs, *param_values)
    return _fwd_body(*inputs, *param_values)


def gradients(dout, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
              params: AttnParams):
    """``(dq, dk, dv, ds_aux)`` of a forward that returned ``out``/``lse``, outside autograd
    (flash-attn 2's low-level backward wrapper): the op, or its body for a direct call."""
    param_values = tuple(getattr(params, name) for name in PARAM_FIELDS)
    inputs = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes)
    bwd_fn = _bwd_body if _direct(inputs) else bwd
    return bwd_fn(*inputs, *param_values)
