"""The Hopper CUDA backward (`_cuda.backward`) against the float64 reference, on an sm90 GPU.

The backend is called directly, as the dispatcher does: gradients poisoned with NaN, an
`AttnParams` already normalised (causal => window_right == 0), out and lse from the CUDA forward.
Every gradient is held to the tolerance rule (twice PyTorch's own error in the input dtype).

Covered: bf16/fp16 x every compiled backward head dim (and head dims between them) x causal;
Sq != Sk both ways with sizes off the 64/128 tiles, Sq = 1, rows that see a single key (dS = 0:
dQ and dK held to the noise the rounding of O implies); causal, sliding windows, softcap,
sinks (with the s_aux gradient and fully masked rows); GQA ratios 1, 2, 4, 8 and MQA (dK/dV
summed over the group inside the kernel); varlen with empty and length-1 sequences; the
block-major step order with several heads per CTA; transposed
and packed strides; agreement with the Triton backward; the head-dim split above D=128 (GQA,
MQA, bands, varlen, sinks, softcap, group split, deterministic mode). CPU-only checks cover
`supports` and the launch's CTA count.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from helpers import (assert_matches_reference, backend_params, make_varlen_qkv, nan_like,
                     needs_sm90, reference_results, run_backward, run_forward, seeded_cuda_qkv,
                     sm90)
from flash_attn_hub.reference import assert_close_to_reference, attention_reference




def _check(backend, q, k, v, params, *, cu_q=None, cu_k=None, s_aux=None, label=""):
    """Forward and backward on the CUDA backend; the gradients against the reference."""
    sink = s_aux is not None
    varlen = cu_q is not None
    assert backend.supports(q, k, params, backward=True, varlen=varlen, alibi=False, sink=sink), \
        "the CUDA backend should accept this backward"
    launch = dict(params=params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, s_aux=s_aux)
    out, lse = run_forward(backend, q, k, v, **launch)
    dout = torch.randn_like(out)
    grads = run_backward(backend, dout, q, k, v, out, lse, **launch)
    torch.cuda.synchronize()
    kwargs = dict(softmax_scale=params.softmax_scale, causal=params.causal,
                  window_size=(params.window_left, params.window_right), softcap=params.softcap,
                  cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref64 = reference_results(q, k, v, dtype=torch.float64, dout=dout, s_aux=s_aux, **kwargs)
    lowp = reference_results(q, k, v, dtype=q.dtype, dout=dout, s_aux=s_aux, **kwargs)
    for name, value in grads.items():
        if name in ("dq", "dk") and not ref64[name].any():
            _assert_within_rounding_noise(name, value, q, k, v, out, dout, ref64, kwargs, label)
        else:
            assert_close_to_reference(f"{label} {name}".strip(), value, ref64[name], lowp[name])
    return grads


def _assert_bitwise_reproducible(backend, q, k, v, params, *, cu_q=None, cu_k=None):
    """Two backward runs on the same inputs (deterministic mode) give identical bits."""
    launch = dict(params=params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = run_forward(backend, q, k, v, **launch)
    dout = torch.randn_like(out)
    runs = [run_backward(backend, dout, q, k, v, out, lse, **launch) for _ in range(2)]
    for name in ("dq", "dk", "dv"):
        assert torch.equal(runs[0][name], runs[1][name]), f"{name} differs between two runs"


def _assert_within_rounding_noise(name, ours, q, k, v, out, dout, ref64, kwargs, label):
    """dQ and dK when every query sees at most one key: dS is exactly 0, so are they, and the
    relative rule has nothing to measure against. A FlashAttention backward computes
    dS = P * (dP - delta) with delta = rowsum(dO * O) from the rounded O (the only O it has)
    and both dot products in fp32, so dS keeps (1) P * (delta - delta') and (2) the fp32
    rounding of a difference of two sums of size a = rowsum(|dO| * |O|). Bound: three times the
    float64 gradient of (1), e = delta - delta', plus 2^-16 times the gradient an uncancelled
    a would give (fp32 keeps 2^-24 per term over D <= 256 terms)."""
    assert not kwargs["softcap"], "the bound ignores the softcap factor"
    f64 = [t.detach().double() for t in (q, k, v)]
    e = ((dout.double() * (ref64["out"].double() - out.double())).sum(-1))[..., None]
    a = (dout.double().abs() * out.double().abs()).sum(-1)[..., None]
    scale = kwargs["softmax_scale"]

    def through_p(weight):  # scale * (P K) * weight for dQ, scale * P^T (weight * |Q|) for dK
        if name == "dq":
            pk, _ = attention_reference(f64[0], f64[1], f64[1].abs(), dtype=torch.float64,
                                        **kwargs)
            return scale * weight * pk
        vv = f64[2].clone().requires_grad_(True)
        o, _ = attention_reference(f64[0], f64[1], vv, dtype=torch.float64, **kwargs)
        return scale * torch.autograd.grad(o, vv, weight * f64[0].abs())[0]

    noise = through_p(e.abs())
    limit = 3 * noise.norm().item() + 2 ** -16 * through_p(a).norm().item() + 1e-6
    got = ours.double().norm().item()
    assert got <= limit, f"{label} {name}: norm {got:.3e} with an exactly zero gradient; the " \
                         f"rounding of O explains {noise.norm().item():.3e}"


@pytest.mark.parametrize("seed", range(6))
def test_workspace_layout(cuda_backend, seed):
    """[Note] Backward workspaces (csrc/flash_params.h): every varlen sequence's rows start on a
    multiple of 128 (the longest step of a main kernel), its padding up to the next multiple ends
    before the next sequence starts and inside the head's rows, and ``_unpadded`` reads delta
    back from those rows in token order. CPU only: the layout is arithmetic on cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 300, (int(torch.randint(1, 7, (), generator=gen)),), generator=gen)
    lens[0] = 128 * (seed % 3)  # a sequence that fills whole blocks, or an empty one
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    heads = 3
    q = torch.empty(int(lens.sum()), heads, 64)
    rows, ws_heads = cuda_backend._workspace_rows(q, cu)
    w = cuda_backend._WORKSPACE_ALIGN
    assert w == 128 and rows % w == 0 and ws_heads == heads
    starts = [(int(cu[b]) + w * b) // w * w for b in range(len(lens))]
    ends = [start + -(-int(n) // w) * w for start, n in zip(starts, lens)]
    assert all(start % w == 0 for start in starts)
    assert all(end <= nxt for end, nxt in zip(ends, starts[1:])), (starts, ends)
    assert ends[-1] <= rows
    # delta's padded rows hold (head, sequence, row) codes; _unpadded must return them per token
    ws = torch.full((heads, rows), -1.0)
    expect = torch.empty(heads, int(lens.sum()))
    for h in range(heads):
        for b, (start, n) in enumerate(zip(starts, lens.tolist())):
            codes = torch.arange(n, dtype=torch.float32) + 1000 * b + 100000 * h
            ws[h, start:start + n] = codes
            expect[h, int(cu[b]):int(cu[b]) + n] = codes
    assert torch.equal(cuda_backend._unpadded(ws.reshape(-1), q, cu, rows), expect)
    batched = torch.empty(2, 300, heads, 64)
    assert cuda_backend._workspace_rows(batched, None) == (384, 2 * heads)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dims(cuda_backend, attn_params, dtype, d, causal):
    q, k, v = seeded_cuda_qkv(2, 257, 257, 4, 4, d, dtype, seed=d)
    _check(cuda_backend, q, k, v, backend_params(attn_params, d, causal=causal, max_q=257,
                                                 max_k=257))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("d", [8, 40, 72, 80, 112, 120, 136, 200, 248])
def test_head_dims_between_buckets(cuda_backend, attn_params, d):
    q, k, v = seeded_cuda_qkv(1, 113, 239, 2, 2, d, seed=d)
    _check(cuda_backend, q, k, v, backend_params(attn_params, d, max_q=113, max_k=239))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 239), (17, 1023), (113, 239), (1023, 113),
                                   (239, 17), (640, 640)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (17, 5), (0, 0), (64, -1)],
                         ids=["full", "causal", "band", "diag", "left"])
