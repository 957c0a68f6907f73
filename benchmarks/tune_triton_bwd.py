"""GPU ONLY: time candidate tile configs of the Triton backward kernels, write the tuning file.

    python benchmarks/tune_triton_bwd.py --quick        # D=128, S=4096, coordinate descent
                                                        # and coupled pairs
    python benchmarks/tune_triton_bwd.py                # D 64/128/256 x S 1k/4k/16k, exhaustive
    python benchmarks/tune_triton_bwd.py --head-dims 128 --seqlens 4096 16384 --out /tmp/t.json

The dK/dV and dQ kernels are separate launches, so the search runs per kernel: with the dQ
fields of the table fixed it searches the dK/dV fields of ``_triton_bwd.BwdTiles``, then with
the best dK/dV fixed the dQ fields. Each time is the whole backward (delta, dK/dV, dQ; bf16, 16k
tokens per batch, out/lse from the Triton forward, backward FLOPs = 2.5 x forward), on a causal
and a non-causal workload of each head shape in HEADS (D=128: MHA 16/16 and GQA 32/8, as
ANCHORS.md; ``--heads 16/16`` overrides). The best config is
recorded for this GPU, head-dim bucket and sequence-length bucket in
``torch-ext/flash_attn/triton_bwd_configs.json`` (or ``--out``), merged with the entries already
there. Search, timing and the summary table printed last are ``_tune_common``'s; long-format
results go to ``$OUT/tune_triton_bwd.jsonl`` when ``OUT`` is set.
"""

from __future__ import annotations

import math
import sys

import torch

import _tune_common as tc
from flash_attn_hub.reference import attention_reference, relative_error

# head dim -> the (query, kv) heads of the timed shapes; a config is scored by the geo-mean over
# all of them. D=128 times MHA and GQA 32/8 (the shapes of ANCHORS.md): one entry per bucket
# serves both, and the one tuned on GQA alone ran MHA 10-15% slower than GQA.
HEADS = {64: ((32, 32),), 128: ((16, 16), (32, 8)), 256: ((8, 8),)}
# Candidate values per kernel, for sm90. The dK/dV kernel holds two BLOCK_N x BLOCK_D fp32
# accumulators; ptxas reports 255 registers at 8 warps for D=128, so its query step BLOCK_M is
# the main trade-off (16 spills least, 64 measured fastest); stages 1 frees shared memory and
# registers. On sm90+ the ``*_tma`` fields are searched first: tensor descriptors cut ptxas's
# spills (dK/dV 64x128, 2 stages: 2.2 KB -> 1.3 KB; dQ 128x64: 255 regs -> 180, no spill).
# ``dkdv_d_splits`` (two programs per key block, each owning half the head dim) is searched
# first at D=128 and 256: it halves the accumulators (ptxas, sm_90a, D=256 with every feature:
# 10 KB -> 1.5 KB spilled) for 1.5x the score dots, so the best tiles differ with it.
DKDV = {
    64: dict(dkdv_block_m=(16, 32, 64), dkdv_block_n=(64, 128), dkdv_warps=(4, 8),
             dkdv_stages=(1, 2, 3)),
    128: dict(dkdv_d_splits=(1, 2), dkdv_block_m=(16, 32, 64), dkdv_block_n=(64, 128),
              dkdv_warps=(4, 8), dkdv_stages=(1, 2, 3)),
    256: dict(dkdv_d_splits=(1, 2), dkdv_block_m=(16, 32, 64), dkdv_block_n=(32, 64, 128),
              dkdv_warps=(4, 8), dkdv_stages=(1, 2)),
}
DQ = {
    64: dict(dq_block_m=(64, 128), dq_block_n=(32, 64, 128), dq_warps=(4, 8),
             dq_stages=(1, 2, 3)),
    128: dict(dq_block_m=(64, 128), dq_block_n=(32, 64, 128), dq_warps=(4, 8),
              dq_stages=(1, 2, 3)),
    256: dict(dq_block_m=(32, 64), dq_block_n=(16, 32), dq_warps=(4, 8), dq_stages=(1, 2)),
}
# Fields the quick search also varies together (``_tune_common.search``): the warps split the
# tiles, so a warp count can lose with one tile and win with another.
DKDV_PAIRS = (("dkdv_warps", "dkdv_block_n"), ("dkdv_warps", "dkdv_block_m"))
DQ_PAIRS = (("dq_warps", "dq_block_m"), ("dq_warps", "dq_block_n"))
CHECK_SEQLEN = 304  # ragged against every tile, a multiple of 16 (no extra specialisation)


