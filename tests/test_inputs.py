"""Every bad input raises TypeError/ValueError naming the argument, what was given and what is
accepted, before any backend runs (the dispatcher is replaced by one that fails the test)."""

from __future__ import annotations

import math

import pytest
import torch

import numpy as np

from helpers import cu_seqlens, make_qkv, make_varlen_qkv, submodule


@pytest.fixture
def api(flash_attn, monkeypatch):
    """The package with its backend choice replaced: reaching a backend fails the test."""
    def reached(*args, **kwargs):
        raise AssertionError("a backend was reached before the input was rejected")

    monkeypatch.setattr(submodule(flash_attn, "_dispatch"), "select_backend", reached)
    return flash_attn


def _batched(**overrides):
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 5, 7, 4, 2, 32)
    args = dict(q=q, k=k, v=v)
    args.update(overrides)
    return args


def _varlen(**overrides):
    torch.manual_seed(0)
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([3, 4], [5, 2], 4, 2, 32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
                max_seqlen_k=mk)
    args.update(overrides)
    return args


def _f16(*shape):
    return torch.randn(*shape, dtype=torch.float16)


# (id, arguments, exception, argument name the message must start with)
BATCHED = [
    ("q_not_tensor", lambda: _batched(q=[[1.0]]), TypeError, "q"),
    ("q_float32", lambda: _batched(q=torch.randn(2, 5, 4, 32)), TypeError, "q"),
    ("qkv_float32", lambda: _batched(q=torch.randn(2, 5, 4, 32), k=torch.randn(2, 7, 2, 32),
                                     v=torch.randn(2, 7, 2, 32)), TypeError, "q"),
    ("k_bf16_q_fp16", lambda: _batched(k=torch.randn(2, 7, 2, 32, dtype=torch.bfloat16)),
     TypeError, "k"),
    ("v_bf16_q_fp16", lambda: _batched(v=torch.randn(2, 7, 2, 32, dtype=torch.bfloat16)),
     TypeError, "v"),
    ("k_on_meta", lambda: _batched(k=torch.empty(2, 7, 2, 32, dtype=torch.float16,
                                                 device="meta")), ValueError, "k"),
    ("q_rank_3", lambda: _batched(q=_f16(5, 4, 32)), ValueError, "q"),
    ("k_rank_5", lambda: _batched(k=_f16(1, 2, 7, 2, 32)), ValueError, "k"),
    ("k_batch", lambda: _batched(k=_f16(3, 7, 2, 32), v=_f16(3, 7, 2, 32)), ValueError, "k"),
    ("v_shape", lambda: _batched(v=_f16(2, 6, 2, 32)), ValueError, "v"),
    ("k_head_dim", lambda: _batched(k=_f16(2, 7, 2, 16), v=_f16(2, 7, 2, 16)), ValueError,
     "k"),
    ("head_ratio", lambda: _batched(k=_f16(2, 7, 3, 32), v=_f16(2, 7, 3, 32)), ValueError, "k"),
    ("head_dim_over_256", lambda: _batched(q=_f16(1, 2, 1, 264), k=_f16(1, 2, 1, 264),
                                           v=_f16(1, 2, 1, 264)), ValueError, "q"),
    ("head_dim_zero", lambda: _batched(q=_f16(2, 5, 4, 0), k=_f16(2, 7, 2, 0),
                                       v=_f16(2, 7, 2, 0)), ValueError, "q"),
    ("window_left", lambda: _batched(window_size=(-2, 0)), ValueError, "window_size[0]"),
    ("window_right", lambda: _batched(window_size=(4, -5)), ValueError, "window_size[1]"),
    ("window_float", lambda: _batched(window_size=(4.0, 0)), TypeError, "window_size[0]"),
    ("window_scalar", lambda: _batched(window_size=4), TypeError, "window_size"),
    ("window_triple", lambda: _batched(window_size=(1, 2, 3)), TypeError, "window_size"),
    ("window_string", lambda: _batched(window_size="ab"), TypeError, "window_size"),
    ("window_tensor_3", lambda: _batched(window_size=torch.tensor([1, 2, 3])), TypeError,
     "window_size"),
    ("window_tensor_2d", lambda: _batched(window_size=torch.tensor([[1, 2]])), TypeError,
     "window_size"),
    ("window_float_tensor", lambda: _batched(window_size=torch.tensor([1.5, 2.0])), TypeError,
     "window_size[0]"),
    ("window_tensor_left", lambda: _batched(window_size=torch.tensor([-3, 0])), ValueError,
     "window_size[0]"),
    ("window_numpy_float", lambda: _batched(window_size=np.array([4.0, 1.0])), TypeError,
     "window_size[0]"),
    ("softcap_inf", lambda: _batched(softcap=math.inf), ValueError, "softcap"),
    ("softcap_nan", lambda: _batched(softcap=math.nan), ValueError, "softcap"),
    ("softcap_none", lambda: _batched(softcap=None), TypeError, "softcap"),
    ("dropout_one", lambda: _batched(dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout_negative", lambda: _batched(dropout_p=-0.1), ValueError, "dropout_p"),
    ("dropout_nan", lambda: _batched(dropout_p=math.nan), ValueError, "dropout_p"),
    ("dropout_1d_tensor", lambda: _batched(dropout_p=torch.tensor([0.1])), TypeError,
     "dropout_p"),
    ("dropout_0d_tensor_one", lambda: _batched(dropout_p=torch.tensor(1.0)), ValueError,
     "dropout_p"),
    ("dropout_bool_tensor", lambda: _batched(dropout_p=torch.tensor(True)), TypeError,
     "dropout_p"),
    ("scale_zero", lambda: _batched(softmax_scale=0.0), ValueError, "softmax_scale"),
    ("scale_negative", lambda: _batched(softmax_scale=-0.1), ValueError, "softmax_scale"),
    ("scale_inf", lambda: _batched(softmax_scale=math.inf), ValueError, "softmax_scale"),
    ("scale_nan", lambda: _batched(softmax_scale=math.nan), ValueError, "softmax_scale"),
    ("scale_string", lambda: _batched(softmax_scale="0.1"), TypeError, "softmax_scale"),
    ("scale_numpy_negative", lambda: _batched(softmax_scale=np.float32(-0.5)), ValueError,
     "softmax_scale"),
    ("scale_numpy_1d", lambda: _batched(softmax_scale=np.array([0.5])), TypeError,
     "softmax_scale"),
    ("scale_complex_tensor", lambda: _batched(softmax_scale=torch.tensor(1j)), TypeError,
     "softmax_scale"),
    ("causal_string", lambda: _batched(causal="yes"), TypeError, "causal"),
    ("deterministic_none", lambda: _batched(deterministic=None), TypeError, "deterministic"),
    ("return_attn_probs_int", lambda: _batched(return_attn_probs=2), TypeError,
     "return_attn_probs"),
    ("alibi_fp16", lambda: _batched(alibi_slopes=torch.ones(4, dtype=torch.float16)),
     TypeError, "alibi_slopes"),
    ("alibi_shape", lambda: _batched(alibi_slopes=torch.ones(2)), ValueError, "alibi_slopes"),
    ("alibi_batch", lambda: _batched(alibi_slopes=torch.ones(3, 4)), ValueError,
     "alibi_slopes"),
    ("alibi_list", lambda: _batched(alibi_slopes=[0.1] * 4), TypeError, "alibi_slopes"),
    ("alibi_device", lambda: _batched(alibi_slopes=torch.ones(4, device="meta")), ValueError,
     "alibi_slopes"),
    ("s_aux_shape", lambda: _batched(s_aux=torch.zeros(2)), ValueError, "s_aux"),
    ("s_aux_2d", lambda: _batched(s_aux=torch.zeros(1, 4)), ValueError, "s_aux"),
    ("s_aux_int", lambda: _batched(s_aux=torch.zeros(4, dtype=torch.int32)), TypeError,
     "s_aux"),
    ("s_aux_device", lambda: _batched(s_aux=torch.zeros(4, device="meta")), ValueError,
     "s_aux"),
]

VARLEN = [
    ("q_rank_4", lambda: _varlen(q=_f16(1, 7, 4, 32)), ValueError, "q"),
    ("k_total", lambda: _varlen(k=_f16(6, 2, 32), v=_f16(6, 2, 32)), ValueError,
     "cu_seqlens_k"),
    ("cu_q_int64", lambda: _varlen(cu_seqlens_q=cu_seqlens([3, 4]).long()), TypeError,
     "cu_seqlens_q"),
    ("cu_k_float", lambda: _varlen(cu_seqlens_k=cu_seqlens([5, 2]).float()), TypeError,
     "cu_seqlens_k"),
    ("cu_q_list", lambda: _varlen(cu_seqlens_q=[0, 3, 7]), TypeError, "cu_seqlens_q"),
    ("cu_q_2d", lambda: _varlen(cu_seqlens_q=cu_seqlens([3, 4])[None]), ValueError,
     "cu_seqlens_q"),
    ("cu_q_too_short", lambda: _varlen(cu_seqlens_q=torch.zeros(1, dtype=torch.int32)),
     ValueError, "cu_seqlens_q"),
    ("cu_lengths_differ", lambda: _varlen(cu_seqlens_k=cu_seqlens([5, 1, 1])), ValueError,
     "cu_seqlens_k"),
    ("cu_q_start", lambda: _varlen(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)),
     ValueError, "cu_seqlens_q"),
    ("cu_k_decreasing", lambda: _varlen(cu_seqlens_k=torch.tensor([0, 5, 4, 7],
                                                                  dtype=torch.int32),
                                        cu_seqlens_q=cu_seqlens([3, 4, 0])),
     ValueError, "cu_seqlens_k"),
    ("cu_q_end", lambda: _varlen(cu_seqlens_q=cu_seqlens([3, 5])), ValueError,
     "cu_seqlens_q"),
    ("cu_k_device", lambda: _varlen(cu_seqlens_k=torch.zeros(3, dtype=torch.int32,
                                                              device="meta")), ValueError,
     "cu_seqlens_k"),
    ("max_q_small", lambda: _varlen(max_seqlen_q=3), ValueError, "max_seqlen_q"),
    ("max_k_small", lambda: _varlen(max_seqlen_k=torch.tensor(4)), ValueError, "max_seqlen_k"),
    ("max_q_negative", lambda: _varlen(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
    ("max_q_float", lambda: _varlen(max_seqlen_q=4.0), TypeError, "max_seqlen_q"),
    ("max_k_float_tensor", lambda: _varlen(max_seqlen_k=torch.tensor(5.0)), TypeError,
     "max_seqlen_k"),
    ("max_k_1d_tensor", lambda: _varlen(max_seqlen_k=torch.tensor([5])), TypeError,
     "max_seqlen_k"),
    ("max_q_numpy_float", lambda: _varlen(max_seqlen_q=np.float64(4.0)), TypeError,
     "max_seqlen_q"),
    ("alibi_batch", lambda: _varlen(alibi_slopes=torch.ones(3, 4)), ValueError,
     "alibi_slopes"),
    ("s_aux_shape", lambda: _varlen(s_aux=torch.zeros(5)), ValueError, "s_aux"),
    ("window_left", lambda: _varlen(window_size=(-3, -1)), ValueError, "window_size[0]"),
    ("dropout_one", lambda: _varlen(dropout_p=1.0), ValueError, "dropout_p"),
]


def _check_message(err: Exception, name: str) -> None:
    message = str(err)
    assert message.startswith(f"{name}: got "), message
    assert "; expected " in message, message


def _ids(cases):
    return [case[0] for case in cases]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("case", BATCHED, ids=_ids(BATCHED))
def test_batched_rejects(api, case):
    _, make_args, exc, name = case
    with pytest.raises(exc) as info:
        api.flash_attn_func(**make_args())
    _check_message(info.value, name)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("case", VARLEN, ids=_ids(VARLEN))
def test_varlen_rejects(api, case):
    _, make_args, exc, name = case
    with pytest.raises(exc) as info:
        api.flash_attn_varlen_func(**make_args())
    _check_message(info.value, name)


@pytest.mark.kernels_ci
def test_rejection_leaves_the_rng_alone(api):
    args = _batched(dropout_p=0.5, window_size=(-2, 0))
    state = torch.get_rng_state()
    with pytest.raises(ValueError):
        api.flash_attn_func(**args)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.kernels_ci
def test_accepted_edge_values(flash_attn):
    """Values at the edge of what is accepted go through."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 3, 4, 2, 1, 8)
    flash_attn.flash_attn_func(q, k, v, window_size=[0, 0], softcap=1, dropout_p=0,
                               softmax_scale=1, s_aux=torch.zeros(2, dtype=torch.float64))
    flash_attn.flash_attn_func(q, k, v, window_size=np.array([3, 0]), softcap=np.float16(2),
                               dropout_p=torch.tensor(0.0), softmax_scale=np.array(0.5),
                               causal=np.bool_(True), deterministic=torch.tensor(False))
    q, k, v = make_qkv(1, 2, 2, 1, 1, 256)
    flash_attn.flash_attn_func(q, k, v)
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([2, 0, 1], [0, 3, 1], 2, 2, 16)
    flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq + 5, torch.tensor(mk + 1),
                                      alibi_slopes=torch.ones(3, 2))


@pytest.mark.kernels_ci
def test_scalar_memo_never_hides_a_bad_value(flash_attn, monkeypatch):
    """[Note: scalar memo]: a good call's scalars are reused, yet the same value of another type,
    or a bad value after good ones, is still checked and refused."""
    validate = submodule(flash_attn, "_validate")
    calls = []
    checked = validate.memo_plain_scalars(lambda a, *, b: calls.append((a, b)) or (a, b))
    assert checked(1, b=(2, 3)) == (1, (2, 3)) and checked(1, b=(2, 3)) == (1, (2, 3))
    assert len(calls) == 1  # the second call was a hit
    checked(True, b=(2, 3))  # True == 1, but not the same type: checked again
    checked(1, b=[2, 3])
    checked(np.int64(1), b=(2, 3))  # not plain: never memoised
    checked(np.int64(1), b=(2, 3))
    assert len(calls) == 5
    for _ in range(2):  # a good call is memoised, then bad values still raise every time
        flash_attn.flash_attn_func(**_batched(causal=True, softcap=0.0, window_size=(-1, -1)))
    def reached(*args, **kwargs):
        raise AssertionError("a backend was reached with a bad value")

    monkeypatch.setattr(submodule(flash_attn, "_dispatch"), "select_backend", reached)
    for bad, exc in (dict(causal=1), TypeError), (dict(softcap=math.nan), ValueError), (
            dict(window_size=(-2, 0)), ValueError), (dict(softmax_scale=0.0), ValueError):
        for _ in range(2):
            with pytest.raises(exc):
                flash_attn.flash_attn_func(**_batched(**bad))


# -- backend selection --------------------------------------------------------------------

@pytest.mark.kernels_ci
def test_backend_variable_invalid(flash_attn, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "tpu")
    q, k, v = make_qkv(1, 2, 2, 1, 1, 8)
    with pytest.raises(ValueError, match=r"^FLASH_ATTN_HUB_BACKEND: got 'tpu'; expected"):
        flash_attn.flash_attn_func(q, k, v)


@pytest.mark.kernels_ci
def test_triton_on_cpu_needs_the_interpreter(flash_attn, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = make_qkv(1, 2, 2, 1, 1, 8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        flash_attn.flash_attn_func(q, k, v)


@pytest.mark.kernels_ci
def test_cuda_backend_on_cpu_tensors(flash_attn, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cuda")
    q, k, v = make_qkv(1, 2, 2, 1, 1, 8)
    with pytest.raises(ValueError, match="FLASH_ATTN_HUB_BACKEND=cuda"):
        flash_attn.flash_attn_func(q, k, v)


# -- CUDA tensors: value checks read cu_seqlens from the device once per tensor ------------

def test_tensor_version_follows_in_place_writes_and_skips_inference_tensors(flash_attn):
    """The version rule both host-read caches use (``_host_values``, the kv-cache value
    checks): the same object, unchanged, matches; a write through a view, another object of
    the same values and a dead reference do not; an inference tensor has no version (reading
    ``_version`` of one raises), so nothing can be cached for it."""
    validate = submodule(flash_attn, "_validate")
    base = torch.arange(6, dtype=torch.int32)
    t = base[:3]
    held = validate.tensor_version(t)
    assert validate.same_version(held, t)
    assert not validate.same_version(held, t.clone())
    assert not validate.same_version(None, t)
    base[0] = 7
    assert not validate.same_version(held, t)
    gone = validate.tensor_version(torch.zeros(2))
    assert gone[0]() is None and not validate.same_version(gone, torch.zeros(2))
    with torch.inference_mode():
        frozen = torch.arange(3)
    assert validate.tensor_version(frozen) is None
    assert not validate.same_version(held, frozen)


@pytest.mark.gpu
def test_cuda_host_values_of_an_inference_tensor(flash_attn):
    """A CUDA tensor made under ``torch.inference_mode`` (no version counter) is read every
    call instead of raising, and varlen calls given such cu_seqlens still check them."""
    validate = submodule(flash_attn, "_validate")
    with torch.inference_mode():
        t = torch.arange(3, dtype=torch.int32, device="cuda")
        assert validate.host_values(t) == [0, 1, 2]
        t[0] = 5
        assert validate.host_values(t) == [5, 1, 2]
        q, k, v, cq, ck, mq, mk = make_varlen_qkv([3, 4], [5, 2], 4, 2, 32, device="cuda")
        flash_attn.flash_attn_varlen_func(q, k, v, cq.clone(), ck.clone(), mq, mk)
        with pytest.raises(ValueError) as info:
            flash_attn.flash_attn_varlen_func(q, k, v, cq.clone(), ck.clone(), 3, mk)
        _check_message(info.value, "max_seqlen_q")


@pytest.mark.gpu
def test_cuda_cu_seqlens_checked_and_cache_follows_writes(flash_attn):
    torch.manual_seed(0)
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([3, 4], [5, 2], 4, 2, 32, device="cuda")
    flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk)
    with pytest.raises(ValueError) as info:
        flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 3, mk)
    _check_message(info.value, "max_seqlen_q")
    cq[1] = 5  # an in-place write must invalidate the cached host copy
    with pytest.raises(ValueError) as info:
        flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk)
    _check_message(info.value, "max_seqlen_q")
    bad = torch.tensor([0, 4, 3], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError) as info:
        flash_attn.flash_attn_varlen_func(q, k, v, bad, ck, mq, mk)
    _check_message(info.value, "cu_seqlens_q")
