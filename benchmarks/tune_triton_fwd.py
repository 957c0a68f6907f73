"""GPU ONLY: time candidate tile configs of the Triton forward kernel, write the tuning file.

    python benchmarks/tune_triton_fwd.py --quick        # D=128, S=4096, coordinate descent
                                                        # and coupled pairs
    python benchmarks/tune_triton_fwd.py                # D 64/128/192/256 x S 1k/4k/16k, exhaustive
    python benchmarks/tune_triton_fwd.py --head-dims 128 --seqlens 4096 16384 --out /tmp/t.json

For each (head dim, sequence length) it times candidates of ``_triton_fwd.FwdTiles`` on a causal
and a non-causal workload of each head shape in HEADS (bf16, 16k tokens per batch; D=128: MHA
16/16 and GQA 32/8, as ANCHORS.md; ``--heads 16/16`` overrides) and records the best for this GPU (``torch.cuda.get_device_name``), its head-dim bucket and
sequence-length bucket in ``torch-ext/flash_attn/triton_fwd_configs.json`` (or ``--out``),
merged with the entries already there. Search, timing and the summary table printed last are
``_tune_common``'s; long-format results go to ``$OUT/tune_triton_fwd.jsonl`` when ``OUT`` is set.
"""

from __future__ import annotations

import sys

import torch

import _tune_common as tc
from flash_attn_hub.reference import attention_reference, relative_error

# head dim -> the (query, kv) heads of the timed shapes; a config is scored by the geo-mean over
# all of them, so one entry per bucket serves MHA and GQA alike (as in tune_triton_bwd.py).
HEADS = {64: ((32, 32),), 128: ((16, 16), (32, 8)), 192: ((16, 16),), 256: ((8, 8),)}
# Candidate values per FwdTiles field, for sm90 (every value also compiles for sm80). D=128:
# the 128 x 64 x 8 warps x 3 stages default reached 456-472 TFLOP/s; 128 x 128 spills. On sm90+
# ``tma`` is searched first (ptxas: 248 -> 200 registers at D=128, which changes the best tiles);
# ``warp_specialize`` only on sm100+ (triton 3.6 compiles it to the same code on sm90).
SPACE = {
    64: dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4)),
    128: dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4)),
    256: dict(block_m=(64, 128), block_n=(32, 64), num_warps=(4, 8), num_stages=(1, 2)),
    # split into 128 + 64 columns on sm90+ (its own bucket, 192): 147 KB at 128 x 64 x 2
    # stages, so a third stage or 128 keys may fit where D=256's tiles do not
    192: dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3)),
}
# Fields the quick search also varies together (``_tune_common.search``): the warps split the
# query tile, and the key tile sets how many stages fit in shared memory.
PAIRS = (("num_warps", "block_m"), ("block_n", "num_stages"))
CHECK_SEQLEN = 304  # ragged against every tile, a multiple of 16 (no extra specialisation)


class Problem:
    """Random bf16 inputs and NaN-poisoned outputs of one batched forward."""

    def __init__(self, fwd, attn_params, batch, seqlen, heads, head_dim, causal):
        hq, hkv = heads
        self.fwd = fwd
        self.params = tc.attn_params(attn_params, head_dim, causal, seqlen)
        self.q = torch.randn(batch, seqlen, hq, head_dim, device="cuda", dtype=torch.bfloat16)
        self.k, self.v = (torch.randn(batch, seqlen, hkv, head_dim, device="cuda",
                                      dtype=torch.bfloat16) for _ in range(2))
        self.out = torch.full_like(self.q, float("nan"))
        self.lse = torch.full((batch, hq, seqlen), float("nan"), device="cuda")

    def run(self, tiles):
        self.fwd.forward(self.q, self.k, self.v, self.out, self.lse, cu_seqlens_q=None,
                         cu_seqlens_k=None, s_aux=None, alibi_slopes=None, params=self.params,
                         tiles=tiles)


def main() -> int:
    args = tc.parse_args(__doc__, sorted(HEADS), heads=True)
    if not tc.require_gpu("tune_triton_fwd.py"):
        return 2
    fwd, tuning, params_mod = tc.load("_triton_fwd", "_tuning", "_params")
    attn_params = params_mod.AttnParams
    session = tc.Session("tune_triton_fwd", tuning, fwd.TABLE)
    arch = tuning.arch_of(torch.device("cuda"))

    for head_dim in args.head_dims:
        shapes = args.heads or HEADS.get(head_dim, ((16, 16),))
        # the columns the kernel runs on this GPU: D=192 split on sm90+ keys a bucket of its own
        block_d = fwd.tile_width(head_dim, torch.device("cuda"))
        padded = tuning.block_d_for(head_dim)
        torch.manual_seed(0)
        check = Problem(fwd, attn_params, 1, CHECK_SEQLEN, shapes[-1], head_dim, True)
        ref, _ = attention_reference(check.q, check.k, check.v, causal=True)
        low, _ = attention_reference(check.q, check.k, check.v, causal=True,
                                     dtype=torch.bfloat16)
        bound = 2 * relative_error(low, ref) + 1e-6

        def correct(tiles):
            check.out.fill_(float("nan"))
            check.run(tiles)
            return relative_error(check.out, ref) <= bound

        for seqlen in args.seqlens:
            batch = max(1, tc.TOKENS // seqlen)
            torch.manual_seed(1)
            workloads = tc.head_shape_workloads(
                shapes,
                lambda heads, causal: Problem(fwd, attn_params, batch, seqlen, heads, head_dim,
                                              causal),
                lambda heads: 4 * batch * heads[0] * seqlen * seqlen * head_dim,
                lambda heads: dict(head_dim=head_dim, heads=list(heads), batch=batch,
                                   seqlen=seqlen))
            tag = f"D={head_dim} S={seqlen}"
            score, results = session.scorer(correct, workloads, tag)

            default, default_label = fwd.TABLE.default(arch, head_dim), "table default"
            if block_d != padded:
                # start from what the split ran before it had entries: the padded bucket's
                default = fwd.TABLE.lookup(arch, session.gpu, padded,
                                           tuning.seqlen_bucket(seqlen))
                default_label = f"D={padded} entry"
            space = {**tc.hopper_fields("tma"), **tc.blackwell_fields("warp_specialize"),
                     **SPACE.get(block_d, SPACE[128])}
            best = tc.search(default, tc.narrow(space, args.space), score, args.quick, PAIRS)
            session.record(block_d=block_d, seqlen=seqlen,
                           shape=f"B={batch} S={seqlen} H={','.join(f'{a}/{b}' for a, b in shapes)} "
                                 f"D={head_dim}", best=best,
                           default=default, results=results, tag=tag,
                           default_label=default_label)
    return session.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())
