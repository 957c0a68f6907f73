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

Two launches, or three: ``_append_kernel`` writes the new keys (rotated) and values into the
cache, ``_attend_kernel`` attends over the cache (writing the output directly when there is one
split), and ``common.combine_kernel`` merges the splits in a fixed order, so a result never depends
on timing. Nothing is read from the device on the host and every buffer's size follows from
shapes, so a call can be captured in a CUDA graph.

[Note: masked cache access] Every load and store is masked to the cache: positions past the
sequence (or past the cache), a block index outside ``[0, num_blocks)``, a cache row outside
the cache. The host checks these values on eager calls (``kvcache``'s [Note: value checks]);
a captured call that skips the checks reads zeros for a bad key (scored -inf: it is not a key)
and drops a bad append, but never touches memory outside the cache. ``cache_seqlens = -1``
(a padding slot) appends nothing and sees no key.

[Note: rotary] Positions index the ``(seqlen_rotary, ROTARY_DIM / 2)`` tables; a pair ``(d,
partner(d))`` turns by its angle: ``x'[d] = x[d] cos + sign(d) x[partner] sin`` with sign -1 on
the pair's first element. Interleaved pairs are ``(2i, 2i + 1)``, GPT-NeoX pairs ``(i, i +
ROTARY_DIM / 2)``; dims past ROTARY_DIM keep ``cos = 1, sin = 0``. Computed in fp32, rounded
to the input dtype (the cache holds rounded keys; the queries are rounded before the product,
as flash-attn 2 does). A position past the table is clamped to its last row.

Splits are merged by ``common.combine_kernel`` ([Note: combining splits] there).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._heuristics import hopper_or_later, kvcache_splits
from .._params import KvCacheParams
from .common import (LOG2E, combine_splits, key_block_range, score_constants, scores_log2,
                     visible)
from .tuning import block_d_for


@dataclasses.dataclass(frozen=True)
class KvTiles:
    """The attention kernel's launch shape."""
    block_m: int  # packed rows per program
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    reason: str


def tiles_for(head_dim: int, packed_rows: int, device: torch.device, *,
              page_size: int = 0) -> KvTiles:
    """Tiles by head dim, packed rows (GROUP * Sq) and page size (0: a contiguous cache).
    BLOCK_M is the packed rows rounded up to a power of two between 16 (``tl.dot``'s minimum)
    and 64 (32 above D=128). Keys per step: 64 up to D=128, 32 above; a paged cache whose
    pages do not hold whole 64-key blocks (the per-key gather) takes 128 at D <= 128.

    Measured on an H100 (tools/kvcache_tiles.py, GQA 32/8, D=128, bf16, at the best split
    count of each): 4 warps were fastest or within 2% in every cell (8 warps at 64 rows cost
    1.25x at B=8 Sq=16); with pages of 16 keys, 128-key steps read 1.08-1.19x faster than 64
    (B=1 over 32k with 2 stages, B=8 Sq=16 with 3); contiguous caches were level (within 2%)
    for 32, 64 and 128 keys and 2-4 stages. ptxas sm90 (bf16, paged, causal; 3 stages): 16 x
    64 at D=128 with 4 warps 168 registers, 40 KB shared memory, no spills; 64 x 64 with 4
    warps 236; D=256 16 x 32 156, 32 x 32 <= 212. Three stages on Hopper, two elsewhere
    (sm86/sm89 have 99 KB). The interpreter takes 16 x 16, so small tests cross row blocks,
    key blocks and pages."""
    if device.type != "cuda":
        return KvTiles(16, 16, 1, 1, "interpreter: small tiles")
    block_m = max(16, min(triton.next_power_of_2(max(packed_rows, 1)),
                          64 if head_dim <= 128 else 32))
    hopper = hopper_or_later(device)
    stages = 3 if hopper else 2
    block_n = 64 if head_dim <= 128 else 32
    if page_size and page_size % block_n and head_dim <= 128 and hopper:
        block_n = 128
        stages = 3 if block_m >= 64 else 2
    return KvTiles(block_m, block_n, 4, stages, "measured on an H100")


