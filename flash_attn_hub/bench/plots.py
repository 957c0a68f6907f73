"""PNG plots of a run: one figure per (grid, head dim), a row of panels per head shape (and
sequence shape: Sq != Sk, a packed mix), a panel per (mask and softcap, mode), TFLOP/s against
the key sequence length with a line per provider (bars where a row has one length only, e.g. a
packed batch). GPU and versions are in every title. KV-cache steps are tables only (``markdown.py``):
their measure is bandwidth per cache layout and batch, not TFLOP/s against a length."""

from __future__ import annotations

from pathlib import Path

from .env import cudnn_version

MODE_TITLES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}


def versions(env: dict) -> str:
    """``torch 2.11.0+cu130, CUDA 13.0, cuDNN 9.19.0, triton 3.6.0`` (known fields only)."""
    cudnn = env.get("cudnn")
    if str(cudnn).isdigit():  # cuDNN's integer encoding
        cudnn = cudnn_version(int(cudnn))
    parts = [f"torch {env.get('torch')}", f"CUDA {env.get('cuda')}", f"cuDNN {cudnn}", f"triton {env.get('triton')}"]
    return ", ".join(p for p in parts if not p.endswith("None"))


def _shape(r: dict) -> str:
    """The row a record belongs to within its (grid, head dim) figure, besides its heads."""
    if r["varlen"]:
        return "varlen" + (f" {r['mix']}" if r.get("mix") else "")
    return "" if r["seqlen_q"] == r["seqlen_k"] else f"Sq={r['seqlen_q']}"


def _mask(r: dict) -> tuple[bool, int, float]:
    return r["causal"], r["window_left"], r.get("softcap") or 0.0  # no softcap column on older pages


def _mask_title(mask: tuple[bool, int, float]) -> str:
    causal, left, softcap = mask
    return (("causal" if causal else "non-causal") + (f", window {left}" if left >= 0 else "")
            + (f", softcap {softcap:g}" if softcap else ""))


def plot(out_dir: Path, records: list[dict], env: dict) -> list[Path]:
    """One PNG per (grid, head dim) in ``out_dir``; returns their paths."""
    records = [r for r in records if not r.get("kv_cache")]
    if not records:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    figures: dict[tuple, list[dict]] = {}
    for r in records:
        figures.setdefault((r["grid"], r["head_dim"]), []).append(r)
    providers_all = sorted({r["provider"] for r in records}, key=lambda p: (not p.startswith("ours"), p))
    palette = plt.get_cmap("tab10").colors
    colors = {p: palette[i % len(palette)] for i, p in enumerate(providers_all)}
    paths = []
    for (grid, d), rows in figures.items():
        shapes = list(dict.fromkeys((r["heads_q"], r["heads_kv"], _shape(r)) for r in rows))
        columns = [(mask, mode) for mask in sorted({_mask(r) for r in rows})
                   for mode in MODE_TITLES if any(r["mode"] == mode and _mask(r) == mask for r in rows)]
        fig, axes = plt.subplots(len(shapes), len(columns), figsize=(4.2 * len(columns), 3.3 * len(shapes)),
                                 squeeze=False)
        for i, (hq, hkv, shape) in enumerate(shapes):
            for j, (mask, mode) in enumerate(columns):
                ax = axes[i][j]
                panel = [r for r in rows if (r["heads_q"], r["heads_kv"], _shape(r)) == (hq, hkv, shape)
                         and r["mode"] == mode and _mask(r) == mask]
                if not panel:  # e.g. a row measured causal only
                    ax.axis("off")
                    continue
                xs = sorted({r["seqlen_k"] for r in panel})
                providers = [p for p in providers_all if any(r["provider"] == p for r in panel)]
                for k, p in enumerate(providers):
                    pts = sorted((r["seqlen_k"], r["tflops"]) for r in panel if r["provider"] == p)
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
                    what = "longest document" if shape.startswith("varlen") else "keys"
                    ax.set_xlabel(f"{what}: {xs[0]}")
                ax.set_ylabel("TFLOP/s")
                ax.set_ylim(bottom=0)
                ax.grid(alpha=0.3)
                ax.set_title(f"Hq/Hkv={hq}/{hkv}{' ' + shape if shape else ''}: {MODE_TITLES[mode]}, "
                             f"{_mask_title(mask)}", fontsize=9)
                ax.legend(fontsize=7)
        fig.suptitle(f"{grid}: D={d}, {rows[0]['dtype']} | {env.get('gpu')} | {versions(env)}", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{grid}-d{d}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
