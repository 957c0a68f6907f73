"""Triton kernels of the KV-cache calls (``flash_attn_with_kvcache``, paged
``flash_attn_varlen_func``) and their destination-passing launcher :func:`forward`.

Glossary (see also ``common``):
  B, Hq, Hkv, GROUP  batch, query heads, kv heads, GROUP = Hq // Hkv query heads per kv head
  Sq, S_NEW          query rows and new keys of a sequence
  position           a key's index in its sequence's cache. Sequence ``b`` reads positions
                     ``[start, start + seqlen_k)``: ``start = cache_leftpad[b]`` (else 0),
                     ``seqlen_k = cache_seqlens[b] + S_NEW - start`` (varlen: the
                     ``cu_seqlens_k`` difference, start 0). Key ``j`` is position ``start + j``
  PAGED, PAGE_SIZE   position ``n`` lives in block ``block_table[b, n // PAGE_SIZE]``, slot
                     ``n % PAGE_SIZE`` (any page size: the address is computed per key, so a
                     tile may straddle pages); contiguous caches read row ``cache_batch_idx[b]``
                     (else ``b``), slot ``n``
  PAGE_ALIGNED       pages hold whole key blocks (PAGE_SIZE a multiple of BLOCK_N, no leftpad):
                     a block reads one table entry and is a strided tile, which Triton's
                     pipeliner prefetches like a contiguous cache's (ptxas sm90, page 256,
                     16 x 64 tile: 72 KB of staged shared memory and 116 registers, against
                     40 KB and 168 for the per-key gather, which it does not pipeline)
  packed row         row ``r`` of a tile is query row ``r // GROUP`` of query head
                     ``kv_head * GROUP + r % GROUP``: the GROUP * Sq rows that read one kv head
                     share its K/V tiles (decode and multi-token decode read K/V once per kv
                     head, not once per query head); BLOCK_M packed rows per program,
                     ROW_BLOCKS = cdiv(GROUP * Sq, BLOCK_M) programs per (kv head, sequence)
  split              NUM_SPLITS ranges of whole BLOCK_N key blocks per sequence, sized on the
                     device from the sequence's own key count (lengths are never read on the
                     host); one program per (kv head and row block, split, sequence)
  partial            a split's normalised output (fp32, ``(tokens, Hq, NUM_SPLITS, D)``) and
                     its lse in log2 units (``(tokens, Hq, NUM_SPLITS)``, -inf for no key)

One launch, or two: ``_attend_kernel`` attends over the cache and, given new keys, appends
them to it ([Note: appending]), writing the output directly when there is one split;
``common.combine_kernel`` merges the splits in a fixed order, so a result never depends on
timing. Nothing is read from the device on the host and every buffer's size follows from
shapes, so a call can be captured in a CUDA graph.

[Note: appending] New key ``j`` of sequence ``b`` goes to cache position ``cache_seqlens[b] +
j``, which is key column ``first_new + j`` with ``first_new = cache_seqlens[b] - start``. No
read waits for a write: the key loop reads the columns before ``first_new`` from the cache (the
loop of a call without new keys, masked at ``first_new``) and a second loop reads the new
columns from ``k``/``v``, BLOCK_NEW at a time, rotated by the same fp32 operations that rotate
them for the cache (``_load_rows``), so the keys attended are the keys stored. Each split takes
the new columns of its own key blocks. The program of row block 0 and split 0 of each (sequence,
kv head) writes that kv head's new keys and values, BLOCK_WRITE at a time, between the two
loops (ptxas sm90: written before the cache loop, the write cost the page-16 decode kernel 37
registers; after the new-key loop, 45 with interleaved rotary; between them, none). Nothing
reads a slot that is being written, so there is no race, unless two sequences' block tables
share a page that one of them appends into. A call with Sq = 0 runs the writing programs only,
over no key. Without new keys (APPEND off) neither the second loop nor the write is compiled:
the kernel's instructions are those of the attention alone.

[Note: masked cache access] Every load and store is masked to the cache: positions past the
sequence (or past the cache), a block index outside ``[0, num_blocks)``, a cache row outside
the cache. The host checks these values on eager calls (``_kvcache_values``' [Note: value checks]);
a captured call that skips the checks reads zeros for a bad key (scored -inf: it is not a key)
and drops a bad append (the call itself still attends to that new key, read from ``k``), but
never touches memory outside the cache. ``cache_seqlens = -1`` (a padding slot) appends
nothing and sees no key.

[Note: rotary] Positions index the ``(seqlen_rotary, ROTARY_DIM / 2)`` tables; a pair ``(d,
partner(d))`` turns by its angle: ``x'[d] = x[d] cos + sign(d) x[partner] sin`` with sign -1 on
the pair's first element. Interleaved pairs are ``(2i, 2i + 1)``, GPT-NeoX pairs ``(i, i +
ROTARY_DIM / 2)``; dims past ROTARY_DIM keep ``cos = 1, sin = 0``. Computed in fp32 (by
``_load_rows``, for queries and new keys alike), rounded to the input dtype (the cache holds
rounded keys; the queries are rounded before the product, as flash-attn 2 does). A position
past the table is clamped to its last row.

Splits are merged by ``common.combine_kernel`` ([Note: combining splits] there).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .._heuristics import (KVCACHE_GATHER_PROGRAMS_PER_SM, KVCACHE_GATHER_ROWS,
                           KVCACHE_PROGRAMS_PER_SM, hopper_or_later, kvcache_splits)
from .._params import KvCacheParams
from .common import (LOG2E, combine_launch, key_block_range, score_constants, scores_log2,
                     visible)
from . import launch as _launch
from .launch import Bound, CachedLauncher, alignment, pointer_alignment, triton_state
from .tuning import block_d_for


@dataclasses.dataclass(frozen=True)
class KvTiles:
    """The attention kernel's launch shape."""
    block_m: int  # packed rows per program
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    reason: str
    programs_per_sm: int = KVCACHE_PROGRAMS_PER_SM  # what the split count fills (kvcache_splits)


