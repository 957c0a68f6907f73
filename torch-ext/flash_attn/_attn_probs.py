"""The attention probabilities ``return_attn_probs=True`` returns when dropout is on: flash-attn
2's ``S_dmask``, materialised for small shapes (a testing aid, never a kernel output).

Convention (flash-attn 2's sign encoding, with exact values): entry ``[b, h, i, j]`` is the
softmax probability ``P = exp(s_ij - lse_i)`` of query ``i`` and key ``j`` of sequence ``b``
and query head ``h``, before dropout's ``1 / (1 - p)`` rescaling, negated where dropout dropped
the entry. ``s_ij`` is the score with every modifier applied (scale, softcap, ALiBi) and ``lse``
includes the sink, so with ``s_aux`` a row sums to less than 1. Keys a query cannot see (causal,
window, a row that sees no key) have ``P = 0``. So ``S_dmask.abs()`` is the probability matrix,
``S_dmask >= 0`` the keep mask on visible entries, and
``(S_dmask.clamp(min=0) / (1 - p)) @ v`` the output.

Shape ``(batch, num_heads_q, seqlen_q, seqlen_k)``; for varlen ``(batch, num_heads_q,
max_seqlen_q, max_seqlen_k)`` with sequence ``b`` in ``[b, :, :len_q, :len_k]`` and zeros
elsewhere. flash-attn 2 rounds the last two sizes up to multiples of 128 (zeros again), so code
written for it slices ``[..., :seqlen_q, :seqlen_k]``, which reads the same values here.

The scores and the dropout mask come from the CPU backend's score hook and counter-based mask
(``_cpu._Sequences``), the definitions every kernel's dropout is tested against, computed in
float32 on the inputs' device. The whole matrix exists at once, hence :data:`MAX_ELEMENTS`.
"""

from __future__ import annotations

import importlib

import torch

# 2**24 entries: 32 MiB of fp16 output, about 200 MiB of float32 scores and int64 hashes while
# one sequence is computed. Larger requests are answered with None (public API) or an empty
# matrix (the flash-attn 2 private wrapper, see flash_attn_interface.py), and a warning.
MAX_ELEMENTS = 1 << 24


def num_elements(q, k, cu_seqlens_q, params) -> int:
    """Entries of the matrix a call would return."""
    num_heads_q = q.shape[-2]
    if cu_seqlens_q is None:
        return q.shape[0] * num_heads_q * q.shape[1] * k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    return batch * num_heads_q * params.max_seqlen_q * params.max_seqlen_k


def fits(q, k, cu_seqlens_q, params) -> bool:
    return num_elements(q, k, cu_seqlens_q, params) <= MAX_ELEMENTS


def _one_batch(cpu, q, k, lse, *, slopes, batch_offset, params) -> torch.Tensor:
    """``(B, Hq, Sq, Sk)`` float32 dropout-encoded probabilities of equal-length sequences
    ``q (B, Sq, Hq, D)``, ``k (B, Sk, Hkv, D)``, ``lse (B, Hq, Sq)`` (-inf for a row that sees
    no key)."""
    seq = cpu._Sequences(q, k, k, s_aux=None, slopes=slopes, batch_offset=batch_offset,
                         params=params)
    seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
    if seqlen_q == 0 or seqlen_k == 0:
        return torch.zeros(seq.batch, q.shape[2], seqlen_q, seqlen_k, device=q.device)
    scores, _ = seq.scores(seq.load_rows(q, 0, seqlen_q), 0, seqlen_q, 0, seqlen_k, True)
    row_lse = seq.load_row_stat(lse, 0, seqlen_q)
    probs = scores.sub_(cpu._safe(row_lse)[..., None]).exp_()
    dropped = seq.dropped(seq.row_hash(0, seqlen_q), 0, seqlen_k)
    probs = torch.where(dropped, -probs, probs)
    # rows (B, Hkv, Sq * GROUP, Sk) -> (B, Hkv * GROUP, Sq, Sk)
    probs = probs.view(seq.batch, seq.num_heads_kv, seqlen_q, seq.group, seqlen_k)
    return probs.transpose(2, 3).reshape(seq.batch, -1, seqlen_q, seqlen_k)


@torch.compiler.disable
def dropout_encoded(q, k, lse, *, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                    params) -> torch.Tensor:
    """The matrix described in the module docstring, in q's dtype, for the call whose inputs
    (as the backend saw them), forward ``lse`` (the ops' -inf convention) and params (with the
    call's dropout seed) are given."""
    cpu = importlib.import_module(f"{__package__}._cpu")
    num_heads_q = q.shape[-2]
    with torch.no_grad():
        if cu_seqlens_q is None:
            probs = _one_batch(cpu, q, k, lse, slopes=alibi_slopes, batch_offset=0,
                               params=params)
            return probs.to(q.dtype)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        batch = len(cq) - 1
        probs = torch.zeros(batch, num_heads_q, params.max_seqlen_q, params.max_seqlen_k,
                            dtype=q.dtype, device=q.device)
        for b in range(batch):
            (q0, q1), (k0, k1) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
            if q1 == q0 or k1 == k0:
                continue
            slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else (
                alibi_slopes[b:b + 1])
            probs[b, :, :q1 - q0, :k1 - k0] = _one_batch(
                cpu, q[None, q0:q1], k[None, k0:k1], lse[None, :, q0:q1], slopes=slopes,
                batch_offset=b, params=params)[0]
        return probs
