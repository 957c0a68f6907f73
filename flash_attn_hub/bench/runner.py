"""Runs the workloads x providers x modes in one process, one after another, and turns the
timings into long-format records (one per provider, workload, mode).

Per workload: fresh random input sets (rotated so that the L2 cache never holds the next
call's inputs), the oracle on a slice (``verify.py``), then per provider: verify, and
only if that passes, time each mode with ``timing.quantiles`` (``triton.testing.do_bench``
median with the 20th/80th percentiles; on CPU a wall-clock loop) and measure the peak
memory it adds.

KV-cache decode steps are timed with ``timing.graph_quantiles`` instead (CUDA-graph replays:
the device's time, not the host's), their bandwidth compared with a device copy measured once
per run (``timing.copy_gbps``); on the cells that ``Workload.host_timed`` names, the eager host
time per call (``timing.host_ms``) is recorded too. A cell whose K+V exceed a third of the
GPU's memory is skipped whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
import warnings
from typing import Callable

import torch

from . import verify as verify_mod
from .env import environment
from .providers import Provider
from .timing import Timing, copy_gbps, graph_quantiles, host_ms, quantiles
from .workloads import DTYPES, Workload, attention_flops, make_inputs

MiB = 1 << 20
MAX_SETS = 4  # input sets rotated per measurement (small problems)
ROTATE_BYTES_PER_L2 = 4  # enough sets that their inputs span this many L2s
KV_MEMORY_SHARE = 1 / 3  # largest K+V of a kv-cache cell, as a share of the GPU's memory: room for the
# oracle's slice of the cache, SDPA's workspace and the allocator's slack


@dataclasses.dataclass
class Skip:
    provider: str
    workload: str
    mode: str  # "all" when the provider was skipped for the whole workload
    reason: str


class Rotator:
    """Calls the given closures in turn, so consecutive calls read different inputs."""

    def __init__(self, fns):
        self._fns = fns
        self._next = itertools.cycle(range(len(fns)))

    def __call__(self):
        return self._fns[next(self._next)]()


def peak_memory(fn, *, device: torch.device, grad_to_none) -> int | None:
    """Bytes allocated at the peak of one call above what was allocated before it."""
    if device.type != "cuda":
        return None
    for t in grad_to_none:
        t.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def _mode_closure(mode: str, prepared: list, seed: int):
    """The timed closure of ``mode`` over the rotated prepared sets, and the tensors whose
    gradients are cleared between timed calls. For "bwd" the forward graphs are built
    here, outside the timed region."""
    leaves = [t for p in prepared for t in p.leaves]
    if mode == "fwd":
        return Rotator([p.fwd for p in prepared]), []
    fns = []
    for i, p in enumerate(prepared):
        out = p.fwd()
        gen = torch.Generator(device=out.device).manual_seed(seed + i)
        dout = torch.randn(out.shape, generator=gen, device=out.device).to(out.dtype)
        if mode == "bwd":
            fns.append(lambda out=out, dout=dout: out.backward(dout, retain_graph=True))
        else:
            del out
            fns.append(lambda p=p, dout=dout: p.fwd().backward(dout))
    return Rotator(fns), leaves


def make_record(w: Workload, provider: str, mode: str, dtype: str, ms, peak, errors, env, *,
                copy: float | None = None, host: float | None = None) -> dict:
    """One long-format record; ``ratio_to_best_peer`` is filled in by :func:`add_ratios`.
    kv-cache steps: ``copy`` the run's device copy GB/s, ``host`` eager host ms per call."""
    p20, p50, p80 = ms
    flops = attention_flops(w, mode)
    record = {
        "provider": provider, "workload": w.name, "grid": w.grid, "family": w.family, "mode": mode,
        "dtype": dtype, "batch": w.batch, "seqlen_q": w.seqlen_q, "seqlen_k": w.seqlen_k,
        "heads_q": w.heads_q, "heads_kv": w.heads_kv, "head_dim": w.head_dim, "causal": w.causal,
        "window_left": w.window_left, "window_right": w.window_size[1], "softcap": w.softcap,
        "varlen": w.varlen, "mix": w.mix or None,
        "num_seqs": len(w.seqlens) if w.varlen else w.batch, "total_tokens_q": w.total_tokens_q,
        "kv_cache": w.kv_cache, "page_size": w.page_size if w.kv_cache else None,
        "flops": flops, "ms_p20": p20, "ms_p50": p50, "ms_p80": p80,
        "tflops": flops / (p50 * 1e-3) / 1e12, "ratio_to_best_peer": None, "best_peer": None,
        "peak_mem_bytes": peak,
        "gbps": None, "copy_gbps": None, "pct_copy": None, "host_us": None,
        "verify_err_out": errors.get("out"),
        "verify_err_grad": max((errors[k] for k in ("dq", "dk", "dv") if k in errors), default=None),
    }
    if w.grid == "decode" and mode == "fwd":  # memory-bound: bytes of q, k, v read and out written
        moved = 2 * w.head_dim * (2 * w.batch * w.seqlen_q * w.heads_q + 2 * w.batch * w.seqlen_k * w.heads_kv)
        record["gbps"] = moved / (p50 * 1e-3) / 1e9
    if w.kv_cache:  # memory-bound: the K and V bytes the step must read
        record["gbps"] = w.cache_elements * DTYPES[dtype].itemsize / (p50 * 1e-3) / 1e9
        if copy:
            record["copy_gbps"] = copy
            record["pct_copy"] = 100 * record["gbps"] / copy
        if host is not None:
            record["host_us"] = host * 1e3
    record.update(env)
    return record


