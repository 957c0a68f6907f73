"""What the benchmark measures: workloads, grids, FLOP counting and inputs.

Glossary:
  B       batch size (varlen: number of packed documents)
  Sq, Sk  query / key sequence lengths (varlen: the longest document)
  Hq, Hkv query / key-value heads (GQA: Hq % Hkv == 0; MQA: Hkv == 1)
  D       head dimension
  window  (left, right) band around the bottom-right aligned diagonal, -1 = unbounded;
          causal forces right = 0
  mode    "fwd", "bwd" (backward only, forward graph built outside the timed region),
          "fwd_bwd" (both)

FLOPs follow ANCHORS.md: forward ``4 * B * Hq * Sq * Sk * D``, halved for a causal
square (Sq == Sk) score matrix; every other masked case (causal with Sq != Sk, sliding
windows, packed documents) counts the visible (query, key) pairs exactly. Backward is
2.5x the forward, forward+backward 3.5x. GQA counts query heads.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import torch

MODES = ("fwd", "bwd", "fwd_bwd")
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
TOKENS_PER_BATCH = 16384
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Workload:
    grid: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    window_left: int = -1
    window_right: int = -1
    seqlens: tuple[int, ...] | None = None  # varlen: document lengths (q and k alike)
    mix: str = ""  # varlen: the length distribution the documents were drawn from (LENGTH_MIXES)
    modes: tuple[str, ...] = MODES

    @property
    def varlen(self) -> bool:
        return self.seqlens is not None

    @property
    def gqa(self) -> bool:
        return self.heads_q != self.heads_kv

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or (self.window_right >= 0 and not self.causal)

    @property
    def window_size(self) -> tuple[int, int]:
        """``window_size`` as flash-attn takes it (causal implies right = 0 anyway)."""
        return (self.window_left, 0 if self.causal else self.window_right)

    @property
    def total_tokens_q(self) -> int:
        return sum(self.seqlens) if self.varlen else self.batch * self.seqlen_q

    @property
    def name(self) -> str:
        heads = f"h{self.heads_q}" if not self.gqa else f"h{self.heads_q}-{self.heads_kv}"
        if self.varlen:
            shape = f"{self.mix}{len(self.seqlens)}x{self.seqlen_q}max"
        elif self.seqlen_q == self.seqlen_k:
            shape = f"b{self.batch}-s{self.seqlen_q}"
        else:
            shape = f"b{self.batch}-sq{self.seqlen_q}-sk{self.seqlen_k}"
        mask = "causal" if self.causal else "full"
        if self.windowed:
            mask += f"-w{self.window_left}.{self.window_size[1]}"
        return f"{self.grid}-d{self.head_dim}-{heads}-{shape}-{mask}"

    @property
    def family(self) -> str:
        """Workloads that differ only in sequence length (one line per provider in a plot)."""
        heads = f"Hq/Hkv={self.heads_q}/{self.heads_kv}"
        mix = f" {self.mix}" if self.varlen and self.mix else ""
        return f"{self.grid}{mix} D={self.head_dim} {heads}"


def visible_pairs(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int) -> int:
    """Exact count of visible (query, key) pairs with the bottom-right aligned band of
    ``flash_attn_hub.reference.visible_mask``: key j is visible from query i iff
    ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (a negative side is unbounded)."""
    if seqlen_q == 0 or seqlen_k == 0:
        return 0
    diag = np.arange(seqlen_q, dtype=np.int64) + (seqlen_k - seqlen_q)
    lo = np.zeros_like(diag) if window_left < 0 else np.maximum(diag - window_left, 0)
    hi = np.full_like(diag, seqlen_k - 1) if window_right < 0 else np.minimum(diag + window_right, seqlen_k - 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def _sequence_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window_left: int, window_right: int) -> float:
    if causal:
        window_right = 0
    if window_left < 0 and window_right < 0:
        return float(seqlen_q * seqlen_k)
    if causal and window_left < 0 and seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k / 2.0  # the convention everyone reports (ANCHORS.md)
    return float(visible_pairs(seqlen_q, seqlen_k, window_left, window_right))


def attention_flops(w: Workload, mode: str = "fwd") -> float:
    """FLOPs of one call in ``mode``, counted as ANCHORS.md prescribes."""
    if w.varlen:
        pairs = sum(_sequence_pairs(n, n, w.causal, w.window_left, w.window_right) for n in w.seqlens)
    else:
        pairs = w.batch * _sequence_pairs(w.seqlen_q, w.seqlen_k, w.causal, w.window_left, w.window_right)
    return 4.0 * w.heads_q * w.head_dim * pairs * MODE_FLOP_FACTOR[mode]


# Document-length distributions of packed batches: lognormal ``(median, sigma, low, high)``.
#   sft       chat / instruction SFT samples: a few hundred tokens, rarely over 2k
#   longtail  mostly short documents and a few long ones (up to 8k) that dominate the FLOPs
LENGTH_MIXES = {
    "sft": (400.0, 0.8, 32, 4096),
    "longtail": (160.0, 1.8, 8, 8192),
}


def packed_lengths(total: int, *, seed: int = 0, median: float = 512.0, sigma: float = 1.0,
                   low: int = 16, high: int = 8192) -> tuple[int, ...]:
    """Document lengths of one packed batch: lognormal (long tail of long documents),
    clipped to ``[low, high]``, the last one trimmed so they add up to ``total``."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(np.clip(rng.lognormal(math.log(median), sigma), low, high))
        lengths.append(min(n, total - sum(lengths)))
    return tuple(lengths)


