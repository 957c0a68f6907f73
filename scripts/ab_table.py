"""The table of an A/B of two CUDA builds: GPU time per call, patched against base.

`bash scripts/gpu_run.sh setup ab` (AB_PATCH, KT_ARGS) writes `ab.log`: for every round and
workload, one `scripts/kernel_times.py` process per build, each block headed
`== <build> rep<round>: <workload args>`. This prints, per workload and mode (fwd, bwd), the
median over rounds of ours' GPU time per call (all kernels, and the main kernel: the longest
one), the change from base to exp in the main kernel's time, and SDPA cuDNN's time from the same
processes (the range over all of them):

    python3 scripts/ab_table.py gpu-out/ab.log [--base base --exp exp]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HEADER = re.compile(r"^== (\S+?)(?: rep(\d+))?: (.*)$")
TOTAL = re.compile(r"^(\S+) (fwd|bwd): ([\d.]+) us of kernels per call")
ROW = re.compile(r"^\s+([\d.]+) us\s+\d+x")


def parse(text: str) -> dict:
    """``{(build, workload, provider, mode): [(total us, main kernel us), ...]}``, one pair per
    process (round)."""
    times: dict = defaultdict(list)
    build = workload = None
    pending = None  # the (key, total) whose main-kernel row comes next
    for line in text.splitlines():
        if m := HEADER.match(line):
            build, workload, pending = m.group(1), m.group(3).strip(), None
        elif build is not None and (m := TOTAL.match(line)):
            pending = ((build, workload, m.group(1), m.group(2)), float(m.group(3)))
        elif pending is not None and (m := ROW.match(line)):
            key, total = pending
            times[key].append((total, float(m.group(1))))  # rows are sorted: the first is longest
            pending = None
    return times


def table(times: dict, base: str, exp: str) -> list[str]:
    """Markdown rows: one per (workload, mode) that both builds ran."""
    lines = ["| workload | mode | base total / main | exp total / main | exp vs base (main) "
             "| cuDNN total |",
             "|---|---|---|---|---|---|"]
    ours = [(w, p, mode) for (b, w, p, mode) in times if b == base and p.startswith("ours")]
    for workload, provider, mode in ours:  # in the log's order
        a, b = times[(base, workload, provider, mode)], times.get((exp, workload, provider, mode))
        if not b:
            continue
        med = [tuple(statistics.median(x[i] for x in runs) for i in (0, 1)) for runs in (a, b)]
        change = med[1][1] / med[0][1] - 1
        cudnn = [t for build in (base, exp)
                 for t, _ in times.get((build, workload, "sdpa-cudnn", mode), [])]
        peer = f"{min(cudnn):.0f}-{max(cudnn):.0f}" if cudnn else "-"
        lines.append(f"| {workload} | {mode} | {med[0][0]:.0f} / {med[0][1]:.0f} | "
                     f"{med[1][0]:.0f} / {med[1][1]:.0f} | {change:+.1%} | {peer} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--base", default="base")
    parser.add_argument("--exp", default="exp")
    args = parser.parse_args(argv)
    times = parse(args.log.read_text())
    rows = table(times, args.base, args.exp)
    if len(rows) == 2:
        print(f"{args.log}: no workload ran on both {args.base} and {args.exp}", file=sys.stderr)
        return 1
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
