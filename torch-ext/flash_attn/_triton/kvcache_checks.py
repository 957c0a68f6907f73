"""The one launch behind the value checks of the KV-cache calls (``_kvcache_values``' [Note:
value checks]): :func:`_values_kernel` gathers every number the host then reads, so a check
costs one launch and one device-to-host copy.

Glossary:
  B                  sequences (rows of the block table), one program each
  LENGTHS            ``cache_seqlens`` (B,), or with CUMULATIVE ``cu_seqlens_k`` (B + 1,),
                     whose differences are the lengths (a paged varlen call: no new keys)
  used pages         of row ``b``: the pages holding positions ``[start, end)``, ``start =
                     cache_leftpad[b]`` (else 0), ``end = cache_seqlens[b] + seqlen_new`` (0
                     for a negative length): columns ``[first, last)``, ``first = max(start,
                     0) // page_size``, ``last = min(cdiv(end, page_size), table_width)``
                     (page ``j`` is used when ``j * page_size < end`` and ``(j + 1) *
                     page_size > start``; ``_kvcache_values._used_pages``' rule)
  range of a row     the least and the greatest of its entries with 0 standing in for its
                     unused columns (what ``_kvcache_values._used_entry_range`` gives for
                     that row alone): the used entries' own when the row uses every column, else
                     widened to include 0, and ``(0, 0)`` for a row that uses none

Output (int32, ``(count,)``): LENGTHS copied (B values, or with CUMULATIVE the B + 1 of
``cu_seqlens_k``, so the host checks them from the same read; program ``b`` writes element
``b + 1`` and program 0 element 0 too), then in blocks of B the left pads and the batch indices
(when given), then with a table each row's least entry and each row's greatest (the host takes
the min and the max over rows). int32 holds every value: each is an element of an int32 tensor
or 0 (the callers accept only int32 index tensors and tables); the arithmetic on positions is
int64 (``cache_seqlens + seqlen_new``, a difference of ``cu_seqlens_k`` and ``column *
page_size`` may pass 2**31 on a bad length or a wide table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import CachedLauncher


def _columns_per_step(device: torch.device) -> int:
    """Table columns a program reads per step: 512 on a GPU (4 warps, 4 entries a thread; a
    decode row of 32k keys in 16-key pages takes 4 steps; not tuned: the launch and the copy
    to the host, not these reads, are the check's cost), 4 under the interpreter, so that
    small tests cross steps."""
    return 512 if device.type == "cuda" else 4


@triton.jit
def _values_kernel(OUT, LENGTHS, CACHE_LEFTPAD, CACHE_BATCH_IDX, BLOCK_TABLE,
                   stride_tb, batch, table_width, seqlen_new, page_size,
                   BLOCK: tl.constexpr, CUMULATIVE: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                   HAS_BATCH_IDX: tl.constexpr, HAS_TABLE: tl.constexpr):
    b = tl.program_id(0)
    if CUMULATIVE:
        offset = tl.load(LENGTHS + b)
        next_offset = tl.load(LENGTHS + b + 1)
        if b == 0:
            tl.store(OUT, offset)
        tl.store(OUT + b + 1, next_offset)
        length = next_offset.to(tl.int64) - offset
        at = OUT + batch + 1 + b  # where the next block of B goes
    else:
        length = tl.load(LENGTHS + b)
        tl.store(OUT + b, length)
        at = OUT + batch + b
    if HAS_LEFTPAD:
        start = tl.load(CACHE_LEFTPAD + b)
        tl.store(at, start)
        at += batch
    if HAS_BATCH_IDX:
        tl.store(at, tl.load(CACHE_BATCH_IDX + b))
        at += batch
    if HAS_TABLE:
        end = tl.where(length < 0, 0, length.to(tl.int64) + seqlen_new)
        last = tl.minimum(tl.cdiv(end, page_size), table_width).to(tl.int32)
        if HAS_LEFTPAD:
            first = tl.minimum(tl.maximum(start, 0).to(tl.int64) // page_size, last)
            first = first.to(tl.int32)
        else:
            first = last * 0
        row = BLOCK_TABLE + b.to(tl.int64) * stride_tb
        offs = tl.arange(0, BLOCK)
        least = tl.full([BLOCK], 2147483647, tl.int32)
        greatest = tl.full([BLOCK], -2147483648, tl.int32)
        for column in range(first, last, BLOCK):
            cols = column + offs
            ok = cols < last
            entries = tl.load(row + cols, mask=ok, other=0)
            least = tl.where(ok, tl.minimum(least, entries), least)
            greatest = tl.where(ok, tl.maximum(greatest, entries), greatest)
        least = tl.min(least, 0)
        greatest = tl.max(greatest, 0)
        every = (first == 0) & (last == table_width) & (last > 0)  # no column stands in with 0
        tl.store(at, tl.where(every, least, tl.minimum(least, 0)))
        tl.store(at + batch, tl.where(every, greatest, tl.maximum(greatest, 0)))


_values = CachedLauncher(_values_kernel)


def value_count(batch: int, *, leftpad: bool, batch_idx: bool, table: bool,
                cumulative: bool) -> int:
    """The length of :func:`gather_values`' output for these inputs (module notes): with
    ``cumulative`` one more, the leading ``cu_seqlens_k[0]``."""
    return batch * (1 + leftpad + batch_idx + 2 * table) + cumulative


def gather_values(out: Tensor, lengths: Tensor, cache_leftpad: Tensor | None,
                  cache_batch_idx: Tensor | None, block_table: Tensor | None, *,
                  seqlen_new: int, page_size: int, cumulative: bool = False) -> Tensor:
    """Writes the values the checks read into ``out`` (int32, contiguous, of
    :func:`value_count`'s length; module notes) in one launch (none for an empty batch: a copy
    of the one cumulative value with ``cumulative``, else nothing); returns ``out``. The index
    vectors are contiguous int32 on one device, ``block_table`` an int32 ``(B, max_blocks)``
    with unit-stride rows (any ``max_blocks``, 0 too), ``page_size`` >= 1; ``cumulative``:
    ``lengths`` is ``cu_seqlens_k``, whose values lead the output. Launched on the current
    device."""
    batch = lengths.shape[0] - cumulative
    if batch == 0:
        return out.copy_(lengths) if cumulative else out
    table = block_table is not None
    launch = _values.bind(
        block_table.stride(0) if table else 0, batch, block_table.shape[1] if table else 0,
        seqlen_new, page_size, BLOCK=_columns_per_step(lengths.device), CUMULATIVE=cumulative,
        HAS_LEFTPAD=cache_leftpad is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_TABLE=table, num_warps=4)
    launch[(batch,)](out, lengths, cache_leftpad, cache_batch_idx, block_table)
    return out


def check_values(lengths: Tensor, cache_leftpad: Tensor | None, cache_batch_idx: Tensor | None,
                 block_table: Tensor | None, *, seqlen_new: int, page_size: int,
                 cumulative: bool = False) -> Tensor:
    """:func:`gather_values` into a new buffer on ``lengths``' device."""
    count = value_count(lengths.shape[0] - cumulative, leftpad=cache_leftpad is not None,
                        batch_idx=cache_batch_idx is not None, table=block_table is not None,
                        cumulative=cumulative)
    out = torch.empty(count, dtype=torch.int32, device=lengths.device)
    return gather_values(out, lengths, cache_leftpad, cache_batch_idx, block_table,
                         seqlen_new=seqlen_new, page_size=page_size, cumulative=cumulative)
