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

Helpers: ``scores_log2`` (the score hook: scale, softcap, ALiBi) with its host-side
``score_constants``; ``visible`` (the band mask); ``key_block_range`` (which key blocks a query
block sees, split into unmasked interior and masked edges); ``dropout_row_hash``/``dropout_keep``
with host-side ``dropout_constants``; ``tanh``; ``LOG2E`` (a constexpr).
"""

import triton
import triton.language as tl

# A constexpr: compiled kernels may read only constexpr globals (the interpreter does not check
# this). Host code uses ``LOG2E.value``.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def mix32(x):
    """uint32 finaliser of the dropout RNG (tests/reference.py: ``mix32``)."""
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
def visible(rows, cols, seqlen_q, seqlen_k, window_left, window_right,
            HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr):
    """(BLOCK_M, BLOCK_N) visibility of key ``cols`` from query ``rows``, bounds included."""
    diag = rows[:, None] + (seqlen_k - seqlen_q)
    ok = (cols[None, :] < seqlen_k) & (rows[:, None] < seqlen_q)
    if HAS_WINDOW_LEFT:
        ok = ok & (cols[None, :] >= diag - window_left)
    if HAS_WINDOW_RIGHT:
        ok = ok & (cols[None, :] <= diag + window_right)
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
    ``tests/reference.dropout_keep_mask`` (keep iff hash >= threshold)."""
    threshold = min(int(dropout_p * 2**32), 0xFFFFFFFF)
    return threshold, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


@triton.jit
def tanh(x):
    """``tanh`` from one ``exp2``, saturating to +-1 without inf/inf (libdevice-free, so the
    interpreter runs it too). Absolute error ~1e-7, which is what the score needs."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def scores_log2(qk, rows, cols, diag, qk_scale, softcap_log2, alibi_slope_log2,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Score hook: raw fp32 ``qk = q.k`` tile -> scores in log2 units (before masking).

    ``rows``/``cols`` are sequence-local indices, ``diag = Sk - Sq``, the constants come from
    :func:`score_constants` and ``alibi_slope_log2 = slope * log2(e)``. With SOFTCAP the result
    is ``softcap_log2 * t`` with ``t = tanh(qk * scale / softcap)``, so a backward recovers
    ``t = s / softcap_log2`` for the chain rule ``1 - t^2`` (before ALiBi is subtracted)."""
    s = qk * qk_scale
    if SOFTCAP:
        s = softcap_log2 * tanh(s)
    if HAS_ALIBI:
        dist = tl.abs(rows[:, None] + diag - cols[None, :]).to(tl.float32)
        s = s - alibi_slope_log2 * dist
    return s


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
