"""A run folder (``benchmarks/results/<run>/``): long-format ``results.json`` and
``results.csv`` (one record per provider, workload and mode), ``skipped.json``, ``run.json``
(grids, machine, and one entry per command that measured into it), PNG plots and
``RESULTS.md``; beside the runs, ``INDEX.md`` lists them.

A run may be measured in several commands (a GPU machine limits how long one may run):
``--append`` adds to a folder in place, ``bench merge`` combines folders (or the archives a
GPU machine returns). Either way a (workload, mode, dtype) group measured again replaces
the old one whole, so a ratio never mixes two processes, and runs from different machines
or software versions are refused unless ``allow_mixed``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import tarfile
import tempfile
from pathlib import Path

from .env import SAME_MACHINE
from .markdown import markdown
from .plots import plot, versions
from .runner import add_ratios


class MergeError(Exception):
    """Runs that cannot share one folder (different machines or software, no results)."""


@dataclasses.dataclass
class Run:
    records: list[dict] = dataclasses.field(default_factory=list)
    skips: list[dict] = dataclasses.field(default_factory=list)
    parts: list[dict] = dataclasses.field(default_factory=list)  # one per command: argv, grids, env, seconds...

    @property
    def grids(self) -> list[str]:
        return list(dict.fromkeys(g for p in self.parts for g in p.get("grids", [])))

    @property
    def env(self) -> dict:
        """The parts' environment: a field's value when they agree, else the values joined
        (dates: first .. last)."""
        envs = [p.get("env", {}) for p in self.parts]
        out = {}
        for key in dict.fromkeys(k for e in envs for k in e):
            values = list(dict.fromkeys(e.get(key) for e in envs if e.get(key) is not None))
            if key == "date" and len(values) > 1:
                out[key] = f"{min(values)} .. {max(values)}"
            else:
                out[key] = " | ".join(map(str, values)) if len(values) > 1 else (values[0] if values else None)
        return out


def skip_dict(s) -> dict:
    return s if isinstance(s, dict) else dataclasses.asdict(s)


def merge(existing: list[dict], new: list[dict]) -> list[dict]:
    """Records of a run extended by another: a (workload, mode, dtype) group measured
    again is replaced whole, so a ratio never mixes two processes."""
    keys = {(r["workload"], r["mode"], r["dtype"]) for r in new}
    return [r for r in existing if (r["workload"], r["mode"], r["dtype"]) not in keys] + new


def mismatches(parts: list[dict]) -> dict[str, list]:
    """``SAME_MACHINE`` fields on which the parts disagree, with their values."""
    out = {}
    for key in SAME_MACHINE:
        values = list(dict.fromkeys(p.get("env", {}).get(key) for p in parts))
        if len(values) > 1:
            out[key] = values
    return out


def combine(runs: list[Run], *, allow_mixed: bool = False) -> Run:
    """One run from several, later ones winning per (workload, mode, dtype) group; a skip of
    an earlier run is dropped when a later one measured or skipped that workload again."""
    parts = [p for r in runs for p in r.parts]
    bad = mismatches(parts)
    if bad and not allow_mixed:
        raise MergeError("runs from different machines or software cannot share one table: "
                         + "; ".join(f"{k}: {v}" for k, v in bad.items())
                         + " (allow_mixed / --allow-mixed overrides)")
    out = Run()
    for run in runs:
        redone = {r["workload"] for r in run.records} | {s["workload"] for s in run.skips if s["workload"] != "all"}
        out.records = merge(out.records, run.records)
        out.skips = [s for s in out.skips if s["workload"] not in redone]
        out.skips += [s for s in run.skips if s not in out.skips]
        out.parts += run.parts
    add_ratios(out.records)
    return out


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def write_csv(path: Path, records: list[dict]) -> None:
    fields: list[str] = []
    for r in records:
        fields += [k for k in r if k not in fields]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(records)


def load_run(run_dir: Path) -> Run:
    """A run folder as written by :func:`write_data`; also reads the older ``run.json``
    without ``parts`` (one part: its grids and env)."""
    results = run_dir / "results.json"
    if not results.exists():
        raise MergeError(f"{run_dir}: no results.json")
    skipped = run_dir / "skipped.json"
    meta_path = run_dir / "run.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    parts = meta.get("parts") or [{"grids": meta.get("grids", []), "env": meta.get("env", {})}]
    for part in parts:
        part.setdefault("source", run_dir.name)
    return Run(json.loads(results.read_text()), json.loads(skipped.read_text()) if skipped.exists() else [], parts)


def write_data(run_dir: Path, run: Run) -> None:
    """The data files of a run (cheap: written after every workload while measuring)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "results.json", run.records)
    write_csv(run_dir / "results.csv", run.records)
    write_json(run_dir / "skipped.json", run.skips)
    write_json(run_dir / "run.json", {"grids": run.grids, "env": run.env, "parts": run.parts})


