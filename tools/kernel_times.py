"""GPU ONLY: GPU time per kernel of one attention forward and backward, ours against SDPA cuDNN.

The benchmark times a whole call; this says where that time goes. Each provider runs a bf16
forward and backward `--iters` times under torch.profiler (after a warm-up), and the table lists
every kernel launched with its mean GPU time per call, so that the main kernels can be set
against the work around them (workspace fills, preprocess, dQ cast, copies). Each call is also
timed whole with the benchmark's timer; FLOPs by the benchmark's rule.

    python3 -m tools.kernel_times --kernel-dir build [--seqlen 4096 --batch 4 --heads 16/16]

``--fa4`` adds FlashAttention-4 (``flash_attn.cute``, when importable) as a third provider.
``--group-splits 1,2,4,8`` times our backward once per value with the CUDA backward's group
split forced to it instead of the heuristic's (``_heuristics.cuda_group_splits``; each must
divide Hq/Hkv), ``--rounds 2`` repeats the providers in turn: an A/B of the split inside one
process, with cuDNN as the anchor.
"""

from __future__ import annotations

import importlib
from collections import defaultdict

import torch

from flash_attn_hub.bench.timing import median_ms
from flash_attn_hub.bench.workloads import Workload, attention_flops

from .profile_kernels import load_workload, workload_parser


def kernel_profile(fn, iters: int) -> list[tuple[str, float, int]]:
    """(kernel name, mean microseconds per call, launches per call) of what ``fn`` launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total[evt.name] += evt.device_time
            count[evt.name] += 1
    rows = [(name, total[name] / iters, count[name] // iters) for name in total]
    return sorted(rows, key=lambda r: -r[1])


def main() -> int:
    parser = workload_parser(__doc__)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--group-splits", default="",
                        help="comma-separated group splits to force on our CUDA backward")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--fa4", action="store_true",
                        help="time FlashAttention-4 too (flash_attn.cute must import)")
    args = parser.parse_args()
    flash_attn, q, k, v, dout = load_workload(args)
    heuristics = importlib.import_module(flash_attn.__name__ + "._heuristics")
    chosen_splits = heuristics.cuda_group_splits
    splits = [int(x) for x in args.group_splits.split(",") if x]
    group = q.shape[2] // k.shape[2]
    if any(n < 1 or group % n for n in splits):
        parser.error(f"--group-splits: each must divide Hq/Hkv = {group}")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, s, d = args.batch, args.seqlen, args.head_dim
    hq, hkv = q.shape[2], k.shape[2]
    workload = Workload("kernel_times", b, s, s, hq, hkv, d, args.causal)

    def ours_fwd():
        return flash_attn.flash_attn_func(q, k, v, causal=args.causal)

    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    doutt = dout.transpose(1, 2)

    def cudnn_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=args.causal, enable_gqa=hq != hkv)

    print(f"B={b} S={s} H={hq}/{hkv} D={d} causal={args.causal} bf16, {args.iters} calls each; "
          f"GPU {torch.cuda.get_device_name()}")
    ours = [("ours-" + args.backend, ours_fwd, dout, None)]
    if splits:
        ours = [(f"ours-{args.backend}-split{n}", ours_fwd, dout, n) for n in splits]
    peers = [("sdpa-cudnn", cudnn_fwd, doutt, None)]
    if args.fa4:
        fa4 = importlib.import_module("flash_attn.cute")

        def fa4_fwd():
            out = fa4.flash_attn_func(q, k, v, causal=args.causal)
            return out[0] if isinstance(out, (tuple, list)) else out
        peers.append(("fa4", fa4_fwd, dout, None))
    providers = [*ours, *peers] * args.rounds
    for name, fwd, grad_out, split in providers:
        heuristics.cuda_group_splits = (chosen_splits if split is None
                                        else lambda *_, n=split: n)
        for mode in ("fwd", "bwd"):
            if mode == "fwd":
                def fn(fwd=fwd):
                    with torch.no_grad():
                        fwd()
            else:
                out = fwd()

                def fn(out=out, grad_out=grad_out):
                    for t in (q, k, v, qt, kt, vt):  # no gradient accumulation kernels
                        t.grad = None
                    out.backward(grad_out, retain_graph=True)
            rows = kernel_profile(fn, args.iters)
            total = sum(r[1] for r in rows)
            wall = median_ms(fn, device="cuda", grad_to_none=[q, k, v, qt, kt, vt]) * 1e3
            mode_flops = attention_flops(workload, mode)
            print(f"\n{name} {mode}: {total:.1f} us of kernels per call "
                  f"({mode_flops / total / 1e6:.0f} TFLOP/s), {wall:.1f} us per call timed "
                  f"back to back ({mode_flops / wall / 1e6:.0f} TFLOP/s)")
            for kname, us, n in rows:
                print(f"  {us:9.1f} us  {n:3d}x  {us / total:6.1%}  {kname[:110]}")
            for t in (q, k, v, qt, kt, vt):
                t.grad = None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
