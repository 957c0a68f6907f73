"""Triton split-KV forward for few query rows per kv head (decode, short GQA prefill).

Glossary (see also ``fwd`` and ``common``):
  packed row     row r of a program's tile is query row ``r % Sq`` of query head
                 ``kv_head * GROUP + r // Sq``: the GROUP * Sq rows that read one kv head share
                 one tile, so that head's K/V are read once, not once per query head
  split          one of NUM_SPLITS contiguous key ranges of ``keys_per_split`` keys (a multiple
                 of BLOCK_N); one program per (split, kv head, sequence)
  token          a query row's index on the flattened token axis: ``b * Sq + i`` batched,
                 its packed position (cu_seqlens_q[b] + i) varlen
  partial        a split's normalised output (fp32, ``(tokens, Hq, NUM_SPLITS, D)``) and its
                 lse in log2 units (``(tokens, Hq, NUM_SPLITS)``; -inf when the split saw no key)

The regular forward runs one program per (query block, query head): at Sq = 1 its tile holds
one real row of BLOCK_M, and B * Hq programs each walk every key alone (at 4k-128k keys most of
the GPU idles). Here B * Hkv * NUM_SPLITS programs share the keys (batched, or varlen as
transformers' generate calls it for padded batches), each running the forward's own key loop
(``common.inner_loop``: the same score hooks and band masks) over its range;
``common.combine_kernel`` then merges a row's splits in a fixed order, so the result does not
depend on timing. Which calls run here is ``_heuristics.split_applies``'s rule, applied by the
dispatcher.

Each split writes its partial output and lse for ``common.combine_kernel`` ([Note: combining
splits] there).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._heuristics import num_splits_for
from .._params import AttnParams
from .common import (LOG2E, LaunchShape, combine_splits, inner_loop, key_block_range,
                     sequence_bounds, shared_arguments)


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """The split kernel's launch shape."""
    block_n: int
    num_warps: int
    num_stages: int


def tiles_for(head_dim: int, device: torch.device) -> DecodeTiles:
    """Launch shape by head dim: 64 keys per step keep K^T and V tiles (2 x 64 x D bf16) and
    the fp32 accumulator within registers up to D=128; D=256 takes 32. The interpreter takes
    16, so tests cross several blocks per split."""
    if device.type != "cuda":
        return DecodeTiles(16, 1, 1)
    return DecodeTiles(64 if head_dim <= 128 else 32, 4, 3)


