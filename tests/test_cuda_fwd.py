"""The Hopper CUDA forward (`_cuda.forward`) against the float64 reference, on an sm90 GPU.

The backend is called directly, as the dispatcher does: destinations poisoned with NaN, an
`AttnParams` already normalised (causal => window_right == 0). Every comparison uses the
tolerance rule (`assert_close_to_reference`): the error against float64 must stay within twice
PyTorch's own error in the input dtype; the Triton cross-check holds us to twice Triton's error.

Covered: bf16/fp16 x every compiled head dim (and head dims between them, run on the next one
up) x causal; Sq != Sk both ways with awkward sizes; causal, sliding windows, softcap, sinks
(with fully masked rows), GQA and MQA by index, varlen with empty sequences, transposed and
packed-qkv strides; several tiles per persistent CTA (paired causal blocks included). A CPU-only check covers import and `supports` without a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math

import pytest
import torch

from helpers import (backend_params, make_qkv, make_varlen_qkv, needs_sm90, seeded_cuda_qkv,
                     sm90)
from flash_attn_hub.reference import assert_close_to_reference, attention_reference



@pytest.fixture(scope="module")
def triton_fwd(flash_attn):
    try:
        return importlib.import_module(flash_attn.__name__ + "._triton.fwd")
    except ModuleNotFoundError:
        pytest.skip("this build has no Triton forward")


def _run(backend, q, k, v, params, *, cu_q=None, cu_k=None, s_aux=None):
    out = torch.full_like(q, math.nan)
    if cu_q is None:
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan, device=q.device)
    else:
        lse = torch.full((q.shape[1], q.shape[0]), math.nan, device=q.device)
    varlen = cu_q is not None
    assert backend.supports(q, k, params, backward=False, varlen=varlen, alibi=False,
                            sink=s_aux is not None), "the CUDA backend should accept this call"
    backend.forward(q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, s_aux=s_aux,
                    alibi_slopes=None, params=params)
    torch.cuda.synchronize()
    return out, lse


def _check(backend, q, k, v, params, *, cu_q=None, cu_k=None, s_aux=None):
    out, lse = _run(backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k, s_aux=s_aux)
    common = dict(softmax_scale=params.softmax_scale, causal=params.causal,
                  window_size=(params.window_left, params.window_right), softcap=params.softcap,
                  s_aux=s_aux, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref_out, ref_lse = attention_reference(q, k, v, **common)
    low_out, low_lse = attention_reference(q, k, v, dtype=q.dtype, **common)
    assert_close_to_reference("out", out, ref_out, low_out)
    assert_close_to_reference("lse", lse, ref_lse, low_lse.float())
    return out, lse


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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["plain", "softcap"])
def test_running_max_moves_late(cuda_backend, attn_params, dtype, d, causal, softcap):
    """[Note] Lazy rescale (softmax.h): keys scaled up towards the start of the sequence (the
    forward walks key blocks from the last to the first), so each row's max grows in late
    steps, by more than the slack in some and by less in others: both the rescaled and the
    kept-max steps run, the latter with probabilities above 1."""
    q, k, v = seeded_cuda_qkv(1, 600, 600, 2, 2, d, dtype, seed=7 + d)
    ramp = torch.linspace(6.0, 1.0, 600, device="cuda")
    k = (k.float() * ramp[None, :, None, None]).to(dtype)
    _check(cuda_backend, q, k, v, backend_params(attn_params, d, causal=causal, softcap=softcap,
                                                 max_q=600, max_k=600))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("d", [8, 40, 72, 80, 112, 136, 160, 200, 248])
def test_head_dims_between_buckets(cuda_backend, attn_params, d):
    q, k, v = seeded_cuda_qkv(1, 113, 239, 2, 2, d, torch.bfloat16, seed=d)
    _check(cuda_backend, q, k, v, backend_params(attn_params, d, max_q=113, max_k=239))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 239), (17, 1023), (113, 239), (1023, 113), (239, 17)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (17, 5), (0, 0), (64, -1)],
                         ids=["full", "causal", "band", "diag", "left"])
def test_lengths_and_windows(cuda_backend, attn_params, sq, sk, window):
    q, k, v = seeded_cuda_qkv(2, sq, sk, 3, 3, 128, torch.bfloat16, seed=sq * 7 + sk)
    params = backend_params(attn_params, 128, causal=window == (-1, 0), window=window, max_q=sq,
                            max_k=sk)
    _check(cuda_backend, q, k, v, params)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_softcap(cuda_backend, attn_params, causal, d):
    q, k, v = seeded_cuda_qkv(2, 300, 300, 2, 2, d, torch.bfloat16, seed=3)
    q = q * 4  # large scores, so the cap bites
    _check(cuda_backend, q, k, v,
           backend_params(attn_params, d, causal=causal, softcap=5.0, max_q=300, max_k=300))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("sq,sk", [(200, 200), (300, 100)])  # (300, 100) causal: masked rows
def test_sinks(cuda_backend, attn_params, sq, sk):
    q, k, v = seeded_cuda_qkv(2, sq, sk, 4, 2, 128, torch.bfloat16, seed=5)
    s_aux = torch.randn(4, device="cuda", dtype=torch.float32) * 2
    for causal in (False, True):
        _, lse = _check(cuda_backend, q, k, v,
                        backend_params(attn_params, 128, causal=causal, max_q=sq, max_k=sk),
                                       s_aux=s_aux)
        if causal and sq > sk:
            torch.testing.assert_close(lse[:, :, 0], s_aux.expand(2, 4), rtol=0, atol=1e-5)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (6, 3)], ids=["gqa", "mqa", "gqa3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(cuda_backend, attn_params, hq, hkv, causal):
    q, k, v = seeded_cuda_qkv(2, 200, 333, hq, hkv, 128, torch.float16, seed=hq + hkv)
    _check(cuda_backend, q, k, v, backend_params(attn_params, 128, causal=causal, max_q=200,
                                                 max_k=333))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (33, 7)], ids=["full", "causal", "band"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_with_empty_sequences(cuda_backend, attn_params, window, d):
    torch.manual_seed(11)
    seq_q = [0, 17, 128, 1, 300, 5, 129]
    seq_k = [5, 0, 200, 1, 300, 0, 77]
    cu_q = torch.tensor([0, *itertools.accumulate(seq_q)], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(seq_k)], device="cuda", dtype=torch.int32)
    q = torch.randn(sum(seq_q), 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(seq_k), 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(seq_k), 2, d, device="cuda", dtype=torch.bfloat16)
    s_aux = torch.randn(4, device="cuda") if window == (33, 7) else None
    params = backend_params(attn_params, d, causal=window == (-1, 0), window=window,
                            max_q=max(seq_q),
                     max_k=max(seq_k))
    _check(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k, s_aux=s_aux)


@pytest.mark.gpu
@needs_sm90
def test_strided_layouts(cuda_backend, attn_params):
    torch.manual_seed(13)
    b, s, h, d = 2, 190, 4, 128
    # (B, H, S, D) storage seen as (B, S, H, D), as transformers passes it
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    # one slice of a packed (B, S, 3, H, D) projection: row stride 3 * H * D
    packed = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = packed[:, :, 1], packed[:, :, 2]
    for causal in (False, True):
        _check(cuda_backend, q, k, v, backend_params(attn_params, d, causal=causal, max_q=s,
                                                     max_k=s))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("window,sq,sk", [((-1, -1), 1100, 1301), ((-1, 0), 1100, 1301),
                                          ((300, 0), 1100, 1301), ((-1, 77), 1100, 1301),
                                          ((-1, 0), 1300, 300)],
                         ids=["full", "causal", "sliding", "right", "causal-rows-without-keys"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_many_tiles_per_cta(cuda_backend, attn_params, window, sq, sk, d):
    """More units than SMs, so each persistent CTA runs several tiles back to back (its Q, K/V
    ring, pingpong turns and a tile's last P V carried into the next tile). 1100 queries are 9
    query blocks: under a triangle band (causal, right bound only) the units pair blocks 8+0,
    ..., 5+3 and leave block 4 alone; Sk != Sq and Sk not a multiple of any key block. With
    1300 queries over 300 keys, causal, the first 1000 rows see no key: tiles without a key
    block sit between tiles with some, and a third of the CTAs get only such tiles (units pair
    blocks 10-j and j; CTA c runs the units with j = c mod 6); those rows carry a sink, so their
    lse is its logit."""
    q, k, v = seeded_cuda_qkv(3, sq, sk, 16, 4, d, torch.bfloat16, seed=d + sum(window) + sk)
    params = backend_params(attn_params, d, causal=window == (-1, 0), window=window, max_q=sq,
                            max_k=sk)
    s_aux = torch.randn(16, device="cuda") if sq > sk else None
    _check(cuda_backend, q, k, v, params, s_aux=s_aux)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", ["causal", "right", "causal_rows_without_keys", "varlen"])
def test_long_band_tiles(cuda_backend, attn_params, case):
    """[Note] Long bands (csrc/hopper/fwd_launch.h): at D=64 a band without a left bound over
    at least 4096 queries runs 192-row tiles (the last one partial) instead of 128-row ones:
    causal, a right bound only, causal with Sq > Sk (rows that see no key, with a sink), and
    varlen whose longest sequence passes the threshold beside short and empty ones."""
    torch.manual_seed(47)
    cu_q = cu_k = s_aux = None
    if case == "varlen":
        q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv([4100, 0, 5, 300], [4200, 3, 5, 0],
                                                            8, 2, 64, dtype=torch.bfloat16,
                                                            device="cuda")
        params = backend_params(attn_params, 64, causal=True, max_q=max_q, max_k=max_k)
    else:
        sq, sk, window = {"causal": (4100, 4300, (-1, 0)), "right": (4097, 3900, (-1, 77)),
                          "causal_rows_without_keys": (4200, 700, (-1, 0))}[case]
        q, k, v = seeded_cuda_qkv(1, sq, sk, 8, 2, 64, torch.float16, seed=sq + sk)
        params = backend_params(attn_params, 64, causal=window == (-1, 0), window=window,
                                max_q=sq, max_k=sk)
        s_aux = torch.randn(8, device="cuda") if sq > sk else None
    _check(cuda_backend, q, k, v, params, cu_q=cu_q, cu_k=cu_k, s_aux=s_aux)


@pytest.mark.gpu
@pytest.mark.sanitize
@needs_sm90
def test_small_persistent_tiles(cuda_backend, attn_params):
    """Several tiles per persistent CTA (batched, full and causal), sized for compute-sanitizer:
    full runs D=64's three-consumer tiles (3 query blocks of 192 rows, the last one partial, x 64
    heads = 192 tiles), causal the two-consumer band tiles (5 blocks of 128, 192 paired units),
    and a causal 4100-query run the three-consumer long-band tiles.
    The references run on the CPU, so only our kernel runs on the GPU under the sanitizer."""
    shapes = [(520, 520, 64, 8, False), (520, 520, 64, 8, True),
              (4100, 4100, 2, 1, True)]  # the last: [Note] Long bands, 22 blocks of 192 rows
    for sq, sk, hq, hkv, causal in shapes:
        q, k, v = seeded_cuda_qkv(1, sq, sk, hq, hkv, 64, torch.float16, seed=23)
        params = backend_params(attn_params, 64, causal=causal, max_q=sq, max_k=sk)
        out, lse = _run(cuda_backend, q, k, v, params)
        qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
        ref_out, ref_lse = attention_reference(qc, kc, vc, causal=causal)
        low_out, low_lse = attention_reference(qc, kc, vc, causal=causal, dtype=q.dtype)
        assert_close_to_reference("out", out.cpu(), ref_out, low_out)
        assert_close_to_reference("lse", lse.cpu(), ref_lse, low_lse.float())


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_against_triton(cuda_backend, triton_fwd, attn_params, causal):
    q, k, v = seeded_cuda_qkv(2, 1000, 1000, 4, 2, 128, torch.bfloat16, seed=17)
    params = backend_params(attn_params, 128, causal=causal, max_q=1000, max_k=1000)
    out, lse = _run(cuda_backend, q, k, v, params)
    t_out, t_lse = torch.full_like(out, math.nan), torch.full_like(lse, math.nan)
    triton_fwd.forward(q, k, v, t_out, t_lse, cu_seqlens_q=None, cu_seqlens_k=None, s_aux=None,
                       alibi_slopes=None, params=params)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
    assert_close_to_reference("out vs triton", out, ref_out, t_out)
    assert_close_to_reference("lse vs triton", lse, ref_lse, t_lse)


@pytest.mark.gpu
@pytest.mark.sanitize
@needs_sm90
def test_small_all_features_once(cuda_backend, attn_params):
    """A short run of every code path, sized for compute-sanitizer."""
    torch.manual_seed(19)
    seq = [0, 33, 130]
    cu = torch.tensor([0, 0, 33, 163], device="cuda", dtype=torch.int32)
    q = torch.randn(163, 4, 80, device="cuda", dtype=torch.float16)
    k = torch.randn(163, 2, 80, device="cuda", dtype=torch.float16)
    v = torch.randn(163, 2, 80, device="cuda", dtype=torch.float16)
    params = backend_params(attn_params, 80, window=(20, 3), softcap=8.0, max_q=max(seq),
                            max_k=max(seq))
    _check(cuda_backend, q, k, v, params, cu_q=cu, cu_k=cu, s_aux=torch.randn(4, device="cuda"))


def test_decode_preference(heuristics, attn_params, monkeypatch):
    """[Note: decode on Triton]: a GQA decode over DECODE_MIN_KEYS keys or more (batched, and
    varlen as generate calls it) is preferred on Triton; a prefill, fewer keys and dropout are
    not, nor anything with the switch off. No GPU needed: the rule reads shapes only."""
    monkeypatch.setattr(heuristics, "DECODE_ON_TRITON", True)
    keys = heuristics.DECODE_MIN_KEYS
    q = torch.empty(4, 1, 32, 128)
    k = torch.empty(1, 1, 8, 128).expand(4, keys, 8, 128)  # shapes only
    decode = backend_params(attn_params, 128, causal=True, max_q=1, max_k=keys)
    assert heuristics.forward_prefers_triton(q, k, decode)
    qv, kv = torch.empty(4, 32, 128), torch.empty(1, 8, 128).expand(4 * keys, 8, 128)
    assert heuristics.forward_prefers_triton(qv, kv, decode)
    prefill = backend_params(attn_params, 128, causal=True, max_q=keys, max_k=keys)
    assert heuristics.forward_prefers_triton(q[:1].expand(1, keys, 32, 128), k[:1],
                                             prefill) is None
    fewer = backend_params(attn_params, 128, causal=True, max_q=1, max_k=keys - 8)
    assert heuristics.forward_prefers_triton(q, k[:, :keys - 8], fewer) is None
    dropout = dataclasses.replace(decode, dropout_p=0.1)
    assert heuristics.forward_prefers_triton(q, k, dropout) is None
    monkeypatch.setattr(heuristics, "DECODE_ON_TRITON", False)
    assert heuristics.forward_prefers_triton(q, k, decode) is None


@pytest.mark.kernels_ci
def test_supports_declines_without_sm90_or_features(cuda_backend, attn_params):
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    params = backend_params(attn_params, 64, max_q=8, max_k=8)
    flags = dict(varlen=False, alibi=False, sink=False)
    assert not cuda_backend.supports(q, q, params, backward=False, **flags)  # CPU tensors
    if not sm90():
        return
    qc = q.cuda()
    assert cuda_backend.supports(qc, qc, params, backward=False, **flags)
    # the backward has its own cases (tests/test_cuda_bwd.py); dropout is not one
    assert not cuda_backend.supports(qc, qc, dataclasses.replace(params, dropout_p=0.1),
                                     backward=True, **flags)
    assert not cuda_backend.supports(qc, qc, params, backward=False, varlen=False, alibi=True,
                                     sink=False)
    assert not cuda_backend.supports(qc.float(), qc.float(), params, backward=False, **flags)
    dropout = dataclasses.replace(params, dropout_p=0.1)
    assert not cuda_backend.supports(qc, qc, dropout, backward=False, **flags)


def _decode_case(batch, heads_q, heads_kv, keys, d, dtype, device, *, transposed=False):
    torch.manual_seed(keys + heads_q)
    return make_qkv(batch, 1, keys, heads_q, heads_kv, d, dtype=dtype, device=device,
                    transposed=transposed)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("causal,softcap", [(False, 0.0), (True, 0.0), (True, 5.0)])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_packed_decode_views(cuda_backend, flash_attn, attn_params, causal, softcap, transposed):
    """[Note: packed decode], without a GPU: the packed views and params, run through the CPU
    backend, write the same out and lse as the unpacked call."""
    cpu = importlib.import_module(flash_attn.__name__ + "._cpu")
    q, k, v = _decode_case(3, 12, 2, 37, 32, torch.float32, "cpu", transposed=transposed)
    params = backend_params(attn_params, 32, causal=causal, softcap=softcap, max_q=1, max_k=37)
    outputs = []
    for pack in (False, True):
        out = torch.full((3, 1, 12, 32), math.nan)
        lse = torch.full((3, 12, 1), math.nan)
        args = (q, out, lse, params)
        if pack:
            args = cuda_backend.packed_decode(q, k, out, lse, cu_seqlens_q=None, s_aux=None,
                                              params=params)
            assert args is not None and args[0].shape == (3, 6, 2, 32) and not args[3].causal
        cpu.forward(args[0], k, v, args[1], args[2], cu_seqlens_q=None, cu_seqlens_k=None,
                    s_aux=None, alibi_slopes=None, params=args[3])
        outputs.append((out, lse))
    (out, lse), (packed_out, packed_lse) = outputs
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(packed_out, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(packed_lse, lse, rtol=1e-6, atol=1e-6)


@pytest.mark.kernels_ci
def test_packed_decode_declines(cuda_backend, attn_params):
    q, k, _ = _decode_case(2, 8, 2, 16, 32, torch.float32, "cpu")
    out, lse = torch.empty_like(q), torch.empty(2, 8, 1)
    decode = backend_params(attn_params, 32, causal=True, max_q=1, max_k=16)

    def packs(q=q, k=k, lse=lse, params=decode, s_aux=None):
        return cuda_backend.packed_decode(q, k, torch.empty_like(q), lse, cu_seqlens_q=None,
                                          s_aux=s_aux, params=params) is not None

    assert packs()
    assert not packs(k=k.repeat_interleave(4, dim=2))  # MHA: nothing to pack
    assert not packs(q=q.expand(2, 3, 8, 32).contiguous(), lse=torch.empty(2, 8, 3))  # Sq > 1
    assert not packs(s_aux=torch.zeros(8))  # one sink per query head
    assert not packs(params=backend_params(attn_params, 32, causal=True, window=(8, 0),
                                           max_q=1, max_k=16))  # left window: differs per row
    varlen = cuda_backend.packed_decode(q[:, 0], k.flatten(0, 1), out[:, 0], lse[..., 0].T,
                                        cu_seqlens_q=torch.tensor([0, 1, 2]), s_aux=None,
                                        params=decode)
    assert varlen is None


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("batch,heads_q,heads_kv,keys", [
    (3, 8, 2, 1), (3, 8, 2, 239), (2, 32, 8, 4099), (2, 32, 1, 1000), (5, 12, 2, 333),
    (40, 16, 4, 700)],  # the last: 640 unpacked tiles, several per SM
    ids=["g4-k1", "g4-k239", "g4-k4099", "mqa32", "g6", "many-tiles"])
@pytest.mark.parametrize("causal,softcap", [(False, 0.0), (True, 0.0), (True, 6.0)],
                         ids=["full", "causal", "causal-softcap"])
def test_packed_decode(cuda_backend, attn_params, monkeypatch, batch, heads_q, heads_kv, keys,
                       causal, softcap):
    """[Note: packed decode] on the GPU against the reference, the packed launch confirmed
    (the switch forced on, so the test keeps its meaning if the default changes)."""
    monkeypatch.setattr(cuda_backend, "PACKED_DECODE", True)
    packed = []
    pack = cuda_backend.packed_decode
    monkeypatch.setattr(cuda_backend, "packed_decode",
                        lambda *a, **kw: packed.append(pack(*a, **kw)) or packed[-1])
    q, k, v = _decode_case(batch, heads_q, heads_kv, keys, 128, torch.bfloat16, "cuda",
                           transposed=keys == 239)
    _check(cuda_backend, q, k, v, backend_params(attn_params, 128, causal=causal,
                                                 softcap=softcap, max_q=1, max_k=keys))
    assert len(packed) == 1 and packed[0] is not None
