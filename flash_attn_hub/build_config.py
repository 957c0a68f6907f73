"""``build.toml`` (kernel-builder edition 5): parse, validate, and expose what the build needs.

The schema below is the edition-5 one kernel-builder enforces: every table rejects keys it
does not know, ``[general]`` requires ``name``/``version``/``edition = 5``/``license``/
``backends``, exactly one framework section (``[torch]``, ``[torch-noarch]`` or ``[tvm-ffi]``)
is present, and each ``[kernel.<name>]`` is tagged by ``backend`` with that backend's own
keys. Validation collects every problem and raises one :class:`BuildConfigError` that lists
them, each naming the offending key (``general.license``, ``kernel.flash_attn_cuda.srcs``).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

EDITION = 5
BACKENDS = ("cann", "cpu", "cuda", "metal", "neuron", "rocm", "tpu", "xpu")
FRAMEWORKS = ("torch", "torch-noarch", "tvm-ffi")
# Dependency names kernel-builder knows (kernels-data `Dependency`).
DEPENDENCIES = ("cutlass_2_10", "cutlass_3_5", "cutlass_3_6", "cutlass_3_8", "cutlass_3_9",
                "cutlass_4_0", "cutlass_4_4", "cutlass_4_5", "sycl_tla", "metal-cpp", "torch")
_NAME_RE = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")
_VERSION_RE = re.compile(r"^\d+(\.\d+)*$")
_CUDA_CAP_RE = re.compile(r"^\d+\.\d+[af]?(\+PTX)?$")

# Type tags of the schema: a Python type, or a (list, item type) pair.
STR, INT, STRS, TABLE = str, int, (list, str), dict
VERSION = "version"  # a dotted numeric version written as a string ("2.11")

_DEPENDS = ("kernel-depends", (list, dict)), ("python-depends", STRS)
_GENERAL = {
    "name": STR, "version": INT, "edition": INT, "license": STR, "upstream": STR, "source": STR,
    "backends": STRS, "cuda": TABLE, "hub": TABLE, "kernel-depends": (list, dict),
    "python-depends": STRS, "neuron": TABLE, "tpu": TABLE, "xpu": TABLE,
}
_GENERAL_REQUIRED = ("name", "version", "edition", "license", "backends")
_GENERAL_SUB = {
    "cuda": {"minver": VERSION, "maxver": VERSION, **dict(_DEPENDS)},
    "hub": {"repo-id": STR, "branch": STR},
    "neuron": dict(_DEPENDS),
    "tpu": {"python-depends": STRS},
    "xpu": dict(_DEPENDS),
}
_FRAMEWORK = {
    "torch": {"include": STRS, "minver": VERSION, "maxver": VERSION, "pyext": STRS, "src": STRS,
              "stable-abi": None, "cxx-flags": STRS},
    "torch-noarch": {"pyext": STRS, "cuda_capabilities": STRS, "rocm_archs": STRS},
    "tvm-ffi": {"include": STRS, "pyext": STRS, "src": STRS, "cxx-flags": STRS},
}
_FRAMEWORK_REQUIRED = {"torch": (), "torch-noarch": (), "tvm-ffi": ("src",)}
_KERNEL_COMMON = {"backend": STR, "cxx-flags": STRS, "depends": STRS, "include": STRS, "src": STRS}
_KERNEL = {
    "cpu": {},
    "cuda": {"cuda-capabilities": STRS, "cuda-flags": STRS, "cuda-minver": VERSION},
    "metal": {},
    "rocm": {"rocm-archs": STRS, "hip-flags": STRS},
    "xpu": {"sycl-flags": STRS},
}


class BuildConfigError(ValueError):
    """``build.toml`` breaks the edition-5 schema; ``problems`` lists each broken rule."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.path = Path(path)
        self.problems = problems
        super().__init__(f"{path}: invalid build.toml (edition {EDITION}):\n  "
                         + "\n  ".join(problems))


