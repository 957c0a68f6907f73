"""The CPU backend (`_cpu.forward` / `_cpu.backward`) against the float64 reference.

The backend is called directly, as the dispatcher does: destination tensors poisoned with NaN,
an `AttnParams` already normalised. Every comparison uses the tolerance rule
(`assert_close_to_reference`): our error against float64 must stay within twice PyTorch's own
error in the input dtype.

The feature matrix is covered pairwise (`COVERING`, built greedily from the factor table below,
then topped up with random cases), plus targeted tests: chunking keeps memory bounded, the band
skips chunks, fully masked rows, the dropout keep-mask bit for bit, determinism.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import (assert_each_close, assert_matches_reference, built_or_source_package,
                     make_sequences_qkv, random_tensor, reference_kwargs, reference_results,
                     run_backward, run_forward, submodule)
from flash_attn_hub.reference import dropout_keep_mask


@pytest.fixture(scope="module")
def package(request):
    return built_or_source_package(request)


@pytest.fixture(scope="module")
def cpu(package):
    return submodule(package, "_cpu")


@pytest.fixture(scope="module")
def attn_params(package):
    return submodule(package, "_params").AttnParams


def shrink_chunks(monkeypatch, cpu, *, keys=24, queries=10):
    """Tiny, unaligned chunks so small problems cross many chunk and band boundaries."""
    monkeypatch.setattr(cpu, "KEY_CHUNK", keys)
    monkeypatch.setattr(cpu, "QUERY_CHUNK_MIN", queries)
    monkeypatch.setattr(cpu, "QUERY_CHUNK_MAX", queries)


# ---------------------------------------------------------------------------------------------
# One case: inputs, a call of the backend, the reference in float64 and in the input dtype.
# ---------------------------------------------------------------------------------------------

HEADS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (4, 1)}
MASKS = {  # name -> (causal, window_left, window_right) as the user passes them
    "full": (False, -1, -1),
    "causal": (True, -1, -1),
    "window": (False, 17, 4),
    "left": (False, 9, -1),
    "causal_window": (True, 23, -1),
}


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.bfloat16
    head_dim: int = 64
    heads: str = "mha"
    mask: str = "full"
    softcap: float = 0.0
    alibi: str = "none"  # none | h: (Hq,) | bh: (B, Hq)
    sinks: bool = False
    layout: str = "contig"  # contig | strided | varlen | varlen_strided
    dropout_p: float = 0.0
    sizes: tuple = (17, 17)  # (Sq, Sk); varlen adds empty and length-1 sequences
    chunks: str = "small"  # small: shrink_chunks; default: the module's own sizes

    def __str__(self):
        parts = [str(self.dtype).removeprefix("torch."), f"d{self.head_dim}", self.heads,
                 self.mask, self.layout, f"{self.sizes[0]}x{self.sizes[1]}", self.chunks]
        if self.softcap:
            parts.append("softcap")
        if self.alibi != "none":
            parts.append(f"alibi_{self.alibi}")
        if self.sinks:
            parts.append("sinks")
        if self.dropout_p:
            parts.append("dropout")
        return "-".join(parts)

    @property
    def varlen(self):
        return self.layout.startswith("varlen")

    @property
    def strided(self):
        return self.layout.endswith("strided")

    def seqlens(self):
        """(Sq, Sk) of each sequence: batched B=2; varlen mixes in empty and length-1 ones."""
        sq, sk = self.sizes
        if not self.varlen:
            return [(sq, sk)] * 2
        return [(sq, sk), (0, 5), (1, 1), (6, 0), (sk % 37 + 2, sq % 29 + 1)]


def make_inputs(case: Case, seed: int = 0):
    """Strided: q and dout transposed, K and V views of one kv-packed tensor."""
    torch.manual_seed(seed)
    hq, hkv = HEADS[case.heads]
    seqlens = case.seqlens()
    q, k, v, cu_q, cu_k, max_q, max_k = make_sequences_qkv(
        seqlens, hq, hkv, case.head_dim, varlen=case.varlen, dtype=case.dtype,
        transposed=case.strided, kv_layout="packed" if case.strided else "contiguous")
    dout = random_tensor(q.shape, dtype=case.dtype,
                         layout="transposed" if case.strided else "contiguous")
    batch = len(seqlens)
    slopes = {"none": None, "h": torch.rand(hq) * 0.2,
              "bh": torch.rand(batch, hq) * 0.2}[case.alibi]
    s_aux = torch.randn(hq) if case.sinks else None
    return dict(q=q, k=k, v=v, dout=dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                alibi_slopes=slopes, s_aux=s_aux, max_seqlen_q=max_q, max_seqlen_k=max_k)


def make_params(attn_params, case: Case, inputs, *, seed=0x5EED_0000_1234):
    causal, left, right = MASKS[case.mask]
    return attn_params(
        softmax_scale=case.head_dim ** -0.5, causal=causal, window_left=left,
        window_right=0 if causal else right, softcap=case.softcap, dropout_p=case.dropout_p,
        seed=seed, deterministic=True, max_seqlen_q=inputs["max_seqlen_q"],
        max_seqlen_k=inputs["max_seqlen_k"])


CALL = ("cu_seqlens_q", "cu_seqlens_k", "s_aux", "alibi_slopes")  # launcher keywords


def run_backend(cpu, inputs, params, *, backward=True):
    """forward (+ backward) into NaN-poisoned destinations; returns the written tensors."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    call = {name: inputs[name] for name in CALL}
    out, lse = run_forward(cpu, q, k, v, params=params, **call)
    result = dict(out=out, lse=lse)
    if backward:
        result.update(run_backward(cpu, inputs["dout"], q, k, v, out, lse, params=params, **call))
    return result


