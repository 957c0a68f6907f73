"""The implementations the benchmark compares: ours (per backend, loaded through
``kernels``) and the peers (PyTorch SDPA backends, FlexAttention, flash-attn 2 / 3 when
importable).

The calling conventions shared with the ``kernels benchmark`` script (a flash-attn 2 style
call, SDPA with flash-attn's mask semantics) live in ``benchmarks/benchmark.py``, the file a
Hub snapshot ships, and are imported from there (:func:`hub_benchmark`).

Every provider turns a workload and one canonical input set (``workloads.Inputs``) into a
:class:`Prepared`: a zero-argument forward closure plus the maps between its own layout
and the canonical one (only the padded-SDPA varlen peer has a layout of its own). Layout
changes that users would not pay for (padding a packed batch) happen in ``prepare``,
outside the timed closure; free views (``transpose``) happen inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

import torch

from .. import REPO_ROOT, reference
from .workloads import Inputs, Workload, visible_pairs

BACKEND_ENV = "FLASH_ATTN_HUB_BACKEND"
GPU_DEFAULT = ("ours-cuda", "ours-triton", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex",
               "flash-attn2", "fa3")
CPU_DEFAULT = ("ours-cpu", "sdpa-math")
# ours-auto: the package's own choice per call (what users get); not in the default set, whose
# ours-cuda / ours-triton already measure both GPU backends.
KNOWN = GPU_DEFAULT + ("ours-auto", "ours-cpu", "sdpa-math")
HUB_BENCHMARK = REPO_ROOT / "benchmarks" / "benchmark.py"


@functools.lru_cache(maxsize=1)
def hub_benchmark():
    """``benchmarks/benchmark.py`` imported from the source tree (registered in
    ``sys.modules`` under its own name, which its dataclasses need)."""
    name = "flash_attn_hub_bench_hub_benchmark"
    spec = importlib.util.spec_from_file_location(name, HUB_BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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
def backend_env(value: str):
    """Force our package's dispatch (read per call) onto one backend."""
    old = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = old


class FlashApi(Provider):
    """A package with flash-attn 2's API (ours, flash-attn 2, FlashAttention-3): native GQA,
    bottom-right causal, windows and varlen, called through ``hub_benchmark().flash_attn_forward``."""
    module = None

    def prepare(self, w, x):
        call = functools.partial(hub_benchmark().flash_attn_forward, self.module, x.q, x.k, x.v,
                                 causal=w.causal, window_size=w.window_size)
        if w.varlen:
            call = functools.partial(call, cu_seqlens=x.cu_seqlens, max_seqlen=max(w.seqlens))
        return Prepared([x.q, x.k, x.v], call)


class Ours(FlashApi):
    """Our package through its public API, one backend at a time (``FLASH_ATTN_HUB_BACKEND``).

    The CUDA backend is measured only while it is validated (``_cuda.VALIDATED``: an unvalidated
    kernel may crash the process, ending the whole benchmark), unless it was asked for by name
    (``explicit``)."""
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

    def context(self):
        return backend_env(self.backend)


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
        q, k, v = x.q, x.k, x.v
        if w.varlen:  # right padding keeps the score matrix square: valid queries never see padded keys
            gen = torch.Generator(device=x.q.device).manual_seed(7)
            to_provider, to_canonical = _padding_maps(w, x.q.device, gen)
            q, k, v = (to_provider(t).detach().requires_grad_() for t in (q, k, v))
        call = functools.partial(hub_benchmark().sdpa_forward, q, k, v, causal=w.causal, attn_mask=mask)
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


class Flex(Provider):
    """FlexAttention, ``torch.compile``'d (static shapes: one graph per shape and mask);
    masks as block masks, GQA through ``enable_gqa``, packed documents as a document mask."""
    name = "flex"

    def __init__(self):
        self._compiled = None
        self._mask_for = None  # (workload, block mask) of the last workload: shared by its input sets

    def label(self, w):
        return "flex-docmask" if w.varlen else self.name

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
        q, k, v = x.q, x.k, x.v

        if w.varlen:
            def fwd():
                out = flex(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
                           v.unsqueeze(0).transpose(1, 2), block_mask=block_mask, enable_gqa=w.gqa)
                return out.transpose(1, 2)[0]
        else:
            def fwd():
                out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           block_mask=block_mask, enable_gqa=w.gqa)
                return out.transpose(1, 2)
        return Prepared([q, k, v], fwd)


class FlashAttnPackage(FlashApi):
    """The flash-attn 2 (``flash_attn``) or FlashAttention-3 (``flash_attn_interface``) pip
    packages, when installed (and not our own package under the same name)."""

    def __init__(self, name: str, module_name: str, ours_module=None):
        self.name = name
        self.module_name = module_name
        self.ours_file = Path(getattr(ours_module, "__file__", "") or "/nonexistent").resolve()

    def unavailable(self):
        try:
            module = importlib.import_module(self.module_name)
        except Exception as err:
            return f"`import {self.module_name}` failed ({type(err).__name__})"
        if Path(getattr(module, "__file__", "") or "").resolve().parent == self.ours_file.parent:
            return f"`{self.module_name}` is our own package"
        self.module = module
        return None


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
        else:
            raise ValueError(f"providers: unknown provider {name!r}; known: {', '.join(KNOWN)}")
    return out
