"""Checks every provider's output (and gradients) against the oracle
(``flash_attn_hub.reference``) before it is timed, on a cheap slice of the workload.

[Note] The slice. The oracle is O(S^2) in memory, so it sees one batch element (varlen:
the longest document), at most ``ROWS`` trailing query rows and the first and last query
heads with their kv heads. Taking the *last* rows keeps the bottom-right aligned mask
identical to the full problem's. For gradients, the upstream gradient is zero outside
the slice, so dK/dV of the sliced kv heads receive contributions from the sliced rows
and heads only, which the oracle computes exactly from the slice.

A kv-cache step is checked against ``kvcache_reference`` on the same kind of slice: the last
sequence's query rows and heads, its kv heads of the cache (for a paged cache every block,
so the oracle follows that sequence's block-table row itself).

The oracle sees the workload's mask and softcap (capped before the mask, as flash-attn
does). On a softcap workload q is spread to the cap (the [Note] Softcap inputs of
``workloads.make_inputs``), so a provider that drops the cap fails here.

The tolerance is the project's rule (STYLE.md): a provider's relative error against the
float64 oracle may be at most twice PyTorch's own error in the same low precision.
"""

from __future__ import annotations

import dataclasses
import torch

from .. import reference as ref
from .workloads import Inputs, Workload

ROWS = 128


class VerificationError(Exception):
    """A provider's output or gradient is outside the tolerance, or not finite."""


