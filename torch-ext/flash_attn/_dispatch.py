"""The one dispatch point: which backend function computes a forward or a backward.

``FLASH_ATTN_HUB_BACKEND`` (read on every call, so tests and users can switch it at run time):

* ``auto`` (default): CUDA tensors go to Triton; CPU tensors go to ``_cpu``. The compiled
  Hopper forward ``_cuda`` joins ``auto`` only once ``_cuda.VALIDATED`` is true, and its
  backward once ``_cuda.BWD_VALIDATED`` is, i.e. after each has passed the GPU test matrix;
  until then it runs only when asked for with ``cuda``. A call the CUDA backend supports still
  runs on Triton where ``_heuristics.forward_prefers_triton`` / ``backward_prefers_triton``
  say why (long decodes, small banded backward grids).
* ``triton``: the Triton kernels (``_triton.fwd`` / ``_triton.bwd``). On CPU tensors only under
  Triton's interpreter (``TRITON_INTERPRET=1``).
* ``cuda``: the compiled backend for the forward, an error when it is missing or does not
  support the call; a backward it does not implement runs on Triton (logged).
* ``cpu``: the PyTorch-ops backend ``_cpu``; its torch ops run on any device, which makes it a
  slow but exact fallback for debugging on a GPU too.

Every other choice is made here too, never inside a backend: a call whose ``v`` (or ``dout``)
strides or alignment the CUDA kernel's copy engine cannot read runs on Triton, whatever was
asked for, and a Triton forward with few query rows per kv head over many keys runs on the
split-KV decode (``_triton.decode``, by ``_heuristics.split_kv_applies``). Backends never call
one another.

KV-cache calls (``flash_attn_with_kvcache``, a paged ``flash_attn_varlen_func``) choose the
same way between ``_cpu.kvcache_forward`` and ``_triton.kvcache``
(:func:`select_kvcache_backend`); with ``cuda`` they run on Triton, logged, as no compiled
kernel reads a KV cache. Their value checks read their numbers through one Triton launch where
the call runs on Triton, else through torch ops (:func:`select_kvcache_checks`).

Backend modules are imported on first use, so importing the package imports no kernel module
(and so never touches CUDA or autotuning). Each distinct (direction, backend, reason) is logged
once on the ``flash_attn`` logger, so a fallback to a slower path is never silent.
"""

from __future__ import annotations

import importlib
import logging
import os

from . import _heuristics
from ._params import AttnParams

ENV_BACKEND = "FLASH_ATTN_HUB_BACKEND"
ENV_INTERPRET = "TRITON_INTERPRET"
BACKENDS = ("auto", "triton", "cpu", "cuda")

logger = logging.getLogger("flash_attn")

# (backend, kernel) -> (module, function); kernel is the direction, or "decode" (a forward)
_FUNCTIONS = {
    ("cpu", "forward"): ("_cpu", "forward"),
    ("cpu", "backward"): ("_cpu", "backward"),
    ("triton", "forward"): ("_triton.fwd", "forward"),
    ("triton", "decode"): ("_triton.decode", "forward"),
    ("triton", "backward"): ("_triton.bwd", "backward"),
    ("cuda", "forward"): ("_cuda", "forward"),
    ("cuda", "backward"): ("_cuda", "backward"),
}
_logged: set[tuple] = set()
_NOT_SHIPPED = object()
_cuda_module = None


_modules: dict = {}


def _import(name: str):
    """The backend module ``name``, imported on first use (then looked up without importlib,
    whose machinery was a measurable share of a short call's host time)."""
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(f".{name}", __package__)
    return module


def _cuda():
    """The ``_cuda`` module, or None when this build does not ship it. Only the absence of
    ``_cuda`` itself is tolerated: an import error inside it propagates."""
    global _cuda_module
    if _cuda_module is None:
        try:
            _cuda_module = _import("_cuda")
        except ModuleNotFoundError as err:
            if err.name != f"{__package__}._cuda":
                raise
            _cuda_module = _NOT_SHIPPED
    return None if _cuda_module is _NOT_SHIPPED else _cuda_module


