"""How long a benchmark run takes on an H200, and how to split it into commands that each
fit a time limit (a GPU machine may stop one command after ~9 minutes).

The estimate is a cost model, not a measurement: per workload, input sets and the oracle;
per (workload, provider), preparing, verifying and compiling; per (workload, provider,
mode), ``do_bench`` (warm-up + repetitions, each call preceded by an L2 flush) plus the
calls around it (autotune / compile call, ``do_bench``'s five estimate calls, the peak-memory
call). Call times come from the TFLOP/s each provider reached on our H200 (ANCHORS.md for the
peers). Calibration: a run of the standard D=128 grid on the H200 (6 workloads, SDPA
flash / cuDNN / mem-efficient and FlexAttention, 3 modes) took 78 s; FlexAttention's compile
time is the constant fitted to it, the rest are guesses. Every run writes its measured
seconds per workload to ``run.json`` (``parts[].seconds``) to recalibrate from.
"""

from __future__ import annotations

import dataclasses

from .providers import Provider
from .workloads import Workload, attention_flops

# Forward / backward TFLOP/s measured on the H200 (bf16, D=128; the peers' as in ANCHORS.md).
TFLOPS = {
    "ours-triton": (450.0, 350.0),
    "ours-cuda": (450.0, 350.0),
    "ours-auto": (450.0, 350.0),
    "sdpa-flash": (320.0, 290.0),
    "sdpa-cudnn": (570.0, 480.0),
    "sdpa-efficient": (160.0, 120.0),
    "flex": (430.0, 380.0),
    "flash-attn2": (320.0, 290.0),
    "fa3": (600.0, 500.0),
}
DEFAULT_TFLOPS = (300.0, 250.0)
DECODE_BYTES_PER_S = 2.5e12  # decode reads K/V once: memory-bound (H200 copy: 4.27 TB/s read + write)
L2_FLUSH_MS = 0.07  # do_bench zeroes a 256 MB buffer before each timed call
CALLS_AROUND_DO_BENCH = 9  # compile call, do_bench's first + 5 estimate calls, peak-memory call, slack
MEASUREMENT_OVERHEAD_S = 0.1  # synchronize, empty_cache, closures
PROVIDER_OVERHEAD_S = 0.4  # prepare every input set, verify forward (and backward) on the slice
WORKLOAD_OVERHEAD_S = 0.5  # input sets, the float64 oracle on the slice
COMPILE_S = {  # per workload: FlexAttention compiles a graph per (shape, grad mode); Triton JIT mostly cached
    "flex": {"fwd": 2.0, "grad": 5.4},
    "ours-triton": {"fwd": 0.5, "grad": 1.0},
    "ours-cuda": {"fwd": 0.5, "grad": 1.0},
    "ours-auto": {"fwd": 0.5, "grad": 1.0},
}


def _call_ms(w: Workload, provider: Provider, mode: str) -> float:
    """Milliseconds of one call of ``provider`` on ``w`` in ``mode``."""
    fwd_rate, bwd_rate = TFLOPS.get(provider.name, DEFAULT_TFLOPS)
    if w.grid == "decode":
        kv_bytes = 2 * 2 * w.batch * w.seqlen_k * w.heads_kv * w.head_dim
        return kv_bytes / DECODE_BYTES_PER_S * 1e3 * (1 if mode == "fwd" else 3.5)
    work = w
    label = provider.label(w)
    if label.endswith("-padded"):  # SDPA on the padded batch computes every padded row
        work = dataclasses.replace(w, seqlens=None)
    elif label.endswith("-densemask"):  # a dense mask skips no block
        work = dataclasses.replace(w, window_left=-1, window_right=-1, causal=False)
    fwd = attention_flops(work, "fwd")
    ms = {"fwd": fwd / fwd_rate, "bwd": 2.5 * fwd / bwd_rate}
    ms["fwd_bwd"] = ms["fwd"] + ms["bwd"]
    return ms[mode] / 1e9


def measurement_s(call_ms: float, warmup_ms: float, rep_ms: float) -> float:
    """Seconds ``runner.quantiles`` + ``peak_memory`` spend on one (workload, provider, mode)."""
    if call_ms >= warmup_ms + rep_ms:  # do_bench runs one warm-up and one timed call
        loop_ms = 2 * (call_ms + L2_FLUSH_MS)
    else:
        loop_ms = (warmup_ms + rep_ms) * (1 + L2_FLUSH_MS / max(call_ms, 1e-3))
    return (loop_ms + CALLS_AROUND_DO_BENCH * call_ms) / 1e3 + MEASUREMENT_OVERHEAD_S