def write_run(run_dir: Path, run: Run) -> Path:
    """Everything for one run under ``run_dir`` and the index beside it; returns RESULTS.md."""
    write_data(run_dir, run)
    plots_dir = run_dir / "plots"
    for old in plots_dir.glob("*.png") if plots_dir.is_dir() else []:
        old.unlink()  # a merged run's figures are redrawn from all its records
    plots = plot(run_dir, run.records, run.env) if run.records else []
    md = markdown(run.records, run.skips, run.env, plots, run_dir, f"Attention benchmark: {run_dir.name}",
                  parts=run.parts)
    path = run_dir / "RESULTS.md"
    path.write_text(md)
    update_index(run_dir.parent)
    return path


def find_runs(source: Path, scratch: Path) -> list[Path]:
    """Run folders in ``source``: a run folder, a folder holding some, or a ``.tgz`` /
    ``.tar.gz`` / ``.tar`` archive of either (unpacked under ``scratch``)."""
    if source.is_file() and source.name.endswith((".tgz", ".tar.gz", ".tar")):
        target = scratch / f"{len(list(scratch.iterdir()))}-{source.name.split('.')[0]}"
        with tarfile.open(source) as tar:
            tar.extractall(target, filter="data")
        source = target
    if (source / "results.json").is_file():
        return [source]
    found = sorted(p.parent for p in source.rglob("results.json"))
    if not found:
        raise MergeError(f"{source}: no run folder (results.json) in it")
    return found


def merge_sources(sources: list[Path], into: Path, *, allow_mixed: bool = False, log=print) -> Path:
    """``bench merge``: the runs in ``sources`` (and ``into``'s own results, when it has any)
    combined into ``into``, oldest first by date, with plots, RESULTS.md and the index."""
    with tempfile.TemporaryDirectory() as scratch:
        dirs = [d for s in sources for d in find_runs(Path(s), Path(scratch))]
        if (into / "results.json").exists():
            dirs.insert(0, into)
        unique = list({d.resolve(): d for d in dirs}.values())
        runs = [load_run(d) for d in unique]
        for d, r in zip(unique, runs):
            log(f"  {d}: {len(r.records)} records, grids {', '.join(r.grids) or '?'}, {r.env.get('date')}")
        runs.sort(key=lambda r: str(r.env.get("date") or ""))
        merged = combine(runs, allow_mixed=allow_mixed)
    replaced = sum(len(r.records) for r in runs) - len(merged.records)
    if replaced:
        log(f"  {replaced} records replaced by newer measurements of the same workload and mode")
    return write_run(into, merged)


def update_index(out_root: Path) -> Path:
    """``INDEX.md`` beside the runs: a table row per run with its RESULTS.md, newest first."""
    runs = []
    for run_dir in (p for p in out_root.iterdir() if (p / "RESULTS.md").exists()):
        try:
            runs.append((run_dir, load_run(run_dir)))
        except (MergeError, json.JSONDecodeError):
            continue
    runs.sort(key=lambda item: (str(item[1].env.get("date") or ""), item[0].name), reverse=True)
    lines = ["# Benchmark runs", "",
             "Newest first. Every ratio in a run compares providers measured in the same process; "
             "`python -m flash_attn_hub bench --grid all` reproduces a full run on a GPU "
             "(see [benchmarks/README.md](../README.md)).", "",
             "| run | GPU | versions | grids | workloads | providers | git | date |",
             "|---|---|---|---|---|---|---|---|"]
    for run_dir, run in runs:
        env = run.env
        workloads = len({r["workload"] for r in run.records})
        providers = ", ".join(sorted({r["provider"] for r in run.records},
                                     key=lambda p: (not p.startswith("ours"), p)))
        date = str(env.get("date") or "")[:16].replace("T", " ")
        git = f"`{env['git_sha']}`" if env.get("git_sha") else "not recorded"
        lines.append(f"| [{run_dir.name}]({run_dir.name}/RESULTS.md) | {env.get('gpu', '?')} | {versions(env)} | "
                     f"{', '.join(run.grids)} | {workloads} | {providers} | {git} | {date} |")
    path = out_root / "INDEX.md"
    path.write_text("\n".join(lines) + "\n")
    return path
