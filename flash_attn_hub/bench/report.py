"""Writes a run's results: long-format JSON and CSV, PNG plots (TFLOP/s against sequence
length, one line per provider) and a Markdown summary, plus an index of all runs."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

MiB = 1 << 20
MODE_TITLES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}

NOTES = """\
- **FLOPs** (ANCHORS.md): forward `4 * B * Hq * Sq * Sk * D`, halved for a causal square score
  matrix; causal with `Sq != Sk`, sliding windows and packed documents count the visible
  (query, key) pairs exactly (bottom-right aligned masks). Backward = 2.5x forward,
  forward + backward = 3.5x. GQA counts query heads. TFLOP/s = FLOPs / median time.
- **Timing**: every provider in one process, one after another; `triton.testing.do_bench`
  (L2 flushed before each call) median with 20th/80th percentiles; several random input sets
  rotated for small problems. "bwd" times the backward alone (the forward graph is built
  outside the timed region; FlexAttention is compiled with AOTAutograd's buffer donation off,
  which that needs); "fwd" runs without autograd (inference: no tensors saved for a backward).
- **Ratio**: our TFLOP/s over the best peer's in the same run, workload and mode (ours are
  never peers).
- **Verification**: before timing, every provider's output (and, when backward modes run,
  dQ/dK/dV) on a slice (last batch element or longest document, up to 128 trailing query rows,
  first and last query heads) is compared with `tests/reference.py` in float64: the error
  may be at most 2x PyTorch's own error in the same precision. A provider that fails is
  skipped with its reason (listed below).
- **Peak memory**: `torch.cuda.max_memory_allocated` during one call minus what was allocated
  before it (outputs, gradients, saved tensors and workspaces of that call).
- **Varlen** (packed SFT batches, lognormal document lengths, 16k tokens): SDPA has no
  native varlen; `sdpa-*-padded` runs SDPA on the batch right-padded to its longest document
  (padding done outside the timed region) and is credited with the useful FLOPs only;
  `flex-docmask` is FlexAttention with a causal document mask over the packed batch.
- **Window**: SDPA flash/cuDNN take no mask; `sdpa-efficient-densemask` uses a dense boolean
  mask; `flex` uses a sliding-window block mask.