def workload_s(w: Workload, providers: list[Provider], modes, *, warmup_ms: float = 25.0,
               rep_ms: float = 100.0) -> float:
    """Estimated seconds of one workload with every provider that supports it."""
    modes = [m for m in modes if m in w.modes]
    total = WORKLOAD_OVERHEAD_S
    for p in providers:
        if p.unsupported(w):
            continue
        total += PROVIDER_OVERHEAD_S
        compile_s = COMPILE_S.get(p.name, {})
        total += compile_s.get("fwd", 0.0) if "fwd" in modes else 0.0
        total += compile_s.get("grad", 0.0) if any(m != "fwd" for m in modes) else 0.0
        total += sum(measurement_s(_call_ms(w, p, m), warmup_ms, rep_ms) for m in modes)
    return total


@dataclasses.dataclass
class Chunk:
    """Workloads one command measures, expressed with the CLI's filters."""
    grids: list[str]
    head_dims: list[int] | None = None
    seqlens: list[int] | None = None
    workloads: list[Workload] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def args(self) -> list[str]:
        out = ["--grid", ",".join(self.grids)]
        if self.head_dims:
            out += ["--head-dims", ",".join(map(str, self.head_dims))]
        if self.seqlens:
            out += ["--seqlens", ",".join(_short(s) for s in self.seqlens)]
        return out


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _pack(items, limit_s: float, make) -> list[Chunk]:
    """Consecutive ``(key, workloads, seconds)`` items packed greedily into chunks of at most
    ``limit_s`` (an item above the limit alone gets its own chunk); ``make(keys)`` builds a chunk."""
    chunks: list[Chunk] = []
    keys: list = []
    loads: list[Workload] = []
    seconds = 0.0
    for key, items_w, s in items:
        if keys and seconds + s > limit_s:
            chunks.append(dataclasses.replace(make(keys), workloads=loads, seconds=seconds))
            keys, loads, seconds = [], [], 0.0
        keys.append(key)
        loads = loads + items_w
        seconds += s
    if keys:
        chunks.append(dataclasses.replace(make(keys), workloads=loads, seconds=seconds))
    return chunks


def split(workloads: list[Workload], cost: dict[str, float], limit_s: float) -> list[Chunk]:
    """Commands that together measure ``workloads``, each estimated at most ``limit_s`` where the
    filters allow: whole grids first (``--grid a,b``), then head dims of one grid, then key
    lengths of one (grid, head dim). ``cost`` maps workload names to seconds."""
    def group(ws, attr):
        out: dict = {}
        for w in ws:
            out.setdefault(getattr(w, attr), []).append(w)
        return out

    def seconds(ws):
        return sum(cost[w.name] for w in ws)

    by_grid = group(workloads, "grid")
    small = [(g, ws, seconds(ws)) for g, ws in by_grid.items() if seconds(ws) <= limit_s]
    chunks = _pack(small, limit_s, lambda keys: Chunk(grids=keys))
    for grid, ws in by_grid.items():
        if seconds(ws) <= limit_s:
            continue
        by_dim = group(ws, "head_dim")
        fitting = [(d, dws, seconds(dws)) for d, dws in by_dim.items() if seconds(dws) <= limit_s]
        chunks += _pack(fitting, limit_s, lambda keys, grid=grid: Chunk(grids=[grid], head_dims=keys))
        for d, dws in by_dim.items():
            if seconds(dws) <= limit_s:
                continue
            by_len = [(s, sws, seconds(sws)) for s, sws in sorted(group(dws, "seqlen_k").items())]
            chunks += _pack(by_len, limit_s, lambda keys, grid=grid, d=d: Chunk([grid], [d], keys))
    return chunks


def describe(chunks: list[Chunk], limit_s: float, base_args: list[str]) -> list[str]:
    """Printable lines: one command per chunk with its estimate."""
    lines = []
    for c in chunks:
        over = "  (over the limit: one (grid, head dim, length) cannot be split further)" \
            if c.seconds > limit_s else ""
        cmd = " ".join(["python -m flash_attn_hub bench", *c.args(), *base_args])
        lines.append(f"  {cmd}   # {len(c.workloads)} workloads, ~{c.seconds / 60:.1f} min{over}")
    return lines


