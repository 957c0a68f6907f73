"""A/B: the Triton forward with head dims split into two tiles against padded tiles, and SDPA
cuDNN, in one process (bf16, B=4, S=4k, 16 heads; alternating rounds, median)."""
import statistics, sys
sys.path.insert(0, "benchmarks")
import torch, triton.testing
import _tune_common as tc
from torch.nn.attention import SDPBackend, sdpa_kernel

fwd, params_mod = tc.load("_triton_fwd", "_params")
print("D mask | split padded cudnn TFLOP/s | split/padded split/cudnn padded/cudnn | max|diff|")
for d in (80, 96, 160, 192):
    for causal in (False, True):
        b, s, h = 4, 4096, 16
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        params = tc.attn_params(params_mod.AttnParams, d, causal, s)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def ours(split):
            def run():
                fwd.SPLIT_HEAD_DIM = split
                fwd.forward(q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, s_aux=None,
                            alibi_slopes=None, params=params)
            return run

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        ours(False)(); padded_out = out.clone()
        ours(True)(); diff = (out - padded_out).abs().max().item()
        ref = cudnn().transpose(1, 2)
        diff_ref = (out - ref).abs().max().item()
        fns = {"split": ours(True), "padded": ours(False), "cudnn": cudnn}
        times = {n: [] for n in fns}
        for _ in range(3):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=25, rep=150))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        t = {n: statistics.median(v) for n, v in times.items()}
        tf = {n: flops / t[n] / 1e9 for n in t}
        print(f"{d} {'causal' if causal else 'full'} | {tf['split']:.0f} {tf['padded']:.0f} "
              f"{tf['cudnn']:.0f} | {t['padded'] / t['split']:.3f} {t['cudnn'] / t['split']:.3f} "
              f"{t['cudnn'] / t['padded']:.3f} | {diff:.2e} (vs cudnn {diff_ref:.2e})", flush=True)