- **Decode** (`Sq = 1`): memory-bound, so GB/s (q, k, v read, out written) is listed too.
"""


def merge(existing: list[dict], new: list[dict]) -> list[dict]:
    """Records of a run extended by another: a (workload, mode, dtype) group measured
    again is replaced whole, so a ratio never mixes two processes."""
    keys = {(r["workload"], r["mode"], r["dtype"]) for r in new}
    return [r for r in existing if (r["workload"], r["mode"], r["dtype"]) not in keys] + new


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


def _versions(env: dict) -> str:
    parts = [f"torch {env.get('torch')}", f"CUDA {env.get('cuda')}", f"cuDNN {env.get('cudnn')}",
             f"triton {env.get('triton')}"]
    return ", ".join(p for p in parts if not p.endswith("None"))


def _x(r: dict) -> int:
    return r["seqlen_k"]


def plot(run_dir: Path, records: list[dict], env: dict) -> list[Path]:
    """One PNG per (grid, head dim, heads): a panel per (mask, mode), TFLOP/s against the
    key sequence length, one line per provider (bars when there is one length only)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    families: dict[tuple, list[dict]] = {}
    for r in records:
        shape = "varlen" if r["varlen"] else ("" if r["seqlen_q"] == r["seqlen_k"] else f"sq{r['seqlen_q']}")
        families.setdefault((r["grid"], r["head_dim"], r["heads_q"], r["heads_kv"], shape), []).append(r)
    providers_all = sorted({r["provider"] for r in records}, key=lambda p: (not p.startswith("ours"), p))
    palette = plt.get_cmap("tab10").colors
    colors = {p: palette[i % len(palette)] for i, p in enumerate(providers_all)}
    paths = []
    for (grid, d, hq, hkv, shape), rows in families.items():
        masks = sorted({(r["causal"], r["window_left"]) for r in rows})
        modes = [m for m in MODE_TITLES if any(r["mode"] == m for r in rows)]
        providers = [p for p in providers_all if any(r["provider"] == p for r in rows)]
        fig, axes = plt.subplots(len(masks), len(modes), figsize=(5.2 * len(modes), 3.8 * len(masks)),
                                 squeeze=False)
        for i, (causal, left) in enumerate(masks):
            for j, mode in enumerate(modes):
                ax = axes[i][j]
                panel = [r for r in rows if r["mode"] == mode and (r["causal"], r["window_left"]) == (causal, left)]
                xs = sorted({_x(r) for r in panel})
                for k, p in enumerate(providers):
                    pts = sorted((_x(r), r["tflops"]) for r in panel if r["provider"] == p)
                    if not pts:
                        continue
                    style = dict(color=colors[p], label=p)
                    if len(xs) > 1:
                        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o",
                                linewidth=2.4 if p.startswith("ours") else 1.4, **style)
                    else:
                        ax.bar(k, pts[0][1], **style)
                if len(xs) > 1:
                    ax.set_xscale("log", base=2)
                    ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 else str(x) for x in xs])
                    ax.set_xlabel("sequence length (keys)")
                else:
                    ax.set_xticks([])
                    what = "packed batch, longest document" if shape == "varlen" else "sequence length (keys)"
                    ax.set_xlabel(f"{what}: {xs[0] if xs else ''}")
                ax.set_ylabel("TFLOP/s")
                ax.set_ylim(bottom=0)
                ax.grid(alpha=0.3)
                mask = ("causal" if causal else "non-causal") + (f", window {left}" if left >= 0 else "")
                ax.set_title(f"{MODE_TITLES[mode]}, {mask}", fontsize=10)
                if panel:
                    ax.legend(fontsize=7)
        dtype = rows[0]["dtype"]
        what = {"varlen": ", packed varlen", "": ""}.get(shape, f", Sq={shape[2:]}")
        fig.suptitle(f"{grid}: D={d}, Hq/Hkv={hq}/{hkv}{what}, {dtype} | {env.get('gpu')} | {_versions(env)}",
                     fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{grid}-d{d}-h{hq}-{hkv}{'-' + shape if shape else ''}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _fmt(v) -> str:
    if v is None:
        return ""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def _table(rows: list[dict], value, providers, ours, ratios=True) -> list[str]:
    """A Markdown table: one row per workload, one column per provider (``value`` of its
    record), then the best peer and our ratios to it (TFLOP/s)."""
    ours = ours if ratios else []
    head = ["D", "Hq/Hkv", "B", "Sq", "Sk", "mask", *providers, *(["best peer"] if ratios else []),
            *[f"{o} / best" for o in ours]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_workload: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_workload.setdefault(r["workload"], {})[r["provider"]] = r
    for cells in by_workload.values():
        any_r = next(iter(cells.values()))
        mask = "causal" if any_r["causal"] else "full"
        if any_r["window_left"] >= 0:
            mask += f" w{any_r['window_left']}"
        if any_r["varlen"]:
            mask += f" varlen x{any_r['num_seqs']}"
        line = [str(any_r["head_dim"]), f"{any_r['heads_q']}/{any_r['heads_kv']}", str(any_r["batch"]),
                str(any_r["seqlen_q"]), str(any_r["seqlen_k"]), mask]
        line += [_fmt(value(cells[p])) if p in cells else "-" for p in providers]
        if ratios:
            line.append(any_r["best_peer"] or "-")
        line += [f"{cells[o]['ratio_to_best_peer']:.2f}x" if o in cells and cells[o]["ratio_to_best_peer"]
                 else "-" for o in ours]
        lines.append("| " + " | ".join(line) + " |")
    return lines


def markdown(records: list[dict], skips: list, env: dict, plots: list[Path], run_dir: Path,
             title: str) -> str:
    lines = [f"# {title}", "",
             f"GPU: **{env.get('gpu')}**" + (f" (driver {env['driver']})" if env.get("driver") else "") +
             f"; {_versions(env)}; "
             f"kernels {env.get('kernels')}; our build `{env.get('kernel_build')}`; "
             f"git `{env.get('git_sha')}`; {env.get('date')}.", ""]
    if str(env.get("gpu", "")).startswith("none"):
        lines += ["**No GPU**: a tiny CPU grid that checks the pipeline. GPU numbers need a GPU.", ""]
    lines += ["Raw data: [results.json](results.json), [results.csv](results.csv).", ""]
    for grid in dict.fromkeys(r["grid"] for r in records):
        lines += [f"## {grid}", ""]
        for mode in MODE_TITLES:
            rows = [r for r in records if r["grid"] == grid and r["mode"] == mode]
            if not rows:
                continue
            providers = sorted({r["provider"] for r in rows}, key=lambda p: (not p.startswith("ours"), p))
            ours = [p for p in providers if p.startswith("ours")]
            lines += [f"### {MODE_TITLES[mode]}: TFLOP/s (median)", ""]
            lines += _table(rows, lambda r: r["tflops"], providers, ours) + [""]
            if grid == "decode":
                lines += [f"### {MODE_TITLES[mode]}: GB/s (median)", ""]
                lines += _table(rows, lambda r: r["gbps"], providers, ours) + [""]
            has_memory = any(r["peak_mem_bytes"] is not None for r in rows)
            if has_memory and (mode == "fwd_bwd" or (mode == "fwd" and grid == "decode")):
                lines += [f"### {MODE_TITLES[mode]}: peak memory (MiB)", ""]
                lines += _table(rows, lambda r: None if r["peak_mem_bytes"] is None else r["peak_mem_bytes"] / MiB,
                                providers, ours, ratios=False) + [""]
        for p in plots:
            if p.name.startswith(f"{grid}-"):
                lines += [f"![{p.stem}]({p.relative_to(run_dir).as_posix()})", ""]
    if skips:
        lines += ["## Skipped", "", "| provider | workloads | mode | reason |", "|---|---|---|---|"]
        grouped: dict[tuple, int] = {}
        for s in skips:
            s = s if isinstance(s, dict) else dataclasses.asdict(s)
            key = (s["provider"], s["mode"], s["reason"])
            grouped[key] = grouped.get(key, 0) + 1
        for (provider, mode, reason), n in grouped.items():
            reason = reason.replace("|", "/").replace("\n", " ")
            lines.append(f"| {provider} | {n} | {mode} | {reason} |")
        lines.append("")
    lines += ["## Method", "", NOTES]
    return "\n".join(lines)


def update_index(out_root: Path) -> Path:
    """``INDEX.md`` beside the runs: one line per run with its RESULTS.md."""
    runs = sorted((p for p in out_root.iterdir() if (p / "RESULTS.md").exists()), reverse=True)
    lines = ["# Benchmark runs", "", "Newest first. Each run's numbers come from one process on one machine.", ""]
    for run in runs:
        meta_path = run / "run.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        env = meta.get("env", {})
        lines.append(f"- [{run.name}]({run.name}/RESULTS.md): {env.get('gpu', '?')}, grids "
                     f"{', '.join(meta.get('grids', []))}, {env.get('date', '')}")
    path = out_root / "INDEX.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_run(run_dir: Path, records: list[dict], skips: list, env: dict, *, grids: list[str],
              append: bool = False) -> Path:
    """Everything for one run under ``run_dir``; returns the Markdown summary's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    skips = [s if isinstance(s, dict) else dataclasses.asdict(s) for s in skips]
    results_path = run_dir / "results.json"
    if append and results_path.exists():
        old = json.loads(results_path.read_text())
        records = merge(old, records)
        old_skips = json.loads((run_dir / "skipped.json").read_text()) if (run_dir / "skipped.json").exists() else []
        seen = {r["workload"] for r in records}
        skips = [s for s in old_skips if s["workload"] in seen or s["workload"] == "all"] + skips
        meta_path = run_dir / "run.json"
        if meta_path.exists():
            grids = list(dict.fromkeys(json.loads(meta_path.read_text()).get("grids", []) + grids))
    from .runner import add_ratios
    records = add_ratios(records)
    write_json(results_path, records)
    write_csv(run_dir / "results.csv", records)
    write_json(run_dir / "skipped.json", skips)
    write_json(run_dir / "run.json", {"grids": grids, "env": env})
    plots = plot(run_dir, records, env) if records else []
    md = markdown(records, skips, env, plots, run_dir, f"Attention benchmark: {run_dir.name}")
    path = run_dir / "RESULTS.md"
    path.write_text(md)
    update_index(run_dir.parent)
    return path
