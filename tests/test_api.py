"""The public API as callers see it: flash-attn 2 signatures, return values, the layouts
transformers sends, dropout seeding, backend dispatch, and forward+backward through the
built package against the float64 reference (tolerance rule) on CPU."""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from helpers import (assert_matches_reference, cu_seqlens, make_qkv, make_varlen_qkv, run_api,
                     submodule)
from flash_attn_hub.reference import attention_reference

# flash-attn 2 (2.8), in order, plus `s_aux` (sinks, as vllm's flash-attn 3 names it) last.
FUNC_PARAMS = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty),
    ("v", inspect.Parameter.empty), ("dropout_p", 0.0), ("softmax_scale", None),
    ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
    ("deterministic", False), ("return_attn_probs", False), ("s_aux", None),
]
VARLEN_PARAMS = FUNC_PARAMS[:3] + [
    ("cu_seqlens_q", inspect.Parameter.empty), ("cu_seqlens_k", inspect.Parameter.empty),
    ("max_seqlen_q", inspect.Parameter.empty), ("max_seqlen_k", inspect.Parameter.empty),
] + FUNC_PARAMS[3:] + [("block_table", None)]  # paged prefill, as flash-attn 2 has it
_QKV = [("qkv", inspect.Parameter.empty)]
_Q_KV = [("q", inspect.Parameter.empty), ("kv", inspect.Parameter.empty)]
SIGNATURES = {
    "flash_attn_func": FUNC_PARAMS,
    "flash_attn_varlen_func": VARLEN_PARAMS,
    "flash_attn_qkvpacked_func": _QKV + FUNC_PARAMS[3:],
    "flash_attn_kvpacked_func": _Q_KV + FUNC_PARAMS[3:],
    "flash_attn_varlen_qkvpacked_func": _QKV + [
        ("cu_seqlens", inspect.Parameter.empty), ("max_seqlen", inspect.Parameter.empty),
    ] + FUNC_PARAMS[3:],
    "flash_attn_varlen_kvpacked_func": _Q_KV + VARLEN_PARAMS[3:-1],
}


def _signature(fn):
    params = inspect.signature(fn).parameters.values()
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params), (
        "every parameter must be an explicit positional-or-keyword parameter (no *args/**kwargs)")
    return [(p.name, p.default) for p in params]


@pytest.mark.kernels_ci
def test_exports(flash_attn):
    assert sorted(flash_attn.__all__) == sorted([*SIGNATURES, "flash_attn_with_kvcache"])
    interface = flash_attn.flash_attn_interface  # an attribute, as diffusers reads it
    assert sorted(interface.__all__) == sorted([*SIGNATURES, "flash_attn_with_kvcache"])
    for name in flash_attn.__all__:
        assert callable(getattr(flash_attn, name))
        assert getattr(interface, name) is getattr(flash_attn, name)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signature_is_flash_attn_2(flash_attn, name):
    assert _signature(getattr(flash_attn, name)) == SIGNATURES[name]


def test_import_loads_no_backend(flash_attn):
    """Importing the package must not import a kernel module (they may touch CUDA/autotune)."""
    root = Path(flash_attn.__file__).parents[2]
    code = (
        "import sys; from pathlib import Path; import kernels\n"
        f"m = kernels.get_local_kernel(Path({str(root)!r}))\n"
        "loaded = sorted(n for n in sys.modules if n.startswith(m.__name__ + '._'))\n"
        "print(','.join(loaded))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    loaded = {name.split(".", 1)[1] for name in done.stdout.strip().split(",") if name}
    assert not {name for name in loaded
                if name.split(".")[0] in ("_cpu", "_cuda", "_triton")}, loaded


@pytest.mark.kernels_ci
def test_return_values(flash_attn):
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 5, 7, 4, 2, 32)
    out = flash_attn.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
    out2, lse, probs = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert probs is None and torch.equal(out, out2)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 5)

    q, k, v, cq, ck, mq, mk = make_varlen_qkv([3, 1, 4], [2, 6, 5], 4, 2, 32)
    out, lse, probs = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk,
                                                        return_attn_probs=True)
    assert out.shape == q.shape and probs is None
    assert lse.dtype == torch.float32 and lse.shape == (4, 8)


@pytest.mark.kernels_ci
def test_lse_is_not_differentiable(flash_attn):
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 4, 4, 2, 2, 16, requires_grad=True)
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad


