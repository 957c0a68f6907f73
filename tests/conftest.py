"""Shared fixtures: the package as users get it (built, then loaded through ``kernels``).

Outputs the package allocates are poisoned with NaN for the whole test session
(``FLASH_ATTN_HUB_POISON=1``), so an element a backend forgets to write fails the comparison
instead of passing on stale memory. Tests marked ``gpu`` are skipped without CUDA.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("FLASH_ATTN_HUB_POISON", "1")
# Without a GPU the Triton kernels run under Triton's interpreter. Triton reads the variable when
# a function is decorated, its own library's included (tl.cdiv, tl.sum, ...), so it is set here,
# before any test module imports triton (torch._dynamo does, at collection).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def flash_attn(tmp_path_factory):
    """The kernel module, built for this machine into a temporary repository and imported the
    way users import it (``kernels.get_local_kernel``): its ``__name__`` is the build's ops
    namespace, and its backends are ``importlib.import_module(f"{mod.__name__}._cpu")`` etc.
    ``FLASH_ATTN_HUB_TEST_REPO=<repo root>`` loads an existing ``<root>/build`` instead."""
    import kernels

    prebuilt = os.environ.get("FLASH_ATTN_HUB_TEST_REPO")
    if prebuilt:
        # A repository whose build/ already holds this machine's variant (GPU runs build the
        # CUDA variant once instead of once per test process).
        return kernels.get_local_kernel(Path(prebuilt))
    from flash_attn_hub.build import build_variant

    root = tmp_path_factory.mktemp("flash_attn_repo")
    build_variant(root / "build")
    return kernels.get_local_kernel(root)


@pytest.fixture(scope="module")
def cuda_backend(flash_attn):
    """The package's Hopper CUDA backend module (``_cuda``)."""
    return importlib.import_module(flash_attn.__name__ + "._cuda")


@pytest.fixture(scope="module")
def heuristics(flash_attn):
    """The package's launch heuristics (``_heuristics``)."""
    return importlib.import_module(flash_attn.__name__ + "._heuristics")


@pytest.fixture(scope="module")
def attn_params(flash_attn):
    """The package's ``AttnParams`` (test files that load the source package override it)."""
    return importlib.import_module(flash_attn.__name__ + "._params").AttnParams
