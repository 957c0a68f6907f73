"""Triton forward kernel (FlashAttention-2 style) and its destination-passing launcher.

Glossary (see also ``common``):
  Q, K, V, O, LSE  queries, keys, values, output, log-sum-exp (natural log, float32)
  B, Hq, Hkv       batch, query heads, kv heads; GROUP = Hq // Hkv (kv head = h // GROUP)
  BLOCK_M          query rows of one program; BLOCK_N keys per inner-loop step
  HEAD_DIM         D; BLOCK_D = max(16, next_pow2(D)), the padded tile width (masked when wider)
  m_i, l_i, acc    running row max (log2 units), running row sum, unnormalised output (fp32)
  IS_VARLEN        sequences delimited by cu_seqlens; batch strides are then unused (0)
  TMA              Q/K/V/O through tensor descriptors (``rows_source``; sm90+, 16-byte aligned)
  WARP_SPECIALIZE  ``tl.range(warp_specialize=True)`` on the key loops (a no-op on sm90 with
                   triton 3.6: same ptxas output; meant for sm100)

One program computes BLOCK_M query rows of one (batch, query head). It walks the key blocks the
rows can see (``key_block_range``) in one loop, where only the band's edge blocks pay for the
visibility mask ([Note: one key loop]). Causal, window, softcap, ALiBi, sinks and dropout are
compile-time hooks into that loop, not copies of it.

[Note: one key loop] The key blocks of a program are one loop over ``[lo, hi)``; an edge block
(outside ``[full_lo, full_hi)``, from ``key_block_range``) masks its scores in a branch that
the band's interior blocks skip (uniform across the program, so no divergence). Loads are
row-checked in every block (free with tensor descriptors; one compare per row on the pointer
path). Three loops (the interior, then each edge) fill Triton's load pipeline once each, so a
causal program paid two fills; on the H200 the one loop measured +2-4% causal at 4k-16k and
+7% at 1k, full masks level, with bitwise-equal outputs.
The backward kernels keep three loops: the same change lost 7-11% there on GQA and full masks.

[Note: sinks and empty rows] With a sink the running max starts at ``s_aux * log2(e)`` and the
running sum at 1: the sink joins the denominator and contributes nothing to ``acc``. Without one
the max starts at -inf and the sum at 0. A row that sees no key ends with ``acc = 0`` and
``l_i = 0`` (out 0, lse -inf) or ``l_i = 1`` (out 0, lse s_aux). Exponents are taken against a
max that is replaced by 0 while it is still -inf, so no ``-inf - -inf`` NaN ever forms.

[Note: dropout] ``l_i`` sums the undropped probabilities (the softmax denominator and lse are
unaffected by dropout); only the ``P V`` product sees the keep-mask, and ``1 / (1 - p)`` is folded
into the final normalisation. The keep-mask is the hash of ``common`` on
sequence-local (row, key) indices, bitwise equal to ``flash_attn_hub.reference.dropout_keep_mask``.

[Note: scale after the max] Without softcap or ALiBi the loop takes the row max of the raw
``q.k`` tile and scales the (BLOCK_M,) max, not the tile: ``qk_scale > 0`` (validated), so
``max(qk) * scale`` rounds to the same float as ``max(qk * scale)``, and ``qk * scale - m`` is
one FFMA per score. That removes one FMUL per score: 64 of the ~550 instructions a thread runs
per 128 x 128 step at D=128 (sm90 SASS).

[Note: split head dim] A head dim just above a power of two pads its tiles to the next one:
D=192 runs 256-wide Q K^T and P V products, a quarter of them on zero columns (the H200
measured 0.63-0.69x cuDNN at D=192 against 0.80-0.90x at D=256). ``head_dim_split`` cuts such
a head dim into two power-of-two tiles (128 + 64 at D=192, 128 + 32 at D=160). The program
loads Q, K, V in both, adds the second score product into the first (``tl.dot(q2, k2_t,
qk)``, the padded product's K-chunk order: the H200's outputs were bitwise equal to the
padded tiles' in all eight workloads measured), keeps one output accumulator per tile and
stores both. The second tile's descriptors start HEAD_DIM - HEAD_DIM2 columns into the row, a
multiple of 16 elements, so 16-byte aligned. Its tiles are tuned under the width it runs
(``tile_width``: 192), falling back to the padded bucket's (256) where a GPU has no such entry.
- Only padded widths from ``SPLIT_MIN_PADDED`` (256) split. The H200 measured D=192 +8% (full
  masks, 4k and 16k; causal 4k level, 16k +6%) and D=160 +9-13%, but D=80 and D=96 (64 + 16,
  64 + 32 out of 128-wide tiles) 14-20% slower.
- Before sm90 the padded tiles stay: ptxas (sm_80, D=192, 64 x 64 x 8 warps) gives the split
  program 128 registers, a 1.7 KB stack frame and 2.3 KB of spills, where the padded one fits
  in 255 registers without spilling; no pre-Hopper GPU has measured either.
- The interpreter splits, so the CPU tests run both tiles; ``SPLIT_HEAD_DIM`` turns the split
  off (the A/B of the measurement).

[Note: offsets] Per-program bases (batch, head, sequence start) and per-block key offsets are
int64; in-tile offsets stay int32, so tensors beyond 2**31 elements address correctly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import triton
import triton.language as tl

from .._heuristics import hopper_or_later
from .._params import AttnParams
from .common import (LOG2E, LaunchShape, dropout_row_hash, inner_loop, key_block_range,
                     load_rows, rows_source, sequence_bounds, shared_arguments, store_rows,
                     use_tma)
from .tuning import HEAD_DIM_BUCKETS, TileTable, block_d_for, head_dim_split


@triton.jit(do_not_specialize=["threshold", "seed_lo", "seed_hi"])
def _attn_fwd_kernel(
        Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, S_AUX, ALIBI,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
        stride_lb, stride_lh, stride_ls, stride_ab,
        seqlen_q_batched, seqlen_k_batched, num_heads_q,
        qk_scale, softcap_log2, window_left, window_right,
        threshold, seed_lo, seed_hi, dropout_rescale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, GROUP: tl.constexpr, IS_VARLEN: tl.constexpr,
        HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
        HAS_ALIBI: tl.constexpr, HAS_SINK: tl.constexpr, DROPOUT: tl.constexpr,
        TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, HEAD_DIM2: tl.constexpr,
        BLOCK_D2: tl.constexpr):
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
    # This (sequence, head)'s matrices: pointers at its first row, or descriptors of them; under
    # a head-dim split ([Note: split head dim]) of their first HEAD_DIM - HEAD_DIM2 columns, and
    # the *2 ones of the rest.
    D1: tl.constexpr = HEAD_DIM - HEAD_DIM2
    q_base = Q + batch64 * stride_qb + head64 * stride_qh + q_row0 * stride_qs
    o_base = O + batch64 * stride_ob + head64 * stride_oh + q_row0 * stride_os
    k_base = K + batch64 * stride_kb + kv_head64 * stride_kh + k_row0 * stride_ks
    v_base = V + batch64 * stride_vb + kv_head64 * stride_vh + k_row0 * stride_vs
    q_src = rows_source(q_base, seqlen_q, stride_qs, BLOCK_M, D1, BLOCK_D, TMA)
    o_dst = rows_source(o_base, seqlen_q, stride_os, BLOCK_M, D1, BLOCK_D, TMA)
    k_src = rows_source(k_base, seqlen_k, stride_ks, BLOCK_N, D1, BLOCK_D, TMA)
    v_src = rows_source(v_base, seqlen_k, stride_vs, BLOCK_N, D1, BLOCK_D, TMA)
    lse_base = (LSE + batch64 * stride_lb + head64 * stride_lh
                + (q_row0 + m_first) * stride_ls)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    rows = m_first + offs_m
    m_ok = rows < seqlen_q
    q = load_rows(q_src, m_first, stride_qs, seqlen_q, BLOCK_M, D1, BLOCK_D, True, TMA)

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
        thr = threshold.to(tl.uint32)
    else:
        row_hash = 0
        thr = 0

    lo, full_lo, full_hi, hi = key_block_range(m_first, m_last, seqlen_q, seqlen_k,
                                               window_left, window_right, BLOCK_N,
                                               HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
    if BLOCK_D2 > 0:
        q2_src = rows_source(q_base + D1, seqlen_q, stride_qs, BLOCK_M, HEAD_DIM2, BLOCK_D2, TMA)
        k2_src = rows_source(k_base + D1, seqlen_k, stride_ks, BLOCK_N, HEAD_DIM2, BLOCK_D2, TMA)
        v2_src = rows_source(v_base + D1, seqlen_k, stride_vs, BLOCK_N, HEAD_DIM2, BLOCK_D2, TMA)
        q2 = load_rows(q2_src, m_first, stride_qs, seqlen_q, BLOCK_M, HEAD_DIM2, BLOCK_D2, True,
                       TMA)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D2], tl.float32)
    else:
        q2 = 0.0
        k2_src = 0
        v2_src = 0
        acc2 = 0.0
    acc, l_i, m_i, acc2 = inner_loop(
        acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, lo, full_lo, full_hi, hi, rows,
        offs_n, seqlen_q, seqlen_k, qk_scale, softcap_log2, alibi_slope_log2, window_left,
        window_right, row_hash, thr, HEAD_DIM, BLOCK_N, BLOCK_D, SOFTCAP, HAS_ALIBI,
        HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, DROPOUT, TMA, WARP_SPECIALIZE, acc2, q2, k2_src,
        v2_src, HEAD_DIM2, BLOCK_D2)

    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    if DROPOUT:
        norm = dropout_rescale / l_safe
    else:
        norm = 1.0 / l_safe
    lse = tl.where(has_mass, (m_i + tl.log2(l_safe)) / LOG2E, float("-inf"))
    store_rows(o_dst, m_first, stride_os, seqlen_q, (acc * norm[:, None]).to(O.dtype.element_ty),
               BLOCK_M, D1, BLOCK_D, TMA)
    if BLOCK_D2 > 0:
        o2_dst = rows_source(o_base + D1, seqlen_q, stride_os, BLOCK_M, HEAD_DIM2, BLOCK_D2, TMA)
        store_rows(o2_dst, m_first, stride_os, seqlen_q,
                   (acc2 * norm[:, None]).to(O.dtype.element_ty), BLOCK_M, HEAD_DIM2, BLOCK_D2,
                   TMA)
    tl.store(lse_base + offs_m * stride_ls, lse, mask=m_ok)


# ---------------------------------------------------------------------------------------------
# Tile sizes: the one table of defaults, keyed by (arch, BLOCK_D). No GPU timing stands behind
# most of them: each reason quotes ptxas for a bf16 compile of the kernel with every feature on
# (registers per thread, spills, shared memory), the static constraint that ruled out the
# neighbours. `python -m flash_attn_hub tune fwd` times candidates on a GPU and writes
# `triton_fwd_configs.json` beside this file, keyed by GPU name, BLOCK_D and sequence-length
# bucket; its entries, with their measured reasons, take precedence (`tuning`).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FwdTiles:
    """One row of the table: the program's tile and launch shape."""
    block_m: int  # query rows per program
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    reason: str = ""
    tma: bool = False  # Q/K/V/O through tensor descriptors (sm90+, aligned tensors)
    warp_specialize: bool = False  # tl.range(warp_specialize=True) on the key loops