@pytest.mark.kernels_ci
def test_transposed_views_and_contiguous_output(flash_attn):
    """transformers passes (B, H, S, D) tensors transposed to (B, S, H, D)."""
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 9, 11, 4, 2, 64, transposed=True, requires_grad=True)
    assert not q.is_contiguous() and q.stride(-1) == 1
    ours, dout = run_api(flash_attn.flash_attn_func, q, k, v, causal=True)
    assert ours["out"].is_contiguous()
    assert_matches_reference(ours, q, k, v, dout=dout, causal=True)


@pytest.mark.kernels_ci
def test_varlen_transposed_output_views_back(flash_attn):
    """transformers `.view`s the varlen output to (B, S, H, D): it must be contiguous."""
    torch.manual_seed(0)
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([6, 6], [6, 6], 4, 1, 32, transposed=True)
    assert not q.is_contiguous()
    out = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=True)
    assert out.view(2, -1, 4, 32).shape == (2, 6, 4, 32)


@pytest.mark.kernels_ci
def test_max_seqlen_as_0d_tensor(flash_attn):
    torch.manual_seed(0)
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([5, 2], [3, 7], 2, 2, 16)
    as_int = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=True)
    as_tensor = flash_attn.flash_attn_varlen_func(
        q, k, v, cq, ck, torch.tensor(mq, dtype=torch.int32), torch.tensor(mk), causal=True)
    assert torch.equal(as_int, as_tensor)


@pytest.mark.kernels_ci
def test_causal_forces_right_window_to_zero(flash_attn):
    """transformers sends a symmetric window (w - 1, w - 1) together with causal=True."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 12, 12, 2, 2, 16)
    sent = flash_attn.flash_attn_func(q, k, v, causal=True, window_size=(3, 3))
    meant = flash_attn.flash_attn_func(q, k, v, window_size=(3, 0))
    assert torch.equal(sent, meant)
    assert_matches_reference({"out": sent}, q, k, v, window_size=(3, 0))


@pytest.mark.kernels_ci
def test_empty_query(flash_attn):
    q, k, v = make_qkv(2, 0, 5, 2, 2, 16, requires_grad=True)
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert dq.shape == q.shape and not dk.any() and not dv.any()


# -- dropout ------------------------------------------------------------------------------

def _drawn_seed(manual_seed: int) -> int:
    """The seed the API draws after ``torch.manual_seed(manual_seed)``: one
    ``torch.randint(0, 2**63 - 1, ())`` on the default CPU generator."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


@pytest.mark.kernels_ci
def test_dropout_seed_follows_torch_manual_seed(flash_attn):
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 7, 9, 2, 1, 16, requires_grad=True)
    torch.manual_seed(1234)
    first = flash_attn.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(1234)
    again = flash_attn.flash_attn_func(q, k, v, dropout_p=0.3)
    other = flash_attn.flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(first, again) and not torch.equal(first, other)

    seed = _drawn_seed(1234)
    torch.manual_seed(1234)
    ours, dout = run_api(flash_attn.flash_attn_func, q, k, v, dropout_p=0.3, causal=True)
    assert_matches_reference(ours, q, k, v, dout=dout, dropout_p=0.3, seed=seed, causal=True)


@pytest.mark.kernels_ci
def test_no_dropout_leaves_the_rng_alone(flash_attn):
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 4, 4, 2, 2, 16)
    state = torch.get_rng_state()
    flash_attn.flash_attn_func(q, k, v, dropout_p=0.0)
    assert torch.equal(state, torch.get_rng_state())


def test_varlen_dropout_matches_reference(flash_attn):
    torch.manual_seed(0)
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([4, 9, 1], [6, 3, 8], 4, 2, 32,
                                              requires_grad=True)
    seed = _drawn_seed(99)
    torch.manual_seed(99)
    ours, dout = run_api(flash_attn.flash_attn_varlen_func, q, k, v, cq, ck, mq, mk,
                         dropout_p=0.2)
    assert_matches_reference(ours, q, k, v, dout=dout, dropout_p=0.2, seed=seed,
                             cu_seqlens_q=cq, cu_seqlens_k=ck)


# -- end to end on CPU --------------------------------------------------------------------

HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (5, 2)},
    "causal_window_softcap": {"causal": True, "window_size": (7, 7), "softcap": 5.0},
    "scale_alibi": {"softmax_scale": 0.3, "alibi_slopes": "per_head"},
    "sink": {"s_aux": True, "causal": True},
}


def _features(name, heads_q, batch):
    kwargs = dict(FEATURES[name])
    if kwargs.get("alibi_slopes") == "per_head":
        kwargs["alibi_slopes"] = torch.rand(batch, heads_q, dtype=torch.float32) * 0.5
    if kwargs.pop("s_aux", False):
        kwargs["s_aux"] = torch.randn(heads_q, dtype=torch.float32).requires_grad_(True)
    return kwargs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_batched_end_to_end(flash_attn, heads, feature, dtype):
    torch.manual_seed(11)
    heads_q, heads_kv = HEADS[heads]
    q, k, v = make_qkv(2, 17, 23, heads_q, heads_kv, 64, dtype=dtype, transposed=True,
                       requires_grad=True)
    kwargs = _features(feature, heads_q, 2)
    ours, dout = run_api(flash_attn.flash_attn_func, q, k, v, **kwargs)
    assert_matches_reference(ours, q, k, v, dout=dout, **kwargs)


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_varlen_end_to_end(flash_attn, heads, feature):
    torch.manual_seed(12)
    heads_q, heads_kv = HEADS[heads]
    seqlens_q, seqlens_k = [1, 17, 0, 8], [9, 13, 4, 8]
    q, k, v, cq, ck, mq, mk = make_varlen_qkv(seqlens_q, seqlens_k, heads_q, heads_kv, 32,
                                              requires_grad=True)
    kwargs = _features(feature, heads_q, len(seqlens_q))
    ours, dout = run_api(flash_attn.flash_attn_varlen_func, q, k, v, cq, ck, mq, mk, **kwargs)
    assert_matches_reference(ours, q, k, v, dout=dout, cu_seqlens_q=cq, cu_seqlens_k=ck,
                             **kwargs)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
def test_end_to_end_ci(flash_attn, heads):
    """The cheap subset: GQA/MQA backward is the bug users hit first (SPEC.md section 6)."""
    torch.manual_seed(7)
    heads_q, heads_kv = HEADS[heads]
    q, k, v = make_qkv(2, 13, 13, heads_q, heads_kv, 32, requires_grad=True)
    s_aux = torch.randn(heads_q, requires_grad=True)
    ours, dout = run_api(flash_attn.flash_attn_func, q, k, v, causal=True, s_aux=s_aux)
    assert_matches_reference(ours, q, k, v, dout=dout, causal=True, s_aux=s_aux)


@pytest.mark.kernels_ci
def test_s_aux_in_half_precision_gets_its_gradient(flash_attn):
    torch.manual_seed(3)
    q, k, v = make_qkv(1, 6, 6, 2, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    s_aux = torch.randn(2, dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn.flash_attn_func(q, k, v, s_aux=s_aux)
    (grad,) = torch.autograd.grad(out.float().sum(), (s_aux,))
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all()


@pytest.mark.kernels_ci
def test_deterministic_backward_is_bitwise_repeatable(flash_attn):
    torch.manual_seed(5)
    q, k, v = make_qkv(2, 19, 19, 4, 2, 32, requires_grad=True)
    dout = torch.randn(2, 19, 4, 32, dtype=torch.float16)
    runs = []
    for _ in range(2):
        out = flash_attn.flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


TRITON_THROUGH_API = """
from pathlib import Path
import kernels, torch
from helpers import assert_matches_reference, make_qkv, run_api
m = kernels.get_local_kernel(Path({root!r}))
torch.manual_seed(0)
q, k, v = make_qkv(2, 19, 27, 4, 2, 32, transposed=True, requires_grad={grad})
s_aux = torch.randn(4, requires_grad={grad})
ours, dout = run_api(m.flash_attn_func, q, k, v, causal=True, softcap=4.0, s_aux=s_aux)
assert_matches_reference(ours, q, k, v, dout=dout, causal=True, softcap=4.0, s_aux=s_aux)
print("ok", sorted(ours))
"""


def test_triton_through_the_api_under_the_interpreter(flash_attn):
    """FLASH_ATTN_HUB_BACKEND=triton on CPU tensors (fp16; the interpreter needs
    TRITON_INTERPRET=1 before the kernels are defined, hence a fresh interpreter)."""
    variant = Path(flash_attn.__file__).parent
    if not (variant / "_triton" / "fwd.py").exists():
        pytest.skip("this build has no Triton forward")
    grad = (variant / "_triton" / "bwd.py").exists()
    code = TRITON_THROUGH_API.format(root=str(variant.parents[1]), grad=grad)
    tests = Path(__file__).resolve().parent  # helpers, and the repository root for the oracle
    path = [str(tests), str(tests.parent)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "TRITON_INTERPRET": "1", "FLASH_ATTN_HUB_BACKEND": "triton",
           "FLASH_ATTN_HUB_POISON": "1", "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "ok" in done.stdout


# -- dispatch -----------------------------------------------------------------------------

@pytest.mark.kernels_ci
def test_one_log_line_per_backend_choice(flash_attn, caplog, monkeypatch):
    dispatch = submodule(flash_attn, "_dispatch")
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.delenv("FLASH_ATTN_HUB_BACKEND", raising=False)
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 4, 4, 2, 2, 16, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="flash_attn"):
        for _ in range(3):
            flash_attn.flash_attn_func(q, k, v).sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "flash_attn"]
    assert len(lines) == 2, lines  # one forward choice, one backward choice
    assert all("cpu backend" in line for line in lines)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("value", ["cpu", "CPU", "auto", ""])
def test_backend_variable_accepts_cpu_choices(flash_attn, monkeypatch, value):
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", value)
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 3, 3, 2, 2, 16)
    flash_attn.flash_attn_func(q, k, v)
    assert submodule(flash_attn, "_dispatch").requested_backend() in ("cpu", "auto")


