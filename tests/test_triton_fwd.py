"""The Triton forward kernel (`_triton/fwd.py`, ``forward``) against the float64 reference.

The launcher is called as the dispatcher calls it: destinations poisoned with NaN, an
`AttnParams` already normalised. Every comparison uses the tolerance rule
(`assert_close_to_reference`): our error against float64 must stay within twice PyTorch's own
error in the input dtype (the reference evaluated at ``dtype=q.dtype``).

Without a GPU the kernel runs under Triton's interpreter on CPU tensors, in fp16 only (the
interpreter computes bf16 dots wrongly); the interpreter is slow, so shapes stay small but
awkward (1, 17, 113, Sq != Sk) and the interpreter's tile table (32 x 16) makes them cross
several query and key blocks. On a GPU machine the same matrix runs compiled on CUDA tensors,
and the `gpu` tests add realistic sizes in bf16 and fp16.
"""

from __future__ import annotations

import os
import sys

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the kernel module is
# imported (by the fixtures below, after collection). Without CUDA the interpreter is the only
# way to run it; the `device` fixture skips if the kernel was nevertheless compiled for a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from helpers import (SOURCE_PACKAGE, assert_matches_reference,  # noqa: E402
                     built_or_source_package, interpreted, make_qkv, make_varlen_qkv,
                     reference_kwargs, run_forward, submodule, triton_device)
from flash_attn_hub.reference import dropout_keep_mask, visible_mask  # noqa: E402

# The interpreter's own NumPy deprecation warnings, thousands per kernel call.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")


@pytest.fixture(scope="module")
def package(request):
    return built_or_source_package(request)


@pytest.fixture(scope="module")
def fwd(package):
    return submodule(package, "_triton.fwd")


@pytest.fixture(scope="module")
def common(package):
    return submodule(package, "_triton.common")


@pytest.fixture(scope="module")
def heuristics(package):
    return submodule(package, "_heuristics")


@pytest.fixture(scope="module")
def attn_params(package):
    return submodule(package, "_params").AttnParams


@pytest.fixture(scope="module")
def device(fwd):
    return triton_device(fwd._attn_fwd_kernel)


# ---------------------------------------------------------------------------------------------
# One case: inputs, a call of the kernel, the reference in float64 and in the input dtype.
# ---------------------------------------------------------------------------------------------

def make_params(attn_params, *, head_dim, causal=False, window=(-1, -1), softcap=0.0,
                dropout_p=0.0, seed=0, softmax_scale=None, max_seqlen_q=0, max_seqlen_k=0):
    left, right = window
    return attn_params(softmax_scale=head_dim ** -0.5 if softmax_scale is None else softmax_scale,
                       causal=causal, window_left=left, window_right=0 if causal else right,
                       softcap=softcap, dropout_p=dropout_p, seed=seed, deterministic=False,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def make_inputs(device, dtype, *, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
                layout="contiguous"):
    """q/k/v in the batched layout; ``layout="transposed"`` builds them as views of
    ``(B, H, S, D)`` tensors and of a packed kv tensor, so every stride but the last differs."""
    transposed = layout == "transposed"
    return make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=dtype,
                    device=device, transposed=transposed,
                    kv_layout="packed_transposed" if transposed else "contiguous")


def check_against_reference(q, k, v, out, lse, params, **extra):
    assert_matches_reference({"out": out, "lse": lse}, q, k, v, **reference_kwargs(params),
                             **extra)


# ---------------------------------------------------------------------------------------------
# Batched feature matrix.
# ---------------------------------------------------------------------------------------------