def check_case(cpu, attn_params, case: Case, seed: int = 0, device: str = "cpu"):
    inputs = make_inputs(case, seed)
    params = make_params(attn_params, case, inputs)
    on_device = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in inputs.items()}
    ours = {n: x.cpu() for n, x in run_backend(cpu, on_device, params).items()}
    reference = dict(reference_kwargs(params), alibi_slopes=inputs["alibi_slopes"],
                     cu_seqlens_q=inputs["cu_seqlens_q"], cu_seqlens_k=inputs["cu_seqlens_k"],
                     dout=inputs["dout"], s_aux=inputs["s_aux"])
    qkv = inputs["q"], inputs["k"], inputs["v"]
    assert_each_close(ours, reference_results(*qkv, dtype=torch.float64, **reference),
                      reference_results(*qkv, dtype=case.dtype, **reference), label=str(case))
    return ours


# ---------------------------------------------------------------------------------------------
# The covering set: every pair of factor levels appears in at least one case.
# ---------------------------------------------------------------------------------------------

FACTORS = {
    "dtype": [torch.float16, torch.bfloat16],
    "head_dim": [32, 64, 80, 128, 256],
    "heads": list(HEADS),
    "mask": list(MASKS),
    "softcap": [0.0, 3.0],
    "alibi": ["none", "h", "bh"],
    "sinks": [False, True],
    "layout": ["contig", "strided", "varlen", "varlen_strided"],
    "dropout_p": [0.0, 0.17],
    "sizes": [(1, 3), (1, 239), (17, 17), (113, 239), (239, 113), (64, 17)],
    "chunks": ["small", "default"],
}
COVERING_SIZE = 84


def _covering_cases(size: int, seed: int = 2024):
    """Greedy pairwise covering of FACTORS (each step keeps the random candidate that covers
    the most uncovered pairs), topped up with random cases to ``size``."""
    rng = random.Random(seed)
    names = list(FACTORS)
    uncovered = {((a, x), (b, y))
                 for a, b in itertools.combinations(names, 2)
                 for x in range(len(FACTORS[a])) for y in range(len(FACTORS[b]))}

    def pairs(levels):
        return {((a, levels[a]), (b, levels[b])) for a, b in itertools.combinations(names, 2)}

    chosen = []
    while uncovered or len(chosen) < size:
        candidates = [{n: rng.randrange(len(FACTORS[n])) for n in names} for _ in range(64)]
        best = max(candidates, key=lambda c: len(pairs(c) & uncovered))
        uncovered -= pairs(best)
        chosen.append(Case(**{n: FACTORS[n][best[n]] for n in names}))
    return chosen


