"""``python -m flash_attn_hub check build/<variant>``: the checks a kernel-builder build runs.

Rules (each failure names the file and the rule; the exit code is 1 when any fails):

* ``variant-name``: the directory name is a variant kernels parses, matching the backend.
* ``metadata``: ``metadata.json`` has the required keys and kernels' ``Metadata`` reads it;
  ``id`` is the ops namespace ``_ops.py`` uses; a CUDA build declares its ``archs``.
* ``digest``: the recorded digest validates against kernels' ``Digest.hash_variant`` of the
  directory (a changed, missing or extra file fails).
* ``ops-module``: ``_ops.py`` exists, and imports the compiled extension exactly when one is
  shipped (``<id>.abi3.so``; no other ``.so``).
* ``op-name``, ``relative-imports``: see ``check_source``.
* ``abi-symbol-version``, ``abi-python``: see ``check_abi`` (each ``.so``).
* ``import-on-cpu``: the variant imports through ``kernels.get_local_kernel`` in a fresh
  interpreter with ``CUDA_VISIBLE_DEVICES=""``, without initialising CUDA, and every op
  the package defines is registered under the build's namespace.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from . import check_abi, check_source

REQUIRED_KEYS = ("name", "id", "version", "license", "python-depends", "backend")


@dataclasses.dataclass(frozen=True)
class Failure:
    file: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: [{self.rule}] {self.message}"


def _ops_namespace(variant_dir: Path) -> tuple[str | None, list[str]]:
    """(namespace, modules imported with ``from . import X``) read from ``_ops.py``."""
    tree = ast.parse((variant_dir / "_ops.py").read_text())
    namespace = None
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
            imports += [a.name for a in node.names]
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ops"
                                                for t in node.targets):
            value = node.value
            if isinstance(value, ast.Attribute):
                namespace = value.attr
    return namespace, imports


def check_metadata(variant_dir: Path) -> list[Failure]:
    from kernels._rust import Digest, DigestValidationError, Metadata
    from kernels.variants import NoarchVariant, parse_variant

    failures = []
    meta_path = variant_dir / "metadata.json"
    name = variant_dir.name
    try:
        parsed = parse_variant(name)
        if parsed.variant_str != name:
            raise ValueError(f"parses as {parsed.variant_str!r}")
    except ValueError as err:
        failures.append(Failure(name, "variant-name", f"not a variant name kernels accepts: {err}"))
        parsed = None
    if not meta_path.is_file():
        return failures + [Failure("metadata.json", "metadata", "missing")]
    try:
        raw = json.loads(meta_path.read_text())
    except ValueError as err:
        return failures + [Failure("metadata.json", "metadata", f"not JSON: {err}")]
    missing = [k for k in REQUIRED_KEYS if k not in raw]
    if missing:
        failures.append(Failure("metadata.json", "metadata", f"missing keys: {', '.join(missing)}"))
    try:
        meta = Metadata.read_from_file(meta_path)
    except ValueError as err:
        return failures + [Failure("metadata.json", "metadata", f"kernels cannot read it: {err}")]

    backend = str(meta.backend.backend_type).lower()
    if parsed is not None:
        expected = parsed.arch.backend_name if isinstance(parsed, NoarchVariant) \
            else parsed.arch.backend.name
        if expected != backend:
            failures.append(Failure("metadata.json", "metadata",
                                    f"backend.type {backend!r} does not match variant {name!r}"))
        if not isinstance(parsed, NoarchVariant) and backend == "cuda" and not meta.backend.archs:
            failures.append(Failure("metadata.json", "metadata",
                                    "a compiled CUDA build must list backend.archs"))
    if (variant_dir / "_ops.py").is_file():
        namespace, _ = _ops_namespace(variant_dir)
        if namespace != meta.id:
            failures.append(Failure("metadata.json", "metadata",
                                    f"id {meta.id!r} is not the ops namespace of _ops.py ({namespace!r})"))

    if meta.digest is None:
        failures.append(Failure("metadata.json", "digest", "no digest recorded"))
    else:
        actual = Digest.hash_variant(meta.digest.algorithm, variant_dir)
        try:
            meta.digest.validate(actual)
        except DigestValidationError as err:
            for violation in err.violations:
                path = getattr(violation, "path", "metadata.json")
                failures.append(Failure(path, "digest", str(violation)))
    return failures


def check_ops_module(variant_dir: Path) -> list[Failure]:
    if not (variant_dir / "_ops.py").is_file():
        return [Failure("_ops.py", "ops-module", "missing (the build generates it)")]
    namespace, imports = _ops_namespace(variant_dir)
    failures = []
    if namespace is None:
        failures.append(Failure("_ops.py", "ops-module", "does not assign `ops = torch.ops.<namespace>`"))
    libraries = sorted(p.name for p in variant_dir.rglob("*.so"))
    expected = [f"{namespace}.abi3.so"] if libraries else []
    if libraries != expected:
        failures.append(Failure(", ".join(libraries), "ops-module",
                                f"the only shared library must be {namespace}.abi3.so"))
    if libraries and imports != [namespace]:
        failures.append(Failure("_ops.py", "ops-module",
                                f"must import the extension (`from . import {namespace}`), imports {imports}"))
    if not libraries and imports:
        failures.append(Failure("_ops.py", "ops-module",
                                f"imports {imports} but the variant ships no extension"))
    return failures


_IMPORT_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
import kernels
variant = Path(sys.argv[1])
module = kernels.get_local_kernel(variant)
ns = json.loads(sys.argv[2])
missing = [op for op in ns["ops"] if not hasattr(getattr(torch.ops, ns["namespace"]), op)]
print("\n" + json.dumps({"module": module.__name__, "all": list(getattr(module, "__all__", [])),
                  "cuda_initialized": torch.cuda.is_initialized(), "missing_ops": missing}))
"""


