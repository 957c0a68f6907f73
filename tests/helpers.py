"""Helpers shared by the test files: the package from the source tree, fresh random inputs in
the layouts callers really send, NaN-poisoned destinations for the backends, and comparisons
against ``flash_attn_hub/reference.py`` under the tolerance rule.

Inputs are drawn from the default torch generator: seed it in the test (``torch.manual_seed``)
for a reproducible case. Layouts of one tensor ``(.., S, H, D)`` (``LAYOUTS``):

* ``contiguous``;
* ``transposed``: the layout transformers sends, a ``(.., H, S, D)`` allocation viewed as
  ``(.., S, H, D)`` (varlen: ``(H, T, D)`` viewed as ``(T, H, D)``): non-contiguous, last stride 1;
* ``sliced``: the last ``D`` channels of a ``(.., S, H, 2 D)`` allocation (wider row strides and
  an offset base).

K and V may also share one allocation (``KV_LAYOUTS``): ``packed``, views of a
``(.., S, 2, H, D)`` tensor (flash-attn's kv-packed layout); ``packed_transposed``, views of a
``(.., H, S, 2, D + 8)`` tensor (K its last ``D`` channels, V its first), so every stride but the
last differs from the contiguous layout and K does not start at the allocation's base.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from itertools import accumulate
from pathlib import Path

import pytest
import torch

from flash_attn_hub.reference import assert_close_to_reference, attention_reference

GRAD_NAMES = ("dq", "dk", "dv", "ds_aux")
LAYOUTS = ("contiguous", "transposed", "sliced")
KV_LAYOUTS = LAYOUTS + ("packed", "packed_transposed")
SOURCE_PACKAGE = Path(__file__).resolve().parents[1] / "torch-ext" / "flash_attn"


def source_package() -> types.ModuleType:
    """The package straight from the source tree, for runs without the `flash_attn` fixture:
    a bare package object whose path is the source folder, so relative imports work and
    `__init__` (which needs the build's `_ops`) never runs."""
    name = "flash_attn_source"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(SOURCE_PACKAGE)]
        sys.modules[name] = package
    return sys.modules[name]


def built_or_source_package(request) -> types.ModuleType:
    """The `flash_attn` fixture's package where the run defines it, else :func:`source_package`
    (for a fixture: ``return built_or_source_package(request)``)."""
    import pytest

    try:
        return request.getfixturevalue("flash_attn")
    except pytest.FixtureLookupError:
        return source_package()


def interpreted(kernel) -> bool:
    """Whether a ``@triton.jit`` kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``
    when its module was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def triton_device(kernel) -> torch.device:
    """CPU under the interpreter, else CUDA; skips the test when neither can run ``kernel``."""
    import pytest

    if interpreted(kernel):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("the Triton kernels were compiled for a GPU but there is no CUDA device: set "
                "TRITON_INTERPRET=1 before the package is imported")


def submodule(package, name: str):
    """A module of the loaded kernel package, e.g. ``submodule(flash_attn, "_cpu")``."""
    return importlib.import_module(f"{package.__name__}.{name}")


def poison(*tensors: torch.Tensor):
    """Fills each tensor with NaN in place; returns the tensor (or a tuple of them)."""
    for t in tensors:
        t.fill_(math.nan)
    return tensors[0] if len(tensors) == 1 else tensors


def nan_like(x: torch.Tensor, *, shape=None, dtype=None) -> torch.Tensor:
    """A contiguous NaN tensor on ``x``'s device, with its shape and dtype unless given."""
    return torch.full(x.shape if shape is None else shape, math.nan,
                      dtype=x.dtype if dtype is None else dtype, device=x.device)


def random_tensor(shape, *, dtype=torch.float16, device="cpu", layout="contiguous",
                  requires_grad=False) -> torch.Tensor:
    """Standard-normal ``shape`` (ending with ``(.., S, H, D)``) in one of ``LAYOUTS``; a leaf."""
    *lead, seq, heads, dim = shape
    if layout == "contiguous":
        t = torch.randn(*shape, dtype=dtype, device=device)
    elif layout == "transposed":
        t = torch.randn(*lead, heads, seq, dim, dtype=dtype, device=device).transpose(-3, -2)
    elif layout == "sliced":
        t = torch.randn(*lead, seq, heads, 2 * dim, dtype=dtype, device=device)[..., dim:]
    else:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUTS}")
    return t.detach().requires_grad_(requires_grad)


