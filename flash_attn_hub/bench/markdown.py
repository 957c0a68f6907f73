"""``RESULTS.md`` of a run: where and what was measured, a summary of our ratios, GQA/MQA
backward peak memory against SDPA flash, per grid one TFLOP/s table per mode (workloads x
providers) and the plots (a kv-cache grid: device time, GB/s and %copy per cell, and the eager
host time per call), what was skipped and why, and how everything was counted. Times,
percentiles and peak memory of every cell are in ``results.csv``."""

from __future__ import annotations

import math
from pathlib import Path

from .plots import MODE_TITLES, versions
from .timing import Timing

MiB = 1 << 20
SDPA_FLASH = "sdpa-flash"

METHOD = """\
- **FLOPs**: forward `4 * B * Hq * Sq * Sk * D`, halved for a causal square score matrix;
  causal with `Sq != Sk`, sliding windows and packed documents count the visible (query, key)
  pairs exactly (bottom-right aligned masks). Backward = 2.5x forward, forward + backward =
  3.5x. GQA counts query heads. TFLOP/s = FLOPs / median time.
- **Timing**: every provider in one process, one after another; `triton.testing.do_bench`
  (L2 flushed before each call) median with 20th/80th percentiles (`ms_p20`, `ms_p50`,
  `ms_p80` in results.csv); several random input sets rotated for small problems. "bwd" times
  the backward alone (the forward graph is built outside the timed region; FlexAttention is
  compiled with AOTAutograd's buffer donation off, which that needs); "fwd" runs without
  autograd (inference: no tensors saved for a backward); "fwd+bwd" is a training step's
  attention.
- **Ours**: `ours-triton` / `ours-cuda` force `FLASH_ATTN_HUB_BACKEND`; `ours-cuda` is the
  compiled Hopper kernels (a backward they do not cover runs on Triton); `ours-auto` is the
  package's own choice per call, what users get.
- **Peers**: PyTorch SDPA pinned to one backend (`sdpa-cudnn`, `sdpa-flash`), FlexAttention
  (`flex`, `torch.compile`d, one graph per shape), FlashAttention-4 (`fa4`, the `flash-attn-4`
  package, compiled on its first call per configuration, before anything is timed; its
  backward through autograd), FlashInfer (`flashinfer`, the `flashinfer-python` package, on
  kv-cache steps only: its paged decode wrapper planned before timing, one new token on its
  CUDA-core decode kernel, several on its tensor-core one; a contiguous cache read in place as
  pages of 16 keys), and flash-attn 2 / FlashAttention-3 when installed.
- **Ratio**: our TFLOP/s over the best peer's in the same process, workload and mode (ours are
  never peers). A page measured in two commands keeps each (workload, mode) group whole from
  one of them, so a ratio never mixes two processes.
- **Verification**: before timing, every provider's output (and, when backward modes run,
  dQ/dK/dV) on a slice (last batch element or longest document, up to 128 trailing query rows,
  first and last query heads) is compared with `flash_attn_hub/reference.py` in float64: the error
  may be at most 2x PyTorch's own error in the same precision. A provider that fails is
  skipped with its reason (listed above).
- **Peak memory**: `torch.cuda.max_memory_allocated` during one call minus what was allocated
  before it (outputs, gradients, saved tensors and workspaces of that call; for "bwd" the
  forward's saved tensors already exist, so it is what the backward adds: dQ/dK/dV and
  workspaces, e.g. a group-expanded dK/dV before its reduction).
- **Varlen** (16k-token packed batches, lognormal document lengths: `sft` SFT-like, `longtail`
  mostly short documents with a few long ones): SDPA has no native varlen; `sdpa-*-padded`
  runs SDPA on the batch right-padded to its longest document (padding done outside the timed
  region) and is credited with the useful FLOPs only; `flex-docmask` is FlexAttention with a
  causal document mask over the packed batch.
- **Window**: SDPA flash/cuDNN take no mask; `sdpa-efficient-densemask` uses a dense boolean
  mask; `flex` uses a sliding-window block mask.
- **Softcap** (Gemma 2's logit soft-capping, `cap50` in the mask column): each scaled score `s`
  becomes `softcap * tanh(s / softcap)` before the mask. Ours, FlashAttention-4 and flash-attn
  2 / 3 take `softcap`; `flex` caps in a `score_mod`; SDPA has no soft-capping (skipped). The
  FLOPs are those of the same cell without the cap (a tanh is no matmul). q is drawn with
  standard deviation `softcap`, so scores reach the cap and verification refuses a provider
  that drops it.
- **Decode** (`Sq = 1`): memory-bound, so GB/s (q, k, v read, out written) is listed too.
- **KV cache** (`flash_attn_with_kvcache` decode steps: `Sq` new queries over a cache of `Sk`
  keys per sequence, nothing appended; paged caches hand out their blocks in a random order):
  ours with its value checks off (`FLASH_ATTN_HUB_CHECK_VALUES=0`), as a serving loop runs it;
  SDPA cuDNN / flash read the contiguous cache in place (`enable_gqa`, causal lower-right for
  `Sq > 1`) and have no paged form; the other peers are not wired to a kv-cache call. Each
  call is timed inside a CUDA graph ({calls} calls per replay, median of {replays} replays):
  the device's time, without the host's. GB/s = the K and V bytes a call must read / median
  time; %copy = that over the bytes read + written per second by a device-to-device copy
  (the faster of a memcpy and an elementwise copy kernel), measured once per run the same way;
  a kernel that only reads can pass 100% of a copy that reads and writes. Host time: wall time
  per eager call, the median of {batches} batches of {per} back-to-back calls, on the smallest
  cells. The oracle is `kvcache_reference`, on the last sequence. Cells whose K+V exceed a
  third of the GPU's memory are skipped.
""".format(calls=Timing.graph_calls, replays=Timing.graph_replays, batches=Timing.host_batches,
           per=Timing.host_calls // Timing.host_batches)


def _fmt(v) -> str:
    if v is None:
        return ""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def _ours_first(providers) -> list[str]:
    return sorted(set(providers), key=lambda p: (not p.startswith("ours"), p))


def _mask(r: dict) -> str:
    mask = "causal" if r["causal"] else "full"
    if r["window_left"] >= 0:
        mask += f" w{r['window_left']}"
    if r.get("softcap"):  # absent from pages measured before softcap was a column
        mask += f" cap{r['softcap']:g}"
    if r["varlen"]:
        mask += f" varlen {r.get('mix') or ''} x{r['num_seqs']}".replace("  ", " ")
    return mask


def _row(line: list[str]) -> str:
    return "| " + " | ".join(line) + " |"


def _header(head: list[str]) -> list[str]:
    return [_row(head), "|" + "---|" * len(head)]


def _by_workload(rows: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r["workload"], {})[r["provider"]] = r
    return out


def _grid_table(rows: list[dict], value, providers, ours) -> list[str]:
    """One row per workload, one column per provider (``value`` of its record), then the
    best peer and our ratios to it (TFLOP/s)."""
    lines = _header(["D", "Hq/Hkv", "B", "Sq", "Sk", "mask", *providers, "best peer",
                     *[f"{o} / best" for o in ours]])
    for cells in _by_workload(rows).values():
        any_r = next(iter(cells.values()))
        line = [str(any_r["head_dim"]), f"{any_r['heads_q']}/{any_r['heads_kv']}", str(any_r["batch"]),
                str(any_r["seqlen_q"]), str(any_r["seqlen_k"]), _mask(any_r)]
        line += [_fmt(value(cells[p])) if p in cells else "-" for p in providers]
        line.append(any_r["best_peer"] or "-")
        line += [f"{cells[o]['ratio_to_best_peer']:.2f}x" if o in cells and cells[o]["ratio_to_best_peer"]
                 else "-" for o in ours]
        lines.append(_row(line))
    return lines


def _cache_cells(r: dict) -> list[str]:
    cache = f"page {r['page_size']}" if r.get("page_size") else "contiguous"
    return [cache, f"{r['heads_q']}/{r['heads_kv']}", str(r["batch"]),
            f"{r['seqlen_k'] // 1024}k" if r["seqlen_k"] % 1024 == 0 else str(r["seqlen_k"]), str(r["seqlen_q"])]


def kvcache_tables(rows: list[dict]) -> list[str]:
    """A kv-cache grid: per cell each provider's device time (us), our GB/s and %copy, the best
    peer and our ratio to it; then the eager host time per call where it was measured."""
    providers = _ours_first(r["provider"] for r in rows)
    ours = [p for p in providers if p.startswith("ours")]
    copies = sorted({round(r["copy_gbps"]) for r in rows if r.get("copy_gbps")})
    lines = [f"`flash_attn_with_kvcache` decode steps, device time per call from CUDA-graph replays; "
             f"device copy {' / '.join(map(str, copies)) or '-'} GB/s (read + write). Ratio: the best "
             "peer's time over ours (above 1: ours faster).", "",
             "### Device time (us, median), K+V read (GB/s) and %copy", ""]
    lines += _header(["cache", "Hq/Hkv", "B", "Sk", "Sq", *[f"{p} us" for p in providers],
                      *[f"{o} {unit}" for o in ours for unit in ("GB/s", "%copy")], "best peer",
                      *[f"{o} / best" for o in ours]])
    for cells in _by_workload(rows).values():
        any_r = next(iter(cells.values()))
        line = _cache_cells(any_r) + [_fmt(cells[p]["ms_p50"] * 1e3) if p in cells else "-" for p in providers]
        for o in ours:
            r = cells.get(o, {})
            line += [_fmt(r.get("gbps")) or "-", f"{r['pct_copy']:.0f}" if r.get("pct_copy") else "-"]
        line.append(any_r["best_peer"] or "-")
        line += [f"{cells[o]['ratio_to_best_peer']:.2f}x" if o in cells and cells[o]["ratio_to_best_peer"]
                 else "-" for o in ours]
        lines.append(_row(line))
    timed = [r for r in rows if r.get("host_us") is not None]
    if timed:
        providers = _ours_first(r["provider"] for r in timed)
        ours = [p for p in providers if p.startswith("ours")]
        lines += ["", "### Host time per eager call (us)", "",
                  "Wall time per call over back-to-back eager calls, where the device finishes each call "
                  "before the next is issued: what a loop that does not capture CUDA graphs pays per step. "
                  "Ratio: the fastest peer's host time over ours (above 1: ours cheaper; SDPA has no paged "
                  "cache, so a paged cell's peer is SDPA on the contiguous cache of the same shape).", ""]
        lines += _header(["cache", "Hq/Hkv", "B", "Sk", "Sq", *[f"{p} us" for p in providers],
                          *[f"{o} / fastest peer" for o in ours]])
        fastest = {}
        for r in timed:
            if not r["provider"].startswith("ours"):
                key = (r["heads_q"], r["heads_kv"], r["batch"], r["seqlen_k"], r["seqlen_q"])
                fastest[key] = min(fastest.get(key, float("inf")), r["host_us"])
        for cells in _by_workload(timed).values():
            any_r = next(iter(cells.values()))
            # SDPA has no paged cache: a paged cell's peer is SDPA on the same cell's contiguous cache
            peer = fastest.get((any_r["heads_q"], any_r["heads_kv"], any_r["batch"], any_r["seqlen_k"],
                                any_r["seqlen_q"]))
            line = _cache_cells(any_r) + [_fmt(cells[p]["host_us"]) if p in cells else "-" for p in providers]
            line += [f"{peer / cells[o]['host_us']:.2f}x" if o in cells and peer else "-" for o in ours]
            lines.append(_row(line))
    return lines


def _mib(r: dict | None) -> float | None:
    return None if r is None or r["peak_mem_bytes"] is None else r["peak_mem_bytes"] / MiB


def summary(records: list[dict]) -> list[str]:
    """Per (grid, mode, our backend): geometric mean, min and max of the ratio to the best
    peer over the workloads, and the peer that was best most often."""
    lines = _header(["grid", "mode", "ours", "workloads", "geomean / best peer", "min", "max",
                     "best peer (most often)"])
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["provider"].startswith("ours") and r["ratio_to_best_peer"]:
            groups.setdefault((r["grid"], r["mode"], r["provider"]), []).append(r)
    if not groups:
        return []
    order = {m: i for i, m in enumerate(MODE_TITLES)}
    for (grid, mode, ours), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1]], kv[0][2])):
        ratios = [r["ratio_to_best_peer"] for r in rows]
        geomean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        peers = [r["best_peer"] for r in rows]
        common = max(dict.fromkeys(peers), key=peers.count)
        lines.append(_row([grid, MODE_TITLES[mode], ours, str(len(rows)), f"{geomean:.2f}x", f"{min(ratios):.2f}x",
                           f"{max(ratios):.2f}x", f"{common} ({peers.count(common)}/{len(rows)})"]))
    return lines