class _OnCuda:
    """Stands in for a CUDA tensor where only ``.device``, shape and dtype are read."""
    device = torch.device("cuda", 0)
    dtype = torch.float16

    def __init__(self, shape=(2, 16, 4, 64)):
        self.shape = shape

    def dim(self):
        return len(self.shape)


class _FakeCuda:
    """A ``_cuda`` module that supports forwards only; ``readable`` is what its copy engine
    says of every operand."""

    def __init__(self, validated=True):
        self.calls = []
        self.VALIDATED = validated
        self.BWD_VALIDATED = validated
        self.readable = True

    def supports(self, q, k, params, *, backward, varlen, alibi, sink):
        self.calls.append(dict(backward=backward, varlen=varlen, alibi=alibi, sink=sink))
        return not backward

    def copy_engine_ok(self, t):
        return self.readable


@pytest.fixture
def dispatch(flash_attn, monkeypatch):
    """``_dispatch`` with a fresh log memory, whose choice returns the module's name instead
    of its function, and whose heuristics prefer no backend (tests set a preference)."""
    module = submodule(flash_attn, "_dispatch")
    monkeypatch.setattr(module, "_logged", set())
    monkeypatch.setattr(module, "_import",
                        lambda name: types.SimpleNamespace(forward=name, backward=name))
    for direction in ("forward", "backward"):
        monkeypatch.setattr(module._heuristics, f"{direction}_prefers_triton",
                            lambda q, k, params: None)
    return module


def _select(dispatch, direction, *, seqlen_q=16, seqlen_k=16, dropout_p=0.0, **features):
    params = dispatch.AttnParams(0.125, False, -1, -1, 0.0, dropout_p, 0, False, seqlen_q,
                                 seqlen_k)
    features = {"varlen": False, "alibi": False, "sink": False, **features}
    q, k = _OnCuda((2, seqlen_q, 8, 64)), _OnCuda((2, seqlen_k, 2, 64))
    dout = _OnCuda(q.shape) if direction == "backward" else None
    return dispatch.select_backend(direction, q, k, _OnCuda(k.shape), params, dout=dout,
                                   **features)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("requested, direction, expected", [
    ("auto", "forward", "_cuda"), ("auto", "backward", "_triton.bwd"),
    ("cuda", "forward", "_cuda"), ("cuda", "backward", "_triton.bwd"),
    ("triton", "forward", "_triton.fwd"), ("cpu", "backward", "_cpu"),
])
def test_dispatch_cuda_tensors(dispatch, monkeypatch, requested, direction, expected):
    fake = _FakeCuda()
    monkeypatch.setattr(dispatch, "_cuda", lambda: fake)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", requested)
    assert _select(dispatch, direction, varlen=True, sink=True) == expected
    if requested in ("auto", "cuda"):
        assert fake.calls == [dict(backward=direction == "backward", varlen=True, alibi=False,
                                   sink=True)]