# [Note: split head dim]: head dims above a power of two run as two narrower tiles
SPLIT_HEAD_DIM = True

_T = FwdTiles
_SM90_64 = _T(128, 64, 8, 3, "ptxas sm90: 225 regs, 0 spills, 64 KB smem; 4 warps spill")
_SM80_64 = _T(128, 64, 8, 3, "ptxas sm80: 189 regs, 0 spills, 48 KB smem; 4 warps hit 255 regs")
_INTERP = _T(32, 16, 1, 1, "interpreter: small, BLOCK_M != BLOCK_N, so tests cross both kinds")
# sm90 D=64/128/256 are the H200's tuned tiles at 4k keys. A Hopper GPU without rows of its
# own takes the H200's rows from the tuning file before these (TABLE's reference GPU), which
# adds the 1k bucket: 128 x 64 without descriptors at D=128. On an H100 (tools/ab_bench.py,
# two rounds, against these rows, FlexAttention level in the same processes) that ran 1.12-1.15x
# at 512 keys full, 1.31x causal, 1.01-1.03x at 1k full and 1.13x causal (MHA, GQA 32/8, 64/8).
TILES = {
    ("sm90", 16): _SM90_64,
    ("sm90", 32): _SM90_64,
    ("sm90", 64): _T(128, 64, 8, 3, "H200 tune, S=4k: 413/353 TFLOP/s full/causal with tensor "
                                    "descriptors, 317/289 without", tma=True),
    ("sm90", 128): _T(128, 128, 8, 3, "H200 tune, MHA+GQA: 4k 1.08x and 16k 1.15x the 128x64 "
                                      "pointer tiles (555/530 at 16k); at 1k the tuner kept those "
                                      "(128x64 with descriptors: 0.88x)", tma=True),
    ("sm90", 256): _T(128, 64, 8, 2, "H200 tune, S=4k: 510/432 with descriptors, 1.54x the "
                                     "128x32 pointer tiles (register-bound without them)",
                      tma=True),
    ("sm80", 16): _SM80_64,
    ("sm80", 32): _SM80_64,
    ("sm80", 64): _SM80_64,
    ("sm80", 128): _T(128, 64, 8, 2, "ptxas sm80: 255 regs, 0 spills, 64 KB smem; 4 warps spill "
                                     "44 B"),
    ("sm80", 256): _T(64, 64, 8, 2, "ptxas sm80: 255 regs, 32 B spills, 104 KB smem; 128x32 "
                                    "spills 868 B, 4 warps 360 B"),
}
for _d in HEAD_DIM_BUCKETS:
    TILES[("generic", _d)] = (_T(64, 32, 4, 1, "unknown arch: smallest smem footprint")
                              if _d == 256 else
                              _T(64, 64, 4, 2, "unknown arch: conservative, small smem footprint"))
    TILES[("interpreter", _d)] = _INTERP