def gqa_memory(records: list[dict]) -> list[str]:
    """Backward peak memory of GQA/MQA workloads: every provider in MiB, and ours over SDPA
    flash (which reduces a group-expanded dK/dV; ours reduce in the kernel)."""
    rows = [r for r in records if r["heads_q"] != r["heads_kv"] and r["mode"] in ("bwd", "fwd_bwd")
            and r["peak_mem_bytes"] is not None]
    if not rows:
        return []
    providers = _ours_first(r["provider"] for r in rows)
    ours = [p for p in providers if p.startswith("ours")]
    lines = _header(["workload", "mode", *[f"{p} MiB" for p in providers], *[f"{o} / {SDPA_FLASH}" for o in ours]])
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["workload"], r["mode"]), {})[r["provider"]] = r
    for (workload, mode), by in cells.items():
        flash = next((r for p, r in by.items() if p.startswith(SDPA_FLASH)), None)
        line = [f"`{workload}`", MODE_TITLES[mode], *[_fmt(_mib(by.get(p))) or "-" for p in providers]]
        for o in ours:
            line.append(f"{by[o]['peak_mem_bytes'] / flash['peak_mem_bytes']:.2f}x"
                        if o in by and flash and flash["peak_mem_bytes"] else "-")
        lines.append(_row(line))
    return lines


