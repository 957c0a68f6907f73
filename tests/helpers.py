"""Helpers shared by the test files: fresh random inputs in the layouts callers really send,
NaN poisoning, the package's submodules, and a forward+backward comparison against
``tests/reference.py`` under the tolerance rule.

Inputs are drawn from the default torch generator: seed it in the test (``torch.manual_seed``)
for a reproducible case. ``transposed=True`` gives the layout transformers sends, a
``(B, H, S, D)`` allocation viewed as ``(B, S, H, D)`` (varlen: ``(H, T, D)`` viewed as
``(T, H, D)``): non-contiguous, last stride 1.
"""

from __future__ import annotations

import importlib
import math
from itertools import accumulate

import torch

from reference import assert_close_to_reference, attention_reference

GRAD_NAMES = ("dq", "dk", "dv", "ds_aux")


def submodule(package, name: str):
    """A module of the loaded kernel package, e.g. ``submodule(flash_attn, "_cpu")``."""
    return importlib.import_module(f"{package.__name__}.{name}")


def poison(*tensors: torch.Tensor):
    """Fills each tensor with NaN in place; returns the tensor (or a tuple of them)."""
    for t in tensors:
        t.fill_(math.nan)
    return tensors[0] if len(tensors) == 1 else tensors


def _random(shape, *, dtype, device, transposed: bool, requires_grad: bool) -> torch.Tensor:
    """``shape`` ends with (.., S, H, D). Transposed: allocated (.., H, S, D), viewed back."""
    if transposed:
        *lead, seq, heads, dim = shape
        t = torch.randn(*lead, heads, seq, dim, dtype=dtype, device=device).transpose(-3, -2)
    else:
        t = torch.randn(*shape, dtype=dtype, device=device)
    return t.detach().requires_grad_(requires_grad)


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, *, dtype=torch.float16,
             device="cpu", transposed=False, requires_grad=False):
    """Batched q ``(B, Sq, Hq, D)``, k/v ``(B, Sk, Hkv, D)``; leaves when ``requires_grad``."""
    kw = dict(dtype=dtype, device=device, transposed=transposed, requires_grad=requires_grad)
    q = _random((batch, seqlen_q, heads_q, head_dim), **kw)
    k = _random((batch, seqlen_k, heads_kv, head_dim), **kw)
    v = _random((batch, seqlen_k, heads_kv, head_dim), **kw)
    return q, k, v


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 cumulative lengths ``(len(lengths) + 1,)`` starting at 0."""
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)


def make_varlen_qkv(seqlens_q, seqlens_k, heads_q, heads_kv, head_dim, *, dtype=torch.float16,
                    device="cpu", transposed=False, requires_grad=False):
    """Packed q ``(Tq, Hq, D)``, k/v ``(Tk, Hkv, D)`` and ``(cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k)``."""
    kw = dict(dtype=dtype, device=device, transposed=transposed, requires_grad=requires_grad)
    q = _random((sum(seqlens_q), heads_q, head_dim), **kw)
    k = _random((sum(seqlens_k), heads_kv, head_dim), **kw)
    v = _random((sum(seqlens_k), heads_kv, head_dim), **kw)
    return (q, k, v, cu_seqlens(seqlens_q, device), cu_seqlens(seqlens_k, device),
            max(seqlens_q), max(seqlens_k))


def _reference_run(q, k, v, dout, s_aux, kwargs, dtype):
    """Reference out/lse and gradients (w.r.t. q, k, v and s_aux when given) in ``dtype``."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    sink = None if s_aux is None else s_aux.detach().requires_grad_(True)
    out, lse = attention_reference(*leaves, s_aux=sink, dtype=dtype, **kwargs)
    result = {"out": out, "lse": lse}
    if dout is not None:
        inputs = leaves + ([] if sink is None else [sink])
        grads = torch.autograd.grad(out, inputs, dout.to(dtype))
        result.update(zip(GRAD_NAMES, grads))
    return result


def assert_matches_reference(ours: dict, q, k, v, *, dout=None, s_aux=None, **kwargs) -> None:
    """Checks ``ours`` (any of out, lse, dq, dk, dv, ds_aux) against the float64 reference with
    the tolerance rule, PyTorch's own error measured in q's dtype. ``kwargs`` are
    ``attention_reference`` keywords (causal, window_size, softcap, cu_seqlens_q, ...)."""
    ref64 = _reference_run(q, k, v, dout, s_aux, kwargs, torch.float64)
    lowp = _reference_run(q, k, v, dout, s_aux, kwargs, q.dtype)
    missing = set(ours) - set(ref64)
    assert not missing, f"no reference for {sorted(missing)}"
    for name, value in ours.items():
        assert_close_to_reference(name, value, ref64[name], lowp[name])


def run_api(fn, q, k, v, *args, s_aux=None, **kwargs):
    """Calls an API function with ``return_attn_probs=True`` and, when q requires grad,
    backpropagates a fresh random ``dout``. Returns ``(ours, dout)``: ``ours`` for
    :func:`assert_matches_reference` (out, lse and the gradients), ``dout`` None without grad."""
    out, lse, probs = fn(q, k, v, *args, s_aux=s_aux, return_attn_probs=True, **kwargs)
    assert probs is None
    ours = {"out": out, "lse": lse}
    dout = None
    if q.requires_grad:
        dout = torch.randn_like(out)
        inputs = [q, k, v] + ([] if s_aux is None else [s_aux])
        ours.update(zip(GRAD_NAMES, torch.autograd.grad(out, inputs, dout)))
    return ours, dout
