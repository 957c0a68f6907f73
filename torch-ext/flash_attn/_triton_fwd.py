"""Triton forward kernel (FlashAttention-2 style) and its destination-passing launcher.

Glossary (see also ``_triton_common``):
  Q, K, V, O, LSE  queries, keys, values, output, log-sum-exp (natural log, float32)
  B, Hq, Hkv       batch, query heads, kv heads; GROUP = Hq // Hkv (kv head = h // GROUP)
  BLOCK_M          query rows of one program; BLOCK_N keys per inner-loop step
  HEAD_DIM         D; BLOCK_D = max(16, next_pow2(D)), the padded tile width (masked when wider)
  m_i, l_i, acc    running row max (log2 units), running row sum, unnormalised output (fp32)
  IS_VARLEN        sequences delimited by cu_seqlens; batch strides are then unused (0)

One program computes BLOCK_M query rows of one (batch, query head). It walks the key blocks the
rows can see (``key_block_range``) in three calls of one inner loop: the band-interior blocks
without any mask, then the left and right edge blocks with the visibility mask. Causal, window,
softcap, ALiBi, sinks and dropout are compile-time hooks into that loop, not copies of it.

[Note: sinks and empty rows] With a sink the running max starts at ``s_aux * log2(e)`` and the
running sum at 1: the sink joins the denominator and contributes nothing to ``acc``. Without one
the max starts at -inf and the sum at 0. A row that sees no key ends with ``acc = 0`` and
``l_i = 0`` (out 0, lse -inf) or ``l_i = 1`` (out 0, lse s_aux). Exponents are taken against a
max that is replaced by 0 while it is still -inf, so no ``-inf - -inf`` NaN ever forms.

[Note: dropout] ``l_i`` sums the undropped probabilities (the softmax denominator and lse are
unaffected by dropout); only the ``P V`` product sees the keep-mask, and ``1 / (1 - p)`` is folded
into the final normalisation. The keep-mask is the hash of ``_triton_common`` on
sequence-local (row, key) indices, bitwise equal to ``tests/reference.dropout_keep_mask``.

[Note: offsets] Per-program bases (batch, head, sequence start) and per-block key offsets are
int64; in-tile offsets stay int32, so tensors beyond 2**31 elements address correctly.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
import triton
import triton.language as tl

from ._params import AttnParams
from ._triton_common import (LOG2E, dropout_constants, dropout_keep, dropout_row_hash,
                             key_block_range, score_constants, scores_log2, visible)

logger = logging.getLogger("flash_attn")


@triton.jit
def _inner_loop(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, block_lo, block_hi,
                rows, offs_n, offs_d, seqlen_q, seqlen_k, qk_scale, softcap_log2,
                alibi_slope_log2, window_left, window_right, row_hash, dropout_threshold,
                MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
                DROPOUT: tl.constexpr):
    """Online softmax over key blocks ``[block_lo, block_hi)``; MASKED blocks pay for the
    visibility mask and the ``seqlen_k`` bound, interior blocks load and score unmasked."""
    diag = seqlen_k - seqlen_q
    d_ok = offs_d < HEAD_DIM
    for block in range(block_lo, block_hi):
        start_n = block * BLOCK_N
        cols = start_n + offs_n
        k_ptrs = (k_base + start_n.to(tl.int64) * stride_ks
                  + offs_n[None, :] * stride_ks + offs_d[:, None])
        v_ptrs = (v_base + start_n.to(tl.int64) * stride_vs
                  + offs_n[:, None] * stride_vs + offs_d[None, :])
        if MASKED:
            n_ok = cols < seqlen_k
            k_t = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D == HEAD_DIM:
            k_t = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k_t = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        s = scores_log2(tl.dot(q, k_t), rows, cols, diag, qk_scale, softcap_log2,
                        alibi_slope_log2, SOFTCAP, HAS_ALIBI)
        if MASKED:
            ok = visible(rows, cols, seqlen_q, seqlen_k, window_left, window_right,
                         HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dropout_keep(row_hash, cols, dropout_threshold), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["dropout_threshold", "seed_lo", "seed_hi"])
def _attn_fwd_kernel(
        Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, S_AUX, ALIBI,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
        stride_lb, stride_lh, stride_ls, stride_ab,
        seqlen_q_batched, seqlen_k_batched, num_heads_q,
        qk_scale, softcap_log2, window_left, window_right,
        dropout_threshold, seed_lo, seed_hi, dropout_rescale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, GROUP: tl.constexpr, IS_VARLEN: tl.constexpr,
        HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
        HAS_ALIBI: tl.constexpr, HAS_SINK: tl.constexpr, DROPOUT: tl.constexpr):
    # Heaviest query blocks first (bottom-right causal: the last rows see the most keys).
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + batch)
        seqlen_q = tl.load(CU_SEQLENS_Q + batch + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + batch)
        seqlen_k = tl.load(CU_SEQLENS_K + batch + 1) - k_start
        k_row0 = k_start.to(tl.int64)
    else:
        q_start = 0
        seqlen_q = seqlen_q_batched
        seqlen_k = seqlen_k_batched
        k_row0 = 0
    m_first = pid_m * BLOCK_M
    if m_first >= seqlen_q:
        return
    m_last = tl.minimum(m_first + BLOCK_M, seqlen_q) - 1

    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    kv_head64 = (head // GROUP).to(tl.int64)
    q_row0 = (q_start + m_first).to(tl.int64)
    q_base = Q + batch64 * stride_qb + head64 * stride_qh + q_row0 * stride_qs
    o_base = O + batch64 * stride_ob + head64 * stride_oh + q_row0 * stride_os
    k_base = K + batch64 * stride_kb + kv_head64 * stride_kh + k_row0 * stride_ks
    v_base = V + batch64 * stride_vb + kv_head64 * stride_vh + k_row0 * stride_vs
    lse_base = LSE + batch64 * stride_lb + head64 * stride_lh + q_row0 * stride_ls

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m_first + offs_m
    m_ok = rows < seqlen_q
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    if HAS_SINK:
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(S_AUX + head) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_ALIBI:
        alibi_slope_log2 = tl.load(ALIBI + batch64 * stride_ab + head) * LOG2E
    else:
        alibi_slope_log2 = 0.0
    if DROPOUT:
        row_hash = dropout_row_hash(seed_lo, seed_hi, batch, head, num_heads_q, rows)
        threshold = dropout_threshold.to(tl.uint32)
    else:
        row_hash = 0
        threshold = 0

    lo, full_lo, full_hi, hi = key_block_range(m_first, m_last, seqlen_q, seqlen_k,
                                               window_left, window_right, BLOCK_N,
                                               HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
    acc, l_i, m_i = _inner_loop(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, full_lo, full_hi, rows, offs_n,
        offs_d, seqlen_q, seqlen_k, qk_scale, softcap_log2, alibi_slope_log2, window_left,
        window_right, row_hash, threshold, False, HEAD_DIM, BLOCK_N, BLOCK_D, SOFTCAP,
        HAS_ALIBI, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, DROPOUT)
    acc, l_i, m_i = _inner_loop(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, lo, full_lo, rows, offs_n,
        offs_d, seqlen_q, seqlen_k, qk_scale, softcap_log2, alibi_slope_log2, window_left,
        window_right, row_hash, threshold, True, HEAD_DIM, BLOCK_N, BLOCK_D, SOFTCAP,
        HAS_ALIBI, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, DROPOUT)
    acc, l_i, m_i = _inner_loop(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, full_hi, hi, rows, offs_n,
        offs_d, seqlen_q, seqlen_k, qk_scale, softcap_log2, alibi_slope_log2, window_left,
        window_right, row_hash, threshold, True, HEAD_DIM, BLOCK_N, BLOCK_D, SOFTCAP,
        HAS_ALIBI, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, DROPOUT)

    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    if DROPOUT:
        out = acc * (dropout_rescale / l_safe)[:, None]
    else:
        out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(has_mass, (m_i + tl.log2(l_safe)) / LOG2E, float("-inf"))
    tl.store(o_base + offs_m[:, None] * stride_os + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_base + offs_m * stride_ls, lse, mask=m_ok)


# ---------------------------------------------------------------------------------------------
# Tile sizes: the one table. Keyed by (arch, BLOCK_D); entries are
# (BLOCK_M, BLOCK_N, num_warps, num_stages, reason). No GPU timing stands behind the defaults
# yet: each reason quotes ptxas for a bf16 compile of the kernel with every feature on (registers
# per thread, spills, shared memory), the static constraint that ruled out the neighbours.
# `benchmarks/tune_triton_fwd.py` times candidates on a GPU and writes `triton_fwd_configs.json`
# beside this file; its entries, with their measured reasons, replace the defaults below for the
# (arch, BLOCK_D) they name.
# ---------------------------------------------------------------------------------------------

_SM90_64 = (128, 64, 8, 3, "ptxas sm90: 225 regs, 0 spills, 64 KB smem; 4 warps hit 255 and spill")
_SM80_64 = (128, 64, 8, 3, "ptxas sm80: 189 regs, 0 spills, 48 KB smem; 4 warps hit 255 regs")
_INTERP = (32, 16, 1, 1, "interpreter: small, BLOCK_M != BLOCK_N, so tests cross both kinds")
TILES = {
    ("sm90", 16): _SM90_64,
    ("sm90", 32): _SM90_64,
    ("sm90", 64): _SM90_64,
    ("sm90", 128): (128, 64, 8, 3, "ptxas sm90: 255 regs, 0 spills, 128 KB smem; 128x128 "
                                   "spills 52 B, 4 warps spill"),
    ("sm90", 256): (128, 32, 8, 2, "ptxas sm90: 255 regs, 0 spills, 128 KB smem; 64x64 spills "
                                   "32 B, 128x64 spills 68 B"),
    ("sm80", 16): _SM80_64,
    ("sm80", 32): _SM80_64,
    ("sm80", 64): _SM80_64,
    ("sm80", 128): (128, 64, 8, 2, "ptxas sm80: 255 regs, 0 spills, 64 KB smem; 4 warps spill "
                                   "44 B"),
    ("sm80", 256): (64, 64, 8, 2, "ptxas sm80: 255 regs, 32 B spills, 104 KB smem; 128x32 "
                                  "spills 868 B, 4 warps 360 B"),
    ("generic", 16): (64, 64, 4, 2, "unknown arch: conservative, small smem footprint"),
    ("generic", 32): (64, 64, 4, 2, "unknown arch: conservative, small smem footprint"),
    ("generic", 64): (64, 64, 4, 2, "unknown arch: conservative, small smem footprint"),
    ("generic", 128): (64, 64, 4, 2, "unknown arch: conservative, small smem footprint"),
    ("generic", 256): (64, 32, 4, 1, "unknown arch: smallest smem footprint"),
    ("interpreter", 16): _INTERP,
    ("interpreter", 32): _INTERP,
    ("interpreter", 64): _INTERP,
    ("interpreter", 128): _INTERP,
    ("interpreter", 256): _INTERP,
}
CONFIG_FILE = Path(__file__).with_name("triton_fwd_configs.json")


@functools.cache
def _tuned_tiles() -> dict:
    """Measured entries from ``triton_fwd_configs.json`` (absent file: no overrides)."""
    if not CONFIG_FILE.exists():
        return {}
    entries = json.loads(CONFIG_FILE.read_text())["forward"]
    logger.info("Triton forward tiles: %d measured entries from %s", len(entries), CONFIG_FILE.name)
    return {(e["arch"], int(e["block_d"])): (int(e["block_m"]), int(e["block_n"]),
                                             int(e["num_warps"]), int(e["num_stages"]),
                                             e["reason"]) for e in entries}


def block_d_for(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def arch_of(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    return {9: "sm90", 8: "sm80"}.get(major, "generic")


def tile_config_for(arch: str, head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for this head dim on ``arch``."""
    key = (arch, block_d_for(head_dim))
    block_m, block_n, num_warps, num_stages, _ = _tuned_tiles().get(key, TILES[key])
    return block_m, block_n, num_warps, num_stages