def _header_lines(env: dict, records: list[dict]) -> list[str]:
    peers = "".join(f"; {title} {env[key]}" for key, title in (("fa4", "FlashAttention-4 (flash-attn-4)"),
                                                               ("flashinfer", "FlashInfer (flashinfer-python)"))
                    if env.get(key) and any(r["provider"] == key for r in records))
    return [f"GPU: **{env.get('gpu')}**" + (f" (driver {env['driver']})" if env.get("driver") else "") +
            f"; {versions(env)}{peers}; kernels {env.get('kernels')}; our build `{env.get('kernel_build')}`; "
            f"git `{env.get('git_sha')}`; {env.get('date')}.", "",
            *_command_lines(env.get("command"))]


def _command_lines(commands) -> list[str]:
    """Where the page's numbers came from: one command, or the commands a page was measured in
    (each later one with --append), in order."""
    if isinstance(commands, str):
        commands = [commands]
    if not commands:
        return []
    if len(commands) == 1:
        return [f"Measured by `{commands[0]}` (a narrower command measures a subset of the grid).", ""]
    return ["Measured by these commands, one after another on this machine (a workload measured again "
            "by a later command keeps only the later numbers):", "",
            *[f"- `{c}`" for c in commands], ""]


def markdown(records: list[dict], skips: list[dict], env: dict, plots: list[Path], page_dir: Path,
             title: str) -> str:
    lines = [f"# {title}", "", *_header_lines(env, records)]
    if str(env.get("gpu", "")).startswith("none"):
        lines += ["**No GPU**: a tiny CPU grid that checks the pipeline. GPU numbers need a GPU.", ""]
    lines += ["Data: [results.csv](results.csv) (times, percentiles and peak memory of every cell).", ""]
    table = summary(records)
    if table:
        lines += ["## Summary: ours against the best peer (TFLOP/s ratio)", "", *table, ""]
    table = gqa_memory(records)
    if table:
        lines += ["## GQA / MQA backward: peak memory", "",
                  "What one backward (or forward + backward) call allocates; SDPA flash reduces a "
                  "group-expanded dK/dV, ours reduce over the query group in the kernel.", "", *table, ""]
    for grid in dict.fromkeys(r["grid"] for r in records):
        lines += [f"## {grid}", ""]
        grid_rows = [r for r in records if r["grid"] == grid]
        if all(r.get("kv_cache") for r in grid_rows):
            lines += kvcache_tables(grid_rows) + [""]
            continue
        for p in plots:
            if p.name.startswith(f"{grid}-"):
                lines += [f"![{p.stem}]({p.relative_to(page_dir).as_posix()})", ""]
        for mode in MODE_TITLES:
            rows = [r for r in grid_rows if r["mode"] == mode]
            if not rows:
                continue
            providers = _ours_first(r["provider"] for r in rows)
            ours = [p for p in providers if p.startswith("ours")]
            lines += [f"### {MODE_TITLES[mode]}: TFLOP/s (median)", ""]
            lines += _grid_table(rows, lambda r: r["tflops"], providers, ours) + [""]
            if any(r.get("gbps") for r in rows):
                lines += [f"### {MODE_TITLES[mode]}: GB/s (median)", ""]
                lines += _grid_table(rows, lambda r: r["gbps"], providers, ours) + [""]
    if skips:
        lines += ["## Skipped", "", *_header(["provider", "workloads", "mode", "reason"])]
        grouped: dict[tuple, int] = {}
        for s in skips:
            key = (s["provider"], s["mode"], s["reason"])
            grouped[key] = grouped.get(key, 0) + 1
        for (provider, mode, reason), n in grouped.items():
            lines.append(_row([provider, str(n), mode, reason.replace("|", "/").replace("\n", " ")]))
        lines.append("")
    lines += ["## Method", "", METHOD]
    return "\n".join(lines)
