"""Decode timing of ``flash_attn_with_kvcache`` against SDPA and the GPU's copy bandwidth.

    python benchmarks/kvcache_decode.py [--root DIR] [--quick] [--json PATH]

Loads the build under ``<root>/build`` (default: the checkout) through
``kernels.get_local_kernel`` and times, in one process, bf16 decode cells: GQA 32/8 and 64/8 at
D=128, paged (page 16 and 64, blocks in shuffled order as a long-running server leaves them)
and contiguous caches, B in {1, 8, 32, 128}, KV in {4k, 32k, 128k} (cells whose K+V exceed a
third of the GPU's memory are skipped), then multi-token decode (Sq 4/8/16, causal). Each call
is timed inside a CUDA graph (20 calls per replay, median of 5 replays), so host time is out of
the device numbers; the SDPA peers (cuDNN and flash, ``enable_gqa``) read the contiguous
cache in place. GB/s counts the K and V bytes a call must read; ``%copy`` compares it with a
device-to-device copy's (read + write) bytes per second. Host time per eager call (value
checks off, as in a serving loop) is measured last, against SDPA's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

ROOT = Path(__file__).resolve().parents[1]
DTYPE = torch.bfloat16
CALLS_PER_GRAPH = 20


def graph_time_us(fn) -> float:
    """Median device time of one ``fn()`` call, from CUDA-graph replays of CALLS_PER_GRAPH."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times)


def copy_gbps() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.empty(2 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 2 / statistics.median(times) / 1e9


def make_cell(batch, seqlen_k, heads, layout, seqlen_q):
    """q, the caches, the block table (paged) and cache_seqlens for ``seqlen_k`` cached keys."""
    heads_q, heads_kv = heads
    q = torch.randn(batch, seqlen_q, heads_q, 128, dtype=DTYPE, device="cuda")
    if layout == "contiguous":
        shape, table = (batch, seqlen_k, heads_kv, 128), None
    else:
        size = int(layout.removeprefix("page"))
        pages = math.ceil(seqlen_k / size)
        order = torch.randperm(batch * pages, device="cuda").to(torch.int32)
        table = order.view(batch, pages)
        shape = (batch * pages, size, heads_kv, 128)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, seqlens


def sdpa(q, k_cache, v_cache, backend):
    """SDPA on the contiguous cache, read in place: flash-attn's layout transposed, GQA through
    ``enable_gqa``, causal bottom-right for Sq > 1."""
    sq, sk = q.shape[1], k_cache.shape[1]
    mask = causal_lower_right(sq, sk) if sq > 1 else None
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=mask,
            enable_gqa=True)
    return out.transpose(1, 2)


def run_cell(fa, batch, seqlen_k, heads, layout, seqlen_q, copy) -> dict:
    q, k_cache, v_cache, table, seqlens = make_cell(batch, seqlen_k, heads, layout, seqlen_q)
    kv_bytes = 2 * batch * seqlen_k * heads[1] * 128 * 2

    def ours():
        return fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                          block_table=table, causal=True)

    record = dict(layout=layout, heads=f"{heads[0]}/{heads[1]}", batch=batch, seqlen_k=seqlen_k,
                  seqlen_q=seqlen_q, kv_bytes=kv_bytes)
    out = ours()
    record["ours_us"] = graph_time_us(ours)
    record["ours_gbps"] = kv_bytes / record["ours_us"] / 1e3
    record["ours_pct_copy"] = 100 * record["ours_gbps"] / copy
    if layout == "contiguous":
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                expected = sdpa(q, k_cache, v_cache, backend)
                record[f"{name}_us"] = graph_time_us(lambda: sdpa(q, k_cache, v_cache, backend))
            except RuntimeError as err:  # the backend refuses the shape
                record[f"{name}_error"] = str(err).splitlines()[0][:120]
                continue
            error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
            record[f"{name}_rel_diff"] = error
            record[f"ours_vs_{name}"] = record[f"{name}_us"] / record["ours_us"]
    return record


def host_us(fn, calls=300) -> float:
    """Host time per eager call: calls issued back to back, the GPU drained afterwards."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _cell(record: dict, key: str, digits: int = 1) -> str:
    return f"{record[key]:.{digits}f}" if key in record else "-"


def cells(quick: bool):
    heads_list = [(32, 8)] if quick else [(32, 8), (64, 8)]
    layouts = ["page16", "contiguous"] if quick else ["page16", "page64", "contiguous"]
    batches = [1, 32] if quick else [1, 8, 32, 128]
    lengths = [4096, 32768] if quick else [4096, 32768, 131072]
    for heads in heads_list:
        for layout in layouts:
            for batch in batches:
                for seqlen_k in lengths:
                    yield batch, seqlen_k, heads, layout, 1
    for seqlen_q in ([4, 16] if quick else [4, 8, 16]):
        for layout in ("page16", "contiguous"):
            for batch in (1, 8):
                for seqlen_k in (4096, 32768):
                    yield batch, seqlen_k, (32, 8), layout, seqlen_q


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="a repository holding build/")
    parser.add_argument("--quick", action="store_true", help="a few cells only")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args()
    import kernels

    os.environ["FLASH_ATTN_HUB_CHECK_VALUES"] = "0"  # eager host time as a serving loop sees it
    fa = kernels.get_local_kernel(args.root)
    torch.manual_seed(0)
    copy = copy_gbps()
    budget = torch.cuda.get_device_properties(0).total_memory / 3
    print(f"# {torch.cuda.get_device_name()}: device copy {copy:.0f} GB/s (read + write)")
    print("| layout | heads | B | KV | Sq | ours us | GB/s | %copy | cuDNN us | x cuDNN "
          "| flash us | x flash |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    records = []
    with torch.no_grad():
        for cell in cells(args.quick):
            batch, seqlen_k, heads, _, _ = cell
            if 2 * batch * seqlen_k * heads[1] * 128 * 2 > budget:
                continue
            r = run_cell(fa, *cell, copy)
            records.append(r)
            print(f"| {r['layout']} | {r['heads']} | {batch} | {seqlen_k // 1024}k | "
                  f"{r['seqlen_q']} | {r['ours_us']:.1f} | {r['ours_gbps']:.0f} | "
                  f"{r['ours_pct_copy']:.0f} | {_cell(r, 'cudnn_us')} | "
                  f"{_cell(r, 'ours_vs_cudnn', 2)} | {_cell(r, 'flash_us')} | "
                  f"{_cell(r, 'ours_vs_flash', 2)} |", flush=True)
            torch.cuda.empty_cache()
        q, k_cache, v_cache, table, seqlens = make_cell(1, 4096, (32, 8), "page16", 1)
        k_dense, v_dense = make_cell(1, 4096, (32, 8), "contiguous", 1)[1:3]
        host = {"ours_page16": host_us(lambda: fa.flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True)),
                "ours_contiguous": host_us(lambda: fa.flash_attn_with_kvcache(
                    q, k_dense, v_dense, cache_seqlens=seqlens, causal=True))}
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            try:
                host[name] = host_us(lambda: sdpa(q, k_dense, v_dense, backend))
            except RuntimeError:
                pass
    print("host us per eager call (B=1, KV=4k, 32/8): "
          + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_gbps": copy,
                                         "cells": records, "host_us": host}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