def _import_env(variant_dir: Path) -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    if any(variant_dir.glob("*.so")):
        # A CUDA variant checked under a CPU build of torch needs the toolkit's runtime library,
        # which a CUDA build of torch would already have loaded.
        from .build_cuda import find_nvcc

        nvcc = find_nvcc()
        if nvcc is not None:
            for lib in (nvcc.parent.parent / "lib64", nvcc.parent.parent / "lib"):
                if lib.is_dir():
                    env["LD_LIBRARY_PATH"] = os.pathsep.join(
                        p for p in (env.get("LD_LIBRARY_PATH", ""), str(lib)) if p)
    return env


def check_import(variant_dir: Path, op_names: list[str], namespace: str | None,
                 timeout: float = 300) -> list[Failure]:
    payload = json.dumps({"ops": sorted(set(op_names)), "namespace": namespace or ""})
    try:
        result = subprocess.run([sys.executable, "-c", _IMPORT_SCRIPT, str(variant_dir), payload],
                                capture_output=True, text=True, env=_import_env(variant_dir),
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        return [Failure("__init__.py", "import-on-cpu", f"import did not finish in {timeout:.0f} s")]
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        return [Failure("__init__.py", "import-on-cpu",
                        f"kernels.get_local_kernel failed with CUDA_VISIBLE_DEVICES=\"\":\n{tail}")]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    failures = []
    if report["cuda_initialized"]:
        failures.append(Failure("__init__.py", "import-on-cpu", "importing the package initialised CUDA"))
    if report["missing_ops"]:
        failures.append(Failure("_ops.py", "import-on-cpu",
                                f"ops not registered under {namespace} after import: "
                                f"{', '.join(report['missing_ops'])}"))
    return failures


def check_variant(variant_dir: Path, *, run_import: bool = True) -> list[Failure]:
    """Every rule on ``variant_dir``; an empty list means the variant passes."""
    variant_dir = Path(variant_dir).resolve()
    if not variant_dir.is_dir():
        return [Failure(str(variant_dir), "variant-name", "not a directory")]
    failures = check_metadata(variant_dir)
    failures += check_ops_module(variant_dir)
    source = check_source.check_package(variant_dir)
    failures += [Failure(f"{p.file}:{p.line}", p.rule, p.message) for p in source.problems]
    for library in sorted(variant_dir.rglob("*.so")):
        rel = library.relative_to(variant_dir).as_posix()
        try:
            failures += [Failure(rel, p.rule, p.message) for p in check_abi.check_library(library)]
        except Exception as err:  # pyelftools raises ELFError and struct errors on bad files
            failures.append(Failure(rel, "abi-elf", f"not a readable ELF shared library: {err}"))
    if run_import and not any(f.rule in ("syntax", "ops-module") for f in failures):
        namespace = _ops_namespace(variant_dir)[0]
        failures += check_import(variant_dir, source.op_names, namespace)
    return failures


def register(subparsers) -> None:
    parser = subparsers.add_parser("check", help="check a built variant as a kernel-builder build does",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("variant", type=Path, help="a build variant directory (build/<variant>)")
    parser.add_argument("--no-import", action="store_true",
                        help="skip importing the variant in a fresh interpreter")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    failures = check_variant(args.variant, run_import=not args.no_import)
    for failure in failures:
        print(f"FAIL {failure}")
    if failures:
        print(f"check {args.variant}: {len(failures)} failure(s)")
        return 1
    print(f"check {args.variant}: ok")
    return 0