def requested_backend() -> str:
    value = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}: got {os.environ[ENV_BACKEND]!r}; expected one of "
                         f"{', '.join(BACKENDS)}")
    return value


def _interpreting() -> bool:
    return os.environ.get(ENV_INTERPRET, "0") not in ("", "0")


def _off_gpu(requested: str, q):
    """The choice every call shares: ``cpu`` asked for, or tensors not on a CUDA device
    (``(backend name, reason)``), else None; raises when the requested backend cannot run
    CPU tensors."""
    if requested == "cpu":
        return "cpu", f"{ENV_BACKEND}=cpu"
    if q.device.type != "cuda":
        if requested == "auto":
            return "cpu", f"tensors on {q.device.type}"
        if requested == "triton" and _interpreting():
            return "triton", f"{ENV_BACKEND}=triton under {ENV_INTERPRET}=1"
        needs = (f"CUDA tensors, or {ENV_INTERPRET}=1 (set before the package is imported) for "
                 f"CPU tensors" if requested == "triton" else "CUDA tensors")
        raise ValueError(f"{ENV_BACKEND}={requested}: got tensors on {q.device}; the "
                         f"{requested} backend needs {needs}")
    return None


def _choose(requested: str, direction: str, q, k, params: AttnParams, features: dict,
            operands: dict):
    """``(backend name, reason)``; raises when the requested backend cannot run the call.
    ``operands``: the tensors besides q and k that the CUDA kernel reads through its copy
    engine (``v``, and ``dout`` for a backward), by name."""
    chosen = _off_gpu(requested, q)
    if chosen is not None:
        return chosen
    if requested == "triton":
        return "triton", f"{ENV_BACKEND}=triton"
    cuda = _cuda()
    flag = "VALIDATED" if direction == "forward" else "BWD_VALIDATED"
    if requested == "auto" and cuda is not None and not getattr(cuda, flag, False):
        return "triton", (f"the CUDA {direction} is not yet validated on a GPU; "
                          f"{ENV_BACKEND}=cuda opts in")
    if cuda is not None and cuda.supports(q, k, params, backward=direction == "backward",
                                          **features):
        prefers = (_heuristics.forward_prefers_triton if direction == "forward"
                   else _heuristics.backward_prefers_triton)
        why = prefers(q, k, params) if requested == "auto" else None
        if why:
            return "triton", f"{ENV_BACKEND}=auto; {why}"
        unsuited = [name for name, t in operands.items() if not cuda.copy_engine_ok(t)]
        if unsuited:
            return "triton", (f"{ENV_BACKEND}={requested}; {' and '.join(unsuited)} strides/"
                              f"alignment do not suit the CUDA kernel")
        return "cuda", f"{ENV_BACKEND}={requested}, supported by the CUDA backend"
    if requested == "cuda" and direction == "forward":
        missing = ("this build has no compiled CUDA backend" if cuda is None else
                   f"the CUDA backend does not support this call "
                   f"({_describe(q, k, params, features)})")
        raise ValueError(f"{ENV_BACKEND}=cuda: {missing}; use auto or triton")
    why = "this build has no compiled CUDA backend" if cuda is None else (
        f"the CUDA backend does not support this {direction}")
    return "triton", f"{ENV_BACKEND}={requested}; {why}"


def _describe(q, k, params: AttnParams, features: dict) -> str:
    on = [name for name, value in features.items() if value]
    return (f"dtype {q.dtype}, head dim {q.shape[-1]}, {q.shape[-2]}/{k.shape[-2]} heads, "
            f"causal {params.causal}, window ({params.window_left}, {params.window_right}), "
            f"softcap {params.softcap}, dropout {params.dropout_p}"
            + (", " + ", ".join(on) if on else ""))


