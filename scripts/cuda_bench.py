"""Forward TFLOP/s of the sm90 CUDA kernel against its peers, all in one process.

Standard grid slice (ANCHORS.md): bf16, D=128, H=16, B*S = 16k tokens, S in {4k, 16k}, causal
and not. Providers: ours (`_cuda.forward`), our Triton forward, SDPA cuDNN, SDPA flash.
FLOPs = 4 * B * H * S * S * D, halved for causal; medians of `triton.testing.do_bench`.

    python scripts/cuda_bench.py [--kernel-dir build | --import-path DIR] [--seqlens 4096 16384]

Results go to $OUT/cuda_bench.json (and a table on stdout) when OUT is set.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]


def load_package(kernel_dir: Path, import_path: Path | None):
    if import_path is not None:  # a folder holding an assembled flash_attn package
        import sys
        sys.path.insert(0, str(import_path.resolve()))
        return importlib.import_module("flash_attn")
    import kernels
    return kernels.get_local_kernel(kernel_dir.resolve().parent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel-dir", type=Path, default=ROOT / "build",
                        help="folder holding build/<variant>/")
    parser.add_argument("--import-path", type=Path, default=None,
                        help="import flash_attn from this folder instead of the built variant")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()

    pkg = load_package(args.kernel_dir, args.import_path)
    cuda_be = importlib.import_module(pkg.__name__ + "._cuda")
    try:
        triton_be = importlib.import_module(pkg.__name__ + "._triton.fwd")
    except ModuleNotFoundError:
        triton_be = None
        print("no _triton.fwd in this build: skipping that provider")
    AttnParams = importlib.import_module(pkg.__name__ + "._params").AttnParams

    h, d = args.heads, args.head_dim
    rows = []
    for s in args.seqlens:
        b = max(1, args.tokens // s)
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            out = torch.empty_like(q)
            lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
            params = AttnParams(softmax_scale=d ** -0.5, causal=causal, window_left=-1,
                                window_right=0 if causal else -1, softcap=0.0, dropout_p=0.0,
                                seed=0, deterministic=False, max_seqlen_q=s, max_seqlen_k=s)
            kw = dict(cu_seqlens_q=None, cu_seqlens_k=None, s_aux=None, alibi_slopes=None,
                      params=params)
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            providers = {"ours_cuda": lambda: cuda_be.forward(q, k, v, out, lse, **kw)}
            if triton_be is not None:
                providers["ours_triton"] = lambda: triton_be.forward(q, k, v, out, lse, **kw)
            for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                def run(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vt, is_causal=causal)
                providers[name] = run
            cuda_be.forward(q, k, v, out, lse, **kw)
            ref = providers["sdpa_flash"]().transpose(1, 2)
            max_err = (out.float() - ref.float()).abs().max().item()
            for name, fn in providers.items():
                try:
                    ms = triton.testing.do_bench(fn, warmup=50, rep=200)
                    tflops = flops / ms / 1e9
                except Exception as err:  # a peer missing on this machine is reported, not fatal
                    ms, tflops = math.nan, math.nan
                    print(f"{name}: {type(err).__name__}: {err}")
                rows.append(dict(provider=name, seqlen=s, batch=b, heads=h, head_dim=d,
                                 causal=causal, ms=ms, tflops=tflops,
                                 max_abs_err_vs_sdpa_flash=max_err))
                print(f"S={s:6d} B={b:2d} causal={int(causal)} {name:12s} {ms:8.3f} ms "
                      f"{tflops:7.1f} TFLOP/s (ours vs SDPA max |diff| {max_err:.2e})")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, cudnn=torch.backends.cudnn.version())
    try:
        meta["git"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip()
    except OSError:
        pass
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "cuda_bench.json"
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
