"""What flash-attn 2.8.3 accepts, accepted here with its semantics: head dims that are not a
multiple of 8, any last stride, scalars as numpy or 0-d tensors, ``window_size`` as any pair,
``softcap <= 0`` as off, the qkv/kv-packed entry points, the dropout-encoded probabilities of
``return_attn_probs``, the ``+inf`` lse of rows that see no key, and the private
``flash_attn_interface`` wrappers. On CPU against the float64 oracle (tolerance rule, NaN-poisoned
outputs), and once through the Triton kernels under the interpreter."""

from __future__ import annotations

import logging

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flash_attn_hub.reference import (assert_close_to_reference, attention_reference,
                                      dropout_keep_mask)
from helpers import (GRAD_NAMES, assert_matches_reference, cu_seqlens, make_qkv,
                     make_varlen_qkv, oracle_lse, run_api, submodule)


def _drawn_seed(manual_seed: int) -> int:
    """The dropout seed the API draws after ``torch.manual_seed(manual_seed)``."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def _grads(out, inputs, dout):
    return dict(zip(GRAD_NAMES, torch.autograd.grad(out, inputs, dout)))


# -- head dims that are not a multiple of 8 ---------------------------------------------------

@pytest.mark.kernels_ci
@pytest.mark.parametrize("head_dim", [59, 111, 3])
def test_head_dim_padded_batched(flash_attn, head_dim):
    torch.manual_seed(head_dim)
    q, k, v = make_qkv(2, 13, 17, 4, 2, head_dim, transposed=True, requires_grad=True)
    s_aux = torch.randn(4, requires_grad=True)
    ours, dout = run_api(flash_attn.flash_attn_func, q, k, v, causal=True, softcap=3.0,
                         s_aux=s_aux)
    assert ours["out"].shape == q.shape and ours["out"].is_contiguous()
    assert ours["dq"].shape == q.shape and ours["dk"].shape == k.shape
    assert_matches_reference(ours, q, k, v, dout=dout, s_aux=s_aux, causal=True, softcap=3.0)


def test_head_dim_padded_varlen_keeps_the_callers_scale(flash_attn):
    """``softmax_scale=None`` scales by the caller's head dim, not the padded one."""
    torch.manual_seed(1)
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([5, 0, 9], [7, 3, 9], 6, 2, 59,
                                              requires_grad=True)
    slopes = torch.rand(6)
    ours, dout = run_api(flash_attn.flash_attn_varlen_func, q, k, v, cq, ck, mq, mk,
                         window_size=(4, 1), alibi_slopes=slopes)
    assert_matches_reference(ours, q, k, v, dout=dout, cu_seqlens_q=cq, cu_seqlens_k=ck,
                             window_size=(4, 1), alibi_slopes=slopes, softmax_scale=59 ** -0.5)


# -- strides, scalars, window pairs, softcap ---------------------------------------------------

@pytest.mark.kernels_ci
def test_last_stride_not_one_is_copied(flash_attn):
    torch.manual_seed(2)
    base = [torch.randn(2, 9, h, 32, 2, dtype=torch.float16) for h in (4, 2, 2)]
    strided = [t[..., 0].requires_grad_(True) for t in (b.clone() for b in base)]
    assert all(t.stride(-1) == 2 for t in strided)
    dense = [t[..., 0].contiguous().requires_grad_(True) for t in base]
    dout = torch.randn(2, 9, 4, 32, dtype=torch.float16)
    outs, grads = [], []
    for q, k, v in (strided, dense):
        out = flash_attn.flash_attn_func(q, k, v, causal=True)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    assert torch.equal(*outs)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("window", [
    [53, 441], (53, 441), torch.tensor([53, 441]), torch.tensor([53, 441], dtype=torch.int32),
    np.array([53, 441]), (np.int64(53), torch.tensor(441)),
], ids=["list", "tuple", "tensor", "tensor_int32", "numpy", "mixed_scalars"])
def test_window_size_any_pair(flash_attn, window):
    torch.manual_seed(3)
    q, k, v = make_qkv(1, 600, 600, 2, 1, 8)
    out = flash_attn.flash_attn_func(q, k, v, window_size=window)
    assert torch.equal(out, flash_attn.flash_attn_func(q, k, v, window_size=(53, 441)))


