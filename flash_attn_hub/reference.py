"""The one attention oracle. Every test, the benchmark's verification, the Triton tuning
checks and ``python -m flash_attn_hub verify`` import it as a module
(``from flash_attn_hub.reference import ...``); nobody writes a second one.

It computes attention the slow, obvious way (the full score matrix, one
sequence at a time) in float64 by default, with every feature the package
claims: GQA by index (query head ``h`` uses kv head ``h // (Hq // Hkv)``),
bottom-right aligned causal and sliding-window masks, softcap, ALiBi,
attention sinks (``s_aux``), dropout with the package's counter-based mask,
and varlen by splitting on ``cu_seqlens``. Gradients come from autograd on
the same float64 graph.

Conventions shared with the kernels:

* A row with no visible key has ``out = 0`` and ``lse = -inf`` (or
  ``lse = s_aux[h]`` when a sink is present).
* ``lse`` includes the sink: ``lse = log(exp(s_aux) + sum_j exp(s_j))``.
* Scores: ``s = scale * q.k``; ``s = softcap * tanh(s / softcap)`` when
  ``softcap > 0``; then ``s -= slope[h] * |i + Sk - Sq - j|`` for ALiBi.
* Dropout drops entries of the normalised probabilities and rescales the
  kept ones by ``1 / (1 - p)``; ``lse`` is unaffected.
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit integer finaliser used by the dropout RNG, on int64 tensors
    holding values in [0, 2**32). Kernels implement the same function on
    uint32 (multiplication wraps mod 2**32 there; here we mask)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    x = x ^ (x >> 15)
    return x


def dropout_keep_mask(seed: int, batch: int, head: int, num_heads_q: int,
                      seqlen_q: int, seqlen_k: int, p: float) -> torch.Tensor:
    """Boolean keep-mask ``(seqlen_q, seqlen_k)`` for one (batch, query head).

    ``row = mix32(mix32(seed_lo ^ mix32((batch * Hq + head + seed_hi) mod 2**32)) ^ i)``,
    ``r = mix32(row ^ j)``; the entry is kept iff ``r >= threshold`` with
    ``threshold = min(floor(p * 2**32), 2**32 - 1)``. ``i``/``j`` are indices
    local to the sequence (varlen: relative to its start)."""
    seed_lo = seed & MASK32
    seed_hi = (seed >> 32) & MASK32
    bh = torch.tensor((batch * num_heads_q + head + seed_hi) & MASK32, dtype=torch.int64)
    base = mix32(torch.tensor(seed_lo, dtype=torch.int64) ^ mix32(bh))
    i = torch.arange(seqlen_q, dtype=torch.int64)
    j = torch.arange(seqlen_k, dtype=torch.int64)
    row = mix32(base ^ i)
    r = mix32(row[:, None] ^ j[None, :])
    threshold = min(int(p * 2**32), MASK32)
    return r >= threshold


def visible_mask(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int,
                 device=None) -> torch.Tensor:
    """``(Sq, Sk)`` bool: key ``j`` visible from query ``i`` (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        ok &= j >= diag - window_left
    if window_right >= 0:
        ok &= j <= diag + window_right
    return ok


def _one_sequence(q, k, v, *, scale, window_left, window_right, softcap, alibi, s_aux,
                  dropout_p, seed, batch_index):
    """q (Sq, Hq, D), k/v (Sk, Hkv, D) in the compute dtype -> out (Sq, Hq, D), lse (Hq, Sq)."""
    seqlen_q, num_heads_q, _ = q.shape
    seqlen_k, num_heads_kv, _ = k.shape
    group = num_heads_q // num_heads_kv
    kv_index = torch.arange(num_heads_q, device=q.device) // group
    k_h = k[:, kv_index]  # the oracle may expand; the kernels may not
    v_h = v[:, kv_index]
    s = torch.einsum("ihd,jhd->hij", q, k_h) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        dist = (i + seqlen_k - seqlen_q - j).abs().to(s.dtype)
        s = s - alibi.to(s.dtype)[:, None, None] * dist
    visible = visible_mask(seqlen_q, seqlen_k, window_left, window_right, q.device)
    s = s.masked_fill(~visible, -math.inf)
    if s_aux is not None:
        sink = s_aux.to(s.dtype)[:, None, None].expand(num_heads_q, seqlen_q, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1) if seqlen_k > 0 else torch.full(
            (num_heads_q, seqlen_q), -math.inf, dtype=s.dtype, device=q.device)
    finite = torch.isfinite(lse)
    safe_lse = torch.where(finite, lse, torch.zeros_like(lse))
    p = torch.exp(s - safe_lse[..., None])
    p = torch.where(finite[..., None], p, torch.zeros_like(p))
    if dropout_p > 0:
        keep = torch.stack([
            dropout_keep_mask(seed, batch_index, h, num_heads_q, seqlen_q, seqlen_k, dropout_p)
            for h in range(num_heads_q)
        ]).to(q.device)
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    out = torch.einsum("hij,jhd->ihd", p, v_h)
    return out, lse


def attention_reference(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, s_aux=None, dropout_p=0.0, seed=0,
                        cu_seqlens_q=None, cu_seqlens_k=None, dtype=torch.float64):
    """Attention in ``dtype`` (float64 by default), differentiable.

    Batched: q ``(B, Sq, Hq, D)``, k/v ``(B, Sk, Hkv, D)`` -> out ``(B, Sq, Hq, D)``,
    lse ``(B, Hq, Sq)``. Varlen (``cu_seqlens_q``/``cu_seqlens_k`` given): q ``(Tq, Hq, D)``,
    k/v ``(Tk, Hkv, D)`` -> out ``(Tq, Hq, D)``, lse ``(Hq, Tq)``. ``alibi_slopes`` is
    ``(Hq,)`` or ``(B, Hq)``. Outputs are in ``dtype``; pass ``dtype=q.dtype`` to get
    "PyTorch's own error" in low precision for the tolerance rule.
    """
    head_dim = q.shape[-1]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    window_left, window_right = window_size
    if causal:
        window_right = 0
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    s_aux_c = None if s_aux is None else s_aux.to(dtype)

    def slopes_for(b):
        if alibi_slopes is None:
            return None
        return alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]

    common = dict(scale=scale, window_left=window_left, window_right=window_right,
                  softcap=softcap, s_aux=s_aux_c, dropout_p=dropout_p, seed=seed)
    if cu_seqlens_q is None:
        outs, lses = [], []
        for b in range(q.shape[0]):
            o, l = _one_sequence(qc[b], kc[b], vc[b], alibi=slopes_for(b), batch_index=b, **common)
            outs.append(o)
            lses.append(l)
        return torch.stack(outs), torch.stack(lses)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        o, l = _one_sequence(qc[cq[b]:cq[b + 1]], kc[ck[b]:ck[b + 1]], vc[ck[b]:ck[b + 1]],
                             alibi=slopes_for(b), batch_index=b, **common)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / max(||ref||, tiny)`` over the finite entries of ``ref``;
    entries where ``ref`` is infinite must match it exactly (else +inf)."""
    x = x.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    finite = torch.isfinite(ref)
    if not bool(finite.all()):  # masked copies only when needed (slow on a model's gradient vector)
        if not torch.equal(x[~finite], ref[~finite]):
            return math.inf
        x, ref = x[finite], ref[finite]
    if torch.isnan(x).any():
        return math.inf
    diff = (x - ref).norm().item()
    return diff / max(ref.norm().item(), 1e-30)


def assert_close_to_reference(name: str, ours: torch.Tensor, ref64: torch.Tensor,
                              torch_lowp: torch.Tensor, *, factor: float = 2.0,
                              floor: float = 1e-6) -> None:
    """The tolerance rule (STYLE.md): ``err(ours) <= factor * err(torch_lowp) + floor``,
    both errors measured against the float64 reference ``ref64``."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    ours_err = relative_error(ours, ref64)
    torch_err = relative_error(torch_lowp, ref64)
    limit = factor * torch_err + floor
    assert ours_err <= limit, (
        f"{name}: error {ours_err:.3e} exceeds {factor} x torch's own {torch_err:.3e} + {floor:g}")