del _d, _T
CONFIG_FILE = Path(__file__).with_name("triton_fwd_configs.json")
TABLE = TileTable("forward", CONFIG_FILE, TILES, FwdTiles, reference_gpus={"sm90": "NVIDIA H200"})


def splits_head_dim(device: torch.device) -> bool:
    """Whether head dims are split on ``device`` ([Note: split head dim]: sm90+ and the
    interpreter; sm80 keeps the padded tiles). Cached per GPU, like the tile lookup."""
    if not SPLIT_HEAD_DIM:
        return False
    if device.type != "cuda":
        return True
    return hopper_or_later(device)


def split_tiles(head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_D, HEAD_DIM2, BLOCK_D2)`` of ``head_dim`` on ``device``: ``head_dim_split``'s
    where the split applies, else the padded tile and no second one."""
    return head_dim_split(head_dim) if splits_head_dim(device) else (block_d_for(head_dim), 0, 0)


def tile_width(head_dim: int, device: torch.device) -> int:
    """The columns the kernel runs for ``head_dim`` on ``device``, which keys its tuning entries
    (D=192: 192 where split, else 256)."""
    block_d, _, block_d2 = split_tiles(head_dim, device)
    return block_d + block_d2


def tile_config(head_dim: int, device: torch.device, seqlen: int) -> FwdTiles:
    """The tiles of a call: measured for this GPU if the tuning file has them (the entries of
    the split width first, then the padded one's), else the table."""
    return TABLE.for_call(device, head_dim, seqlen, tile_width(head_dim, device))


def forward(q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
            params: AttnParams, tiles: FwdTiles | None = None) -> None:
    """Write attention of ``q, k, v`` into ``out`` (like q) and ``lse`` (float32).

    Batched: q ``(B, Sq, Hq, D)``, lse ``(B, Hq, Sq)``; varlen (``cu_seqlens_q`` given): q
    ``(Tq, Hq, D)``, lse ``(Hq, Tq)``. Inputs are validated by the caller. ``tiles`` overrides
    the tile table (tests and the tuning script use it). The dispatcher sends few query rows
    per kv head over many keys to the split-KV kernels of ``decode`` instead."""
    shape = LaunchShape.of(q, k, cu_seqlens_q, params)
    assert shape.heads_q % shape.heads_kv == 0 and q.stride(-1) == 1 and out.is_contiguous()
    if shape.batch == 0 or shape.max_seqlen_q == 0 or shape.heads_q == 0:
        return
    cfg = tiles or tile_config(shape.head_dim, q.device, shape.longest)
    scalars, flags = shared_arguments(shape, params, alibi_slopes)
    flags["BLOCK_D"], head_dim2, block_d2 = split_tiles(shape.head_dim, q.device)
    grid = (triton.cdiv(shape.max_seqlen_q, cfg.block_m), shape.heads_q, shape.batch)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
        *shape.seq_strides(q), *shape.seq_strides(k), *shape.seq_strides(v),
        *shape.seq_strides(out), *shape.lse_strides(lse), **scalars,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_SINK=s_aux is not None,
        TMA=use_tma(cfg.tma, q.device, shape, q, k, v, out),
        WARP_SPECIALIZE=cfg.warp_specialize, HEAD_DIM2=head_dim2, BLOCK_D2=block_d2, **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