BASE = dict(batch=2, seqlen_q=37, seqlen_k=53, heads_q=4, heads_kv=4, head_dim=64)
CASES = {  # name -> overrides of BASE and feature switches
    "full": {},
    "causal": dict(causal=True),
    "causal_sq_gt_sk": dict(causal=True, seqlen_q=61, seqlen_k=29),
    "causal_decode": dict(causal=True, seqlen_q=1, seqlen_k=113, heads_q=8, heads_kv=2),
    "window": dict(window=(9, 4)),
    "window_left_only": dict(window=(13, -1)),
    "window_right_only": dict(window=(-1, 5)),
    "causal_window": dict(causal=True, window=(7, -1), seqlen_q=113, seqlen_k=113),
    "gqa4": dict(heads_q=8, heads_kv=2),
    "mqa": dict(heads_q=4, heads_kv=1, causal=True),
    "odd_1x1": dict(batch=3, seqlen_q=1, seqlen_k=1),
    "odd_17x113": dict(seqlen_q=17, seqlen_k=113, batch=1),
    "odd_113x17_causal": dict(seqlen_q=113, seqlen_k=17, batch=1, causal=True),
    "sk_zero": dict(seqlen_k=0, batch=1),
    "softcap": dict(softcap=3.0, softmax_scale=0.5),
    "softcap_causal_gqa": dict(softcap=20.0, causal=True, heads_q=4, heads_kv=2),
    "alibi": dict(alibi="head", causal=True),
    "alibi_batch_window": dict(alibi="batch", window=(11, 11)),
    "sink": dict(sink=True),
    "sink_causal_sq_gt_sk": dict(sink=True, causal=True, seqlen_q=61, seqlen_k=29),
    "sink_window_empty_rows": dict(sink=True, window=(3, 0), seqlen_q=53, seqlen_k=37),
    "dropout": dict(dropout_p=0.17, seed=1),
    "dropout_causal_gqa_seed64": dict(dropout_p=0.5, seed=(7 << 32) + 12345, causal=True,
                                      heads_q=4, heads_kv=2),
    "everything": dict(causal=True, window=(19, -1), softcap=5.0, alibi="head", sink=True,
                       dropout_p=0.25, seed=99, heads_q=6, heads_kv=2),
    "d8": dict(head_dim=8, seqlen_q=20, seqlen_k=20, causal=True),
    "d40_transposed": dict(head_dim=40, layout="transposed", window=(6, 2)),
    "d80": dict(head_dim=80, batch=1, seqlen_q=17, seqlen_k=33, heads_q=2, heads_kv=1),
    "d128_causal": dict(head_dim=128, batch=1, seqlen_q=33, seqlen_k=33, heads_q=2, heads_kv=2,
                        causal=True),
    "d256_sink": dict(head_dim=256, batch=1, seqlen_q=17, seqlen_k=20, heads_q=2, heads_kv=1,
                      sink=True),
    "transposed_gqa_causal": dict(layout="transposed", heads_q=8, heads_kv=2, causal=True),
    # head dims split into two tiles ([Note: split head dim]): 128 + 64, and 128 + 8 columns in
    # a 16-wide second tile
    "d192_gqa_causal": dict(head_dim=192, batch=1, seqlen_q=37, seqlen_k=29, heads_q=4,
                            heads_kv=2, causal=True, softcap=5.0),
    "d136_window_sink": dict(head_dim=136, batch=1, seqlen_q=21, seqlen_k=40, heads_q=2,
                             heads_kv=1, window=(9, 3), sink=True),
}
CI_CASES = {"causal_sq_gt_sk", "gqa4", "sink_window_empty_rows", "dropout", "d40_transposed"}


def run_case(fwd, attn_params, device, dtype, spec, tiles=None):
    spec = {**BASE, **spec}
    shape = {key: spec[key] for key in BASE}
    q, k, v = make_inputs(device, dtype, layout=spec.get("layout", "contiguous"), **shape)
    params = make_params(attn_params, head_dim=shape["head_dim"],
                         causal=spec.get("causal", False), window=spec.get("window", (-1, -1)),
                         softcap=spec.get("softcap", 0.0), dropout_p=spec.get("dropout_p", 0.0),
                         seed=spec.get("seed", 0), softmax_scale=spec.get("softmax_scale"),
                         max_seqlen_q=shape["seqlen_q"], max_seqlen_k=shape["seqlen_k"])
    extra = {}
    if spec.get("alibi") == "head":
        extra["alibi_slopes"] = torch.rand(shape["heads_q"], device=device) * 0.3
    elif spec.get("alibi") == "batch":
        extra["alibi_slopes"] = torch.rand(shape["batch"], shape["heads_q"], device=device) * 0.3
    if spec.get("sink"):
        extra["s_aux"] = torch.randn(shape["heads_q"], device=device) * 2
    tiles = None if tiles is None else fwd.FwdTiles(*tiles)
    out, lse = run_forward(fwd, q, k, v, params=params, tiles=tiles, **extra)
    check_against_reference(q, k, v, out, lse, params, **extra)
    return out, lse


CASE_PARAMS = [pytest.param(spec, id=name,
                            marks=[pytest.mark.kernels_ci] if name in CI_CASES else [])
               for name, spec in CASES.items()]


@pytest.mark.parametrize("spec", CASE_PARAMS)
def test_batched(fwd, attn_params, device, spec):
    torch.manual_seed(0)
    run_case(fwd, attn_params, device, torch.float16, spec)


@pytest.mark.parametrize("tiles", [(16, 32, 4, 1), (64, 64, 4, 2), (16, 16, 4, 1)],
                         ids=["m16n32", "m64n64", "m16n16"])
@pytest.mark.parametrize("name", ["causal_sq_gt_sk", "window", "sink_window_empty_rows"])
def test_other_tiles(fwd, attn_params, device, tiles, name):
    """Block-range arithmetic must not depend on BLOCK_M vs BLOCK_N (the table's GPU tiles)."""
    torch.manual_seed(1)
    run_case(fwd, attn_params, device, torch.float16, CASES[name], tiles=tiles)


TMA_TILES = (32, 16, 1, 1, "tests: tensor descriptors", True)


