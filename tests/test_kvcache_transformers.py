"""transformers 5.22's continuous batching (``generate_batch``) with our kernel, against
``paged|sdpa``: the same greedy tokens on a tiny GQA Llama built from a config.

transformers takes its decode fast path (``flash_attn_with_kvcache`` on its paged cache, with
``block_table`` and int32 ``cache_seqlens``, new keys appended in place) only on CUDA; elsewhere
it gathers the pages itself and calls ``flash_attn_varlen_func``. On CPU both paths are
exercised: the varlen one as transformers chooses it, and the fast path with transformers'
CUDA-only availability check bypassed (everything else is transformers' own code). The ``gpu``
test runs the fast path as users get it: CUDA graphs (whose padded batch slots reach the kernel
as ``cache_seqlens = -1``), no warning about block tables or the decode path.

Each run is a child process serving a build through ``LOCAL_KERNELS`` (its ops namespace is
fixed at build time, and transformers keeps one kernel per implementation string).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flash_attn_hub import REPO_ROOT

REPO = "flash-attn-hub/flash-attn"
OURS = f"paged|{REPO}@v3"

# argv: device, then runs "<implementation>|<bypass: 0 or 1>"; 1 bypasses transformers'
# CUDA-only fast-path check. Prints one JSON list: per run, the tokens and the log messages.
_GENERATE = r"""
import json, logging, sys
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import initialization
from flash_attn_hub.verify import tiny_llama

device, runs = sys.argv[1], sys.argv[2:]
messages = []


class Keep(logging.Handler):
    def emit(self, record):
        messages.append(f"{record.name}: {record.getMessage()}")


for name in ("transformers", "flash_attn"):
    logging.getLogger(name).addHandler(Keep())
logging.getLogger("flash_attn").setLevel(logging.INFO)
check = initialization.ensure_decode_fast_path_is_available
torch.manual_seed(0)
prompts = [torch.randint(0, 128, (n,)).tolist() for n in (5, 11, 3, 8, 14)]
results = []
for run in runs:
    implementation, bypass = run.rsplit("|", 1)
    initialization.ensure_decode_fast_path_is_available = (
        (lambda *args: None) if bypass == "1" else check)
    ours = implementation != "paged|sdpa"
    model = tiny_llama().to(device=device, dtype=torch.bfloat16)
    model.set_attn_implementation(implementation)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=64,
                                      max_blocks_per_request=16 if ours else None,
                                      auto_switch_to_flash=False)
    generation = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)
    del messages[:]
    outputs = model.generate_batch(prompts, generation_config=generation,
                                   continuous_batching_config=config)
    results.append({"tokens": [outputs[key].generated_tokens for key in sorted(outputs)],
                    "messages": list(messages)})
print(json.dumps(results))
"""


def _generate(device: str, build_root: Path, *runs: tuple[str, bool]) -> list:
    """``generate_batch`` in a child process for each ``(implementation, bypass)`` run."""
    env = {**os.environ, "LOCAL_KERNELS": f"{REPO}={build_root}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    argv = [f"{impl}|{int(bypass)}" for impl, bypass in runs]
    done = subprocess.run([sys.executable, "-c", _GENERATE, device, *argv], env=env,
                          cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _kvcache_lines(result) -> list:
    return [m for m in result["messages"] if m.startswith("flash_attn: ") and "kv-cache" in m]


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """paged|sdpa, ours as transformers chooses (varlen on CPU), ours on the fast path."""
    from flash_attn_hub.build import build_variant

    root = tmp_path_factory.mktemp("kv-tf-repo")
    build_variant(root / "build", backend="cpu", unique_id="kvtf")
    sdpa, varlen, fast = _generate("cpu", root, ("paged|sdpa", False), (OURS, False),
                                   (OURS, True))
    return {"sdpa": sdpa, "varlen": varlen, "fast": fast}


def test_cpu_varlen_path_generates_sdpa_tokens(cpu_runs):
    ours = cpu_runs["varlen"]
    assert ours["tokens"] == cpu_runs["sdpa"]["tokens"]
    assert not _kvcache_lines(ours)  # transformers gathers the pages and calls varlen here
    assert not any("does not support block tables" in m for m in ours["messages"])


def test_cpu_decode_fast_path_generates_sdpa_tokens(cpu_runs):
    """transformers' decode fast path run on CPU: its block tables (page size 4, padded with
    -1), its cache_seqlens and its in-place append through our ``flash_attn_with_kvcache``."""
    ours = cpu_runs["fast"]
    assert ours["tokens"] == cpu_runs["sdpa"]["tokens"]
    assert _kvcache_lines(ours) == [
        "flash_attn: flash_attn kv-cache paged on cpu: cpu backend (tensors on cpu)"]


@pytest.fixture(scope="module")
def gpu_build(tmp_path_factory):
    """A repository whose build/ holds a variant this GPU machine accepts:
    ``FLASH_ATTN_HUB_TEST_REPO`` (as for the ``flash_attn`` fixture) or a fresh build."""
    prebuilt = os.environ.get("FLASH_ATTN_HUB_TEST_REPO")
    if prebuilt:
        return Path(prebuilt)
    from flash_attn_hub.build import build_variant

    root = tmp_path_factory.mktemp("kv-tf-cuda-repo")
    build_variant(root / "build")
    return root


@pytest.mark.gpu
def test_gpu_decode_fast_path_is_taken_and_generates_sdpa_tokens(gpu_build):
    sdpa, ours = _generate("cuda", gpu_build, ("paged|sdpa", False), (OURS, False))
    unwanted = ("block tables", "not FA3", "decode fast path is not available")
    assert not [m for m in ours["messages"] if any(w in m for w in unwanted)], ours["messages"]
    assert any("kv-cache paged on cuda: triton backend" in m for m in _kvcache_lines(ours)), (
        ours["messages"])
    assert ours["tokens"] == sdpa["tokens"]
