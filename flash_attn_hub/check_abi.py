"""ELF checks of a compiled extension: manylinux_2_28 symbol versions and the Python limited API.

* Symbol versions: the ``.gnu.version_r`` (version needed) section lists every
  ``GLIBC_x.y``, ``GLIBCXX_x.y.z`` and ``CXXABI_x.y.z`` the library needs; each must be at most
  the manylinux_2_28 ceiling (GLIBC 2.28, GLIBCXX 3.4.24, CXXABI 1.3.11). The undefined
  dynamic symbols that need a too-new version are named (via ``.gnu.version``).
* Python: every undefined ``Py*``/``_Py*`` symbol must be part of the limited API of
  Python 3.9 (abi3). That set is read from the installed ``Python.h`` itself, preprocessed
  with ``Py_LIMITED_API=0x03090000``: the functions and data it declares as exported.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

# manylinux_2_28 ceilings (PEP 600 policy of the manylinux_2_28 image).
MAX_VERSIONS = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11)}
LIMITED_API = 0x03090000
_VERSION_RE = re.compile(r"^(GLIBCXX|GLIBC|CXXABI)_(\d+(?:\.\d+)*)$")


@dataclasses.dataclass(frozen=True)
class AbiProblem:
    rule: str  # "abi-symbol-version" | "abi-python"
    message: str


def _parse_version(name: str) -> tuple[str, tuple[int, ...]] | None:
    match = _VERSION_RE.match(name)
    if match is None:
        return None
    return match[1], tuple(int(x) for x in match[2].split("."))


def needed_versions(path: Path) -> dict[str, list[str]]:
    """{version name (``GLIBC_2.32``): [undefined symbols that need it]} for ``path``."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection, GNUVerSymSection

    with open(path, "rb") as f:
        elf = ELFFile(f)
        index_to_name: dict[int, str] = {}
        for section in elf.iter_sections():
            if isinstance(section, GNUVerNeedSection):
                for _verneed, vernaux_iter in section.iter_versions():
                    for aux in vernaux_iter:
                        index_to_name[aux["vna_other"]] = aux.name
        result: dict[str, list[str]] = {name: [] for name in index_to_name.values()}
        dynsym = elf.get_section_by_name(".dynsym")
        versym = next((s for s in elf.iter_sections() if isinstance(s, GNUVerSymSection)), None)
        if dynsym is not None and versym is not None:
            for i, sym in enumerate(dynsym.iter_symbols()):
                if sym["st_shndx"] != "SHN_UNDEF" or not sym.name:
                    continue
                ndx = versym.get_symbol(i)["ndx"]
                if isinstance(ndx, int) and ndx in index_to_name:
                    result[index_to_name[ndx]].append(sym.name)
    return result


def undefined_symbols(path: Path) -> list[str]:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        dynsym = ELFFile(f).get_section_by_name(".dynsym")
        if dynsym is None:
            return []
        return [s.name for s in dynsym.iter_symbols() if s["st_shndx"] == "SHN_UNDEF" and s.name]


@functools.lru_cache(maxsize=1)
def limited_api_symbols() -> frozenset[str] | None:
    """Names ``Python.h`` exports under ``Py_LIMITED_API=3.9``; None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    include = sysconfig.get_paths()["include"]
    result = subprocess.run(
        [compiler, "-E", f"-DPy_LIMITED_API={LIMITED_API:#x}", f"-I{include}", "-x", "c", "-"],
        input="#include <Python.h>\n", capture_output=True, text=True)
    if result.returncode != 0:
        return None
    names = set()
    for decl in re.findall(r'visibility\s*\(\s*"default"\s*\)\s*\)\s*\)([^;]*);', result.stdout):
        func = re.search(r"\b(_?Py\w*)\s*\(", decl)
        if func:
            names.add(func[1])
            continue
        data = re.findall(r"\b(\w+)\s*(?:\[[^\]]*\])?\s*$", decl.strip())
        if data:
            names.add(data[-1])
    return frozenset(names)


def check_library(path: Path) -> list[AbiProblem]:
    problems = []
    for version, symbols in sorted(needed_versions(path).items()):
        parsed = _parse_version(version)
        if parsed is None:
            continue
        family, numbers = parsed
        ceiling = MAX_VERSIONS[family]
        if numbers > ceiling:
            who = ", ".join(sorted(symbols)[:8]) + (" ..." if len(symbols) > 8 else "")
            problems.append(AbiProblem(
                "abi-symbol-version",
                f"needs {version} (manylinux_2_28 allows {family} <= {'.'.join(map(str, ceiling))})"
                + (f" for {who}" if who else "")))
    python_symbols = [s for s in undefined_symbols(path) if s.startswith(("Py", "_Py"))]
    allowed = limited_api_symbols()
    if allowed is None:
        bad = [s for s in python_symbols if s.startswith("_Py")]
        note = " (no C compiler to read the limited API from Python.h: only private names checked)"
    else:
        bad = [s for s in python_symbols if s not in allowed]
        note = ""
    if bad:
        problems.append(AbiProblem(
            "abi-python", f"uses Python symbols outside the 3.9 limited API (abi3): "
                          f"{', '.join(sorted(bad))}{note}"))
    return problems
