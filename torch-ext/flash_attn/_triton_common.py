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
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


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
