"""Triton building blocks shared by the forward and backward kernels.

Glossary (all kernels):
  Q, K, V, O, DO   tiles of queries, keys, values, output, output gradient
  BLOCK_M/BLOCK_N  query rows / key columns per tile
  GROUP            Hq // Hkv, query heads per kv head (GQA; 1 = MHA, Hq = MQA)
  DIAG             Sk - Sq of the current sequence: query i sits on key diagonal i + DIAG
  WINDOW_LEFT/RIGHT  band half-widths, -1 = unbounded (causal = right 0)

[Note: score pipeline] scores are computed in log2 units: ``s2 = q.k * scale * log2(e)``
so the loop can use ``exp2``. Softcap and ALiBi are defined on natural-unit
scores, so when SOFTCAP is on we undo the fold inside the hook; ALiBi slopes are
multiplied by log2(e) once per program. The same hooks run in forward and
backward, so both see bitwise the same scores.

Kernel helpers: ``sequence_bounds`` (a sequence's start and lengths, batched or varlen);
``scores_log2`` (the score hook: scale, softcap, ALiBi) with its host-side
``score_constants``; ``visible`` (the band mask, either tile orientation); ``key_block_range`` /
``query_block_range`` (which key blocks a query block sees, and the mirror, split into unmasked
interior and masked edges); ``safe_lse_log2`` (LSE for recomputing P); ``load_rows`` /
``load_rows_t`` / ``store_rows`` (tiles of a (rows, D) matrix, pointers or descriptors) and
``load_column_slice`` / ``store_column_slice`` (a slice of its columns);
``dropout_row_hash``/``dropout_keep`` with host-side ``dropout_constants``; ``tanh``; ``LOG2E``
(a constexpr); ``inner_loop`` (the forward's key loop, which the split-KV decode runs too).
Launcher helpers: ``LaunchShape`` (sizes and strides of a call), ``shared_arguments`` (the
scalars and constexpr flags every kernel takes by the same name) and ``use_tma``.
"""

import dataclasses
import functools
import logging

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .._heuristics import hopper_or_later
from .launch import Bound, CachedLauncher
from .tuning import block_d_for

logger = logging.getLogger("flash_attn")

