"""The kv-cache Triton kernels compiled for Hopper (sm90a) and Ampere (sm80) on a machine
without a GPU: the interpreter that runs them in CI is lax about types and layouts, the
compiler is not. Each launch the launcher makes is recorded instead of run, then compiled
ahead of time with the argument specialisations a real launch would give it (16-byte
alignment, divisibility, constants), through Triton's own ptxas; the attention kernel must not
spill (its stack frame stays empty) and every kernel must fit the architecture's shared memory.

The compiles run in one child process (``python tests/test_kvcache_compile.py``): a process
that has run kernels under the interpreter (other test modules set ``TRITON_INTERPRET=1``)
cannot compile them afterwards."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch


triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction, native_specialize_impl  # noqa: E402

SOURCE_PACKAGE = Path(__file__).resolve().parents[1] / "torch-ext" / "flash_attn"
SHARED_LIMIT = {90: 232448, 80: 166912}  # bytes of shared memory a block may use
# (module, launcher, kernel) of every launch a kv-cache call with new keys and splits makes, in
# order (the attention kernel appends the new keys itself); each goes through its module's
# cached launcher (``_triton/launch.py``), which is what the recorder replaces
KERNELS = (("kvcache", "_attend", "_attend_kernel"), ("common", "_combine", "combine_kernel"))


def _modules():
    """The source tree's kv-cache kernel module and ``KvCacheParams``, with a stand-in for the
    build's ``_ops`` (the child process imports nothing else of the package)."""
    name = "flash_attn_kvcache_compile"
    package = types.ModuleType(name)
    package.__path__ = [str(SOURCE_PACKAGE)]
    ops = types.ModuleType(name + "._ops")
    ops.add_op_namespace_prefix = lambda op: f"{name}::{op}"
    sys.modules[name] = package
    sys.modules[ops.__name__] = ops
    kernel = importlib.import_module(name + "._triton.kvcache")
    assert isinstance(kernel._attend_kernel, JITFunction)
    return kernel, importlib.import_module(name + "._params").KvCacheParams


class _Recorder:
    """Stands in for a cached launcher: ``bind(*trailing, **constexprs)[grid](*leading)``
    records ``(kernel, leading + trailing, constexprs)`` instead of launching."""

    def __init__(self, fn, calls, trailing=(), constexprs=None):
        self.fn, self.calls = fn, calls
        self.trailing, self.constexprs = trailing, constexprs

    def bind(self, *trailing, **constexprs):
        return _Recorder(self.fn, self.calls, trailing, constexprs)

    def __getitem__(self, grid):
        return lambda *leading: self.calls.append((self.fn, leading + self.trailing,
                                                   dict(self.constexprs)))


