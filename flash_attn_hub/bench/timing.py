"""The one timer of the tooling: ``python -m flash_attn_hub bench`` and ``python -m
flash_attn_hub tune`` (and the profiling helpers in ``tools/``) time every call through it.

On a GPU, ``triton.testing.do_bench``: warm-up calls, then repetitions for ``rep_ms``, each
preceded by an L2 flush, and the median with the 20th / 80th percentiles. Without a GPU, a
wall-clock loop of the same shape (warm-up, then at least five calls and ``rep_ms``), so the
whole pipeline runs on a CPU; those numbers check the pipeline, they do not measure kernels.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class Timing:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0


def quantiles(fn: Callable[[], object], *, device: torch.device | str = "cuda",
              grad_to_none: Iterable[torch.Tensor] = (), timing: Timing = Timing()) -> tuple[float, float, float]:
    """(p20, p50, p80) milliseconds of one call of ``fn``; ``grad_to_none``: tensors whose
    ``.grad`` is cleared before each call (a backward would otherwise time its accumulation)."""
    grad_to_none = list(grad_to_none)
    if torch.device(device).type == "cuda":
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