@pytest.fixture
def descriptor_choices(fwd, monkeypatch):
    """Records what the launcher's ``use_tma`` grants, so a test knows which path ran."""
    granted = []

    def recording(*args):
        granted.append(use_tma(*args))
        return granted[-1]
    use_tma = fwd.use_tma
    monkeypatch.setattr(fwd, "use_tma", recording)
    return granted


@pytest.mark.parametrize("name", ["causal_sq_gt_sk", "everything", "d8", "d40_transposed",
                                  "sink_window_empty_rows", "transposed_gqa_causal"])
def test_tensor_descriptor_path(fwd, attn_params, device, descriptor_choices, name):
    """The TMA path (``tma=True``; the interpreter runs descriptors on CPU tensors): the
    descriptor's own bounds replace every row and column mask, so ragged and padded shapes,
    band edges and strided views must all still match the reference."""
    torch.manual_seed(1)
    run_case(fwd, attn_params, device, torch.float16, CASES[name], tiles=TMA_TILES)
    assert descriptor_choices == [True]


@pytest.mark.parametrize("tiles", [None, TMA_TILES], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("name", ["d192_gqa_causal", "d136_window_sink"])
def test_split_head_dim_matches_padded_tiles(fwd, attn_params, device, monkeypatch, tiles, name):
    """[Note: split head dim]: the two-tile program and the padded one (``SPLIT_HEAD_DIM``
    off) both match the reference, and each other to within the last bits of the fp32
    accumulation order."""
    outputs = []
    for split in (True, False):
        monkeypatch.setattr(fwd, "SPLIT_HEAD_DIM", split)
        torch.manual_seed(3)  # the same inputs both times
        outputs.append(run_case(fwd, attn_params, device, torch.float16, CASES[name], tiles))
    (out_split, lse_split), (out_padded, lse_padded) = outputs
    torch.testing.assert_close(out_split, out_padded, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse_split, lse_padded, atol=1e-4, rtol=1e-5)


def test_head_dim_split_widths(package):
    split = submodule(package, "_triton.tuning").head_dim_split
    assert split(192) == (128, 64, 64)
    assert split(160) == (128, 32, 32)
    assert split(136) == (128, 8, 16)
    assert split(96) == (128, 0, 0)  # below SPLIT_MIN_PADDED: measured slower split
    assert split(40) == (64, 0, 0)
    for padded in (16, 32, 64, 128, 256):  # powers of two are never split
        assert split(padded) == (padded, 0, 0)
    assert split(200) == (256, 0, 0)  # 128 + 128 would be no narrower
    assert split(24) == (32, 0, 0)  # 16 + 16 would be no narrower


def test_misaligned_inputs_take_the_pointer_path(fwd, attn_params, device, descriptor_choices):
    """A q whose rows start 8 bytes off a 16-byte boundary cannot back a descriptor: the
    launcher falls back to pointers (and stays correct)."""
    torch.manual_seed(2)
    wide = torch.randn(2, 37, 4, 40, dtype=torch.float16, device=device)
    q = wide[..., 4:36]  # data_ptr + 8 bytes
    k, v = (torch.randn(2, 53, 4, 32, dtype=torch.float16, device=device) for _ in range(2))
    params = make_params(attn_params, head_dim=32, causal=True, max_seqlen_q=37, max_seqlen_k=53)
    out, lse = run_forward(fwd, q, k, v, params=params, tiles=fwd.FwdTiles(*TMA_TILES))
    assert descriptor_choices == [False]
    check_against_reference(q, k, v, out, lse, params)


def test_tma_alignment_rule(common):
    """``LaunchShape.tma_ok``: 16-byte aligned base and (batch, sequence, head) strides."""
    q = torch.zeros(2, 8, 4, 64, dtype=torch.float16)
    shape = common.LaunchShape(False, 2, 8, 8, 8, 8, 4, 4, 64)
    assert shape.tma_ok(q, q.transpose(1, 2).contiguous().transpose(1, 2))
    assert not shape.tma_ok(q[..., 4:36])  # base 8 bytes off
    assert not shape.tma_ok(torch.zeros(2, 8, 4, 68, dtype=torch.float16)[..., :64])  # stride
    varlen = common.LaunchShape(True, 2, 0, 0, 8, 8, 4, 4, 64)
    packed = torch.zeros(16, 2, 4, 64, dtype=torch.float16)
    assert varlen.tma_ok(packed[:, 0], packed[:, 1])


# ---------------------------------------------------------------------------------------------
# Varlen.
# ---------------------------------------------------------------------------------------------

VARLEN = {  # name -> (query lengths, key lengths, features)
    "mixed": ([5, 0, 1, 40, 17], [9, 3, 1, 40, 0], {}),
    "causal_gqa": ([1, 33, 0, 17], [60, 33, 2, 5], dict(causal=True, heads=(8, 2))),
    "window_sink_alibi": ([23, 1, 0, 31], [23, 7, 4, 50],
                          dict(window=(5, 3), sink=True, alibi="batch")),
    "dropout_softcap": ([3, 0, 29], [30, 5, 29], dict(dropout_p=0.3, seed=5, softcap=4.0,
                                                      causal=True)),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.kernels_ci] if n == "mixed"
                                               else []) for n in VARLEN])