@pytest.mark.kernels_ci
def test_window_pair_reaches_the_backend_as_ints(flash_attn, monkeypatch):
    cpu = submodule(flash_attn, "_cpu")
    seen = []
    forward = cpu.forward

    def recording(*args, params, **kwargs):
        seen.append((params.window_left, params.window_right))
        return forward(*args, params=params, **kwargs)

    monkeypatch.setattr(cpu, "forward", recording)
    q, k, v = make_qkv(1, 5, 5, 1, 1, 8)
    flash_attn.flash_attn_func(q, k, v, window_size=torch.tensor([3, 2]), causal=True)
    assert seen == [(3, 0)] and all(type(x) is int for x in seen[0])


@pytest.mark.kernels_ci
def test_scalars_as_numpy_and_0d_tensors(flash_attn):
    torch.manual_seed(4)
    q, k, v = make_qkv(2, 7, 9, 4, 2, 16)
    expected = flash_attn.flash_attn_func(q, k, v, softmax_scale=0.3, softcap=2.5)
    for scale, cap in ((np.float32(0.3), np.float64(2.5)), (torch.tensor(0.3), torch.tensor(2.5)),
                       (np.array(0.3), torch.tensor(2.5, dtype=torch.float64))):
        got = flash_attn.flash_attn_func(q, k, v, softmax_scale=scale, softcap=cap)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.manual_seed(9)
    expected = flash_attn.flash_attn_func(q, k, v, dropout_p=0.25)
    for p in (np.float32(0.25), torch.tensor(0.25)):
        torch.manual_seed(9)
        assert torch.equal(flash_attn.flash_attn_func(q, k, v, dropout_p=p), expected)


@pytest.mark.kernels_ci
def test_negative_softcap_is_off(flash_attn):
    """flash-attn 2: ``softcap <= 0`` deactivates capping."""
    torch.manual_seed(5)
    q, k, v = make_qkv(1, 6, 6, 2, 2, 16)
    assert torch.equal(flash_attn.flash_attn_func(q, k, v, softcap=-3.0),
                       flash_attn.flash_attn_func(q, k, v))


# -- packed entry points -----------------------------------------------------------------------

def _autograd_nodes(tensor) -> list[str]:
    seen, stack, names = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


@pytest.mark.kernels_ci
@pytest.mark.parametrize("head_dim", [32, 59])
def test_qkvpacked(flash_attn, head_dim):
    torch.manual_seed(6)
    qkv = torch.randn(2, 11, 3, 4, head_dim, dtype=torch.float16, requires_grad=True)
    s_aux = torch.randn(4, requires_grad=True)
    out, lse, probs = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True, s_aux=s_aux,
                                                           return_attn_probs=True)
    assert probs is None and out.shape == (2, 11, 4, head_dim)
    nodes = _autograd_nodes(out)
    assert nodes.count("UnbindBackward0") == 1 and not any("Select" in n for n in nodes), nodes
    dout = torch.randn_like(out)
    dqkv, ds_aux = torch.autograd.grad(out, (qkv, s_aux), dout)
    assert dqkv.shape == qkv.shape
    q, k, v = qkv.unbind(2)
    ours = {"out": out, "lse": oracle_lse(lse), "dq": dqkv[:, :, 0], "dk": dqkv[:, :, 1],
            "dv": dqkv[:, :, 2], "ds_aux": ds_aux}
    assert_matches_reference(ours, q, k, v, dout=dout, s_aux=s_aux, causal=True)


