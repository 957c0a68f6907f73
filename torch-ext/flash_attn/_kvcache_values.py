"""The value checks of the kv-cache calls (``kvcache``): the checks that read the values of the
index tensors, not only their metadata.

[Note: value checks] The checks that need values (``-1 <= cache_seqlens``, ``cache_seqlens +
seqlen_new <= capacity``, ``0 <= cache_leftpad <= cache_seqlens``, ``cache_batch_idx`` in range
and, with new keys, distinct, every block-table entry a sequence uses in ``[0, num_blocks)``,
``cu_seqlens`` of a paged varlen call) run:

* always on CPU tensors;
* on CUDA tensors unless a CUDA graph is being captured
  (``torch.cuda.is_current_stream_capturing()``), ``torch.compile`` is tracing, or
  ``FLASH_ATTN_HUB_CHECK_VALUES=0``. On CUDA they cost one small kernel and one
  device-to-host copy of ``B`` to ``4 B`` int32 per checked call (``3 B + 1`` for a paged
  varlen call: ``cu_seqlens_k`` and the ranges), which waits for the work queued before it.
  A serving loop that captures its decode step in a CUDA graph (as transformers' continuous
  batching does) pays it only in its eager warm-up; an eager loop can opt out with the
  environment variable.

Where the call runs on Triton (CUDA tensors unless the ``cpu`` backend is asked for, and CPU
tensors with ``triton`` under the interpreter), one launch of ``_triton.kvcache_checks``
(chosen by ``_dispatch.select_kvcache_checks``) writes the index vectors (``cu_seqlens_k``
itself for a paged varlen call) and each sequence's least and greatest used block-table entry
into one int32 buffer, read with one ``.tolist()``; the host takes the least and the greatest
over sequences. Elsewhere torch ops compute the same numbers (:func:`_used_entry_range`: the
range over the whole table at once). Either way a range that leaves ``[0, num_blocks)`` sends
the call to :func:`_fail_on_bad_table`, which names the first bad entry from an exact mask, so
both paths raise the same errors.

The checks run once per version of the index tensors: a call with the very tensors (the same
objects, unchanged since) and sizes of the last call that passed skips them, so the layers of
one decode step, which share ``cache_seqlens`` and ``block_table``, pay one check per step, not
one per layer. A paged varlen call is memoised the same way on ``cu_seqlens_k`` and
``block_table``, whose check is the one read above (its ``cu_seqlens_q`` check reads through
``_validate._host_values``, which copies a tensor once per version), and each entry point
remembers its own last passed call, so a step that mixes a paged prefill with a decode keeps
both. Changing a tensor in place through torch (``cache_seqlens += 1``, ``copy_``, a write
into a view of it) bumps its version and the next call checks again; a write that torch does
not see (a custom kernel writing through the tensor's pointer, or a CUDA graph's replay of
captured writes) does not, and inference tensors (made under ``torch.inference_mode``) have no
version, so they are checked every call.

The kernels stay memory-safe without them (``kvcache``'s notes).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import _custom_ops, _dispatch, _validate
from ._validate import _fail

ENV_CHECK_VALUES = "FLASH_ATTN_HUB_CHECK_VALUES"


def _checking_values(*tensors) -> bool:
    """Whether the value checks run ([Note: value checks]). The tensors are on one device (the
    metadata checks saw to it), so the first, never None, stands for them all."""
    if _validate._compiling():
        return False
    if tensors[0].device.type == "cpu":
        return True
    if os.environ.get(ENV_CHECK_VALUES, "1") == "0":
        return False
    return not torch.cuda.is_current_stream_capturing()


def _used_pages(block_table: Tensor, cache_seqlens: Tensor, cache_leftpad, seqlen_new: int,
                page_size: int) -> Tensor:
    """Bool ``block_table``-shaped: the pages that hold positions ``[cache_leftpad,
    cache_seqlens + seqlen_new)`` of each sequence (none for a -1 length)."""
    span = block_table.shape[1] * page_size
    starts = torch.arange(0, span, page_size, device=block_table.device,
                          dtype=torch.int32 if span < 2**31 else torch.int64)
    used = starts < torch.where(cache_seqlens < 0, 0, cache_seqlens + seqlen_new)[:, None]
    if cache_leftpad is not None:  # page j is used when it ends after cache_leftpad
        used &= starts > (cache_leftpad - page_size)[:, None]
    return used


def _used_entry_range(block_table: Tensor, cache_seqlens: Tensor, cache_leftpad, seqlen_new: int,
                      page_size: int) -> tuple[Tensor, Tensor]:
    """The least and the greatest entry of the used pages (:func:`_used_pages`), 0 standing in
    for the others: two ``(1,)`` int tensors from a handful of torch ops, read with the index
    vectors where the checks run on torch ops ([Note: value checks]; the device gather gives
    the same per sequence). Both in ``[0, num_blocks)`` means no used entry is bad; otherwise
    :func:`_fail_on_bad_table` finds the entry."""
    used = _used_pages(block_table, cache_seqlens, cache_leftpad, seqlen_new, page_size)
    least, greatest = torch.where(used, block_table, 0).aminmax()
    return least.view(1), greatest.view(1)


def _outside(ranges: list, num_blocks: int) -> bool:
    """Whether a used block-table entry may lie outside ``[0, num_blocks)``: ``ranges`` holds
    least entries, then as many greatest ones (one of each from :func:`_used_entry_range`, one
    per row from the device gather), 0 standing in for unused pages; :func:`_fail_on_bad_table`
    then finds the entry, if any."""
    half = len(ranges) // 2
    return min(ranges[:half]) < 0 or max(ranges[half:]) >= num_blocks


def _fail_on_bad_table(block_table: Tensor, cache_seqlens: Tensor, cache_leftpad,
                       seqlen_new: int, page_size: int, num_blocks: int) -> None:
    """Raises naming the first used block-table entry outside ``[0, num_blocks)``, if any."""
    bad = (_used_pages(block_table, cache_seqlens, cache_leftpad, seqlen_new, page_size)
           & ((block_table < 0) | (block_table >= num_blocks)))
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        _fail(ValueError, "block_table", f"block_table[{b}, {j}] = {int(block_table[b, j])}, a "
              f"page sequence {b} uses", f"a block index in [0, {num_blocks}) (only entries past "
              "a sequence's last page may be -1)")


# Per check (``"cache"``: ``flash_attn_with_kvcache``, ``"paged_varlen"``), what its last call
# that passed held: its sizes, and per index tensor its ``_validate.tensor_version`` (None where
# absent) ([Note: value checks], once per version). One entry per check, so that the two entry
# points, called in turn, do not evict each other.
_passed: dict[str, tuple] = {}


def _versions(tensors: tuple) -> tuple | None:
    """Each tensor's ``tensor_version`` (None stays None); None when one has none (an
    inference tensor)."""
    versions = tuple(None if t is None else _validate.tensor_version(t) for t in tensors)
    return None if any(v is None for t, v in zip(tensors, versions) if t is not None) else versions


def _unchanged(check: str, sizes: tuple, tensors: tuple) -> bool:
    """Whether ``tensors`` are the objects of the last call that passed ``check``, at the
    versions they had then, with the same ``sizes``."""
    passed = _passed.get(check)
    return passed is not None and passed[0] == sizes and all(
        held is None if t is None else _validate.same_version(held, t)
        for t, held in zip(tensors, passed[1]))


def _remember(check: str, sizes: tuple, tensors: tuple) -> None:
    """Records a call that passed ``check``, unless one of its tensors has no version."""
    versions = _versions(tensors)
    if versions is not None:
        _passed[check] = (sizes, versions)


def _check_cache_values(*, batch: int, seqlen_new: int, capacity: int, cache_seqlens: Tensor,
                        cache_leftpad, cache_batch_idx, batch_cache: int, block_table,
                        page_size: int, num_blocks: int, gated: bool = False) -> None:
    """[Note: value checks] for ``flash_attn_with_kvcache``: one host read of the index vectors
    and of the range of the used block-table entries, unless the tensors and sizes are the last
    passed call's, unchanged. ``gated``: the caller has established that checks run (a lane
    has: its key rules out compiling and fixes the environment, and it tests capture itself)."""
    if not gated and not _checking_values(cache_seqlens, cache_leftpad, cache_batch_idx,
                                          block_table):
        return
    sizes = (batch, seqlen_new, capacity, batch_cache, page_size, num_blocks)
    tensors = (cache_seqlens, cache_leftpad, cache_batch_idx, block_table)
    if _unchanged("cache", sizes, tensors):
        return
    _passed.pop("cache", None)
    table = block_table is not None and block_table.numel() > 0
    gather = _dispatch.select_kvcache_checks(cache_seqlens)
    if gather is not None:
        with _custom_ops._on_device_of(cache_seqlens):
            values = gather(cache_seqlens, cache_leftpad, cache_batch_idx,
                            block_table if table else None, seqlen_new=seqlen_new,
                            page_size=page_size).tolist()
    else:
        parts = [t for t in (cache_seqlens, cache_leftpad, cache_batch_idx) if t is not None]
        if table:
            parts.extend(_used_entry_range(block_table, cache_seqlens, cache_leftpad,
                                           seqlen_new, page_size))
        values = torch.cat(parts).tolist()
    seqlens, rest = values[:batch], values[batch:]
    for b, n in enumerate(seqlens):
        if n < -1 or n + seqlen_new > capacity:
            _fail(ValueError, "cache_seqlens", f"{n} at batch index {b} (+ {seqlen_new} new "
                  f"tokens)", f"-1 (a padding slot) or a length with cache_seqlens + seqlen_new "
                  f"<= the cache capacity {capacity}")
    if cache_leftpad is not None:
        leftpad, rest = rest[:batch], rest[batch:]
        for b, (pad, n) in enumerate(zip(leftpad, seqlens)):
            if n >= 0 and not 0 <= pad <= n:
                _fail(ValueError, "cache_leftpad", f"{pad} at batch index {b}",
                      f"0 <= cache_leftpad <= cache_seqlens ({n})")
    if cache_batch_idx is not None:
        index, rest = rest[:batch], rest[batch:]
        for b, row in enumerate(index):
            if not 0 <= row < batch_cache:
                _fail(ValueError, "cache_batch_idx", f"{row} at batch index {b}",
                      f"a cache row in [0, {batch_cache})")
        active = [row for row, n in zip(index, seqlens) if n >= 0]
        if seqlen_new and len(set(active)) != len(active):
            _fail(ValueError, "cache_batch_idx", f"repeated rows {index}",
                  "distinct cache rows when new keys are appended")
    if table and _outside(rest, num_blocks):
        _fail_on_bad_table(block_table, cache_seqlens, cache_leftpad, seqlen_new, page_size,
                           num_blocks)
    _remember("cache", sizes, tensors)


def _check_paged_varlen_values(cu_seqlens_k: Tensor, block_table: Tensor, *, max_k: int,
                               capacity: int, page_size: int, num_blocks: int) -> None:
    """[Note: value checks] for a paged ``flash_attn_varlen_func`` call: ``cu_seqlens_k`` (starts
    at 0, never decreases, each length within the capacity and ``max_seqlen_k``) and the block
    table's used entries, from one host read (the gather's, which leads with ``cu_seqlens_k``,
    where it runs and the table has entries), unless the tensors and sizes are the last passed
    call's, unchanged."""
    batch = block_table.shape[0]
    sizes = (batch, max_k, capacity, page_size, num_blocks)
    tensors = (cu_seqlens_k, block_table)
    if _unchanged("paged_varlen", sizes, tensors):
        return
    _passed.pop("paged_varlen", None)
    table = block_table.numel() > 0
    gather = _dispatch.select_kvcache_checks(block_table) if table else None
    if gather is not None:  # one read: cu_seqlens_k's values, then the ranges
        with _custom_ops._on_device_of(block_table):
            values = gather(cu_seqlens_k, None, None, block_table, seqlen_new=0,
                            page_size=page_size, cumulative=True).tolist()
        values, ranges = values[:batch + 1], values[batch + 1:]
    else:
        values, ranges = _validate._host_values(cu_seqlens_k), None
    if values[0] != 0:
        _fail(ValueError, "cu_seqlens_k", f"first element {values[0]}", "0")
    lengths = [values[b + 1] - values[b] for b in range(batch)]
    for b, n in enumerate(lengths):
        if n < 0:
            _fail(ValueError, "cu_seqlens_k", f"a decrease at index {b + 1} ({values[b]} -> "
                  f"{values[b + 1]})", "non-decreasing cumulative sequence lengths")
        if n > capacity:
            _fail(ValueError, "cu_seqlens_k", f"{n} keys for sequence {b}",
                  f"at most the block table's capacity ({capacity})")
    if lengths and max(lengths) > max_k:
        _fail(ValueError, "max_seqlen_k", max_k,
              f"at least the longest sequence in the cu_seqlens ({max(lengths)})")
    if table and (ranges is None or _outside(ranges, num_blocks)):
        # the torch ops' range, or the bad entry to name, need the lengths on the device
        end = torch.tensor(lengths, dtype=torch.int32, device=block_table.device)
        if ranges is None:
            ranges = torch.cat(_used_entry_range(block_table, end, None, 0, page_size)).tolist()
        if _outside(ranges, num_blocks):
            _fail_on_bad_table(block_table, end, None, 0, page_size, num_blocks)
    _remember("paged_varlen", sizes, tensors)
