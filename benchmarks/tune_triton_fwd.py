"""GPU ONLY: measure candidate tile configs of the Triton forward kernel, write the tuning file.

    python benchmarks/tune_triton_fwd.py      # every head-dim bucket; writes the package's
                                              # torch-ext/flash_attn/triton_fwd_configs.json
    python benchmarks/tune_triton_fwd.py --head-dims 128 --quick --out /tmp/t.json

For each head-dim bucket it times every candidate ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``
with ``triton.testing.do_bench`` (median, fresh random bf16 inputs, 16k tokens per batch as in
ANCHORS.md) on a causal and a non-causal workload, scores a candidate by the geometric mean of its
TFLOP/s, and records the winner for this GPU's arch with the measurement as its reason. The
kernel module reads the file on first use; entries it holds replace the defaults of
``_triton_fwd.TILES`` for the (arch, BLOCK_D) they name, other entries in the file are kept.
Every candidate is checked against the float64 reference on a small problem before it is timed.
Long-format results go to ``$OUT/tune_triton_fwd.jsonl`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
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

# Head dim -> query heads of the standard grid (ANCHORS.md), kv heads equal.
HEADS = {64: 32, 128: 16, 256: 8}
CANDIDATES = {
    64: dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4)),
    128: dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3)),
    256: dict(block_m=(64, 128), block_n=(32, 64), num_warps=(4, 8), num_stages=(1, 2)),
}


def _package():
    package = types.ModuleType("flash_attn_tune")
    package.__path__ = [str(REPO / "torch-ext" / "flash_attn")]
    sys.modules["flash_attn_tune"] = package
    return (importlib.import_module("flash_attn_tune._triton_fwd"),
            importlib.import_module("flash_attn_tune._params").AttnParams)


def _params(attn_params, head_dim, causal, seqlen):
    return attn_params(softmax_scale=head_dim ** -0.5, causal=causal, window_left=-1,
                       window_right=0 if causal else -1, softcap=0.0, dropout_p=0.0, seed=0,
                       deterministic=False, max_seqlen_q=seqlen, max_seqlen_k=seqlen)


def _inputs(batch, seqlen, heads, head_dim):
    shape = (batch, seqlen, heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
    return q, k, v, out, lse


def _call(fwd, tensors, params, tiles):
    q, k, v, out, lse = tensors
    fwd.forward(q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, s_aux=None,
                alibi_slopes=None, params=params, tiles=tiles)


def _correct(fwd, attn_params, head_dim, tiles) -> bool:
    """The candidate against the float64 reference on a small causal problem (bf16 rule)."""
    torch.manual_seed(0)
    tensors = _inputs(2, 300, 2, head_dim)
    params = _params(attn_params, head_dim, True, 300)
    _call(fwd, tensors, params, tiles)
    q, k, v, out, lse = tensors
    ref, _ = attention_reference(q, k, v, causal=True)
    low, _ = attention_reference(q, k, v, causal=True, dtype=q.dtype)
    return relative_error(out, ref) <= 2 * relative_error(low, ref) + 1e-6


def _tflops(batch, seqlen, heads, head_dim, causal, ms):
    flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return flops / ms * 1e-9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=sorted(HEADS))
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="first two candidates only")
    parser.add_argument("--out", type=Path, default=None,
                        help="tuning file (default: the package's triton_fwd_configs.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tune_triton_fwd.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    fwd, attn_params = _package()
    target = args.out or fwd.CONFIG_FILE
    device = torch.device("cuda")
    arch = fwd.arch_of(device)
    gpu = torch.cuda.get_device_name(device)
    stamp = datetime.date.today().isoformat()
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    log_path = Path(os.environ["OUT"]) / "tune_triton_fwd.jsonl" if os.environ.get("OUT") else None
    existing = json.loads(target.read_text())["forward"] if target.exists() else []
    entries = {(e["arch"], e["block_d"]): e for e in existing}

    for head_dim in args.head_dims:
        heads = HEADS.get(head_dim, 16)
        batch = max(1, 16384 // args.seqlen)
        space = CANDIDATES.get(head_dim, CANDIDATES[128])
        candidates = list(itertools.product(*space.values()))
        if args.quick:
            candidates = candidates[:2]
        default = fwd.TILES[(arch, fwd.block_d_for(head_dim))][:4]
        if default not in candidates:
            candidates.append(default)
        torch.manual_seed(1)
        tensors = _inputs(batch, args.seqlen, heads, head_dim)
        results = []
        for tiles in candidates:
            try:
                if not _correct(fwd, attn_params, head_dim, tiles):
                    print(f"D={head_dim} {tiles}: WRONG RESULT, skipped", flush=True)
                    continue
                rates = []
                for causal in (False, True):
                    params = _params(attn_params, head_dim, causal, args.seqlen)
                    ms = do_bench(lambda: _call(fwd, tensors, params, tiles), warmup=25, rep=100)
                    rates.append(_tflops(batch, args.seqlen, heads, head_dim, causal, ms))
                    if log_path:
                        with log_path.open("a") as log:
                            log.write(json.dumps(dict(
                                provider="ours-triton", tiles=tiles, head_dim=head_dim,
                                heads=heads, batch=batch, seqlen=args.seqlen, causal=causal,
                                ms=ms, tflops=rates[-1], gpu=gpu, versions=versions)) + "\n")
            except Exception as err:  # out of shared memory / registers: not a candidate
                print(f"D={head_dim} {tiles}: failed ({type(err).__name__}: {err})"[:200],
                      flush=True)
                continue
            score = math.sqrt(rates[0] * rates[1])
            results.append((score, tiles, rates))
            print(f"D={head_dim} {tiles}: {rates[0]:.0f} / {rates[1]:.0f} TFLOP/s "
                  f"(non-causal / causal)", flush=True)
        if not results:
            print(f"D={head_dim}: no candidate ran", file=sys.stderr)
            continue
        results.sort(reverse=True)
        best_score, best, rates = results[0]
        base = next((r for r in results if r[1] == default), None)
        versus = (f"; table default {default} {base[0]:.0f}" if base and best != default else "")
        runner = f"; runner-up {results[1][1]} {results[1][0]:.0f}" if len(results) > 1 else ""
        reason = (f"measured {stamp} on {gpu} ({versions}): bf16 B={batch} S={args.seqlen} "
                  f"H={heads}, {rates[0]:.0f}/{rates[1]:.0f} TFLOP/s non-causal/causal, "
                  f"geo-mean {best_score:.0f}{runner}{versus}")
        block_m, block_n, num_warps, num_stages = best
        entries[(arch, fwd.block_d_for(head_dim))] = dict(
            arch=arch, block_d=fwd.block_d_for(head_dim), block_m=block_m, block_n=block_n,
            num_warps=num_warps, num_stages=num_stages, reason=reason)
        print(f"D={head_dim}: best {best} -- {reason}", flush=True)

    ordered = sorted(entries.values(), key=lambda e: (e["arch"], e["block_d"]))
    target.write_text(json.dumps({"forward": ordered}, indent=1) + "\n")
    print(f"wrote {target}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], target.name).write_text(target.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
