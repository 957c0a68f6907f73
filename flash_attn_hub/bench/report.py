"""The results page of a benchmark run, in one folder (``--into``; the release's is
``benchmarks/``): ``results.csv`` (long format, one row per provider, workload and mode, each
with the machine, versions and git sha it was measured with; a skipped cell is a row whose
``skipped`` column gives the reason), ``plots/*.png`` and ``RESULTS.md``.

A run replaces the page. A full run may take two commands on a GPU machine that stops a
command after a few minutes: the second one passes ``append=True``, which keeps the first
one's rows except the (workload, mode, dtype) groups it measures again (replaced whole, so a
ratio never mixes two processes), and refuses rows from another GPU or software version.
"""

from __future__ import annotations

import csv
from pathlib import Path

from .env import SAME_MACHINE
from .markdown import markdown
from .plots import plot
from .runner import add_ratios

RESULTS_MD = "RESULTS.md"
RESULTS_CSV = "results.csv"
PLOTS = "plots"
SKIPPED = "skipped"  # the reason column of a skipped cell's row
_INT = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "window_left", "window_right",
        "num_seqs", "total_tokens_q", "peak_mem_bytes", "page_size")
_FLOAT = ("softcap", "flops", "ms_p20", "ms_p50", "ms_p80", "tflops", "ratio_to_best_peer", "gbps", "copy_gbps",
          "pct_copy", "host_us", "verify_err_out", "verify_err_grad")
_BOOL = ("causal", "varlen", "kv_cache")


class PageError(Exception):
    """Rows that cannot share one page (another machine or software), or no page to add to."""


def env_of(records: list[dict]) -> dict:
    """The machine and versions of the rows: a field's value when they agree, else the
    values joined (dates: first .. last); ``command`` is the list of the commands whose rows
    the page holds, in the order they first appear."""
    keys = ("gpu", "driver", "torch", "cuda", "cudnn", "triton", "kernels", "fa4", "flashinfer", "kernel_build",
            "git_sha", "date", "command")
    out = {}
    for key in keys:
        values = list(dict.fromkeys(r.get(key) for r in records if r.get(key) not in (None, "")))
        if key == "date" and len(values) > 1:
            out[key] = f"{min(values)} .. {max(values)}"
        elif key == "command":  # a list: the commands whose rows are on the page, in order
            out[key] = [str(v) for v in values]
        else:
            out[key] = " | ".join(map(str, values)) if len(values) > 1 else (values[0] if values else None)
    return out


# The SAME_MACHINE fields that are a peer's package version, with the peer's provider name: such
# a version matters only to a page on which that peer is measured (FlashInfer, say, installed
# between two commands of a page that never runs it).
PEER_VERSIONS = {"fa4": "fa4", "flashinfer": "flashinfer"}


def mismatches(old: list[dict], new: list[dict], providers=()) -> dict[str, list]:
    """``SAME_MACHINE`` fields on which the rows of ``old`` and ``new`` disagree; a peer's
    version only where that peer has rows in ``old`` or is among the ``providers`` to run."""
    measured = {r.get("provider") for r in old} | set(providers)
    out = {}
    for key in SAME_MACHINE:
        if key in PEER_VERSIONS and PEER_VERSIONS[key] not in measured:
            continue
        values = list(dict.fromkeys(str(r.get(key) or "") for r in old + new))
        if len(values) > 1:
            out[key] = values
    return out


def combine(old_records, old_skips, new_records, new_skips) -> tuple[list[dict], list[dict]]:
    """A page extended by a later command: a (workload, mode, dtype) group measured again is
    replaced whole; an old skip goes when the later command measured or skipped its workload."""
    keys = {(r["workload"], r["mode"], r["dtype"]) for r in new_records}
    records = [r for r in old_records if (r["workload"], r["mode"], r["dtype"]) not in keys] + new_records
    redone = {r["workload"] for r in new_records} | {s["workload"] for s in new_skips if s["workload"] != "all"}
    skips = [s for s in old_skips if s["workload"] not in redone and s not in new_skips] + new_skips
    return add_ratios(records), skips


def _value(key: str, text: str):
    if text == "":
        return None
    if key in _INT:
        return int(text)
    if key in _FLOAT:
        return float(text)
    if key in _BOOL:
        return text == "True"
    return text


def load(into: Path) -> tuple[list[dict], list[dict]]:
    """(records, skips) of the page in ``into``."""
    path = Path(into) / RESULTS_CSV
    if not path.is_file():
        raise PageError(f"{into}: no {RESULTS_CSV} to add to")
    records, skips = [], []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if row.get(SKIPPED):
                skips.append({"provider": row["provider"], "workload": row["workload"], "mode": row["mode"],
                              "reason": row[SKIPPED]})
            else:
                row.pop(SKIPPED, None)
                records.append({k: _value(k, v) for k, v in row.items()})
    return records, skips


def write_data(into: Path, records: list[dict], skips: list[dict]) -> Path:
    """``results.csv`` alone (cheap: written after every workload while measuring)."""
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    rows = list(records) + [{"provider": s["provider"], "workload": s["workload"], "mode": s["mode"],
                             SKIPPED: s["reason"]} for s in skips]
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    path = into / RESULTS_CSV
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def clear_page(into: Path) -> None:
    """Remove the page in ``into`` (RESULTS.md, results.csv, plots/*.png), nothing else: a run
    that replaces it and is stopped half-way leaves no page describing other numbers."""
    into = Path(into)
    for path in [into / RESULTS_MD, into / RESULTS_CSV, *(into / PLOTS).glob("*.png")]:
        path.unlink(missing_ok=True)


def write_page(into: Path, records: list[dict], skips: list[dict], *, title: str = "Attention benchmark") -> Path:
    """The whole page in ``into``: results.csv, the plots (the old ones removed) and
    RESULTS.md; returns RESULTS.md's path."""
    into = Path(into)
    write_data(into, records, skips)
    for old in (into / PLOTS).glob("*.png"):
        old.unlink()
    env = env_of(records)
    plots = plot(into / PLOTS, records, env) if records else []
    path = into / RESULTS_MD
    path.write_text(markdown(records, skips, env, plots, into, title))
    return path
