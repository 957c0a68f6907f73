"""GPU ONLY: the Triton kernels of this tree against a baseline copy, in one process.

Benchmark runs of different processes move by a few percent (cuDNN's own cells moved 438 -> 469
TFLOP/s between two runs on one H200), which hides the 1-4% a kernel change is usually worth.
This script times the working tree's Triton forward or backward and a baseline copy of the
package alternately in one process (median of ``--rounds`` rounds, each a
``triton.testing.do_bench`` median), on the same inputs, with each package's own tuned tiles, and
prints the ratio per workload. The forward also reports whether the two outputs are bitwise
equal.

The baseline is a directory holding another revision's ``torch-ext/flash_attn`` (the GPU machine
has no git), made where the repository is, e.g.::

    mkdir -p .device-carry/base && git archive HEAD~1 torch-ext/flash_attn | tar x -C .device-carry/base
    python3 scripts/ab_triton.py --baseline .device-carry/base/torch-ext/flash_attn --kernel fwd

Workloads: bf16, 16k tokens per batch (ANCHORS.md), ``--seqlens`` x ``--heads`` x ``--masks``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

import _tune_common as tc  # noqa: E402
from flash_attn_hub.bench.workloads import Workload, attention_flops  # noqa: E402
import tune_triton_bwd  # noqa: E402
import tune_triton_fwd  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="another revision's torch-ext/flash_attn directory")
    parser.add_argument("--kernel", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=tc._parse_heads, nargs="+", default=[(16, 16), (32, 8)])
    parser.add_argument("--masks", choices=("full", "causal"), nargs="+",
                        default=["full", "causal"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not tc.require_gpu("ab_triton.py"):
        return 2
    if not (args.baseline / "_triton" / "fwd.py").is_file():
        parser.error(f"--baseline {args.baseline}: no _triton/fwd.py there")
    from triton.testing import do_bench

    ours_fwd, params_mod = tc.load("_triton.fwd", "_params")
    base_fwd, = tc.load("_triton.fwd", package=args.baseline, alias="flash_attn_baseline")
    attn_params = params_mod.AttnParams
    if args.kernel == "bwd":
        ours_bwd, = tc.load("_triton.bwd")
        base_bwd, = tc.load("_triton.bwd", package=args.baseline, alias="flash_attn_baseline")
    print(f"{torch.cuda.get_device_name()}: {args.kernel}, D={args.head_dim}, ours "
          f"{tc.PACKAGE} against {args.baseline}, median of {args.rounds} rounds", flush=True)
    for seqlen in args.seqlens:
        batch = max(1, tc.TOKENS // seqlen)
        for heads in args.heads:
            for mask in args.masks:
                causal = mask == "causal"
                flops = attention_flops(Workload("ab", batch, seqlen, seqlen, heads[0],
                                                 heads[1], args.head_dim, causal),
                                        args.kernel)
                torch.manual_seed(0)
                if args.kernel == "fwd":
                    problems = {name: tune_triton_fwd.Problem(mod, attn_params, batch, seqlen,
                                                              heads, args.head_dim, causal)
                                for name, mod in (("base", base_fwd), ("ours", ours_fwd))}
                    for field in ("q", "k", "v"):  # the same inputs for both
                        setattr(problems["ours"], field, getattr(problems["base"], field))
                else:  # each Problem draws its inputs: the same seed gives the same ones
                    problems = {}
                    for name, bwd, fwd in (("base", base_bwd, base_fwd),
                                           ("ours", ours_bwd, ours_fwd)):
                        torch.manual_seed(0)
                        problems[name] = tune_triton_bwd.Problem(bwd, fwd, attn_params, batch,
                                                                 seqlen, heads, args.head_dim,
                                                                 causal)
                rates: dict[str, list[float]] = {"base": [], "ours": []}
                for _ in range(args.rounds):
                    for name, problem in problems.items():
                        ms = do_bench(lambda: problem.run(None), warmup=25, rep=100,
                                      return_mode="median")
                        rates[name].append(flops / ms * 1e-9)
                base, ours = (statistics.median(rates[n]) for n in ("base", "ours"))
                line = (f"S={seqlen} H={heads[0]}/{heads[1]} {mask}: base {base:.0f} ours "
                        f"{ours:.0f} TFLOP/s, ratio {ours / base:.3f}")
                if args.kernel == "fwd":
                    same = torch.equal(problems["ours"].out, problems["base"].out)
                    line += f", outputs bitwise equal: {same}"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
