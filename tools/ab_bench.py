"""An A/B of run-time variants inside one build, or of builds: `python -m flash_attn_hub bench`
once per variant and round, each in its own process with the variant's environment (and build,
with --kernel-dir-of), variants alternating, then one table of TFLOP/s per workload and variant.

A kernel change is judged by timing both sides on one machine in one call (docs/performance.md,
How numbers are taken: separate machines differ by ~2.5%, a cell moves by up to ~5% between
runs). Where the change can be switched at run time (an environment variable read by a
temporary launch-side switch, or a Python heuristic), one build serves every variant, and each
bench process carries a peer (cuDNN, say) as the anchor that shows drift between processes.

    python3 -m tools.ab_bench --variant old=FAH_SWITCH=0 --variant new= --rounds 2 \\
        --out ab -- --kernel-dir build --grid main --modes fwd --head-dims 256 \\
        --providers ours-cuda,sdpa-cudnn

A change that a switch cannot reach without changing the code around it (a kernel's registers,
its template parameters) is compared as two builds: ``--kernel-dir-of NAME=DIR`` gives variant
NAME its own ``--kernel-dir`` (after bench's own arguments, so it wins). A switch compiled into
a kernel changes what it is meant to compare: both paths share one register allocation.

    python3 -m tools.ab_bench --variant main= --variant lab= --kernel-dir-of lab=/tmp/lab \\
        --out ab -- --kernel-dir build --grid main --modes bwd --providers ours-cuda,sdpa-cudnn

Each process writes its page into ``--out``/``<round>-<variant>/``; the summary (printed, and
``--out``/summary.csv) has one row per (workload, mode, provider) and one column per variant:
the median over rounds of TFLOP/s (all rounds are kept in the CSV). Without a GPU, bench runs
its tiny CPU grid, which checks this tool, not a kernel.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

from flash_attn_hub.bench import report


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``name=VAR=value,VAR2=value`` (or ``name=`` for the unchanged environment) as
    ``(name, {VAR: value})``."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=[VAR=VALUE,...]")
    env = {}
    for item in filter(None, rest.split(",")):
        var, sep, value = item.partition("=")
        if not sep or not var:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def parse_kernel_dir(text: str) -> tuple[str, str]:
    """``name=DIR`` as ``(name, DIR)``."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--kernel-dir-of {text!r}: expected NAME=DIR")
    return name, path


def run_variant(bench_args: list[str], env: dict[str, str], into: Path,
                kernel_dir: str | None = None) -> int:
    """One bench process with ``env`` added to this process's environment (and ``kernel_dir``
    as its build)."""
    own = ["--kernel-dir", kernel_dir] if kernel_dir else []
    cmd = [sys.executable, "-m", "flash_attn_hub", "bench", "--into", str(into), "--no-progress",
           *bench_args, *own]
    return subprocess.run(cmd, env={**os.environ, **env}).returncode


def summarise(pages: dict[str, list[Path]]) -> tuple[list[str], list[dict]]:
    """``(variants, rows)``: per (workload, mode, provider), each variant's TFLOP/s per round
    and their median, from the pages each variant wrote (in round order)."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    for variant, dirs in pages.items():
        for into in dirs:
            records, _ = report.load(into)
            for r in records:
                key = (r["workload"], r["mode"], r["provider"])
                cells.setdefault(key, {}).setdefault(variant, []).append(r["tflops"])
    rows = []
    for (workload, mode, provider), by in cells.items():
        row = {"workload": workload, "mode": mode, "provider": provider}
        for variant in pages:
            values = by.get(variant, [])
            row[variant] = statistics.median(values) if values else None
            row[f"{variant} rounds"] = " ".join(f"{v:.4g}" for v in values)
        rows.append(row)
    return list(pages), rows


def table(variants: list[str], rows: list[dict]) -> str:
    """The summary as text: TFLOP/s medians, and each variant over the first."""
    base = variants[0]
    head = ["workload", "mode", "provider", *variants, *[f"{v}/{base}" for v in variants[1:]]]
    lines = ["  ".join(head)]
    for row in rows:
        cells = [row["workload"], row["mode"], row["provider"]]
        cells += ["-" if row[v] is None else f"{row[v]:.4g}" for v in variants]
        for v in variants[1:]:
            ok = row[v] is not None and row[base]
            cells.append(f"{row[v] / row[base]:.3f}" if ok else "-")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        own, bench_args = argv[:split], argv[split + 1:]
    else:
        own, bench_args = argv, []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME=[VAR=VALUE,...]; the first is the baseline")
    parser.add_argument("--kernel-dir-of", type=parse_kernel_dir, action="append", default=[],
                        metavar="NAME=DIR", help="variant NAME's build (bench's --kernel-dir)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(own)
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        parser.error(f"--variant: names must differ, got {names}")
    kernel_dirs = dict(args.kernel_dir_of)
    unknown = sorted(set(kernel_dirs) - set(names))
    if unknown or len(kernel_dirs) != len(args.kernel_dir_of):
        parser.error(f"--kernel-dir-of: one per variant, for variants {names}; got "
                     f"{[n for n, _ in args.kernel_dir_of]}")
    if any("--into" == a or a.startswith("--into=") for a in bench_args):
        parser.error("give --out, not bench's --into: each variant and round gets its own page")
    pages: dict[str, list[Path]] = {name: [] for name in names}
    for rnd in range(1, args.rounds + 1):
        for name, env in args.variant:
            into = args.out / f"{rnd}-{name}"
            status = run_variant(bench_args, env, into, kernel_dirs.get(name))
            build = f" {kernel_dirs[name]}" if name in kernel_dirs else ""
            print(f"[ab] round {rnd} {name} {env or '(unchanged)'}{build}: exit {status}", flush=True)
            if status != 0:
                return status
            pages[name].append(into)
    variants, rows = summarise(pages)
    text = table(variants, rows)
    print(text)
    with (args.out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["workload"])
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
