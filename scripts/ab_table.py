"""The table of an A/B of CUDA builds: GPU time per call, each build against the one before it.

`bash scripts/gpu_run.sh setup ab` (AB_PATCH, KT_ARGS) writes `ab.log`: for every round and
workload, one `scripts/kernel_times.py` process per build, each block headed
`== <build> rep<round>: <workload args>`. This prints, per workload and mode (fwd, bwd), the
median over rounds of ours' GPU time per call (all kernels, and the main kernel: the longest
one) for every build, the change in the main kernel's time from each build to the next, and SDPA
cuDNN's time from the same processes (the range over all of them):

    python3 scripts/ab_table.py gpu-out/ab.log [--builds base,exp]

With two builds (the default, base and exp) that is one change column, exp against base; a
stack of patches (AB_PATCH naming several) names its builds base, then each patch's file name.
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


def table(times: dict, builds: list[str]) -> list[str]:
    """Markdown rows: one per (workload, mode) that every build ran."""
    head = ["workload", "mode", *(f"{b} total / main" for b in builds)]
    head += [f"{b} vs {a} (main)" for a, b in zip(builds, builds[1:])]
    lines = ["| " + " | ".join([*head, "cuDNN total"]) + " |",
             "|" + "---|" * (len(head) + 1)]
    ours = [(w, p, mode) for (b, w, p, mode) in times if b == builds[0] and p.startswith("ours")]
    for workload, provider, mode in ours:  # in the log's order
        runs = [times.get((b, workload, provider, mode)) for b in builds]
        if not all(runs):
            continue
        med = [tuple(statistics.median(x[i] for x in r) for i in (0, 1)) for r in runs]
        cells = [f"{t:.0f} / {m:.0f}" for t, m in med]
        cells += [f"{b[1] / a[1] - 1:+.1%}" for a, b in zip(med, med[1:])]
        cudnn = [t for build in builds
                 for t, _ in times.get((build, workload, "sdpa-cudnn", mode), [])]
        peer = f"{min(cudnn):.0f}-{max(cudnn):.0f}" if cudnn else "-"
        lines.append("| " + " | ".join([workload, mode, *cells, peer]) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--builds", default="base,exp",
                        help="comma-separated build names, in the order of the stack")
    args = parser.parse_args(argv)
    builds = [b for b in args.builds.split(",") if b]
    if len(builds) < 2:
        parser.error("--builds names fewer than two builds")
    times = parse(args.log.read_text())
    rows = table(times, builds)
    if len(rows) == 2:
        print(f"{args.log}: no workload ran on every one of {', '.join(builds)}", file=sys.stderr)
        return 1
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
