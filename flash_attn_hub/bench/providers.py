"""The implementations the benchmark compares: ours (per backend, loaded through
``kernels``) and the peers (PyTorch SDPA backends, FlexAttention, FlashAttention-4, and
flash-attn 2 / FlashAttention-3 when installed).

Every provider turns a workload and one canonical input set (``workloads.Inputs``) into a
:class:`Prepared`: a zero-argument forward closure plus the maps between its own layout
and the canonical one (only the padded-SDPA varlen peer has a layout of its own). Layout
changes that users would not pay for (padding a packed batch) happen in ``prepare``,
outside the timed closure; free views (``transpose``) happen inside it. A provider that
cannot run a workload says why (``unsupported``), or fails verification or its first call
(the runner records the reason); either way it is skipped for that workload only.

KV-cache decode steps (``Workload.kv_cache``) are ``flash_attn_with_kvcache`` calls for ours
(value checks off, as a serving loop runs it; see ``KV_CHECK_VALUES_ENV``), and for SDPA an
attention over the contiguous cache read in place (``enable_gqa``, causal lower-right for
several new tokens). SDPA has no paged cache. FlashInfer (``flashinfer``) runs kv-cache steps
only, through its paged decode wrapper (:class:`FlashInfer`). The other peers are not wired to a
kv-cache call here: they skip those cells.

Logit soft-capping (``Workload.softcap``, Gemma 2's): ours, flash-attn 2 / FlashAttention-3 and
FlashAttention-4 take it as ``softcap``, FlexAttention as a ``score_mod`` on the scaled scores
(:func:`softcap_score_mod`); SDPA has none and FlashInfer is not wired to it here: they skip
those cells with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
from pathlib import Path
from typing import Callable

import torch

from .. import reference
from .workloads import Inputs, Workload, visible_pairs

BACKEND_ENV = "FLASH_ATTN_HUB_BACKEND"
# Our kv-cache entry points check index values on the host unless a CUDA graph is captured
# (a device-to-host read per eager call); a serving loop turns that off (_kvcache_values.py's
# [Note: value checks]), and so does the benchmark, so eager host time is the loop's.
KV_CHECK_VALUES_ENV = "FLASH_ATTN_HUB_CHECK_VALUES"
GPU_DEFAULT = ("ours-cuda", "ours-triton", "fa4", "sdpa-cudnn", "sdpa-flash", "flex", "flash-attn2", "fa3",
               "flashinfer")
CPU_DEFAULT = ("ours-cpu", "sdpa-math")
# ours-auto: the package's own choice per call (what users get); not in the default set, whose
# ours-cuda / ours-triton already measure both GPU backends. sdpa-efficient: no GQA, far behind.
KNOWN = GPU_DEFAULT + ("ours-auto", "ours-cpu", "sdpa-efficient", "sdpa-math")


def flash_attn_forward(module, q, k, v, *, causal: bool, window_size=(-1, -1), softcap: float = 0.0,
                       cu_seqlens=None, max_seqlen: int | None = None) -> torch.Tensor:
    """One call of a flash-attn 2 style API (ours, flash-attn 2, FlashAttention-3 share it):
    batched ``(B, S, H, D)``, or packed ``(T, H, D)`` with ``cu_seqlens`` (the same for q and
    k) and ``max_seqlen``. Returns the output (these APIs may return a tuple starting with it).
    ``softcap`` is passed only when on: flash-attn 2 releases before 2.6 have no such argument,
    and they still run every other grid."""
    kwargs = dict(causal=causal, window_size=window_size)
    if softcap > 0:
        kwargs["softcap"] = softcap
    if cu_seqlens is not None:
        result = module.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    else:
        result = module.flash_attn_func(q, k, v, **kwargs)
    return result[0] if isinstance(result, (tuple, list)) else result


def kvcache_forward(module, q, k_cache, v_cache, *, cache_seqlens, block_table=None, causal: bool,
                    window_size=(-1, -1), softcap: float = 0.0) -> torch.Tensor:
    """One decode step through a flash-attn 2 style ``flash_attn_with_kvcache`` (ours): the
    caches already hold ``cache_seqlens`` keys, none is appended. ``softcap`` only when on,
    as in :func:`flash_attn_forward`."""
    extra = {"softcap": softcap} if softcap > 0 else {}
    result = module.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                            block_table=block_table, causal=causal, window_size=window_size,
                                            **extra)
    return result[0] if isinstance(result, (tuple, list)) else result


def sdpa_forward(q, k, v, *, causal: bool, attn_mask=None) -> torch.Tensor:
    """``scaled_dot_product_attention`` on flash-attn's ``(B, S, H, D)`` layout, with
    flash-attn's semantics: GQA through ``enable_gqa``, causal bottom-right aligned
    (``is_causal`` for a square score matrix, ``causal_lower_right`` otherwise; a single
    query sees every key). A dense boolean ``attn_mask`` replaces the causal mask."""
    from torch.nn.attention.bias import causal_lower_right

    sq, sk = q.shape[1], k.shape[1]
    is_causal = False
    if attn_mask is None and causal:
        if sq == sk:
            is_causal = True
        elif sq > 1:
            attn_mask = causal_lower_right(sq, sk)
    gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, is_causal=is_causal, **gqa)
    return out.transpose(1, 2)


def _identity(t: torch.Tensor, pad: str = "random") -> torch.Tensor:
    return t


@dataclasses.dataclass
class Prepared:
    leaves: list[torch.Tensor]  # q, k, v in the provider's layout; gradients land here
    fwd: Callable[[], torch.Tensor]
    to_canonical: Callable[[torch.Tensor], torch.Tensor] = _identity
    to_provider: Callable[..., torch.Tensor] = _identity  # (tensor, pad="random"|"zeros")


class Provider:
    """Base: a name, where it runs, what it cannot do (a reason), how to prepare."""
    name = ""
    is_ours = False
    devices = ("cuda",)

    def label(self, w: Workload) -> str:
        """The provider column in results; differs from ``name`` when the workload
        forces the provider onto a workaround (padding, a dense mask)."""
        return self.name

    def unavailable(self) -> str | None:
        return None

    def unsupported(self, w: Workload) -> str | None:
        return None

    def context(self):
        return contextlib.nullcontext()

    def prepare(self, w: Workload, x: Inputs) -> Prepared:
        raise NotImplementedError


@contextlib.contextmanager
def environ(**values: str):
    """Set environment variables our package reads per call (its backend, its value checks),
    restoring them afterwards."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class FlashApi(Provider):
    """A package with flash-attn 2's API (ours, flash-attn 2, FlashAttention-3): native GQA,
    bottom-right causal, windows, softcap and varlen, called through :func:`flash_attn_forward`;
    a kv-cache step (ours) through :func:`kvcache_forward`."""
    module = None

    def prepare(self, w, x):
        if w.kv_cache:
            call = functools.partial(kvcache_forward, self.module, x.q, x.k, x.v, cache_seqlens=x.cache_seqlens,
                                     block_table=x.block_table, causal=w.causal, window_size=w.window_size,
                                     softcap=w.softcap)
            return Prepared([x.q, x.k, x.v], call)
        call = functools.partial(flash_attn_forward, self.module, x.q, x.k, x.v,
                                 causal=w.causal, window_size=w.window_size, softcap=w.softcap)
        if w.varlen:
            call = functools.partial(call, cu_seqlens=x.cu_seqlens, max_seqlen=max(w.seqlens))
        return Prepared([x.q, x.k, x.v], call)


