"""Benchmarks for ``kernels benchmark``: time the published kernel on a few workloads.

    kernels benchmark flash-attn-hub/flash-attn@v3      # the kernel on the Hub, branch v3
    kernels benchmark ./                                # a checkout holding build/

The runner loads the kernel itself (``self.kernel``), calls ``setup_<name>``, compares
``self.out`` after ``benchmark_<name>`` with the tensor ``verify_<name>`` returns
(``torch.allclose(atol=1e-2)``), then times ``benchmark_<name>``.

This script runs from a Hub snapshot, where only torch and kernels exist, so the expected
values come from PyTorch's math SDPA in float32 (bottom-right aligned causal mask, GQA by
head index), not from the repository's test oracle. Inputs are fp16: with the runner's
absolute tolerance, bf16 rounding alone (1/128 relative) would fail outputs above ~1.
The project's own benchmark with peers, FLOP rates and plots is
``python -m flash_attn_hub bench``.
"""

from __future__ import annotations

import dataclasses

import torch
from kernels.benchmark import Benchmark

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


def _reference(q, k, v, causal: bool) -> torch.Tensor:
    """``(B, S, H, D)`` attention in float32 through PyTorch's math SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    sq, sk = q.shape[1], k.shape[1]
    mask = causal_lower_right(sq, sk) if causal and sq != sk else None
    qt, kt, vt = (t.float().transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, is_causal=causal and sq == sk, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


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
            longest = max(s.seqlens)
            result = self.kernel.flash_attn_varlen_func(q, k, v, self.cu_seqlens, self.cu_seqlens, longest, longest,
                                                        causal=s.causal)
        else:
            result = self.kernel.flash_attn_func(q, k, v, causal=s.causal)
        return result[0] if isinstance(result, tuple) else result

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