@pytest.mark.kernels_ci
def test_dispatch_auto_skips_unvalidated_cuda(dispatch, monkeypatch):
    fake = _FakeCuda(validated=False)
    monkeypatch.setattr(dispatch, "_cuda", lambda: fake)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "auto")
    assert _select(dispatch, "forward") == "_triton.fwd"
    assert fake.calls == []
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cuda")
    assert _select(dispatch, "forward") == "_cuda"


@pytest.mark.kernels_ci
def test_dispatch_auto_skips_unvalidated_cuda_backward(dispatch, monkeypatch):
    """A CUDA backward joins ``auto`` only with its own flag; ``cuda`` opts in before that."""
    fake = _FakeCuda()
    fake.BWD_VALIDATED = False
    fake.supports = lambda *args, **kwargs: True
    monkeypatch.setattr(dispatch, "_cuda", lambda: fake)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "auto")
    assert _select(dispatch, "forward") == "_cuda"
    assert _select(dispatch, "backward") == "_triton.bwd"
    fake.BWD_VALIDATED = True
    assert _select(dispatch, "backward") == "_cuda"
    monkeypatch.setattr(dispatch._heuristics, "backward_prefers_triton",
                        lambda q, k, params: "a small banded grid")
    assert _select(dispatch, "backward") == "_triton.bwd"  # auto follows the preference
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cuda")
    assert _select(dispatch, "backward") == "_cuda"  # a forced backend does not
    fake.BWD_VALIDATED = False
    assert _select(dispatch, "backward") == "_cuda"


@pytest.mark.kernels_ci
def test_dispatch_auto_follows_forward_preference(dispatch, monkeypatch):
    """``auto`` runs a supported forward on Triton when ``_heuristics.forward_prefers_triton``
    says why (decode); ``cuda`` still runs it on the compiled kernel."""
    fake = _FakeCuda()
    monkeypatch.setattr(dispatch, "_cuda", lambda: fake)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "auto")
    assert _select(dispatch, "forward") == "_cuda"
    monkeypatch.setattr(dispatch._heuristics, "forward_prefers_triton",
                        lambda q, k, params: "decode runs on the split-KV kernels")
    assert _select(dispatch, "forward") == "_triton.fwd"
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cuda")
    assert _select(dispatch, "forward") == "_cuda"


@pytest.mark.kernels_ci
def test_dispatch_without_compiled_backend(dispatch, monkeypatch):
    monkeypatch.setattr(dispatch, "_cuda", lambda: None)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "auto")
    assert _select(dispatch, "forward") == "_triton.fwd"
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cuda")
    with pytest.raises(ValueError, match="no compiled CUDA backend"):
        _select(dispatch, "forward")


@pytest.mark.kernels_ci
def test_dispatch_forced_cuda_unsupported_forward(dispatch, monkeypatch, caplog):
    fake = _FakeCuda()
    fake.supports = lambda *args, **kwargs: False
    monkeypatch.setattr(dispatch, "_cuda", lambda: fake)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "cuda")
    params = dispatch.AttnParams(0.125, True, -1, 0, 0.0, 0.0, 0, False, 16, 16)
    with pytest.raises(ValueError, match="does not support this call"):
        dispatch.select_backend("forward", _OnCuda(), _OnCuda(), _OnCuda(), params,
                                varlen=False, alibi=True, sink=False)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "auto")
    with caplog.at_level(logging.INFO, logger="flash_attn"):
        for _ in range(3):
            assert dispatch.select_backend("forward", _OnCuda(), _OnCuda(), _OnCuda(), params,
                                           varlen=False, alibi=True,
                                           sink=False) == "_triton.fwd"
    lines = [r.getMessage() for r in caplog.records if r.name == "flash_attn"]
    assert len(lines) == 1 and "does not support" in lines[0], lines