def random_kv(shape, *, dtype=torch.float16, device="cpu", layout="contiguous",
              requires_grad=False) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``shape`` ``(.., S, Hkv, D)`` in one of ``KV_LAYOUTS``; leaves."""
    *lead, seq, heads, dim = shape
    if layout in LAYOUTS:
        kw = dict(dtype=dtype, device=device, layout=layout, requires_grad=requires_grad)
        return random_tensor(shape, **kw), random_tensor(shape, **kw)
    if layout == "packed":
        kv = torch.randn(*lead, seq, 2, heads, dim, dtype=dtype, device=device)
        k, v = kv.select(-3, 0), kv.select(-3, 1)
    elif layout == "packed_transposed":
        kv = torch.randn(*lead, heads, seq, 2, dim + 8, dtype=dtype, device=device)
        k, v = kv[..., 0, 8:].transpose(-3, -2), kv[..., 1, :dim].transpose(-3, -2)
    else:
        raise ValueError(f"layout: {layout!r} is not one of {KV_LAYOUTS}")
    return k.detach().requires_grad_(requires_grad), v.detach().requires_grad_(requires_grad)


def _qkv(shape_q, shape_kv, *, transposed, kv_layout, **kw):
    q = random_tensor(shape_q, layout="transposed" if transposed else "contiguous", **kw)
    if kv_layout is None:
        kv_layout = "transposed" if transposed else "contiguous"
    return (q, *random_kv(shape_kv, layout=kv_layout, **kw))


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, *, dtype=torch.float16,
             device="cpu", transposed=False, kv_layout=None, requires_grad=False):
    """Batched q ``(B, Sq, Hq, D)``, k/v ``(B, Sk, Hkv, D)``; leaves when ``requires_grad``.
    ``transposed``: q (and k/v unless ``kv_layout`` names one of ``KV_LAYOUTS``) transposed."""
    return _qkv((batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_kv, head_dim),
                transposed=transposed, kv_layout=kv_layout, dtype=dtype, device=device,
                requires_grad=requires_grad)


def seeded_cuda_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=torch.bfloat16,
                    seed=0, **kw):
    """:func:`make_qkv` on the GPU after ``torch.manual_seed(seed)`` (the sm90 kernel tests)."""
    torch.manual_seed(seed)
    return make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=dtype,
                    device="cuda", **kw)


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 cumulative lengths ``(len(lengths) + 1,)`` starting at 0."""
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)


def make_varlen_qkv(seqlens_q, seqlens_k, heads_q, heads_kv, head_dim, *, dtype=torch.float16,
                    device="cpu", transposed=False, kv_layout=None, requires_grad=False):
    """Packed q ``(Tq, Hq, D)``, k/v ``(Tk, Hkv, D)`` and ``(cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k)``; layouts as in :func:`make_qkv`."""
    q, k, v = _qkv((sum(seqlens_q), heads_q, head_dim), (sum(seqlens_k), heads_kv, head_dim),
                   transposed=transposed, kv_layout=kv_layout, dtype=dtype, device=device,
                   requires_grad=requires_grad)
    return (q, k, v, cu_seqlens(seqlens_q, device), cu_seqlens(seqlens_k, device),
            max(seqlens_q), max(seqlens_k))