@dataclasses.dataclass(frozen=True)
class KernelSection:
    """One ``[kernel.<name>]`` table."""

    name: str
    backend: str
    depends: tuple[str, ...]
    src: tuple[str, ...]
    include: tuple[str, ...]
    cxx_flags: tuple[str, ...]
    cuda_flags: tuple[str, ...]
    cuda_capabilities: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """The validated contents of ``build.toml`` the build tooling uses."""

    path: Path
    name: str
    version: int
    license: str
    backends: tuple[str, ...]
    repo_id: str | None
    upstream: str | None
    source: str | None
    python_depends: tuple[str, ...]
    framework: str
    torch_src: tuple[str, ...]
    torch_include: tuple[str, ...]
    torch_cxx_flags: tuple[str, ...]
    pyext: tuple[str, ...]
    stable_abi: dict[str, str]
    kernels: tuple[KernelSection, ...]
    raw: dict[str, Any] = dataclasses.field(repr=False, compare=False)

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    def kernels_for(self, backend: str) -> tuple[KernelSection, ...]:
        return tuple(k for k in self.kernels if k.backend == backend)

    def source_files(self) -> list[str]:
        """Every file the config names (framework and kernel ``src``), in order, once."""
        seen: dict[str, None] = {}
        for rel in (*self.torch_src, *(s for k in self.kernels for s in k.src)):
            seen.setdefault(rel, None)
        return list(seen)


def _type_name(kind: Any) -> str:
    if kind is VERSION:
        return "a version string like \"2.11\""
    if isinstance(kind, tuple):
        return f"a list of {kind[1].__name__}"
    return {str: "a string", int: "an integer", dict: "a table"}.get(kind, str(kind))


