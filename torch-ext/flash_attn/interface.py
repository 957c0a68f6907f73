"""The public functions, with flash-attn 2's names, argument order and defaults (2.8.3), plus
``s_aux`` (attention sinks) last.

Every keyword is a named parameter (transformers reads the signature of
``flash_attn_varlen_func`` to decide which keywords it sends), and only parameters the package
implements appear: an unsupported feature is an absent keyword, never one that is ignored.

Shapes: batched q ``(B, Sq, Hq, D)``, k/v ``(B, Sk, Hkv, D)``; varlen q ``(Tq, Hq, D)``, k/v
``(Tk, Hkv, D)`` with int32 ``cu_seqlens_q/k`` ``(B + 1,)``; packed qkv ``(B, S, 3, H, D)`` /
``(T, 3, H, D)``, packed kv ``(B, Sk, 2, Hkv, D)`` / ``(Tk, 2, Hkv, D)``. The output is
contiguous, shaped like q; ``softmax_lse`` is float32 ``(B, Hq, Sq)`` or ``(Hq, Tq)``.

What flash-attn 2 accepts is accepted here, once, in this layer (no backend sees it):

* any head dim in ``[1, 256]``: one that is not a multiple of 8 is zero-padded up to the next
  multiple for the kernels (``softmax_scale`` still defaults to the caller's ``D ** -0.5``; zero
  channels change no score), the output is cut back to ``D`` and the gradients come back ``D``
  wide through autograd;
* any strides: a tensor whose last stride is not 1 is copied to a contiguous one;
* scalars as numpy scalars or 0-d tensors, ``window_size`` as any pair (tuple, list, tensor,
  array), ``softcap <= 0`` as off (see ``_validate``).

Packed entry points unbind their packed tensor into views (no copy), so the gradient reaches the
packed tensor through one ``stack`` of the three (or two) parts: one write per part.

[Note: lse of a row that sees no key] A query row with no visible key (causal with Sq > Sk, a
window that leaves it empty, an empty key sequence) and no sink has output 0 and
``softmax_lse = +inf``, flash-attn 2's (and 3's) convention, which the returned lse follows so
that code written for flash-attn (e.g. merging partial results, where such rows are matched with
``isinf``) reads the same values. Internally the ops keep ``log(0) = -inf`` (the oracle's value):
the conversion happens only on the lse a public function returns. With a sink the row's lse is
``s_aux[h]``, finite. transformers never reads the lse.

[Note: return_attn_probs] ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``.
``S_dmask`` is None without dropout (flash-attn 2 returns an empty tensor there) and, with
dropout, the dropout-encoded probability matrix of ``_attn_probs`` (probabilities, negated where
dropped), for at most ``_attn_probs.MAX_ELEMENTS`` entries; a larger request logs a warning and
returns None in its place, as this package did before it computed the matrix (code that asks
for the probabilities only to get the lse keeps working at real sizes).
It is computed in eager mode only (a graph break under torch.compile).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.nn.functional as F

from . import _attn_probs, _custom_ops, _validate, kvcache

logger = logging.getLogger("flash_attn")

# Dropout seeds are drawn from [0, 2**63): non-negative, and an int64 for the op schema.
_SEED_BOUND = 2**63 - 1
_QKV_NAMES = ("q", "k", "v")


def _with_seed(params):
    """Draws the dropout seed from torch's default CPU generator (``torch.manual_seed``
    reproduces the mask), only when dropout is on, so eval calls leave the RNG alone."""
    if params.dropout_p == 0.0:
        return params
    seed = int(torch.randint(0, _SEED_BOUND, (), device="cpu", dtype=torch.int64))
    return dataclasses.replace(params, seed=seed)


def head_dim_padding(head_dim) -> int:
    """Zero channels appended to a head dim for the kernels (0 for a multiple of 8)."""
    return -head_dim % _validate.HEAD_DIM_MULTIPLE


def kernel_layout(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` as the kernels take it: ``pad`` zero channels appended (differentiable; the
    gradient is cut back by autograd), a last stride of 1."""
    if pad:
        return F.pad(t, (0, pad))
    return t if t.stride(-1) == 1 else t.contiguous()


def public_lse(lse: torch.Tensor) -> torch.Tensor:
    """The ops' lse with flash-attn 2's +inf for rows that see no key ([Note: lse of a row
    that sees no key])."""
    return lse.masked_fill(lse == -math.inf, math.inf)