@triton.jit
def _rotary_terms(positions, offs_d, COS, SIN, stride_rot, ok, ROTARY_DIM: tl.constexpr,
                  INTERLEAVED: tl.constexpr):
    """``(partner, cos, signed_sin)`` for rows at ``positions`` (R,) and columns ``offs_d``
    (D,): ``x' = x * cos + x[:, partner] * signed_sin`` ([Note: rotary]); ``ok`` (R,) masks
    rows whose tables are not read."""
    rotated = offs_d < ROTARY_DIM
    if INTERLEAVED:
        partner = offs_d ^ 1
        pair = offs_d // 2
        first = offs_d % 2 == 0
    else:
        half: tl.constexpr = ROTARY_DIM // 2
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        pair = tl.where(first, offs_d, offs_d - half)
    partner = tl.where(rotated, partner, offs_d)
    pair = tl.where(rotated, pair, 0)
    mask = ok[:, None] & rotated[None, :]
    ptr = positions.to(tl.int64)[:, None] * stride_rot + pair[None, :]
    cos = tl.load(COS + ptr, mask=mask, other=1.0).to(tl.float32)
    sin = tl.load(SIN + ptr, mask=mask, other=0.0).to(tl.float32)
    return partner, cos, tl.where(first[None, :], -sin, sin)


@triton.jit
def _append_kernel(
        K_NEW, V_NEW, K_CACHE, V_CACHE, BLOCK_TABLE, CACHE_SEQLENS, CACHE_BATCH_IDX, COS, SIN,
        stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_tb, stride_rot,
        num_heads_kv, num_blocks, table_width, cache_rows, cache_slots, rotary_len,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
        PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
        ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr):
    """New token ``j`` of sequence ``b`` (all kv heads) into its cache slot, keys rotated at
    position ``cache_seqlens[b] + j``; nothing for a padding slot or a slot outside the cache
    ([Note: masked cache access])."""
    j = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    length = tl.load(CACHE_SEQLENS + b)
    position = tl.maximum(length, 0) + j
    valid = length >= 0
    if PAGED:
        page = position // PAGE_SIZE
        valid = valid & (page < table_width)
        block = tl.load(BLOCK_TABLE + b64 * stride_tb + page, mask=valid, other=-1)
        valid = valid & (block >= 0) & (block < num_blocks)
        row = block.to(tl.int64)
        slot = (position % PAGE_SIZE).to(tl.int64)
    else:
        if HAS_BATCH_IDX:
            row = tl.load(CACHE_BATCH_IDX + b).to(tl.int64)
        else:
            row = b64
        valid = valid & (row >= 0) & (row < cache_rows) & (position < cache_slots)
        slot = position.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_h < num_heads_kv)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_k = K_NEW + b64 * stride_knb + j * stride_kns + offs_h[:, None] * stride_knh
    key = tl.load(src_k + offs_d[None, :], mask=inside, other=0.0)
    if ROTARY_DIM > 0:
        at = tl.minimum(position, rotary_len - 1) + offs_h * 0
        partner, cos, sin = _rotary_terms(at, offs_d, COS, SIN, stride_rot,
                                          (offs_h < num_heads_kv) & valid, ROTARY_DIM,
                                          ROTARY_INTERLEAVED)
        other = tl.load(src_k + partner[None, :], mask=inside, other=0.0)
        key = (key.to(tl.float32) * cos + other.to(tl.float32) * sin).to(key.dtype)
    value = tl.load(V_NEW + b64 * stride_vnb + j * stride_vns + offs_h[:, None] * stride_vnh
                    + offs_d[None, :], mask=inside, other=0.0)
    mask = inside & valid
    tl.store(K_CACHE + row * stride_kb + slot * stride_ks + offs_h[:, None] * stride_kh
             + offs_d[None, :], key, mask=mask)
    tl.store(V_CACHE + row * stride_vb + slot * stride_vs + offs_h[:, None] * stride_vh
             + offs_d[None, :], value, mask=mask)