def _square(grid, s, d, h, causal, hkv=None, **kw):
    return Workload(grid, TOKENS_PER_BATCH // s, s, s, h, hkv or h, d, causal, **kw)


def _grid_standard():
    return [_square("standard", s, d, h, c)
            for d, h in ((64, 32), (128, 16), (256, 8))
            for c in (False, True)
            for s in (512, 1024, 2048, 4096, 8192, 16384)]


def _grid_small():
    return [_square("small", s, 128, 16, c) for c in (False, True) for s in (1024, 4096)]


def _grid_gqa():
    return [_square("gqa", s, 128, 32, c, hkv=hkv)
            for hkv in (8, 1) for c in (False, True) for s in (1024, 4096, 8192, 16384)]


def _packed(mix: str, seed: int, hq: int, hkv: int, d: int) -> Workload:
    median, sigma, low, high = LENGTH_MIXES[mix]
    lengths = packed_lengths(TOKENS_PER_BATCH, seed=seed, median=median, sigma=sigma, low=low, high=high)
    return Workload("varlen", len(lengths), max(lengths), max(lengths), hq, hkv, d, True, seqlens=lengths,
                    mix=mix)


def _grid_varlen():
    """Packed 16k-token batches, causal per document: SFT-like lengths with MHA, GQA 32/8 and
    a 7:1 GQA at D=64; long-tailed lengths (longest documents 7k / 5k) with MHA and GQA."""
    return [_packed("sft", 0, 16, 16, 128), _packed("sft", 1, 32, 8, 128), _packed("sft", 2, 14, 2, 64),
            _packed("longtail", 1, 16, 16, 128), _packed("longtail", 2, 32, 8, 128)]


def _grid_decode():
    """One new token per sequence over a KV cache, GQA 32/8: a small batch over long caches, and
    a serving-sized batch (64) whose B x Hq query heads are many waves of SMs."""
    return ([Workload("decode", 4, 1, sk, 32, 8, 128, True, modes=("fwd",))
             for sk in (4096, 16384, 65536, 131072)]
            + [Workload("decode", 64, 1, sk, 32, 8, 128, True, modes=("fwd",))
               for sk in (4096, 16384)])


def _grid_window():
    """A 4k causal sliding window (Mistral-style), MHA and GQA 32/8."""
    return [_square("window", s, 128, h, True, hkv=hkv, window_left=4095, window_right=0)
            for h, hkv in ((16, 16), (32, 8)) for s in (8192, 16384)]


def _grid_wide():
    """The wide head dims, where the CUDA backward splits the head dim between its consumers:
    D=192 MHA 16/16 and D=256 GQA 16/8 (Gemma-2-9B's attention shape), 4k and 16k."""
    return [_square("wide", s, d, 16, c, hkv=hkv)
            for d, hkv in ((192, 16), (256, 8)) for c in (False, True) for s in (4096, 16384)]


def _grid_cpu():
    """Tiny shapes for a machine without a GPU: checks the pipeline, not the kernels' speed."""
    return [
        Workload("cpu", 2, 128, 128, 4, 4, 64, False),
        Workload("cpu", 2, 256, 256, 4, 4, 64, False),
        Workload("cpu", 2, 128, 128, 4, 4, 64, True),
        Workload("cpu", 2, 256, 256, 4, 4, 64, True),
        Workload("cpu", 2, 64, 192, 4, 2, 64, True),
        Workload("cpu", 3, 113, 113, 4, 2, 64, True, seqlens=(37, 113, 90), mix="docs"),
    ]


GRIDS = {
    "standard": _grid_standard,
    "small": _grid_small,
    "gqa": _grid_gqa,
    "varlen": _grid_varlen,
    "decode": _grid_decode,
    "window": _grid_window,
    "wide": _grid_wide,
    "cpu": _grid_cpu,
}
GPU_GRIDS = ("standard", "small", "gqa", "varlen", "decode", "window", "wide")
ALL_GRIDS = tuple(g for g in GPU_GRIDS if g != "small")  # what "all" means: every table of a full run


def grid_names(spec) -> list[str]:
    """Grid names from ``"all"``, ``"gqa,varlen"`` or a list of such; raises ValueError on an
    unknown name."""
    parts = [spec] if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for part in parts:
        for name in filter(None, (p.strip() for p in part.split(","))):
            if name != "all" and name not in GRIDS:
                raise ValueError(f"grid: {name!r} is not one of {', '.join([*GRIDS, 'all'])}")
            names += ALL_GRIDS if name == "all" else [name]
    return list(dict.fromkeys(names))


def grid_workloads(name, *, seqlens=None, head_dims=None, match=None) -> list[Workload]:
    """The workloads of grid ``name`` (a name, ``"all"`` = ``ALL_GRIDS``, or several
    comma-separated), optionally restricted to the given key sequence lengths (``Sk``), head
    dims, and names matching the regular expression ``match``."""
    out = [w for n in grid_names(name) for w in GRIDS[n]()]
    if seqlens:
        out = [w for w in out if w.seqlen_k in seqlens]
    if head_dims:
        out = [w for w in out if w.head_dim in head_dims]
    if match:
        out = [w for w in out if re.search(match, w.name)]
    return out


@dataclasses.dataclass
class Inputs:
    """One random input set in the canonical layout: batched q ``(B, Sq, Hq, D)``,
    k/v ``(B, Sk, Hkv, D)``; varlen q/k/v ``(T, H, D)`` with int32 ``cu_seqlens``."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v))


def make_inputs(w: Workload, *, device, dtype, seed: int) -> Inputs:
    """Fresh standard-normal q, k, v (never zeros) from a generator seeded with ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if w.varlen:
        total = w.total_tokens_q
        cu = torch.tensor([0, *np.cumsum(w.seqlens).tolist()], dtype=torch.int32, device=device)
        return Inputs(randn(total, w.heads_q, w.head_dim), randn(total, w.heads_kv, w.head_dim),
                      randn(total, w.heads_kv, w.head_dim), cu)
    return Inputs(randn(w.batch, w.seqlen_q, w.heads_q, w.head_dim),
                  randn(w.batch, w.seqlen_k, w.heads_kv, w.head_dim),
                  randn(w.batch, w.seqlen_k, w.heads_kv, w.head_dim))