# -- KV caches (flash_attn_with_kvcache, paged varlen) ------------------------------------------
#
# The cache is read the obvious way: each sequence's logical keys are gathered position by
# position (through its block-table row when paged), the new keys (rotated) appended after them,
# and the result goes through `attention_reference`. Nothing here writes a cache.

def rotary_reference(x, cos, sin, positions, *, interleaved: bool, dtype=torch.float64):
    """``x`` ``(S, H, D)`` rotated at ``positions`` ``(S,)``, computed in ``dtype``: pairs
    ``(2i, 2i + 1)`` when ``interleaved``, else ``(i, i + rotary_dim / 2)``, each turned by the
    angle whose cosine and sine are ``cos[p, i]``, ``sin[p, i]``; dims past ``rotary_dim =
    2 * cos.shape[1]`` are unchanged."""
    half = cos.shape[1]
    c = cos.to(dtype)[positions][:, None, :]
    s = sin.to(dtype)[positions][:, None, :]
    x = x.to(dtype)
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        turned = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
        turned = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([turned, x[..., 2 * half:]], dim=-1)


def cache_rows(cache, start: int, end: int, *, row=None, pages=None):
    """Logical positions ``[start, end)`` of one sequence as ``(end - start, Hkv, D)``: rows of
    ``cache[row]`` (contiguous cache), or gathered from the blocks ``pages`` (a list, the
    sequence's block-table row) of a paged cache."""
    if pages is None:
        return cache[row, start:end]
    size, count = cache.shape[1], cache.shape[0]
    blocks = [pages[n // size] for n in range(start, end)]
    if any(not -count <= block < count for block in blocks):
        raise IndexError(f"block index out of range for a cache of {count} blocks")
    # One gather (not a stack of per-position views), so a 128k-key sequence stays cheap.
    device = cache.device
    return cache[torch.tensor(blocks, dtype=torch.int64, device=device),
                 torch.arange(start, end, device=device) % size]


def kvcache_reference(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None,
                      cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                      block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, rotary_interleaved=True, alibi_slopes=None, s_aux=None,
                      dtype=torch.float64):
    """``flash_attn_with_kvcache`` in ``dtype``: a dict with ``out`` ``(B, Sq, Hq, D)``, ``lse``
    ``(B, Hq, Sq)`` and, with new keys, ``k_new``/``v_new`` ``(B, Sk_new, Hkv, D)``: what the
    call must write at cache positions ``cache_seqlens[b] + j`` (k rotated), in ``dtype``.

    Sequence ``b`` attends to cache positions ``[cache_leftpad[b], cache_seqlens[b])`` of its
    cache row (``cache_batch_idx[b]`` or ``b``) or of its pages (``block_table[b]``), then to its
    new keys; ``cache_seqlens[b] == -1`` is a padding slot that sees no key. Rotary: new key
    ``j`` at position ``cache_seqlens[b] + j``; query row ``i`` at ``cache_seqlens[b] + i`` when
    causal or local, else at ``cache_seqlens[b]``. ``cache_seqlens`` may be an int; None means
    the whole cache."""
    batch, seqlen_q = q.shape[:2]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if cache_seqlens is None:
        cache_seqlens = capacity
    lengths = ([cache_seqlens] * batch if isinstance(cache_seqlens, int)
               else cache_seqlens.tolist())
    starts = [0] * batch if cache_leftpad is None else cache_leftpad.tolist()
    rows = list(range(batch)) if cache_batch_idx is None else cache_batch_idx.tolist()
    local = causal or window_size[0] >= 0 or window_size[1] >= 0
    rotate = dict(interleaved=rotary_interleaved, dtype=dtype)
    outs, lses, k_news, v_news = [], [], [], []
    for b in range(batch):
        n = lengths[b]
        where = dict(pages=block_table[b].tolist()) if paged else dict(row=rows[b])
        qb = q[b].to(dtype)
        if n < 0:  # a padding slot: no key at all
            keys = values = k_cache.new_empty((0, *k_cache.shape[2:])).to(dtype)
        else:
            keys = cache_rows(k_cache, starts[b], n, **where).to(dtype)
            values = cache_rows(v_cache, starts[b], n, **where).to(dtype)
        if k is not None:
            new_k, new_v = k[b].to(dtype), v[b].to(dtype)
            position = max(n, 0)
            if rotary_cos is not None:
                new_k = rotary_reference(k[b], rotary_cos, rotary_sin,
                                         position + torch.arange(k.shape[1]), **rotate)
                q_pos = position + (torch.arange(seqlen_q) if local
                                    else torch.zeros(seqlen_q, dtype=torch.int64))
                qb = rotary_reference(q[b], rotary_cos, rotary_sin, q_pos, **rotate)
            k_news.append(new_k)
            v_news.append(new_v)
            if n >= 0:
                keys = torch.cat([keys, new_k])
                values = torch.cat([values, new_v])
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        out, lse = attention_reference(qb[None], keys[None], values[None],
                                       softmax_scale=softmax_scale, causal=causal,
                                       window_size=window_size, softcap=softcap,
                                       alibi_slopes=slopes, s_aux=s_aux, dtype=dtype)
        outs.append(out[0])
        lses.append(lse[0])
    result = {"out": torch.stack(outs), "lse": torch.stack(lses)}
    if k is not None:
        result.update(k_new=torch.stack(k_news), v_new=torch.stack(v_news))
    return result


def paged_varlen_reference(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, *,
                           dtype=torch.float64, **kwargs):
    """``flash_attn_varlen_func(..., block_table=)``: sequence ``b``'s keys are positions
    ``[0, cu_seqlens_k[b + 1] - cu_seqlens_k[b])`` of its pages; ``(out, lse)`` as
    :func:`attention_reference` gives them for the gathered keys. ``kwargs``: its keywords."""
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    keys, values = [], []
    for b, n in enumerate(lengths):
        pages = block_table[b].tolist()
        keys.append(cache_rows(k_cache, 0, n, pages=pages))
        values.append(cache_rows(v_cache, 0, n, pages=pages))
    return attention_reference(q, torch.cat(keys), torch.cat(values), cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, dtype=dtype, **kwargs)
