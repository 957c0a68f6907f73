"""What the benchmark measures: workloads, grids, FLOP counting and inputs. The one
workload definition and the one FLOP rule of the tooling (``bench`` and ``tune`` use both).

Glossary:
  B       batch size (varlen: number of packed documents)
  Sq, Sk  query / key sequence lengths (varlen: the longest document)
  Hq, Hkv query / key-value heads (GQA: Hq % Hkv == 0; MQA: Hkv == 1)
  D       head dimension
  window  (left, right) band around the bottom-right aligned diagonal, -1 = unbounded;
          causal forces right = 0
  softcap logit soft-capping (Gemma 2): each scaled score s becomes softcap * tanh(s / softcap)
          before the mask and the softmax; 0 = off
  mode    "fwd", "bwd" (backward only, forward graph built outside the timed region),
          "fwd_bwd" (both: a training step's attention)
  kv_cache  a decode step of ``flash_attn_with_kvcache``: Sq new queries (1, or a few for
          multi-token decode) over a cache holding Sk keys per sequence, nothing appended
  page    kv_cache: the cache's page size (blocks in shuffled order, as a long-running server
          leaves them); 0 = a contiguous ``(B, Sk, Hkv, D)`` cache

FLOPs, the way FlashAttention's papers, Triton's tutorial and tritonbench count: forward
``4 * B * Hq * Sq * Sk * D``, halved for a causal square (Sq == Sk) score matrix; every other
masked case (causal with Sq != Sk, sliding windows, packed documents) counts the visible
(query, key) pairs exactly. Backward is 2.5x the forward, forward+backward 3.5x. GQA counts
query heads. Soft-capping adds a ``tanh`` per score and no matmul, so a softcap cell counts
the FLOPs of the same cell without it: its TFLOP/s drop is what the cap costs. Every grid but
decode and kvcache holds 16k tokens per batch (B = 16384 / S).
A kv-cache decode step is memory-bound: what counts there is the K and V bytes it must read
(:attr:`Workload.cache_elements`), per second.
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
    softcap: float = 0.0  # > 0: scores capped as softcap * tanh(s / softcap) (flash-attn's softcap)
    seqlens: tuple[int, ...] | None = None  # varlen: document lengths (q and k alike)
    mix: str = ""  # varlen: the length distribution the documents were drawn from (LENGTH_MIXES)
    modes: tuple[str, ...] = MODES
    kv_cache: bool = False  # a flash_attn_with_kvcache decode step over Sk cached keys
    page_size: int = 0  # kv_cache: keys per page of a paged cache; 0 = contiguous

    @property
    def cache_layout(self) -> str:
        """``"page16"``, ``"contiguous"`` for a kv-cache workload, else ``""``."""
        if not self.kv_cache:
            return ""
        return f"page{self.page_size}" if self.page_size else "contiguous"

    @property
    def cache_elements(self) -> int:
        """K and V elements a kv-cache call must read: ``2 * B * Sk * Hkv * D``."""
        return 2 * self.batch * self.seqlen_k * self.heads_kv * self.head_dim

    @property
    def host_timed(self) -> bool:
        """Whether the eager host time per call is measured too: single-token kv-cache steps
        of one sequence over the shortest cache, where the device finishes a call long before
        the host issues the next one (on larger cells back-to-back calls wait for the GPU)."""
        return self.kv_cache and self.batch == 1 and self.seqlen_q == 1 and self.seqlen_k <= 4096

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
        if self.kv_cache:
            shape += f"-{self.cache_layout}"
        mask = "causal" if self.causal else "full"
        if self.windowed:
            mask += f"-w{self.window_left}.{self.window_size[1]}"
        if self.softcap > 0:
            mask += f"-cap{self.softcap:g}"
        return f"{self.grid}-d{self.head_dim}-{heads}-{shape}-{mask}"

    @property
    def family(self) -> str:
        """Workloads that differ only in sequence length (one line per provider in a plot)."""
        heads = f"Hq/Hkv={self.heads_q}/{self.heads_kv}"
        mix = f" {self.mix}" if self.varlen and self.mix else ""
        cache = f" {self.cache_layout} B={self.batch} Sq={self.seqlen_q}" if self.kv_cache else ""
        cap = f" softcap={self.softcap:g}" if self.softcap > 0 else ""
        return f"{self.grid}{mix} D={self.head_dim} {heads}{cache}{cap}"


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
        return seqlen_q * seqlen_k / 2.0  # the convention everyone reports
    return float(visible_pairs(seqlen_q, seqlen_k, window_left, window_right))


def attention_flops(w: Workload, mode: str = "fwd") -> float:
    """FLOPs of one call in ``mode``, counted by the rule of the module docstring."""
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


# The release grid: head dims x head shapes x masks x lengths, 16k tokens per batch. MHA 32/32,
# GQA 32/8 and Llama's 64/8 (at 8k tokens that is Llama-3-70B's B=2 training shape).
MAIN_HEADS = ((32, 32), (32, 8), (64, 8))
MAIN_HEAD_DIMS = (64, 128, 256)
MAIN_SEQLENS = (512, 1024, 4096, 8192, 16384)


def _grid_main():
    return [_square("main", s, d, hq, c, hkv=hkv)
            for d in MAIN_HEAD_DIMS for hq, hkv in MAIN_HEADS for c in (False, True) for s in MAIN_SEQLENS]


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


def _kv_step(batch, seqlen_k, heads, page_size, seqlen_q=1, grid="kvcache", head_dim=128):
    return Workload(grid, batch, seqlen_q, seqlen_k, *heads, head_dim, True, modes=("fwd",), kv_cache=True,
                    page_size=page_size)


def _kvcache_cells(quick: bool):
    """Decode steps of ``flash_attn_with_kvcache``, bf16, D=128: GQA 32/8 and Llama's 64/8, paged
    (pages of 16 and 64 keys) and contiguous caches, B 1..128 over 4k..128k cached keys (the
    runner skips cells whose K+V exceed a third of the GPU's memory); then multi-token decode
    (Sq 4/8/16, causal; speculative decoding's verification step) at GQA 32/8. ``quick``: the
    corners of the same cells, in a few minutes."""
    heads_list = [(32, 8)] if quick else [(32, 8), (64, 8)]
    pages = (16, 0) if quick else (16, 64, 0)
    batches = (1, 32) if quick else (1, 8, 32, 128)
    lengths = (4096, 32768) if quick else (4096, 32768, 131072)
    cells = [_kv_step(b, sk, heads, page) for heads in heads_list for page in pages
             for b in batches for sk in lengths]
    return cells + [_kv_step(b, sk, (32, 8), page, seqlen_q=sq) for sq in ((4, 16) if quick else (4, 8, 16))
                    for page in (16, 0) for b in (1, 8) for sk in (4096, 32768)]


def _grid_kvcache():
    return _kvcache_cells(quick=False)


def _grid_kvcache_quick():
    """A subset of ``kvcache`` (same names: a page may hold both)."""
    return _kvcache_cells(quick=True)


def _grid_window():
    """A 4k causal sliding window (Mistral-style), MHA and GQA 32/8."""
    return [_square("window", s, 128, h, True, hkv=hkv, window_left=4095, window_right=0)
            for h, hkv in ((16, 16), (32, 8)) for s in (8192, 16384)]


# Gemma 2's attention: logits capped at 50 (``attn_logit_softcapping``), GQA 2:1, global causal
# layers alternating with 4k sliding-window ones. 9B: 16/8 heads of 256; 27B: 32/16 heads of 128.
GEMMA2_SOFTCAP = 50.0
GEMMA2_HEADS = ((256, 16, 8), (128, 32, 16))  # (D, Hq, Hkv)


def _grid_softcap():
    """Gemma 2 shapes with soft-capping at 50, 16k tokens per batch: its global (causal) layers at
    4k and 8k tokens, and its local (4k sliding window) layers at 8k, where the window is narrower
    than the sequence."""
    return [_square("softcap", s, d, hq, True, hkv=hkv, softcap=GEMMA2_SOFTCAP, **window)
            for d, hq, hkv in GEMMA2_HEADS
            for s, window in ((4096, {}), (8192, {}), (8192, dict(window_left=4095, window_right=0)))]


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


def _grid_cpu_softcap():
    """The softcap grid's kinds of cells, tiny, for a machine without a GPU: no CPU peer caps
    logits (SDPA has no soft-capping, FlexAttention no CPU backward), so these check our path
    and the oracle's (verification fails when the cap is dropped), not a ratio; the ``cpu``
    grid keeps its comparison with SDPA whole."""
    return [Workload("cpu-softcap", 2, 128, 128, 4, 2, 64, True, softcap=GEMMA2_SOFTCAP),
            Workload("cpu-softcap", 2, 256, 256, 4, 2, 64, True, window_left=95, window_right=0,
                     softcap=GEMMA2_SOFTCAP),
            Workload("cpu-softcap", 3, 113, 113, 4, 2, 64, True, seqlens=(37, 113, 90), mix="docs",
                     softcap=GEMMA2_SOFTCAP)]


def _grid_cpu_kvcache():
    """The kv-cache grid's kinds of cells, tiny, for a machine without a GPU: contiguous and
    paged (pages of 16, a partial last page) caches, one and several new tokens."""
    return [_kv_step(b, sk, (4, 2), page, seqlen_q=sq, grid="cpu-kvcache", head_dim=64)
            for page in (16, 0) for b, sk, sq in ((1, 200, 1), (3, 100, 1), (2, 150, 4))]


GRIDS = {
    "main": _grid_main,
    "varlen": _grid_varlen,
    "decode": _grid_decode,
    "window": _grid_window,
    "softcap": _grid_softcap,
    "kvcache": _grid_kvcache,
    "kvcache-quick": _grid_kvcache_quick,
    "cpu": _grid_cpu,
    "cpu-softcap": _grid_cpu_softcap,
    "cpu-kvcache": _grid_cpu_kvcache,
}
ALL_GRIDS = ("main", "varlen", "decode", "window", "softcap", "kvcache")  # what "all" means: every GPU grid
CPU_GRIDS = ("cpu", "cpu-softcap", "cpu-kvcache")
CPU_STAND_INS = {"softcap": "cpu-softcap", "kvcache": "cpu-kvcache", "kvcache-quick": "cpu-kvcache"}


def cpu_stand_ins(names) -> list[str]:
    """The tiny CPU grids that stand in for ``names`` on a machine without a GPU: the
    kv-cache grids' is ``cpu-kvcache``, the softcap grid's ``cpu-softcap``, every other
    grid's ``cpu``."""
    return list(dict.fromkeys(n if n in CPU_GRIDS else CPU_STAND_INS.get(n, "cpu") for n in names))


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
    out = list({w.name: w for n in grid_names(name) for w in GRIDS[n]()}.values())  # kvcache-quick in kvcache
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
    k/v ``(B, Sk, Hkv, D)``; varlen q/k/v ``(T, H, D)`` with int32 ``cu_seqlens``; kv-cache:
    q ``(B, Sq, Hq, D)``, k/v the caches (contiguous ``(B, Sk, Hkv, D)``, or paged
    ``(num_blocks, page, Hkv, D)`` with an int32 ``block_table (B, pages)``) and int32
    ``cache_seqlens (B,)``."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v))


def make_inputs(w: Workload, *, device, dtype, seed: int) -> Inputs:
    """Fresh standard-normal q, k, v (never zeros) from a generator seeded with ``seed``, q
    spread to the cap on a softcap workload (below); a paged cache's blocks are handed out in
    a random order.

    [Note] Softcap inputs. Standard-normal q and k give scaled scores of about unit size, where
    ``50 * tanh(s / 50)`` moves them by a fraction of a percent: a provider that ignored the cap
    would pass verification. So on a softcap workload q has standard deviation ``softcap``, the
    scores spread over +-softcap where tanh bends, and an output without the cap is off by 8x
    (S=128) to 100x (S=8k) torch's own bf16 error, against a tolerance of 2x. The kernels
    compute the same tanh and exp whatever the values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q_std = w.softcap if w.softcap > 0 else 1.0

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    if w.kv_cache:
        q = randn(w.batch, w.seqlen_q, w.heads_q, w.head_dim, std=q_std)
        seqlens = torch.full((w.batch,), w.seqlen_k, dtype=torch.int32, device=device)
        if not w.page_size:
            shape = (w.batch, w.seqlen_k, w.heads_kv, w.head_dim)
            return Inputs(q, randn(*shape), randn(*shape), cache_seqlens=seqlens)
        pages = math.ceil(w.seqlen_k / w.page_size)
        table = torch.randperm(w.batch * pages, generator=gen, device=device).to(torch.int32)
        shape = (w.batch * pages, w.page_size, w.heads_kv, w.head_dim)
        return Inputs(q, randn(*shape), randn(*shape), block_table=table.view(w.batch, pages),
                      cache_seqlens=seqlens)
    if w.varlen:
        total = w.total_tokens_q
        cu = torch.tensor([0, *np.cumsum(w.seqlens).tolist()], dtype=torch.int32, device=device)
        return Inputs(randn(total, w.heads_q, w.head_dim, std=q_std), randn(total, w.heads_kv, w.head_dim),
                      randn(total, w.heads_kv, w.head_dim), cu)
    return Inputs(randn(w.batch, w.seqlen_q, w.heads_q, w.head_dim, std=q_std),
                  randn(w.batch, w.seqlen_k, w.heads_kv, w.head_dim),
                  randn(w.batch, w.seqlen_k, w.heads_kv, w.head_dim))