@dataclasses.dataclass
class Slice:
    """Where the verified slice sits in the canonical layout (``workloads.Inputs``)."""
    varlen: bool
    batch: int  # batched: batch index; varlen: first token of the document
    q_rows: tuple[int, int]  # [start, end) within the sequence
    seqlen_k: int
    q_heads: torch.Tensor
    kv_heads: torch.Tensor

    def take_q(self, t: torch.Tensor) -> torch.Tensor:
        """``(rows, hq', D)`` from a q-like canonical tensor."""
        rows = t[self.batch + self.q_rows[0]:self.batch + self.q_rows[1]] if self.varlen \
            else t[self.batch, self.q_rows[0]:self.q_rows[1]]
        return rows.index_select(1, self.q_heads.to(t.device))

    def take_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``(Sk, hkv', D)`` from a k/v-like canonical tensor."""
        rows = t[self.batch:self.batch + self.seqlen_k] if self.varlen else t[self.batch]
        return rows.index_select(1, self.kv_heads.to(t.device))

    def put_q(self, t: torch.Tensor, value: torch.Tensor) -> None:
        rows = t[self.batch + self.q_rows[0]:self.batch + self.q_rows[1]] if self.varlen \
            else t[self.batch, self.q_rows[0]:self.q_rows[1]]
        rows[:, self.q_heads.to(t.device)] = value


def make_slice(w: Workload) -> Slice:
    group = w.heads_q // w.heads_kv
    q_heads = sorted({0, w.heads_q - 1})
    kv_heads = sorted({h // group for h in q_heads})
    if w.varlen:
        doc = max(range(len(w.seqlens)), key=lambda i: w.seqlens[i])
        length = w.seqlens[doc]
        rows = min(length, ROWS)
        return Slice(True, sum(w.seqlens[:doc]), (length - rows, length), length,
                     torch.tensor(q_heads), torch.tensor(kv_heads))
    rows = min(w.seqlen_q, ROWS)
    return Slice(False, w.batch - 1, (w.seqlen_q - rows, w.seqlen_q), w.seqlen_k,
                 torch.tensor(q_heads), torch.tensor(kv_heads))


@dataclasses.dataclass
class Expected:
    """Oracle results on the slice: float64 and PyTorch-in-low-precision, out and grads."""
    slice: Slice
    dout: torch.Tensor | None
    ref64: dict[str, torch.Tensor]
    lowp: dict[str, torch.Tensor]


def expected(w: Workload, x: Inputs, *, with_grads: bool) -> Expected:
    """Run the oracle on the slice of one canonical input set."""
    if w.kv_cache:
        return _kvcache_expected(w, x)
    sl = make_slice(w)
    qs, ks, vs = sl.take_q(x.q), sl.take_kv(x.k), sl.take_kv(x.v)
    gen = torch.Generator(device=x.q.device).manual_seed(1234)
    dout = torch.randn(qs.shape, generator=gen, device=x.q.device).to(x.q.dtype) if with_grads else None
    results = {}
    for label, dtype in (("ref64", torch.float64), ("lowp", x.q.dtype)):
        leaves = [t.detach().to(dtype).unsqueeze(0).requires_grad_(with_grads) for t in (qs, ks, vs)]
        with torch.enable_grad():
            out, _ = ref.attention_reference(*leaves, causal=w.causal, window_size=w.window_size,
                                             softcap=w.softcap, dtype=dtype)
            got = {"out": out[0].detach()}
            if with_grads:
                grads = torch.autograd.grad(out, leaves, dout.unsqueeze(0).to(dtype))
                got.update(dq=grads[0][0], dk=grads[1][0], dv=grads[2][0])
        results[label] = got
    return Expected(sl, dout, results["ref64"], results["lowp"])


def _kvcache_expected(w: Workload, x: Inputs) -> Expected:
    """``kvcache_reference`` (forward only) on the slice of a kv-cache step."""
    sl = make_slice(w)
    b, (first, last) = sl.batch, sl.q_rows
    kv_heads = sl.kv_heads.to(x.k.device)
    q = x.q[b:b + 1, first:last].index_select(2, sl.q_heads.to(x.q.device))
    if x.block_table is None:
        k_cache, v_cache = (t[b:b + 1].index_select(2, kv_heads) for t in (x.k, x.v))
        table = None
    else:
        k_cache, v_cache = (t.index_select(2, kv_heads) for t in (x.k, x.v))
        table = x.block_table[b:b + 1]
    results = {label: {"out": ref.kvcache_reference(q, k_cache, v_cache, cache_seqlens=x.cache_seqlens[b:b + 1],
                                                    block_table=table, causal=w.causal,
                                                    window_size=w.window_size, softcap=w.softcap,
                                                    dtype=dtype)["out"][0]}
               for label, dtype in (("ref64", torch.float64), ("lowp", x.q.dtype))}
    return Expected(sl, None, results["ref64"], results["lowp"])


def check(name: str, got: dict[str, torch.Tensor], exp: Expected) -> dict[str, float]:
    """Apply the tolerance rule to every tensor in ``got``; return the relative errors
    against float64, or raise :class:`VerificationError` naming the tensor."""
    errors = {}
    for key, value in got.items():
        try:
            ref.assert_close_to_reference(f"{name} {key}", value, exp.ref64[key], exp.lowp[key])
        except AssertionError as err:
            raise VerificationError(str(err)) from None
        errors[key] = ref.relative_error(value, exp.ref64[key])
    return errors


def verify(name: str, prepared, exp: Expected, *, grads: bool) -> dict[str, float]:
    """Run the prepared provider once and check it: the forward output, or (``grads``)
    forward and backward, then dQ/dK/dV. ``prepared`` is a ``providers.Prepared``."""
    sl = exp.slice
    with torch.set_grad_enabled(grads):
        out = prepared.fwd()
        out_c = prepared.to_canonical(out)
        if not grads:
            if not torch.isfinite(out_c).all():
                raise VerificationError(f"{name}: output has non-finite values")
            return check(name, {"out": sl.take_q(out_c)}, exp)
        dout_c = torch.zeros_like(out_c)
        sl.put_q(dout_c, exp.dout)
        out.backward(prepared.to_provider(dout_c, pad="zeros"))
    dq, dk, dv = (prepared.to_canonical(t.grad) for t in prepared.leaves)
    for t in prepared.leaves:
        t.grad = None
    return check(name, {"dq": sl.take_q(dq), "dk": sl.take_kv(dk), "dv": sl.take_kv(dv)}, exp)