def _check_type(value: Any, kind: Any) -> bool:
    if kind is None:
        return True
    if kind is VERSION:
        return isinstance(value, str) and bool(_VERSION_RE.fullmatch(value))
    if isinstance(kind, tuple):
        return isinstance(value, list) and all(isinstance(v, kind[1]) for v in value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_table(table: Any, schema: dict[str, Any], where: str, problems: list[str],
                 required: tuple[str, ...] = ()) -> None:
    if not isinstance(table, dict):
        problems.append(f"{where}: must be a table")
        return
    for key, value in table.items():
        if key not in schema:
            problems.append(f"{where}.{key}: unknown key (known: {', '.join(sorted(schema))})")
        elif not _check_type(value, schema[key]):
            problems.append(f"{where}.{key}: must be {_type_name(schema[key])}, got {value!r}")
    for key in required:
        if key not in table:
            problems.append(f"{where}.{key}: required key is missing")


def _validate(data: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    known_top = {"general", "kernel", *FRAMEWORKS}
    for key in data:
        if key not in known_top:
            problems.append(f"{key}: unknown top-level section (known: {', '.join(sorted(known_top))})")

    general = data.get("general")
    if general is None:
        problems.append("general: required section is missing")
    else:
        _check_table(general, _GENERAL, "general", problems, _GENERAL_REQUIRED)
        if isinstance(general, dict):
            for sub, schema in _GENERAL_SUB.items():
                if isinstance(general.get(sub), dict):
                    _check_table(general[sub], schema, f"general.{sub}", problems)
            if "edition" in general and general["edition"] != EDITION:
                problems.append(f"general.edition: must be {EDITION}, got {general['edition']!r}")
            name = general.get("name")
            if isinstance(name, str) and not _NAME_RE.fullmatch(name):
                problems.append(f"general.name: {name!r} must match {_NAME_RE.pattern}")
            if isinstance(general.get("license"), str) and not general["license"].strip():
                problems.append("general.license: must not be empty")
            for backend in general.get("backends") or ():
                if backend not in BACKENDS:
                    problems.append(f"general.backends: unknown backend {backend!r} "
                                    f"(known: {', '.join(BACKENDS)})")

    frameworks = [f for f in FRAMEWORKS if f in data]
    if len(frameworks) != 1:
        problems.append(f"framework: exactly one of [{'], ['.join(FRAMEWORKS)}] is required, "
                        f"found {len(frameworks)}" + (f" ({', '.join(frameworks)})" if frameworks else ""))
    for framework in frameworks:
        table = data[framework]
        _check_table(table, _FRAMEWORK[framework], framework, problems, _FRAMEWORK_REQUIRED[framework])
        if framework == "torch" and isinstance(table, dict) and "stable-abi" in table:
            _check_stable_abi(table["stable-abi"], problems)

    kernels = data.get("kernel", {})
    if not isinstance(kernels, dict):
        problems.append("kernel: must be a table of [kernel.<name>] tables")
        kernels = {}
    declared = set(general.get("backends") or ()) if isinstance(general, dict) else set()
    for name, kernel in kernels.items():
        where = f"kernel.{name}"
        if not isinstance(kernel, dict):
            problems.append(f"{where}: must be a table")
            continue
        backend = kernel.get("backend")
        if backend not in _KERNEL:
            problems.append(f"{where}.backend: must be one of {', '.join(_KERNEL)}, got {backend!r}")
            continue
        _check_table(kernel, {**_KERNEL_COMMON, **_KERNEL[backend]}, where, problems,
                     ("backend", "depends", "src"))
        for dep in kernel.get("depends") or ():
            if dep not in DEPENDENCIES:
                problems.append(f"{where}.depends: unknown dependency {dep!r} "
                                f"(known: {', '.join(DEPENDENCIES)})")
        for cap in kernel.get("cuda-capabilities") or ():
            if isinstance(cap, str) and not _CUDA_CAP_RE.fullmatch(cap):
                problems.append(f"{where}.cuda-capabilities: {cap!r} is not a capability like \"9.0a\"")
        if declared and backend not in declared:
            problems.append(f"{where}.backend: {backend!r} is not listed in general.backends")
    return problems


def _check_stable_abi(value: Any, problems: list[str]) -> None:
    if isinstance(value, str):
        if not _VERSION_RE.fullmatch(value):
            problems.append(f"torch.stable-abi: must be a version string like \"2.11\", got {value!r}")
        return
    if not isinstance(value, dict):
        problems.append(f"torch.stable-abi: must be a version string or a table per backend, got {value!r}")
        return
    _check_table(value, dict.fromkeys(BACKENDS, VERSION), "torch.stable-abi", problems)


def parse(text: str, path: Path | str = "build.toml") -> BuildConfig:
    """Validate ``text`` (the contents of ``build.toml`` at ``path``) and return the config."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise BuildConfigError(path, [f"TOML syntax: {err}"]) from None
    problems = _validate(data)
    if problems:
        raise BuildConfigError(path, problems)

    general = data["general"]
    framework = next(f for f in FRAMEWORKS if f in data)
    fw = data[framework]
    stable = fw.get("stable-abi")
    if isinstance(stable, str):
        stable_abi = dict.fromkeys(general["backends"], stable)
    else:
        stable_abi = dict(stable or {})
    kernels = tuple(
        KernelSection(
            name=name, backend=k["backend"], depends=tuple(k["depends"]), src=tuple(k["src"]),
            include=tuple(k.get("include", ())), cxx_flags=tuple(k.get("cxx-flags", ())),
            cuda_flags=tuple(k.get("cuda-flags", ())),
            cuda_capabilities=tuple(k.get("cuda-capabilities", ())),
        )
        for name, k in data.get("kernel", {}).items()
    )
    return BuildConfig(
        path=Path(path), name=general["name"], version=general["version"],
        license=general["license"], backends=tuple(general["backends"]),
        repo_id=general.get("hub", {}).get("repo-id"), upstream=general.get("upstream"),
        source=general.get("source"), python_depends=tuple(general.get("python-depends", ())),
        framework=framework, torch_src=tuple(fw.get("src", ())),
        torch_include=tuple(fw.get("include", ())), torch_cxx_flags=tuple(fw.get("cxx-flags", ())),
        pyext=tuple(fw.get("pyext", ("py", "json"))), stable_abi=stable_abi, kernels=kernels,
        raw=data,
    )


def load(path: Path | str | None = None) -> BuildConfig:
    """Read and validate ``build.toml`` (default: the repository's)."""
    if path is None:
        from . import REPO_ROOT

        path = REPO_ROOT / "build.toml"
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BuildConfigError(path, ["file not found"]) from None
    return parse(text, path)


def missing_sources(config: BuildConfig) -> list[str]:
    """The ``src`` entries (relative to the config's directory) that do not exist."""
    return [rel for rel in config.source_files() if not (config.root / rel).is_file()]
