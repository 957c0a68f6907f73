"""GPU ONLY: the kv-cache attention kernel's device time per launch shape, to find what bounds a
decode cell (key block, warps, pipeline stages, key splits) before changing the kernel or its
rule (``_triton/kvcache.tiles_for``, ``_heuristics.kvcache_splits``).

Each cell is a ``flash_attn_with_kvcache`` decode over a full cache (bf16, D=128, no new keys),
run through the Triton backend's ``forward`` with each candidate ``KvTiles`` and split count,
timed inside a CUDA graph like the benchmark's kv-cache grid (``graph_quantiles``). Per cell it
prints the rule's choice first, then the candidates sorted by time, with GB/s of K+V read.

    python3 -m tools.kvcache_tiles --kernel-dir build [--cells b1-32k,p16-b8-sq16] [--top 8]
    python3 -m tools.kvcache_tiles --kernel-dir build --cells b1-32k --only-rule   # for ncu
    python3 -m tools.kvcache_tiles --kernel-dir build --cells p16-b1-32k,p16-b1-32k-inorder \
        --time-rule   # the rule's choice alone, pages shuffled against pages in order

A paged cell's block table is a random permutation of the pool's pages unless its name ends in
``-inorder`` (page i of a sequence at pool block i): the two bound what the gather's address
pattern (a fresh page every 16 keys, anywhere in the pool) costs.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
from pathlib import Path

import torch

from flash_attn_hub import REPO_ROOT
from flash_attn_hub.bench import load_local_kernel
from flash_attn_hub.bench.timing import Timing, graph_quantiles

# name: (batch, keys, heads q/kv, page size or 0 for contiguous, Sq)
CELLS = {
    "b1-4k": (1, 4096, (32, 8), 0, 1),
    "b1-32k": (1, 32768, (32, 8), 0, 1),
    "b1-128k": (1, 131072, (32, 8), 0, 1),
    "p16-b1-32k": (1, 32768, (32, 8), 16, 1),
    "p16-b1-32k-inorder": (1, 32768, (32, 8), 16, 1),
    "p64-b1-32k": (1, 32768, (32, 8), 64, 1),
    "b32-4k": (32, 4096, (32, 8), 0, 1),
    "b128-4k": (128, 4096, (32, 8), 0, 1),
    "b128-32k": (128, 32768, (32, 8), 0, 1),
    "b8-32k-sq16": (8, 32768, (32, 8), 0, 16),
    "p16-b8-32k-sq16": (8, 32768, (32, 8), 16, 16),
    "p16-b1-32k-sq16": (1, 32768, (32, 8), 16, 16),
    "p16-b1-4k": (1, 4096, (32, 8), 16, 1),
    "p16-b1-4k-sq16": (1, 4096, (32, 8), 16, 16),
    "b8-32k-sq8": (8, 32768, (32, 8), 0, 8),
    "p16-b8-32k-sq8": (8, 32768, (32, 8), 16, 8),
}


def _cell_inputs(batch, keys, heads, page, seqlen_q, inorder=False, device="cuda",
                 dtype=torch.bfloat16):
    hq, hkv = heads
    q = torch.randn(batch, seqlen_q, hq, 128, device=device, dtype=dtype)
    if page:
        blocks = batch * keys // page
        k_cache, v_cache = (torch.randn(blocks, page, hkv, 128, device=device, dtype=dtype)
                            for _ in range(2))
        table = (torch.arange(blocks, device=device, dtype=torch.int32) if inorder else
                 torch.randperm(blocks, device=device, dtype=torch.int32)).view(batch, -1)
    else:
        k_cache, v_cache = (torch.randn(batch, keys, hkv, 128, device=device, dtype=dtype)
                            for _ in range(2))
        table = None
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, table, seqlens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel-dir", type=Path, default=REPO_ROOT / "build")
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--only-rule", action="store_true",
                        help="run the rule's choice a few times and time nothing (for ncu)")
    parser.add_argument("--time-rule", action="store_true",
                        help="time the rule's choice alone, no candidates")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tools.kvcache_tiles needs a CUDA GPU")
        return 2
    fa = load_local_kernel(args.kernel_dir)
    kv = importlib.import_module(fa.__name__ + "._triton.kvcache")
    params_mod = importlib.import_module(fa.__name__ + "._params")
    heur = importlib.import_module(fa.__name__ + "._heuristics")
    timing = Timing()
    for name in args.cells.split(","):
        batch, keys, heads, page, seqlen_q = CELLS[name]
        q, k_cache, v_cache, table, seqlens = _cell_inputs(batch, keys, heads, page, seqlen_q,
                                                           name.endswith("-inorder"))
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads[0], seqlen_q, device="cuda", dtype=torch.float32)
        group = heads[0] // heads[1]

        def run(tiles, splits):
            params = params_mod.KvCacheParams(
                softmax_scale=128 ** -0.5, causal=seqlen_q > 1, window_left=-1,
                window_right=0 if seqlen_q > 1 else -1, softcap=0.0, rotary_interleaved=True,
                num_splits=splits, max_seqlen_q=seqlen_q, max_seqlen_k=keys)
            kv.forward(q, k_cache, v_cache, out, lse, k=None, v=None, rotary_cos=None,
                       rotary_sin=None, cache_seqlens=seqlens, cache_batch_idx=None,
                       cache_leftpad=None, block_table=table, cu_seqlens_q=None,
                       cu_seqlens_k=None, alibi_slopes=None, s_aux=None, params=params,
                       tiles=tiles)

        rule = kv.tiles_for(128, group * seqlen_q, q.device, page_size=page)
        rows = math.ceil(group * seqlen_q / rule.block_m)
        rule_splits = heur.kvcache_splits(batch=batch, heads_kv=heads[1], row_blocks=rows,
                                          max_keys=keys, block_n=rule.block_n, device=q.device,
                                          programs_per_sm=rule.programs_per_sm)
        if args.only_rule:
            for _ in range(3):
                run(rule, rule_splits)
            torch.cuda.synchronize()
            continue
        nbytes = 2 * batch * keys * heads[1] * 128 * q.element_size()
        results = []
        candidates = [(rule.block_m, rule.block_n, rule.num_warps, rule.num_stages, rule_splits)]
        for block_n in () if args.time_rule else (32, 64, 128):
            for warps, stages in itertools.product((4, 8), (2, 3, 4)):
                for factor in (0.5, 1, 2, 4):
                    splits = heur.kvcache_splits(batch=batch, heads_kv=heads[1],
                                                 row_blocks=rows, max_keys=keys,
                                                 block_n=block_n, device=q.device,
                                                 programs_per_sm=rule.programs_per_sm)
                    candidates.append((rule.block_m, block_n, warps, stages,
                                       max(1, min(256, round(splits * factor)))))
        seen = set()
        for i, (bm, bn, warps, stages, splits) in enumerate(candidates):
            key = (bm, bn, warps, stages, splits)
            if key in seen:
                continue
            seen.add(key)
            tiles = kv.KvTiles(bm, bn, warps, stages, "candidate")
            try:
                ms = graph_quantiles(lambda: run(tiles, splits), timing=timing)[1]
            except Exception as err:  # a shape that does not compile (shared memory) is skipped
                print(f"  {name} {key}: {type(err).__name__}: {str(err)[:80]}")
                continue
            results.append((ms, key, i == 0))
        print(f"\n{name}: B={batch} keys={keys} H={heads[0]}/{heads[1]} page={page or '-'} "
              f"Sq={seqlen_q}, K+V {nbytes / 1e6:.0f} MB")
        rule_row = [r for r in results if r[2]]
        for ms, key, is_rule in rule_row + sorted(results)[:args.top]:
            print(f"  {'rule ' if is_rule else '     '}m{key[0]} n{key[1]} w{key[2]} s{key[3]} "
                  f"splits {key[4]:4d}: {ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
