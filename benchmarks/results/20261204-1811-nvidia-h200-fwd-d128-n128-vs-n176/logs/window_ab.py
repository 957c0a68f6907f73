"""A/B: the sm90 forward's full-mask kernel (D=128: 128 x 176 tiles) against its band kernel
(128 x 128) run with a window that covers every key, and SDPA cuDNN, in one process."""
import sys, statistics
sys.path.insert(0, "scripts")
import torch, triton.testing
from profile_kernels import load_workload, workload_parser
from torch.nn.attention import SDPBackend, sdpa_kernel

p = workload_parser(__doc__)
args = p.parse_args(["--kernel-dir", "build"])
fa, *_ = load_workload(args)
print("S B heads | full(176) band(128) cudnn TFLOP/s | band/full cudnn/full | max|diff|")
for s, b in ((1024, 16), (2048, 8), (4096, 4), (8192, 2), (16384, 1)):
    for hq, hkv in ((16, 16), (32, 8)):
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        def full(): return fa.flash_attn_func(q, k, v)
        def band(): return fa.flash_attn_func(q, k, v, window_size=(s, s))
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hq != hkv)
        diff = (full() - band()).abs().max().item()
        times = {n: [] for n in ("full", "band", "cudnn")}
        for _ in range(3):
            for n, f in (("full", full), ("band", band), ("cudnn", cudnn)):
                times[n].append(triton.testing.do_bench(f, warmup=25, rep=150))
        flops = 4 * b * hq * s * s * 128
        t = {n: statistics.median(v) for n, v in times.items()}
        tf = {n: flops / t[n] / 1e9 for n in t}
        print(f"{s} {b} {hq}/{hkv} | {tf['full']:.0f} {tf['band']:.0f} {tf['cudnn']:.0f} | "
              f"{t['full'] / t['band']:.3f} {t['full'] / t['cudnn']:.3f} | {diff:.2e}", flush=True)