class Ours(FlashApi):
    """Our package through its public API, one backend at a time (``FLASH_ATTN_HUB_BACKEND``).

    The CUDA backend is measured only while it is validated (``_cuda.VALIDATED``: an unvalidated
    kernel may crash the process, ending the whole benchmark), unless it was asked for by name
    (``explicit``). It has no kv-cache kernel (the package runs those calls on Triton), so
    ``ours-triton`` alone measures kv-cache steps on a GPU."""
    is_ours = True

    def __init__(self, module, backend: str, load_error: str | None = None, explicit: bool = False):
        self.module = module
        self.load_error = load_error
        self.backend = backend
        self.explicit = explicit
        self.name = f"ours-{backend}"
        self.devices = ("cpu",) if backend == "cpu" else ("cuda",)

    def unavailable(self):
        if self.module is None:
            return f"our kernel was not loaded ({self.load_error or 'not requested'})"
        if self.backend == "cuda":
            try:
                cuda = importlib.import_module(self.module.__name__ + "._cuda")
            except Exception as err:  # the build may be Triton-only
                return f"this build has no CUDA backend ({type(err).__name__}: {err})"
            if not getattr(cuda, "VALIDATED", False) and not self.explicit:
                return ("the CUDA backend is not validated on a GPU yet (_cuda.VALIDATED is False); "
                        "name ours-cuda in --providers to measure it anyway")
        return None

    def unsupported(self, w):
        if w.kv_cache and self.backend == "cuda":
            return "the CUDA backend has no kv-cache kernel (the package runs it on Triton: ours-triton)"
        if w.kv_cache and not hasattr(self.module, "flash_attn_with_kvcache"):
            return "this build has no flash_attn_with_kvcache"
        return None

    def context(self):
        return environ(**{BACKEND_ENV: self.backend, KV_CHECK_VALUES_ENV: "0"})


