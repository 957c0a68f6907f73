"""CPU backend: exact attention in PyTorch ops, chunked with an online softmax.

Glossary:
  B, Hq, Hkv, GROUP  batch, query heads, kv heads, GROUP = Hq // Hkv query heads per kv head
  Sq, Sk, DIAG       query / key lengths of one sequence; query ``i`` sits on key diagonal
                     ``i + DIAG`` with ``DIAG = Sk - Sq`` (bottom-right alignment)
  rows               a query chunk of ``m`` positions laid out ``(B, Hkv, m, GROUP)`` and flattened
                     to ``(B, Hkv, m * GROUP)``: the GROUP query heads that share a kv head are rows
                     of one matrix, so they multiply the same K/V chunk with no expanded copy, and
                     dK/dV come out already summed over the group by the matmul itself
  KEY_CHUNK          keys per chunk
  band               keys visible from a query chunk; chunks outside it are never computed and
                     only chunks that cross an edge of the band pay for the mask

Every chunk's scores are at most ``B * Hq * m * KEY_CHUNK`` floats, with ``m`` chosen so that
this stays near ``SCORE_TILE_ELEMENTS``: the ``Sq x Sk`` score matrix never exists.

[Note: compute precision] Inputs are fp16/bf16; every product, exponential and accumulator is
float32. K and V of the current sequence are converted to float32 once (linear memory); queries
and output gradients one chunk at a time.

[Note: fully masked rows] A row can see no key (causal with Sq > Sk, a narrow window, Sk = 0).
Its running max stays -inf; every exponent is taken against a max that is replaced by 0 when it
is -inf, so masked scores give exp(-inf) = 0 and never inf - inf. The final normaliser ``denom``
is 0 for such a row: lse = log(0) = -inf (or s_aux with a sink) and the output weight is set
to 0 explicitly. Backward recomputes P against an lse that is replaced by 0 when -inf.

[Note: sinks] ``s_aux[h]`` is one more logit per row with no value: it enters the normaliser,
``denom = l * exp(m - m_fin) + exp(s_aux - m_fin)`` with ``m_fin = max(m, s_aux)``, never the
accumulator.

[Note: determinism] Loops run in a fixed order and every accumulation (online softmax, dQ per
query chunk, dK/dV per key chunk, ds_aux) is a sequential float32 sum: results are bitwise
identical run to run whatever ``params.deterministic`` says.
"""

from __future__ import annotations

import itertools
import math

import torch

from ._params import AttnParams

# Chunk sizes, measured single-threaded (B=1, S=2048, Hq=8, Hkv=2, D=128, bf16): forward and
# backward times are flat (within 10%) for 128-512 keys per chunk and 2**20-2**22 score
# elements per tile, so the smaller memory wins. Query chunks above 128 rows cost causal runs
# 15-30% (the chunks crossing the diagonal compute more masked scores).
KEY_CHUNK = 256
# Cap (elements) on one chunk's score tile over batch and heads: 2**21 floats = 8 MB; the
# backward holds about five tiles at once. Binds only when B * Hq > 64; QUERY_CHUNK_MIN keeps
# the loop overhead bounded when it does.
SCORE_TILE_ELEMENTS = 1 << 21
QUERY_CHUNK_MIN = 16
QUERY_CHUNK_MAX = 128

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The dropout RNG's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In-place :func:`_mix32` for the large per-chunk hash tensors."""
    x.bitwise_xor_(x >> 16).mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(0x735A2D97).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)