@pytest.mark.kernels_ci
def test_kvpacked_gqa(flash_attn):
    torch.manual_seed(7)
    q = torch.randn(2, 9, 6, 32, dtype=torch.float16, requires_grad=True)
    kv = torch.randn(2, 14, 2, 2, 32, dtype=torch.float16, requires_grad=True)
    out = flash_attn.flash_attn_kvpacked_func(q, kv, window_size=(3, 3), softcap=4.0)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    k, v = kv.unbind(2)
    assert_matches_reference({"out": out, "dq": dq, "dk": dkv[:, :, 0], "dv": dkv[:, :, 1]},
                             q, k, v, dout=dout, window_size=(3, 3), softcap=4.0)


def test_varlen_packed(flash_attn):
    torch.manual_seed(8)
    lengths_q, lengths_k = [4, 0, 9], [6, 5, 9]
    cq, ck = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    qkv = torch.randn(sum(lengths_k), 3, 4, 24, dtype=torch.float16, requires_grad=True)
    out = flash_attn.flash_attn_varlen_qkvpacked_func(qkv, ck, torch.tensor(9), causal=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    q, k, v = qkv.unbind(1)
    assert_matches_reference({"out": out, "dq": dqkv[:, 0], "dk": dqkv[:, 1], "dv": dqkv[:, 2]},
                             q, k, v, dout=dout, causal=True, cu_seqlens_q=ck, cu_seqlens_k=ck)

    q = torch.randn(sum(lengths_q), 4, 24, dtype=torch.float16, requires_grad=True)
    kv = torch.randn(sum(lengths_k), 2, 1, 24, dtype=torch.float16, requires_grad=True)
    out = flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 9, 9, causal=True)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    k, v = kv.unbind(1)
    assert_matches_reference({"out": out, "dq": dq, "dk": dkv[:, 0], "dv": dkv[:, 1]}, q, k, v,
                             dout=dout, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("call, exc", [
    (lambda fa: fa.flash_attn_qkvpacked_func(torch.zeros(2, 3, 2, 1, 8, dtype=torch.float16)),
     ValueError),
    (lambda fa: fa.flash_attn_qkvpacked_func([1.0]), TypeError),
    (lambda fa: fa.flash_attn_kvpacked_func(torch.zeros(1, 2, 1, 8, dtype=torch.float16),
                                            torch.zeros(1, 2, 2, 1, 8)), TypeError),
    (lambda fa: fa.flash_attn_varlen_kvpacked_func(
        torch.zeros(3, 1, 8, dtype=torch.float16), torch.zeros(3, 1, 8, dtype=torch.float16),
        cu_seqlens([3]), cu_seqlens([3]), 3, 3), ValueError),
], ids=["qkv_parts", "qkv_list", "kv_dtype", "kv_rank"])
def test_packed_rejects(flash_attn, call, exc):
    with pytest.raises(exc) as info:
        call(flash_attn)
    name = str(info.value).split(":")[0]
    assert name in ("qkv", "kv") and "; expected " in str(info.value)


# -- rows that see no key: lse = +inf ----------------------------------------------------------

@pytest.mark.kernels_ci
def test_rows_without_keys_report_lse_plus_inf(flash_attn):
    torch.manual_seed(10)
    q, k, v = make_qkv(1, 6, 3, 2, 2, 16)  # causal with Sq > Sk: the first 3 rows see no key
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.isposinf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert not out[:, :3].any()
    s_aux = torch.randn(2)
    _, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=True, s_aux=s_aux,
                                           return_attn_probs=True)
    torch.testing.assert_close(lse[0, :, :3], s_aux[:, None].expand(2, 3))
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([2, 3], [4, 0], 2, 1, 16)
    out, lse, _ = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk,
                                                    return_attn_probs=True)
    assert torch.isposinf(lse[:, 2:]).all() and torch.isfinite(lse[:, :2]).all()
    assert not out[2:].any()


# -- return_attn_probs with dropout ------------------------------------------------------------