def _padding_maps(w: Workload, device, generator):
    """Maps between a packed ``(T, H, D)`` batch and a right-padded ``(B, maxlen, H, D)``
    one. Padding holds random values (inputs) or zeros (upstream gradients: a loss ignores
    padded positions)."""
    longest = max(w.seqlens)
    index = torch.cat([torch.arange(n, device=device) + i * longest for i, n in enumerate(w.seqlens)])

    def to_provider(t, pad="random"):
        flat_shape = (len(w.seqlens) * longest, *t.shape[1:])
        if pad == "zeros":
            flat = torch.zeros(flat_shape, device=t.device, dtype=t.dtype)
        else:
            flat = torch.randn(flat_shape, generator=generator, device=t.device).to(t.dtype)
        flat[index] = t.detach()
        return flat.view(len(w.seqlens), longest, *t.shape[1:])

    def to_canonical(t):
        return t.reshape(-1, *t.shape[2:])[index]

    return to_provider, to_canonical


class Sdpa(Provider):
    """``torch.nn.functional.scaled_dot_product_attention`` pinned to one backend."""
    KINDS = {
        "flash": "FLASH_ATTENTION",
        "cudnn": "CUDNN_ATTENTION",
        "efficient": "EFFICIENT_ATTENTION",
        "math": "MATH",
    }

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"sdpa-{kind}"
        self.devices = ("cpu", "cuda") if kind == "math" else ("cuda",)

    def label(self, w):
        if w.varlen:
            return f"{self.name}-padded"
        if w.windowed:
            return f"{self.name}-densemask"
        return self.name

    def unsupported(self, w):
        if w.softcap > 0:
            return "SDPA has no logit soft-capping"
        if w.kv_cache and w.page_size:
            return "SDPA has no paged cache (it reads the contiguous cache in place)"
        if w.windowed and self.kind in ("flash", "cudnn"):
            return f"SDPA {self.kind} takes no mask: a sliding window needs a dense mask"
        if w.gqa and self.kind == "efficient":
            return "SDPA mem-efficient has no GQA (enable_gqa)"
        return None

    def context(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([getattr(SDPBackend, self.KINDS[self.kind])])

    def prepare(self, w, x):
        mask = None
        if w.windowed:
            mask = reference.visible_mask(w.seqlen_q, w.seqlen_k, w.window_left, w.window_size[1],
                                          x.q.device)
        to_provider, to_canonical = _identity, _identity
        q, k, v = x.q, x.k, x.v  # a kv-cache step: the contiguous caches, every position filled
        if w.varlen:  # right padding keeps the score matrix square: valid queries never see padded keys
            gen = torch.Generator(device=x.q.device).manual_seed(7)
            to_provider, to_canonical = _padding_maps(w, x.q.device, gen)
            q, k, v = (to_provider(t).detach().requires_grad_() for t in (q, k, v))
        call = functools.partial(sdpa_forward, q, k, v, causal=w.causal, attn_mask=mask)
        return Prepared([q, k, v], call, to_canonical, to_provider)


def _configure_compile():
    """One compile per (shape, mask) with no eager fallback: raise the recompile limits
    far above the grid's size and make hitting them an error, not a silent fallback.

    [Note] Donated buffers. AOTAutograd lets a compiled backward reuse ("donate") saved
    buffers, which forbids ``backward(retain_graph=True)``; the "bwd" mode needs it to time
    the backward alone on one forward graph, so donation is turned off (a memory
    optimisation, not a change of the kernels)."""
    import torch._dynamo.config as dynamo
    import torch._functorch.config as functorch
    functorch.donated_buffer = False
    for name, value in (("recompile_limit", 4096), ("cache_size_limit", 4096),
                        ("accumulated_recompile_limit", 65536), ("accumulated_cache_size_limit", 65536)):
        if hasattr(dynamo, name):
            setattr(dynamo, name, value)
    if hasattr(dynamo, "fail_on_recompile_limit_hit"):
        dynamo.fail_on_recompile_limit_hit = True


@functools.cache  # one function per value: a new closure per input set could recompile the graph
def softcap_score_mod(softcap: float):
    """FlexAttention's ``score_mod`` for flash-attn's ``softcap``: FlexAttention hands it the
    score already multiplied by the softmax scale (and masks after it), so capping that score
    is flash-attn's ``softcap * tanh(scale * q.k / softcap)``, with no scale after it."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)
    return score_mod


class Flex(Provider):
    """FlexAttention, ``torch.compile``'d (static shapes: one graph per shape and mask);
    masks as block masks, GQA through ``enable_gqa``, packed documents as a document mask,
    softcap as a ``score_mod`` (:func:`softcap_score_mod`)."""
    name = "flex"

    def __init__(self):
        self._compiled = None
        self._mask_for = None  # (workload, block mask) of the last workload: shared by its input sets

    def label(self, w):
        return "flex-docmask" if w.varlen else self.name

    def unsupported(self, w):
        return "no kv-cache call wired for FlexAttention here" if w.kv_cache else None

    def _flex(self):
        if self._compiled is None:
            from torch.nn.attention.flex_attention import flex_attention
            _configure_compile()
            self._compiled = torch.compile(flex_attention, dynamic=False)
        return self._compiled

    @staticmethod
    def _block_mask(w: Workload, x: Inputs):
        from torch.nn.attention.flex_attention import create_block_mask
        device = x.q.device
        left, right = w.window_size
        if w.varlen:
            doc = torch.repeat_interleave(torch.arange(len(w.seqlens), device=device),
                                          torch.tensor(w.seqlens, device=device))

            def mask_mod(b, h, q_idx, kv_idx):
                ok = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
                if left >= 0:
                    ok = ok & (q_idx - kv_idx <= left)
                return ok
            return create_block_mask(mask_mod, None, None, w.total_tokens_q, w.total_tokens_q, device=device)
        right = 0 if w.causal else right
        if visible_pairs(w.seqlen_q, w.seqlen_k, left, right) == w.seqlen_q * w.seqlen_k:
            return None  # every key visible: no mask
        offset = w.seqlen_k - w.seqlen_q

        def mask_mod(b, h, q_idx, kv_idx):
            diag = q_idx + offset
            ok = kv_idx == kv_idx
            if right >= 0:
                ok = ok & (kv_idx <= diag + right)
            if left >= 0:
                ok = ok & (kv_idx >= diag - left)
            return ok
        return create_block_mask(mask_mod, None, None, w.seqlen_q, w.seqlen_k, device=device)

    def prepare(self, w, x):
        flex = self._flex()
        if self._mask_for is None or self._mask_for[0] != w:
            self._mask_for = (w, self._block_mask(w, x))
        block_mask = self._mask_for[1]
        score_mod = softcap_score_mod(w.softcap) if w.softcap > 0 else None
        q, k, v = x.q, x.k, x.v

        if w.varlen:
            def fwd():
                out = flex(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
                           v.unsqueeze(0).transpose(1, 2), score_mod=score_mod, block_mask=block_mask,
                           enable_gqa=w.gqa)
                return out.transpose(1, 2)[0]
        else:
            def fwd():
                out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                           block_mask=block_mask, enable_gqa=w.gqa)
                return out.transpose(1, 2)
        return Prepared([q, k, v], fwd)


def import_peer(module_name: str, package: str, needs: str):
    """``(module, None)`` when ``module_name`` imports and has attribute ``needs``, else
    ``(None, why not)``: how an optional peer package is found (``package``: its pip name)."""
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        return None, f"`import {module_name}` ({package}) failed ({type(err).__name__}: {err})"[:200]
    if not hasattr(module, needs):
        return None, f"`{module_name}` has no {needs}"
    return module, None


class FlashAttnPackage(FlashApi):
    """The flash-attn 2 (``flash_attn``) or FlashAttention-3 (``flash_attn_interface``) pip
    packages, when installed (and not our own package under the same name)."""

    def __init__(self, name: str, module_name: str, ours_module=None):
        self.name = name
        self.module_name = module_name
        self.package = {"flash_attn": "flash-attn", "flash_attn_interface": "flash-attn-3"}.get(
            module_name, module_name)
        self.ours_file = Path(getattr(ours_module, "__file__", "") or "/nonexistent").resolve()

    def unavailable(self):
        # no flash_attn_func: e.g. the namespace flash-attn-4 installs
        module, why = import_peer(self.module_name, self.package, "flash_attn_func")
        if why:
            return why
        if Path(getattr(module, "__file__", "") or "").resolve().parent == self.ours_file.parent:
            return f"`{self.module_name}` is our own package"
        self.module = module
        return None

    def unsupported(self, w):
        # FlashAttention-3 names the block table page_table and flash-attn 2 wants pages of 256
        # keys: not wired here.
        return f"no kv-cache call wired for {self.name} here" if w.kv_cache else None


class FlashAttention4(Provider):
    """FlashAttention-4 (pip ``flash-attn-4``, CuTe DSL, imported as ``flash_attn.cute``), when
    installed: ``(B, S, H, D)`` like ours, native GQA, bottom-right causal, windows (unbounded
    sides as None), ``softcap`` (passed only when on: other cells' calls are as without it) and
    varlen; its backward is autograd through its function. It compiles each configuration on
    its first call, which verification makes before anything is timed (and the runner calls
    every closure once more before timing). What it cannot run fails that first call, and the
    cell is skipped with FA4's own message; a backward that drops the cap (some releases pass
    no softcap to their backward kernel, and their varlen backward asserts it is 0) fails
    verification, and only the backward modes are skipped."""
    name = "fa4"

    def __init__(self):
        self.api = None

    def unavailable(self):
        self.api, why = import_peer("flash_attn.cute", "flash-attn-4", "flash_attn_func")
        return why

    def unsupported(self, w):
        return "no kv-cache call wired for FlashAttention-4 here" if w.kv_cache else None

    def prepare(self, w, x):
        left, right = (None if side < 0 else side for side in w.window_size)
        kwargs = dict(causal=w.causal, window_size=(left, right))
        if w.softcap > 0:
            kwargs["softcap"] = w.softcap
        q, k, v = x.q, x.k, x.v
        if w.varlen:
            longest = max(w.seqlens)
            call = functools.partial(self.api.flash_attn_varlen_func, q, k, v, cu_seqlens_q=x.cu_seqlens,
                                     cu_seqlens_k=x.cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest,
                                     **kwargs)
        else:
            call = functools.partial(self.api.flash_attn_func, q, k, v, **kwargs)

        def fwd():
            result = call()
            return result[0] if isinstance(result, (tuple, list)) else result
        return Prepared([q, k, v], fwd)


def paged_kv_indices(block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                     page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table from a flash-attn style one: ``block_table (B, max_pages)``
    (int32, padded past each sequence's pages) and ``cache_seqlens (B,)`` become int32
    ``indptr (B + 1,)`` (sequence b's pages are ``indices[indptr[b]:indptr[b + 1]]``),
    ``indices`` (the used page ids, sequence by sequence, in order) and ``last_page_len (B,)``
    (keys in each sequence's last page, 1..page_size). Reads the lengths on the host: setup
    work, never timed."""
    if page_size < 1:
        raise ValueError(f"page_size: must be >= 1, got {page_size}")
    if block_table.dim() != 2 or cache_seqlens.shape != block_table.shape[:1]:
        raise ValueError(f"block_table / cache_seqlens: need (B, pages) and (B,), got {tuple(block_table.shape)} "
                         f"and {tuple(cache_seqlens.shape)}")
    lengths = cache_seqlens.to(torch.int64)
    if lengths.numel() and int(lengths.min()) < 1:
        raise ValueError(f"cache_seqlens: FlashInfer's decode needs >= 1 cached key per sequence, got "
                         f"{cache_seqlens.tolist()}")
    pages = (lengths + page_size - 1) // page_size
    if pages.numel() and int(pages.max()) > block_table.shape[1]:
        raise ValueError(f"block_table: {block_table.shape[1]} pages per sequence hold fewer than "
                         f"cache_seqlens={cache_seqlens.tolist()} keys in pages of {page_size}")
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int64, device=block_table.device)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(block_table.shape[1], device=block_table.device) < pages[:, None]
    indices = block_table[used]  # boolean indexing walks row-major: sequence by sequence
    last_page_len = lengths - (pages - 1) * page_size
    return indptr.to(torch.int32), indices.to(torch.int32), last_page_len.to(torch.int32)


