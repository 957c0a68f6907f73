"""GPU ONLY: one workload for Nsight Compute to read the counters of.

One bf16 forward and one backward per backend named, on one shape (D=128, S=4k, B=4, MHA 16/16
unless told), each run twice so that `ncu --launch-skip` can pass over the first (cold) launch.
It times nothing: ncu reads the counters. ``--peer fa4`` runs FlashAttention-4 (``flash_attn.cute``)
instead of ours, so that the same ncu sections can be set against its kernels.

    ncu --clock-control none -k regex:"fwd_kernel|bwd_kernel" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats \
        python3 -m tools.profile_kernels --kernel-dir build [--causal] [--heads 32/8]

With `--section SourceCounters -o REPORT` ncu also keeps each kernel's stall samples per SASS
instruction; `ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv` exports
them for `python3 -m tools.sass_stalls sass.csv`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from flash_attn_hub import REPO_ROOT
from flash_attn_hub.bench import load_local_kernel


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of one bf16 attention workload (shared with kernel_times.py)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--kernel-dir", type=Path, default=REPO_ROOT / "build",
                        help="the build directory (holding <variant>/)")
    parser.add_argument("--backend", default="cuda", choices=("cuda", "triton"))
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", default="16/16", help="HQ/HKV")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    return parser


def load_workload(args):
    """``(flash_attn, q, k, v, dout)``: our build from ``--kernel-dir`` on ``--backend``, and
    seeded bf16 inputs of the workload (q, k, v requiring grad). Exits with status 2, saying so,
    on a machine without a CUDA GPU."""
    if not torch.cuda.is_available():
        print(f"{Path(sys.argv[0]).name} needs a CUDA GPU")
        raise SystemExit(2)
    os.environ["FLASH_ATTN_HUB_BACKEND"] = args.backend
    flash_attn = load_local_kernel(args.kernel_dir)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    b, s, d = args.batch, args.seqlen, args.head_dim
    torch.manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    return flash_attn, q, k, v, dout


def main() -> int:
    parser = workload_parser(__doc__)
    parser.add_argument("--peer", choices=("fa4",), help="run this peer instead of ours")
    args = parser.parse_args()
    flash_attn, q, k, v, dout = load_workload(args)
    call = flash_attn.flash_attn_func
    if args.peer == "fa4":
        import importlib
        fa4 = importlib.import_module("flash_attn.cute")

        def call(q, k, v, causal):
            out = fa4.flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, (tuple, list)) else out
    b, s, d = args.batch, args.seqlen, args.head_dim
    hq, hkv = q.shape[2], k.shape[2]
    for _ in range(2):
        out = call(q, k, v, causal=args.causal)
        torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    print(f"ran {args.peer or args.backend} forward+backward twice: B={b} S={s} H={hq}/{hkv} D={d} "
          f"causal={args.causal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
