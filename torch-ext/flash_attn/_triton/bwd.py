"""Triton backward kernels (FlashAttention-2 style) and their destination-passing launcher.

Glossary (see also ``common``):
  Q, K, V, O, DO     queries, keys, values, output, output gradient (DO may be any strides)
  DQ, DK, DV         gradients, contiguous, shaped like Q / K / V (DK, DV per KV head)
  LSE                forward log-sum-exp, natural log, float32, sink included
  DELTA              rowsum(DO * O), float32, laid out like LSE
  B, Hq, Hkv, GROUP  batch, query heads, kv heads, Hq // Hkv (kv head = h // GROUP)
  GROUP_SPLITS       parts a kv head's GROUP query heads are split into across dK/dV programs
  P, dP, dS          probabilities, their gradient, the score gradient (natural units)
  HEAD_DIM, BLOCK_D  D and its padded tile width max(16, next_pow2(D)), masked when wider
  DKDV_BLOCK_M/N     query rows per step / keys owned, in the dK/dV kernel
  DQ_BLOCK_M/N       queries owned / keys per step, in the dQ kernel
  IS_VARLEN          sequences delimited by cu_seqlens; batch strides are then unused (0)
  TMA                Q, dO, K, V read through tensor descriptors (``rows_source``; sm90+,
                     16-byte aligned), per kernel (``dkdv_tma``, ``dq_tma``)

Three launches:
  1. ``_bwd_delta_kernel``: DELTA = rowsum(DO * O) in fp32, one program per (query block, head).
  2. ``_bwd_dkdv_kernel``: one program owns DKDV_BLOCK_N keys of one (batch, KV head). It loops
     over the GROUP query heads of that kv head and, per head, over the query blocks of the
     causal / window band, accumulating dK and dV in registers. The GQA reduction happens
     there, so no (.., Hq, D)-sized dK/dV buffer ever exists. When that grid is too small to
     fill the GPU (MQA, high GQA ratios), the group is split across GROUP_SPLITS programs per
     key block, each looping over GROUP / GROUP_SPLITS heads and storing fp32 partial dK/dV
     into a (GROUP_SPLITS, ..K/V shape..) buffer that one torch sum per gradient reduces in
     a fixed order ([Note: group split] and ``dkdv_group_splits`` in ``_heuristics``).
     GROUP_SPLITS = 1, the common case, stores dK and dV directly: no buffer, no reduction op.
  3. ``_bwd_dq_kernel``: one program owns DQ_BLOCK_M queries of one (batch, query head) and
     loops over the band's key blocks, recomputing P from LSE.
With ``deterministic=True`` every output element (and every partial) is written by exactly one
program, and partials are summed in a fixed order, so gradients are bitwise reproducible run to
run (on one GPU model: GROUP_SPLITS follows the SM count). Otherwise, where the tile entry says
``atomic_dq``, launch 3 is skipped: the dK/dV kernel also forms ``dS K`` for each query block
it visits and adds it into an fp32 dQ buffer with atomics ([Note: atomic dQ]).

Both loops visit their band in three calls of one inner loop: the leading edge blocks (masked),
the interior blocks (no mask, no bounds checks), the trailing edge blocks (masked). Causal,
window, softcap, ALiBi and dropout are compile-time hooks into those loops.

[Note: recomputing P] Scores are recomputed with the forward's arithmetic (``score_constants``:
``s2 = qk * scale * log2(e)``, or ``softcap * log2(e) * tanh(qk * scale / softcap)``, minus
``slope * log2(e) * |i + Sk - Sq - j|``), then ``P = exp2(s2 - LSE * log2(e))``. LSE is the
forward's, so P is the forward's softmax (sink included: the sink column has no value and is
never materialised). A row with LSE = -inf sees no key; its LSE is replaced by +inf so that
``exp2(s2 - inf) = 0`` for finite and masked (-inf) scores alike: such rows contribute nothing
and no ``-inf - -inf`` NaN forms.

[Note: gradient chain] With ``Pd = P * keep / (1 - p)`` the dropped probabilities the forward
multiplied into V: ``dV = Pd^T dO``; ``dP = (dO V^T) * keep / (1 - p)``;
``dS = P * (dP - DELTA)`` with ``DELTA = rowsum(dO * O) = rowsum(P * dP)`` (O is the dropped
output, so DELTA already accounts for dropout); softcap multiplies dS by ``1 - t^2`` with
``t = tanh(qk * scale / softcap)``; ``dQ = scale * dS K`` and ``dK = scale * dS^T Q``, the
scale applied once to the fp32 accumulators. The sink logit gets
``ds_aux[h] = -sum_rows exp(s_aux[h] - LSE) * DELTA`` (its own dP is 0), a few torch ops.

[Note: padding lanes] A program's own tile may hang past its sequence (the last key block in
the dK/dV kernel, the last query block in the dQ kernel). Its padding lanes are loaded as zeros
and never stored, and each dK/dV row depends only on its own key (each dQ row only on its own
query), so the interior loop may run over them unmasked: only the loop dimension needs the
bounds, and ``query_block_range`` / ``key_block_range`` keep interior blocks inside it.

[Note: atomic dQ] The dQ kernel recomputes ``Q K^T`` and ``dO V^T``: the two launches run
7 matmuls per (query block, key block) where the gradient needs 5 (14 M*N*D flops against the
10 the FLOP rule counts). Accumulating dQ in the dK/dV loop needs only one more matmul there,
``dS^T``'s transpose times the resident K tile, at the price of fp32 atomic adds into a
zero-filled (.., Hq, D) fp32 buffer (summed in whatever order the programs finish: not
bitwise reproducible), converted to dQ's dtype at the end. The buffer is per query head, as dQ
is; K/V-sized gradients stay reduced in registers as before.

[Note: offsets] Per-program bases (batch, head, sequence start) and per-block offsets are
int64; in-tile offsets stay int32, so tensors beyond 2**31 elements address correctly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import triton
import triton.language as tl

from .._heuristics import dkdv_group_splits, sm_count
from .._math import sink_gradient
from .._params import AttnParams
from .common import (LOG2E, LaunchShape, dropout_keep, dropout_row_hash, key_block_range,
                     load_column_slice, load_rows, load_rows_t, mix32, query_block_range,
                     rows_source, safe_lse_log2, scores_log2, sequence_bounds, shared_arguments,
                     store_column_slice, store_rows, use_tma, visible)
from .tuning import HEAD_DIM_BUCKETS, TileTable


# ---------------------------------------------------------------------------------------------
# 1. DELTA = rowsum(dO * O)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, CU_SEQLENS_Q,
                      stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
                      stride_lb, stride_lh, stride_ls, seqlen_q_batched,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + batch)
        seqlen_q = tl.load(CU_SEQLENS_Q + batch + 1) - q_start
    else:
        q_start = 0
        seqlen_q = seqlen_q_batched
    m_first = pid_m * BLOCK_M
    if m_first >= seqlen_q:
        return
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    row0 = tl.cast(q_start, tl.int64)
    o = load_rows(O + batch64 * stride_ob + head64 * stride_oh + row0 * stride_os, m_first,
                  stride_os, seqlen_q, BLOCK_M, HEAD_DIM, BLOCK_D, True, False)
    do = load_rows(DO + batch64 * stride_dob + head64 * stride_doh + row0 * stride_dos, m_first,
                   stride_dos, seqlen_q, BLOCK_M, HEAD_DIM, BLOCK_D, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    rows = m_first + tl.arange(0, BLOCK_M)
    tl.store(DELTA + batch64 * stride_lb + head64 * stride_lh + (row0 + rows) * stride_ls, delta,
             mask=rows < seqlen_q)


# ---------------------------------------------------------------------------------------------
# 2. dK, dV: one program per (key block, batch, kv head), transposed (N, M) orientation so that
#    P^T and dS^T come out of the score dot directly as the A operand of the dV / dK dots.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_inner(dk, dv, k, k_cols, v, q_src, do_src, q_base, do_base, lse_base, delta_base,
                dq_base, stride_qs, stride_dos, stride_ls, stride_dqs, block_lo, block_hi, cols,
                col0, seqlen_q, seqlen_k, softmax_scale, qk_scale, softcap_log2,
                alibi_slope_log2, window_left, window_right, seed_lo, seed_hi, batch, head,
                num_heads_q, threshold, dropout_rescale, MASKED: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                D_SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
                DROPOUT: tl.constexpr, TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """Accumulates the contribution of query blocks ``[block_lo, block_hi)`` of one head;
    ``q_src``/``do_src`` are that head's Q/dO matrices as ``rows_source`` gives them. With
    ATOMIC_DQ it also adds ``scale * dS K`` into the fp32 rows at ``dq_base``. With
    D_SPLITS > 1 the program owns head-dim columns ``col0 .. col0 + BLOCK_D / D_SPLITS`` of
    dK, dV (and dQ): the scores still contract over the whole head dim, the gradient dots read
    that column slice of Q and dO (``q_base``/``do_base``, pointers) and of K (``k_cols``)."""
    diag = seqlen_k - seqlen_q
    offs_m = tl.arange(0, BLOCK_M)
    WIDTH: tl.constexpr = BLOCK_D // D_SPLITS
    offs_d = col0 + tl.arange(0, WIDTH)
    for block in range(block_lo, block_hi):
        start_m = block * BLOCK_M
        rows = start_m + offs_m
        q_t = load_rows_t(q_src, start_m, stride_qs, seqlen_q, BLOCK_M, HEAD_DIM, BLOCK_D,
                          MASKED, TMA)
        do = load_rows(do_src, start_m, stride_dos, seqlen_q, BLOCK_M, HEAD_DIM, BLOCK_D,
                       MASKED, TMA)
        if MASKED:
            m_ok = rows < seqlen_q
            lse = tl.load(lse_base + rows * stride_ls, mask=m_ok, other=0.0)
            delta = tl.load(delta_base + rows * stride_ls, mask=m_ok, other=0.0)
        else:
            lse = tl.load(lse_base + rows * stride_ls)
            delta = tl.load(delta_base + rows * stride_ls)
        s_t, t_t = scores_log2(tl.dot(k, q_t), rows[None, :], cols[:, None], diag,
                               qk_scale, softcap_log2, alibi_slope_log2, SOFTCAP, HAS_ALIBI)
        if MASKED:
            ok = visible(rows[None, :], cols[:, None], seqlen_q, seqlen_k, window_left,
                         window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
            s_t = tl.where(ok, s_t, float("-inf"))
        p_t = tl.exp2(s_t - safe_lse_log2(lse)[None, :])
        dp_t = tl.dot(v, tl.trans(do))
        if DROPOUT:
            row_hash = dropout_row_hash(seed_lo, seed_hi, batch, head, num_heads_q, rows)
            keep_t = mix32(row_hash[None, :] ^ cols.to(tl.uint32)[:, None]) >= threshold
            pd_t = tl.where(keep_t, p_t * dropout_rescale, 0.0)
            dp_t = tl.where(keep_t, dp_t * dropout_rescale, 0.0)
        else:
            pd_t = p_t
        if D_SPLITS == 1:
            do_cols = do
            q_cols = tl.trans(q_t)
        else:
            do_cols = load_column_slice(do_base, start_m, stride_dos, seqlen_q, col0, BLOCK_M,
                                        WIDTH, HEAD_DIM, MASKED)
            q_cols = load_column_slice(q_base, start_m, stride_qs, seqlen_q, col0, BLOCK_M,
                                       WIDTH, HEAD_DIM, MASKED)
        dv += tl.dot(pd_t.to(do.dtype), do_cols)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk += tl.dot(ds_t.to(q_t.dtype), q_cols)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k_cols) * softmax_scale
            dq_ptrs = dq_base + rows[:, None] * stride_dqs + offs_d[None, :]
            if MASKED:
                dq_ok = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
            else:
                dq_ok = offs_d[None, :] < HEAD_DIM
            tl.atomic_add(dq_ptrs, dq, mask=dq_ok, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["threshold", "seed_lo", "seed_hi"])
def _bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, DQACC, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
        stride_dkb, stride_dks, stride_dkh, stride_dkp, stride_dqb, stride_dqs, stride_dqh,
        stride_lb, stride_lh, stride_ls, stride_ab,
        seqlen_q_batched, seqlen_k_batched, num_heads_q,
        softmax_scale, qk_scale, softcap_log2, window_left, window_right,
        threshold, seed_lo, seed_hi, dropout_rescale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GROUP_SPLITS: tl.constexpr,
        IS_VARLEN: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
        TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr, D_SPLITS: tl.constexpr):
    # The GROUP_SPLITS x D_SPLITS programs of one key block are adjacent in launch order: they
    # run together (sharing the K/V tile in L2) and the heaviest causal key blocks go first.
    pid = tl.program_id(0)
    if D_SPLITS == 1:
        col0 = 0
    else:  # [Note: head-dim split]
        col0 = (pid % D_SPLITS) * (BLOCK_D // D_SPLITS)
        pid = pid // D_SPLITS
    if GROUP_SPLITS == 1:
        pid_n = pid
    else:
        pid_n = pid // GROUP_SPLITS
        split = pid % GROUP_SPLITS
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(
        CU_SEQLENS_Q, CU_SEQLENS_K, batch, seqlen_q_batched, seqlen_k_batched, IS_VARLEN)
    n_first = pid_n * BLOCK_N
    if n_first >= seqlen_k:
        return
    n_last = tl.minimum(n_first + BLOCK_N, seqlen_k) - 1

    batch64 = batch.to(tl.int64)
    kv_head64 = kv_head.to(tl.int64)
    q_row0 = tl.cast(q_start, tl.int64)
    k_row0 = tl.cast(k_start, tl.int64)
    cols = n_first + tl.arange(0, BLOCK_N)
    k_src = rows_source(K + batch64 * stride_kb + kv_head64 * stride_kh + k_row0 * stride_ks,
                        seqlen_k, stride_ks, BLOCK_N, HEAD_DIM, BLOCK_D, TMA)
    v_src = rows_source(V + batch64 * stride_vb + kv_head64 * stride_vh + k_row0 * stride_vs,
                        seqlen_k, stride_vs, BLOCK_N, HEAD_DIM, BLOCK_D, TMA)
    k = load_rows(k_src, n_first, stride_ks, seqlen_k, BLOCK_N, HEAD_DIM, BLOCK_D, True, TMA)
    v = load_rows(v_src, n_first, stride_vs, seqlen_k, BLOCK_N, HEAD_DIM, BLOCK_D, True, TMA)
    if D_SPLITS == 1:
        k_cols = k
    else:
        k_cols = load_column_slice(K + batch64 * stride_kb + kv_head64 * stride_kh
                                   + k_row0 * stride_ks, n_first, stride_ks, seqlen_k, col0,
                                   BLOCK_N, BLOCK_D // D_SPLITS, HEAD_DIM, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D // D_SPLITS], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D // D_SPLITS], tl.float32)
    if DROPOUT:
        thr = threshold.to(tl.uint32)
    else:
        thr = 0

    lo, full_lo, full_hi, hi = query_block_range(n_first, n_last, seqlen_q, seqlen_k,
                                                 window_left, window_right, BLOCK_M,
                                                 HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
    if GROUP_SPLITS == 1:
        head_first = kv_head * GROUP
    else:
        head_first = kv_head * GROUP + split * (GROUP // GROUP_SPLITS)
    for g in range(GROUP // GROUP_SPLITS):
        head = head_first + g
        head64 = head.to(tl.int64)
        q_base = Q + batch64 * stride_qb + head64 * stride_qh + q_row0 * stride_qs
        do_base = DO + batch64 * stride_dob + head64 * stride_doh + q_row0 * stride_dos
        q_src = rows_source(q_base, seqlen_q, stride_qs, BLOCK_M, HEAD_DIM, BLOCK_D, TMA)
        do_src = rows_source(do_base, seqlen_q, stride_dos, BLOCK_M, HEAD_DIM, BLOCK_D, TMA)
        lse_base = LSE + batch64 * stride_lb + head64 * stride_lh + q_row0 * stride_ls
        delta_base = DELTA + batch64 * stride_lb + head64 * stride_lh + q_row0 * stride_ls
        dq_base = DQACC + batch64 * stride_dqb + head64 * stride_dqh + q_row0 * stride_dqs
        if HAS_ALIBI:
            alibi_slope_log2 = tl.load(ALIBI + batch64 * stride_ab + head) * LOG2E
        else:
            alibi_slope_log2 = 0.0
        dk, dv = _dkdv_inner(
            dk, dv, k, k_cols, v, q_src, do_src, q_base, do_base, lse_base, delta_base, dq_base,
            stride_qs, stride_dos, stride_ls, stride_dqs, full_lo, full_hi, cols, col0, seqlen_q,
            seqlen_k, softmax_scale, qk_scale, softcap_log2, alibi_slope_log2, window_left,
            window_right, seed_lo, seed_hi, batch, head, num_heads_q, thr, dropout_rescale,
            False, HEAD_DIM, BLOCK_M, BLOCK_D, D_SPLITS, SOFTCAP, HAS_ALIBI, HAS_WINDOW_LEFT,
            HAS_WINDOW_RIGHT, DROPOUT, TMA, ATOMIC_DQ)
        dk, dv = _dkdv_inner(
            dk, dv, k, k_cols, v, q_src, do_src, q_base, do_base, lse_base, delta_base, dq_base,
            stride_qs, stride_dos, stride_ls, stride_dqs, lo, full_lo, cols, col0, seqlen_q,
            seqlen_k, softmax_scale, qk_scale, softcap_log2, alibi_slope_log2, window_left,
            window_right, seed_lo, seed_hi, batch, head, num_heads_q, thr, dropout_rescale,
            True, HEAD_DIM, BLOCK_M, BLOCK_D, D_SPLITS, SOFTCAP, HAS_ALIBI, HAS_WINDOW_LEFT,
            HAS_WINDOW_RIGHT, DROPOUT, TMA, ATOMIC_DQ)
        dk, dv = _dkdv_inner(
            dk, dv, k, k_cols, v, q_src, do_src, q_base, do_base, lse_base, delta_base, dq_base,
            stride_qs, stride_dos, stride_ls, stride_dqs, full_hi, hi, cols, col0, seqlen_q,
            seqlen_k, softmax_scale, qk_scale, softcap_log2, alibi_slope_log2, window_left,
            window_right, seed_lo, seed_hi, batch, head, num_heads_q, thr, dropout_rescale,
            True, HEAD_DIM, BLOCK_M, BLOCK_D, D_SPLITS, SOFTCAP, HAS_ALIBI, HAS_WINDOW_LEFT,
            HAS_WINDOW_RIGHT, DROPOUT, TMA, ATOMIC_DQ)

    dk = dk * softmax_scale
    out_base = batch64 * stride_dkb + kv_head64 * stride_dkh + k_row0 * stride_dks
    if GROUP_SPLITS > 1:
        out_base += split.to(tl.int64) * stride_dkp  # this split's fp32 partial
    if D_SPLITS == 1:
        store_rows(DK + out_base, n_first, stride_dks, seqlen_k, dk.to(DK.dtype.element_ty),
                   BLOCK_N, HEAD_DIM, BLOCK_D, False)
        store_rows(DV + out_base, n_first, stride_dks, seqlen_k, dv.to(DV.dtype.element_ty),
                   BLOCK_N, HEAD_DIM, BLOCK_D, False)
    else:
        store_column_slice(DK + out_base, n_first, stride_dks, seqlen_k, col0,
                           dk.to(DK.dtype.element_ty), BLOCK_N, BLOCK_D // D_SPLITS, HEAD_DIM)
        store_column_slice(DV + out_base, n_first, stride_dks, seqlen_k, col0,
                           dv.to(DV.dtype.element_ty), BLOCK_N, BLOCK_D // D_SPLITS, HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# 3. dQ: one program per (query block, query head, batch), (M, N) orientation as the forward.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dq_inner(dq, q, do, lse_log2, delta, k_src, v_src, stride_ks, stride_vs, block_lo,
              block_hi, rows, offs_n, seqlen_q, seqlen_k, qk_scale, softcap_log2,
              alibi_slope_log2, window_left, window_right, row_hash, threshold,
              dropout_rescale, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
              HAS_ALIBI: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr,
              HAS_WINDOW_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, TMA: tl.constexpr):
    """Accumulates ``dS K`` over key blocks ``[block_lo, block_hi)``; ``k_src``/``v_src`` are
    the sequence's K/V matrices as ``rows_source`` gives them."""
    diag = seqlen_k - seqlen_q
    for block in range(block_lo, block_hi):
        start_n = block * BLOCK_N
        cols = start_n + offs_n
        k_t = load_rows_t(k_src, start_n, stride_ks, seqlen_k, BLOCK_N, HEAD_DIM, BLOCK_D,
                          MASKED, TMA)
        v_t = load_rows_t(v_src, start_n, stride_vs, seqlen_k, BLOCK_N, HEAD_DIM, BLOCK_D,
                          MASKED, TMA)
        s, t = scores_log2(tl.dot(q, k_t), rows[:, None], cols[None, :], diag, qk_scale,
                           softcap_log2, alibi_slope_log2, SOFTCAP, HAS_ALIBI)
        if MASKED:
            ok = visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left,
                         window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
            s = tl.where(ok, s, float("-inf"))
        p = tl.exp2(s - lse_log2[:, None])
        dp = tl.dot(do, v_t)
        if DROPOUT:
            dp = tl.where(dropout_keep(row_hash, cols, threshold), dp * dropout_rescale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t))
    return dq