def test_varlen(fwd, attn_params, device, name):
    torch.manual_seed(2)
    lens_q, lens_k, feat = VARLEN[name]
    heads_q, heads_kv = feat.get("heads", (4, 2))
    head_dim = 32
    # K and V: strided views of one packed tensor
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv(lens_q, lens_k, heads_q, heads_kv,
                                                        head_dim, dtype=torch.float16,
                                                        device=device, kv_layout="packed")
    params = make_params(attn_params, head_dim=head_dim, causal=feat.get("causal", False),
                         window=feat.get("window", (-1, -1)), softcap=feat.get("softcap", 0.0),
                         dropout_p=feat.get("dropout_p", 0.0), seed=feat.get("seed", 0),
                         max_seqlen_q=max_q, max_seqlen_k=max_k)
    extra = {}
    if feat.get("sink"):
        extra["s_aux"] = torch.randn(heads_q, device=device)
    if feat.get("alibi") == "batch":
        extra["alibi_slopes"] = torch.rand(len(lens_q), heads_q, device=device) * 0.5
    out, lse = run_forward(fwd, q, k, v, params=params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           **extra)
    check_against_reference(q, k, v, out, lse, params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            **extra)


# ---------------------------------------------------------------------------------------------
# Split-KV decode (`_triton/decode.py`): few query rows per kv head over many keys. The
# dispatcher routes these calls there; the tests call it with chosen split counts too.
# ---------------------------------------------------------------------------------------------

# SPLIT_KV_MIN_KEYS while these tests run: the interpreter is slow on long key ranges
DECODE_KEYS = 256
DECODE_CASES = {  # name -> overrides of BASE (Sk >= DECODE_KEYS, GROUP * Sq <= SPLIT_KV_MAX_ROWS)
    "decode_gqa_causal": dict(seqlen_q=1, seqlen_k=300, heads_q=8, heads_kv=2, causal=True),
    "decode_mha": dict(seqlen_q=1, seqlen_k=257, batch=3),
    "prefill5_gqa_causal": dict(seqlen_q=5, seqlen_k=300, heads_q=8, heads_kv=2, causal=True),
    "mqa_window": dict(seqlen_q=3, seqlen_k=400, heads_q=4, heads_kv=1, window=(50, 0)),
    "softcap_alibi_sink_d80": dict(seqlen_q=2, seqlen_k=260, heads_q=6, heads_kv=2,
                                   head_dim=80, softcap=5.0, alibi="head", sink=True,
                                   causal=True),
    "alibi_batch_window_right": dict(seqlen_q=4, seqlen_k=256, alibi="batch",
                                     window=(-1, 30)),
    "d40_transposed_gqa": dict(seqlen_q=2, seqlen_k=270, heads_q=8, heads_kv=2, head_dim=40,
                               layout="transposed", causal=True),
    "d256_sink": dict(seqlen_q=1, seqlen_k=256, batch=1, heads_q=2, heads_kv=1, head_dim=256,
                      sink=True),
}


@pytest.fixture
def decode(package, heuristics, monkeypatch):
    monkeypatch.setattr(heuristics, "SPLIT_KV_MIN_KEYS", DECODE_KEYS)
    return submodule(package, "_triton.decode")


@pytest.fixture
def decode_calls(decode, monkeypatch):
    """Records the split counts of the split-KV launches, so a test knows that path ran."""
    calls = []
    launch = decode.forward

    def recording(*args, **kwargs):
        calls.append(kwargs.get("num_splits"))
        return launch(*args, **kwargs)
    monkeypatch.setattr(decode, "forward", recording)
    return calls


class _Dispatched:
    """A launcher that runs the forward the dispatcher chooses with the Triton backend asked
    for, as the custom op calls it (the split-KV decode where it applies)."""

    def __init__(self, dispatch):
        self.dispatch = dispatch

    def forward(self, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
                params, tiles=None):
        assert tiles is None, "the dispatcher runs the tile table"
        run = self.dispatch.select_backend("forward", q, k, v, params,
                                           varlen=cu_seqlens_q is not None,
                                           alibi=alibi_slopes is not None,
                                           sink=s_aux is not None)
        run(q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            s_aux=s_aux, alibi_slopes=alibi_slopes, params=params)


@pytest.fixture
def dispatched(package, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "triton")
    return _Dispatched(submodule(package, "_dispatch"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.kernels_ci]
                                               if n == "prefill5_gqa_causal" else [])
                                  for n in DECODE_CASES])
