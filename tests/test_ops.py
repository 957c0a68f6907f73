"""The custom ops are compile-safe: schema, fakes and autograd pass ``torch.library.opcheck``,
and a small attention layer compiles with ``fullgraph=True`` (no graph break), forward and
backward, matching eager."""

from __future__ import annotations

import contextlib
import inspect
import types

import pytest
import torch
import torch.nn.functional as F

from helpers import make_qkv, make_varlen_qkv, submodule

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


@pytest.fixture(scope="module")
def ops(flash_attn):
    return submodule(flash_attn, "_custom_ops")


def _params(ops, head_dim, max_q, max_k, **overrides):
    values = dict(softmax_scale=head_dim ** -0.5, causal=False, window_left=-1, window_right=-1,
                  softcap=0.0, dropout_p=0.0, seed=0, deterministic=False, max_seqlen_q=max_q,
                  max_seqlen_k=max_k)
    values.update(overrides)
    return tuple(values[name] for name in ops.PARAM_FIELDS)


def _batched_case(ops, heads_q, heads_kv, *, sink=False, alibi=False, **overrides):
    q, k, v = make_qkv(2, 9, 12, heads_q, heads_kv, 32, transposed=True, requires_grad=True)
    s_aux = torch.randn(heads_q, requires_grad=True) if sink else None
    slopes = torch.rand(heads_q) if alibi else None
    return (q, k, v, None, None, s_aux, slopes) + _params(ops, 32, 9, 12, **overrides)


def _varlen_case(ops, *, sink=False, **overrides):
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([5, 0, 3], [4, 6, 3], 4, 2, 16,
                                              requires_grad=True)
    s_aux = torch.randn(4, requires_grad=True) if sink else None
    return (q, k, v, cq, ck, s_aux, None) + _params(ops, 16, mq, mk, **overrides)


CASES = {
    "mha": lambda ops: _batched_case(ops, 2, 2),
    "gqa_causal_window_softcap": lambda ops: _batched_case(
        ops, 4, 2, causal=True, window_left=3, window_right=0, softcap=4.0),
    "mqa_alibi_dropout": lambda ops: _batched_case(ops, 4, 1, alibi=True, dropout_p=0.25,
                                                   seed=12345),
    "sink": lambda ops: _batched_case(ops, 4, 2, sink=True),
    "varlen_sink_causal": lambda ops: _varlen_case(ops, sink=True, causal=True, window_right=0),
}


@pytest.mark.kernels_ci
def test_op_arguments_follow_the_params_record(ops):
    """``attention`` passes AttnParams positionally in field order: the schemas must agree."""
    fwd_names = [a.name for a in ops.fwd._opoverload._schema.arguments]
    bwd_names = [a.name for a in ops.bwd._opoverload._schema.arguments]
    assert fwd_names == list(ops.FWD_TENSORS + ops.PARAM_FIELDS)
    assert bwd_names == list(ops.BWD_TENSORS + ops.PARAM_FIELDS)
    assert list(inspect.signature(ops.fwd._init_fn).parameters) == fwd_names


@pytest.mark.parametrize("case", list(CASES))
def test_opcheck_fwd(ops, case):
    torch.manual_seed(0)
    torch.library.opcheck(ops.fwd, CASES[case](ops), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("case", ["mha", "sink", "varlen_sink_causal"])
def test_opcheck_bwd(ops, case):
    torch.manual_seed(0)
    args = CASES[case](ops)
    with torch.no_grad():
        out, lse = ops.fwd(*args)
    tensors = [t.detach() if isinstance(t, torch.Tensor) else t for t in args[:7]]
    dout = torch.randn_like(out).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
    bwd_args = (dout, *tensors[:3], out, lse, *tensors[3:]) + args[7:]
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.bwd, bwd_args, test_utils=utils)


class _Attention(torch.nn.Module):
    """A GQA attention layer in the layout transformers uses: projections to (B, H, S, D),
    transposed views handed to ``flash_attn_func``."""

    def __init__(self, flash_attn, hidden, heads_q, heads_kv, head_dim):
        super().__init__()
        self.flash_attn = flash_attn
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, head_dim
        self.q = torch.nn.Linear(hidden, heads_q * head_dim, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * heads_kv * head_dim, bias=False)
        self.o = torch.nn.Linear(heads_q * head_dim, hidden, bias=False)
        self.sinks = torch.nn.Parameter(torch.randn(heads_q))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads_q, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.heads_kv, self.head_dim).unbind(2)
        out = self.flash_attn.flash_attn_func(
            q.transpose(1, 2).to(torch.float16), k.to(torch.float16), v.to(torch.float16),
            causal=True, window_size=(5, 5), s_aux=self.sinks)
        return self.o(F.silu(out.float()).reshape(b, s, -1))


def _grads(layer, x):
    loss = layer(x).square().mean()
    grads = torch.autograd.grad(loss, [x, *layer.parameters()])
    return loss.detach(), grads