def _attend(q, k, v, varlen_args, *, names, dropout_p, softmax_scale, causal, window_size,
            softcap, alibi_slopes, deterministic, return_attn_probs, s_aux):
    """Validates, lays out for the kernels, runs the op and shapes the result: the body of
    every public function. ``varlen_args``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)``, or None for a batched call; ``names``: the arguments q, k, v came from."""
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   deterministic=deterministic, s_aux=s_aux, names=names)
    if varlen_args is None:
        params, s_aux, alibi_slopes = _validate.batched(q, k, v, **options)
        cu_seqlens_q = cu_seqlens_k = None
    else:
        params, s_aux, alibi_slopes = _validate.varlen(q, k, v, *varlen_args, **options)
        cu_seqlens_q, cu_seqlens_k = varlen_args[:2]
    return_attn_probs = _validate.flag("return_attn_probs", return_attn_probs)
    with_probs = return_attn_probs and params.dropout_p > 0
    if with_probs and not _attn_probs.fits(q, k, cu_seqlens_q, params):
        # code that asks for the probabilities only to get the lse keeps working at real sizes
        logger.warning("flash_attn: return_attn_probs=True with dropout asks for a %d-entry "
                       "S_dmask, over the %d-entry limit; returning None in its place",
                       _attn_probs.num_elements(q, k, cu_seqlens_q, params),
                       _attn_probs.MAX_ELEMENTS)
        with_probs = False
    head_dim = q.shape[-1]
    pad = head_dim_padding(head_dim)
    q, k, v = (kernel_layout(t, pad) for t in (q, k, v))
    params = _with_seed(params)
    out, lse = _custom_ops.attention(q, k, v, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k, s_aux=s_aux,
                                     alibi_slopes=alibi_slopes, params=params)
    if pad:
        out = out[..., :head_dim].contiguous()
    if not return_attn_probs:
        return out
    probs = None
    if with_probs:
        probs = _attn_probs.dropout_encoded(q, k, lse, cu_seqlens_q=cu_seqlens_q,
                                            cu_seqlens_k=cu_seqlens_k,
                                            alibi_slopes=alibi_slopes, params=params)
    return out, public_lse(lse), probs