COVERING = _covering_cases(COVERING_SIZE)
KERNELS_CI_CASES = 6


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.kernels_ci) if i < KERNELS_CI_CASES else c
    for i, c in enumerate(COVERING)], ids=str)
def test_covering(cpu, attn_params, case, monkeypatch):
    if case.chunks == "small":
        shrink_chunks(monkeypatch, cpu)
    check_case(cpu, attn_params, case)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("head_dim", [8, 24, 256])
def test_head_dims(cpu, attn_params, head_dim, monkeypatch):
    shrink_chunks(monkeypatch, cpu)
    check_case(cpu, attn_params, Case(head_dim=head_dim, heads="gqa4", mask="causal",
                                      sizes=(33, 47), dtype=torch.float16))


@pytest.mark.parametrize("sizes", [(1, 1023), (5, 1023)])
@pytest.mark.parametrize("mask", ["causal", "window", "full"])
def test_decode(cpu, attn_params, sizes, mask):
    """Sq << Sk with the default chunk sizes: the band starts far into the keys."""
    check_case(cpu, attn_params, Case(sizes=sizes, mask=mask, heads="gqa4", sinks=True,
                                      chunks="default"))


# ---------------------------------------------------------------------------------------------
# Targeted tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.kernels_ci
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("layout", ["contig", "varlen"])
def test_fully_masked_rows(cpu, attn_params, sinks, layout, monkeypatch):
    """Causal with Sq > Sk: the first Sq - Sk rows see no key (varlen adds Sk = 0)."""
    shrink_chunks(monkeypatch, cpu)
    case = Case(sizes=(40, 8), mask="causal", sinks=sinks, layout=layout, heads="gqa4",
                dropout_p=0.1, alibi="h", softcap=3.0)
    inputs = make_inputs(case)
    ours = check_case(cpu, attn_params, case)
    for name, value in ours.items():
        assert torch.isfinite(value[~torch.isinf(value)]).all(), name
    if layout == "contig":
        hidden = slice(0, 32)
        assert (ours["out"][:, hidden] == 0).all()
        assert (ours["dq"][:, hidden] == 0).all()
        expected = (inputs["s_aux"][None, :, None].expand(2, -1, 32) if sinks
                    else torch.full((2, 8, 32), -math.inf))
        assert torch.equal(ours["lse"][:, :, hidden], expected)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces, and how many matmuls run."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.mm):
            self.matmuls += 1
        for x in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(x, torch.Tensor):
                self.max_numel = max(self.max_numel, x.numel())
        return result


def test_long_sequence_is_chunked(cpu, attn_params):
    """Sq = Sk = 1024: no op output comes near the (B, Hq, Sq, Sk) score matrix, and the
    forward still matches the reference (checked on the last rows: with no mask, rows do not
    depend on Sq)."""
    case = Case(sizes=(1024, 1024), heads="mha", head_dim=32, chunks="default",
                dtype=torch.float16)
    inputs = make_inputs(case)
    inputs = {n: (x[:1] if n in ("q", "k", "v", "dout") else x) for n, x in inputs.items()}
    params = make_params(attn_params, case, inputs)
    with _LargestTensor() as probe:
        ours = run_backend(cpu, inputs, params)
    score_matrix = inputs["q"].shape[0] * 4 * 1024 * 1024
    assert probe.max_numel <= score_matrix // 8, (probe.max_numel, score_matrix)
    assert all(torch.isfinite(x).all() for x in ours.values())
    tail = slice(-128, None)
    assert_matches_reference({"out": ours["out"][:, tail], "lse": ours["lse"][..., tail]},
                             inputs["q"][:, tail], inputs["k"], inputs["v"])