def add_ratios(records: list[dict]) -> list[dict]:
    """Set ``ratio_to_best_peer`` (TFLOP/s over the best peer's in the same workload,
    mode and dtype) and ``best_peer`` on every record. Peers are providers that are not
    ours; with no peer measured, both stay None."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["workload"], r["mode"], r["dtype"]), []).append(r)
    for group in groups.values():
        peers = [r for r in group if not r["provider"].startswith("ours")]
        best = max(peers, key=lambda r: r["tflops"], default=None)
        for r in group:
            r["best_peer"] = best["provider"] if best else None
            r["ratio_to_best_peer"] = r["tflops"] / best["tflops"] if best else None
    return records


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _free(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class Progress:
    """A tqdm bar on a terminal when tqdm is installed, else one plain line per step."""

    def __init__(self, total: int, enabled: bool = True):
        self.enabled = enabled
        self.count, self.total = 0, total
        self.start = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():  # a log file gets plain lines, not carriage returns
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="run", dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label: str):
        self.count += 1
        if self.bar is not None:
            self.bar.set_description(label[:60])
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.count}/{self.total} {time.perf_counter() - self.start:.0f}s] {label}", flush=True)

    def write(self, text: str):
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _input_sets(w: Workload, device, dtype) -> list:
    first = make_inputs(w, device=device, dtype=dtype, seed=0)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 4 * MiB
    count = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES_PER_L2 * l2 / first.nbytes)))
    sets = [first] + [make_inputs(w, device=device, dtype=dtype, seed=i) for i in range(1, count)]
    if not w.kv_cache:  # a cache is read, never differentiated
        for x in sets:
            for t in (x.q, x.k, x.v):
                t.requires_grad_()
    return sets


def too_large(w: Workload, device, dtype) -> str | None:
    """Why a kv-cache cell does not fit this GPU (see ``KV_MEMORY_SHARE``), else None."""
    if not w.kv_cache or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if w.cache_elements * dtype.itemsize > KV_MEMORY_SHARE * total:
        return f"K+V over {KV_MEMORY_SHARE:.0%} of this GPU's memory"
    return None


def run_workload(w: Workload, providers: list[Provider], modes, *, device, dtype, dtype_name,
                 timing: Timing, env: dict, progress: Progress,
                 copy: float | None = None) -> tuple[list[dict], list[Skip]]:
    """Verify and time every provider on one workload (``copy``: the run's device copy GB/s,
    for kv-cache steps)."""
    records, skips = [], []
    modes = [m for m in modes if m in w.modes]
    reason = too_large(w, device, dtype)
    if reason:
        progress.write(f"skip {w.name}: {reason}")
        return records, [Skip("all", w.name, "all", reason)]
    sets = _input_sets(w, device, dtype)
    with_grads = any(m != "fwd" for m in modes)
    exp = verify_mod.expected(w, sets[0], with_grads=with_grads)
    for provider in providers:
        label = provider.label(w)
        progress.step(f"{w.name} {label}")

        def skip(mode, reason):
            skips.append(Skip(label, w.name, mode, reason))
            progress.write(f"skip {label} on {w.name} ({mode}): {reason}")

        reason = provider.unsupported(w)
        if reason:
            skip("all", reason)
            continue
        with provider.context(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                prepared = [provider.prepare(w, x) for x in sets]
                errors = verify_mod.verify(label, prepared[0], exp, grads=False)
            except Exception as err:  # any failure skips this provider, with its reason
                skip("all", _reason(err))
                _free(device)
                continue
            backward_failure = None
            if with_grads:
                try:
                    errors.update(verify_mod.verify(label, prepared[0], exp, grads=True))
                except Exception as err:  # e.g. a forward-only backend: its forward is still timed
                    backward_failure = _reason(err)
                    skip(",".join(m for m in modes if m != "fwd"), backward_failure)
            for mode in modes:
                if mode != "fwd" and backward_failure:
                    continue
                try:
                    fn, grads = _mode_closure(mode, prepared, seed=100)
                    with torch.set_grad_enabled(mode != "fwd"):
                        fn()  # compile / autotune outside the timed region
                        if w.kv_cache:
                            ms = graph_quantiles(fn, device=device, timing=timing)
                        else:
                            ms = quantiles(fn, device=device, grad_to_none=grads, timing=timing)
                        host = host_ms(fn, device=device, timing=timing) if w.host_timed else None
                        peak = peak_memory(fn, device=device, grad_to_none=grads)
                    records.append(make_record(w, label, mode, dtype_name, ms, peak, errors, env, copy=copy,
                                               host=host))
                except Exception as err:
                    skip(mode, _reason(err))
                finally:
                    fn = grads = None
                    for x in sets:
                        for t in (x.q, x.k, x.v):
                            t.grad = None
                    _free(device)
        prepared = None
        _free(device)
    return records, skips


def available(providers: list[Provider], device: torch.device) -> tuple[list[Provider], list[Skip]]:
    """The providers that can run on ``device`` here, and a skip (printed) for each other."""
    usable, skips = [], []
    for p in providers:
        reason = None if device.type in p.devices else f"runs on {'/'.join(p.devices)} only"
        reason = reason or p.unavailable()
        if reason:
            skips.append(Skip(p.name, "all", "all", reason))
            print(f"skip {p.name}: {reason}", flush=True)
        else:
            usable.append(p)
    return usable, skips


@dataclasses.dataclass
class SuiteResult:
    records: list[dict]
    skips: list[Skip]
    env: dict
    seconds: dict[str, float]  # wall time per measured workload
    copy_gbps: float | None = None  # device copy, read + write (measured when kv-cache steps run)


def run_suite(workloads, providers, modes, *, device, dtype_name="bf16", timing=None, ours_module=None,
              progress=True, env: dict | None = None,
              on_workload: Callable[[SuiteResult], None] | None = None) -> SuiteResult:
    """Every workload with every provider that is available on ``device``.

    ``on_workload(result so far)`` runs after each workload (the CLI saves the records there,
    so a run stopped by a time limit keeps every finished workload)."""
    dtype = DTYPES[dtype_name]
    timing = timing or Timing()
    env = env or environment(device, ours_module)
    usable, skips = available(providers, device)
    result = SuiteResult([], skips, env, {})
    if any(w.kv_cache for w in workloads):
        result.copy_gbps = copy_gbps(device, timing=timing)
        print(f"device copy: {result.copy_gbps:.0f} GB/s (read + write)", flush=True)
        _free(device)
    bar = Progress(len(workloads) * len(usable), enabled=progress)
    try:
        for w in workloads:
            t0 = time.perf_counter()
            got, skipped = run_workload(w, usable, modes, device=device, dtype=dtype, dtype_name=dtype_name,
                                        timing=timing, env=env, progress=bar, copy=result.copy_gbps)
            result.records += got
            result.skips += skipped
            result.seconds[w.name] = round(time.perf_counter() - t0, 2)
            add_ratios(result.records)
            if on_workload is not None:
                on_workload(result)
    finally:
        bar.close()
    add_ratios(result.records)
    return result
