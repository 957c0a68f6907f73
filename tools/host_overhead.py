"""GPU ONLY: host time of one eager attention call, ours against SDPA, and where ours goes.

A call's host time bounds short calls: when the GPU finishes a kernel before the host has issued
the next one, the host is the bottleneck. Tiny shapes (B=1, S=128) make the device time
negligible, so ``calls / wall time`` is the host's rate. Per provider it prints:

* eager: wall time per call over many back-to-back calls (host-bound at this size);
* graph: per-call time of the same call replayed from a CUDA graph (device time plus replay);
* for ours, a cProfile of the forward path sorted by own time, so the Python layer's share is
  named function by function;
* with ``--kernels``, the GPU time of each kernel a provider launches per call (torch.profiler),
  to set against the graph time: what is left between them is launch gaps.

    python3 -m tools.host_overhead --kernel-dir build [--out host.json]
    python3 -m tools.host_overhead --kernel-dir build --kvcache [--seqlen-k 4096] [--kernels]

``--kvcache`` times a decode step instead: ``flash_attn_with_kvcache`` appending one token to a
contiguous and a page-16 cache (value checks off, on for every call, on for the same index
tensors as the last call: the later layers of a step), against SDPA reading the same
contiguous cache, alone and after writing the new token into it (``index_copy_``, a static
cache's update: the same work as our call, which appends), and profiles ours. Each of ours
says how many of its eager calls (warm-up included) took the full path instead of the lane.

Environment variables (ours) and the SDPA backend are set once around each provider's timing,
not inside the timed call.

Its clock is the host's own (``time.perf_counter`` around many back-to-back calls), not the
benchmark's timer: ``do_bench`` flushes the L2 before each call, which gives the GPU work that
hides exactly the host time measured here.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import json
import pstats
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn_hub import REPO_ROOT
from flash_attn_hub.bench import load_local_kernel
from flash_attn_hub.bench.providers import environ

from .kernel_times import kernel_profile


WARMUP = 20  # untimed calls before each eager timing


def per_call_us(fn, calls: int) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def graph_us(fn, calls: int) -> float | None:
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as err:  # a provider that cannot be captured reports no graph time
        print(f"  (no graph: {type(err).__name__}: {str(err)[:120]})")
        return None
    return per_call_us(graph.replay, calls)


def profile_text(fn, calls: int, lines: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(lines)
    return buf.getvalue()


class Timed:
    """A call to time, with what it runs under: environment variables and, for SDPA, one
    backend, set once around the timing loop so that neither is part of the call's time.
    ``counted`` (a module and a function name in it) names a function whose calls during the
    eager timing are counted and reported: for ours, the kv-cache full path's
    ``_checked_call``, so a row says whether its calls went through the lane."""

    def __init__(self, fn, *, env: dict | None = None, sdpa=None, counted=None):
        self.fn, self.env, self.sdpa, self.counted = fn, env or {}, sdpa, counted

    def __call__(self):
        return self.fn()

    @contextlib.contextmanager
    def setting(self):
        backend = sdpa_kernel(self.sdpa) if self.sdpa is not None else contextlib.nullcontext()
        with environ(**self.env), backend:
            yield

    @contextlib.contextmanager
    def counting(self):
        """Yields a one-item list that counts the calls of ``counted`` inside the block (None
        when nothing is counted)."""
        if self.counted is None:
            yield None
            return
        module, name = self.counted
        real, count = getattr(module, name), [0]

        def wrapper(*args, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)

        setattr(module, name, wrapper)
        try:
            yield count
        finally:
            setattr(module, name, real)


def report(providers: dict, shape: str, args, *, no_graph: str, profiled) -> None:
    """Prints (and with ``--out`` writes) each :class:`Timed`'s eager and graph time per
    call (no graph for names containing ``no_graph``), with ``--kernels`` the GPU time of its
    kernels, then a cProfile of each ``profiled`` one."""
    print(f"host time per call, {shape}, {args.calls} calls ({torch.cuda.get_device_name()})")
    results = {"shape": shape, "gpu": torch.cuda.get_device_name(), "rows": []}
    for name, fn in providers.items():
        with fn.setting():
            with fn.counting() as full:
                eager = per_call_us(fn, args.calls)
            graph = graph_us(fn, args.calls) if no_graph not in name else None
            graph_text = f"{graph:8.1f}" if graph is not None else "       -"
            path = "" if full is None else f"   full path {full[0]}/{args.calls + WARMUP}"
            print(f"  {name:38s} eager {eager:8.1f} us   graph {graph_text} us{path}")
            row = {"provider": name, "eager_us": eager, "graph_us": graph,
                   "full_path_calls": None if full is None else full[0]}
            if args.kernels and no_graph not in name:
                row["kernels"] = kernel_profile(fn, 200)
                for kernel, us, launches in row["kernels"]:
                    print(f"      {us:8.2f} us  x{launches}  {kernel[:90]}")
        results["rows"].append(row)
    for name in profiled:
        with providers[name].setting():
            text = profile_text(providers[name], 500, args.profile_lines)
        print(f"\ncProfile of 500 calls, {name}:\n{text}")
        results[f"profile {name}"] = text
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel-dir", type=Path, default=REPO_ROOT / "build")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--seqlen-k", type=int, default=None)
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--profile-lines", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernels", action="store_true",
                        help="also the GPU time of each kernel per call (torch.profiler)")
    parser.add_argument("--kvcache", action="store_true",
                        help="a decode step of flash_attn_with_kvcache (B=1, Sq=1)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tools.host_overhead needs a CUDA GPU")
        return 2
    fa = load_local_kernel(args.kernel_dir)
    if args.kvcache:
        return kvcache_main(fa, args)

    hq, hkv = (int(x) for x in args.heads.split("/"))
    sq, sk, d = args.seqlen, args.seqlen_k or args.seqlen, args.head_dim
    q = torch.randn(1, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    qtg, ktg, vtg = (t.detach().clone().transpose(1, 2).requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def ours(backend):
        return Timed(lambda: fa.flash_attn_func(q, k, v, causal=True),
                     env={"FLASH_ATTN_HUB_BACKEND": backend})

    def ours_train(backend):
        def call():
            out = fa.flash_attn_func(qg, kg, vg, causal=True)
            return torch.autograd.grad(out, (qg, kg, vg), dout)
        return Timed(call, env={"FLASH_ATTN_HUB_BACKEND": backend})

    def sdpa(backend, train=False):
        def call():
            if not train:
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=sq == sk,
                                                      enable_gqa=hq != hkv)
            out = F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=sq == sk,
                                                 enable_gqa=hq != hkv)
            return torch.autograd.grad(out, (qtg, ktg, vtg), dout.transpose(1, 2))
        return Timed(call, sdpa=backend)

    providers = {
        "ours-auto fwd": ours("auto"), "ours-cuda fwd": ours("cuda"),
        "ours-triton fwd": ours("triton"),
        "sdpa-cudnn fwd": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash fwd": sdpa(SDPBackend.FLASH_ATTENTION),
        "ours-auto fwd+bwd": ours_train("auto"), "ours-cuda fwd+bwd": ours_train("cuda"),
        "sdpa-cudnn fwd+bwd": sdpa(SDPBackend.CUDNN_ATTENTION, train=True),
    }
    shape = f"B=1 Sq={sq} Sk={sk} H={hq}/{hkv} D={d} bf16 causal"
    report(providers, shape, args, no_graph="bwd",
           profiled=("ours-cuda fwd", "ours-triton fwd", "ours-cuda fwd+bwd"))
    return 0


def kvcache_main(fa, args) -> int:
    hq, hkv = (int(x) for x in args.heads.split("/"))
    sk, d, page = args.seqlen_k or 4096, args.head_dim, 16
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 1, hq, d, device=dev, dtype=dt)
    k_new, v_new = (torch.randn(1, 1, hkv, d, device=dev, dtype=dt) for _ in range(2))
    k_cache, v_cache = (torch.randn(1, sk + 1, hkv, d, device=dev, dtype=dt) for _ in range(2))
    blocks = -(-(sk + 1) // page)
    k_pages, v_pages = (torch.randn(blocks, page, hkv, d, device=dev, dtype=dt) for _ in range(2))
    table = torch.randperm(blocks, device=dev, dtype=torch.int32).view(1, blocks)
    seqlens = torch.full((1,), sk, dtype=torch.int32, device=dev)
    qt = q.transpose(1, 2)
    kt, vt = (c[:, :sk].transpose(1, 2) for c in (k_cache, v_cache))

    position = seqlens.to(torch.int64)  # where an SDPA decode step writes its new token
    kvcache_module = importlib.import_module(fa.__name__ + ".kvcache")

    # Value checks run once per version of the index tensors (_kvcache_values.py, [Note: value
    # checks]): "checks, each call" alternates two equal cache_seqlens tensors, so every call is
    # checked (the first layer of a decode step); "checks, same tensors" passes one, so only the
    # first call is (the later layers of a step).
    lengths = (seqlens, seqlens.clone())

    def ours(paged: bool, checks: str = ""):
        turn = [0]

        def call():
            turn[0] ^= checks == "each"
            if paged:
                return fa.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new,
                                                  cache_seqlens=lengths[turn[0]],
                                                  block_table=table)
            return fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                              cache_seqlens=lengths[turn[0]])
        return Timed(call, env={"FLASH_ATTN_HUB_CHECK_VALUES": "1" if checks else "0"},
                     counted=(kvcache_module, "_checked_call"))

    def sdpa(backend, append: bool = False):
        def call():
            if append:  # the new token into the cache, as a static cache does, then attend
                k_cache.index_copy_(1, position, k_new)
                v_cache.index_copy_(1, position, v_new)
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hq != hkv)
        return Timed(call, sdpa=backend)

    providers = {
        "ours contiguous": ours(False), "ours page-16": ours(True),
        "ours contiguous, checks, each call": ours(False, "each"),
        "ours page-16, checks, each call": ours(True, "each"),
        "ours contiguous, checks, same tensors": ours(False, "same"),
        "ours page-16, checks, same tensors": ours(True, "same"),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-cudnn + cache write": sdpa(SDPBackend.CUDNN_ATTENTION, append=True),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }
    shape = f"decode B=1 Sq=1 Sk={sk} H={hq}/{hkv} D={d} bf16, one new token"
    report(providers, shape, args, no_graph="checks", profiled=("ours contiguous", "ours page-16"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
