"""Summarise the per-instruction stall samples of an Nsight Compute report exported as CSV
(`ncu -i REPORT.ncu-rep --page source --csv --print-source sass`; see tools/profile_kernels.py).

For each kernel in the file: the stall reasons over all samples, the samples by how often an
instruction ran (per step, per tile, once per CTA: that separates a kernel's loop from its
prologue and epilogue), and the instructions with the most samples with their two main reasons.

    python3 -m tools.sass_stalls sass.csv [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(path: Path):
    """``(kernel name, header, rows)`` for each kernel section of the CSV."""
    name, header, rows = None, None, []
    for row in csv.reader(path.open(newline="")):
        if row and row[0] == "Kernel Name":
            if header is not None:
                yield name, header, rows
            name, header, rows = row[1] if len(row) > 1 else "?", None, []
        elif header is None and row and row[0] == "Address":
            header = row
        elif header is not None and row:
            rows.append(row)
    if header is not None:
        yield name, header, rows


def _int(text: str) -> int:
    try:
        return int(text.replace(",", ""))
    except ValueError:
        return 0


def summarise(name: str, header: list[str], rows: list[list[str]], top: int) -> None:
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    totals = collections.Counter()
    by_count = collections.Counter()
    lines_by_count = collections.Counter()
    for row in rows:
        for h in reasons:
            totals[h] += _int(row[col[h]])
        by_count[_int(row[col[EXECUTED]])] += _int(row[col[SAMPLES]])
        lines_by_count[_int(row[col[EXECUTED]])] += 1
    total = sum(totals.values()) or 1
    print(f"== {name[:150]}\n{total} stall samples, {len(rows)} SASS instructions")
    for reason, n in totals.most_common(8):
        print(f"  {reason:28s} {n:9d} {n / total:6.1%}")
    print("  samples by times executed (the loop runs most often):")
    for count, n in by_count.most_common(6):
        print(f"    executed {count:>10d}x: {n:9d} samples ({n / total:5.1%}) "
              f"over {lines_by_count[count]} instructions")
    ranked = sorted(range(len(rows)), key=lambda i: -_int(rows[i][col[SAMPLES]]))
    print(f"  top {top} instructions:")
    for i in ranked[:top]:
        row = rows[i]
        main = sorted(((_int(row[col[h]]), h[6:]) for h in reasons), reverse=True)[:2]
        why = ", ".join(f"{r} {n}" for n, r in main if n)
        print(f"    {_int(row[col[SAMPLES]]):7d}  #{i:<5d} {row[col['Source']].strip()[:60]:60s} {why}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    for path in args.csv:
        for name, header, rows in kernels(path):
            summarise(name, header, rows, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