def _reference_probs(q, k, *, dtype, **kwargs):
    """Softmax probabilities ``(B, Hq, Sq, Sk)`` from the oracle: attention against one-hot
    values (``v[j] = e_j``) returns row ``i`` of the probability matrix."""
    batch, seqlen_k, heads_kv, head_dim = k.shape
    assert seqlen_k <= head_dim
    onehot = torch.eye(seqlen_k, head_dim, dtype=q.dtype)[None, :, None].expand(
        batch, seqlen_k, heads_kv, head_dim)
    out, _ = attention_reference(q, k, onehot, dtype=dtype, **kwargs)
    return out[..., :seqlen_k].permute(0, 2, 1, 3)


def _reference_dropped(seed, batch, heads_q, seqlen_q, seqlen_k, p):
    return ~torch.stack([torch.stack([dropout_keep_mask(seed, b, h, heads_q, seqlen_q, seqlen_k, p)
                                      for h in range(heads_q)]) for b in range(batch)])


@pytest.mark.kernels_ci
def test_attn_probs_with_dropout_batched(flash_attn):
    torch.manual_seed(11)
    q, k, v = make_qkv(2, 17, 23, 4, 2, 32, transposed=True)
    kwargs = dict(causal=True, softcap=5.0, alibi_slopes=torch.rand(4) * 0.3)
    seed = _drawn_seed(12)
    torch.manual_seed(12)
    out, lse, s_dmask = flash_attn.flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True,
                                                   **kwargs)
    assert s_dmask.shape == (2, 4, 17, 23) and s_dmask.dtype == q.dtype
    ref64 = _reference_probs(q, k, dtype=torch.float64, **kwargs)
    lowp = _reference_probs(q, k, dtype=q.dtype, **kwargs)
    assert_close_to_reference("|S_dmask|", s_dmask.abs(), ref64, lowp)
    assert torch.equal(torch.signbit(s_dmask), _reference_dropped(seed, 2, 4, 17, 23, 0.3))
    # The encoded matrix reproduces the output: kept probabilities, rescaled, times V.
    vh = v.repeat_interleave(2, dim=2).permute(0, 2, 1, 3).to(torch.float64)
    rebuilt = ((s_dmask.to(torch.float64).clamp(min=0) / 0.7) @ vh).permute(0, 2, 1, 3)
    assert_matches_reference({"out": rebuilt}, q, k, v, dropout_p=0.3, seed=seed, **kwargs)
    assert_matches_reference({"out": out}, q, k, v, dropout_p=0.3, seed=seed, **kwargs)


def test_attn_probs_with_dropout_varlen(flash_attn):
    torch.manual_seed(13)
    q, k, v, cq, ck, mq, mk = make_varlen_qkv([3, 0, 6], [5, 2, 4], 2, 1, 16)
    seed = _drawn_seed(14)
    torch.manual_seed(14)
    _, _, s_dmask = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, mq + 1, mk, causal=True,
                                                      dropout_p=0.5, return_attn_probs=True)
    assert s_dmask.shape == (3, 2, 7, 5)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(zip(cq[:-1].tolist(), cq[1:].tolist()),
                                                 zip(ck[:-1].tolist(), ck[1:].tolist()))):
        block = s_dmask[b, :, :q1 - q0, :k1 - k0][None]
        qb, kb = q[None, q0:q1], k[None, k0:k1]
        if q1 > q0:
            ref64 = _reference_probs(qb, kb, dtype=torch.float64, causal=True)
            lowp = _reference_probs(qb, kb, dtype=q.dtype, causal=True)
            assert_close_to_reference(f"|S_dmask[{b}]|", block.abs(), ref64, lowp)
            dropped = _reference_dropped(seed, b + 1, 2, q1 - q0, k1 - k0, 0.5)[b:]
            assert torch.equal(torch.signbit(block), dropped)
        outside = s_dmask[b].clone()
        outside[:, :q1 - q0, :k1 - k0] = 0
        assert not outside.any()


