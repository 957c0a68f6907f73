"""The machine and software a run measured on, copied into every record.

``git_sha`` says which source tree produced the numbers. A GPU machine often receives a
copy of the tree without ``.git``, so the commit is taken, in order, from:

1. the environment variable ``FLASH_ATTN_HUB_GIT_SHA`` (set by whoever copies the tree),
2. the file ``.git_sha`` at the repository root (one line, written beside the copy),
3. ``git rev-parse`` in the repository (``-dirty`` appended when tracked files changed),
4. otherwise ``"unknown"``, with a warning: never an empty field.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import warnings
from importlib import metadata

import torch

from .. import REPO_ROOT

GIT_SHA_ENV = "FLASH_ATTN_HUB_GIT_SHA"
GIT_SHA_FILE = ".git_sha"
UNKNOWN = "unknown"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()


def git_sha() -> tuple[str, str]:
    """``(sha, where it came from)``; ``("unknown", reason)`` with a warning when no source
    names the commit."""
    value = os.environ.get(GIT_SHA_ENV, "").strip()
    if value:
        return value, f"${GIT_SHA_ENV}"
    path = REPO_ROOT / GIT_SHA_FILE
    if path.is_file():
        value = path.read_text().strip()
        if value:
            return value.splitlines()[0].strip(), str(path)
    try:
        sha = _git("rev-parse", "--short=12", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        return sha + ("-dirty" if dirty else ""), "git"
    except (OSError, subprocess.SubprocessError):
        pass
    reason = (f"no ${GIT_SHA_ENV}, no {GIT_SHA_FILE} and no git repository at {REPO_ROOT}: results record "
              f"git_sha={UNKNOWN!r}; set {GIT_SHA_ENV}=<commit> when the tree is a copy without .git")
    warnings.warn(reason, stacklevel=2)
    return UNKNOWN, reason


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def cudnn_version(number: int | None) -> str | None:
    """``91900`` -> ``"9.19.0"`` (cuDNN >= 9 encodes major*10000 + minor*100 + patch,
    cuDNN 8 major*1000 + minor*100 + patch)."""
    if not number:
        return None
    major_unit = 10000 if number >= 90000 else 1000
    return f"{number // major_unit}.{number % major_unit // 100}.{number % 100}"


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except Exception:  # not installed, or broken: the field says so by being empty
        return None


def distribution_version(name: str) -> str | None:
    """The installed version of the distribution ``name`` (e.g. ``flash-attn-4``), else None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, ours_module=None, sha: str | None = None) -> dict:
    """Machine and versions of this process, with the commit (``sha``, else :func:`git_sha`)."""
    cuda = device.type == "cuda"
    sha = sha or git_sha()[0]
    cpu = platform.processor() or platform.machine()
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else f"none (CPU: {cpu})",
        "driver": _driver() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn_version(torch.backends.cudnn.version()) if cuda else None,
        "triton": _version("triton"),
        "kernels": _version("kernels"),
        "fa4": distribution_version("flash-attn-4"),
        "flashinfer": distribution_version("flashinfer-python"),
        "kernel_build": getattr(ours_module, "__name__", None),
        "git_sha": sha,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# Fields that must agree for two runs' numbers to share one table (see ``report.combine``).
SAME_MACHINE = ("gpu", "driver", "torch", "cuda", "cudnn", "triton", "fa4", "flashinfer")
