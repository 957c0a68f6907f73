"""Benchmarks for ``kernels benchmark``: time the published kernel on a few workloads.

    kernels benchmark flash-attn-hub/flash-attn@v3      # the kernel on the Hub, branch v3
    kernels benchmark ./                                # a checkout holding build/

The runner loads the kernel itself (``self.kernel``), calls ``setup_<name>``, compares
``self.out`` after ``benchmark_<name>`` with the tensor ``verify_<name>`` returns
(``torch.allclose(atol=1e-2)``), then times ``benchmark_<name>``.

This script is part of what a kernel repository serves: it runs from a Hub snapshot, where
only torch and kernels exist, so it stands alone (the runner does the timing) and its
expected values come from PyTorch's math SDPA in float32 (bottom-right aligned causal mask,
GQA by head index), not from the repository's oracle. Inputs are fp16: with the runner's
absolute tolerance, bf16 rounding alone (1/128 relative) would fail outputs above ~1.
The project's own benchmark with peers, FLOP rates and plots is
``python -m flash_attn_hub bench`` (the repository's tooling, never shipped).
"""

from __future__ import annotations

import dataclasses

import torch
from kernels.benchmark import Benchmark
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

DTYPE = torch.float16


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool = False
    seqlens: tuple[int, ...] | None = None  # varlen: packed document lengths
    backward: bool = False  # time forward + backward; compare dK (the GQA reduction)


def _cpu(shape: Shape) -> Shape:
    """The same kind of problem, small enough for a CPU."""
    if shape.seqlens:
        return dataclasses.replace(shape, seqlens=(17, 64, 40), heads_q=min(shape.heads_q, 4),
                                   heads_kv=min(shape.heads_kv, 2), head_dim=64)
    return dataclasses.replace(shape, batch=1, seqlen_q=min(shape.seqlen_q, 128), seqlen_k=min(shape.seqlen_k, 256),
                               heads_q=4, heads_kv=max(1, 4 * shape.heads_kv // shape.heads_q), head_dim=64)


def flash_attn_forward(module, q, k, v, *, causal: bool, window_size=(-1, -1), cu_seqlens=None,
                       max_seqlen: int | None = None) -> torch.Tensor:
    """One call of a flash-attn 2 style API (ours, flash-attn 2, FlashAttention-3 share it):
    batched ``(B, S, H, D)``, or packed ``(T, H, D)`` with ``cu_seqlens`` (the same for q and
    k) and ``max_seqlen``. Returns the output (these APIs may return a tuple starting with it)."""
    kwargs = dict(causal=causal, window_size=window_size)
    if cu_seqlens is not None:
        result = module.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    else:
        result = module.flash_attn_func(q, k, v, **kwargs)
    return result[0] if isinstance(result, (tuple, list)) else result


def sdpa_forward(q, k, v, *, causal: bool, attn_mask=None) -> torch.Tensor:
    """``scaled_dot_product_attention`` on flash-attn's ``(B, S, H, D)`` layout, with
    flash-attn's semantics: GQA through ``enable_gqa``, causal bottom-right aligned
    (``is_causal`` for a square score matrix, ``causal_lower_right`` otherwise; a single
    query sees every key). A dense boolean ``attn_mask`` replaces the causal mask."""
    sq, sk = q.shape[1], k.shape[1]
    is_causal = False
    if attn_mask is None and causal:
        if sq == sk:
            is_causal = True
        elif sq > 1:
            attn_mask = causal_lower_right(sq, sk)
    gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, is_causal=is_causal, **gqa)
    return out.transpose(1, 2)


def _reference(q, k, v, causal: bool) -> torch.Tensor:
    """``(B, S, H, D)`` attention in float32 through PyTorch's math SDPA."""
    with sdpa_kernel([SDPBackend.MATH]):
        return sdpa_forward(q.float(), k.float(), v.float(), causal=causal)


class _Attention:
    """Shared setup / run / reference for the benchmark classes below (not a Benchmark
    itself: the runner would look for workloads in it)."""

    def _setup(self, shape: Shape) -> None:
        if self.device == "cpu":
            shape = _cpu(shape)
        self.shape = shape
        if shape.seqlens:
            total = sum(shape.seqlens)
            dims_q, dims_kv = (total, shape.heads_q, shape.head_dim), (total, shape.heads_kv, shape.head_dim)
            cu = [0]
            for n in shape.seqlens:
                cu.append(cu[-1] + n)
            self.cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=self.device)
        else:
            dims_q = (shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim)
            dims_kv = (shape.batch, shape.seqlen_k, shape.heads_kv, shape.head_dim)
        grad = shape.backward
        self.q = torch.randn(dims_q, device=self.device, dtype=DTYPE, requires_grad=grad)
        self.k = torch.randn(dims_kv, device=self.device, dtype=DTYPE, requires_grad=grad)
        self.v = torch.randn(dims_kv, device=self.device, dtype=DTYPE, requires_grad=grad)
        self.dout = 0.1 * torch.randn(dims_q, device=self.device, dtype=DTYPE) if grad else None
        self.out = torch.empty(dims_q, device=self.device, dtype=DTYPE)

    def _forward(self, q, k, v):
        s = self.shape
        if s.seqlens:
            return flash_attn_forward(self.kernel, q, k, v, causal=s.causal, cu_seqlens=self.cu_seqlens,
                                      max_seqlen=max(s.seqlens))
        return flash_attn_forward(self.kernel, q, k, v, causal=s.causal)

    def _run(self) -> None:
        if not self.shape.backward:
            with torch.no_grad():
                self.out = self._forward(self.q, self.k, self.v)
            return
        self.k.grad = None
        self._forward(self.q, self.k, self.v).backward(self.dout)
        self.out = self.k.grad

    def _expected(self) -> torch.Tensor:
        s = self.shape
        leaves = [t.detach().float().requires_grad_(s.backward) for t in (self.q, self.k, self.v)]
        with torch.enable_grad():
            if s.seqlens:
                cu = self.cu_seqlens.tolist()
                out = torch.cat([_reference(*(t[a:b][None] for t in leaves), s.causal)[0]
                                 for a, b in zip(cu, cu[1:])])
            else:
                out = _reference(*leaves, s.causal)
            if not s.backward:
                return out.detach().to(DTYPE)
            (dk,) = torch.autograd.grad(out, [leaves[1]], self.dout.float())
        return dk.to(DTYPE)