@pytest.mark.parametrize("d", [64, 128])  # D=64 steps over 128 query rows, D=128 over 64
def test_lengths_and_windows(cuda_backend, attn_params, sq, sk, window, d):
    q, k, v = seeded_cuda_qkv(2, sq, sk, 3, 3, d, seed=sq * 7 + sk)
    params = backend_params(attn_params, d, causal=window == (-1, 0), window=window, max_q=sq,
                            max_k=sk)
    _check(cuda_backend, q, k, v, params)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("window", [(2**40, 0), (2**32, 2**31 + 5), (-1, 2**32 + 3)],
                         ids=["causal-wide-left", "both-wide", "wide-right"])
def test_windows_wider_than_an_int(cuda_backend, attn_params, window):
    """flash-attn 2 takes any int as a window side; narrowed to the kernels' int, 2^32 + 3
    would become 3. A side wider than the sequence hides nothing, whatever its size."""
    q, k, v = seeded_cuda_qkv(2, 239, 113, 3, 3, 64, seed=11)
    _check(cuda_backend, q, k, v, backend_params(attn_params, 64, window=window, max_q=239,
                                                 max_k=113))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap(cuda_backend, attn_params, causal, d):
    q, k, v = seeded_cuda_qkv(2, 300, 300, 2, 2, d, seed=3)
    q = q * 4  # large scores, so the cap bites
    _check(cuda_backend, q, k, v,
           backend_params(attn_params, d, causal=causal, softcap=5.0, max_q=300, max_k=300))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("sq,sk", [(200, 200), (300, 100)])  # (300, 100) causal: masked rows
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks(cuda_backend, attn_params, sq, sk, causal):
    q, k, v = seeded_cuda_qkv(2, sq, sk, 4, 2, 128, seed=5)
    s_aux = torch.randn(4, device="cuda", dtype=torch.float32) * 2
    grads = _check(cuda_backend, q, k, v,
                   backend_params(attn_params, 128, causal=causal, max_q=sq, max_k=sk), s_aux=s_aux)
    assert "ds_aux" in grads


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 4), (8, 2), (16, 2), (8, 1), (6, 3)],
                         ids=["mha", "gqa2", "gqa4", "gqa8", "mqa", "gqa_odd_heads"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa(cuda_backend, attn_params, hq, hkv, causal, d):
    q, k, v = seeded_cuda_qkv(2, 200, 333, hq, hkv, d, torch.float16, seed=hq + hkv)
    _check(cuda_backend, q, k, v, backend_params(attn_params, d, causal=causal, max_q=200,
                                                 max_k=333))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case,splits", [("mqa_causal", 4), ("gqa4_band", 2), ("mqa_full", 8),
                                         ("varlen_mqa_causal", 2), ("deterministic_mqa", 4)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_group_split(cuda_backend, heuristics, attn_params, monkeypatch, case, splits, d):
    """[Note: CUDA group split]: each kv head's query heads over `splits` CTAs, adding into one
    fp32 dK/dV (stored per split and summed by the caller in deterministic mode); held to the
    reference, and bitwise reproducible in deterministic mode (the split forced, so the test
    keeps its meaning whatever the rule), at each compiled head dim (D=256's CTAs take 64 keys
    and split the head dim: csrc/hopper/bwd_traits.h)."""
    chosen = []
    monkeypatch.setattr(heuristics, "cuda_group_splits",
                        lambda *a: chosen.append(splits) or splits)
    cu_q = cu_k = None
    if case == "varlen_mqa_causal":
        torch.manual_seed(41)
        q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv([300, 0, 1, 513], [300, 7, 1, 600],
                                                            8, 1, d, device="cuda")
        params = backend_params(attn_params, d, causal=True, max_q=max_q, max_k=max_k)
    else:
        hkv = 2 if case == "gqa4_band" else 1
        window = {"mqa_causal": (-1, 0), "gqa4_band": (65, 9), "mqa_full": (-1, -1),
                  "deterministic_mqa": (-1, 0)}[case]
        q, k, v = seeded_cuda_qkv(2, 300, 413, 8, hkv, d, seed=43)
        params = backend_params(attn_params, d, causal=window == (-1, 0), window=window,
                                max_q=300, max_k=413, deterministic=case == "deterministic_mqa")
    _check(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k, label=case)
    assert chosen == [splits], "the split launch did not run"
    if params.deterministic:
        _assert_bitwise_reproducible(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", ["gqa4", "mqa", "more_queries", "varlen", "sinks_softcap"])
@pytest.mark.parametrize("d", [128, 120, 256, 200])
def test_block_major_steps(cuda_backend, heuristics, attn_params, monkeypatch, case, d):
    """[Note] Backward step order (csrc/hopper/bwd_kernel.h): at head dim 128 or 256 under a causal
    band of at most 64 key blocks, without a group split, a CTA walks its query blocks downwards
    with all its query heads on each. The split is forced to 1 so that several heads share a CTA
    (the split rule would pick more at these sizes); GQA and MQA groups, more queries than keys
    (leading rows see no key), varlen sequences of different lengths beside empty and one-token
    ones, sinks with softcap, and head dims padded to 128 and 256."""
    monkeypatch.setattr(heuristics, "cuda_group_splits", lambda *a: 1)
    torch.manual_seed(d + len(case))
    cu_q = cu_k = s_aux = None
    softcap = 0.0
    if case == "varlen":
        q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv(
            [700, 0, 1, 129, 300], [700, 3, 1, 129, 1200], 8, 2, d, device="cuda")
    else:
        hkv, sq, sk = {"gqa4": (2, 640, 1000), "mqa": (1, 500, 500),
                       "more_queries": (2, 1300, 700), "sinks_softcap": (2, 640, 640)}[case]
        q, k, v = seeded_cuda_qkv(2, sq, sk, 8, hkv, d, seed=d + sq)
        max_q, max_k = sq, sk
        if case == "sinks_softcap":
            s_aux, softcap = torch.randn(8, device="cuda"), 6.0
    params = backend_params(attn_params, d, causal=True, softcap=softcap, max_q=max_q,
                            max_k=max_k)
    _check(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k, s_aux=s_aux, label=case)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", ["gqa4_causal", "mqa_full", "gqa2_band_sinks", "varlen_gqa",
                                  "group_split_mqa", "deterministic_gqa", "deterministic_varlen"])