def tiles_for(head_dim: int, packed_rows: int, device: torch.device, *,
              page_size: int = 0, rotary_append: bool = False) -> KvTiles:
    """Tiles by head dim, packed rows (GROUP * Sq), page size (0: a contiguous cache) and
    whether new keys are rotated in the call. BLOCK_M is the packed rows rounded up to a power
    of two between 16 (``tl.dot``'s minimum) and 64 (32 above D=128). Keys per step: 64 up to
    D=128, 32 above; a paged cache whose pages do not hold whole 64-key blocks (the per-key
    gather) takes 128 at D <= 128.

    Measured on an H100 (tools/kvcache_tiles.py, GQA 32/8, D=128, bf16, at the best split
    count of each): 4 warps were fastest or within 2% in every cell (8 warps at 64 rows cost
    1.25x at B=8 Sq=16); with pages of 16 keys, 128-key steps read 1.08-1.19x faster than 64
    (B=1 over 32k with 2 stages, B=8 Sq=16 with 3); contiguous caches were level (within 2%)
    for 32, 64 and 128 keys and 2-4 stages. ptxas sm90 (bf16, paged, causal; 3 stages): 16 x
    64 at D=128 with 4 warps 168 registers, 40 KB shared memory, no spills; D=256 16 x 32 156,
    32 x 32 <= 212. Above D=128 a call that rotates new keys (``rotary_append``) takes 16 rows:
    rotating them in registers beside a 32-row fp32 accumulator spilled (sm80 and sm90, 255
    registers; 194 with 16 rows). Three stages on Hopper, two elsewhere (sm86/sm89 have 99 KB).
    The interpreter takes 16 x 16, so small tests cross row blocks, key blocks and pages."""
    if device.type != "cuda":
        return KvTiles(16, 16, 1, 1, "interpreter: small tiles")
    block_m = max(16, min(triton.next_power_of_2(max(packed_rows, 1)),
                          64 if head_dim <= 128 else (16 if rotary_append else 32)))
    hopper = hopper_or_later(device)
    stages = 3 if hopper else 2
    block_n = 64 if head_dim <= 128 else 32
    if page_size and page_size % block_n and head_dim <= 128 and hopper:
        block_n = 128
        stages = 3 if block_m >= 64 else 2
        return KvTiles(block_m, block_n, 4, stages, "measured on an H100 and an H200",
                       KVCACHE_GATHER_PROGRAMS_PER_SM if block_m <= KVCACHE_GATHER_ROWS else
                       KVCACHE_PROGRAMS_PER_SM)
    return KvTiles(block_m, block_n, 4, stages, "measured on an H100")


@dataclasses.dataclass(frozen=True)
class NewKeyTiles:
    """How the attention kernel reads and writes new keys ([Note: appending])."""
    block_new: int  # new keys per step of the new-key loop
    new_stages: int  # software-pipeline stages of that loop
    block_write: int  # new keys per step of the write