@triton.jit(do_not_specialize=["threshold", "seed_lo", "seed_hi"])
def _bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
        stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ls, stride_ab,
        seqlen_q_batched, seqlen_k_batched, num_heads_q,
        softmax_scale, qk_scale, softcap_log2, window_left, window_right,
        threshold, seed_lo, seed_hi, dropout_rescale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, GROUP: tl.constexpr, IS_VARLEN: tl.constexpr,
        HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
        HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, TMA: tl.constexpr):
    # Heaviest query blocks first (bottom-right causal: the last rows see the most keys).
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(
        CU_SEQLENS_Q, CU_SEQLENS_K, batch, seqlen_q_batched, seqlen_k_batched, IS_VARLEN)
    m_first = pid_m * BLOCK_M
    if m_first >= seqlen_q:
        return
    m_last = tl.minimum(m_first + BLOCK_M, seqlen_q) - 1

    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    kv_head64 = (head // GROUP).to(tl.int64)
    q_row0 = tl.cast(q_start, tl.int64)
    k_row0 = tl.cast(k_start, tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    rows = m_first + offs_m
    m_ok = rows < seqlen_q
    q_src = rows_source(Q + batch64 * stride_qb + head64 * stride_qh + q_row0 * stride_qs,
                        seqlen_q, stride_qs, BLOCK_M, HEAD_DIM, BLOCK_D, TMA)
    do_src = rows_source(DO + batch64 * stride_dob + head64 * stride_doh + q_row0 * stride_dos,
                         seqlen_q, stride_dos, BLOCK_M, HEAD_DIM, BLOCK_D, TMA)
    k_src = rows_source(K + batch64 * stride_kb + kv_head64 * stride_kh + k_row0 * stride_ks,
                        seqlen_k, stride_ks, BLOCK_N, HEAD_DIM, BLOCK_D, TMA)
    v_src = rows_source(V + batch64 * stride_vb + kv_head64 * stride_vh + k_row0 * stride_vs,
                        seqlen_k, stride_vs, BLOCK_N, HEAD_DIM, BLOCK_D, TMA)
    q = load_rows(q_src, m_first, stride_qs, seqlen_q, BLOCK_M, HEAD_DIM, BLOCK_D, True, TMA)
    do = load_rows(do_src, m_first, stride_dos, seqlen_q, BLOCK_M, HEAD_DIM, BLOCK_D, True, TMA)
    lse_offs = (batch64 * stride_lb + head64 * stride_lh + (q_row0 + m_first) * stride_ls
                + offs_m * stride_ls)
    lse_log2 = safe_lse_log2(tl.load(LSE + lse_offs, mask=m_ok, other=0.0))
    delta = tl.load(DELTA + lse_offs, mask=m_ok, other=0.0)
    if HAS_ALIBI:
        alibi_slope_log2 = tl.load(ALIBI + batch64 * stride_ab + head) * LOG2E
    else:
        alibi_slope_log2 = 0.0
    if DROPOUT:
        row_hash = dropout_row_hash(seed_lo, seed_hi, batch, head, num_heads_q, rows)
        thr = threshold.to(tl.uint32)
    else:
        row_hash = 0
        thr = 0
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo, full_lo, full_hi, hi = key_block_range(m_first, m_last, seqlen_q, seqlen_k,
                                               window_left, window_right, BLOCK_N,
                                               HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
    dq = _dq_inner(dq, q, do, lse_log2, delta, k_src, v_src, stride_ks, stride_vs, full_lo, full_hi,
                   rows, offs_n, seqlen_q, seqlen_k, qk_scale, softcap_log2, alibi_slope_log2,
                   window_left, window_right, row_hash, thr, dropout_rescale, False, HEAD_DIM,
                   BLOCK_N, BLOCK_D, SOFTCAP, HAS_ALIBI, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT,
                   DROPOUT, TMA)
    dq = _dq_inner(dq, q, do, lse_log2, delta, k_src, v_src, stride_ks, stride_vs, lo, full_lo,
                   rows, offs_n, seqlen_q, seqlen_k, qk_scale, softcap_log2, alibi_slope_log2,
                   window_left, window_right, row_hash, thr, dropout_rescale, True, HEAD_DIM,
                   BLOCK_N, BLOCK_D, SOFTCAP, HAS_ALIBI, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT,
                   DROPOUT, TMA)
    dq = _dq_inner(dq, q, do, lse_log2, delta, k_src, v_src, stride_ks, stride_vs, full_hi, hi,
                   rows, offs_n, seqlen_q, seqlen_k, qk_scale, softcap_log2, alibi_slope_log2,
                   window_left, window_right, row_hash, thr, dropout_rescale, True, HEAD_DIM,
                   BLOCK_N, BLOCK_D, SOFTCAP, HAS_ALIBI, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT,
                   DROPOUT, TMA)

    dq = dq * softmax_scale
    store_rows(DQ + batch64 * stride_dqb + head64 * stride_dqh + q_row0 * stride_dqs, m_first,
               stride_dqs, seqlen_q, dq.to(DQ.dtype.element_ty), BLOCK_M, HEAD_DIM, BLOCK_D,
               False)


# ---------------------------------------------------------------------------------------------
# Tile sizes: the one table of defaults, keyed by (arch, BLOCK_D). `python -m flash_attn_hub tune bwd`
# measures candidates on a GPU and writes `triton_bwd_configs.json` beside this file, keyed by
# GPU name, BLOCK_D and sequence-length bucket; its entries, with their measured reasons, take
# precedence (`tuning`).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BwdTiles:
    """One row of the table: each of the two main kernels has its own tiles and launch shape
    (they are independent launches, so the tuning script sweeps them one at a time)."""
    dkdv_block_m: int  # query rows per inner step of the dK/dV kernel
    dkdv_block_n: int  # keys owned by one dK/dV program (its two fp32 accumulators)
    dkdv_warps: int
    dkdv_stages: int
    dq_block_m: int  # queries owned by one dQ program
    dq_block_n: int  # keys per inner step of the dQ kernel
    dq_warps: int
    dq_stages: int
    reason: str = ""
    dkdv_tma: bool = False  # dK/dV kernel reads K, V, Q, dO through tensor descriptors
    dq_tma: bool = False  # dQ kernel reads Q, dO, K, V through tensor descriptors
    # deterministic=False only: dQ accumulated with fp32 atomics in the dK/dV kernel, no dQ
    # kernel ([Note: atomic dQ]); the dq_* fields then go unused
    atomic_dq: bool = False
    # dK/dV programs per key block, each owning a slice of the head dim ([Note: head-dim split])
    dkdv_d_splits: int = 1


_T = BwdTiles
# sm90 D=128 is the configuration timed on an H200 (bf16, 16k tokens): about 350 TFLOP/s
# backward, 1.15-1.2x SDPA flash. The H200's tuning-file entry supersedes it there (tuned on
# MHA and GQA together: 1.24-1.31x SDPA flash). Query steps of 16 rows, which ptxas prefers
# (fewer spilled registers), measured 3x slower (102-124 TFLOP/s): the dK/dV dots then have K=16 and
# the loop runs 4x more iterations, which costs far more than the few spilled registers of
# 64-row steps. Other entries follow the same shapes, scaled by the register budget (a dK/dV
# program holds two BLOCK_N x BLOCK_D fp32 accumulators; D=256 halves the tiles), untimed.
# The sm90 D=128/256 rows now carry the H200's tuned choices (descriptors for dK/dV at D=128,
# atomic dQ at D=256) so that every Hopper GPU starts from them. ptxas sm_90a, D=128, bf16: dK/dV
# 64x128 x 8 warps spills 2.7 -> 2.2 KB at 3 stages, 2.2 -> 1.3 KB at 2, 0.6 -> 0.4 KB at 1;
# dQ 128x64 goes from 255 registers (24 B spilled) to 180, no spill.
TILES = {
    ("sm90", 16): _T(64, 128, 8, 3, 128, 64, 8, 3, "untimed: small D, as D=64"),
    ("sm90", 32): _T(64, 128, 8, 3, 128, 64, 8, 3, "untimed: small D, as D=64"),
    ("sm90", 64): _T(64, 128, 8, 3, 128, 64, 8, 3, "untimed: 2x128x64 fp32 acc, 64 regs/th"),
    ("sm90", 128): _T(64, 64, 4, 2, 128, 64, 8, 3,
                      "H200 tune, MHA+GQA: 4-warp dK/dV programs of 64 keys, two per SM, "
                      "geo-mean 389 at 4k and 423 at 16k against 363 / 403 for 8 warps x 128 "
                      "keys; ptxas: 255 regs, 860 B spilled (1192 B causal)", dkdv_tma=True),
    ("sm90", 256): _T(32, 64, 8, 2, 64, 32, 8, 2, "H200 tune, S=4k: 165/160 full/causal with "
                      "atomic dQ (deterministic calls keep the dQ kernel), 142/136 without",
                      atomic_dq=True),
    ("sm80", 16): _T(64, 128, 8, 3, 128, 64, 8, 3, "untimed: as sm90"),
    ("sm80", 32): _T(64, 128, 8, 3, 128, 64, 8, 3, "untimed: as sm90"),
    ("sm80", 64): _T(64, 128, 8, 3, 128, 64, 8, 3, "untimed: as sm90"),
    ("sm80", 128): _T(32, 128, 8, 2, 128, 32, 8, 2, "untimed: Ampere 164 KB smem, thinner steps"),
    ("sm80", 256): _T(32, 64, 8, 1, 64, 32, 8, 1, "untimed: Ampere, D=256 register-bound"),
}
for _d in HEAD_DIM_BUCKETS:
    # Other archs (consumer parts have ~100 KB of shared memory): sm80's shapes, smaller at 256.
    TILES[("generic", _d)] = (_T(32, 32, 4, 1, 32, 16, 4, 1, "untimed: unknown arch, D=256")
                              if _d == 256 else _T(32, 64, 4, 2, 64, 32, 4, 2,
                                                   "untimed: unknown arch, small tiles"))
    # Interpreter: small, unequal steps so small test shapes cross several blocks both ways.
    TILES[("interpreter", _d)] = _T(16, 32, 1, 1, 32, 16, 1, 1, "interpreter: tests cross blocks")
del _d, _T
CONFIG_FILE = Path(__file__).with_name("triton_bwd_configs.json")
# No reference GPU for the backward: the H200's D=64 row (4-warp 64 x 64 dK/dV, atomic dQ,
# tuned on MHA) ran 0.88-0.97x these rows on an H100 with GQA 32/8 and 64/8 at 1k-16k keys
# (1.03-1.09x MHA; tools/ab_bench.py, FlexAttention level in the same processes), so every
# GPU but the H200 keeps the in-code rows.
TABLE = TileTable("backward", CONFIG_FILE, TILES, BwdTiles)
DELTA_BLOCK_M = 64  # rows per program of the rowsum(dO * O) pass: memory-bound, any size works


def tile_config(head_dim: int, device: torch.device, seqlen: int) -> BwdTiles:
    """The tiles of a call: measured for this GPU if the tuning file has them, else the table."""
    return TABLE.for_call(device, head_dim, seqlen)


# [Note: head-dim split] A dK/dV program holds two BLOCK_N x BLOCK_D fp32 accumulators; at
# D=256 that is 2 x 64 x 256 x 4 B = 128 KB of registers for a 64-key block, so the tiles shrink
# until the dots are too small to be efficient and ptxas still spills (the H200 measured
# 135-165 TFLOP/s, 0.55x SDPA flash). With ``dkdv_d_splits = 2`` each key block gets two
# programs, each owning half of the head dim of dK and dV (and of dQ on the atomic path): both
# compute the full S^T = K Q^T and dP^T = V dO^T (they contract over the whole head dim) and
# then the dV, dK dots on their half, reading that half of Q, dO (and K) as a column slice.
# The score dots are done twice, 6 instead of 4 M*N*D per step, for half the accumulators.
# Untimed: the tuning script searches it (D=128 and 256).

def backward(dout, q, k, v, out, lse, dq, dk, dv, ds_aux, *, cu_seqlens_q, cu_seqlens_k, s_aux,
             alibi_slopes, params: AttnParams, tiles: BwdTiles | None = None,
             group_splits: int | None = None) -> None:
    """Write ``dq`` (like q), ``dk``/``dv`` (like k/v, summed over each kv head's query group)
    and ``ds_aux`` (float32 ``(Hq,)``, when ``s_aux`` is given).

    Batched: q ``(B, Sq, Hq, D)``, lse ``(B, Hq, Sq)``; varlen (``cu_seqlens_q`` given): q
    ``(Tq, Hq, D)``, lse ``(Hq, Tq)``. Inputs are validated by the caller. ``tiles`` overrides
    the tile table and ``group_splits`` the dK/dV launch's :func:`dkdv_group_splits` (a divisor
    of Hq // Hkv; tests use both)."""
    shape = LaunchShape.of(q, k, cu_seqlens_q, params)
    assert shape.heads_q % shape.heads_kv == 0 and dout.stride(-1) == 1 and out.stride(-1) == 1
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    cfg = tiles or tile_config(shape.head_dim, q.device, shape.longest)
    scalars, flags = shared_arguments(shape, params, alibi_slopes)
    has_q = shape.batch > 0 and shape.max_seqlen_q > 0
    has_k = shape.batch > 0 and shape.max_seqlen_k > 0

    if has_q:
        grid = (triton.cdiv(shape.max_seqlen_q, DELTA_BLOCK_M), shape.heads_q, shape.batch)
        _bwd_delta_kernel[grid](
            out, dout, delta, cu_seqlens_q, *shape.seq_strides(out), *shape.seq_strides(dout),
            *shape.lse_strides(lse), shape.seqlen_q, HEAD_DIM=flags["HEAD_DIM"],
            BLOCK_D=flags["BLOCK_D"], BLOCK_M=DELTA_BLOCK_M, IS_VARLEN=shape.varlen)

    strides = (*shape.seq_strides(q), *shape.seq_strides(k), *shape.seq_strides(v),
               *shape.seq_strides(dout))
    scalars.update(softmax_scale=params.softmax_scale)
    atomic_dq = cfg.atomic_dq and not params.deterministic
    # fp32 dQ accumulator of the atomic path; the dQ kernel's output otherwise (never read)
    dq_acc = torch.zeros(dq.shape, device=dq.device, dtype=torch.float32) if atomic_dq else dq
    if has_k:
        key_blocks = triton.cdiv(shape.max_seqlen_k, cfg.dkdv_block_n)
        group = flags["GROUP"]
        if group_splits is None:
            banded = params.window_left >= 0 or params.window_right >= 0
            group_splits = dkdv_group_splits(key_blocks * shape.heads_kv * shape.batch, group,
                                             sm_count(q.device), banded=banded)
        elif group_splits < 1 or group % group_splits:
            raise ValueError(f"group_splits must divide Hq // Hkv = {group}; got {group_splits}")
        if group_splits == 1:
            dk_dst, dv_dst, split_stride = dk, dv, 0
        else:  # [Note: group split] in _heuristics
            partial = torch.empty((2, group_splits, *dk.shape), device=dk.device,
                                  dtype=torch.float32)
            dk_dst, dv_dst, split_stride = partial[0], partial[1], partial.stride(1)
        assert cfg.dkdv_d_splits in (1, 2, 4), "a power of two that divides every BLOCK_D >= 16"
        d_splits = cfg.dkdv_d_splits if flags["BLOCK_D"] // cfg.dkdv_d_splits >= 16 else 1
        grid = (key_blocks * group_splits * d_splits, shape.heads_kv, shape.batch)
        _bwd_dkdv_kernel[grid](
            q, k, v, dout, lse, delta, dk_dst, dv_dst, dq_acc, cu_seqlens_q, cu_seqlens_k,
            alibi_slopes, *strides, *shape.seq_strides(dk), split_stride,
            *shape.seq_strides(dq_acc), *shape.lse_strides(lse), **scalars,
            BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n, GROUP_SPLITS=group_splits,
            TMA=use_tma(cfg.dkdv_tma, q.device, shape, q, k, v, dout), ATOMIC_DQ=atomic_dq,
            D_SPLITS=d_splits, num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages, **flags)
        if group_splits > 1:
            dk.copy_(dk_dst.sum(dim=0))
            dv.copy_(dv_dst.sum(dim=0))
    if atomic_dq:
        dq.copy_(dq_acc)
    elif has_q:
        grid = (triton.cdiv(shape.max_seqlen_q, cfg.dq_block_m), shape.heads_q, shape.batch)
        _bwd_dq_kernel[grid](
            q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
            *strides, *shape.seq_strides(dq), *shape.lse_strides(lse), **scalars,
            BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
            TMA=use_tma(cfg.dq_tma, q.device, shape, q, k, v, dout),
            num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, **flags)
    if ds_aux is not None:
        ds_aux.copy_(sink_gradient(s_aux, lse, delta, shape.varlen))
