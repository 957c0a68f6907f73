"""``check`` passes on a good build and fails, naming the file and the rule, on broken copies."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from flash_attn_hub import build, check, check_abi, cli, variant


def _quiet(_line: str) -> None:
    pass


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good") / "build"
    return build.build_variant(out, backend="cpu", unique_id="checktest", log=_quiet)


def _copy(good: Path, tmp_path: Path, name: str | None = None) -> Path:
    dest = tmp_path / (name or good.name)
    shutil.copytree(good, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _redigest(variant_dir: Path) -> None:
    """Re-record the digest after a deliberate edit, so only the edited rule fails."""
    meta = json.loads((variant_dir / "metadata.json").read_text())
    meta.pop("digest")
    (variant_dir / "metadata.json").unlink()
    variant.write_metadata(variant_dir, meta)


def _rules(failures) -> set[tuple[str, str]]:
    return {(f.file.split(":")[0], f.rule) for f in failures}


@pytest.mark.kernels_ci
def test_good_build_passes_including_import_without_gpu(good):
    assert check.check_variant(good) == []


def test_wrapped_op_name_fails(good, tmp_path):
    broken = _copy(good, tmp_path)
    with open(broken / "_custom_ops.py", "a") as f:
        f.write(textwrap.dedent('''

            def _named(name):
                return add_op_namespace_prefix(name)


            @torch.library.custom_op(_named("extra"), mutates_args=())
            def _extra(x: torch.Tensor) -> torch.Tensor:
                return x.clone()
        '''))
    _redigest(broken)
    failures = check.check_variant(broken, run_import=False)
    assert _rules(failures) == {("_custom_ops.py", "op-name")}, failures
    assert "_named" in failures[0].message and "add_op_namespace_prefix" in str(failures[0])


@pytest.mark.parametrize("source", [
    "from ._ops import add_op_namespace_prefix as _p\n",
    "add_op_namespace_prefix = str\n",
    "def add_op_namespace_prefix(name):\n    return 'flash_attn::' + name\n",
    "try:\n    from ._ops import add_op_namespace_prefix\nexcept ImportError:\n    pass\n",
    "import torch\ntorch.library.register_fake('flash_attn::fwd')(lambda *a: None)\n",
    "import torch\nNAME = 'fwd'\ntorch.library.define(add_op_namespace_prefix(NAME), '(Tensor x) -> Tensor')\n",
])
def test_op_name_fallbacks_fail(good, tmp_path, source):
    broken = _copy(good, tmp_path)
    (broken / "_fallback.py").write_text(source)
    _redigest(broken)
    assert ("_fallback.py", "op-name") in _rules(check.check_variant(broken, run_import=False))


@pytest.mark.parametrize("line", [
    "import numpy\n", "from flash_attn import _params\n", "from .. import sibling\n",
    "import importlib\nimportlib.import_module('einops')\n",
])
def test_absolute_import_fails(good, tmp_path, line):
    broken = _copy(good, tmp_path)
    (broken / "interface.py").write_text(line + (broken / "interface.py").read_text())
    _redigest(broken)
    failures = check.check_variant(broken, run_import=False)
    assert ("interface.py", "relative-imports") in _rules(failures), failures


@pytest.mark.kernels_ci
def test_allowed_imports_pass(good, tmp_path):
    ok = _copy(good, tmp_path)
    (ok / "_extra_imports.py").write_text(
        "import os, math\nimport torch.nn.functional as F\nimport triton.language as tl\n"
        "from . import _params\nfrom ._params import AttnParams\n")
    _redigest(ok)
    assert check.check_variant(ok, run_import=False) == []


@pytest.mark.kernels_ci
def test_extra_file_breaks_the_digest(good, tmp_path):
    broken = _copy(good, tmp_path)
    (broken / "stray.py").write_text("")
    failures = check.check_variant(broken, run_import=False)
    assert _rules(failures) == {("stray.py", "digest")}, failures
    assert "stray.py" in failures[0].message


def test_edited_and_missing_files_break_the_digest(good, tmp_path):
    broken = _copy(good, tmp_path)
    (broken / "interface.py").write_text((broken / "interface.py").read_text() + "\n")
    (broken / "_params.py").unlink()
    assert {("interface.py", "digest"), ("_params.py", "digest")} <= _rules(
        check.check_variant(broken, run_import=False))


@pytest.mark.parametrize("edit, expected", [
    (lambda m: m.pop("license"), "license"),
    (lambda m: m.pop("python-depends"), "python-depends"),
    (lambda m: m.update(id="_flash_attn_cpu_other"), "_flash_attn_cpu_other"),
    (lambda m: m.update(backend={"type": "cuda"}), "does not match variant"),
])
def test_metadata_rules(good, tmp_path, edit, expected):
    broken = _copy(good, tmp_path)
    meta = json.loads((broken / "metadata.json").read_text())
    edit(meta)
    (broken / "metadata.json").write_text(json.dumps(meta))
    failures = check.check_variant(broken, run_import=False)
    assert any(f.rule == "metadata" and f.file == "metadata.json" and expected in f.message
               for f in failures), failures


def test_variant_name_rule(good, tmp_path):
    broken = _copy(good, tmp_path, name="flash_attn")
    assert ("flash_attn", "variant-name") in _rules(check.check_variant(broken, run_import=False))


def test_stray_library_breaks_ops_module_rule(good, tmp_path):
    broken = _copy(good, tmp_path)
    (broken / "_other.abi3.so").write_bytes(b"not an ELF file")
    _redigest(broken)
    rules = {f.rule for f in check.check_variant(broken, run_import=False)}
    assert "ops-module" in rules and "abi-elf" in rules


def test_import_failure_is_reported(good, tmp_path):
    broken = _copy(good, tmp_path)
    (broken / "__init__.py").write_text("raise RuntimeError('boom at import')\n")
    _redigest(broken)
    failures = check.check_variant(broken)
    assert _rules(failures) == {("__init__.py", "import-on-cpu")}, failures
    assert "boom at import" in failures[0].message


def test_unregistered_op_is_reported(good, tmp_path):
    broken = _copy(good, tmp_path)
    # A definition the package never imports: named correctly, but never registered.
    (broken / "_unused.py").write_text(textwrap.dedent('''
        import torch
        from ._ops import add_op_namespace_prefix


        @torch.library.custom_op(add_op_namespace_prefix("never_loaded"), mutates_args=())
        def _never(x: torch.Tensor) -> torch.Tensor:
            return x.clone()
    '''))
    _redigest(broken)
    failures = check.check_variant(broken)
    assert _rules(failures) == {("_ops.py", "import-on-cpu")} and "never_loaded" in failures[0].message


@pytest.mark.kernels_ci
def test_cli_exit_codes(good, tmp_path, capsys):
    assert cli.main(["check", str(good), "--no-import"]) == 0
    broken = _copy(good, tmp_path)
    (broken / "stray.json").write_text("{}")
    assert cli.main(["check", str(broken), "--no-import"]) == 1
    assert "FAIL stray.json: [digest]" in capsys.readouterr().out


needs_cc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def _shared_library(tmp_path: Path, source: str) -> Path:
    (tmp_path / "lib.c").write_text(source)
    out = tmp_path / "lib.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", str(tmp_path / "lib.c"), "-o", str(out)],
                   check=True, capture_output=True)
    return out


@needs_cc
def test_abi_check_names_too_new_glibc_and_private_python_symbols(tmp_path):
    library = _shared_library(tmp_path, textwrap.dedent('''
        #include <pthread.h>
        extern void _PyObject_SecretHelper(void);
        extern void *PyLong_FromLong(long);
        extern char __libc_single_threaded;
        int use(void) {
            pthread_key_t key;
            PyLong_FromLong(1);
            _PyObject_SecretHelper();
            return pthread_key_create(&key, 0) + __libc_single_threaded;
        }
    '''))
    problems = check_abi.check_library(library)
    by_rule: dict[str, str] = {}
    for p in problems:
        by_rule[p.rule] = by_rule.get(p.rule, "") + p.message + "\n"
    assert "GLIBC_2.34" in by_rule["abi-symbol-version"]
    assert "GLIBC_2.32" in by_rule["abi-symbol-version"]
    assert "__libc_single_threaded" in by_rule["abi-symbol-version"]
    assert "_PyObject_SecretHelper" in by_rule["abi-python"]
    assert "PyLong_FromLong" not in by_rule["abi-python"]


@needs_cc
def test_abi_check_passes_old_symbols_and_limited_api(tmp_path):
    library = _shared_library(tmp_path, textwrap.dedent('''
        #include <string.h>
        extern void *PyLong_FromLong(long);
        extern void *PyModule_Create2(void *, int);
        void *use(char *d, const char *s) { memcpy(d, s, 4); PyModule_Create2(0, 3);
                                            return PyLong_FromLong(1); }
    '''))
    assert check_abi.check_library(library) == []
