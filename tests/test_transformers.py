"""transformers 5.22 loading the published kernel from the embedded Hub:
``attn_implementation="<repo>@v3"`` on a tiny random Llama with GQA, padded (2-D mask,
unpadded into varlen) and packed (position_ids -> cu_seqlens) batches, logits and the
loss gradient against float64 SDPA with the tolerance rule; ``@<sha>`` pins a build.
A Qwen2.5-0.5B-shaped GQA model (14 query / 2 kv heads) trains a few steps with it, its
losses and gradients checked at every step: on CPU from the CPU build, and (marker ``gpu``)
at sequence length 1024 from this machine's compiled CUDA variant."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flash_attn_hub import REPO_ROOT
from flash_attn_hub.hub import start_embedded_hub
from flash_attn_hub.hub.testing import client_env, publish_versions

TOKEN = "hf_test_transformers_token"
REPO = "flash-attn-hub/flash-attn"


@pytest.fixture(scope="module")
def cuda_hub(tmp_path_factory):
    """This machine's compiled CUDA variant, alone, published as is to its own embedded Hub;
    yields the Hub's endpoint. The variant comes from ``<FLASH_ATTN_HUB_TEST_REPO>/build`` when
    that is set (as for the ``flash_attn`` fixture), else it is built here."""
    from flash_attn_hub.publish import publish

    prebuilt = os.environ.get("FLASH_ATTN_HUB_TEST_REPO")
    if prebuilt:
        build_dir = Path(prebuilt) / "build"
    else:
        from flash_attn_hub.build import build_variant

        build_dir = build_variant(tmp_path_factory.mktemp("tf-cuda-build"), backend="cuda").parent
    cuda_variants = [p for p in sorted(build_dir.iterdir()) if (p / "metadata.json").is_file()
                     and json.loads((p / "metadata.json").read_text())["backend"]["type"] == "cuda"]
    assert cuda_variants, f"no compiled CUDA variant under {build_dir}"
    staged = tmp_path_factory.mktemp("tf-cuda-publish")
    for variant in cuda_variants:
        shutil.copytree(variant, staged / variant.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    server = start_embedded_hub(tmp_path_factory.mktemp("tf-cuda-hub"), token=TOKEN)
    try:
        result = publish(staged, endpoint=server.endpoint, token=TOKEN, repo_id=REPO, allow_dirty=True, card=None,
                         benchmarks_dir=None, log=lambda _: None)
        assert result.version == 3
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    build = pytest.importorskip("flash_attn_hub.build", reason="the build tool is not written yet")
    variant = Path(build.build_variant(tmp_path_factory.mktemp("tf-build"), backend="cpu"))
    server = start_embedded_hub(tmp_path_factory.mktemp("tf-hub"), token=TOKEN)
    try:
        with client_env(server.endpoint, tmp_path_factory.mktemp("tf-hf-home")):
            yield publish_versions(variant, tmp_path_factory.mktemp("tf-versions"), endpoint=server.endpoint,
                                   token=TOKEN, repo_id=REPO, uid_prefix="tf")
    finally:
        server.stop()


def test_llama_gqa_dense_padded_and_packed_match_sdpa(published):
    from flash_attn_hub.verify import check_transformers

    errors = check_transformers(f"{REPO}@v3")
    assert set(errors) == {"dense", "padded", "packed"}


def _assert_training_errors(steps, count):
    assert len(steps) == count
    assert [s["padded"] for s in steps] == [i % 2 == 0 for i in range(count)]
    for errors in steps:
        compared = {k: v for k, v in errors.items() if k not in ("padded", "ref_loss")}
        assert {"loss", "grad"} <= set(compared)
        assert sum(k.endswith("k_proj.weight") for k in compared) == 2  # one per layer
        assert all(math.isfinite(e) for pair in compared.values() for e in pair)


def test_qwen2_gqa_trains_like_sdpa(published):
    from flash_attn_hub.verify import check_transformers_training

    _assert_training_errors(check_transformers_training(f"{REPO}@v3", steps=2, seqlen=64, batch=2), 2)


def test_sha_pins_a_build(published):
    from transformers.integrations.hub_kernels import load_and_register_attn_kernel

    from flash_attn_hub.verify import tiny_llama

    pinned = f"{REPO}@{published[2].commit}"
    kernel = load_and_register_attn_kernel(pinned)
    assert kernel.published_version() == 2
    assert f"/snapshots/{published[2].commit}/" in kernel.__file__
    import torch

    model = tiny_llama().to(torch.bfloat16)
    model.set_attn_implementation(pinned)
    logits = model(input_ids=torch.randint(0, 128, (1, 11))).logits
    assert torch.isfinite(logits).all()


# The variant is published unrenamed (its compiled ops namespace is fixed at build time), so it runs
# in a fresh process: one that has not loaded the same namespace from build/ already, and whose
# transformers has no kernel bound to the same attn_implementation string.
_TRAIN_IN_A_FRESH_PROCESS = """
import json, sys
from flash_attn_hub.verify import check_transformers_training
steps = check_transformers_training(sys.argv[1], steps=3, seqlen=1024, batch=2)
print(json.dumps(steps))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_qwen2_gqa_trains_like_sdpa_on_the_cuda_variant(cuda_hub, backend):
    """``auto`` is what users get (it may route a causal backward at head dim 64 to Triton, see
    ``_heuristics.backward_prefers_triton``); ``cuda`` puts the forward and backward on the sm90 CUDA
    kernels."""
    from flash_attn_hub.verify import child_env

    with tempfile.TemporaryDirectory(prefix="tf-cuda-hf-home-") as hf_home:
        env = {**child_env(cuda_hub, hf_home), "FLASH_ATTN_HUB_BACKEND": backend}
        run = subprocess.run([sys.executable, "-c", _TRAIN_IN_A_FRESH_PROCESS, f"{REPO}@v3"], env=env,
                             cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]
    _assert_training_errors(json.loads(run.stdout.strip().splitlines()[-1]), 3)
