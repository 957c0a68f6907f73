"""The one timer of the tooling: ``python -m flash_attn_hub bench`` and ``python -m
flash_attn_hub tune`` (and the profiling helpers in ``tools/``) time every call through it.

Three clocks, one module:

* :func:`quantiles`: on a GPU, ``triton.testing.do_bench``: warm-up calls, then repetitions
  for ``rep_ms``, each preceded by an L2 flush, and the median with the 20th / 80th
  percentiles. Kernels long enough that the host's launch cost hides behind them.
* :func:`graph_quantiles`: device time alone, for calls so short that the host's cost per
  call would be most of a ``do_bench`` sample (a decode step over a KV cache): ``graph_calls``
  calls captured in one CUDA graph, each replay timed with CUDA events and divided by
  ``graph_calls``, quantiles over ``graph_replays`` replays.
* :func:`host_ms`: the host's side of the same calls, eager: wall time per call over many
  back-to-back calls, the GPU drained after the clock stops.

Without a GPU each is a wall-clock loop (:func:`quantiles`' warm-up, then at least five calls
and ``rep_ms``), so the whole pipeline runs on a CPU; those numbers check the pipeline, they
do not measure kernels.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Iterable

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class Timing:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    graph_calls: int = 20  # calls captured per CUDA graph (graph_quantiles)
    graph_replays: int = 5  # timed replays, after one untimed
    host_calls: int = 300  # eager calls per host_ms measurement, after 20 untimed
    host_batches: int = 5  # host_ms takes the median batch of host_calls / host_batches calls


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def quantiles(fn: Callable[[], object], *, device: torch.device | str = "cuda",
              grad_to_none: Iterable[torch.Tensor] = (), timing: Timing = Timing()) -> tuple[float, float, float]:
    """(p20, p50, p80) milliseconds of one call of ``fn``; ``grad_to_none``: tensors whose
    ``.grad`` is cleared before each call (a backward would otherwise time its accumulation)."""
    grad_to_none = list(grad_to_none)
    if _is_cuda(device):
        import triton.testing
        p20, p50, p80 = triton.testing.do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms,
                                                grad_to_none=grad_to_none, quantiles=[0.2, 0.5, 0.8])
        return float(p20), float(p50), float(p80)
    fn()
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < timing.warmup_ms:
        fn()
    times: list[float] = []
    while len(times) < 5 or (sum(times) < timing.rep_ms and len(times) < 1000):
        for t in grad_to_none:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    p20, p50, p80 = np.quantile(np.asarray(times), [0.2, 0.5, 0.8])
    return float(p20), float(p50), float(p80)


def median_ms(fn: Callable[[], object], **kwargs) -> float:
    """The median of :func:`quantiles`."""
    return quantiles(fn, **kwargs)[1]


def graph_quantiles(fn: Callable[[], object], *, device: torch.device | str = "cuda",
                    timing: Timing = Timing()) -> tuple[float, float, float]:
    """(p20, p50, p80) milliseconds of one call of ``fn`` on the device alone, host time out:
    ``timing.graph_calls`` calls of ``fn`` captured in one CUDA graph, one untimed replay,
    then ``timing.graph_replays`` replays timed with CUDA events (each divided by the calls).
    ``fn`` runs once on a side stream before the capture (lazy initialisation, allocations),
    as capturing requires. Without a GPU, :func:`quantiles`' wall-clock loop."""
    if not _is_cuda(device):
        return quantiles(fn, device=device, timing=timing)
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        fn()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(timing.graph_calls):
                fn()
        graph.replay()
        times = []
        for _ in range(timing.graph_replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / timing.graph_calls)
    finally:
        graph.reset()  # its memory pool goes back to the allocator
    p20, p50, p80 = np.quantile(np.asarray(times), [0.2, 0.5, 0.8])
    return float(p20), float(p50), float(p80)


def host_ms(fn: Callable[[], object], *, device: torch.device | str = "cuda", timing: Timing = Timing()) -> float:
    """Host milliseconds per eager call of ``fn``: 20 untimed calls, then ``timing.host_calls``
    calls issued back to back under ``time.perf_counter`` in ``timing.host_batches`` batches,
    the median batch's time per call (a batch that a background task on the host slowed down
    does not move it: on one H100 host two identical cells read 206 and 373 us from a single
    mean). The GPU is drained before the clock starts and after it stops. Meaningful where the
    device finishes a call before the host issues the next one (otherwise the launch queue
    fills and the host waits for the GPU)."""
    cuda = _is_cuda(device)
    for _ in range(20):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    per_batch = max(1, timing.host_calls // timing.host_batches)
    times = []
    for _ in range(timing.host_batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        times.append((time.perf_counter() - start) / per_batch)
    if cuda:
        torch.cuda.synchronize(device)
    return statistics.median(times) * 1e3


def copy_gbps(device: torch.device | str = "cuda", *, nbytes: int | None = None, timing: Timing = Timing()) -> float:
    """Bytes read + written per second (GB/s) by the faster of two copies of ``nbytes``
    (default 4 GiB on a GPU, 16 MiB on a CPU) within the device, timed like the calls they are
    compared with (:func:`graph_quantiles`, median): the memory-bound ceiling of a call that
    reads ``n`` bytes is about ``n / (2 * nbytes)`` of this copy's time.

    The two copies: ``Tensor.copy_`` (a device-to-device memcpy, which a CUDA graph may hand to
    a copy engine, slower than the SMs on an H100) and an elementwise kernel on the SMs
    (``torch.bitwise_not``: one read and one write per element, like the memcpy). Taking the
    faster keeps ``%copy`` a fraction of what the SMs can stream."""
    nbytes = nbytes or ((4 << 30) if _is_cuda(device) else (16 << 20))
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device)
    src.random_()
    dst = torch.empty_like(src)
    copies = (lambda: dst.copy_(src), lambda: torch.bitwise_not(src, out=dst))
    median = min(graph_quantiles(copy, device=device, timing=timing)[1] for copy in copies)
    return 2 * src.numel() * src.element_size() / (median * 1e-3) / 1e9