@pytest.mark.parametrize("d", [192, 256])
def test_head_dim_split(cuda_backend, heuristics, attn_params, monkeypatch, case, d):
    """[Note] Backward head-dim split (csrc/hopper/bwd_traits.h): both consumers on the same 64
    keys, each with half of dK's, dV's and dQ's columns, dQ added from registers. GQA and MQA
    (dK/dV summed over the group in the kernel), a band with sinks, varlen with empty and
    length-1 sequences, a forced group split, and deterministic mode (the ordered reductions:
    two runs bitwise equal)."""
    torch.manual_seed(d + len(case))
    cu_q = cu_k = s_aux = None
    deterministic = case.startswith("deterministic")
    if case in ("varlen_gqa", "deterministic_varlen"):
        q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv([0, 70, 1, 200], [9, 70, 1, 333],
                                                            8, 2, d, device="cuda")
        params = backend_params(attn_params, d, causal=case == "varlen_gqa", max_q=max_q,
                                max_k=max_k, deterministic=deterministic)
    else:
        hq, hkv, sq, sk = {"gqa4_causal": (8, 2, 200, 333), "mqa_full": (4, 1, 333, 200),
                           "gqa2_band_sinks": (4, 2, 190, 190), "group_split_mqa": (8, 1, 300, 413),
                           "deterministic_gqa": (8, 2, 400, 600)}[case]
        window = (45, 7) if case == "gqa2_band_sinks" else (-1, 0) if "causal" in case or \
            case.startswith(("group", "deterministic")) else (-1, -1)
        q, k, v = seeded_cuda_qkv(2, sq, sk, hq, hkv, d, seed=d + hq)
        params = backend_params(attn_params, d, causal=window == (-1, 0), window=window,
                                max_q=sq, max_k=sk, deterministic=deterministic)
        if case == "gqa2_band_sinks":
            s_aux = torch.randn(hq, device="cuda")
    if case == "group_split_mqa":
        chosen = []
        monkeypatch.setattr(heuristics, "cuda_group_splits", lambda *a: chosen.append(4) or 4)
    _check(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k, s_aux=s_aux, label=case)
    if case == "group_split_mqa":
        assert chosen == [4], "the split launch did not run"
    if deterministic:
        _assert_bitwise_reproducible(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (33, 7)], ids=["full", "causal", "band"])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_with_empty_sequences(cuda_backend, attn_params, window, d):
    torch.manual_seed(11)
    seq_q = [0, 17, 128, 1, 300, 5, 129]
    seq_k = [5, 0, 200, 1, 300, 0, 77]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv(seq_q, seq_k, 4, 2, d,
                                                        dtype=torch.bfloat16, device="cuda")
    s_aux = torch.randn(4, device="cuda") if window == (33, 7) else None
    params = backend_params(attn_params, d, causal=window == (-1, 0), window=window, max_q=max_q,
                     max_k=max_k)
    _check(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k, s_aux=s_aux)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("kv_layout", ["transposed", "sliced", "packed", "packed_transposed"])
