"""The loops of compiled kernels as their SASS has them: per kernel, each loop's length in
instructions and what in it hints at control flow or memory the source does not show.

A kernel's hot loop can compile into more than its source suggests: a per-element condition on a
run-time value became a branch around every entry of the backward's band mask (BSSY/BSYNC and
three or four BRA per entry, twice the instructions of an unmasked step; docs/performance.md,
Backward), which no profile had pointed at. Read a changed kernel's loops before timing it:

    nvcc ... -gencode arch=compute_90a,code=sm_90a \\
        -c csrc/hopper/instantiations/bwd_bf16_d64.cu -o k.o
    python3 -m tools.sass_loops k.o --kernel bwd_kernel

A loop is a predicated backward branch spanning at least --min-loop instructions (an
unconditional jump back returns from code placed out of line); per loop the table gives
its span and its counts of BSSY (a divergent region: a branch the compiler could not turn into
selects), BRA, local-memory traffic (STL/LDL: spills), HGMMA, MUFU and BAR. OBJ is an object
file, a shared library or a cubin (read with cuobjdump: from PATH, CUDA_HOME, or the copy
Triton bundles), or a text file holding `cuobjdump -sass` output. Needs no GPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

FLAGGED = ("BSSY", "BRA", "STL", "LDL", "HGMMA", "MUFU", "BAR")
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b(?:\s+\S+,)?\s+(0x[0-9a-f]+)")


@dataclasses.dataclass
class Loop:
    start: int  # address of the branch target
    end: int  # address of the backward branch
    counts: collections.Counter  # opcode (before the first dot) -> instructions

    @property
    def length(self) -> int:
        return sum(self.counts.values())


@dataclasses.dataclass
class Kernel:
    name: str
    instructions: list[tuple[int, str]]  # (address, opcode)
    loops: list[Loop]


def _opcode(text: str) -> str:
    words = text.split()
    if words and words[0].startswith("@"):  # a predicate guard
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parse(sass: str, *, min_loop: int = 256) -> list[Kernel]:
    """The kernels of ``cuobjdump -sass`` text, each with its loops of at least ``min_loop``
    instructions, outermost (longest) first."""
    kernels = []
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        matches = map(_INSTRUCTION.match, chunk.splitlines())
        rows = [(int(m.group(1), 16), m.group(2)) for m in matches if m]
        ops = [(address, _opcode(text)) for address, text in rows]
        loops = []
        for address, text in rows:
            branch = _BRANCH.search(text)
            # a loop's back edge is conditional; an unconditional jump back is the return from
            # code placed out of line (a barrier's retry, a slow path), not a loop
            if not branch or not text.startswith("@") or int(branch.group(1), 16) >= address:
                continue
            start = int(branch.group(1), 16)
            counts = collections.Counter(op for a, op in ops if start <= a <= address)
            if sum(counts.values()) >= min_loop:
                loops.append(Loop(start, address, counts))
        loops.sort(key=lambda loop: -loop.length)
        kernels.append(Kernel(name, ops, loops))
    return kernels


def cuobjdump() -> str:
    """The cuobjdump to read binaries with, or exits saying where it was looked for."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump"]
    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        candidates.append(bundled / "cuobjdump")
    except ImportError:
        pass
    for path in candidates:
        if path.is_file():
            return str(path)
    raise SystemExit("no cuobjdump: not on PATH, not in $CUDA_HOME/bin, not bundled with triton")


def read_sass(path: Path) -> str:
    """``cuobjdump -sass`` of a binary, or the file's text when it already is SASS."""
    data = path.read_bytes()
    if not data.startswith(b"\x7fELF"):
        return data.decode(errors="replace")
    result = subprocess.run([cuobjdump(), "-sass", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"cuobjdump -sass {path} failed: {result.stderr.strip()}")
    return result.stdout


def _demangled(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return names
    result = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = result.stdout.splitlines()
    return lines if result.returncode == 0 and len(lines) == len(names) else names


def report(kernels: list[Kernel]) -> str:
    lines = []
    for kernel, name in zip(kernels, _demangled([k.name for k in kernels])):
        lines.append(f"{name}\n  {len(kernel.instructions)} instructions, "
                     f"{len(kernel.loops)} loops")
        for loop in kernel.loops:
            flagged = "  ".join(f"{op} {loop.counts[op]}" for op in FLAGGED)
            lines.append(f"  loop {loop.start:#06x}..{loop.end:#06x}: {loop.length:5d} instructions"
                         f"  {flagged}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("obj", type=Path, help="object, shared library, cubin or SASS text")
    parser.add_argument("--kernel", default="",
                        help="only kernels whose mangled name matches this regex")
    parser.add_argument("--min-loop", type=int, default=256,
                        help="shortest loop reported, in instructions (default 256)")
    args = parser.parse_args(argv)
    kernels = [k for k in parse(read_sass(args.obj), min_loop=args.min_loop)
               if re.search(args.kernel, k.name)]
    if not kernels:
        print(f"no kernel in {args.obj} matches {args.kernel!r}", file=sys.stderr)
        return 1
    print(report(kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