@pytest.mark.kernels_ci
@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_dispatch_operands_the_copy_engine_cannot_read(dispatch, monkeypatch, caplog,
                                                       requested):
    """A supported call whose v (or dout) the CUDA kernel's copy engine cannot read runs on
    Triton, asked for or not, logged once per reason."""
    fake = _FakeCuda()
    fake.supports = lambda *args, **kwargs: True
    monkeypatch.setattr(dispatch, "_cuda", lambda: fake)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", requested)
    assert _select(dispatch, "forward") == "_cuda"
    fake.readable = False
    with caplog.at_level(logging.INFO, logger="flash_attn"):
        for _ in range(2):
            assert _select(dispatch, "forward") == "_triton.fwd"
            assert _select(dispatch, "backward") == "_triton.bwd"
    lines = [r.getMessage() for r in caplog.records if r.name == "flash_attn"]
    assert len(lines) == 2, lines
    assert "forward" in lines[0] and "v strides/alignment do not suit" in lines[0], lines
    assert "backward" in lines[1] and "v and dout strides/alignment" in lines[1], lines


@pytest.mark.kernels_ci
def test_dispatch_chooses_the_split_kv_decode(dispatch, monkeypatch, caplog):
    """A forward that runs on Triton goes to the split-KV decode when few query rows per kv
    head meet many keys (``_heuristics.split_kv_applies``), whichever way Triton was reached;
    never a backward, a dropout call or a call the CUDA backend keeps."""
    keys = dispatch._heuristics.SPLIT_KV_MIN_KEYS
    fake = _FakeCuda()
    monkeypatch.setattr(dispatch, "_cuda", lambda: fake)
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "triton")
    with caplog.at_level(logging.INFO, logger="flash_attn"):
        assert _select(dispatch, "forward", seqlen_q=1, seqlen_k=keys) == "_triton.decode"
    lines = [r.getMessage() for r in caplog.records if r.name == "flash_attn"]
    assert len(lines) == 1 and "split-KV decode" in lines[0], lines
    assert _select(dispatch, "forward", seqlen_q=1, seqlen_k=keys - 1) == "_triton.fwd"
    assert _select(dispatch, "forward", seqlen_q=64, seqlen_k=keys) == "_triton.fwd"
    assert _select(dispatch, "forward", seqlen_q=1, seqlen_k=keys,
                   dropout_p=0.1) == "_triton.fwd"
    assert _select(dispatch, "backward", seqlen_q=1, seqlen_k=keys) == "_triton.bwd"
    monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", "auto")
    assert _select(dispatch, "forward", seqlen_q=1, seqlen_k=keys) == "_cuda"
    monkeypatch.setattr(dispatch, "_cuda", lambda: None)
    assert _select(dispatch, "forward", seqlen_q=1, seqlen_k=keys) == "_triton.decode"


@pytest.mark.kernels_ci
def test_missing_cuda_module_is_tolerated_narrowly(flash_attn, monkeypatch):
    dispatch = submodule(flash_attn, "_dispatch")
    monkeypatch.setattr(dispatch, "_cuda_module", None)

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name}", name=f"{dispatch.__package__}._cuda")

    monkeypatch.setattr(dispatch, "_import", missing)
    assert dispatch._cuda() is None
    monkeypatch.setattr(dispatch, "_cuda_module", None)

    def broken(name):
        raise ModuleNotFoundError("No module named 'cutlass_helper'", name="cutlass_helper")

    monkeypatch.setattr(dispatch, "_import", broken)
    with pytest.raises(ModuleNotFoundError, match="cutlass_helper"):
        dispatch._cuda()


def test_transformers_sees_every_supported_keyword(flash_attn):
    """transformers decides what to send from the varlen signature (SPEC.md section 5)."""
    utils = pytest.importorskip("transformers.modeling_flash_attention_utils")
    supports = utils._lazy_define_process_function(
        flash_attn.flash_attn_varlen_func).keywords["supports_mapping"]
    for name in ("dropout_p", "window_size", "softcap", "deterministic", "s_aux",
                 "max_seqlen_q", "max_seqlen_k", "block_table"):
        assert supports[name], name


@pytest.mark.kernels_ci
def test_reference_helpers_agree():
    """The shared helpers build what they claim: cumulative lengths and transposed layouts."""
    assert cu_seqlens([3, 0, 2]).tolist() == [0, 3, 3, 5]
    q, _, _ = make_qkv(2, 5, 5, 3, 3, 8, transposed=True)
    assert q.shape == (2, 5, 3, 8) and q.stride(-1) == 1 and not q.is_contiguous()
    out, _ = attention_reference(q, q, q)
    assert out.shape == q.shape