@pytest.mark.kernels_ci
def test_attn_probs_size_limit(flash_attn, monkeypatch, caplog):
    """Over the size limit the matrix is None and a warning says so; out and lse still come."""
    monkeypatch.setattr(submodule(flash_attn, "_attn_probs"), "MAX_ELEMENTS", 100)
    q, k, v = make_qkv(1, 16, 16, 2, 2, 8)
    with caplog.at_level(logging.WARNING, logger="flash_attn"):
        out, lse, probs = flash_attn.flash_attn_func(q, k, v, dropout_p=0.1,
                                                     return_attn_probs=True)
    assert probs is None
    assert out.shape == q.shape and lse.shape == (1, 2, 16)
    assert any("512-entry S_dmask, over the 100-entry limit" in r.getMessage()
               for r in caplog.records)


# -- flash_attn_interface: the private wrappers -----------------------------------------------

@pytest.mark.kernels_ci
@pytest.mark.parametrize("head_dim, dropout_p", [(32, 0.0), (59, 0.2)])
def test_private_forward_backward(flash_attn, head_dim, dropout_p):
    """The wrappers as diffusers drives them (its own autograd over the two), against the public
    function with the same seed."""
    fai = flash_attn.flash_attn_interface
    torch.manual_seed(15)
    q, k, v = make_qkv(2, 10, 12, 4, 2, head_dim, transposed=True)
    scale = head_dim ** -0.5
    torch.manual_seed(16)
    out, lse, s_dmask, rng_state = fai._wrapped_flash_attn_forward(
        q, k, v, dropout_p, scale, True, 5, -1, 0.0, None, False)
    assert out.shape == q.shape and not out.requires_grad and s_dmask.numel() == 0
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    dout = torch.randn_like(out)
    grads = {name: torch.full_like(t, math.nan) for name, t in zip(("dq", "dk", "dv"), (q, k, v))}
    softmax_d = fai._wrapped_flash_attn_backward(
        dout, q, k, v, out, lse, grads["dq"], grads["dk"], grads["dv"], dropout_p, scale, True,
        5, -1, 0.0, None, False, rng_state)
    torch.testing.assert_close(softmax_d, (dout.float() * out.float()).sum(-1).transpose(1, 2))

    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(16)
    ref_out, ref_lse, _ = flash_attn.flash_attn_func(*leaves, dropout_p=dropout_p, causal=True,
                                                     window_size=(5, -1), return_attn_probs=True)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for (name, ours), ref in zip(grads.items(), ref_grads):
        assert torch.equal(ours, ref), name


@pytest.mark.kernels_ci
def test_private_wrappers_dropout_matrix_and_rng_state(flash_attn):
    fai = flash_attn.flash_attn_interface
    torch.manual_seed(17)
    q, k, v = make_qkv(1, 5, 6, 2, 2, 16)
    torch.manual_seed(18)
    _, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.4, 0.25, False, -1, -1, 0.0,
                                                         None, True)
    torch.manual_seed(18)
    _, _, public = flash_attn.flash_attn_func(q, k, v, dropout_p=0.4, softmax_scale=0.25,
                                              return_attn_probs=True)
    assert torch.equal(s_dmask, public) and int(rng_state[0]) == _drawn_seed(18)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match="^rng_state: got None"):
        fai._flash_attn_backward(out, q, k, v, out, lse, None, None, None, 0.4, 0.25, False, -1,
                                 -1, 0.0, None, False)
    with pytest.raises(ValueError, match="^dq: got"):
        fai._flash_attn_backward(out, q, k, v, out, lse, torch.zeros(3), None, None, 0.0, 0.25,
                                 False, -1, -1, 0.0, None, False)


# -- the Triton kernels under the interpreter --------------------------------------------------