@pytest.mark.kernels_ci
def test_compile_fullgraph_forward_backward(flash_attn):
    torch.manual_seed(0)
    layer = _Attention(flash_attn, 64, 4, 2, 16)
    x = torch.randn(2, 11, 64, requires_grad=True)
    eager_loss, eager_grads = _grads(layer, x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    loss, grads = _grads(compiled, x)
    torch.testing.assert_close(loss, eager_loss)
    for ours, eager in zip(grads, eager_grads):
        torch.testing.assert_close(ours, eager)


def test_compile_fullgraph_inductor_varlen(flash_attn):
    torch.manual_seed(0)
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([5, 9, 2], [7, 9, 4], 4, 1, 32,
                                              requires_grad=True)

    def step(q, k, v):
        out = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=True,
                                                softcap=3.0)
        return (out.float() * 2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    ours = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a, b)


def test_compiled_dropout_draws_a_fresh_seed_per_call(flash_attn):
    """The seed is drawn at run time, not baked into the graph, and follows torch.manual_seed."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16)

    def attend(q, k, v):
        return flash_attn.flash_attn_func(q, k, v, dropout_p=0.3)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    first, second = compiled(q, k, v), compiled(q, k, v)
    torch.manual_seed(1)
    assert torch.equal(first, attend(q, k, v)) and not torch.equal(first, second)


def test_compiled_varlen_follows_0d_max_seqlen(flash_attn, monkeypatch):
    """0-d ``max_seqlen`` tensors reach the backend with this call's values, shapes unchanged."""
    cpu = submodule(flash_attn, "_cpu")
    seen = []
    forward = cpu.forward

    def recording(*args, params, **kwargs):
        seen.append((params.max_seqlen_q, params.max_seqlen_k))
        return forward(*args, params=params, **kwargs)

    monkeypatch.setattr(cpu, "forward", recording)

    def attend(q, k, v, cq, ck, mq, mk):
        return flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.manual_seed(0)
    for seqlens_q in ([4, 4], [2, 6]):
        q, k, v, cq, ck, mq, mk = make_varlen_qkv(seqlens_q, [5, 5], 2, 2, 16)
        out = compiled(q, k, v, cq, ck, torch.tensor(mq), torch.tensor(mk))
        assert torch.equal(out, attend(q, k, v, cq, ck, mq, mk))
    assert seen[0::2] == [(4, 5), (6, 5)]


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A torch-function mode that changes nothing (its presence sends calls through the ops)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Recording(torch.utils._python_dispatch.TorchDispatchMode):
    """Names of the ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _api_call(flash_attn, q, k, v, s_aux):
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=True, softcap=3.0, s_aux=s_aux,
                                             return_attn_probs=True)
    grads = torch.autograd.grad((out.float().square().sum(),), (q, k, v, s_aux))
    return (out, lse, *grads)


@pytest.mark.kernels_ci
def test_direct_eager_call_matches_the_op(flash_attn, ops, monkeypatch):
    """[Note: direct eager calls]: a plain call skips the ops and returns bitwise what the op
    route returns, gradients included; under a dispatch mode the ops are what the mode sees."""
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 9, 12, 4, 2, 32, transposed=True, requires_grad=True)
    s_aux = torch.randn(4, requires_grad=True)
    with _Recording() as mode:
        routed = _api_call(flash_attn, q, k, v, s_aux)
    namespace = ops.fwd._qualname.split("::")[0]
    assert {f"{namespace}.fwd.default", f"{namespace}.bwd.default"} <= set(mode.names)

    def unused(*args, **kwargs):
        raise AssertionError("a plain eager call went through the custom op")

    monkeypatch.setattr(ops, "fwd", unused)
    monkeypatch.setattr(ops, "bwd", unused)
    direct = _api_call(flash_attn, q, k, v, s_aux)
    with torch.no_grad():
        out = flash_attn.flash_attn_func(q, k, v, causal=True, softcap=3.0, s_aux=s_aux)
    for a, b in zip(direct, routed):
        assert torch.equal(a, b)
    assert torch.equal(out, routed[0])


@pytest.mark.kernels_ci
def test_direct_path_declines_subclasses_and_transforms(ops):
    plain = torch.zeros(2)
    assert ops._direct((plain, None))
    assert not ops._direct((torch.nn.Parameter(torch.zeros(2)), None))
    with _Recording():
        assert not ops._direct((plain,))
    with torch.overrides.TorchFunctionMode():
        assert not ops._direct((plain,))
    assert torch.func.vmap(lambda x: torch.tensor(ops._direct((x,))).expand(x.shape))(
        torch.zeros(3, 2)).logical_not().all()


def test_backends_run_on_the_tensors_device(ops, monkeypatch):
    """[Note: the launching device]: a CUDA tensor off the current device gets a guard that
    makes its device current; one on it, or on the CPU, none (the GPU side runs in
    test_gpu.py with two devices)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    elsewhere = types.SimpleNamespace(device=torch.device("cuda", 1))
    guard = ops._on_device_of(elsewhere)
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        assert ops._on_device_of(types.SimpleNamespace(device=device)) is ops._NO_GUARD


@pytest.mark.kernels_ci
def test_double_backward_is_refused_on_both_routes(flash_attn):
    q, k, v = make_qkv(1, 5, 5, 2, 2, 16, requires_grad=True)
    for mode in (_PassThrough, contextlib.nullcontext):  # the op route, the direct one
        with mode():
            out = flash_attn.flash_attn_func(q, k, v)
        (grad,) = torch.autograd.grad(out.float().sum(), q, create_graph=True)
        with pytest.raises((RuntimeError, NotImplementedError)):
            torch.autograd.grad(grad.float().sum(), q)