def tile_config(head_dim: int, device: torch.device) -> tuple[int, int, int, int]:
    return tile_config_for(arch_of(device), head_dim)


def forward(q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
            params: AttnParams, tiles: tuple[int, int, int, int] | None = None) -> None:
    """Write attention of ``q, k, v`` into ``out`` (like q) and ``lse`` (float32).

    Batched: q ``(B, Sq, Hq, D)``, lse ``(B, Hq, Sq)``; varlen (``cu_seqlens_q`` given): q
    ``(Tq, Hq, D)``, lse ``(Hq, Tq)``. Inputs are validated by the caller. ``tiles`` overrides
    the tile table (tests and the tuning script use it)."""
    varlen = cu_seqlens_q is not None
    head_dim = q.shape[-1]
    num_heads_q, num_heads_kv = q.shape[-2], k.shape[-2]
    assert num_heads_q % num_heads_kv == 0 and q.stride(-1) == 1 and out.is_contiguous()
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        seqlen_q = seqlen_k = 0
        max_seqlen_q = params.max_seqlen_q
        q_strides = (0, q.stride(0), q.stride(1))
        k_strides = (0, k.stride(0), k.stride(1))
        v_strides = (0, v.stride(0), v.stride(1))
        o_strides = (0, out.stride(0), out.stride(1))
        lse_strides = (0, lse.stride(0), lse.stride(1))
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = k.shape[1]
        max_seqlen_q = seqlen_q
        q_strides = (q.stride(0), q.stride(1), q.stride(2))
        k_strides = (k.stride(0), k.stride(1), k.stride(2))
        v_strides = (v.stride(0), v.stride(1), v.stride(2))
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1), lse.stride(2))
    if batch == 0 or max_seqlen_q == 0 or num_heads_q == 0:
        return
    block_m, block_n, num_warps, num_stages = tiles or tile_config(head_dim, q.device)
    qk_scale, softcap_log2 = score_constants(params.softmax_scale, params.softcap)
    dropout = params.dropout_p > 0
    threshold, seed_lo, seed_hi = dropout_constants(params.dropout_p, params.seed)
    dropout_rescale = 1.0 / (1.0 - params.dropout_p)
    alibi_batch_stride = 0
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_batch_stride = alibi_slopes.stride(0)
    grid = (triton.cdiv(max_seqlen_q, block_m), num_heads_q, batch)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
        *q_strides, *k_strides, *v_strides, *o_strides, *lse_strides, alibi_batch_stride,
        seqlen_q, seqlen_k, num_heads_q,
        qk_scale, softcap_log2, params.window_left, params.window_right,
        threshold, seed_lo, seed_hi, dropout_rescale,
        HEAD_DIM=head_dim, BLOCK_D=block_d_for(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        GROUP=num_heads_q // num_heads_kv, IS_VARLEN=varlen,
        HAS_WINDOW_LEFT=params.window_left >= 0, HAS_WINDOW_RIGHT=params.window_right >= 0,
        SOFTCAP=params.softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_SINK=s_aux is not None, DROPOUT=dropout,
        num_warps=num_warps, num_stages=num_stages)