def _unpack(name: str, packed, parts: int, layout: str):
    """The ``parts`` views of a packed tensor ``layout`` along its ``-3`` dim (no copy)."""
    rank = layout.count(",") + 1
    if not isinstance(packed, torch.Tensor):
        _validate._fail(TypeError, name, type(packed).__name__,
                        f"a torch.Tensor of shape {layout}")
    if packed.dim() != rank or packed.shape[-3] != parts:
        _validate._fail(ValueError, name, f"shape {tuple(packed.shape)}", f"a shape {layout}")
    return packed.unbind(-3)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, s_aux=None):
    """Attention over a batch of equal-length sequences.

    Args:
        q: ``(batch, seqlen_q, num_heads_q, head_dim)``, float16 or bfloat16, head_dim <= 256.
        k, v: ``(batch, seqlen_k, num_heads_kv, head_dim)``; ``num_heads_q`` must be a
            multiple of ``num_heads_kv`` (GQA/MQA: query head ``h`` reads kv head
            ``h // (num_heads_q // num_heads_kv)``).
        dropout_p: probability of dropping an attention weight, in ``[0, 1)``.
        softmax_scale: score scale, ``> 0``; ``None`` means ``head_dim ** -0.5``.
        causal: bottom-right aligned causal mask (forces ``window_size[1] = 0``).
        window_size: ``(left, right)`` band around the diagonal, any pair of ints (tuple,
            list, tensor, array); ``-1`` is unbounded.
        softcap: ``> 0`` caps scores as ``softcap * tanh(s / softcap)``; ``<= 0`` is off.
        alibi_slopes: float32 ``(num_heads_q,)`` or ``(batch, num_heads_q)``.
        deterministic: bitwise reproducible gradients.
        return_attn_probs: also return ``softmax_lse`` and the dropout-encoded probabilities
            (None without dropout; see the module's [Note: return_attn_probs]).
        s_aux: attention-sink logits ``(num_heads_q,)`` (any float dtype; differentiable).

    Returns:
        ``out`` ``(batch, seqlen_q, num_heads_q, head_dim)``, or ``(out, softmax_lse, S_dmask)``
        with ``softmax_lse`` float32 ``(batch, num_heads_q, seqlen_q)``, ``+inf`` for a row
        that sees no key and has no sink.
    """
    return _attend(q, k, v, None, names=_QKV_NAMES, dropout_p=dropout_p,
                   softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                   return_attn_probs=return_attn_probs, s_aux=s_aux)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, s_aux=None, block_table=None):
    """Attention over packed sequences of different lengths.

    Args:
        q: ``(total_q, num_heads_q, head_dim)``, sequences back to back.
        k, v: ``(total_k, num_heads_kv, head_dim)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` cumulative lengths, starting at 0
            and ending at ``total_q`` / ``total_k``.
        max_seqlen_q, max_seqlen_k: int (or 0-d integer tensor) at least the longest sequence.
            Under torch.compile they may be symbolic (an int that changes from call to call,
            or ``.item()`` of a tensor): one compiled graph serves every value
            (docs/compile.md).
        The other arguments are those of :func:`flash_attn_func`; ``alibi_slopes`` may be
        ``(batch, num_heads_q)`` with ``batch = len(cu_seqlens_q) - 1``.
        block_table: optional int32 ``(batch, max_blocks)`` (paged prefill, forward only): k
            and v are then paged caches ``(num_blocks, page_size, num_heads_kv, head_dim)``
            (any page size >= 1) and sequence ``b`` reads its ``cu_seqlens_k[b + 1] -
            cu_seqlens_k[b]`` keys from positions ``0..`` of its pages ``block_table[b]``.
            It runs the kv-cache kernels of ``flash_attn_with_kvcache``, which read the pages
            in place (no gathered copy of K/V); no dropout, no gradient.

    Returns:
        ``out`` ``(total_q, num_heads_q, head_dim)`` (contiguous), or
        ``(out, softmax_lse, S_dmask)`` with ``softmax_lse`` float32 ``(num_heads_q, total_q)``.
    """
    if block_table is not None:
        return kvcache.paged_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            block_table=block_table, dropout_p=dropout_p, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            deterministic=deterministic, return_attn_probs=return_attn_probs, s_aux=s_aux)
    return _attend(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                   names=_QKV_NAMES, dropout_p=dropout_p, softmax_scale=softmax_scale,
                   causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, deterministic=deterministic,
                   return_attn_probs=return_attn_probs, s_aux=s_aux)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, s_aux=None):
    """:func:`flash_attn_func` on ``qkv`` ``(batch, seqlen, 3, num_heads, head_dim)`` (q, k, v
    stacked; as many kv heads as query heads). The gradient is one ``(batch, seqlen, 3,
    num_heads, head_dim)`` tensor, its three parts written once each."""
    q, k, v = _unpack("qkv", qkv, 3, "(batch, seqlen, 3, num_heads, head_dim)")
    return _attend(q, k, v, None, names=("qkv",) * 3, dropout_p=dropout_p,
                   softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                   return_attn_probs=return_attn_probs, s_aux=s_aux)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, s_aux=None):
    """:func:`flash_attn_func` on q ``(batch, seqlen_q, num_heads_q, head_dim)`` and ``kv``
    ``(batch, seqlen_k, 2, num_heads_kv, head_dim)`` (k, v stacked; GQA/MQA as in
    :func:`flash_attn_func`)."""
    k, v = _unpack("kv", kv, 2, "(batch, seqlen_k, 2, num_heads_kv, head_dim)")
    return _attend(q, k, v, None, names=("q", "kv", "kv"), dropout_p=dropout_p,
                   softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                   return_attn_probs=return_attn_probs, s_aux=s_aux)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, s_aux=None):
    """:func:`flash_attn_varlen_func` on ``qkv`` ``(total, 3, num_heads, head_dim)``, with one
    ``cu_seqlens`` / ``max_seqlen`` for queries and keys."""
    q, k, v = _unpack("qkv", qkv, 3, "(total, 3, num_heads, head_dim)")
    return _attend(q, k, v, (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen),
                   names=("qkv",) * 3, dropout_p=dropout_p, softmax_scale=softmax_scale,
                   causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, deterministic=deterministic,
                   return_attn_probs=return_attn_probs, s_aux=s_aux)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, s_aux=None):
    """:func:`flash_attn_varlen_func` on q ``(total_q, num_heads_q, head_dim)`` and ``kv``
    ``(total_k, 2, num_heads_kv, head_dim)``."""
    k, v = _unpack("kv", kv, 2, "(total_k, 2, num_heads_kv, head_dim)")
    return _attend(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                   names=("q", "kv", "kv"), dropout_p=dropout_p, softmax_scale=softmax_scale,
                   causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, deterministic=deterministic,
                   return_attn_probs=return_attn_probs, s_aux=s_aux)