def _compile(fn: JITFunction, args, kwargs, arch: int):
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl")
               if k in kwargs}
    values = dict(zip(fn.arg_names, args), **kwargs)
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = values[name]
        if param.is_constexpr or value is None:
            signature[name], constants[name] = "constexpr", value
            continue
        kind, attr = native_specialize_impl(nvidia.CUDABackend, value, False,
                                            not param.do_not_specialize, True)
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = value
        elif attr:
            attrs[(i,)] = nvidia.CUDABackend.parse_attr(attr)
    source = compiler.ASTSource(fn, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _stack_bytes(kernel) -> int:
    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvcache-{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    done = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True,
                          text=True, check=True)
    os.unlink(path)
    return int(re.search(r"STACK:(\d+)", done.stdout).group(1))


CASES = {  # label: (page size or None, leftpad, Sq, heads, head dim, features)
    "decode_page16_gather": (16, False, 1, (32, 8), 128, {}),
    "decode_page256_aligned_sinks": (256, False, 1, (32, 8), 128, {"sink": True}),
    "multi_token_page64": (64, False, 8, (64, 8), 128, {"causal": True}),
    "contiguous_rotary_softcap_alibi": (None, True, 4, (8, 2), 128,
                                        {"rotary": True, "softcap": 30.0, "alibi": True}),
    "contiguous_d256_window": (None, False, 4, (8, 2), 256, {"window": 64}),
    "chunked_prefill_page64_d256_rotary": (64, False, 256, (16, 2), 256, {"rotary": True}),
}


def check(label: str, arch: int) -> list[str]:
    """Records the launches of ``CASES[label]`` and compiles them for ``sm<arch>``; returns the
    problems found (an empty list when there are none)."""
    kernel, params_type = _modules()
    modules = {"kvcache": kernel, "common": sys.modules[kernel.__package__ + ".common"]}
    calls = []
    originals = {(m, name): getattr(modules[m], name)
                 for m, name, _ in KERNELS + (("kvcache", "hopper_or_later", None),)}
    for m, name, _ in KERNELS:
        setattr(modules[m], name, _Recorder(originals[m, name].fn, calls))
    kernel.hopper_or_later = lambda device: arch >= 90
    try:
        _launch(kernel, params_type, label, calls)
    finally:
        for (m, name), value in originals.items():
            setattr(modules[m], name, value)
    problems = []
    if [fn.fn.__name__ for fn, _, _ in calls] != [name for _, _, name in KERNELS]:
        problems.append(f"launched {[fn.fn.__name__ for fn, _, _ in calls]}")
    for fn, args, kwargs in calls:
        name = fn.fn.__name__
        compiled = _compile(fn, args, dict(kwargs), arch)
        if compiled.metadata.shared > SHARED_LIMIT[arch]:
            problems.append(f"{name}: {compiled.metadata.shared} B of shared memory")
        if name == "_attend_kernel" and _stack_bytes(compiled):
            problems.append(f"{name}: a {_stack_bytes(compiled)} B stack frame (spills)")
        # [Note: dependent combine]: on sm90 the combine waits for the attention kernel,
        # which lets it launch; sm80 has neither
        expected = {"_attend_kernel": "griddepcontrol.launch_dependents",
                    "combine_kernel": "griddepcontrol.wait"}[name]
        if (expected in compiled.asm["ptx"]) != (arch >= 90):
            problems.append(f"{name}: {expected} {'missing' if arch >= 90 else 'on sm80'}")
        if name == "combine_kernel" and compiled.metadata.launch_pdl != (arch >= 90):
            problems.append(f"{name}: launch_pdl {compiled.metadata.launch_pdl}")
    return problems


def _launch(kernel, params_type, label: str, calls: list) -> None:
    """The launcher's calls for ``CASES[label]``, on empty CPU tensors (recorded, not run)."""
    page_size, leftpad, seqlen_q, (heads_q, heads_kv), dim, features = CASES[label]
    batch, capacity, dtype = 2, 512, torch.bfloat16
    q = torch.empty(batch, seqlen_q, heads_q, dim, dtype=dtype)
    k = torch.empty(batch, seqlen_q, heads_kv, dim, dtype=dtype)
    if page_size:
        cache = torch.empty(batch * capacity // page_size, page_size, heads_kv, dim, dtype=dtype)
        table = torch.zeros(batch, capacity // page_size, dtype=torch.int32)
    else:
        cache, table = torch.empty(batch, capacity, heads_kv, dim, dtype=dtype), None
    rotary = torch.empty(capacity, dim // 2, dtype=dtype) if features.get("rotary") else None
    causal = features.get("causal", True)
    params = params_type(softmax_scale=0.1, causal=causal, window_left=features.get("window", -1),
                         window_right=0 if causal else -1, softcap=features.get("softcap", 0.0),
                         rotary_interleaved=False, num_splits=3, max_seqlen_q=seqlen_q,
                         max_seqlen_k=capacity)
    tiles = kernel.tiles_for(dim, heads_q // heads_kv * seqlen_q, torch.device("cuda"),
                             page_size=page_size or 0, rotary_append=rotary is not None)
    kernel.forward(
        q, cache, cache.clone(), torch.empty_like(q), torch.empty(batch, heads_q, seqlen_q),
        k=k, v=k.clone(), rotary_cos=rotary, rotary_sin=rotary, block_table=table,
        cache_seqlens=torch.zeros(batch, dtype=torch.int32), cache_batch_idx=None,
        cache_leftpad=torch.zeros(batch, dtype=torch.int32) if leftpad else None,
        cu_seqlens_q=None, cu_seqlens_k=None,
        alibi_slopes=torch.empty(heads_q) if features.get("alibi") else None,
        s_aux=torch.empty(heads_q) if features.get("sink") else None, params=params,
        tiles=tiles)


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(__file__), timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("label", list(CASES))
def test_kernels_compile_without_spills(results, label, arch):
    assert results[f"{label} sm{arch}"] == []


if __name__ == "__main__":
    print(json.dumps({f"{label} sm{arch}": check(label, arch) for label in CASES
                      for arch in (90, 80)}))