def workloads(**shapes: Shape):
    """Class decorator: ``setup_<name>``, ``benchmark_<name>``, ``verify_<name>`` per shape."""
    def add(cls):
        for name, shape in shapes.items():
            setattr(cls, f"setup_{name}", lambda self, shape=shape: self._setup(shape))
            setattr(cls, f"benchmark_{name}", lambda self: self._run())
            setattr(cls, f"verify_{name}", lambda self: self._expected())
        return cls
    return add


@workloads(
    s1k_d64=Shape(16, 1024, 1024, 32, 32, 64),
    s4k_d128=Shape(4, 4096, 4096, 16, 16, 128),
    s2k_d256=Shape(8, 2048, 2048, 8, 8, 256),
)
class FlashAttentionBenchmark(_Attention, Benchmark):
    seed = 42


@workloads(
    s1k_d64=Shape(16, 1024, 1024, 32, 32, 64, causal=True),
    s4k_d128=Shape(4, 4096, 4096, 16, 16, 128, causal=True),
    s2k_d256=Shape(8, 2048, 2048, 8, 8, 256, causal=True),
)
class FlashAttentionCausalBenchmark(_Attention, Benchmark):
    seed = 42


@workloads(
    gqa_s4k=Shape(4, 4096, 4096, 32, 8, 128, causal=True),
    mqa_s4k=Shape(4, 4096, 4096, 32, 1, 128, causal=True),
    decode_s16k=Shape(4, 1, 16384, 32, 8, 128, causal=True),
)
class FlashAttentionGQABenchmark(_Attention, Benchmark):
    seed = 42


@workloads(
    packed_16k=Shape(0, 0, 0, 16, 16, 128, causal=True,
                     seqlens=(1843, 312, 4096, 97, 2210, 640, 1500, 35, 3020, 911, 1720)),
    packed_16k_gqa=Shape(0, 0, 0, 32, 8, 128, causal=True,
                         seqlens=(512, 3801, 128, 2048, 77, 1290, 4096, 980, 2451, 1001)),
)
class FlashAttentionVarlenBenchmark(_Attention, Benchmark):
    seed = 42


@workloads(
    gqa_s2k=Shape(4, 2048, 2048, 32, 8, 128, causal=True, backward=True),
    mqa_s2k=Shape(4, 2048, 2048, 32, 1, 128, causal=True, backward=True),
    packed_gqa=Shape(0, 0, 0, 14, 2, 64, causal=True, backward=True, seqlens=(700, 1500, 64, 3000, 900, 2028)),
)
class FlashAttentionBackwardBenchmark(_Attention, Benchmark):
    """Forward + backward; the compared tensor is dK, which GQA/MQA reduce over the
    query heads of each group (the reduction that broke in kernels-community #1085)."""
    seed = 42