@triton.jit
def _attend_kernel(
        Q, K_CACHE, V_CACHE, BLOCK_TABLE, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX,
        CU_SEQLENS_Q, CU_SEQLENS_K, COS, SIN, ALIBI, S_AUX, O, LSE, O_PART, LSE_PART,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_tb, stride_rot, stride_ab,
        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
        seqlen_q_batched, seqlen_new, num_heads_q, row_blocks, num_splits, num_blocks,
        table_width, cache_rows, cache_slots, rotary_len,
        qk_scale, softcap_log2, window_left, window_right,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
        PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr, IS_VARLEN: tl.constexpr,
        HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, ROTARY_DIM: tl.constexpr,
        ROTARY_INTERLEAVED: tl.constexpr, ROTARY_PER_ROW: tl.constexpr,
        HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
        HAS_ALIBI: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr):
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
    if row_block * BLOCK_M >= GROUP * seqlen_q:
        return
    if PAGED:
        table = BLOCK_TABLE + b64 * stride_tb
        cache_row = 0
    else:
        table = BLOCK_TABLE
        if HAS_BATCH_IDX:
            cache_row = tl.load(CACHE_BATCH_IDX + b).to(tl.int64)
        else:
            cache_row = b64
    row_in_cache = (cache_row >= 0) & (cache_row < cache_rows)

    # The tile: packed rows -> (query row, query head).
    offs_r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    r_ok = rows < seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = q_base + rows.to(tl.int64)[:, None] * stride_qs + heads[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if ROTARY_DIM > 0:
        if ROTARY_PER_ROW:
            at = tl.maximum(length, 0) + rows
        else:
            at = tl.maximum(length, 0) + rows * 0
        partner, cos, sin = _rotary_terms(tl.minimum(at, rotary_len - 1), offs_d, COS, SIN,
                                          stride_rot, r_ok, ROTARY_DIM, ROTARY_INTERLEAVED)
        other = tl.load(q_ptrs + partner[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        q = (q.to(tl.float32) * cos + other.to(tl.float32) * sin).to(q.dtype)
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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for block in range(lo, hi):
        cols = block * BLOCK_N + offs_n
        position = start + cols
        ok = cols < seqlen_k
        if PAGE_ALIGNED:  # the block lies in one page: one table entry, a strided tile
            page = (block * BLOCK_N) // PAGE_SIZE
            ok = ok & (page < table_width)
            blocks = tl.load(table + page, mask=page < table_width, other=-1)
            ok = ok & (blocks >= 0) & (blocks < num_blocks)
            slot = ((block * BLOCK_N) % PAGE_SIZE + offs_n).to(tl.int64)
            k_rows = blocks.to(tl.int64) * stride_kb + slot * stride_ks
            v_rows = blocks.to(tl.int64) * stride_vb + slot * stride_vs
        elif PAGED:  # [Note: masked cache access]
            page = position // PAGE_SIZE
            ok = ok & (page < table_width)
            blocks = tl.load(table + page, mask=ok, other=-1)
            ok = ok & (blocks >= 0) & (blocks < num_blocks)
            slot = (position % PAGE_SIZE).to(tl.int64)
            k_rows = blocks.to(tl.int64) * stride_kb + slot * stride_ks
            v_rows = blocks.to(tl.int64) * stride_vb + slot * stride_vs
        else:
            ok = ok & row_in_cache & (position < cache_slots)
            k_rows = cache_row * stride_kb + position.to(tl.int64) * stride_ks
            v_rows = cache_row * stride_vb + position.to(tl.int64) * stride_vs
        k_t = tl.load(k_head + k_rows[None, :] + offs_d[:, None],
                      mask=ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        s, _ = scores_log2(tl.dot(q, k_t), rows[:, None], cols[None, :], diag, qk_scale,
                           softcap_log2, alibi_slope_log2, SOFTCAP, HAS_ALIBI)
        s = tl.where(ok[None, :], s, float("-inf"))
        if (block < full_lo) | (block >= full_hi):  # band edges only
            s = tl.where(visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left,
                                 window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT),
                         s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    tokens = token0 + rows
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


def _append(k_cache, v_cache, k, v, *, block_table, cache_seqlens, cache_batch_idx, rotary_cos,
            rotary_sin, params: KvCacheParams) -> None:
    batch, seqlen_new, heads_kv, head_dim = k.shape
    paged = block_table is not None
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    block_h = triton.next_power_of_2(heads_kv)
    _append_kernel[(seqlen_new, batch)](
        k, v, k_cache, v_cache, block_table, cache_seqlens, cache_batch_idx, rotary_cos,
        rotary_sin, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), block_table.stride(0) if paged else 0,
        0 if rotary_cos is None else rotary_cos.stride(0), heads_kv, k_cache.shape[0],
        block_table.shape[1] if paged else 0, k_cache.shape[0], k_cache.shape[1],
        0 if rotary_cos is None else rotary_cos.shape[0],
        HEAD_DIM=head_dim, BLOCK_D=block_d_for(head_dim), BLOCK_H=block_h,
        PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged,
        HAS_BATCH_IDX=cache_batch_idx is not None, ROTARY_DIM=rotary_dim,
        ROTARY_INTERLEAVED=params.rotary_interleaved,
        num_warps=4 if block_h * head_dim >= 2048 else 2)


def forward(q, k_cache, v_cache, out, lse, *, k, v, rotary_cos, rotary_sin, cache_seqlens,
            cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k,
            alibi_slopes, s_aux, params: KvCacheParams, tiles: KvTiles | None = None) -> None:
    """Appends ``k``/``v`` (rotated) to the caches in place, then writes ``out`` (like q) and
    ``lse`` (float32 ``(B, Hq, Sq)``, or ``(Hq, Tq)`` varlen); the contract of
    ``kvcache._kvcache_body``. Inputs are validated by the caller; ``tiles`` overrides the
    launch shape (tests)."""
    varlen = cu_seqlens_q is not None
    paged = block_table is not None
    if k is not None and k.shape[1] > 0 and k.shape[0] > 0:
        _append(k_cache, v_cache, k, v, block_table=block_table, cache_seqlens=cache_seqlens,
                cache_batch_idx=cache_batch_idx, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                params=params)
    heads_q, head_dim = q.shape[-2], q.shape[-1]
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    tokens = q.shape[0] if varlen else q.shape[0] * q.shape[1]
    if tokens == 0 or batch == 0:
        return
    cfg = tiles or tiles_for(head_dim, group * params.max_seqlen_q, q.device,
                             page_size=k_cache.shape[1] if paged else 0)
    row_blocks = triton.cdiv(group * params.max_seqlen_q, cfg.block_m)
    splits = params.num_splits or kvcache_splits(
        batch=batch, heads_kv=heads_kv, row_blocks=row_blocks, max_keys=params.max_seqlen_k,
        block_n=cfg.block_n, device=q.device)
    splits = max(1, min(splits, triton.cdiv(max(params.max_seqlen_k, 1), cfg.block_n)))
    qk_scale, softcap_log2 = score_constants(params.softmax_scale, params.softcap)
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    o_strides = (0, out.stride(0), out.stride(1)) if varlen else out.stride()[:3]
    l_strides = (0, lse.stride(0), lse.stride(1)) if varlen else lse.stride()
    q_strides = (0, q.stride(0), q.stride(1)) if varlen else q.stride()[:3]
    if splits > 1:
        o_part = torch.empty(tokens * heads_q * splits, head_dim, device=q.device,
                             dtype=torch.float32)
        lse_part = torch.empty(tokens * heads_q * splits, device=q.device, dtype=torch.float32)
    else:
        o_part = lse_part = None
    block_d = block_d_for(head_dim)
    _attend_kernel[(heads_kv * row_blocks, splits, batch)](
        q, k_cache, v_cache, block_table, cache_seqlens, cache_leftpad, cache_batch_idx,
        cu_seqlens_q, cu_seqlens_k, rotary_cos, rotary_sin, alibi_slopes, s_aux, out, lse,
        o_part, lse_part, *q_strides, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0, 0 if rotary_cos is None else rotary_cos.stride(0),
        alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        *o_strides, *l_strides, 0 if varlen else q.shape[1],
        0 if k is None else k.shape[1], heads_q, row_blocks, splits, k_cache.shape[0],
        block_table.shape[1] if paged else 0, k_cache.shape[0], k_cache.shape[1],
        0 if rotary_cos is None else rotary_cos.shape[0], qk_scale, softcap_log2,
        params.window_left, params.window_right,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        GROUP=group, PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged,
        PAGE_ALIGNED=paged and cache_leftpad is None and k_cache.shape[1] % cfg.block_n == 0,
        IS_VARLEN=varlen, HAS_LEFTPAD=cache_leftpad is not None,
        HAS_BATCH_IDX=cache_batch_idx is not None, ROTARY_DIM=rotary_dim,
        ROTARY_INTERLEAVED=params.rotary_interleaved, ROTARY_PER_ROW=params.rotary_per_row,
        HAS_WINDOW_LEFT=params.window_left >= 0, HAS_WINDOW_RIGHT=params.window_right >= 0,
        SOFTCAP=params.softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_SINK=s_aux is not None, SPLIT=splits > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        combine_splits(o_part, lse_part, out, lse, s_aux, o_strides=o_strides,
                       l_strides=l_strides, seqlen_q_batched=0 if varlen else q.shape[1],
                       heads_q=heads_q, splits=splits, head_dim=head_dim, varlen=varlen)