def make_sequences_qkv(seqlens, heads_q, heads_kv, head_dim, *, varlen: bool, **kw):
    """q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k for the sequences
    ``seqlens`` (``(Sq, Sk)`` pairs): packed when ``varlen``, else a batch of
    ``len(seqlens)`` (every pair equal; the cu_seqlens are None). ``kw``: :func:`make_qkv`'s."""
    if varlen:
        return make_varlen_qkv([sq for sq, _ in seqlens], [sk for _, sk in seqlens], heads_q,
                               heads_kv, head_dim, **kw)
    (seqlen_q, seqlen_k), = set(seqlens)
    q, k, v = make_qkv(len(seqlens), seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, **kw)
    return q, k, v, None, None, seqlen_q, seqlen_k


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    """``(B, Hq, Sq)`` for a batched q ``(B, Sq, Hq, D)``, ``(Hq, Tq)`` for a packed one."""
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def run_forward(backend, q, k, v, *, params, cu_seqlens_q=None, cu_seqlens_k=None, s_aux=None,
                alibi_slopes=None, **launch):
    """``backend.forward`` into a NaN-poisoned out and float32 lse, returned as ``(out, lse)``.
    ``launch``: further keywords of the launcher (``tiles``)."""
    out = nan_like(q)
    lse = nan_like(q, shape=lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
    backend.forward(q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    s_aux=s_aux, alibi_slopes=alibi_slopes, params=params, **launch)
    return out, lse


def run_backward(backend, dout, q, k, v, out, lse, *, params, cu_seqlens_q=None,
                 cu_seqlens_k=None, s_aux=None, alibi_slopes=None, **launch) -> dict:
    """``backend.backward`` into NaN-poisoned gradients: ``{dq, dk, dv}`` and, with a sink,
    ``ds_aux`` (float32). Keywords as in :func:`run_forward`."""
    grads = dict(dq=nan_like(q), dk=nan_like(k), dv=nan_like(v))
    if s_aux is not None:
        grads["ds_aux"] = nan_like(s_aux, dtype=torch.float32)
    backend.backward(dout, q, k, v, out, lse, grads["dq"], grads["dk"], grads["dv"],
                     grads.get("ds_aux"), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     s_aux=s_aux, alibi_slopes=alibi_slopes, params=params, **launch)
    return grads


def reference_kwargs(params) -> dict:
    """``attention_reference`` keywords of an ``AttnParams`` (scale, mask, softcap, dropout)."""
    return dict(softmax_scale=params.softmax_scale, causal=params.causal,
                window_size=(params.window_left, params.window_right), softcap=params.softcap,
                dropout_p=params.dropout_p, seed=params.seed)


def reference_results(q, k, v, *, dtype, dout=None, s_aux=None, **kwargs) -> dict:
    """Reference out/lse and, with ``dout``, the gradients (w.r.t. q, k, v and s_aux when
    given) computed in ``dtype``; detached. ``kwargs``: ``attention_reference``'s."""
    grad = dout is not None
    leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    sink = None if s_aux is None else s_aux.detach().requires_grad_(grad)
    out, lse = attention_reference(*leaves, s_aux=sink, dtype=dtype, **kwargs)
    result = {"out": out.detach(), "lse": lse.detach()}
    if grad:
        inputs = leaves + ([] if sink is None else [sink])
        grads = torch.autograd.grad(out, inputs, dout.to(dtype))
        result.update(zip(GRAD_NAMES, grads))
    return result


def assert_each_close(ours: dict, ref64: dict, lowp: dict, *, label: str = "") -> None:
    """Each of ``ours`` (out, lse, dq, ...) against :func:`reference_results` in float64
    (``ref64``) and in the inputs' dtype (``lowp``), with the tolerance rule."""
    missing = set(ours) - set(ref64)
    assert not missing, f"no reference for {sorted(missing)}"
    for name, value in ours.items():
        assert_close_to_reference(f"{label} {name}".strip(), value, ref64[name], lowp[name])


def assert_matches_reference(ours: dict, q, k, v, *, dout=None, s_aux=None, label: str = "",
                             **kwargs) -> None:
    """Checks ``ours`` (any of out, lse, dq, dk, dv, ds_aux) against the float64 reference with
    the tolerance rule, PyTorch's own error measured in q's dtype. ``kwargs`` are
    ``attention_reference`` keywords (causal, window_size, softcap, cu_seqlens_q, ...);
    ``label`` starts each failure message."""
    common = dict(dout=dout, s_aux=s_aux, **kwargs)
    assert_each_close(ours, reference_results(q, k, v, dtype=torch.float64, **common),
                      reference_results(q, k, v, dtype=q.dtype, **common), label=label)


def oracle_lse(lse: torch.Tensor) -> torch.Tensor:
    """An lse the API returned in the oracle's convention: the API reports a row that sees no
    key with flash-attn 2's ``+inf``, the oracle with ``log(0) = -inf``. The API never returns
    ``-inf``."""
    assert not torch.isneginf(lse).any(), "the API returned an lse of -inf"
    return lse.masked_fill(torch.isposinf(lse), -math.inf)


def run_api(fn, q, k, v, *args, s_aux=None, **kwargs):
    """Calls an API function with ``return_attn_probs=True`` and, when q requires grad,
    backpropagates a fresh random ``dout``. Returns ``(ours, dout)``: ``ours`` for
    :func:`assert_matches_reference` (out, lse in the oracle's convention, and the gradients),
    ``dout`` None without grad."""
    out, lse, probs = fn(q, k, v, *args, s_aux=s_aux, return_attn_probs=True, **kwargs)
    assert probs is None or kwargs.get("dropout_p", 0) > 0
    ours = {"out": out, "lse": oracle_lse(lse)}
    dout = None
    if q.requires_grad:
        dout = torch.randn_like(out)
        inputs = [q, k, v] + ([] if s_aux is None else [s_aux])
        ours.update(zip(GRAD_NAMES, torch.autograd.grad(out, inputs, dout)))
    return ours, dout


def sm90() -> bool:
    """A Hopper (compute capability 9.0) GPU is present."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not sm90(), reason="needs an sm90 (Hopper) GPU")


def backend_params(attn_params, head_dim, *, causal=False, window=(-1, -1), softcap=0.0, max_q,
                   max_k, scale=None, deterministic=False):
    """An ``AttnParams`` as the dispatcher hands it to a backend: causal forces
    ``window_right = 0``; scale ``head_dim ** -0.5`` unless given; no dropout."""
    left, right = window
    if causal:
        right = 0
    return attn_params(softmax_scale=head_dim ** -0.5 if scale is None else scale, causal=causal,
                       window_left=left, window_right=right, softcap=softcap, dropout_p=0.0,
                       seed=0, deterministic=deterministic, max_seqlen_q=max_q,
                       max_seqlen_k=max_k)