def select_backend(direction: str, q, k, v, params: AttnParams, *, dout=None, varlen: bool,
                   alibi: bool, sink: bool):
    """The function that runs this call: a backend's destination-passing ``forward``
    (``direction="forward"``) or ``backward`` (which also takes ``dout``).

    ``varlen``/``alibi``/``sink`` say whether cu_seqlens, ALiBi slopes and ``s_aux`` are in
    play; they are passed on to ``_cuda.supports(q, k, params, *, backward, varlen, alibi,
    sink)``."""
    features = {"varlen": varlen, "alibi": alibi, "sink": sink}
    operands = {"v": v} if direction == "forward" else {"v": v, "dout": dout}
    name, reason = _choose(requested_backend(), direction, q, k, params, features, operands)
    kernel = direction
    if name == "triton" and direction == "forward" and _heuristics.split_kv_applies(q, k,
                                                                                   params):
        kernel = "decode"
        reason += ("; few query rows per kv head over many keys run on the split-KV decode "
                   "kernel")
    key = (direction, name, reason, q.device.type)
    if key not in _logged:
        _logged.add(key)
        logger.info("flash_attn %s on %s: %s backend (%s)", direction, q.device.type, name,
                    reason)
    module, function = _FUNCTIONS[(name, kernel)]
    return getattr(_import(module), function)


# KV-cache calls (``flash_attn_with_kvcache``, paged ``flash_attn_varlen_func``): the CPU
# backend's ``kvcache_forward`` or the Triton kernel's ``forward``. No compiled CUDA kernel
# reads a paged cache yet, so ``cuda`` runs them on Triton (logged).
_KVCACHE = {"cpu": ("_cpu", "kvcache_forward"), "triton": ("_triton.kvcache", "forward")}
# Backends that can repeat a call shape's launches ([Note: kv-cache lane] in _triton/kvcache.py).
_KVCACHE_LANES = {"triton": ("_triton.kvcache", "lane")}


def _choose_kvcache(requested: str, q):
    chosen = _off_gpu(requested, q)
    if chosen is not None:
        return chosen
    if requested == "cuda":
        return "triton", f"{ENV_BACKEND}=cuda; the CUDA backend has no kv-cache kernel"
    return "triton", f"{ENV_BACKEND}={requested}"


def select_kvcache_backend(q, *, paged: bool, varlen: bool):
    """The function (``kvcache_forward`` of ``_cpu``, ``forward`` of ``_triton.kvcache``) that
    runs a kv-cache call: the destination-passing contract of ``kvcache._kvcache_body``."""
    name, reason = _choose_kvcache(requested_backend(), q)
    kind = "paged varlen" if varlen else "kv-cache paged" if paged else "kv-cache"
    key = ("kvcache", kind, name, reason, q.device.type)
    if key not in _logged:
        _logged.add(key)
        logger.info("flash_attn %s on %s: %s backend (%s)", kind, q.device.type, name, reason)
    module, function = _KVCACHE[name]
    return getattr(_import(module), function)


# The value checks of kv-cache calls (``_kvcache_values``' [Note: value checks]) gather what the
# host reads in one launch where the call's kernels are Triton's; elsewhere they run torch ops.
_KVCACHE_CHECKS = ("_triton.kvcache_checks", "check_values")


def select_kvcache_checks(t):
    """The function that gathers a kv-cache call's checked values on the device of ``t`` (an
    index tensor of the call) in one launch (``check_values`` of ``_triton.kvcache_checks``)
    where the call runs on Triton: CUDA tensors, unless the ``cpu`` backend is asked for, and
    CPU tensors with ``triton`` under the interpreter. None elsewhere: the checks' torch ops.
    Raises nothing: a backend the call cannot run on is the dispatch's error, after the
    checks."""
    requested = os.environ.get(ENV_BACKEND, "auto").strip().lower()
    if (t.device.type == "cuda" and requested != "cpu"
            or requested == "triton" and _interpreting()):
        return getattr(_import(_KVCACHE_CHECKS[0]), _KVCACHE_CHECKS[1])
    return None


def select_kvcache_lane(q):
    """The function that makes a lane for a kv-cache call of ``q`` (``lane`` of
    ``_triton.kvcache``) on the backend :func:`select_kvcache_backend` chooses, or None when
    that backend has none."""
    name, _ = _choose_kvcache(requested_backend(), q)
    entry = _KVCACHE_LANES.get(name)
    return None if entry is None else getattr(_import(entry[0]), entry[1])