class _Sequences:
    """One call's worth of equal-length sequences: ``B`` batch entries of ``Sq`` queries against
    ``Sk`` keys, plus everything the score hook needs (K/V in float32, slopes, sink, RNG)."""

    def __init__(self, q, k, v, *, s_aux, slopes, batch_offset, params: AttnParams):
        self.batch, self.seqlen_q, num_heads_q, self.head_dim = q.shape
        self.seqlen_k, self.num_heads_kv = k.shape[1], k.shape[2]
        self.group = num_heads_q // self.num_heads_kv
        self.diag = self.seqlen_k - self.seqlen_q
        self.params = params
        dev = q.device
        # (B, Sk, Hkv, D) -> (B, Hkv, Sk, D) float32: key chunks are row slices of it.
        self.k = k.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)
        self.v = v.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)
        shape5 = (1, self.num_heads_kv, 1, self.group, 1)
        self.neg_slopes = None
        if slopes is not None:
            self.neg_slopes = -slopes.to(torch.float32).reshape(-1, *shape5[1:])
        self.sink = None if s_aux is None else s_aux.to(torch.float32).reshape(shape5[:-1])
        self.keep_threshold = None
        if params.dropout_p > 0:
            self.keep_threshold = min(int(params.dropout_p * 2**32), _MASK32)
            seed_lo = params.seed & _MASK32
            seed_hi = (params.seed >> 32) & _MASK32
            b = torch.arange(self.batch, dtype=torch.int64, device=dev) + batch_offset
            h = torch.arange(num_heads_q, dtype=torch.int64, device=dev)
            bh = (b[:, None] * num_heads_q + h[None, :] + seed_hi) & _MASK32
            base = _mix32(_mix32(bh) ^ seed_lo)
            self.rng_base = base.view(self.batch, self.num_heads_kv, 1, self.group)
        rows_per_key = self.batch * num_heads_q * max(1, min(KEY_CHUNK, self.seqlen_k))
        self.query_chunk = max(QUERY_CHUNK_MIN,
                               min(QUERY_CHUNK_MAX, SCORE_TILE_ELEMENTS // rows_per_key))

    # -- chunk schedule ---------------------------------------------------------------------
    def query_chunks(self):
        for i0 in range(0, self.seqlen_q, self.query_chunk):
            yield i0, min(i0 + self.query_chunk, self.seqlen_q)

    def key_chunks(self, i0: int, i1: int):
        """``(j0, j1, masked)`` for the key chunks meeting the band of queries ``[i0, i1)``;
        ``masked`` is False when every (query, key) pair of the chunk is visible."""
        left, right = self.params.window_left, self.params.window_right
        lo = 0 if left < 0 else max(0, i0 + self.diag - left)
        hi = self.seqlen_k if right < 0 else min(self.seqlen_k, i1 - 1 + self.diag + right + 1)
        for j0 in range(lo, hi, KEY_CHUNK):
            j1 = min(j0 + KEY_CHUNK, hi)
            inside_left = left < 0 or j0 >= i1 - 1 + self.diag - left
            inside_right = right < 0 or j1 - 1 <= i0 + self.diag + right
            yield j0, j1, not (inside_left and inside_right)

    # -- per-chunk hooks --------------------------------------------------------------------
    def load_rows(self, x: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        """``x[:, i0:i1]`` of a (B, S, Hq, D) tensor as float32 rows (B, Hkv, m * GROUP, D)."""
        rows = x[:, i0:i1].unflatten(2, (self.num_heads_kv, self.group)).permute(0, 2, 1, 3, 4)
        rows = rows.to(torch.float32, memory_format=torch.contiguous_format)
        return rows.view(self.batch, self.num_heads_kv, -1, self.head_dim)

    def store_rows(self, dst: torch.Tensor, rows: torch.Tensor, i0: int, i1: int) -> None:
        """Inverse of :meth:`load_rows`: write float32 rows into ``dst[:, i0:i1]`` (cast)."""
        rows = rows.view(self.batch, self.num_heads_kv, i1 - i0, self.group, self.head_dim)
        dst[:, i0:i1].unflatten(2, (self.num_heads_kv, self.group)).copy_(
            rows.permute(0, 2, 1, 3, 4))

    def row_view(self, per_row: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        """A (B, Hkv, m * GROUP) per-row quantity as (B, Hq, m), the layout of lse."""
        per_row = per_row.view(self.batch, self.num_heads_kv, i1 - i0, self.group)
        return per_row.transpose(2, 3).reshape(self.batch, -1, i1 - i0)

    def load_row_stat(self, stat: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        """``stat[:, :, i0:i1]`` of a (B, Hq, S) tensor as float32 (B, Hkv, m * GROUP)."""
        x = stat[:, :, i0:i1].unflatten(1, (self.num_heads_kv, self.group)).transpose(2, 3)
        return x.to(torch.float32).reshape(self.batch, self.num_heads_kv, -1)

    def sink_rows(self, m: int) -> torch.Tensor:
        """s_aux broadcast to (1, Hkv, m * GROUP)."""
        return self.sink.expand(1, self.num_heads_kv, m, self.group).reshape(1, self.num_heads_kv, -1)

    def scores(self, q_rows, i0, i1, j0, j1, masked):
        """Scores (B, Hkv, m * GROUP, n) of a chunk, every modifier applied and invisible pairs
        at -inf, and ``tanh`` of the softcap (None without softcap) for the backward."""
        p = self.params
        s = torch.matmul(q_rows, self.k[:, :, j0:j1].transpose(-1, -2))
        tanh = None
        if p.softcap > 0:
            tanh = s.mul_(p.softmax_scale / p.softcap).tanh_()
            s = tanh * p.softcap
        else:
            s.mul_(p.softmax_scale)
        if self.neg_slopes is None and not masked:
            return s, tanh
        s5 = s.view(self.batch, self.num_heads_kv, i1 - i0, self.group, j1 - j0)
        rel = (torch.arange(i0, i1, device=s.device)[:, None, None] + self.diag
               - torch.arange(j0, j1, device=s.device))
        if self.neg_slopes is not None:
            s5.addcmul_(self.neg_slopes, rel.abs().to(torch.float32))
        if masked:
            hidden = torch.zeros_like(rel, dtype=torch.bool)
            if p.window_left >= 0:
                hidden |= rel > p.window_left
            if p.window_right >= 0:
                hidden |= rel < -p.window_right
            s5.masked_fill_(hidden, -math.inf)
        return s, tanh

    def row_hash(self, i0: int, i1: int) -> torch.Tensor:
        """Per-row dropout hash (B, Hkv, m, GROUP) int64 for sequence-local rows ``[i0, i1)``."""
        i = torch.arange(i0, i1, dtype=torch.int64, device=self.k.device)
        return _mix32(self.rng_base ^ i[None, None, :, None])

    def dropped(self, row_hash, j0: int, j1: int) -> torch.Tensor:
        """Bool (B, Hkv, m * GROUP, n): True where dropout zeroes the entry."""
        j = torch.arange(j0, j1, dtype=torch.int64, device=row_hash.device)
        r = _mix32_(row_hash[..., None] ^ j)
        return (r < self.keep_threshold).view(self.batch, self.num_heads_kv, -1, j1 - j0)


def _safe(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -inf replaced by 0, the reference point for exponentials of a masked row."""
    return x.masked_fill(x == -math.inf, 0.0)


def _forward_sequences(seq: _Sequences, q, out, lse) -> None:
    p = seq.params
    inv_keep = 1.0 / (1.0 - p.dropout_p)
    for i0, i1 in seq.query_chunks():
        q_rows = seq.load_rows(q, i0, i1)
        row_max = torch.full(q_rows.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros_like(q_rows)
        row_hash = seq.row_hash(i0, i1) if seq.keep_threshold is not None else None
        for j0, j1, masked in seq.key_chunks(i0, i1):
            s, _ = seq.scores(q_rows, i0, i1, j0, j1, masked)
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            ref = _safe(new_max)
            probs = s.sub_(ref[..., None]).exp_()
            alpha = torch.exp(row_max - ref)
            row_sum.mul_(alpha).add_(probs.sum(dim=-1))
            if row_hash is not None:
                probs.masked_fill_(seq.dropped(row_hash, j0, j1), 0.0)
            acc.mul_(alpha[..., None]).add_(torch.matmul(probs, seq.v[:, :, j0:j1]))
            row_max = new_max
        if seq.sink is not None:
            sink = seq.sink_rows(i1 - i0)
            final_max = _safe(torch.maximum(row_max, sink))
            weight = torch.exp(row_max - final_max)
            denom = row_sum * weight + torch.exp(sink - final_max)
        else:
            final_max = _safe(row_max)
            weight = torch.exp(row_max - final_max)
            denom = row_sum * weight
        row_lse = final_max + torch.log(denom)
        scale = torch.where(denom > 0, weight / denom, torch.zeros_like(denom))
        if row_hash is not None:
            scale.mul_(inv_keep)
        seq.store_rows(out, acc.mul_(scale[..., None]), i0, i1)
        lse[:, :, i0:i1] = seq.row_view(row_lse, i0, i1)


def _backward_sequences(seq: _Sequences, dout, q, out, lse, dq, dk, dv, ds_aux_acc) -> None:
    p = seq.params
    inv_keep = 1.0 / (1.0 - p.dropout_p)
    dk_acc = torch.zeros_like(seq.k)
    dv_acc = torch.zeros_like(seq.v)
    for i0, i1 in seq.query_chunks():
        q_rows = seq.load_rows(q, i0, i1)
        do_rows = seq.load_rows(dout, i0, i1)
        delta = (do_rows * seq.load_rows(out, i0, i1)).sum(dim=-1)
        row_lse = seq.load_row_stat(lse, i0, i1)
        if ds_aux_acc is not None:
            sink_p = torch.exp(seq.sink_rows(i1 - i0) - row_lse)
            ds_aux_acc -= (sink_p * delta).view(
                seq.batch, seq.num_heads_kv, i1 - i0, seq.group).sum(dim=(0, 2)).flatten()
        ref = _safe(row_lse)[..., None]
        delta = delta[..., None]
        dq_acc = torch.zeros_like(q_rows)
        row_hash = seq.row_hash(i0, i1) if seq.keep_threshold is not None else None
        for j0, j1, masked in seq.key_chunks(i0, i1):
            s, tanh = seq.scores(q_rows, i0, i1, j0, j1, masked)
            probs = s.sub_(ref).exp_()
            k_chunk, v_chunk = seq.k[:, :, j0:j1], seq.v[:, :, j0:j1]
            dprobs = torch.matmul(do_rows, v_chunk.transpose(-1, -2))
            if row_hash is not None:
                dropped = seq.dropped(row_hash, j0, j1)
                kept_probs = probs.masked_fill(dropped, 0.0).mul_(inv_keep)
                dprobs.masked_fill_(dropped, 0.0).mul_(inv_keep)
            else:
                kept_probs = probs
            dv_acc[:, :, j0:j1] += torch.matmul(kept_probs.transpose(-1, -2), do_rows)
            dscores = dprobs.sub_(delta).mul_(probs)
            if tanh is not None:
                dscores.mul_(1.0 - tanh.square_())
            dq_acc.add_(torch.matmul(dscores, k_chunk))
            dk_acc[:, :, j0:j1] += torch.matmul(dscores.transpose(-1, -2), q_rows)
        seq.store_rows(dq, dq_acc.mul_(p.softmax_scale), i0, i1)
    dk.copy_(dk_acc.mul_(p.softmax_scale).permute(0, 2, 1, 3))
    dv.copy_(dv_acc.permute(0, 2, 1, 3))


def _varlen_slices(cu_seqlens_q, cu_seqlens_k):
    """``(b, (q0, q1), (k0, k1))`` per sequence, from int32 cumulative lengths."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        yield b, (cq[b], cq[b + 1]), (ck[b], ck[b + 1])


def _slopes_for(alibi_slopes, b0: int, b1: int):
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[b0:b1]


def forward(q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
            params: AttnParams) -> None:
    """Writes ``out`` (like q) and ``lse`` (float32, (B, Hq, Sq) or (Hq, Tq))."""
    with torch.no_grad():
        if cu_seqlens_q is None:
            seq = _Sequences(q, k, v, s_aux=s_aux, slopes=alibi_slopes, batch_offset=0,
                             params=params)
            _forward_sequences(seq, q, out, lse)
            return
        cq = cu_seqlens_q.tolist()
        out[:cq[0]] = 0
        out[cq[-1]:] = 0
        lse[:, :cq[0]] = -math.inf
        lse[:, cq[-1]:] = -math.inf
        for b, (q0, q1), (k0, k1) in _varlen_slices(cu_seqlens_q, cu_seqlens_k):
            if q1 == q0:
                continue
            seq = _Sequences(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], s_aux=s_aux,
                             slopes=_slopes_for(alibi_slopes, b, b + 1), batch_offset=b,
                             params=params)
            _forward_sequences(seq, q[None, q0:q1], out[None, q0:q1], lse[None, :, q0:q1])


def backward(dout, q, k, v, out, lse, dq, dk, dv, ds_aux, *, cu_seqlens_q, cu_seqlens_k, s_aux,
             alibi_slopes, params: AttnParams) -> None:
    """Writes ``dq`` (like q), ``dk``/``dv`` (like k/v, reduced over each kv head's query
    group) and ``ds_aux`` (float32 (Hq,), when s_aux is given)."""
    with torch.no_grad():
        ds_aux_acc = None
        if s_aux is not None:
            ds_aux_acc = torch.zeros(s_aux.shape, dtype=torch.float32, device=q.device)
        if cu_seqlens_q is None:
            seq = _Sequences(q, k, v, s_aux=s_aux, slopes=alibi_slopes, batch_offset=0,
                             params=params)
            _backward_sequences(seq, dout, q, out, lse, dq, dk, dv, ds_aux_acc)
        else:
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            for grad, bounds in ((dq, cq), (dk, ck), (dv, ck)):
                grad[:bounds[0]] = 0
                grad[bounds[-1]:] = 0
            for b, (q0, q1), (k0, k1) in _varlen_slices(cu_seqlens_q, cu_seqlens_k):
                seq = _Sequences(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], s_aux=s_aux,
                                 slopes=_slopes_for(alibi_slopes, b, b + 1), batch_offset=b,
                                 params=params)
                _backward_sequences(seq, dout[None, q0:q1], q[None, q0:q1], out[None, q0:q1],
                                    lse[None, :, q0:q1], dq[None, q0:q1], dk[None, k0:k1],
                                    dv[None, k0:k1], ds_aux_acc)
        if ds_aux is not None:
            ds_aux.copy_(ds_aux_acc)


# ---------------------------------------------------------------------------------------------
# KV caches (``flash_attn_with_kvcache``, paged ``flash_attn_varlen_func``): the reference
# semantics in torch ops. New keys are rotated and written in place, each sequence's logical
# keys gathered from its cache row or pages into one packed tensor, and the packed call runs
# through :func:`forward` (varlen) above. Reads the index vectors' values: the slow, obvious
# path, for CPU users and tests (on a GPU, ``FLASH_ATTN_HUB_BACKEND=cpu`` only).
# ---------------------------------------------------------------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """``x`` ``(.., S, H, D)`` rotated at ``positions`` ``(.., S)`` (int64), computed in float32
    and rounded to x's dtype; dims past ``rotary_dim = 2 * cos.shape[1]`` unchanged."""
    half = cos.shape[1]
    c = cos[positions].to(torch.float32).unsqueeze(-2)
    s = sin[positions].to(torch.float32).unsqueeze(-2)
    xr = x[..., :2 * half].to(torch.float32)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        turned = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        turned = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([turned.to(x.dtype), x[..., 2 * half:]], dim=-1)


def _cache_index(spans, *, block_table, rows, page_size: int, device):
    """``(blocks, slots)`` int64 index vectors of the cache positions ``spans[b]`` of every
    sequence, concatenated: ``(block_table[b][n // page_size], n % page_size)`` for a paged
    cache (``block_table`` a list of rows), ``(rows[b], n)`` for a contiguous one."""
    blocks, slots = [], []
    for b, span in enumerate(spans):
        for n in span:
            if block_table is None:
                blocks.append(rows[b])
                slots.append(n)
            else:
                blocks.append(block_table[b][n // page_size])
                slots.append(n % page_size)
    return (torch.tensor(blocks, dtype=torch.int64, device=device),
            torch.tensor(slots, dtype=torch.int64, device=device))


def _append(k_cache, v_cache, k, v, *, lengths, rows, table, page_size) -> None:
    """Writes new keys/values at positions ``lengths[b]..`` of every sequence but the padding
    slots (``lengths[b] < 0``)."""
    active = [b for b, n in enumerate(lengths) if n >= 0]
    if not active or k.shape[1] == 0:
        return
    spans = [range(lengths[b], lengths[b] + k.shape[1]) for b in active]
    index = _cache_index(spans, rows=[rows[b] for b in active], page_size=page_size,
                         block_table=None if table is None else [table[b] for b in active],
                         device=k_cache.device)
    k_cache[index] = k[active].flatten(0, 1)
    v_cache[index] = v[active].flatten(0, 1)


def kvcache_forward(q, k_cache, v_cache, out, lse, *, k, v, rotary_cos, rotary_sin,
                    cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q,
                    cu_seqlens_k, alibi_slopes, s_aux, params) -> None:
    """Writes ``out`` (like q) and ``lse`` (float32 ``(B, Hq, Sq)``, or ``(Hq, Tq)`` varlen)
    after appending ``k``/``v`` to the caches in place (``kvcache`` module notes: positions,
    padding slots, rotary). Inputs are validated by the caller."""
    with torch.no_grad():
        dev = k_cache.device
        table = None if block_table is None else block_table.tolist()
        rows = None
        if cu_seqlens_q is not None:  # paged varlen: keys are positions 0.. of each sequence
            ck = cu_seqlens_k.tolist()
            spans = [range(ck[b + 1] - ck[b]) for b in range(len(ck) - 1)]
            q_packed, cu_q, out_packed, lse_packed = q, cu_seqlens_q, out, lse
        else:
            batch, seqlen_q, heads_q, head_dim = q.shape
            lengths = cache_seqlens.tolist()
            rows = list(range(batch)) if cache_batch_idx is None else cache_batch_idx.tolist()
            starts = [0] * batch if cache_leftpad is None else cache_leftpad.tolist()
            seqlen_new = 0 if k is None else k.shape[1]
            if rotary_cos is not None:
                first = cache_seqlens.to(torch.int64).clamp(min=0)[:, None]
                q_rows = torch.arange(seqlen_q, device=dev) if params.rotary_per_row else 0
                last = rotary_cos.shape[0] - 1
                q = rotate(q, rotary_cos, rotary_sin, (first + q_rows).clamp(max=last)
                           .expand(batch, seqlen_q), params.rotary_interleaved)
                k = rotate(k, rotary_cos, rotary_sin,
                           (first + torch.arange(seqlen_new, device=dev)).clamp(max=last),
                           params.rotary_interleaved)
            if k is not None:
                _append(k_cache, v_cache, k, v, lengths=lengths, rows=rows, table=table,
                        page_size=k_cache.shape[1])
            if seqlen_q == 0:
                return
            spans = [range(starts[b], n + seqlen_new) if n >= 0 else range(0)
                     for b, n in enumerate(lengths)]
            q_packed = q.reshape(batch * seqlen_q, heads_q, head_dim)
            cu_q = torch.arange(0, batch * seqlen_q + 1, seqlen_q, dtype=torch.int32,
                                device=dev)
            out_packed = out.view(batch * seqlen_q, heads_q, head_dim)
            lse_packed = torch.empty(heads_q, batch * seqlen_q, dtype=torch.float32, device=dev)
        index = _cache_index(spans, block_table=table, rows=rows, page_size=k_cache.shape[1],
                             device=dev)
        cu_k = torch.tensor([0, *itertools.accumulate(len(s) for s in spans)],
                            dtype=torch.int32, device=dev)
        forward(q_packed, k_cache[index], v_cache[index], out_packed, lse_packed,
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, s_aux=s_aux, alibi_slopes=alibi_slopes,
                params=params.attention())
        if cu_seqlens_q is None:
            lse.copy_(lse_packed.view(heads_q, batch, seqlen_q).transpose(0, 1))