@pytest.mark.kernels_ci
def test_band_skips_chunks(cpu, attn_params, monkeypatch):
    """A 32-key window over 1024 keys computes a few key chunks per query chunk, not all."""
    monkeypatch.setattr(cpu, "KEY_CHUNK", 64)
    monkeypatch.setattr(cpu, "QUERY_CHUNK_MIN", 64)
    monkeypatch.setattr(cpu, "QUERY_CHUNK_MAX", 64)
    counts = {}
    for mask in ("full", "causal_window"):
        case = Case(sizes=(1024, 1024), mask=mask, head_dim=32, chunks="default")
        inputs = make_inputs(case)
        params = make_params(attn_params, case, inputs)
        if params.causal:
            params = dataclasses.replace(params, window_left=32)
        with _LargestTensor() as probe:
            run_backend(cpu, inputs, params, backward=False)
        counts[mask] = probe.matmuls
    # 16 query chunks x 16 key chunks x 2 matmuls, against 16 x 2 (band of 64 + 32 keys) x 2.
    assert counts["full"] == 16 * 16 * 2
    assert counts["causal_window"] <= 16 * 2 * 2


@pytest.mark.kernels_ci
@pytest.mark.parametrize("seed", [0, 2**40 + 7, 2**64 - 1])
@pytest.mark.parametrize("layout", ["contig", "varlen"])
def test_dropout_keep_mask_bitwise(cpu, attn_params, seed, layout, monkeypatch):
    """q = 0 makes attention uniform and V = identity puts key j in output channel j, so
    ``out != 0`` is exactly the keep-mask: it must equal `reference.dropout_keep_mask`."""
    shrink_chunks(monkeypatch, cpu)
    p, head_dim = 0.3, 64
    case = Case(sizes=(37, 64), heads="gqa4", dtype=torch.float16, layout=layout,
                head_dim=head_dim, dropout_p=p)
    inputs = make_inputs(case)
    inputs["q"].zero_()
    seqlens = case.seqlens()
    if case.varlen:
        inputs["v"].zero_()
        start = 0
        for _, sk in seqlens:
            inputs["v"][start:start + sk, :, :sk] = torch.eye(sk, dtype=case.dtype)[:, None]
            start += sk
    else:
        inputs["v"].copy_(torch.eye(64, head_dim, dtype=case.dtype)[None, :, None])
    params = make_params(attn_params, case, inputs, seed=seed)
    ours = run_backend(cpu, inputs, params, backward=False)["out"]
    hq = HEADS[case.heads][0]
    q_start = 0
    for b, (sq, sk) in enumerate(seqlens):
        out_b = ours[q_start:q_start + sq] if case.varlen else ours[b]
        q_start += sq
        for h in range(hq):
            keep = dropout_keep_mask(seed, b, h, hq, sq, sk, p)
            assert torch.equal(out_b[:, h, :sk] != 0, keep), (b, h)
            assert (out_b[:, h, sk:] == 0).all()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("layout", ["contig", "varlen"])
def test_deterministic(cpu, attn_params, layout, monkeypatch):
    """Two runs give bitwise identical outputs and gradients."""
    shrink_chunks(monkeypatch, cpu)
    case = Case(sizes=(57, 71), heads="gqa4", mask="window", softcap=3.0, alibi="bh",
                sinks=True, dropout_p=0.2, layout=layout)
    inputs = make_inputs(case)
    params = make_params(attn_params, case, inputs)
    first = run_backend(cpu, inputs, params)
    second = run_backend(cpu, inputs, params)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["strided", "varlen"])
def test_cuda_tensors(cpu, attn_params, layout, monkeypatch):
    """The backend is torch ops only, so it serves CUDA tensors too (the dispatcher's exact
    fallback there)."""
    shrink_chunks(monkeypatch, cpu)
    check_case(cpu, attn_params, Case(sizes=(113, 239), heads="gqa4", mask="causal_window",
                                      softcap=3.0, alibi="bh", sinks=True, dropout_p=0.17,
                                      layout=layout), device="cuda")
