"""``python -m flash_attn_hub build``: build one kernel variant into ``build/<variant>/``.

What gets built (``build_variant``):

* a **compiled CUDA variant** (``torch-stable-abi211-cu130-x86_64-linux``) when the CUDA backend is
  chosen (``--backend cuda``, or automatically when torch is a CUDA build) and a CUDA toolkit is
  present: every ``.cu``/``.cpp`` named in ``build.toml`` (``[torch].src`` and
  ``[kernel.flash_attn_cuda].src``) is compiled against the torch stable ABI and linked into
  ``_flash_attn_cuda_<uid>.abi3.so`` (see ``build_cuda``); ``--backend cuda`` without a
  toolkit, CUTLASS headers or torch stable-ABI headers is an error naming what is missing;
* otherwise the **noarch variant** of torch's backend (``torch-cpu``, ``torch-cuda``): the
  package's Python and JSON files only.

Either way the variant holds the package files of ``torch-ext/flash_attn/`` (those whose
extension ``[torch].pyext`` lists), a generated ``_ops.py`` naming this build's ops namespace, and
``metadata.json`` with kernels' digest of every other file. The variant is assembled in a
staging directory and swapped in only when its contents changed, so a rebuild of unchanged
sources touches nothing.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from . import REPO_ROOT
from . import build_config, variant

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """The build cannot proceed; the message says what is missing or wrong."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_out_dir() -> Path:
    return REPO_ROOT / "build"


def torch_backend() -> str:
    """``cuda`` for a CUDA build of torch, else ``cpu``."""
    import torch

    return "cuda" if torch.version.cuda is not None else "cpu"


def _copy_package(config: build_config.BuildConfig, staging: Path) -> list[str]:
    package = config.root / "torch-ext" / config.python_name
    if not (package / "__init__.py").is_file():
        raise BuildError(f"package: {package}/__init__.py does not exist")
    if (package / "_ops.py").exists():
        raise BuildError(f"package: {package}/_ops.py must not exist in the source tree "
                         "(the build generates it)")
    suffixes = {f".{ext}" for ext in config.pyext}
    copied = []
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package)
        if not path.is_file() or path.suffix not in suffixes or "__pycache__" in rel.parts:
            continue
        dest = staging / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        copied.append(rel.as_posix())
    return copied


def _same_tree(a: Path, b: Path) -> bool:
    """True when directories ``a`` and ``b`` hold the same files with the same bytes."""
    def files(root: Path) -> set[str]:
        return {p.relative_to(root).as_posix() for p in root.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}

    if not b.is_dir():
        return False
    names = files(a)
    if names != files(b):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def _install(staging: Path, dest: Path, log: Log) -> None:
    if _same_tree(staging, dest):
        shutil.rmtree(staging)
        log(f"[build] {dest.name}: up to date")
        return
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        dest.rename(old)
        staging.rename(dest)
        shutil.rmtree(old)
    else:
        staging.rename(dest)
    log(f"[build] {dest.name}: written to {dest}")


def _resolve_backend(backend: str | None, config: build_config.BuildConfig, log: Log) -> tuple[str, bool]:
    """(backend, compile?) for the requested backend; errors name what a forced CUDA build lacks."""
    from . import build_cuda

    if backend not in (None, "cpu", "cuda"):
        raise BuildError(f"backend: must be 'cpu' or 'cuda', got {backend!r}")
    if backend == "cpu":
        return "cpu", False
    chosen = backend or torch_backend()
    if chosen == "cpu":
        return "cpu", False
    if not config.kernels_for("cuda"):
        return "cuda", False
    missing = build_cuda.missing_requirements(config)
    if not missing:
        return "cuda", True
    if backend == "cuda":
        raise BuildError("backend cuda: cannot compile the CUDA extension: " + "; ".join(missing))
    log("[build] CUDA extension not compiled (" + "; ".join(missing) + "): building the noarch "
        "torch-cuda variant")
    return "cuda", False


def build_variant(out_dir: Path | None = None, *, backend: str | None = None,
                  jobs: int | None = None, unique_id: str | None = None,
                  config_path: Path | None = None, log: Log | None = None) -> Path:
    """Build the variant for this machine into ``<out_dir or REPO_ROOT/build>/<variant>/``.

    ``backend``: ``None`` (torch's backend; the CUDA extension is compiled when a toolkit is
    present), ``"cpu"`` (noarch ``torch-cpu``) or ``"cuda"`` (compiled CUDA variant; an error
    if the toolkit, CUTLASS or the stable-ABI headers are missing). ``jobs``: parallel
    compile jobs (default: CPU count). ``unique_id`` overrides the git-derived build id (the
    ops namespace suffix). Returns the variant directory.
    """
    from . import build_cuda

    log = log or _stderr
    config = build_config.load(config_path)
    backend, compiled = _resolve_backend(backend, config, log)
    git = variant.git_state(config.root)
    uid = unique_id or git.uid
    namespace = variant.ops_namespace(config, backend, uid)
    if compiled:
        toolkit = build_cuda.Toolkit.find(config)
        abi = config.stable_abi.get("cuda")
        if abi is None:
            raise BuildError("build.toml: [torch.stable-abi] cuda is required for a compiled build")
        name = variant.stable_abi_name(abi, toolkit.cuda_version)
    else:
        name = variant.noarch_name(backend)

    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.staging-", dir=out))
    try:
        _copy_package(config, staging)
        archs = None
        extension = None
        if compiled:
            kernel = config.kernels_for("cuda")
            archs = sorted({cap for k in kernel for cap in k.cuda_capabilities})
            so = build_cuda.build_extension(config, toolkit, namespace=namespace, abi=abi,
                                            jobs=jobs, log=log)
            extension = namespace
            shutil.copyfile(so, staging / f"{namespace}.abi3.so")
        (staging / "_ops.py").write_text(variant.ops_py(namespace, extension))
        meta = variant.metadata(config, namespace=namespace, backend=backend, archs=archs, git=git)
        variant.write_metadata(staging, meta)
        dest = out / name
        _install(staging, dest, log)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def register(subparsers) -> None:
    parser = subparsers.add_parser("build", help="build the kernel variant for this machine",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="directory that receives <variant>/ (default: build/)")
    parser.add_argument("--backend", choices=("cpu", "cuda"), default=None,
                        help="cpu: noarch torch-cpu; cuda: compile the CUDA extension "
                             "(default: torch's backend, compiled when nvcc is present)")
    parser.add_argument("-j", "--jobs", type=int, default=None,
                        help="parallel compile jobs (default: number of CPUs)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        path = build_variant(args.out, backend=args.backend, jobs=args.jobs)
    except (BuildError, build_config.BuildConfigError) as err:
        _stderr(f"build failed: {err}")
        return 1
    print(path)
    return 0
