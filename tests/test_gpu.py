"""The full feature matrix on a GPU at realistic sizes, through the public API, for each
GPU backend (``triton`` forced, and ``auto``, which routes the forward to the CUDA kernel
where it covers the configuration). Skipped without CUDA."""

import pytest
import torch

from helpers import assert_matches_reference, make_qkv, make_varlen_qkv, run_api
from test_kvcache import Case, run_case

pytestmark = pytest.mark.gpu

HEADS = {"mha": (8, 8), "gqa4": (16, 4), "gqa8": (32, 4), "mqa": (8, 1)}
FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(255, 255)),
    "softcap": dict(softcap=30.0),
    "alibi": dict(causal=True, alibi=True),
    "sink": dict(causal=True, sink=True),
    "dropout": dict(dropout_p=0.1),
}


def _features(heads_q, spec, device):
    spec = dict(spec)
    s_aux = None
    if spec.pop("alibi", False):
        spec["alibi_slopes"] = torch.rand(heads_q, device=device, dtype=torch.float32)
    if spec.pop("sink", False):
        s_aux = torch.randn(heads_q, device=device, dtype=torch.float32, requires_grad=True)
    return spec, s_aux


def _reference_kwargs(kwargs, seed):
    ref = {k: v for k, v in kwargs.items() if k != "deterministic"}
    if ref.get("dropout_p", 0.0) > 0:
        ref["seed"] = seed
    return ref


def _dropout_seed():
    """The seed the API draws for the next dropout call (it uses the CPU generator)."""
    state = torch.random.get_rng_state()
    seed = int(torch.randint(0, 2**63 - 1, (), device="cpu", dtype=torch.int64))
    torch.random.set_rng_state(state)
    return seed


@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_batched_matrix(flash_attn, monkeypatch, backend, dtype, heads, feature):
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", backend)
    torch.manual_seed(hash((backend, heads, feature)) % 2**31)
    heads_q, heads_kv = HEADS[heads]
    head_dim = {"mha": 64, "gqa4": 128, "gqa8": 128, "mqa": 256}[heads]
    seqlen_q, seqlen_k = (1023, 1023) if feature != "causal" else (511, 1023)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=dtype,
                       device="cuda", requires_grad=True, transposed=feature == "softcap")
    kwargs, s_aux = _features(heads_q, FEATURES[feature], "cuda")
    seed = _dropout_seed()
    ours, dout = run_api(flash_attn.flash_attn_func, q, k, v, s_aux=s_aux, **kwargs)
    assert_matches_reference(ours, q, k, v, dout=dout, s_aux=s_aux, **_reference_kwargs(kwargs, seed))


@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_varlen(flash_attn, monkeypatch, backend, head_dim):
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", backend)
    torch.manual_seed(head_dim)
    lengths_q = [0, 1, 17, 300, 1023, 113]
    lengths_k = [5, 1, 17, 300, 1500, 239]
    q, k, v, cu_q, cu_k, _, _ = make_varlen_qkv(lengths_q, lengths_k, 16, 4, head_dim,
                                                dtype=torch.bfloat16, device="cuda",
                                                requires_grad=True)
    ours, dout = run_api(flash_attn.flash_attn_varlen_func, q, k, v, cu_q, cu_k,
                         max(lengths_q), max(lengths_k), causal=True)
    assert_matches_reference(ours, q, k, v, dout=dout, causal=True, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k)


@pytest.mark.parametrize("heads", ["gqa8", "mqa"])
def test_deterministic_bitwise(flash_attn, heads):
    torch.manual_seed(7)
    heads_q, heads_kv = HEADS[heads]
    q, k, v = make_qkv(2, 2048, 2048, heads_q, heads_kv, 128, dtype=torch.bfloat16, device="cuda",
                       requires_grad=True)
    dout = torch.randn(2, 2048, heads_q, 128, device="cuda", dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        out = flash_attn.flash_attn_func(q, k, v, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for first, second in zip(*grads):
        assert torch.equal(first, second)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_decode_gqa(flash_attn, monkeypatch, backend):
    """Triton runs this on its split-KV decode kernels, auto on the CUDA forward (sm90)."""
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", backend)
    torch.manual_seed(3)
    q, k, v = make_qkv(4, 1, 8192, 32, 8, 128, dtype=torch.bfloat16, device="cuda",
                       requires_grad=False)
    ours, _ = run_api(flash_attn.flash_attn_func, q, k, v, causal=True)
    assert_matches_reference(ours, q, k, v, causal=True)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_decode_varlen_gqa_with_sinks(flash_attn, monkeypatch, backend):
    """Generate on a padded batch: varlen with one or two new queries per sequence against
    caches of different lengths (an empty one among them), sinks, GQA 32/8."""
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", backend)
    torch.manual_seed(4)
    lens_q, lens_k = [1, 2, 1, 0, 1], [5000, 1200, 1, 300, 8191]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv(lens_q, lens_k, 32, 8, 128,
                                                        dtype=torch.bfloat16, device="cuda")
    s_aux = torch.randn(32, device="cuda", dtype=torch.float32)
    ours, _ = run_api(flash_attn.flash_attn_varlen_func, q, k, v, cu_q, cu_k, max_q, max_k,
                      causal=True, s_aux=s_aux)
    assert_matches_reference(ours, q, k, v, causal=True, s_aux=s_aux, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_tensors_on_a_device_that_is_not_current(flash_attn, monkeypatch, backend):
    """[Note: the launching device] in _custom_ops.py: with cuda:0 current, a forward and
    backward on cuda:1 tensors and a kv-cache decode step there match the oracle, and the
    current device stays cuda:0."""
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", backend)
    torch.cuda.set_device(0)
    torch.manual_seed(11)
    q, k, v = make_qkv(2, 300, 700, 16, 4, 128, dtype=torch.bfloat16, device="cuda:1",
                       requires_grad=True)
    ours, dout = run_api(flash_attn.flash_attn_func, q, k, v, causal=True)
    assert torch.cuda.current_device() == 0
    assert all(t.device == q.device for t in ours.values())
    assert_matches_reference(ours, q, k, v, dout=dout, causal=True)
    monkeypatch.setenv("FLASH_ATTN_HUB_CHECK_VALUES", "0")  # so that a lane can be taken
    for _ in range(2):  # a repeated shape (off the current device no lane is made)
        run_case(flash_attn, Case(page_size=16, lengths=(40, 7), heads=(16, 4), head_dim=128,
                                  dtype=torch.bfloat16), device="cuda:1")
        assert torch.cuda.current_device() == 0
