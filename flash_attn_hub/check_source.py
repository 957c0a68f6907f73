"""Source rules kernel-builder's hooks enforce on a kernel's Python package (read with ``ast``).

* ``op-name``: every op name given to ``torch.library`` (``custom_op``, ``triton_op``,
  ``define``, ``register_fake``, ``register_autograd``, ``register_kernel``, ``impl``,
  ``impl_abstract``, ``register_torch_dispatch``, ``register_vmap``) is written as
  ``add_op_namespace_prefix("<name>")`` directly, with ``add_op_namespace_prefix``
  imported from ``._ops`` outside any ``try`` and defined nowhere else: no wrapper, no
  fallback namespace.
* ``relative-imports``: every import is relative (and stays inside the package) or names
  the standard library, torch or triton; ``importlib.import_module``/``__import__`` with a
  literal name follow the same rule.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

PREFIX_FN = "add_op_namespace_prefix"
LIBRARY_FUNCS = frozenset({
    "custom_op", "triton_op", "define", "register_fake", "register_autograd", "register_kernel",
    "impl", "impl_abstract", "register_torch_dispatch", "register_vmap",
})
ALLOWED_TOP_LEVEL = frozenset({"torch", "triton"})


@dataclasses.dataclass(frozen=True)
class SourceProblem:
    file: str
    line: int
    rule: str
    message: str


def _allowed_absolute(module: str) -> bool:
    top = module.split(".")[0]
    return top in ALLOWED_TOP_LEVEL or top in sys.stdlib_module_names


class _Visitor(ast.NodeVisitor):
    def __init__(self, rel: str, depth: int):
        self.rel = rel
        self.depth = depth  # package levels above this file inside the variant (0 = top)
        self.problems: list[SourceProblem] = []
        self.library_aliases: set[str] = set()  # names bound to the torch.library module
        self.torch_aliases: set[str] = set()  # names bound to torch
        self.library_funcs: dict[str, str] = {}  # local name -> torch.library function
        self.ops_names: list[tuple[str, int]] = []  # (op name, line)
        self.try_depth = 0

    def problem(self, node: ast.AST, rule: str, message: str) -> None:
        self.problems.append(SourceProblem(self.rel, getattr(node, "lineno", 0), rule, message))

    def visit_Try(self, node):
        self.try_depth += 1
        self.generic_visit(node)
        self.try_depth -= 1

    visit_TryStar = visit_Try

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            if not _allowed_absolute(alias.name):
                self.problem(node, "relative-imports",
                             f"`import {alias.name}`: imports must be relative or stdlib/torch/triton")
            if alias.name == "torch" or (alias.name.startswith("torch.") and alias.asname is None):
                self.torch_aliases.add(alias.asname or "torch")
            if alias.name == "torch.library" and alias.asname:
                self.library_aliases.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom):
        names = [a.name for a in node.names]
        if node.level == 0:
            module = node.module or ""
            if not _allowed_absolute(module):
                self.problem(node, "relative-imports",
                             f"`from {module} import ...`: imports must be relative or stdlib/torch/triton")
            if module == "torch" and "library" in names:
                alias = next(a for a in node.names if a.name == "library")
                self.library_aliases.add(alias.asname or "library")
            if module == "torch.library":
                for a in node.names:
                    if a.name in LIBRARY_FUNCS:
                        self.library_funcs[a.asname or a.name] = a.name
        else:
            if node.level > self.depth + 1:
                self.problem(node, "relative-imports",
                             f"`from {'.' * node.level}{node.module or ''} import ...` leaves the package")
            if PREFIX_FN in names:
                alias = next(a for a in node.names if a.name == PREFIX_FN)
                if alias.asname not in (None, PREFIX_FN):
                    self.problem(node, "op-name",
                                 f"{PREFIX_FN} is imported as {alias.asname}: call it by its name")
                if node.level != 1 or node.module != "_ops":
                    self.problem(node, "op-name",
                                 f"{PREFIX_FN} must be imported from ._ops, not "
                                 f"{'.' * node.level}{node.module or ''}")
                if self.try_depth:
                    self.problem(node, "op-name",
                                 f"the import of {PREFIX_FN} is inside try: no fallback namespace")
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        if node.name == PREFIX_FN and self.rel != "_ops.py":
            self.problem(node, "op-name", f"{PREFIX_FN} is redefined here (only _ops.py defines it)")
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Name) and target.id == PREFIX_FN:
                self.problem(node, "op-name", f"{PREFIX_FN} is reassigned here")
        self.generic_visit(node)

    def _library_func(self, func: ast.expr) -> str | None:
        if isinstance(func, ast.Name):
            return self.library_funcs.get(func.id)
        if isinstance(func, ast.Attribute) and func.attr in LIBRARY_FUNCS:
            owner = func.value
            if isinstance(owner, ast.Name) and owner.id in self.library_aliases:
                return func.attr
            if (isinstance(owner, ast.Attribute) and owner.attr == "library"
                    and isinstance(owner.value, ast.Name) and owner.value.id in self.torch_aliases):
                return func.attr
        return None

    def visit_Call(self, node: ast.Call):
        name = self._library_func(node.func)
        if name is not None:
            self._check_op_name(node, name)
        self._check_dynamic_import(node)
        self.generic_visit(node)

    def _check_op_name(self, node: ast.Call, func: str) -> None:
        arg = node.args[0] if node.args else next(
            (k.value for k in node.keywords if k.arg in ("name", "qualname", "op", "op_name")), None)
        if arg is None:
            self.problem(node, "op-name", f"torch.library.{func}(...) has no op name argument")
            return
        if not isinstance(arg, ast.Call) or not isinstance(arg.func, ast.Name) or arg.func.id != PREFIX_FN:
            if func in ("register_fake", "register_autograd", "register_kernel", "impl_abstract",
                        "register_torch_dispatch", "register_vmap") and not isinstance(arg, ast.Constant):
                # These also accept the op object returned by custom_op: only a name is checked.
                if isinstance(arg, (ast.Name, ast.Attribute)):
                    return
            self.problem(node, "op-name",
                         f"torch.library.{func}: the op name must be written "
                         f"{PREFIX_FN}(\"<name>\") directly, got `{ast.unparse(arg)}`")
            return
        if len(arg.args) != 1 or arg.keywords or not isinstance(arg.args[0], ast.Constant) \
                or not isinstance(arg.args[0].value, str):
            self.problem(node, "op-name",
                         f"torch.library.{func}: {PREFIX_FN} takes one string literal, got "
                         f"`{ast.unparse(arg)}`")
            return
        if func in ("custom_op", "triton_op", "define"):
            self.ops_names.append((arg.args[0].value.split("(")[0], node.lineno))

    def _check_dynamic_import(self, node: ast.Call) -> None:
        func = node.func
        is_import_module = (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
            (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))
        if not is_import_module or not node.args:
            return
        target = node.args[0]
        if isinstance(target, ast.Constant) and isinstance(target.value, str) \
                and not target.value.startswith(".") and not _allowed_absolute(target.value):
            self.problem(node, "relative-imports",
                         f"dynamic import of {target.value!r}: imports must be relative or "
                         "stdlib/torch/triton")


@dataclasses.dataclass(frozen=True)
class SourceReport:
    problems: list[SourceProblem]
    op_names: list[str]  # ops the package defines (custom_op/triton_op/define)


def check_package(root: Path) -> SourceReport:
    """Apply the source rules to every ``.py`` file under ``root`` (a variant directory)."""
    problems: list[SourceProblem] = []
    op_names: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel.split("/"):
            continue
        try:
            tree = ast.parse(path.read_text(), filename=rel)
        except SyntaxError as err:
            problems.append(SourceProblem(rel, err.lineno or 0, "syntax", str(err)))
            continue
        visitor = _Visitor(rel, depth=rel.count("/"))
        visitor.visit(tree)
        problems += visitor.problems
        op_names += [name for name, _ in visitor.ops_names]
    return SourceReport(problems=problems, op_names=op_names)