class Problem:
    """Inputs, forward results and NaN-poisoned gradient buffers of one batched workload."""

    def __init__(self, bwd, fwd, attn_params, batch, seqlen, heads, head_dim, causal):
        hq, hkv = heads
        self.bwd = bwd
        self.params = tc.attn_params(attn_params, head_dim, causal, seqlen)
        rand = dict(device="cuda", dtype=torch.bfloat16)
        self.q = torch.randn(batch, seqlen, hq, head_dim, **rand)
        self.k = torch.randn(batch, seqlen, hkv, head_dim, **rand)
        self.v = torch.randn(batch, seqlen, hkv, head_dim, **rand)
        self.dout = torch.randn_like(self.q)
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(batch, hq, seqlen, device="cuda", dtype=torch.float32)
        fwd.forward(self.q, self.k, self.v, self.out, self.lse, cu_seqlens_q=None,
                    cu_seqlens_k=None, s_aux=None, alibi_slopes=None, params=self.params)
        self.grads = [torch.full_like(t, math.nan) for t in (self.q, self.k, self.v)]

    def run(self, tiles):
        self.bwd.backward(self.dout, self.q, self.k, self.v, self.out, self.lse, *self.grads,
                          None, cu_seqlens_q=None, cu_seqlens_k=None, s_aux=None,
                          alibi_slopes=None, params=self.params, tiles=tiles)


def _checker(bwd, fwd, attn_params, heads, head_dim):
    """``correct(tiles)``: gradients of a small causal problem (same GQA group and head count
    as the timed ones, so no extra compile) within the bf16 rule of float64 autograd."""
    torch.manual_seed(0)
    problem = Problem(bwd, fwd, attn_params, 1, CHECK_SEQLEN, heads, head_dim, True)

    def grads(dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True)
                  for t in (problem.q, problem.k, problem.v)]
        out, _ = attention_reference(*leaves, causal=True, dtype=dtype)
        return torch.autograd.grad(out, leaves, problem.dout.to(dtype))

    ref, low = grads(torch.float64), grads(torch.bfloat16)
    bounds = [2 * relative_error(lo, r) + 1e-6 for lo, r in zip(low, ref)]

    def correct(tiles):
        for g in problem.grads:
            g.fill_(math.nan)
        problem.run(tiles)
        return all(relative_error(ours, r) <= b for ours, r, b in zip(problem.grads, ref, bounds))
    return correct


def main() -> int:
    args = tc.parse_args(__doc__, sorted(HEADS), heads=True)
    if not tc.require_gpu("tune_triton_bwd.py"):
        return 2
    bwd, fwd, tuning, params_mod = tc.load("_triton_bwd", "_triton_fwd", "_tuning", "_params")
    attn_params = params_mod.AttnParams
    session = tc.Session("tune_triton_bwd", tuning, bwd.TABLE)
    arch = tuning.arch_of(torch.device("cuda"))

    for head_dim in args.head_dims:
        shapes = args.heads or HEADS.get(head_dim, ((16, 16),))
        block_d = tuning.block_d_for(head_dim)
        correct = _checker(bwd, fwd, attn_params, shapes[-1], head_dim)
        for seqlen in args.seqlens:
            batch = max(1, tc.TOKENS // seqlen)
            torch.manual_seed(1)
            workloads = tc.head_shape_workloads(
                shapes,
                lambda heads, causal: Problem(bwd, fwd, attn_params, batch, seqlen, heads,
                                              head_dim, causal),
                lambda heads: 2.5 * 4 * batch * heads[0] * seqlen * seqlen * head_dim,
                lambda heads: dict(head_dim=head_dim, heads=list(heads), batch=batch,
                                   seqlen=seqlen))
            tag = f"D={head_dim} S={seqlen}"
            score, results = session.scorer(correct, workloads, tag)

            default = bwd.TABLE.default(arch, head_dim)
            dkdv = {"atomic_dq": (False, True), **tc.hopper_fields("dkdv_tma"),
                    **DKDV.get(block_d, DKDV[128])}
            best = tc.search(default, tc.narrow(dkdv, args.space), score, args.quick,
                             DKDV_PAIRS)
            if not best.atomic_dq:  # the atomic path launches no dQ kernel
                dq = {**tc.hopper_fields("dq_tma"), **DQ.get(block_d, DQ[128])}
                best = tc.search(best, tc.narrow(dq, args.space), score, args.quick, DQ_PAIRS)
            session.record(block_d=block_d, seqlen=seqlen,
                           shape=f"B={batch} S={seqlen} H={','.join(f'{a}/{b}' for a, b in shapes)} "
                                 f"D={head_dim}",
                           best=best, default=default, results=results, tag=tag)
    return session.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())
