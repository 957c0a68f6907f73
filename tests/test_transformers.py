"""transformers 5.22 loading the published kernel from the embedded Hub:
``attn_implementation="<repo>@v3"`` on a tiny random Llama with GQA, padded (2-D mask,
unpadded into varlen) and packed (position_ids -> cu_seqlens) batches, logits and the
loss gradient against float64 SDPA with the tolerance rule; ``@<sha>`` pins a build."""

from __future__ import annotations

from pathlib import Path

import pytest

from flash_attn_hub.hub import start_embedded_hub
from flash_attn_hub.hub.testing import client_env, publish_versions

TOKEN = "hf_test_transformers_token"
REPO = "flash-attn-hub/flash-attn"


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
