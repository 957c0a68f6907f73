"""The public functions, with flash-attn 2's names, argument order and defaults.

Every keyword is a named parameter (transformers reads the signature of
``flash_attn_varlen_func`` to decide which keywords it sends), and only parameters the package
implements appear: an unsupported feature is an absent keyword, never one that is ignored.

Shapes: batched q ``(B, Sq, Hq, D)``, k/v ``(B, Sk, Hkv, D)``; varlen q ``(Tq, Hq, D)``, k/v
``(Tk, Hkv, D)`` with int32 ``cu_seqlens_q/k`` ``(B + 1,)``. Any strides with a last stride of 1.
The output is contiguous, shaped like q; ``softmax_lse`` is float32 ``(B, Hq, Sq)`` or
``(Hq, Tq)``.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _custom_ops, _validate, kvcache

# Dropout seeds are drawn from [0, 2**63): non-negative, and an int64 for the op schema.
_SEED_BOUND = 2**63 - 1


def _with_seed(params):
    """Draws the dropout seed from torch's default CPU generator (``torch.manual_seed``
    reproduces the mask), only when dropout is on, so eval calls leave the RNG alone."""
    if params.dropout_p == 0.0:
        return params
    seed = int(torch.randint(0, _SEED_BOUND, (), device="cpu", dtype=torch.int64))
    return dataclasses.replace(params, seed=seed)


def _result(out, lse, return_attn_probs: bool):
    if return_attn_probs:
        return out, lse, None
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, s_aux=None):
    """Attention over a batch of equal-length sequences.

    Args:
        q: ``(batch, seqlen_q, num_heads_q, head_dim)``, float16 or bfloat16.
        k, v: ``(batch, seqlen_k, num_heads_kv, head_dim)``; ``num_heads_q`` must be a
            multiple of ``num_heads_kv`` (GQA/MQA: query head ``h`` reads kv head
            ``h // (num_heads_q // num_heads_kv)``).
        dropout_p: probability of dropping an attention weight, in ``[0, 1)``.
        softmax_scale: score scale; ``None`` means ``head_dim ** -0.5``.
        causal: bottom-right aligned causal mask (forces ``window_size[1] = 0``).
        window_size: ``(left, right)`` band around the diagonal; ``-1`` is unbounded.
        softcap: ``> 0`` caps scores as ``softcap * tanh(s / softcap)``; ``0`` is off.
        alibi_slopes: float32 ``(num_heads_q,)`` or ``(batch, num_heads_q)``.
        deterministic: bitwise reproducible gradients.
        return_attn_probs: also return ``softmax_lse`` (and ``None`` for the probabilities,
            which are never materialised).
        s_aux: attention-sink logits ``(num_heads_q,)`` (any float dtype; differentiable).

    Returns:
        ``out`` ``(batch, seqlen_q, num_heads_q, head_dim)``, or ``(out, softmax_lse, None)``
        with ``softmax_lse`` float32 ``(batch, num_heads_q, seqlen_q)``.
    """
    params, s_aux, alibi_slopes = _validate.batched(
        q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, s_aux=s_aux)
    return_attn_probs = _validate.flag("return_attn_probs", return_attn_probs)
    out, lse = _custom_ops.attention(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, s_aux=s_aux,
                                     alibi_slopes=alibi_slopes, params=_with_seed(params))
    return _result(out, lse, return_attn_probs)


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
        ``(out, softmax_lse, None)`` with ``softmax_lse`` float32 ``(num_heads_q, total_q)``.
    """
    if block_table is not None:
        return kvcache.paged_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            block_table=block_table, dropout_p=dropout_p, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            deterministic=deterministic, return_attn_probs=return_attn_probs, s_aux=s_aux)
    params, s_aux, alibi_slopes = _validate.varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, s_aux=s_aux)
    return_attn_probs = _validate.flag("return_attn_probs", return_attn_probs)
    out, lse = _custom_ops.attention(q, k, v, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k, s_aux=s_aux,
                                     alibi_slopes=alibi_slopes, params=_with_seed(params))
    return _result(out, lse, return_attn_probs)
