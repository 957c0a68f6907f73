"""GPU ONLY: measure candidate tile configs of the Triton backward kernels, write the tuning file.

    python benchmarks/tune_triton_bwd.py        # all head-dim buckets, writes
                                                # torch-ext/flash_attn/triton_bwd_configs.json
    python benchmarks/tune_triton_bwd.py --head-dims 128 --quick --out /tmp/t.json

The dK/dV and dQ kernels are separate launches, so the search is coordinate-wise: with the dQ
tiles of the table fixed it times every dK/dV candidate ``(BLOCK_M, BLOCK_N, num_warps,
num_stages)``, then with the best dK/dV fixed every dQ candidate. Each time is the whole
backward (``triton.testing.do_bench`` median, fresh random bf16 inputs, 16k tokens per batch as
in ANCHORS.md, out/lse from the Triton forward), scored by the geometric mean of the causal and
non-causal TFLOP/s (backward = 2.5 x forward FLOPs). Every candidate is first checked against
the float64 reference on a small GQA causal problem. The winner is recorded for this GPU's
arch with the measurement as its reason; the kernel module reads the file on first use and
its entries replace the defaults of ``_triton_bwd.TILES``; other entries in the file are kept.
Long-format results go to ``$OUT/tune_triton_bwd.jsonl`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import itertools
import json
import math
import os
import sys
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from reference import attention_reference, relative_error  # noqa: E402

# Head dim -> (query heads, kv heads): the standard grid of ANCHORS.md; D=128 uses its GQA case.
HEADS = {64: (32, 32), 128: (32, 8), 256: (8, 8)}
# Per kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates.
DKDV = {
    64: dict(block_m=(16, 32, 64), block_n=(64, 128), warps=(4, 8), stages=(2, 3)),
    128: dict(block_m=(16, 32, 64), block_n=(64, 128), warps=(8,), stages=(2, 3)),
    256: dict(block_m=(16, 32), block_n=(32, 64), warps=(8,), stages=(1, 2)),
}
DQ = {
    64: dict(block_m=(64, 128), block_n=(32, 64), warps=(4, 8), stages=(2, 3)),
    128: dict(block_m=(64, 128), block_n=(32, 64), warps=(4, 8), stages=(2, 3)),
    256: dict(block_m=(32, 64), block_n=(16, 32), warps=(4, 8), stages=(1, 2)),
}


def _package():
    package = types.ModuleType("flash_attn_tune")
    package.__path__ = [str(REPO / "torch-ext" / "flash_attn")]
    sys.modules["flash_attn_tune"] = package
    return (importlib.import_module("flash_attn_tune._triton_bwd"),
            importlib.import_module("flash_attn_tune._triton_fwd"),
            importlib.import_module("flash_attn_tune._params").AttnParams)


def _params(attn_params, head_dim, causal, seqlen):
    return attn_params(softmax_scale=head_dim ** -0.5, causal=causal, window_left=-1,
                       window_right=0 if causal else -1, softcap=0.0, dropout_p=0.0, seed=0,
                       deterministic=True, max_seqlen_q=seqlen, max_seqlen_k=seqlen)


class Problem:
    """Inputs, forward results and NaN-poisoned gradient buffers of one batched workload."""

    def __init__(self, fwd, attn_params, batch, seqlen, heads, head_dim, causal):
        hq, hkv = heads
        self.params = _params(attn_params, head_dim, causal, seqlen)
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

    def run(self, bwd, tiles):
        bwd.backward(self.dout, self.q, self.k, self.v, self.out, self.lse, *self.grads, None,
                     cu_seqlens_q=None, cu_seqlens_k=None, s_aux=None, alibi_slopes=None,
                     params=self.params, tiles=tiles)


def _correct(bwd, fwd, attn_params, head_dim, tiles) -> bool:
    """The candidate against float64 autograd on a small GQA causal problem (bf16 rule)."""
    torch.manual_seed(0)
    problem = Problem(fwd, attn_params, 2, 300, (4, 2), head_dim, True)
    problem.run(bwd, tiles)

    def grads(dtype):
        leaves = [t.detach().requires_grad_(True) for t in (problem.q, problem.k, problem.v)]
        out, _ = attention_reference(*leaves, causal=True, dtype=dtype)
        return torch.autograd.grad(out, leaves, problem.dout.to(dtype))

    ref, low = grads(torch.float64), grads(torch.bfloat16)
    return all(relative_error(ours, r) <= 2 * relative_error(lo, r) + 1e-6
               for ours, r, lo in zip(problem.grads, ref, low))


def _tflops(batch, seqlen, heads_q, head_dim, causal, ms):
    flops = 2.5 * 4 * batch * heads_q * seqlen * seqlen * head_dim / (2 if causal else 1)
    return flops / ms * 1e-9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=sorted(HEADS))
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="first two candidates per kernel")
    parser.add_argument("--out", type=Path, default=None,
                        help="tuning file (default: the package's triton_bwd_configs.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tune_triton_bwd.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    bwd, fwd, attn_params = _package()
    target = args.out or bwd.CONFIG_FILE
    device = torch.device("cuda")
    arch = bwd.arch_of(device)
    gpu = torch.cuda.get_device_name(device)
    stamp = datetime.date.today().isoformat()
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    log_path = Path(os.environ["OUT"]) / "tune_triton_bwd.jsonl" if os.environ.get("OUT") else None
    existing = json.loads(target.read_text())["backward"] if target.exists() else []
    entries = {(e["arch"], e["block_d"]): e for e in existing}

    for head_dim in args.head_dims:
        heads = HEADS.get(head_dim, (16, 16))
        batch = max(1, 16384 // args.seqlen)
        block_d = bwd.block_d_for(head_dim)
        torch.manual_seed(1)
        problems = [Problem(fwd, attn_params, batch, args.seqlen, heads, head_dim, causal)
                    for causal in (False, True)]
        default = bwd.TILES[(arch, block_d)]
        measured = {}

        def measure(tiles):
            """Geo-mean TFLOP/s of ``tiles`` (cached), None when it fails or is wrong."""
            key = dataclasses.astuple(dataclasses.replace(tiles, reason=""))
            if key in measured:
                return measured[key]
            measured[key] = None
            try:
                if not _correct(bwd, fwd, attn_params, head_dim, tiles):
                    print(f"D={head_dim} {key[:8]}: WRONG RESULT, skipped", flush=True)
                    return None
                rates = []
                for problem in problems:
                    ms = do_bench(lambda: problem.run(bwd, tiles), warmup=25, rep=100)
                    causal = problem.params.causal
                    rates.append(_tflops(batch, args.seqlen, heads[0], head_dim, causal, ms))
                    if log_path:
                        with log_path.open("a") as log:
                            log.write(json.dumps(dict(
                                provider="ours-triton", mode="bwd", tiles=key[:8],
                                head_dim=head_dim, heads=heads, batch=batch, seqlen=args.seqlen,
                                causal=causal, ms=ms, tflops=rates[-1], gpu=gpu,
                                versions=versions)) + "\n")
            except Exception as err:  # out of shared memory / registers: not a candidate
                print(f"D={head_dim} {key[:8]}: failed ({type(err).__name__}: {err})"[:200],
                      flush=True)
                return None
            measured[key] = (math.sqrt(rates[0] * rates[1]), rates)
            print(f"D={head_dim} {key[:8]}: {rates[0]:.0f} / {rates[1]:.0f} TFLOP/s "
                  f"(non-causal / causal)", flush=True)
            return measured[key]

        def sweep(best, space, fields):
            candidates = [dataclasses.replace(best, **dict(zip(fields, values)))
                          for values in itertools.product(*space.values())]
            if args.quick:
                candidates = candidates[:2]
            scored = [(measure(c), c) for c in [best, *candidates]]
            scored = [(result[0], c) for result, c in scored if result is not None]
            return max(scored, key=lambda sc: sc[0])[1] if scored else best

        best = sweep(default, DKDV.get(block_d, DKDV[128]),
                     ("dkdv_block_m", "dkdv_block_n", "dkdv_warps", "dkdv_stages"))
        best = sweep(best, DQ.get(block_d, DQ[128]),
                     ("dq_block_m", "dq_block_n", "dq_warps", "dq_stages"))
        result = measure(best)
        if result is None:
            print(f"D={head_dim}: no candidate ran", file=sys.stderr)
            continue
        score, rates = result
        base = measure(default)
        versus = f"; table default {base[0]:.0f}" if base and best != default else ""
        reason = (f"measured {stamp} on {gpu} ({versions}): bf16 B={batch} S={args.seqlen} "
                  f"H={heads[0]}/{heads[1]} backward {rates[0]:.0f}/{rates[1]:.0f} TFLOP/s "
                  f"non-causal/causal, geo-mean {score:.0f}{versus}")
        entry = dataclasses.asdict(dataclasses.replace(best, reason=reason))
        entries[(arch, block_d)] = dict(arch=arch, block_d=block_d, **entry)
        print(f"D={head_dim}: best {dataclasses.astuple(best)[:8]} -- {reason}", flush=True)

    ordered = sorted(entries.values(), key=lambda e: (e["arch"], e["block_d"]))
    target.write_text(json.dumps({"backward": ordered}, indent=1) + "\n")
    print(f"wrote {target}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], target.name).write_text(target.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