def test_split_kv_through_the_dispatcher(dispatched, attn_params, device, decode_calls, name):
    torch.manual_seed(7)
    run_case(dispatched, attn_params, device, torch.float16, DECODE_CASES[name])
    assert decode_calls == [None], "the dispatcher should have chosen the split-KV path"


@pytest.mark.parametrize("num_splits", [1, 2, 7, 40], ids=lambda n: f"splits{n}")
def test_split_kv_split_counts(decode, heuristics, attn_params, device, num_splits):
    """Any split count gives the same attention: one split, uneven ones, and more splits than
    key blocks under a band (most see no key and must weigh nothing in the combine)."""
    torch.manual_seed(8)
    q, k, v = make_inputs(device, torch.float16, batch=2, seqlen_q=3, seqlen_k=333, heads_q=8,
                          heads_kv=2, head_dim=32)
    s_aux = torch.randn(8, device=device)
    params = make_params(attn_params, head_dim=32, causal=True, window=(40, -1),
                         max_seqlen_q=3, max_seqlen_k=333)
    assert heuristics.split_kv_applies(q, k, params)
    out, lse = run_forward(decode, q, k, v, params=params, s_aux=s_aux, num_splits=num_splits)
    check_against_reference(q, k, v, out, lse, params, s_aux=s_aux)


@pytest.mark.parametrize("num_splits", [None, 3], ids=["dispatcher", "splits3"])
def test_split_kv_varlen(dispatched, decode, decode_calls, attn_params, device, num_splits):
    """Varlen decode as transformers' generate calls it for a padded batch: one or two new
    queries per sequence against caches of different lengths, with an empty query, an empty
    key range and a single key among them; sinks and a band."""
    torch.manual_seed(10)
    lens_q, lens_k = [1, 2, 0, 1, 1, 2], [300, 257, 40, 0, 1, 280]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv(lens_q, lens_k, 8, 2, 32,
                                                        dtype=torch.float16, device=device,
                                                        kv_layout="packed")
    s_aux = torch.randn(8, device=device)
    params = make_params(attn_params, head_dim=32, causal=True, window=(100, -1),
                         max_seqlen_q=max_q, max_seqlen_k=max_k)
    launch = dispatched if num_splits is None else decode
    extra = {} if num_splits is None else dict(num_splits=num_splits)
    out, lse = run_forward(launch, q, k, v, params=params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           s_aux=s_aux, **extra)
    assert decode_calls == [num_splits]
    check_against_reference(q, k, v, out, lse, params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            s_aux=s_aux)


def test_split_kv_is_bitwise_reproducible(decode, attn_params, device):
    """The combine adds the splits in a fixed order: two runs give the same bits."""
    torch.manual_seed(9)
    q, k, v = make_inputs(device, torch.float16, batch=2, seqlen_q=1, seqlen_k=300, heads_q=8,
                          heads_kv=2, head_dim=64)
    params = make_params(attn_params, head_dim=64, causal=True, max_seqlen_q=1, max_seqlen_k=300)
    first = run_forward(decode, q, k, v, params=params, num_splits=5)
    second = run_forward(decode, q, k, v, params=params, num_splits=5)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.kernels_ci