@triton.jit
def _split_kernel(
        Q, K, V, O_PART, LSE_PART, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_ab,
        seqlen_q_batched, seqlen_k_batched, num_heads_q, keys_per_split, num_splits,
        qk_scale, softcap_log2, window_left, window_right,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, GROUP: tl.constexpr, IS_VARLEN: tl.constexpr,
        HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
        HAS_ALIBI: tl.constexpr):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(
        CU_SEQLENS_Q, CU_SEQLENS_K, batch, seqlen_q_batched, seqlen_k_batched, IS_VARLEN)
    if seqlen_q == 0:
        return
    batch64 = batch.to(tl.int64)
    if IS_VARLEN:
        token0 = tl.cast(q_start, tl.int64)
    else:
        token0 = batch64 * seqlen_q
    k_row0 = tl.cast(k_start, tl.int64)

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    r_ok = offs_r < GROUP * seqlen_q
    rows = offs_r % seqlen_q                      # query row of each packed row
    heads = kv_head * GROUP + offs_r // seqlen_q  # its query head (past GROUP on padding rows)
    heads = tl.where(r_ok, heads, kv_head * GROUP)
    q_ptrs = (Q + batch64 * stride_qb + (tl.cast(q_start, tl.int64) + rows)[:, None] * stride_qs
              + heads.to(tl.int64)[:, None] * stride_qh + offs_d[None, :])
    q = tl.load(q_ptrs, mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    k_src = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_row0 * stride_ks
    v_src = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_row0 * stride_vs
    if HAS_ALIBI:
        slopes = tl.load(ALIBI + batch64 * stride_ab + heads, mask=r_ok, other=0.0)
        alibi_slope_log2 = (slopes * LOG2E)[:, None]
    else:
        alibi_slope_log2 = 0.0

    # The blocks any query row sees, cut to this split's range.
    lo, full_lo, full_hi, hi = key_block_range(0, seqlen_q - 1, seqlen_q, seqlen_k, window_left,
                                               window_right, BLOCK_N, HAS_WINDOW_LEFT,
                                               HAS_WINDOW_RIGHT)
    split_lo = split * (keys_per_split // BLOCK_N)
    split_hi = split_lo + keys_per_split // BLOCK_N
    lo = tl.maximum(lo, split_lo)
    hi = tl.minimum(hi, split_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i, _ = inner_loop(
        acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, lo, full_lo, full_hi, hi, rows,
        offs_n, seqlen_q, seqlen_k, qk_scale, softcap_log2, alibi_slope_log2, window_left,
        window_right, 0, 0, HEAD_DIM, BLOCK_N, BLOCK_D, SOFTCAP, HAS_ALIBI, HAS_WINDOW_LEFT,
        HAS_WINDOW_RIGHT, False, False, False)

    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    part = acc * (1.0 / l_safe)[:, None]
    lse2 = tl.where(has_mass, m_i + tl.log2(l_safe), float("-inf"))
    # partial index of (token, head, split)
    idx = ((token0 + rows) * num_heads_q + heads) * num_splits + split
    tl.store(O_PART + idx[:, None] * HEAD_DIM + offs_d[None, :], part,
             mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(LSE_PART + idx, lse2, mask=r_ok)


def forward(q, k, v, out, lse, *, s_aux, alibi_slopes, params: AttnParams,
            cu_seqlens_q=None, cu_seqlens_k=None, num_splits: int | None = None) -> None:
    """The split-KV forward of a call that ``_heuristics.split_kv_applies`` to; same contract
    as ``fwd.forward``. ``num_splits`` overrides ``_heuristics.num_splits_for`` (tests)."""
    shape = LaunchShape.of(q, k, cu_seqlens_q, params)
    cfg = tiles_for(shape.head_dim, q.device)
    splits = num_splits or num_splits_for(shape.batch, shape.heads_kv, shape.max_seqlen_k,
                                          cfg.block_n, q.device)
    keys_per_split = triton.cdiv(triton.cdiv(shape.max_seqlen_k, splits), cfg.block_n) * cfg.block_n
    splits = triton.cdiv(shape.max_seqlen_k, keys_per_split)  # no split starts past the last key
    tokens = q.shape[0] if shape.varlen else shape.batch * shape.seqlen_q
    rows = tokens * shape.heads_q
    if rows == 0:
        return
    o_part = torch.empty(rows * splits, shape.head_dim, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(rows * splits, device=q.device, dtype=torch.float32)
    scalars, flags = shared_arguments(shape, params, alibi_slopes)
    group = flags["GROUP"]
    _split_kernel[(splits, shape.heads_kv, shape.batch)](
        q, k, v, o_part, lse_part, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
        *shape.seq_strides(q), *shape.seq_strides(k), *shape.seq_strides(v),
        scalars["stride_ab"], shape.seqlen_q, shape.seqlen_k, shape.heads_q, keys_per_split,
        splits, scalars["qk_scale"], scalars["softcap_log2"], params.window_left,
        params.window_right, HEAD_DIM=flags["HEAD_DIM"], BLOCK_D=flags["BLOCK_D"],
        BLOCK_M=max(16, triton.next_power_of_2(group * shape.max_seqlen_q)), BLOCK_N=cfg.block_n,
        GROUP=group, IS_VARLEN=shape.varlen, HAS_WINDOW_LEFT=flags["HAS_WINDOW_LEFT"],
        HAS_WINDOW_RIGHT=flags["HAS_WINDOW_RIGHT"], SOFTCAP=flags["SOFTCAP"],
        HAS_ALIBI=flags["HAS_ALIBI"], num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    combine_splits(o_part, lse_part, out, lse, s_aux, o_strides=shape.seq_strides(out),
                   l_strides=shape.lse_strides(lse), seqlen_q_batched=shape.seqlen_q,
                   heads_q=shape.heads_q, splits=splits, head_dim=shape.head_dim,
                   varlen=shape.varlen)
