"""Hopper (sm90) CUDA backend: forward and backward.

Calls the compiled destination-passing ops ``ops.hopper_fwd`` and ``ops.hopper_bwd``
(csrc/hopper, registered in torch-ext/torch_binding.cpp). The backward recomputes from q, k, v,
out and lse (the Triton forward's lse has the same definition, so either forward pairs with
either backward). It covers the compiled backward head dims; deterministic mode orders the dQ
reductions (bitwise reproducible). What it cannot run (dropout, ALiBi, a ``v`` or ``dout`` its
copy engine cannot read: ``supports``, ``copy_engine_ok``) the dispatcher sends to Triton and
logs; this module calls no other backend.

Importing this module touches neither CUDA nor the compiled extension; ``supports`` returns
False when the extension is absent (noarch builds) or the op is missing from it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import _heuristics
from ._heuristics import _COMPILED_BWD_HEAD_DIMS, _COMPILED_HEAD_DIMS, bwd_kernel_dim, is_sm90
from ._math import sink_gradient
from ._params import AttnParams

# [Note: validation] ``auto`` dispatch uses this kernel only while VALIDATED is True. It was set
# after tests/test_cuda_fwd.py (85 cases, both dtypes, every compiled head dim and feature),
# tests/test_gpu.py and compute-sanitizer memcheck/racecheck/synccheck passed on an H200;
# FLASH_ATTN_HUB_BACKEND=triton opts out.
VALIDATED = True
# The backward's flag: set after tests/test_cuda_bwd.py (92 cases), tests/test_gpu.py (121, through
# the API with auto) and compute-sanitizer memcheck/racecheck passed on an H200; head dims 192
# and 256 (the head-dim split) joined after the same checks (test_cuda_bwd.py 129 cases, the
# GPU suite 412, the three sanitizer tools clean).
BWD_VALIDATED = True

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = max(_COMPILED_HEAD_DIMS)
_MAX_BWD_HEAD_DIM = max(_COMPILED_BWD_HEAD_DIMS)
# [Note] Backward workspaces in csrc/flash_params.h: sequences start on multiples of
# _WORKSPACE_ALIGN rows; deterministic mode has one semaphore per _WORKSPACE_BLOCK rows
_WORKSPACE_ALIGN = 128
_WORKSPACE_BLOCK = 64
_MAX_GRID_Y_Z = 65535  # heads and batch are grid dimensions
_MAX_STRIDE_BYTES = 1 << 40  # the copy engine's stride limit


@functools.lru_cache(maxsize=None)
def _op(name: str = "hopper_fwd"):
    """``ops.<name>`` of the compiled extension, or None when this build lacks it."""
    try:
        from ._ops import ops
    except ImportError:
        return None
    try:
        return getattr(ops, name)
    except (AttributeError, RuntimeError):
        return None


def copy_engine_ok(t: torch.Tensor) -> bool:
    """The tensor-map rules: 16-byte aligned base, 16-byte multiple strides below 2**40
    (dims of extent 1 are exempt: their stride is never used)."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 != 0:
        return False
    size = t.element_size()
    for extent, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if extent != 1 and (stride <= 0 or (stride * size) % 16 != 0
                            or stride * size >= _MAX_STRIDE_BYTES):
            return False
    return True


def supports(q: torch.Tensor, k: torch.Tensor, params: AttnParams, *, backward: bool,
             varlen: bool, alibi: bool, sink: bool) -> bool:
    """True when ``forward`` can run this call on the compiled sm90 kernel."""
    del varlen, sink  # both implemented
    if alibi or params.dropout_p > 0:
        return False
    if backward and q.shape[-3] == 0:
        return False  # the copy engine needs a non-empty q
    if q.device.type != "cuda" or q.dtype not in _DTYPES or k.dtype != q.dtype:
        return False
    head_dim = q.shape[-1]
    max_head_dim = _MAX_BWD_HEAD_DIM if backward else _MAX_HEAD_DIM
    if head_dim % 8 != 0 or not 0 < head_dim <= max_head_dim or k.shape[-1] != head_dim:
        return False
    if not params.softmax_scale > 0 or params.softcap < 0:
        return False
    if q.shape[-2] > _MAX_GRID_Y_Z or (q.dim() == 4 and q.shape[0] > _MAX_GRID_Y_Z):
        return False
    if k.shape[-3] == 0:  # a tensor map needs a non-empty tensor
        return False
    if not (copy_engine_ok(q) and copy_engine_ok(k)):
        return False
    if _op("hopper_bwd" if backward else "hopper_fwd") is None:
        return False
    return is_sm90(q.device)


# [Note: packed decode] A batched decode (one query per sequence) runs the G = Hq / Hkv query
# heads of one kv head as the G rows of one tile: q (B, 1, Hq, D) is viewed as (B, G, Hkv, D),
# where row g of kv head j is query head j*G + g. That is a plain stride pattern (row stride =
# q's head stride, head stride = G times it), and out and lse take the same view, so the kernel
# runs unchanged with G query rows per kv head: B x Hkv tiles instead of B x Hq, each reading
# its kv head's keys once instead of G times. Large-batch decode, whose B x Hq tiles are many
# waves of SMs, then runs in 1/G of the waves. With one query row a causal mask or a right
# window hides no key, so the packed rows run unmasked; a left window (which would differ from
# row to row once the rows are G) and sinks (one logit per query head, read per tile) keep the
# unpacked launch. Varlen and Sq > 1 are not packed: their (position, head) rows are not one
# stride pattern. tests/test_cuda_fwd.py::test_packed_decode checks it on an sm90 GPU against the
# reference (the view mapping alone is tested on the CPU backend). Measured on the H200 (bf16,
# 32/8 heads, D=128): B=64 decode over 4k / 16k keys runs 3.1x / 3.3x faster than unpacked.
PACKED_DECODE = True