# A constexpr: compiled kernels may read only constexpr globals (the interpreter does not check
# this). Host code uses ``LOG2E.value``.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def mix32(x):
    """uint32 finaliser of the dropout RNG (flash_attn_hub/reference.py: ``mix32``)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    x = x ^ (x >> 15)
    return x


@triton.jit
def dropout_row_hash(seed_lo, seed_hi, batch, head, num_heads_q, rows):
    """Per-row part of the dropout hash; ``rows`` are sequence-local query indices."""
    bh = (batch * num_heads_q + head).to(tl.uint32) + seed_hi.to(tl.uint32)
    base = mix32(seed_lo.to(tl.uint32) ^ mix32(bh))
    return mix32(base ^ rows.to(tl.uint32))


@triton.jit
def dropout_keep(row_hash, cols, threshold):
    """Keep-mask of a tile: ``row_hash`` (BLOCK_M,) uint32, ``cols`` (BLOCK_N,) local key
    indices, ``threshold`` uint32 = floor(p * 2**32)."""
    r = mix32(row_hash[:, None] ^ cols.to(tl.uint32)[None, :])
    return r >= threshold


@triton.jit
def visible(rows2, cols2, seqlen_q, seqlen_k, window_left, window_right,
            HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr):
    """Visibility of key ``cols2`` from query ``rows2``, sequence bounds included. The indices
    arrive broadcast to 2-D in either orientation (``rows[:, None], cols[None, :]`` for an
    (M, N) tile, ``rows[None, :], cols[:, None]`` for the transposed (N, M) tile)."""
    diag2 = rows2 + (seqlen_k - seqlen_q)
    ok = (cols2 < seqlen_k) & (rows2 < seqlen_q)
    if HAS_WINDOW_LEFT:
        ok = ok & (cols2 >= diag2 - window_left)
    if HAS_WINDOW_RIGHT:
        ok = ok & (cols2 <= diag2 + window_right)
    return ok


def score_constants(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """Host side of the score hook: ``(qk_scale, softcap_log2)`` for :func:`scores_log2`.

    Without softcap ``qk_scale = scale * log2(e)`` (the fold, done once) and ``softcap_log2``
    is unused; with softcap ``qk_scale = scale / softcap`` (the tanh argument) and
    ``softcap_log2 = softcap * log2(e)``."""
    if softcap > 0:
        return softmax_scale / softcap, softcap * LOG2E.value
    return softmax_scale * LOG2E.value, 0.0


def dropout_constants(dropout_p: float, seed: int) -> tuple[int, int, int]:
    """Host side of the dropout hash: ``(threshold, seed_lo, seed_hi)``, the uint32 values of
    ``flash_attn_hub.reference.dropout_keep_mask`` (keep iff hash >= threshold)."""
    threshold = min(int(dropout_p * 2**32), 0xFFFFFFFF)
    return threshold, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


@triton.jit
def tanh(x):
    """``tanh`` from one ``exp2``, saturating to +-1 without inf/inf (libdevice-free, so the
    interpreter runs it too). Absolute error ~1e-7, which is what the score needs."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def scores_log2(qk, rows2, cols2, diag, qk_scale, softcap_log2, alibi_slope_log2,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Score hook: raw fp32 ``qk = q.k`` tile -> ``(s2, t)``, scores in log2 units (before
    masking) and, with SOFTCAP, ``t = tanh(qk * scale / softcap)`` for the backward's chain rule
    ``1 - t^2`` (otherwise ``t`` is ``s2``; the forward drops it).

    ``rows2``/``cols2`` are sequence-local indices broadcast to 2-D as for :func:`visible`,
    ``diag = Sk - Sq``, the constants come from :func:`score_constants` and
    ``alibi_slope_log2 = slope * log2(e)``. With SOFTCAP ``s2 = softcap_log2 * t`` (ALiBi is
    subtracted after)."""
    s = qk * qk_scale
    t = s
    if SOFTCAP:
        t = tanh(s)
        s = softcap_log2 * t
    if HAS_ALIBI:
        s = s - alibi_slope_log2 * tl.abs(rows2 + diag - cols2).to(tl.float32)
    return s, t


@triton.jit
def safe_lse_log2(lse):
    """LSE (natural) -> log2 units for ``P = exp2(s2 - lse2)``; -inf (a row that sees no key)
    -> +inf, so that P = 0 there for finite and masked scores alike, never NaN."""
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, batch, seqlen_q_batched, seqlen_k_batched,
                    IS_VARLEN: tl.constexpr):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of sequence ``batch``: its first token on the
    packed token axis and its lengths from cu_seqlens (varlen), or 0 and the batched sizes."""
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + batch)
        seqlen_q = tl.load(CU_SEQLENS_Q + batch + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + batch)
        seqlen_k = tl.load(CU_SEQLENS_K + batch + 1) - k_start
    else:
        q_start = 0
        k_start = 0
        seqlen_q = seqlen_q_batched
        seqlen_k = seqlen_k_batched
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def key_block_range(m_first, m_last, seqlen_q, seqlen_k, window_left, window_right,
                    BLOCK_N: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr,
                    HAS_WINDOW_RIGHT: tl.constexpr):
    """Key blocks (index ``n`` covers keys ``[n * BLOCK_N, (n + 1) * BLOCK_N)``) that query rows
    ``m_first..m_last`` (valid, sequence-local) can see, split by whether they need a mask.

    Returns ``(lo, full_lo, full_hi, hi)`` with ``lo <= full_lo <= full_hi <= hi``:
    blocks ``[full_lo, full_hi)`` are visible to every row and lie inside ``seqlen_k`` (no mask);
    ``[lo, full_lo)`` and ``[full_hi, hi)`` are band or sequence edges (masked); blocks outside
    ``[lo, hi)`` are invisible to every row and are skipped. Integer division only ever sees
    non-negative operands (truncation and floor then agree, on the GPU and in the interpreter)."""
    diag = seqlen_k - seqlen_q
    if HAS_WINDOW_LEFT:
        first_key = tl.maximum(m_first + diag - window_left, 0)
        full_first_key = tl.maximum(m_last + diag - window_left, 0)
    else:
        first_key = 0
        full_first_key = 0
    if HAS_WINDOW_RIGHT:
        end_key = tl.maximum(tl.minimum(m_last + diag + window_right + 1, seqlen_k), 0)
        full_end_key = tl.maximum(tl.minimum(m_first + diag + window_right + 1, seqlen_k), 0)
    else:
        end_key = seqlen_k
        full_end_key = seqlen_k
    lo = first_key // BLOCK_N
    hi = tl.maximum(tl.cdiv(end_key, BLOCK_N), lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_first_key, BLOCK_N), lo), hi)
    full_hi = tl.minimum(tl.maximum(full_end_key // BLOCK_N, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_block_range(n_first, n_last, seqlen_q, seqlen_k, window_left, window_right,
                      BLOCK_M: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr,
                      HAS_WINDOW_RIGHT: tl.constexpr):
    """The mirror of :func:`key_block_range`: query blocks (index ``m`` covers rows
    ``[m * BLOCK_M, (m + 1) * BLOCK_M)``) that keys ``n_first..n_last`` (valid, sequence-local)
    are visible to, as ``(lo, full_lo, full_hi, hi)``; ``[full_lo, full_hi)`` see every one of
    the keys and lie inside ``seqlen_q`` (no mask). Row ``i`` sees key ``j`` iff
    ``j - diag - right <= i <= j - diag + left``; every integer division sees non-negative
    operands."""
    diag = seqlen_k - seqlen_q
    if HAS_WINDOW_RIGHT:
        first_row = tl.maximum(n_first - diag - window_right, 0)
        full_first_row = tl.maximum(n_last - diag - window_right, 0)
    else:
        first_row = 0
        full_first_row = 0
    if HAS_WINDOW_LEFT:
        end_row = tl.maximum(tl.minimum(n_last - diag + window_left + 1, seqlen_q), 0)
        full_end_row = tl.maximum(tl.minimum(n_first - diag + window_left + 1, seqlen_q), 0)
    else:
        end_row = seqlen_q
        full_end_row = seqlen_q
    lo = first_row // BLOCK_M
    hi = tl.maximum(tl.cdiv(end_row, BLOCK_M), lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_first_row, BLOCK_M), lo), hi)
    full_hi = tl.minimum(tl.maximum(full_end_row // BLOCK_M, full_lo), hi)
    return lo, full_lo, full_hi, hi


# ---------------------------------------------------------------------------------------------
# Tile loads: one (rows, HEAD_DIM) matrix per (sequence, head), read BLOCK_R rows at a time,
# through a tensor descriptor (TMA on Hopper) or through pointers. [Note: TMA] The descriptor
# carries the matrix's bounds, so its loads zero-fill rows past ``n_rows`` and columns past
# HEAD_DIM and its stores clip them: masks are the pointer path's alone. It needs a 16-byte
# aligned base and row stride (``LaunchShape.tma_ok``) and, compiled, a global scratch for the
# descriptor (``ensure_tma_allocator``); the interpreter runs it on CPU tensors too.
# ---------------------------------------------------------------------------------------------


@triton.jit
def rows_source(base, n_rows, stride, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """What :func:`load_rows` reads: with TMA a descriptor of the (n_rows, HEAD_DIM) matrix at
    ``base`` (row stride ``stride``) in (BLOCK_R, BLOCK_D) blocks, else ``base`` itself."""
    if TMA:
        src = tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride, 1],
                                        block_shape=[BLOCK_R, BLOCK_D])
    else:
        src = base
    return src


@triton.jit
def load_rows(src, row0, stride, n_rows, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """Rows ``row0 .. row0 + BLOCK_R`` as a (BLOCK_R, BLOCK_D) tile, zeros outside the matrix.
    The pointer path checks rows against ``n_rows`` only when MASK_ROWS (interior blocks lie
    inside the sequence) and columns only when BLOCK_D is wider than HEAD_DIM."""
    if TMA:
        tile = src.load([row0, 0])
    else:
        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = src + row0.to(tl.int64) * stride + offs_r[:, None] * stride + offs_d[None, :]
        if MASK_ROWS:
            ok = ((row0 + offs_r) < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
            tile = tl.load(ptrs, mask=ok, other=0.0)
        elif BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return tile


@triton.jit
def load_rows_t(src, row0, stride, n_rows, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """:func:`load_rows` transposed, (BLOCK_D, BLOCK_R): the B operand of ``q @ k^T``. TMA
    loads the row tile and transposes it in shared memory; pointers read it transposed."""
    if TMA:
        tile = tl.trans(src.load([row0, 0]))
    else:
        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = src + row0.to(tl.int64) * stride + offs_r[None, :] * stride + offs_d[:, None]
        if MASK_ROWS:
            ok = (offs_d < HEAD_DIM)[:, None] & ((row0 + offs_r) < n_rows)[None, :]
            tile = tl.load(ptrs, mask=ok, other=0.0)
        elif BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
    return tile


@triton.jit
def load_column_slice(base, row0, stride, n_rows, col0, BLOCK_R: tl.constexpr,
                      WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Rows ``row0 .. row0 + BLOCK_R``, columns ``col0 .. col0 + WIDTH`` of the (n_rows,
    HEAD_DIM) matrix at pointer ``base``, zeros outside it (the pointer path; for kernels that
    own a slice of the head dim)."""
    offs_r = tl.arange(0, BLOCK_R)
    cols = col0 + tl.arange(0, WIDTH)
    ptrs = base + row0.to(tl.int64) * stride + offs_r[:, None] * stride + cols[None, :]
    ok = (cols < HEAD_DIM)[None, :]
    if MASK_ROWS:
        ok = ok & ((row0 + offs_r) < n_rows)[:, None]
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def store_column_slice(base, row0, stride, n_rows, col0, tile, BLOCK_R: tl.constexpr,
                       WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Store a (BLOCK_R, WIDTH) tile at rows ``row0..``, columns ``col0..``; nothing outside
    the (n_rows, HEAD_DIM) matrix."""
    offs_r = tl.arange(0, BLOCK_R)
    cols = col0 + tl.arange(0, WIDTH)
    ptrs = base + row0.to(tl.int64) * stride + offs_r[:, None] * stride + cols[None, :]
    tl.store(ptrs, tile, mask=((row0 + offs_r) < n_rows)[:, None] & (cols < HEAD_DIM)[None, :])


@triton.jit
def store_rows(dst, row0, stride, n_rows, tile, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """Store a (BLOCK_R, BLOCK_D) tile at rows ``row0..``; nothing outside the matrix."""
    if TMA:
        dst.store([row0, 0], tile)
    else:
        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = dst + row0.to(tl.int64) * stride + offs_r[:, None] * stride + offs_d[None, :]
        ok = ((row0 + offs_r) < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(ptrs, tile, mask=ok)


# ---------------------------------------------------------------------------------------------
# The forward's key loop (the regular and the split-KV forward run it).
# ---------------------------------------------------------------------------------------------


@triton.jit
def inner_loop(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, block_lo, full_lo,
               full_hi, block_hi, rows, offs_n, seqlen_q, seqlen_k, qk_scale, softcap_log2,
               alibi_slope_log2, window_left, window_right, row_hash, threshold,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr,
               HAS_WINDOW_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, TMA: tl.constexpr,
               WARP_SPECIALIZE: tl.constexpr, acc2=0.0, q2=0.0, k2_src=0, v2_src=0,
               HEAD_DIM2: tl.constexpr = 0, BLOCK_D2: tl.constexpr = 0):
    """The forward's key loop, run by the regular and the split-KV forward: online softmax
    over key blocks ``[block_lo, block_hi)`` ([Note: one key loop] in ``fwd``): blocks outside
    ``[full_lo, full_hi)`` are band or sequence edges and pay for the visibility mask.
    ``k_src``/``v_src`` are the sequence's K/V matrices as ``rows_source`` gives them. With
    BLOCK_D2 > 0 the head dim is split ([Note: split head dim] in ``fwd``): ``q``, ``k_src``,
    ``v_src``, ``acc`` hold its first HEAD_DIM - HEAD_DIM2 columns, ``q2``, ``k2_src``,
    ``v2_src``, ``acc2`` the other HEAD_DIM2 (in BLOCK_D2-wide tiles); else ``acc2`` comes back
    as given."""
    diag = seqlen_k - seqlen_q
    for block in tl.range(block_lo, block_hi, warp_specialize=WARP_SPECIALIZE):
        start_n = block * BLOCK_N
        cols = start_n + offs_n
        k_t = load_rows_t(k_src, start_n, stride_ks, seqlen_k, BLOCK_N, HEAD_DIM - HEAD_DIM2,
                          BLOCK_D, True, TMA)
        v = load_rows(v_src, start_n, stride_vs, seqlen_k, BLOCK_N, HEAD_DIM - HEAD_DIM2,
                      BLOCK_D, True, TMA)
        qk = tl.dot(q, k_t)
        if BLOCK_D2 > 0:
            k2_t = load_rows_t(k2_src, start_n, stride_ks, seqlen_k, BLOCK_N, HEAD_DIM2,
                               BLOCK_D2, True, TMA)
            v2 = load_rows(v2_src, start_n, stride_vs, seqlen_k, BLOCK_N, HEAD_DIM2, BLOCK_D2,
                           True, TMA)
            qk = tl.dot(q2, k2_t, qk)
        if SOFTCAP or HAS_ALIBI:
            s, _ = scores_log2(qk, rows[:, None], cols[None, :], diag, qk_scale,
                               softcap_log2, alibi_slope_log2, SOFTCAP, HAS_ALIBI)
            scale = 1.0
        else:
            s = qk  # raw: [Note: scale after the max]
            scale = qk_scale
        if (block < full_lo) | (block >= full_hi):  # a uniform branch, skipped inside the band
            ok = visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left,
                         window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s * scale - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dropout_keep(row_hash, cols, threshold), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        if BLOCK_D2 > 0:
            acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2)
        m_i = m_new
    return acc, l_i, m_i, acc2



# ---------------------------------------------------------------------------------------------
# Host side of the launchers: sizes, strides and the scalar/flag arguments every kernel shares.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    """Sizes of one call. Batched: ``seqlen_q/k`` are the (only) lengths; varlen: they are 0
    and each program reads its sequence's from cu_seqlens, ``max_seqlen_q/k`` sizing the grid."""
    varlen: bool
    batch: int
    seqlen_q: int
    seqlen_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int

    @classmethod
    def of(cls, q, k, cu_seqlens_q, params) -> "LaunchShape":
        varlen = cu_seqlens_q is not None
        if varlen:
            batch, seqlen_q, seqlen_k = cu_seqlens_q.numel() - 1, 0, 0
            max_q, max_k = params.max_seqlen_q, params.max_seqlen_k
        else:
            batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
            max_q, max_k = seqlen_q, seqlen_k
        return cls(varlen, batch, seqlen_q, seqlen_k, max_q, max_k, q.shape[-2], k.shape[-2],
                   q.shape[-1])

    @property
    def longest(self) -> int:
        """The sequence length that picks the tuning bucket."""
        return max(self.max_seqlen_q, self.max_seqlen_k)

    def seq_strides(self, t) -> tuple[int, int, int]:
        """(batch, sequence, head) strides of a (B, S, H, D) or varlen (T, H, D) tensor."""
        return (0, t.stride(0), t.stride(1)) if self.varlen else (t.stride(0), t.stride(1),
                                                                    t.stride(2))

    def lse_strides(self, t) -> tuple[int, int, int]:
        """(batch, head, row) strides of a (B, Hq, Sq) or varlen (Hq, Tq) tensor."""
        return self.seq_strides(t)  # the same positions: batch first, then two inner dims

    def tma_ok(self, *tensors) -> bool:
        """Whether tensor descriptors can read these (B, S, H, D) / (T, H, D) tensors: every
        (sequence, head) matrix must start 16-byte aligned and have a positive 16-byte aligned
        row stride (varlen slices and odd strides often do not: they take the pointer path)."""
        for t in tensors:
            size = t.element_size()
            strides = self.seq_strides(t)
            if (t.data_ptr() % 16 or t.stride(-1) != 1 or strides[1] <= 0
                    or any(x * size % 16 for x in strides)):
                return False
        return True


# [Note: combining splits] A split-KV call (``decode``, ``kvcache``) writes per (token, query
# head) row and split s the normalised partial ``O_s = sum_j p_j v_j / l_s`` (fp32) and ``L_s =
# m_s + log2(l_s)`` (-inf for a split that saw no key) at ``row * NUM_SPLITS + s``. With ``top =
# max(max_s L_s, sink)`` the row's denominator is ``den = sum_s 2^(L_s - top) (+ 2^(sink -
# top))`` and ``out = sum_s 2^(L_s - top) O_s / den``, ``lse = (top + log2(den)) * ln 2``. A
# row that saw no key gets out 0 and lse -inf, or lse = s_aux with a sink ([Note: sinks and
# empty rows] in ``fwd``). ``top`` is replaced by 0 while it is -inf, so no NaN forms.
# [Note: dependent combine] On sm90+ the kv-cache call launches the combine as a programmatic
# dependent launch: the attention kernel lets it start once every one of its programs has
# finished its key loop (``gdc_launch_dependents``), and the combine waits at
# ``gdc_wait``, which returns when the attention kernel has completed and its writes are
# visible. What overlaps is the combine's launch and index arithmetic with the attention
# kernel's tail, not the merge itself. H100, B=1 decode at 4k / 32k keys (graph replay):
# ~1.2 / 2.0 us passed between the two kernels, of an 11.3 / 52.6 us step; with the dependent
# launch a replayed 4k step takes 10.6 us (contiguous; 15.5 -> 14.7 with 16-key pages). Eager
# steps are unchanged: there the host has not launched the combine yet when the attention
# kernel ends.
# Splits a combine program reads as one tile: 32 x 128 fp32 partials are 16 KB, 32 registers a
# thread at 4 warps; more splits are read in chunks of this many.
COMBINE_BLOCK_S = 32


@triton.jit
def combine_kernel(
        O_PART, LSE_PART, O, LSE, S_AUX,
        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
        seqlen_q_batched, num_heads_q, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
        IS_VARLEN: tl.constexpr, HAS_SINK: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, query head) row: [Note: combining splits]. The splits' lse and
    partial rows are read BLOCK_S at a time as one tile, so a program issues its loads together
    instead of one split after another (one program per row walking 64 splits serially took
    ~30 us at batch 1 on an H100); chunks are summed in index order, the same on every run."""
    row = tl.program_id(0).to(tl.int64)  # token * Hq + head
    token = row // num_heads_q
    head = row % num_heads_q
    if IS_VARLEN:  # out (Tq, Hq, D) and lse (Hq, Tq): the token is the row
        batch = token * 0
        i = token
    else:
        batch = token // seqlen_q_batched
        i = token % seqlen_q_batched
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    first = row * num_splits
    if PDL:  # [Note: dependent combine]: the attention kernel's partials, complete and visible
        gdc_wait()
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        top = tl.maximum(top, tl.load(LSE_PART + first + s0 + offs_s,
                                      mask=s0 + offs_s < num_splits, other=float("-inf")))
    top = tl.max(top, 0)
    if HAS_SINK:
        sink = tl.load(S_AUX + head) * LOG2E
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    den = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_ok = s0 + offs_s < num_splits
        weight = tl.exp2(tl.load(LSE_PART + first + s0 + offs_s, mask=s_ok,
                                 other=float("-inf")) - top)
        part = tl.load(O_PART + (first + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                       mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        den += weight
        acc += weight[:, None] * part
    den_sum = tl.sum(den, 0)
    if HAS_SINK:
        den_sum += tl.exp2(sink - top)
    has_mass = den_sum > 0.0
    den_safe = tl.where(has_mass, den_sum, 1.0)
    lse = tl.where(has_mass, (top + tl.log2(den_safe)) / LOG2E, float("-inf"))
    tl.store(O + batch * stride_ob + i * stride_os + head * stride_oh + offs_d,
             (tl.sum(acc, 0) / den_safe).to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + batch * stride_lb + head * stride_lh + i * stride_ls, lse)


_combine = CachedLauncher(combine_kernel)


def _pow2_at_least(n: int) -> int:
    """``triton.next_power_of_2`` in plain int arithmetic (a host-time saving: Triton's is a
    constexpr function that unwraps its arguments on every call)."""
    return 1 << max(0, n - 1).bit_length()


def combine_launch(*, o_strides, l_strides, seqlen_q_batched: int, heads_q: int, splits: int,
                   head_dim: int, varlen: bool, sink: bool, pdl: bool = False) -> Bound:
    """The launch of :func:`combine_kernel` for these sizes; ``o_strides`` / ``l_strides``:
    ``(batch, seq, head)`` / ``(batch, head, seq)`` strides of out / lse (varlen: batch 0, the
    token on the seq stride). Launched as ``[(rows,)](o_part, lse_part, out, lse, s_aux)``;
    with ``pdl`` (sm90+) as a programmatic dependent launch ([Note: dependent combine])."""
    options = {"launch_pdl": True} if pdl else {}
    return _combine.bind(
        *o_strides, *l_strides, seqlen_q_batched, heads_q, splits, HEAD_DIM=head_dim,
        BLOCK_D=max(16, _pow2_at_least(head_dim)),
        BLOCK_S=min(COMBINE_BLOCK_S, max(2, _pow2_at_least(splits))), IS_VARLEN=varlen,
        HAS_SINK=sink, PDL=pdl, num_warps=4, **options)


def combine_splits(o_part, lse_part, out, lse, s_aux, *, o_strides, l_strides,
                   seqlen_q_batched: int, heads_q: int, splits: int, head_dim: int,
                   varlen: bool) -> None:
    """Launches :func:`combine_kernel` over ``lse_part.shape[0] // splits`` rows
    (:func:`combine_launch`)."""
    launch = combine_launch(o_strides=o_strides, l_strides=l_strides,
                            seqlen_q_batched=seqlen_q_batched, heads_q=heads_q, splits=splits,
                            head_dim=head_dim, varlen=varlen, sink=s_aux is not None)
    launch[(lse_part.shape[0] // splits,)](o_part, lse_part, out, lse, s_aux)


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Compiled kernels that build tensor descriptors on the device write them to a global
    scratch Triton asks an allocator for at launch. Set ours unless one is set already; Triton
    keeps it in a ContextVar, so each thread needs its own (hence a check per launch, not one
    at import, which must not touch CUDA)."""
    from triton.runtime import _allocation
    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "NullAllocator", None)
    if current is None or null is None or isinstance(current.get(), null):
        triton.set_allocator(_tma_scratch)


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def use_tma(requested: bool, device, shape: LaunchShape, *tensors) -> bool:
    """A config's ``tma`` field, granted where tensor descriptors work: Hopper or newer (or the
    interpreter) and aligned tensors; a refusal is logged once per reason."""
    if not requested:
        return False
    if device.type == "cuda" and not hopper_or_later(device):
        _log_once("flash_attn Triton: tensor descriptors need sm90+; using the pointer path")
        return False
    if not shape.tma_ok(*tensors):
        _log_once("flash_attn Triton: tensors not 16-byte aligned for tensor descriptors; "
                  "using the pointer path")
        return False
    if device.type == "cuda":
        ensure_tma_allocator()
    return True


def shared_arguments(shape: LaunchShape, params, alibi_slopes) -> tuple[dict, dict]:
    """``(scalars, flags)``: the runtime arguments and the constexpr flags that the forward and
    backward kernels take under the same names, passed as keywords."""
    qk_scale, softcap_log2 = score_constants(params.softmax_scale, params.softcap)
    threshold, seed_lo, seed_hi = dropout_constants(params.dropout_p, params.seed)
    alibi_batch_stride = 0
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_batch_stride = alibi_slopes.stride(0)
    scalars = dict(stride_ab=alibi_batch_stride, seqlen_q_batched=shape.seqlen_q,
                   seqlen_k_batched=shape.seqlen_k, num_heads_q=shape.heads_q,
                   qk_scale=qk_scale, softcap_log2=softcap_log2,
                   window_left=params.window_left, window_right=params.window_right,
                   threshold=threshold, seed_lo=seed_lo, seed_hi=seed_hi,
                   dropout_rescale=1.0 / (1.0 - params.dropout_p))
    flags = dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d_for(shape.head_dim),
                 GROUP=shape.heads_q // shape.heads_kv, IS_VARLEN=shape.varlen,
                 HAS_WINDOW_LEFT=params.window_left >= 0,
                 HAS_WINDOW_RIGHT=params.window_right >= 0, SOFTCAP=params.softcap > 0,
                 HAS_ALIBI=alibi_slopes is not None, DROPOUT=params.dropout_p > 0)
    return scalars, flags