def test_split_kv_applies_only_where_it_helps(heuristics, attn_params):
    """Calls without dropout, GROUP * Sq <= SPLIT_KV_MAX_ROWS, Sk >= SPLIT_KV_MIN_KEYS."""
    def applies(q, k, params):
        return heuristics.split_kv_applies(q, k, params)

    def call(sq, sk, hq, hkv, **kw):
        q = torch.zeros(2, sq, hq, 64, dtype=torch.float16)
        k = torch.zeros(2, sk, hkv, 64, dtype=torch.float16)
        return q, k, make_params(attn_params, head_dim=64, max_seqlen_q=sq, max_seqlen_k=sk,
                                 **kw)
    rows, keys = heuristics.SPLIT_KV_MAX_ROWS, heuristics.SPLIT_KV_MIN_KEYS
    assert applies(*call(1, keys, 32, 8))
    assert applies(*call(rows // 4, keys, 8, 2))
    assert not applies(*call(rows // 4 + 1, keys, 8, 2))
    assert not applies(*call(1, keys - 1, 32, 8))
    assert not applies(*call(1, keys, 32, 8, dropout_p=0.1))
    # varlen: the longest sequences decide (max_seqlen_q rows per head, max_seqlen_k keys)
    varlen_q = torch.zeros(3, 32, 64, dtype=torch.float16)
    varlen_k = torch.zeros(2 * keys, 8, 64, dtype=torch.float16)
    assert applies(varlen_q, varlen_k, call(2, keys, 32, 8)[2])
    assert not applies(varlen_q, varlen_k, call(rows // 4 + 1, keys, 32, 8)[2])
    assert not applies(varlen_q, varlen_k, call(2, keys - 1, 32, 8)[2])


# ---------------------------------------------------------------------------------------------
# Exact properties: the dropout keep-mask bit for bit, empty rows, the block ranges.
# ---------------------------------------------------------------------------------------------

@pytest.mark.kernels_ci
@pytest.mark.parametrize("seed", [0, 1, (3 << 32) + 0xDEADBEEF], ids=["seed0", "seed1", "seed64"])
def test_dropout_mask_bitwise(fwd, attn_params, device, seed):
    """With V = identity, ``out[i, j] = P[i, j] * keep[i, j] / (1 - p)`` and every P > 0, so the
    nonzero pattern of ``out`` is the kernel's keep-mask; it must equal the reference's."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, dropout_p = 2, 19, 32, 4, 2, 0.4
    q = torch.randn(batch, seqlen_q, heads_q, seqlen_k, dtype=torch.float16, device=device) * 0.1
    k = torch.randn(batch, seqlen_k, heads_kv, seqlen_k, dtype=torch.float16, device=device) * 0.1
    v = torch.eye(seqlen_k, dtype=torch.float16, device=device)[None, :, None, :].expand(
        batch, seqlen_k, heads_kv, seqlen_k)
    params = make_params(attn_params, head_dim=seqlen_k, dropout_p=dropout_p, seed=seed,
                         max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k)
    out, _ = run_forward(fwd, q, k, v, params=params)
    for b in range(batch):
        for h in range(heads_q):
            want = dropout_keep_mask(seed, b, h, heads_q, seqlen_q, seqlen_k, dropout_p)
            assert torch.equal(out[b, :, h].cpu() != 0, want), f"keep-mask differs at b={b} h={h}"


@pytest.mark.kernels_ci
def test_rows_without_keys(fwd, attn_params, device):
    """Causal with Sq > Sk: the first Sq - Sk rows see nothing -> out 0 and lse -inf exactly,
    or lse = s_aux with a sink; never NaN."""
    torch.manual_seed(3)
    q, k, v = make_inputs(device, torch.float16, batch=1, seqlen_q=40, seqlen_k=7, heads_q=2,
                          heads_kv=2, head_dim=16)
    params = make_params(attn_params, head_dim=16, causal=True, max_seqlen_q=40, max_seqlen_k=7)
    s_aux = torch.tensor([0.5, -1.25], device=device)
    for sink in (None, s_aux):
        out, lse = run_forward(fwd, q, k, v, params=params, s_aux=sink)
        empty = 40 - 7
        assert not out.isnan().any() and not lse.isnan().any()
        assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
        want = torch.full((1, 2, empty), -math.inf, device=device) if sink is None else \
            sink[None, :, None].expand(1, 2, empty)
        assert torch.equal(lse[:, :, :empty], want)


@triton.jit
def _block_range_probe(cases, result, RANGE_FN: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """One program per case row (m_first, m_last, seqlen_q, seqlen_k, left, right)."""
    i = tl.program_id(0)
    row = cases + i * 6
    lo, full_lo, full_hi, hi = RANGE_FN(
        tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4),
        tl.load(row + 5), BLOCK_N, HAS_LEFT, HAS_RIGHT)
    tl.store(result + i * 4, lo)
    tl.store(result + i * 4 + 1, full_lo)
    tl.store(result + i * 4 + 2, full_hi)
    tl.store(result + i * 4 + 3, hi)


@pytest.mark.parametrize("side", ["key", "query"])
def test_block_ranges(common, device, side):
    """`key_block_range` (key blocks a query block sees) and its mirror `query_block_range`
    (query blocks a key block is seen by) against brute force: blocks outside [lo, hi) see
    nothing, blocks in [full_lo, full_hi) see everything, lo <= full_lo <= full_hi <= hi."""
    gen = torch.Generator().manual_seed(4)
    own, step = 16, 8  # rows of the program's own block, width of the blocks it walks
    range_fn = common.key_block_range if side == "key" else common.query_block_range
    for left, right in [(-1, -1), (-1, 0), (5, 0), (0, -1), (3, 9), (20, 2), (0, 0)]:
        cases = []
        for _ in range(40):
            seqlen_q, seqlen_k = (int(x) for x in torch.randint(1, 60, (2,), generator=gen))
            for first in range(0, seqlen_q if side == "key" else seqlen_k, own):
                last = min(first + own, seqlen_q if side == "key" else seqlen_k) - 1
                cases.append((first, last, seqlen_q, seqlen_k, left, right))
        table = torch.tensor(cases, dtype=torch.int32, device=device)
        result = torch.empty(len(cases), 4, dtype=torch.int32, device=device)
        _block_range_probe[(len(cases),)](table, result, RANGE_FN=range_fn, BLOCK_N=step,
                                          HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0)
        for (first, last, seqlen_q, seqlen_k, *_), (lo, full_lo, full_hi, hi) in zip(
                cases, result.cpu().tolist()):
            mask = visible_mask(seqlen_q, seqlen_k, left, right)
            ok = mask[first:last + 1] if side == "key" else mask.T[first:last + 1]
            walked = ok.shape[1]
            assert 0 <= lo <= full_lo <= full_hi <= hi <= -(-walked // step)
            padded = torch.zeros(ok.shape[0], hi * step + walked + step, dtype=torch.bool)
            padded[:, :walked] = ok
            blocks = padded[:, :(padded.shape[1] // step) * step].reshape(ok.shape[0], -1, step)
            where = f"case {(first, last, seqlen_q, seqlen_k, left, right)}"
            assert not blocks[:, :lo].any() and not blocks[:, hi:].any(), where
            assert blocks[:, full_lo:full_hi].all(), where


def test_import_does_not_touch_cuda():
    """Importing the kernel module (and so decorating the kernels) initialises no CUDA."""
    code = ("import sys, types, torch\n"
            f"p = types.ModuleType('fa'); p.__path__ = [{str(SOURCE_PACKAGE)!r}]\n"
            "sys.modules['fa'] = p\n"
            "import importlib; importlib.import_module('fa._triton.fwd')\n"
            "assert not torch.cuda.is_initialized()\n")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


_COMPILE_SCRIPT = """
import dataclasses, importlib, os, re, subprocess, sys, tempfile, types, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
package = types.ModuleType("fa_compile"); package.__path__ = [sys.argv[1]]
sys.modules["fa_compile"] = package
fwd = importlib.import_module("fa_compile._triton.fwd")
tuning = importlib.import_module("fa_compile._triton.tuning")
kernel = fwd._attn_fwd_kernel
SMEM = {90: 232448, 80: 166912}  # opt-in shared memory per block, bytes
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

def ptxas_usage(ptx, arch):
    # registers per thread and spill bytes, as ptxas -v reports them
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx); f.flush()
        log = subprocess.run([PTXAS, "-v", f"-arch=sm_{arch}{'a' if arch == 90 else ''}", f.name,
                              "-o", os.devnull], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\\d+) registers", log).group(1)
    spill = re.search(r"(\\d+) bytes spill stores", log).group(1)
    return f"{regs} regs, {spill} B spill stores"

def signature(kernel, const):
    sig = {}
    for name in kernel.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ("Q", "K", "V", "O"):
            sig[name] = "*bf16"
        elif name.isupper():
            sig[name] = "*i32" if name.startswith("CU_") else "*fp32"
        elif name in ("qk_scale", "softcap_log2", "dropout_rescale"):
            sig[name] = "fp32"
        elif name in ("threshold", "seed_lo", "seed_hi"):
            sig[name] = "u32"
        else:
            sig[name] = "i32"
    return sig

def compile_for(kernel, const, arch, num_warps, num_stages, label):
    sig = signature(kernel, const)
    # what the launcher's specialisation gives aligned pointers and strides
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if sig[name].startswith("*") or name.startswith("stride")}
    compiled = triton.compile(ASTSource(kernel, sig, const, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    shared = compiled.metadata.shared
    assert shared <= SMEM[arch], f"sm{arch} {label}: {shared} B shared memory"
    print(f"sm{arch} {label}: {shared} B shared memory, "
          f"{ptxas_usage(compiled.asm['ptx'], arch)}")

# (arch, head dim, every feature on, overrides of the table's tiles)
CASES = [(90, 64, True, {}), (90, 128, True, {}), (90, 256, True, {}),
         (80, 64, False, {}), (80, 128, True, {}), (80, 256, False, {}),
         (90, 64, True, dict(tma=True)), (90, 128, True, dict(tma=True)),
         (90, 128, False, dict(tma=True, warp_specialize=True)),
         (90, 256, True, dict(tma=True)),
         # sm90 head dims split into two tiles (128 + 64, 128 + 32), descriptors and pointers
         (90, 192, True, {}), (90, 192, False, dict(tma=True)), (90, 160, True, {})]
for arch, head_dim, features, override in CASES:
    tiles = dataclasses.replace(fwd.TABLE.default(f"sm{arch}", head_dim), **override)
    block_d, head_dim2, block_d2 = tuning.head_dim_split(head_dim)
    const = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=tiles.block_m,
                 BLOCK_N=tiles.block_n, GROUP=4, IS_VARLEN=features, HAS_WINDOW_LEFT=features,
                 HAS_WINDOW_RIGHT=True, SOFTCAP=features, HAS_ALIBI=features,
                 HAS_SINK=features, DROPOUT=features, TMA=tiles.tma,
                 WARP_SPECIALIZE=tiles.warp_specialize, HEAD_DIM2=head_dim2, BLOCK_D2=block_d2)
    compile_for(kernel, const, arch, tiles.num_warps, tiles.num_stages,
                f"D={head_dim} features={features} {override or 'table'} "
                f"{(tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages)}")

# the split-KV decode kernels, every feature on: 16 packed rows (GQA 4 decode) and 64 (the most)
decode = importlib.import_module("fa_compile._triton.decode")
for arch, head_dim, rows in ((90, 64, 64), (90, 128, 16), (90, 128, 64), (90, 256, 16),
                             (90, 256, 64), (80, 128, 64), (80, 256, 64)):
    cfg = decode.tiles_for(head_dim, torch.device("cuda"))  # touches no GPU
    block_d = tuning.block_d_for(head_dim)
    compile_for(decode._split_kernel,
                dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=rows, BLOCK_N=cfg.block_n,
                     GROUP=4, IS_VARLEN=True, HAS_WINDOW_LEFT=True, HAS_WINDOW_RIGHT=True,
                     SOFTCAP=True, HAS_ALIBI=True),
                arch, cfg.num_warps, cfg.num_stages, f"decode split D={head_dim} rows={rows} {cfg}")
    common = importlib.import_module("fa_compile._triton.common")
    compile_for(common.combine_kernel,
                dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=common.COMBINE_BLOCK_S,
                     IS_VARLEN=True, HAS_SINK=True, PDL=False),  # the decode path's combine
                arch, 4, 1, f"split combine D={head_dim}")
"""


def test_compiles_for_gpu_targets():
    """The interpreter skips Triton's compiler (which, e.g., rejects non-constexpr globals):
    compile the kernel for sm90 and sm80 with the table's tiles, and the tensor-descriptor
    (and warp-specialised) variants for sm90, no GPU needed (ptxas ships with Triton); check
    the shared memory fits. ``pytest -s`` prints each variant's registers and spills."""
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(SOURCE_PACKAGE)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    print(result.stdout)


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes, bf16 and fp16.
# ---------------------------------------------------------------------------------------------

GPU_CASES = {
    "d64_s1k": dict(batch=4, seqlen_q=1024, seqlen_k=1024, heads_q=8, heads_kv=8, head_dim=64),
    "d128_s2k_causal": dict(batch=2, seqlen_q=2048, seqlen_k=2048, heads_q=8, heads_kv=8,
                            head_dim=128, causal=True),
    "d128_gqa_causal_sq_ne_sk": dict(batch=2, seqlen_q=777, seqlen_k=1500, heads_q=16,
                                     heads_kv=4, head_dim=128, causal=True),
    "d128_decode": dict(batch=8, seqlen_q=1, seqlen_k=4099, heads_q=32, heads_kv=8,
                        head_dim=128, causal=True),
    "d256_window_sink": dict(batch=2, seqlen_q=1023, seqlen_k=1023, heads_q=4, heads_kv=2,
                             head_dim=256, window=(255, 0), sink=True),
    "d96_softcap_alibi": dict(batch=2, seqlen_q=1000, seqlen_k=1000, heads_q=8, heads_kv=8,
                              head_dim=96, softcap=30.0, alibi="head", causal=True),
    "d128_dropout_transposed": dict(batch=2, seqlen_q=513, seqlen_k=513, heads_q=8, heads_kv=8,
                                    head_dim=128, dropout_p=0.1, seed=42, layout="transposed"),
    # the longest sequence-length bucket of the tuning file (its own tiles on a tuned GPU)
    "d128_s4500_gqa": dict(batch=1, seqlen_q=4500, seqlen_k=4500, heads_q=8, heads_kv=2,
                           head_dim=128),
    # a split head dim (128 + 64 on sm90+) on its own width's tiles where the GPU has them
    "d192_s3000_gqa_causal": dict(batch=1, seqlen_q=3000, seqlen_k=3000, heads_q=8, heads_kv=2,
                                  head_dim=192, causal=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_realistic(fwd, attn_params, dtype, name):
    if not torch.cuda.is_available() or interpreted(fwd._attn_fwd_kernel):
        pytest.skip("needs a CUDA GPU and the compiled (not interpreted) kernel")
    torch.manual_seed(5)
    run_case(fwd, attn_params, torch.device("cuda"), dtype, GPU_CASES[name])


@pytest.mark.gpu
@pytest.mark.parametrize("lens_q,lens_k", [([1, 700, 0, 333, 1024], [900, 700, 5, 1000, 1024]),
                                           ([1, 2100, 0, 333], [900, 2100, 5, 1000])],
                         ids=["max1024", "max2100"])  # two sequence-length buckets
def test_gpu_varlen_bf16(fwd, attn_params, lens_q, lens_k):
    if not torch.cuda.is_available() or interpreted(fwd._attn_fwd_kernel):
        pytest.skip("needs a CUDA GPU and the compiled (not interpreted) kernel")
    torch.manual_seed(6)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv(lens_q, lens_k, 16, 4, 128,
                                                        dtype=torch.bfloat16, device="cuda")
    params = make_params(attn_params, head_dim=128, causal=True, max_seqlen_q=max_q,
                         max_seqlen_k=max_k)
    out, lse = run_forward(fwd, q, k, v, params=params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    check_against_reference(q, k, v, out, lse, params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