def test_strided_layouts(cuda_backend, attn_params, kv_layout):
    q, k, v = seeded_cuda_qkv(2, 190, 190, 4, 2, 128, seed=13, transposed=True, kv_layout=kv_layout)
    for causal in (False, True):
        _check(cuda_backend, q, k, v, backend_params(attn_params, 128, causal=causal, max_q=190,
                                              max_k=190), label=f"{kv_layout} causal={causal}")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("d", [72, 128, 200])
def test_unaligned_out_and_dq(cuda_backend, attn_params, d):
    """The element-wise paths of the preprocess and the dQ cast ([Note] Backward preprocess and
    cast): out 8-byte but not 16-byte aligned, dq only 2-byte aligned. The gradients are held to
    the reference like every other case."""
    q, k, v = seeded_cuda_qkv(2, 190, 190, 4, 2, d, seed=29)
    params = backend_params(attn_params, d, causal=True, max_q=190, max_k=190)
    out, lse = run_forward(cuda_backend, q, k, v, params=params)
    dout = torch.randn_like(out)

    def shifted(t, elems):  # t's values in a tensor whose base is `elems` elements further on
        buf = torch.full((t.numel() + elems,), float("nan"), dtype=t.dtype, device=t.device)
        return buf[elems:].view(t.shape).copy_(t)

    out_u = shifted(out, 4)
    grads = dict(dq=shifted(nan_like(q), 1), dk=nan_like(k), dv=nan_like(v))
    assert out_u.data_ptr() % 16 == 8 and grads["dq"].data_ptr() % 4 == 2
    cuda_backend.backward(dout, q, k, v, out_u, lse, grads["dq"], grads["dk"], grads["dv"], None,
                          cu_seqlens_q=None, cu_seqlens_k=None, s_aux=None, alibi_slopes=None,
                          params=params)
    torch.cuda.synchronize()
    assert_matches_reference(grads, q, k, v, dout=dout, label=f"unaligned d={d}",
                             softmax_scale=params.softmax_scale, causal=True)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_against_triton(cuda_backend, flash_attn, attn_params, causal):
    """Same inputs through both backwards: the gradients agree to 1e-2 relative (both are held
    to the reference by the tests above; this catches a disagreement at a larger size)."""
    try:
        triton_bwd = importlib.import_module(flash_attn.__name__ + "._triton.bwd")
    except ModuleNotFoundError:
        pytest.skip("this build has no Triton backward")
    q, k, v = seeded_cuda_qkv(2, 1000, 1000, 8, 2, 128, seed=17)
    params = backend_params(attn_params, 128, causal=causal, max_q=1000, max_k=1000)
    out, lse = run_forward(cuda_backend, q, k, v, params=params)
    dout = torch.randn_like(out)
    ours = run_backward(cuda_backend, dout, q, k, v, out, lse, params=params)
    theirs = run_backward(triton_bwd, dout, q, k, v, out, lse, params=params)
    for name in ("dq", "dk", "dv"):
        err = (ours[name].float() - theirs[name].float()).norm() / theirs[name].float().norm()
        assert err < 1e-2, f"{name}: relative distance to the Triton backward {err:.2e}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", ["gqa_causal", "mqa_band", "varlen_causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_is_bitwise_reproducible(cuda_backend, attn_params, case, d):
    """deterministic=True orders the dQ reductions: the gradients match the reference and two
    runs give identical bits."""
    torch.manual_seed(29)
    cu_q = cu_k = None
    if case == "varlen_causal":
        q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv([700, 1, 0, 1300], [900, 1, 5, 1300],
                                                            8, 2, d, device="cuda")
        params = backend_params(attn_params, d, causal=True, max_q=max_q, max_k=max_k,
                                deterministic=True)
    else:
        hkv, window = (2, (-1, 0)) if case == "gqa_causal" else (1, (300, 100))
        q, k, v = seeded_cuda_qkv(2, 1500, 1700, 8, hkv, d, seed=31)
        params = backend_params(attn_params, d, causal=window == (-1, 0), window=window,
                                max_q=1500, max_k=1700, deterministic=True)
    _check(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k)  # right, first
    _assert_bitwise_reproducible(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k)


@pytest.mark.gpu
@needs_sm90
def test_no_query_head_sized_buffers(cuda_backend, heuristics, attn_params):
    """GQA 32/8: the backward allocates only its fp32 workspaces (dQ accumulator, lse2, delta,
    all q-sized or smaller): no (.., Hq, D) dK/dV. A group split ([Note: CUDA group split],
    taken here: 256 CTAs under a causal band) adds its (2, splits, *k.shape) fp32 partials,
    which its rule keeps under 2 x 4 waves of 128-key blocks whatever the length, and one
    K-sized fp32 sum."""
    q, k, v = seeded_cuda_qkv(2, 2048, 2048, 32, 8, 128, seed=1)
    params = backend_params(attn_params, 128, causal=True, max_q=2048, max_k=2048)
    out, lse = run_forward(cuda_backend, q, k, v, params=params)
    dout = torch.randn_like(out)
    grads = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    cuda_backend.backward(dout, q, k, v, out, lse, grads["dq"], grads["dk"], grads["dv"], None,
                          cu_seqlens_q=None, cu_seqlens_k=None, s_aux=None, alibi_slopes=None,
                          params=params)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    dq_acc = q.numel() * 4  # fp32, q's shape (Sq is a multiple of 128 here)
    rows = 2 * lse.numel() * 4  # lse2 and delta
    splits = heuristics.cuda_group_splits(q, k, params)
    partial = 0 if splits == 1 else (2 * splits + 1) * k.numel() * 4  # + one split sum at a time
    assert extra <= dq_acc + rows + partial + (1 << 20), f"{extra} bytes beyond the workspaces"


@pytest.mark.gpu
@pytest.mark.sanitize
@needs_sm90
def test_small_all_features_once(cuda_backend, attn_params):
    """A short run of every backward code path, sized for compute-sanitizer: varlen with an
    empty sequence, GQA, a band window, softcap and sinks at a head dim between buckets; then
    batched causal MQA with Sq != Sk; D=64's 128-row steps under varlen; the head-dim split."""
    torch.manual_seed(19)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv([0, 33, 130], [5, 33, 200], 4, 2, 80,
                                                        device="cuda")
    params = backend_params(attn_params, 80, window=(20, 3), softcap=8.0, max_q=max_q, max_k=max_k)
    _check(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k,
           s_aux=torch.randn(4, device="cuda"))
    q, k, v = seeded_cuda_qkv(2, 70, 150, 4, 1, 64, seed=23)
    _check(cuda_backend, q, k, v, backend_params(attn_params, 64, causal=True, max_q=70, max_k=150))
    # 128-row steps ([Note] dQ by query rows): varlen sequences that end inside a 128-row
    # block, next to each other in the workspaces, deterministic reductions
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv([70, 0, 200], [90, 3, 150], 4, 2, 64,
                                                        device="cuda")
    _check(cuda_backend, q, k, v, backend_params(attn_params, 64, window=(40, -1), max_q=max_q,
                                                 max_k=max_k, deterministic=True),
           cu_q=cu_q, cu_k=cu_k)
    # the head-dim split ([Note] Backward head-dim split): GQA, varlen, deterministic reductions
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv([0, 90, 1], [3, 130, 1], 4, 2, 256,
                                                        device="cuda")
    _check(cuda_backend, q, k, v, backend_params(attn_params, 256, causal=True, max_q=max_q,
                                                 max_k=max_k, deterministic=True),
           cu_q=cu_q, cu_k=cu_k)


@pytest.mark.gpu
@needs_sm90
def test_small_banded_grids_prefer_triton(heuristics, attn_params):
    """auto's preference ([Note: small banded grids]): MQA causal at 4k x 4 stays on CUDA (the
    group split fills the grid), as do GQA 32/8 causal and MQA without a mask; a causal MHA
    grid too small for any split (1 x 1k, 2 heads) goes to Triton."""
    q = torch.empty(4, 4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_mqa = torch.empty(4, 4096, 1, 128, device="cuda", dtype=torch.bfloat16)
    k_gqa = torch.empty(4, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    causal = backend_params(attn_params, 128, causal=True, max_q=4096, max_k=4096)
    full = backend_params(attn_params, 128, max_q=4096, max_k=4096)
    assert heuristics.backward_prefers_triton(q, k_mqa, causal) is None
    assert heuristics.backward_prefers_triton(q, k_mqa, full) is None
    assert heuristics.backward_prefers_triton(q, k_gqa, causal) is None
    q_small = torch.empty(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
    small_causal = backend_params(attn_params, 128, causal=True, max_q=1024, max_k=1024)
    assert heuristics.backward_prefers_triton(q_small, q_small, small_causal)


def test_group_split_counts(heuristics, attn_params, monkeypatch):
    """[Note: CUDA group split]'s choice on an H200-sized GPU (132 SMs; CPU tensors, so the SM
    count is patched): MQA 32/1 causal at 4k x 4 (128 CTAs) splits 8 ways to reach 4 CTAs per
    SM; without a mask it does not split (0.9 of a wave already); GQA 32/8 causal (1024 CTAs)
    does not; varlen counts the packed length as one sequence."""
    monkeypatch.setattr(heuristics, "sm_count", lambda device: 132)
    q = torch.empty(4, 4096, 32, 128)
    k_mqa, k_gqa = torch.empty(4, 4096, 1, 128), torch.empty(4, 4096, 8, 128)
    causal = backend_params(attn_params, 128, causal=True, max_q=4096, max_k=4096)
    full = backend_params(attn_params, 128, max_q=4096, max_k=4096)
    assert heuristics.cuda_group_splits(q, k_mqa, causal) == 8
    assert heuristics.cuda_group_splits(q, k_mqa, full) == 1
    assert heuristics.cuda_group_splits(q, k_gqa, causal) == 1
    q_var, k_var = torch.empty(8192, 32, 128), torch.empty(8192, 1, 128)
    varlen = backend_params(attn_params, 128, causal=True, max_q=4096, max_k=4096)
    assert heuristics.cuda_group_splits(q_var, k_var, varlen) == 16  # 64 CTAs -> 1024
    # above D=128 a CTA holds 64 keys ([Note] Backward head-dim split): twice the CTAs
    q256, k256 = torch.empty(4, 4096, 32, 256), torch.empty(4, 4096, 1, 256)
    assert heuristics.cuda_backward_ctas(q256, k256, causal) == 256
    assert heuristics.cuda_group_splits(q256, k256, causal) == 4  # 256 CTAs -> 1024


def test_group_split_heads_per_cta(heuristics, attn_params, monkeypatch):
    """[Note: CUDA group split]'s second rule: Llama 64/8 causal from 8k keys at D=128 (1024
    CTAs: no split by the first rule) gives each CTA 2 query heads (4 splits), at D=64 and 256
    too; not at 4k keys, not with a group of 4, not without a band, not in deterministic mode,
    not at the unmeasured D=96 and 192."""
    monkeypatch.setattr(heuristics, "sm_count", lambda device: 132)

    def splits(hq, hkv, seqlen, d=128, **kw):  # 16k tokens, as the benchmark's grid
        batch = 16384 // seqlen
        q, k = torch.empty(batch, seqlen, hq, d), torch.empty(batch, seqlen, hkv, d)
        return heuristics.cuda_group_splits(
            q, k, backend_params(attn_params, d, max_q=seqlen, max_k=seqlen, **kw))

    assert splits(64, 8, 8192, causal=True) == 4
    assert splits(64, 8, 8192, window=(1024, 0)) == 4
    assert splits(64, 8, 4096, causal=True) == 1
    assert splits(32, 8, 8192, causal=True) == 1
    assert splits(64, 8, 8192) == 1
    assert splits(64, 8, 8192, causal=True, deterministic=True) == 1
    assert splits(64, 8, 8192, d=64, causal=True) == 4
    assert splits(64, 8, 16384, d=256, causal=True) == 4
    assert splits(64, 8, 8192, d=96, causal=True) == 1
    assert splits(64, 8, 8192, d=192, causal=True) == 1


def test_banded_small_head_dims_stay_on_cuda(heuristics, attn_params):
    """A band at head dim 64 on a large grid stays on the CUDA backward (it measured faster
    than Triton once dS^T went through stmatrix); CPU tensors: the SM count is
    INTERPRETER_SM_COUNT, so only a head-dim rule could speak."""
    q64 = torch.empty(4, 4096, 32, 64)
    causal = backend_params(attn_params, 64, causal=True, max_q=4096, max_k=4096)
    window = backend_params(attn_params, 64, window=(256, 0), max_q=4096, max_k=4096)
    assert heuristics.backward_prefers_triton(q64, q64, causal) is None
    assert heuristics.backward_prefers_triton(q64, q64, window) is None


def test_supports_excludes_what_it_cannot_run(cuda_backend, attn_params):
    """CPU tensors, dropout, ALiBi and head dims above the widest compiled one go to Triton;
    deterministic mode stays. No GPU needed for the first check."""
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    base = backend_params(attn_params, 128, max_q=8, max_k=8)
    features = dict(varlen=False, alibi=False, sink=False)
    assert not cuda_backend.supports(q, q, base, backward=True, **features)  # CPU tensors
    if not sm90():
        return
    q = q.cuda()
    assert cuda_backend.supports(q, q, base, backward=True, **features)
    assert cuda_backend.supports(q, q, dataclasses.replace(base, deterministic=True),
                                 backward=True, **features)
    assert not cuda_backend.supports(q, q, dataclasses.replace(base, dropout_p=0.1),
                                     backward=True, **features)
    assert not cuda_backend.supports(q, q, base, backward=True, **{**features, "alibi": True})
    d256 = torch.zeros(1, 8, 2, 256, dtype=torch.bfloat16, device="cuda")
    assert cuda_backend.supports(d256, d256, base, backward=True, **features)
    wide = torch.zeros(1, 8, 2, 264, dtype=torch.bfloat16, device="cuda")
    assert not cuda_backend.supports(wide, wide, base, backward=True, **features)
    assert not cuda_backend.supports(wide, wide, base, backward=False, **features)