class FlashInfer(Provider):
    """FlashInfer (pip ``flashinfer-python``), when installed: a decode step through its public
    paged-KV decode API, ``BatchDecodeWithPagedKVCacheWrapper`` (NHD layout, the workload's
    page size; ``plan`` then ``run``), on kv-cache workloads only.

    - One new token: FlashInfer's CUDA-core decode kernel (the wrapper's default,
      ``use_tensor_cores=False``). Several (multi-token decode): its ``q_len_per_req`` path,
      which runs on the tensor-core kernel and is causal, bottom-right aligned (its only mask
      for several tokens); a non-causal one is skipped.
    - ``backend="fa2"``: FlashInfer's own kernels, named rather than ``auto`` (which may hand
      some shapes to cuDNN or XQA), so that the page knows which kernel it measured.
    - A contiguous cache ``(B, Sk, Hkv, D)`` is already paged memory: viewed (no copy) as
      pages of ``gcd(Sk, 16)`` keys with the identity page table. Pages as long as a whole
      sequence would leave FlashInfer's split-KV scheduler (it splits in whole pages) nothing
      to split for a small batch over a long cache.
    - ``plan`` belongs to setup: a serving loop plans once per step (page table to the
      device, the split-KV schedule) and runs every layer on that plan, so only ``run`` is
      timed. Each input set gets its own wrapper and plan (the runner rotates several); they
      share one zeroed float workspace, as a serving loop's wrappers do.
    - GQA natively; ``softmax_scale`` is FlashInfer's default ``D ** -0.5``, as ours. It
      compiles each configuration on its first ``plan`` (JIT), before anything is timed."""
    name = "flashinfer"
    WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-KV workspace
    CONTIGUOUS_PAGE = 16  # keys per page when a contiguous cache is read as a paged one

    def __init__(self):
        self.api = None
        self._workspace: dict[torch.device, torch.Tensor] = {}

    def unavailable(self):
        self.api, why = import_peer("flashinfer", "flashinfer-python",
                                    "BatchDecodeWithPagedKVCacheWrapper")
        return why

    def unsupported(self, w):
        if not w.kv_cache:
            return "FlashInfer is wired for kv-cache decode steps only here"
        if w.softcap > 0:
            return "FlashInfer's logits_soft_cap is not wired here"
        if w.seqlen_q > 1 and not w.causal:  # one query sees every key: causal or not is the same
            return "FlashInfer's multi-token decode (q_len_per_req) is causal only"
        return None

    def _paged_cache(self, w: Workload, x: Inputs):
        """``(k_cache, v_cache, block_table, page_size)`` of FlashInfer's NHD paged layout."""
        if w.page_size:
            return x.k, x.v, x.block_table, w.page_size
        batch, capacity = x.k.shape[:2]
        page = math.gcd(capacity, self.CONTIGUOUS_PAGE)
        pages = capacity // page
        table = torch.arange(batch * pages, dtype=torch.int32, device=x.k.device).view(batch, pages)
        k_cache, v_cache = (t.view(batch * pages, page, *t.shape[2:]) for t in (x.k, x.v))
        return k_cache, v_cache, table, page

    def prepare(self, w, x):
        device = x.q.device
        if device not in self._workspace:  # must be zeros on first use
            self._workspace[device] = torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        k_cache, v_cache, table, page = self._paged_cache(w, x)
        indptr, indices, last_page_len = paged_kv_indices(table, x.cache_seqlens, page)
        wrapper = self.api.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace[device], "NHD", use_tensor_cores=w.seqlen_q > 1, backend="fa2")
        # Planned here, outside the timed closure: a serving loop plans once per step for all layers.
        wrapper.plan(indptr, indices, last_page_len, w.heads_q, w.heads_kv, w.head_dim, page,
                     q_data_type=x.q.dtype, kv_data_type=k_cache.dtype, window_left=w.window_left,
                     q_len_per_req=w.seqlen_q)
        q = x.q.reshape(-1, w.heads_q, w.head_dim)  # (B * Sq, Hq, D): a view

        def fwd():
            return wrapper.run(q, (k_cache, v_cache)).view(x.q.shape)
        return Prepared([x.q, x.k, x.v], fwd)


def make_providers(names, ours_module, ours_error: str | None = None, *, explicit: bool = False) -> list[Provider]:
    """Providers by name, in the given order (``KNOWN`` lists them); ``explicit``: the names
    were asked for, not the defaults (see :class:`Ours`)."""
    out = []
    for name in names:
        if name.startswith("ours-") and name in KNOWN:
            out.append(Ours(ours_module, name.removeprefix("ours-"), ours_error, explicit=explicit))
        elif name.startswith("sdpa-") and name.removeprefix("sdpa-") in Sdpa.KINDS:
            out.append(Sdpa(name.removeprefix("sdpa-")))
        elif name == "flex":
            out.append(Flex())
        elif name == "flash-attn2":
            out.append(FlashAttnPackage(name, "flash_attn", ours_module))
        elif name == "fa3":
            out.append(FlashAttnPackage(name, "flash_attn_interface", ours_module))
        elif name == "fa4":
            out.append(FlashAttention4())
        elif name == "flashinfer":
            out.append(FlashInfer())
        else:
            raise ValueError(f"providers: unknown provider {name!r}; known: {', '.join(KNOWN)}")
    return out