TRITON_DROPIN = """
from pathlib import Path
import kernels, torch
from flash_attn_hub.reference import dropout_keep_mask
from helpers import assert_matches_reference, make_qkv, oracle_lse
m = kernels.get_local_kernel(Path({root!r}))
torch.manual_seed(0)
qkv = torch.randn(1, 21, 3, 2, 59, dtype=torch.float16, requires_grad=True)
out, lse, _ = m.flash_attn_qkvpacked_func(qkv, causal=True, window_size=torch.tensor([7, 7]),
                                          return_attn_probs=True)
dout = torch.randn_like(out)
(dqkv,) = torch.autograd.grad(out, (qkv,), dout)
q, k, v = qkv.unbind(2)
ours = dict(out=out, lse=oracle_lse(lse), dq=dqkv[:, :, 0], dk=dqkv[:, :, 1], dv=dqkv[:, :, 2])
assert_matches_reference(ours, q, k, v, dout=dout, causal=True, window_size=(7, 7))
# Dropout: the kernel's mask is the one the probability matrix reports.
q, k, v = make_qkv(1, 9, 11, 2, 1, 59)
torch.manual_seed(5)
seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
torch.manual_seed(5)
out, _, s_dmask = m.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
assert_matches_reference(dict(out=out), q, k, v, dropout_p=0.3, seed=seed, causal=True)
dropped = ~torch.stack([dropout_keep_mask(seed, 0, h, 2, 9, 11, 0.3) for h in range(2)])
assert torch.equal(torch.signbit(s_dmask[0]), dropped)
print("ok")
"""


def test_triton_padded_packed_under_the_interpreter(flash_attn):
    """Head dim 59 (padded to 64), qkv-packed, a tensor window: forward and backward through the
    Triton kernels; with dropout, the kernel's mask is the one ``S_dmask`` reports (fp16; a
    fresh interpreter, as TRITON_INTERPRET=1 must precede the import)."""
    pytest.importorskip("triton")
    code = TRITON_DROPIN.format(root=str(Path(flash_attn.__file__).parents[2]))
    tests = Path(__file__).resolve().parent
    path = [str(tests), str(tests.parent)] + (
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "TRITON_INTERPRET": "1", "FLASH_ATTN_HUB_BACKEND": "triton",
           "FLASH_ATTN_HUB_POISON": "1", "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "ok" in done.stdout


# -- on the GPU: the compiled and Triton kernels behind the same layer ---------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [59, 111])
def test_padded_and_packed_on_the_gpu(flash_attn, dtype, head_dim):
    """Padded head dims through the packed entry points on whichever GPU backend ``auto``
    picks, forward and backward, against the oracle."""
    torch.manual_seed(head_dim)
    qkv = torch.randn(2, 257, 3, 4, head_dim, dtype=dtype, device="cuda", requires_grad=True)
    out, lse, _ = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    q, k, v = qkv.unbind(2)
    assert_matches_reference({"out": out, "lse": oracle_lse(lse), "dq": dqkv[:, :, 0],
                              "dk": dqkv[:, :, 1], "dv": dqkv[:, :, 2]}, q, k, v, dout=dout,
                             causal=True, label="qkvpacked")

    lengths_q, lengths_k = [1, 200, 77], [130, 200, 5]
    cq, ck = cu_seqlens(lengths_q, "cuda"), cu_seqlens(lengths_k, "cuda")
    q = torch.randn(sum(lengths_q), 8, head_dim, dtype=dtype, device="cuda", requires_grad=True)
    kv = torch.randn(sum(lengths_k), 2, 2, head_dim, dtype=dtype, device="cuda",
                     requires_grad=True)
    out = flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 200, 200, causal=True,
                                                     window_size=(63, 0), softcap=10.0)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    k, v = kv.unbind(1)
    assert_matches_reference({"out": out, "dq": dq, "dk": dkv[:, 0], "dv": dkv[:, 1]}, q, k, v,
                             dout=dout, causal=True, window_size=(63, 0), softcap=10.0,
                             cu_seqlens_q=cq, cu_seqlens_k=ck, label="varlen kvpacked")