def packed_decode(q, k, out, lse, *, cu_seqlens_q, s_aux, params: AttnParams):
    """``(q, out, lse, params)`` of the packed launch ([Note: packed decode]), or None."""
    group = q.shape[-2] // k.shape[-2]
    if (cu_seqlens_q is not None or q.shape[1] != 1 or group == 1 or s_aux is not None
            or params.window_left >= 0 or lse.stride(1) != 1):
        return None
    batch, _, heads_q, head_dim = q.shape
    heads_kv = heads_q // group

    def rows(t):  # (B, 1, Hq, D) -> (B, G, Hkv, D)
        return t.as_strided((batch, group, heads_kv, head_dim),
                            (t.stride(0), t.stride(2), group * t.stride(2), t.stride(3)))

    packed_lse = lse.as_strided((batch, heads_kv, group), (lse.stride(0), group, 1))
    packed = dataclasses.replace(params, causal=False, window_left=-1, window_right=-1,
                                 max_seqlen_q=group)
    return rows(q), rows(out), packed_lse, packed


def forward(q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, s_aux, alibi_slopes,
            params: AttnParams) -> None:
    """Destination-passing forward (see the backend interface in the package contract)."""
    assert alibi_slopes is None and params.dropout_p == 0, "supports() excludes these"
    assert copy_engine_ok(v), "the dispatcher sends such a v to Triton"
    if s_aux is not None:
        s_aux = s_aux.contiguous()
    packed = PACKED_DECODE and packed_decode(q, k, out, lse, cu_seqlens_q=cu_seqlens_q,
                                             s_aux=s_aux, params=params)
    if packed:
        q, out, lse, params = packed
    _op()(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, s_aux, int(params.max_seqlen_q),
          int(params.max_seqlen_k), float(params.softmax_scale), int(params.window_left),
          int(params.window_right), float(params.softcap))


def _workspace_rows(q: torch.Tensor, cu_seqlens_q) -> tuple[int, int]:
    """``(rows per (batch,) head, number of (batch,) heads)`` of the backward workspaces."""
    w = _WORKSPACE_ALIGN
    if cu_seqlens_q is None:
        return -(-q.shape[1] // w) * w, q.shape[0] * q.shape[2]
    batch = cu_seqlens_q.numel() - 1
    return -(-(q.shape[0] + w * batch) // w) * w, q.shape[1]


def _unpadded(ws: torch.Tensor, q: torch.Tensor, cu_seqlens_q, rows: int) -> torch.Tensor:
    """A workspace vector (delta) in lse's layout: ``(B, Hq, Sq)`` or ``(Hq, Tq)``."""
    if cu_seqlens_q is None:
        b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
        return ws.view(b, hq, rows)[:, :, :sq]
    tokens = torch.arange(q.shape[0], device=q.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens_q[1:], tokens, right=True)
    batch = torch.arange(cu_seqlens_q.numel() - 1, device=q.device)
    w = _WORKSPACE_ALIGN
    starts = (cu_seqlens_q[:-1].long() + w * batch) // w * w
    index = starts[seq] + tokens.long() - cu_seqlens_q[seq].long()
    return ws.view(q.shape[1], rows)[:, index]


def backward(dout, q, k, v, out, lse, dq, dk, dv, ds_aux, *, cu_seqlens_q, cu_seqlens_k, s_aux,
             alibi_slopes, params: AttnParams) -> None:
    """Destination-passing backward (see the backend interface in the package contract)."""
    assert alibi_slopes is None and params.dropout_p == 0, "supports() excludes these"
    assert copy_engine_ok(v) and copy_engine_ok(dout), "the dispatcher sends these to Triton"
    rows, heads = _workspace_rows(q, cu_seqlens_q)
    lse2 = torch.empty(rows * heads, device=q.device, dtype=torch.float32)
    delta = torch.empty_like(lse2)
    kernel_dim = bwd_kernel_dim(q.shape[-1])
    # uninitialised: the preprocess zeroes dq_acc and the semaphores (csrc/hopper/bwd_kernel.h,
    # [Note] Backward preprocess and cast)
    dq_acc = torch.empty(rows * heads, kernel_dim, device=q.device, dtype=torch.float32)
    semaphore = (torch.empty(rows * heads // _WORKSPACE_BLOCK, device=q.device, dtype=torch.int32)
                 if params.deterministic else None)
    # [Note: CUDA group split] in _heuristics; looked up on the module so a test can force it
    splits = _heuristics.cuda_group_splits(q, k, params)
    add = splits > 1 and _heuristics.group_split_adds(params)
    if add:  # every split adds into one fp32 dK/dV
        partial = torch.zeros((2, 1, *k.shape), device=k.device, dtype=torch.float32)
    else:
        partial = (torch.empty((2, splits, *k.shape), device=k.device, dtype=torch.float32)
                   if splits > 1 else None)
    _op("hopper_bwd")(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, dq_acc, lse2, delta,
                      semaphore, cu_seqlens_q, cu_seqlens_k, int(params.max_seqlen_q),
                      int(params.max_seqlen_k), float(params.softmax_scale),
                      int(params.window_left), int(params.window_right), float(params.softcap),
                      partial, splits if add else 0)
    if add:
        dk.copy_(partial[0, 0])
        dv.copy_(partial[1, 0])
    elif partial is not None:  # a fixed order over the splits: still bitwise reproducible
        dk.copy_(partial[0].sum(0))
        dv.copy_(partial[1].sum(0))
    if ds_aux is not None:
        ds_aux.copy_(sink_gradient(s_aux, lse, _unpadded(delta, q, cu_seqlens_q, rows),
                                    cu_seqlens_q is not None))
