"""PNG plots of a run: TFLOP/s against the key sequence length, one figure per (grid, head
dim, heads), a panel per (mask, mode), a line per provider (bars where a family has one
length only, e.g. a packed batch). GPU and versions are in every title."""

from __future__ import annotations

from pathlib import Path

from .env import cudnn_version

MODE_TITLES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}


def versions(env: dict) -> str:
    """``torch 2.11.0+cu130, CUDA 13.0, cuDNN 9.19.0, triton 3.6.0`` (known fields only)."""
    cudnn = env.get("cudnn")
    if str(cudnn).isdigit():  # runs before cuDNN versions were written as x.y.z
        cudnn = cudnn_version(int(cudnn))
    parts = [f"torch {env.get('torch')}", f"CUDA {env.get('cuda')}", f"cuDNN {cudnn}", f"triton {env.get('triton')}"]
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
        if r["varlen"]:
            shape = "varlen" + (f"-{r['mix']}" if r.get("mix") else "")
        else:
            shape = "" if r["seqlen_q"] == r["seqlen_k"] else f"sq{r['seqlen_q']}"
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
                    what = "packed batch, longest document" if shape.startswith("varlen") else "sequence length"
                    ax.set_xlabel(f"{what} (keys): {xs[0] if xs else ''}")
                ax.set_ylabel("TFLOP/s")
                ax.set_ylim(bottom=0)
                ax.grid(alpha=0.3)
                mask = ("causal" if causal else "non-causal") + (f", window {left}" if left >= 0 else "")
                ax.set_title(f"{MODE_TITLES[mode]}, {mask}", fontsize=10)
                if panel:
                    ax.legend(fontsize=7)
        dtype = rows[0]["dtype"]
        if shape.startswith("varlen"):
            what = ", packed varlen" + (f" ({shape[7:]} lengths)" if shape != "varlen" else "")
        else:
            what = f", Sq={shape[2:]}" if shape else ""
        fig.suptitle(f"{grid}: D={d}, Hq/Hkv={hq}/{hkv}{what}, {dtype} | {env.get('gpu')} | {versions(env)}",
                     fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{grid}-d{d}-h{hq}-{hkv}{'-' + shape if shape else ''}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
