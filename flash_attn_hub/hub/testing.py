"""Helpers for tests that publish to and load from an embedded Hub in one process.

* :func:`client_env` points huggingface_hub, kernels and transformers (already
  imported, so environment variables alone come too late) at a Hub and a cache.
* :func:`craft_variant` copies a built variant as version ``N`` with its own ops
  namespace (so several versions load side by side) and an edited ``__all__``,
  and re-computes its digest with kernels' own ``Digest.hash_variant``.
* :func:`dummy_variant` writes a minimal loadable variant (no attention) for
  server and publish tests that do not need the real kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from unittest import mock

_ENV_KEYS = ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "KERNELS_CACHE",
             "LOCAL_KERNELS", "HF_TOKEN")


@contextlib.contextmanager
def client_env(endpoint: str, hf_home: Path, *, offline: bool = False):
    """Within the block, clients in this process and children started from it use
    ``endpoint`` and the cache under ``hf_home``; ``offline`` sets HF_HUB_OFFLINE."""
    from huggingface_hub import constants
    import kernels.hf_hub
    import kernels.resolver

    endpoint = endpoint.rstrip("/")
    hub_cache = str(Path(hf_home) / "hub")
    env = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_PROGRESS_BARS="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    patches = [
        mock.patch.dict(os.environ, env, clear=True),
        mock.patch.object(constants, "ENDPOINT", endpoint),
        mock.patch.object(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                          endpoint + "/{repo_id}/resolve/{revision}/{filename}"),
        mock.patch.object(constants, "HF_HOME", str(hf_home)),
        mock.patch.object(constants, "HF_HUB_CACHE", hub_cache),
        mock.patch.object(constants, "HF_HUB_OFFLINE", offline),
        mock.patch.object(kernels.hf_hub, "CACHE_DIR", None),
        mock.patch.object(kernels.resolver, "CACHE_DIR", None),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield env


def write_digest(folder: Path) -> None:
    """Recompute ``metadata.json``'s digest over ``folder`` with kernels' Digest API."""
    from kernels._rust import Digest, DigestAlgorithm

    path = folder / "metadata.json"
    metadata = json.loads(path.read_text())
    digest = Digest.hash_variant(DigestAlgorithm.SHA256, folder)  # never covers metadata.json itself
    metadata["digest"] = {"algorithm": "sha256", "files": dict(digest.files)}
    path.write_text(json.dumps(metadata, indent=2) + "\n")


def craft_variant(variant_dir: Path, build_dir: Path, *, version: int, uid: str,
                  add_public: dict[str, str] | None = None, drop_public: tuple[str, ...] = (),
                  dirty: bool | None = None, name: str | None = None, backend: dict | None = None) -> Path:
    """Copy ``variant_dir`` to ``build_dir/<name or the same name>`` as ``version`` with ops
    namespace and module id ``_flash_attn_<uid>``; ``add_public`` maps new public names to the
    source defining them; ``drop_public`` names leave ``__all__``; ``backend`` replaces
    metadata's. Returns the new variant folder."""
    from ..publish import public_names

    variant_dir = Path(variant_dir)
    target = Path(build_dir) / (name or variant_dir.name)
    shutil.copytree(variant_dir, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    metadata = json.loads((target / "metadata.json").read_text())
    old_id, new_id = metadata["id"], f"_flash_attn_{uid}"
    for path in target.rglob("*.py"):
        path.write_text(path.read_text().replace(old_id, new_id))
    init = target / "__init__.py"
    source = init.read_text()
    names = set(public_names(source) or ())
    extra = "".join(f"\n\n{line}\n" for line in (add_public or {}).values())
    names = (names | set(add_public or {})) - set(drop_public)
    init.write_text(source + extra + f"\n__all__ = {sorted(names)!r}\n")
    metadata["id"] = new_id
    metadata["version"] = version
    if backend is not None:
        metadata["backend"] = backend
    if dirty is not None:
        metadata.setdefault("provenance", {"kernel-builder": {"version": "0"}})
        metadata["provenance"]["kernel"] = {"commit": "0" * 40, "dirty": dirty}
    (target / "metadata.json").write_text(json.dumps(metadata, indent=2))
    write_digest(target)
    return target


_DUMMY_INIT = '''"""A minimal variant for Hub tests (no attention)."""
from ._ops import add_op_namespace_prefix, ops

__all__ = ["version"]


def version():
    return {version}
'''

_DUMMY_OPS = '''import torch

ops = torch.ops.{namespace}


def add_op_namespace_prefix(name):
    return f"{namespace}::{{name}}"
'''


def dummy_variant(build_dir: Path, *, version: int, uid: str, variant: str = "torch-cpu",
                  dirty: bool = False) -> Path:
    """``build_dir/<variant>/`` with ``__init__.py`` (``version()``), ``_ops.py`` and metadata."""
    target = Path(build_dir) / variant
    target.mkdir(parents=True)
    namespace = f"_flash_attn_{uid}"
    (target / "__init__.py").write_text(_DUMMY_INIT.format(version=version))
    (target / "_ops.py").write_text(_DUMMY_OPS.format(namespace=namespace))
    is_cuda = variant == "torch-cuda" or "-cu1" in variant
    backend = {"type": "cuda", "archs": ["9.0a"]} if is_cuda else {"type": "cpu"}
    metadata = {"name": "flash-attn", "id": namespace, "version": version, "license": "BSD-3-Clause",
                "python-depends": [], "backend": backend,
                "provenance": {"kernel-builder": {"version": "0"}, "kernel": {"commit": "0" * 40, "dirty": dirty}}}
    (target / "metadata.json").write_text(json.dumps(metadata, indent=2))
    write_digest(target)
    return target


VERSION_FUNCTION = "def published_version():\n    return {version}"
CUDA_ONLY = {"type": "cuda", "archs": ["9.0a"]}


def publish_versions(variant_dir: Path, workdir: Path, *, endpoint: str, token: str, repo_id: str,
                     uid_prefix: str) -> dict:
    """Publish crafted copies of ``variant_dir`` as v1, v2 and v3 of ``repo_id``; returns
    {version: PublishResult, "dirs": {version: build folder}}. v1 is the build as is; v2 adds the public function
    ``published_version()``; v3 keeps it and also carries a CUDA-only ``torch-cuda``
    variant that a CPU machine rejects. ``uid_prefix`` keeps module ids and op namespaces
    unique within one process."""
    from ..publish import publish

    results: dict = {"dirs": {}}
    for version in (1, 2, 3):
        build = Path(workdir) / f"v{version}"
        extra = {} if version == 1 else {"published_version": VERSION_FUNCTION.format(version=version)}
        craft_variant(variant_dir, build, version=version, uid=f"{uid_prefix}v{version}", add_public=extra)
        if version == 3:
            craft_variant(variant_dir, build, version=3, uid=f"{uid_prefix}v3cuda", add_public=extra,
                          name="torch-cuda", backend=CUDA_ONLY)
        results["dirs"][version] = build
        results[version] = publish(build, endpoint=endpoint, token=token, repo_id=repo_id, allow_dirty=True,
                                   card=None, benchmarks_dir=None, log=lambda _: None)
    return results