@pytest.mark.gpu
def test_attn_probs_report_the_gpu_kernels_mask(flash_attn):
    torch.manual_seed(20)
    q, k, v = make_qkv(2, 33, 47, 4, 2, 64, dtype=torch.bfloat16, device="cuda")
    seed = _drawn_seed(21)
    torch.manual_seed(21)
    out, _, s_dmask = flash_attn.flash_attn_func(q, k, v, dropout_p=0.2, causal=True,
                                                 return_attn_probs=True)
    assert_matches_reference({"out": out}, q, k, v, dropout_p=0.2, seed=seed, causal=True)
    dropped = _reference_dropped(seed, 2, 4, 33, 47, 0.2).to("cuda")
    assert torch.equal(torch.signbit(s_dmask), dropped)


# -- rows past the last sequence (padded varlen batches) ---------------------------------------

ROWS_PAST_CASES = [
    pytest.param("cpu", None, marks=pytest.mark.kernels_ci, id="cpu"),
    pytest.param("cuda", "cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cuda", "triton", marks=pytest.mark.gpu, id="triton"),
]


@pytest.mark.parametrize("device, backend", ROWS_PAST_CASES)
def test_varlen_rows_past_the_last_sequence(flash_attn, monkeypatch, device, backend):
    """[Note: rows past the last sequence]: q and k/v may have more rows than cu_seqlens covers
    (transformers' continuous batching pads batches to a fixed token count for its CUDA graphs,
    as flash-attn 2 allows): the owned rows equal the unpadded call's bitwise, the others are
    rows that see no key (out 0, lse +inf) and get zero gradients. On the GPU each backend runs
    it in deterministic mode, so the two calls' gradients are comparable bit for bit."""
    if backend:
        monkeypatch.setenv("FLASH_ATTN_HUB_BACKEND", backend)
    torch.manual_seed(7)
    head_dim = 16 if device == "cpu" else 64
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv([5, 9], [7, 11], 4, 2, head_dim,
                                                        device=device)
    pad_q, pad_k = 6, 3
    pad = dict(dtype=q.dtype, device=device)
    qp = torch.cat([q, torch.randn(pad_q, *q.shape[1:], **pad)]).requires_grad_()
    kp = torch.cat([k, torch.randn(pad_k, *k.shape[1:], **pad)]).requires_grad_()
    vp = torch.cat([v, torch.randn(pad_k, *v.shape[1:], **pad)]).requires_grad_()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    kw = dict(causal=True, return_attn_probs=True, deterministic=device != "cpu")
    out, lse, _ = flash_attn.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max_q, max_k, **kw)
    ref, ref_lse, _ = flash_attn.flash_attn_varlen_func(qr, kr, vr, cu_q, cu_k, max_q, max_k,
                                                        **kw)
    rows = q.shape[0]
    assert torch.equal(out[:rows], ref) and torch.equal(lse[:, :rows], ref_lse)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:]))
    assert torch.isposinf(lse[:, rows:]).all()
    dout = torch.randn_like(out)
    torch.autograd.backward(out, dout)
    torch.autograd.backward(ref, dout[:rows])
    for padded, plain, owned in ((qp, qr, rows), (kp, kr, k.shape[0]), (vp, vr, k.shape[0])):
        assert torch.equal(padded.grad[:owned], plain.grad)
        assert torch.equal(padded.grad[owned:], torch.zeros_like(padded.grad[owned:]))


@pytest.mark.kernels_ci
def test_varlen_cu_seqlens_past_the_rows_is_refused(flash_attn):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_qkv([5, 9], [7, 11], 4, 2, 16)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: got last element 14; expected at most "
                                         r"the number of rows \(13\)"):
        flash_attn.flash_attn_varlen_func(q[:13], k, v, cu_q, cu_k, max_q, max_k)