def new_key_tiles(seqlen_new: int, block_d: int, rotary: bool, tiles: KvTiles) -> NewKeyTiles:
    """New-key tiles by count, head dim and rotary; ptxas sm90, bf16, 3 stages, registers of
    the attention kernel. Reads: 16 keys (tl.dot's least) for a decode step, up to BLOCK_N for
    chunked prefill, pipelined like the cache loop only when the loop runs more than once
    (page-256 decode: 96 without new keys, 112 with an unpipelined step, 164 pipelined). With
    rotary, 16 keys unpipelined: the fp32 rotation of 32 x 256 keys spilled at D=256, and its
    pipelined loads wanted ~300 KB of shared memory. Writes: ~16 elements per thread of 4 warps
    (a 32-key write tile took D=256 chunked prefill from 196 to 255 registers)."""
    if seqlen_new == 0:
        return NewKeyTiles(16, 1, 1)
    block_new = 16 if rotary else min(tiles.block_n, max(16, triton.next_power_of_2(seqlen_new)))
    stages = 1 if rotary or seqlen_new <= block_new else tiles.num_stages
    return NewKeyTiles(block_new, stages,
                       min(triton.next_power_of_2(seqlen_new), max(1, 2048 // block_d)))


@triton.jit
def _load_rows(rows, positions, ok, COS, SIN, stride_cos, stride_sin, rotary_len,
               HEAD_DIM: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY_DIM: tl.constexpr,
               INTERLEAVED: tl.constexpr):
    """A ``(BLOCK_R, BLOCK_D)`` tile of the vectors at pointers ``rows`` (0 where ``ok`` is
    false), rotated at table rows ``positions`` when ROTARY_DIM > 0 ([Note: rotary]). Every load
    is contiguous along the head dim (interleaved pairs are split apart in registers, GPT-NeoX
    partners read at +-ROTARY_DIM / 2), where gathering partners and angles element by element
    held a 64-bit address per element: the new-key loop rotates a whole tile per step."""
    offs_d = tl.arange(0, BLOCK_D)
    inside = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(rows[:, None] + offs_d[None, :], mask=inside, other=0.0)
    if ROTARY_DIM > 0:
        position = tl.minimum(positions, rotary_len - 1).to(tl.int64)[:, None]
        cos_row = position * stride_cos
        sin_row = position * stride_sin
        if INTERLEAVED:  # pair i is (2i, 2i + 1), its angle is column i of the tables
            offs_i = tl.arange(0, BLOCK_D // 2)
            turned = ok[:, None] & (offs_i < ROTARY_DIM // 2)[None, :]
            cos = tl.load(COS + cos_row + offs_i[None, :], mask=turned, other=1.0).to(tl.float32)
            sin = tl.load(SIN + sin_row + offs_i[None, :], mask=turned, other=0.0).to(tl.float32)
            even, odd = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_D // 2, 2)).to(tl.float32))
            x = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin),
                           (BLOCK_R, BLOCK_D)).to(x.dtype)
        else:  # pair i is (i, i + ROTARY_DIM / 2)
            half: tl.constexpr = ROTARY_DIM // 2
            first = ok[:, None] & (offs_d < half)[None, :]
            second = ok[:, None] & ((offs_d >= half) & (offs_d < ROTARY_DIM))[None, :]
            ahead = tl.load(rows[:, None] + (offs_d + half)[None, :], mask=first, other=0.0)
            behind = tl.load(rows[:, None] + (offs_d - half)[None, :], mask=second, other=0.0)
            at = COS + cos_row + offs_d[None, :]
            cos = tl.load(at, mask=first, other=0.0) + tl.load(at - half, mask=second, other=0.0)
            at = SIN + sin_row + offs_d[None, :]
            sin = tl.load(at, mask=first, other=0.0) + tl.load(at - half, mask=second, other=0.0)
            cos = tl.where(first | second, cos.to(tl.float32), 1.0)
            partner = behind.to(tl.float32) - ahead.to(tl.float32)
            x = (x.to(tl.float32) * cos + partner * sin.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _cache_row(CACHE_BATCH_IDX, b, cache_rows, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr):
    """``(cache_row, row_in_cache)``: sequence ``b``'s row of a contiguous cache (0 for a paged
    one, whose block table says where each key lives) and whether that row exists."""
    if PAGED:
        cache_row = 0
    elif HAS_BATCH_IDX:
        cache_row = tl.load(CACHE_BATCH_IDX + b).to(tl.int64)
    else:
        cache_row = b.to(tl.int64)
    return cache_row, (cache_row >= 0) & (cache_row < cache_rows)


@triton.jit
def _cache_slots(position, ok, table, cache_row, row_in_cache, num_blocks, table_width,
                 cache_slots, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """``(ok, row, slot)``: where cache ``position`` of the sequence lives (cache dim 0 and 1,
    int64) and whether it is inside the cache ([Note: masked cache access]); ``table`` is the
    sequence's block-table row. The cache loop and the write of new keys share it."""
    if PAGED:
        page = position // PAGE_SIZE
        ok = ok & (page < table_width)
        blocks = tl.load(table + page, mask=ok, other=-1)
        ok = ok & (blocks >= 0) & (blocks < num_blocks)
        row = blocks.to(tl.int64)
        slot = (position % PAGE_SIZE).to(tl.int64)
    else:
        ok = ok & row_in_cache & (position < cache_slots)
        row = cache_row
        slot = position.to(tl.int64)
    return ok, row, slot


@triton.jit
def _attend_block(q, k_t, v, ok, rows, cols, edge, m_i, l_i, acc, seqlen_q, seqlen_k, diag,
                  qk_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
                  SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr):
    """One tile of keys in the online softmax: ``(m_i, l_i, acc)`` after keys ``cols``
    (sequence-local, any order; ``k_t`` (D, N), ``v`` (N, D); ``ok``: which are keys). ``edge``:
    the tile may hold keys outside some row's band, so the visibility mask is applied."""
    s, _ = scores_log2(tl.dot(q, k_t), rows[:, None], cols[None, :], diag, qk_scale,
                       softcap_log2, alibi_slope_log2, SOFTCAP, HAS_ALIBI)
    s = tl.where(ok[None, :], s, float("-inf"))
    if edge:
        s = tl.where(visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left,
                             window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT),
                     s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _write_new_keys(k_new, v_new, k_head, v_head, length, seqlen_new, table, cache_row,
                    row_in_cache, COS, SIN, stride_kns, stride_vns, stride_kb, stride_ks,
                    stride_vb, stride_vs, stride_cos, stride_sin, num_blocks, table_width,
                    cache_slots,
                    rotary_len, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_WRITE: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
                    ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr):
    """[Note: appending] The new keys (rotated) and values of one sequence and kv head
    (``k_new``, ``v_new``: its first; ``k_head``, ``v_head``: the caches at the kv head) into
    cache positions ``length ..``, BLOCK_WRITE at a time; nothing for a padding slot or a slot
    outside the cache ([Note: masked cache access])."""
    offs_j = tl.arange(0, BLOCK_WRITE)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for first in range(0, seqlen_new, BLOCK_WRITE):
        index = first + offs_j
        position = tl.maximum(length, 0) + index
        ok, row, slot = _cache_slots(position, (index < seqlen_new) & (length >= 0), table,
                                     cache_row, row_in_cache, num_blocks, table_width,
                                     cache_slots, PAGE_SIZE, PAGED)
        mask = ok[:, None] & d_ok[None, :]
        key = _load_rows(k_new + index.to(tl.int64) * stride_kns, position, ok, COS, SIN,
                         stride_cos, stride_sin, rotary_len, HEAD_DIM, BLOCK_WRITE, BLOCK_D,
                         ROTARY_DIM,
                         ROTARY_INTERLEAVED)
        value = tl.load(v_new + index.to(tl.int64)[:, None] * stride_vns + offs_d[None, :],
                        mask=mask, other=0.0)
        tl.store(k_head + (row * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :], key,
                 mask=mask)
        tl.store(v_head + (row * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :],
                 value, mask=mask)


@triton.jit
def _attend_kernel(
        Q, K_CACHE, V_CACHE, K_NEW, V_NEW, BLOCK_TABLE, CACHE_SEQLENS, CACHE_LEFTPAD,
        CACHE_BATCH_IDX, CU_SEQLENS_Q, CU_SEQLENS_K, COS, SIN, ALIBI, S_AUX, O, LSE, O_PART,
        LSE_PART,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_knb, stride_kns, stride_knh,
        stride_vnb, stride_vns, stride_vnh, stride_tb, stride_cos, stride_sin, stride_ab,
        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
        seqlen_q_batched, seqlen_new, num_heads_q, row_blocks, num_splits, num_blocks,
        table_width, cache_rows, cache_slots, rotary_len,
        qk_scale, softcap_log2, window_left, window_right,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_NEW: tl.constexpr, NEW_STAGES: tl.constexpr,
        BLOCK_WRITE: tl.constexpr, GROUP: tl.constexpr,
        PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
        IS_VARLEN: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
        APPEND: tl.constexpr, ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,
        ROTARY_PER_ROW: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr,
        HAS_WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
        HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    # (kv head, row block) on the first axis, which has no 65535 limit: long prefills have many
    # row blocks.
    kv_head = tl.program_id(0) // row_blocks
    row_block = tl.program_id(0) % row_blocks
    split = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + b)
        seqlen_q = tl.load(CU_SEQLENS_Q + b + 1) - q_start
        seqlen_k = tl.load(CU_SEQLENS_K + b + 1) - tl.load(CU_SEQLENS_K + b)
        start = 0
        token0 = q_start.to(tl.int64)  # the sequence's first row on the packed token axis
        q_base = Q + token0 * stride_qs
        length = 0
    else:
        seqlen_q = seqlen_q_batched
        length = tl.load(CACHE_SEQLENS + b)
        if HAS_LEFTPAD:
            start = tl.load(CACHE_LEFTPAD + b)
        else:
            start = 0
        seqlen_k = tl.where(length >= 0, tl.maximum(length + seqlen_new - start, 0), 0)
        token0 = b64 * seqlen_q
        q_base = Q + b64 * stride_qb
    if APPEND:  # the appending program, (row block 0, split 0), runs even when Sq = 0
        appends = (row_block == 0) & (split == 0)
        done = (row_block * BLOCK_M >= GROUP * seqlen_q) & (appends == 0)
    else:
        done = row_block * BLOCK_M >= GROUP * seqlen_q
    if done:
        return
    if PAGED:
        table = BLOCK_TABLE + b64 * stride_tb  # the sequence's block-table row
    else:
        table = BLOCK_TABLE
    cache_row, row_in_cache = _cache_row(CACHE_BATCH_IDX, b, cache_rows, PAGED, HAS_BATCH_IDX)

    # The tile: packed rows -> (query row, query head).
    offs_r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    r_ok = rows < seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    if ROTARY_PER_ROW:
        at = tl.maximum(length, 0) + rows
    else:
        at = tl.maximum(length, 0) + rows * 0
    q = _load_rows(q_base + rows.to(tl.int64) * stride_qs + heads * stride_qh, at, r_ok, COS, SIN,
                   stride_cos, stride_sin, rotary_len, HEAD_DIM, BLOCK_M, BLOCK_D, ROTARY_DIM,
                   ROTARY_INTERLEAVED)
    if HAS_ALIBI:
        slopes = tl.load(ALIBI + b64 * stride_ab + heads, mask=r_ok, other=0.0)
        alibi_slope_log2 = (slopes * LOG2E)[:, None]
    else:
        alibi_slope_log2 = 0.0
    k_head = K_CACHE + kv_head.to(tl.int64) * stride_kh
    v_head = V_CACHE + kv_head.to(tl.int64) * stride_vh

    # Key blocks any row of the tile sees, cut to this split's share of the sequence.
    m_first = (row_block * BLOCK_M) // GROUP
    m_last = (tl.minimum(row_block * BLOCK_M + BLOCK_M, GROUP * seqlen_q) - 1) // GROUP
    lo, full_lo, full_hi, hi = key_block_range(m_first, m_last, seqlen_q, seqlen_k, window_left,
                                               window_right, BLOCK_N, HAS_WINDOW_LEFT,
                                               HAS_WINDOW_RIGHT)
    per_split = tl.cdiv(tl.cdiv(seqlen_k, BLOCK_N), num_splits)
    lo = tl.maximum(lo, split * per_split)
    hi = tl.minimum(hi, split * per_split + per_split)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    diag = seqlen_k - seqlen_q
    if APPEND:  # new key j is key column first_new + j; the cache holds the columns before
        hi = tl.where(seqlen_q > 0, hi, lo)  # no key for the appending program of Sq = 0
        first_new = length - start
        k_new = K_NEW + b64 * stride_knb + kv_head.to(tl.int64) * stride_knh
        v_new = V_NEW + b64 * stride_vnb + kv_head.to(tl.int64) * stride_vnh
        cached = tl.minimum(tl.maximum(first_new, 0), seqlen_k)
        cached_hi = tl.minimum(hi, tl.cdiv(cached, BLOCK_N))
    else:
        cached = seqlen_k
        cached_hi = hi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for block in range(lo, cached_hi):
        cols = block * BLOCK_N + offs_n
        ok = cols < cached
        if PAGE_ALIGNED:  # the block lies in one page: one table entry, a strided tile
            page = (block * BLOCK_N) // PAGE_SIZE
            ok = ok & (page < table_width)
            blocks = tl.load(table + page, mask=page < table_width, other=-1)
            ok = ok & (blocks >= 0) & (blocks < num_blocks)
            row = blocks.to(tl.int64)
            slot = ((block * BLOCK_N) % PAGE_SIZE + offs_n).to(tl.int64)
        else:
            ok, row, slot = _cache_slots(start + cols, ok, table, cache_row, row_in_cache,
                                         num_blocks, table_width, cache_slots, PAGE_SIZE, PAGED)
        k_t = tl.load(k_head + (row * stride_kb + slot * stride_ks)[None, :] + offs_d[:, None],
                      mask=ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_head + (row * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = _attend_block(q, k_t, v, ok, rows, cols,
                                      (block < full_lo) | (block >= full_hi), m_i, l_i, acc,
                                      seqlen_q, seqlen_k, diag, qk_scale, softcap_log2,
                                      alibi_slope_log2, window_left, window_right, SOFTCAP,
                                      HAS_ALIBI, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
    if APPEND:  # [Note: appending]: the write, then the new keys of this split's blocks
        if appends:
            _write_new_keys(k_new, v_new, K_CACHE + kv_head.to(tl.int64) * stride_kh,
                            V_CACHE + kv_head.to(tl.int64) * stride_vh, length, seqlen_new,
                            table, cache_row, row_in_cache, COS, SIN, stride_kns, stride_vns,
                            stride_kb, stride_ks, stride_vb, stride_vs, stride_cos, stride_sin,
                            num_blocks,
                            table_width, cache_slots, rotary_len, HEAD_DIM, BLOCK_D, BLOCK_WRITE,
                            PAGE_SIZE, PAGED, ROTARY_DIM, ROTARY_INTERLEAVED)
        offs_j = tl.arange(0, BLOCK_NEW)
        new_hi = tl.minimum(hi * BLOCK_N, seqlen_k) - first_new
        for first in tl.range(tl.maximum(lo * BLOCK_N - first_new, 0), new_hi, BLOCK_NEW,
                              num_stages=NEW_STAGES):
            index = first + offs_j
            ok = index < new_hi
            k_t = tl.trans(_load_rows(k_new + index.to(tl.int64) * stride_kns, length + index,
                                      ok, COS, SIN, stride_cos, stride_sin, rotary_len,
                                      HEAD_DIM, BLOCK_NEW,
                                      BLOCK_D, ROTARY_DIM, ROTARY_INTERLEAVED))
            v = tl.load(v_new + index.to(tl.int64)[:, None] * stride_vns + offs_d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, k_t, v, ok, rows, first_new + index, True, m_i, l_i,
                                          acc, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2,
                                          alibi_slope_log2, window_left, window_right, SOFTCAP,
                                          HAS_ALIBI, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)

    tokens = token0 + rows
    if PDL:  # the combine may launch now ([Note: dependent combine] in common)
        gdc_launch_dependents()
    if SPLIT:
        has_mass = l_i > 0.0
        l_safe = tl.where(has_mass, l_i, 1.0)
        idx = (tokens * num_heads_q + heads) * num_splits + split
        tl.store(O_PART + idx[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
                 mask=r_ok[:, None] & d_ok[None, :])
        tl.store(LSE_PART + idx, tl.where(has_mass, m_i + tl.log2(l_safe), float("-inf")),
                 mask=r_ok)
    else:
        if HAS_SINK:  # [Note: combining splits], with one split
            sink = tl.load(S_AUX + heads, mask=r_ok, other=0.0) * LOG2E
            top = tl.maximum(m_i, sink)
            weight = tl.exp2(m_i - top)
            den = l_i * weight + tl.exp2(sink - top)
        else:
            top = m_i
            weight = 1.0
            den = l_i
        has_mass = den > 0.0
        den_safe = tl.where(has_mass, den, 1.0)
        out = acc * (weight / den_safe)[:, None]
        lse = tl.where(has_mass, (top + tl.log2(den_safe)) / LOG2E, float("-inf"))
        if IS_VARLEN:
            o_rows = tokens * stride_os
            l_rows = tokens * stride_ls
        else:
            o_rows = b64 * stride_ob + rows * stride_os
            l_rows = b64 * stride_lb + rows * stride_ls
        tl.store(O + o_rows[:, None] + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
        tl.store(LSE + l_rows + heads * stride_lh, lse, mask=r_ok)



@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a call's launches need besides its tensors, from sizes alone."""
    grid: tuple
    attend: Bound  # the attention kernel's launch, its scalars and constexprs bound
    append: bool
    scratch: int  # fp32 elements of the split partials (0: one split)
    partials: int  # elements of the partial outputs at the scratch's start, then the lse
    combine: Bound | None  # the combine's launch when the keys are split
    rows: int  # the combine's programs, one per (token, query head)


# [Note: launch plans] A decode loop repeats one call shape, and deriving its launch (tiles,
# splits, strides, constexprs) was a large share of an eager call's host time under cProfile.
# Plans are memoised on everything they read: the sizes and strides of every tensor the kernel
# indexes, which optional tensors are present, the params, the tiles override and the device
# (its SM count and arch). Nothing in a plan depends on a tensor's values or address. Module
# constants (the tile rules, ``common.COMBINE_BLOCK_S``) are read when a plan is made: a test
# that changes one starts from an empty ``_plans``.
_plans: dict = {}
_MAX_PLANS = 256
PDL_COMBINE = True  # [Note: dependent combine] in ``common``; off, the combine waits in order
_attend = CachedLauncher(_attend_kernel)


def _plan_key(q, k_cache, v_cache, out, lse, k, v, rotary_cos, rotary_sin, cache_batch_idx,
              cache_leftpad, block_table, cu_seqlens_q, alibi_slopes, s_aux, params, tiles):
    return (q.shape, q.stride(), q.device, k_cache.shape, k_cache.stride(), v_cache.stride(),
            out.stride(), lse.stride(), params, tiles,
            None if k is None else (k.shape, k.stride(), v.stride()),
            None if block_table is None else (block_table.shape, block_table.stride(0)),
            None if rotary_cos is None else (rotary_cos.shape, rotary_cos.stride(0),
                                             rotary_sin.stride(0)),
            None if alibi_slopes is None else alibi_slopes.stride(),
            None if cu_seqlens_q is None else cu_seqlens_q.shape[0],
            cache_batch_idx is None, cache_leftpad is None, s_aux is None)


def _make_plan(q, k_cache, v_cache, out, lse, k, v, rotary_cos, rotary_sin, cache_batch_idx,
               cache_leftpad, block_table, cu_seqlens_q, alibi_slopes, s_aux,
               params: KvCacheParams, tiles: KvTiles | None) -> _Plan | None:
    """The call's :class:`_Plan`, or None when it launches nothing."""
    varlen = cu_seqlens_q is not None
    paged = block_table is not None
    heads_q, head_dim = q.shape[-2], q.shape[-1]
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    tokens = q.shape[0] if varlen else q.shape[0] * q.shape[1]
    append = k is not None and k.shape[1] > 0
    if batch == 0 or (tokens == 0 and not append):
        return None
    cfg = tiles or tiles_for(head_dim, group * params.max_seqlen_q, q.device,
                             page_size=k_cache.shape[1] if paged else 0,
                             rotary_append=append and rotary_cos is not None)
    # One row block at least: with Sq = 0 the (row block 0, split 0) programs still append.
    row_blocks = max(1, triton.cdiv(group * params.max_seqlen_q, cfg.block_m))
    splits = params.num_splits or kvcache_splits(
        batch=batch, heads_kv=heads_kv, row_blocks=row_blocks, max_keys=params.max_seqlen_k,
        block_n=cfg.block_n, device=q.device, programs_per_sm=cfg.programs_per_sm)
    splits = max(1, min(splits, triton.cdiv(max(params.max_seqlen_k, 1), cfg.block_n)))
    if tokens == 0:
        splits = 1  # nothing to combine
    block_d = block_d_for(head_dim)
    # [Note: dependent combine] (common): sm90+ launches the combine as a dependent launch
    pdl = PDL_COMBINE and splits > 1 and hopper_or_later(q.device)
    new = new_key_tiles(k.shape[1] if append else 0, block_d, rotary_cos is not None, cfg)
    qk_scale, softcap_log2 = score_constants(params.softmax_scale, params.softcap)
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    o_strides = (0, out.stride(0), out.stride(1)) if varlen else out.stride()[:3]
    l_strides = (0, lse.stride(0), lse.stride(1)) if varlen else lse.stride()
    q_strides = (0, q.stride(0), q.stride(1)) if varlen else q.stride()[:3]
    attend = _attend.bind(
        *q_strides, *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(k.stride()[:3] if append else (0, 0, 0)), *(v.stride()[:3] if append else (0, 0, 0)),
        block_table.stride(0) if paged else 0, *((0, 0) if rotary_cos is None else
                                                 (rotary_cos.stride(0), rotary_sin.stride(0))),
        alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        *o_strides, *l_strides, 0 if varlen else q.shape[1],
        k.shape[1] if append else 0, heads_q, row_blocks, splits, k_cache.shape[0],
        block_table.shape[1] if paged else 0, k_cache.shape[0], k_cache.shape[1],
        0 if rotary_cos is None else rotary_cos.shape[0], qk_scale, softcap_log2,
        params.window_left, params.window_right,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_NEW=new.block_new, NEW_STAGES=new.new_stages, BLOCK_WRITE=new.block_write,
        GROUP=group, PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged,
        PAGE_ALIGNED=paged and cache_leftpad is None and k_cache.shape[1] % cfg.block_n == 0,
        IS_VARLEN=varlen, HAS_LEFTPAD=cache_leftpad is not None,
        HAS_BATCH_IDX=cache_batch_idx is not None, APPEND=append, ROTARY_DIM=rotary_dim,
        ROTARY_INTERLEAVED=params.rotary_interleaved, ROTARY_PER_ROW=params.rotary_per_row,
        HAS_WINDOW_LEFT=params.window_left >= 0, HAS_WINDOW_RIGHT=params.window_right >= 0,
        SOFTCAP=params.softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_SINK=s_aux is not None, SPLIT=splits > 1, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    partials = tokens * heads_q * splits if splits > 1 else 0
    combine = None
    if splits > 1:
        combine = combine_launch(o_strides=o_strides, l_strides=l_strides,
                                 seqlen_q_batched=0 if varlen else q.shape[1], heads_q=heads_q,
                                 splits=splits, head_dim=head_dim, varlen=varlen,
                                 sink=s_aux is not None, pdl=pdl)
    return _Plan(grid=(heads_kv * row_blocks, splits, batch), attend=attend, append=append,
                 scratch=partials * (head_dim + 1), partials=partials * head_dim,
                 combine=combine, rows=tokens * heads_q)


def _partials(plan: _Plan, device) -> tuple:
    """``(o_part, lse_part)``, the split partials of a launch of ``plan`` in one allocation
    (the partial outputs, then their lse), or ``(None, None)`` with one split."""
    if not plan.scratch:
        return None, None
    o_part = torch.empty(plan.scratch, device=device, dtype=torch.float32)
    return o_part, o_part[plan.partials:]


def forward(q, k_cache, v_cache, out, lse, *, k, v, rotary_cos, rotary_sin, cache_seqlens,
            cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k,
            alibi_slopes, s_aux, params: KvCacheParams, tiles: KvTiles | None = None) -> None:
    """Appends ``k``/``v`` (rotated) to the caches in place and writes ``out`` (like q) and
    ``lse`` (float32 ``(B, Hq, Sq)``, or ``(Hq, Tq)`` varlen), in one attention launch (plus
    the combine when the keys are split); the contract of ``kvcache._kvcache_body``. Inputs are
    validated by the caller; ``tiles`` overrides the launch shape (tests). The launch shape
    comes from a memoised plan ([Note: launch plans])."""
    sizes = (q, k_cache, v_cache, out, lse, k, v, rotary_cos, rotary_sin, cache_batch_idx,
             cache_leftpad, block_table, cu_seqlens_q, alibi_slopes, s_aux, params, tiles)
    key = _plan_key(*sizes)
    plan = _plans.get(key, _plans)
    if plan is _plans:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = _make_plan(*sizes)
    if plan is None:
        return
    o_part, lse_part = _partials(plan, q.device)
    if not plan.append:
        k = v = None
    plan.attend[plan.grid](q, k_cache, v_cache, k, v, block_table, cache_seqlens, cache_leftpad,
                           cache_batch_idx, cu_seqlens_q, cu_seqlens_k, rotary_cos, rotary_sin,
                           alibi_slopes, s_aux, out, lse, o_part, lse_part)
    if plan.combine is not None:
        plan.combine[(plan.rows,)](o_part, lse_part, out, lse, s_aux)


# [Note: kv-cache lane] A decode loop makes one call shape's launches again and again. Once a
# call of a shape has run, :func:`lane` holds what its launches were (the plan, each kernel as
# a :class:`~.launch.Ready`, the output shapes) so that the next calls of that shape allocate
# their outputs and launch, and nothing else: no plan key, no launcher key, no Triton binder.
# Its holder (``kvcache``'s call memo) checks what the Python API reads (the call shape, modes,
# environment); the lane checks what the launches read besides ([Note: ready launches]): the
# current device, Triton's state, each kernel still current, and its pointers' 16-byte
# alignment. When any differs it returns None and the call takes the full path.
#
# The lane hands the compiled launchers each pointer as an int, which they take as it is:
# a tensor would cost them a ``data_ptr()`` call and a driver query of the address per
# pointer, and the lane has read every pointer already for its alignment check. The call key
# has already placed every tensor on the launch's device (the full path's checks), and the
# partials' lse is an address inside the partials' buffer, not a view of it.


class Lane:
    """The launches of one ``flash_attn_with_kvcache`` call shape ([Note: kv-cache lane]):
    ``lane(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, alibi_slopes, s_aux)`` is ``(out, lse)`` (lse None when the
    lane keeps it in scratch memory), or None when the call must take the full path."""
    __slots__ = ("device", "place", "state", "attend", "combine", "present", "aligned",
                 "all_aligned", "append", "grid", "rows", "scratch", "lse_offset", "lse_inside",
                 "out_like_q", "out_shape", "lse_shape", "dtype", "poison")

    def __init__(self, **fields):
        for name, value in fields.items():
            setattr(self, name, value)

    def __call__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, s_aux):
        device = _launch.driver.active.get_current_device()
        attend, combine = self.attend, self.combine
        if (device != self.device or triton_state() != self.state or not attend.holds()
                or (combine is not None and not combine.holds())):
            return None
        if not self.append:
            k = v = None
        pointers = [None if t is None else t.data_ptr()
                    for t in (q, k_cache, v_cache, k, v, block_table, cache_seqlens,
                              cache_leftpad, cache_batch_idx, None, None, rotary_cos,
                              rotary_sin, alibi_slopes, s_aux)]
        present = self.present(pointers)
        if (functools.reduce(operator.or_, present) & 15 if self.all_aligned
                else pointer_alignment(present) != self.aligned):
            return None
        place = self.place
        out = (torch.empty_like(q) if self.out_like_q
               else torch.empty(self.out_shape, dtype=self.dtype, device=place))
        if self.poison:
            out.fill_(math.nan)
        if self.scratch:  # (held until the launches are made: stream-ordered reuse after)
            partials = torch.empty(self.scratch, dtype=torch.float32, device=place)
            o_part = partials.data_ptr()
            lse_part = o_part + self.lse_offset
        else:
            o_part = lse_part = None
        if self.lse_inside:  # an lse nobody returns: scratch past the partials
            lse, lse_ptr = None, o_part + self.lse_inside
        else:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=place)
            if self.poison:
                lse.fill_(math.nan)
            lse_ptr = lse.data_ptr()
        out_ptr = out.data_ptr()
        stream = _launch.driver.active.get_current_stream(device)
        attend.start(*self.grid, stream, *attend.prefix, *pointers, out_ptr, lse_ptr, o_part,
                     lse_part, *attend.tail)
        if combine is not None:
            combine.start(self.rows, 1, 1, stream, *combine.prefix, o_part, lse_part, out_ptr,
                          lse_ptr, pointers[-1], *combine.tail)
        return out, lse


def lane(q, k_cache, v_cache, out, lse, *, k, v, rotary_cos, rotary_sin, cache_seqlens,
         cache_batch_idx, cache_leftpad, block_table, alibi_slopes, s_aux,
         params: KvCacheParams, poison: bool, return_lse: bool) -> Lane | None:
    """The :class:`Lane` of a call that :func:`forward` has just run with these arguments (no
    varlen, no tiles override), ``out``/``lse`` being its outputs as the caller allocated them
    (``poison``: filled with NaN; without ``return_lse`` the caller returns no lse, so the lane
    may keep it in scratch memory and return None for it); None when its launches did not go
    through the cached launchers or launched nothing."""
    sizes = (q, k_cache, v_cache, out, lse, k, v, rotary_cos, rotary_sin, cache_batch_idx,
             cache_leftpad, block_table, None, alibi_slopes, s_aux, params, None)
    plan = _plans.get(_plan_key(*sizes))
    state = triton_state()
    device = _launch.driver.active.get_current_device()
    if plan is None or state is None or q.device.index not in (None, device):
        return None  # (on another device than the current one, the full path guards it)
    o_part, lse_part = _partials(plan, q.device)
    if not plan.append:
        k = v = None
    inputs = (q, k_cache, v_cache, k, v, block_table, cache_seqlens, cache_leftpad,
              cache_batch_idx, None, None, rotary_cos, rotary_sin, alibi_slopes, s_aux)
    attend = plan.attend.launcher.ready(plan.attend, (*inputs, out, lse, o_part, lse_part))
    combine = None
    if plan.combine is not None:
        combine = plan.combine.launcher.ready(plan.combine, (o_part, lse_part, out, lse, s_aux))
    if attend is None or (plan.combine is not None and combine is None):
        return None
    lse_inside = 0  # or the unreturned lse's byte offset in the partials' buffer (16-aligned)
    scratch = plan.scratch
    if plan.scratch and not return_lse and lse.is_contiguous():
        lse_inside = -(-plan.scratch * 4 // 16) * 16
        scratch = lse_inside // 4 + lse.numel()
    # q, the caches and cache_seqlens at least: itemgetter of several items gives a tuple
    present = operator.itemgetter(*[i for i, t in enumerate(inputs) if t is not None])
    aligned = alignment(present(inputs))
    return Lane(device=device, place=q.device, state=state, attend=attend, combine=combine,
                present=present, aligned=aligned, all_aligned=all(aligned), append=plan.append,
                grid=plan.grid, rows=plan.rows, scratch=scratch,
                lse_offset=plan.partials * 4,  # bytes: the partials are float32
                lse_inside=lse_inside,
                out_like_q=out.shape == q.shape and out.stride() == q.stride()
                and out.dtype == q.dtype and out.device == q.device,
                out_shape=out.shape, lse_shape=lse.shape, dtype=out.dtype, poison=poison)
