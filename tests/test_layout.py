"""The package's layers point one way: the backends (``_cpu``, ``_cuda`` and the ``_triton``
modules) never import one another (a ``_triton`` module may import ``_triton.common``,
``_triton.tuning`` and ``_triton.launch``), no other module but ``_dispatch`` (the one dispatch point) imports a
backend, and there is no import cycle.

The imports are read with ``ast`` (at module level and inside functions alike), so nothing is
imported; the rules are checked on the shipped package and, to show that they can fail, on
small trees with one bad import planted and on a copy of the package with one added."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from helpers import SOURCE_PACKAGE

BACKENDS = ("_cpu", "_cuda", "_triton")  # top-level names; every _triton module is a backend
# what a _triton module may import: shared helpers and the launcher, not another kernel module
TRITON_SHARED = ("_triton.common", "_triton.tuning", "_triton.launch")
DISPATCH = "_dispatch"


def module_names(root: Path) -> dict[str, Path]:
    """``{dotted name inside the package: file}``; a package's ``__init__`` is the package."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:  # the package's own __init__ imports the interface only
            names[".".join(parts)] = path
    return names


def _package_of(name: str, path: Path) -> list[str]:
    parts = name.split(".")
    return parts if path.name == "__init__.py" else parts[:-1]


def imports_of(root: Path) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``, from every relative import statement
    (absolute imports cannot reach the package: the source rules forbid them)."""
    names = module_names(root)
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = _package_of(name, path)
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            target = base + (node.module.split(".") if node.module else [])
            for alias in node.names:
                sub = ".".join(target + [alias.name])
                dep = sub if sub in names else ".".join(target)
                if dep and dep != name:
                    deps.add(dep)
        graph[name] = deps
    return graph


def _is_backend(name: str) -> bool:
    return name.split(".")[0] in BACKENDS


def layer_problems(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if _is_backend(module) and _is_backend(dep):
                if module.startswith("_triton") and dep in TRITON_SHARED:
                    continue
                problems.append(f"{module} imports {dep}: backends never import one another "
                                f"(the dispatcher chooses between them)")
            elif _is_backend(dep) and not _is_backend(module) and module != DISPATCH:
                problems.append(f"{module} imports {dep}: only {DISPATCH} chooses a backend")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle once, as the path that closes it."""
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def problems_of(root: Path) -> list[str]:
    graph = imports_of(root)
    return layer_problems(graph) + [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]


def test_shipped_package_layers():
    graph = imports_of(SOURCE_PACKAGE)
    # the rules see the modules they are about
    assert {"_cpu", "_cuda", "_triton.fwd", "_triton.decode", "_triton.bwd", "_dispatch",
            "_heuristics"} <= set(graph), sorted(graph)
    assert "_triton.common" in graph["_triton.fwd"] and "_heuristics" in graph["_cuda"]
    assert problems_of(SOURCE_PACKAGE) == []


GOOD_TREE = {
    "__init__.py": "from .interface import f\n",
    "interface.py": "from . import _dispatch\n",
    "_dispatch.py": "from . import _heuristics\nfrom ._params import P\n",
    "_params.py": "",
    "_heuristics.py": "from ._params import P\n",
    "_math.py": "",
    "_cpu.py": "from ._params import P\n",
    "_cuda.py": "from ._heuristics import h\nfrom ._math import m\n",
    "_triton/__init__.py": "",
    "_triton/tuning.py": "from .._heuristics import h\n",
    "_triton/common.py": "from .tuning import t\n",
    "_triton/fwd.py": "from .. import _params\nfrom . import common\nfrom .tuning import t\n",
    "_triton/decode.py": "from .common import inner_loop\n",
}
PLANTED = {  # name -> (file, bad line, what the report names)
    "cuda_calls_triton": ("_cuda.py", "def f():\n    from ._triton import fwd\n",
                          "_cuda imports _triton.fwd"),
    "cuda_imports_triton_package": ("_cuda.py", "from ._triton.bwd import sink\n",
                                    "_cuda imports _triton.bwd"),
    "decode_imports_fwd": ("_triton/decode.py", "from .fwd import inner_loop\n",
                           "_triton.decode imports _triton.fwd"),
    "triton_imports_cpu": ("_triton/bwd.py", "from .._cpu import x\n",
                           "_triton.bwd imports _cpu"),
    "triton_init_imports_leaf": ("_triton/__init__.py", "from . import fwd\n",
                                 "_triton imports _triton.fwd"),
    "heuristics_imports_backend": ("_heuristics.py", "from ._triton.decode import x\n",
                                   "_heuristics imports _triton.decode"),
    "interface_imports_backend": ("interface.py", "from . import _cpu\n",
                                  "interface imports _cpu"),
    "cycle": ("_params.py", "from ._heuristics import h\n",
              "import cycle: _params -> _heuristics -> _params"),
    "shared_cycle": ("_triton/tuning.py", "from .common import c\n",
                     "import cycle: _triton.common -> _triton.tuning -> _triton.common"),
}


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_good_tree_passes(tmp_path):
    assert problems_of(_write_tree(tmp_path / "pkg", GOOD_TREE)) == []


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_bad_import_fails(tmp_path, name):
    rel, line, expected = PLANTED[name]
    files = dict(GOOD_TREE)
    files[rel] = files.get(rel, "") + line
    problems = problems_of(_write_tree(tmp_path / "pkg", files))
    assert any(expected in problem for problem in problems), problems


def test_planted_in_a_copy_of_the_package(tmp_path):
    copy = tmp_path / "flash_attn"
    shutil.copytree(SOURCE_PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "_cuda.py").open("a") as f:
        f.write("\n\ndef _fallback():\n    from ._triton import fwd\n    return fwd\n")
    assert problems_of(copy) == ["_cuda imports _triton.fwd: backends never import one another "
                                 "(the dispatcher chooses between them)"]
