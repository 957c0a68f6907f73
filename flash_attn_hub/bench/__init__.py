"""``python -m flash_attn_hub bench``: our kernel against the peers (SDPA flash / cuDNN /
mem-efficient, FlexAttention, flash-attn 2 and 3 when installed), measured in one process,
verified against ``tests/reference.py`` first, written to ``benchmarks/results/<run>/``.

Our package is loaded the way users load it, through ``kernels``: a local build
(``--kernel-dir``, default ``build/``, built with ``build_variant`` when missing) or a Hub
repository (``--repo-id`` with ``--version``/``--revision``, ``--endpoint`` for a
Hub-compatible server). Without a GPU it runs a tiny CPU grid (our CPU backend against
SDPA's math backend): a check of the pipeline, not a measurement of the kernels.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
from pathlib import Path

from .. import DEFAULT_REPO_ID, REPO_ROOT
from .workloads import GPU_GRIDS, MODES


def _ints(text: str) -> list[int]:
    """'512,1k,16k' -> [512, 1024, 16384]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)([kK]?)", part)
        if not m:
            raise argparse.ArgumentTypeError(f"expected integers like 512,1k,16k, got {part!r}")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return out


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark our attention against the peers",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="standard", choices=[*GPU_GRIDS, "all"],
                   help="workloads (default: standard; without a GPU the tiny CPU grid runs)")
    p.add_argument("--providers", type=_csv, default=None,
                   help="comma-separated, e.g. ours-cuda,ours-triton,sdpa-cudnn,flex "
                        "(default: all that run on this device)")
    p.add_argument("--modes", type=_csv, default=list(MODES), help="subset of fwd,bwd,fwd_bwd")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results",
                   help="results root; the run goes to OUT/RUN_NAME/")
    p.add_argument("--run-name", default=None, help="default: <date>-<gpu>-<grid>")
    p.add_argument("--append", action="store_true",
                   help="add to an existing run (re-measured workloads are replaced whole)")
    p.add_argument("--seqlens", type=_ints, default=None, help="only these key lengths, e.g. 1k,4k")
    p.add_argument("--head-dims", type=_ints, default=None, help="only these head dims, e.g. 64,128")
    p.add_argument("--match", default=None, help="only workloads whose name matches this regular expression")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--no-progress", action="store_true")
    src = p.add_argument_group("our kernel (loaded through kernels)")
    src.add_argument("--kernel-dir", type=Path, default=None,
                     help="a build directory (or a repository holding build/) for get_local_kernel")
    src.add_argument("--repo-id", default=None, help=f"load from a Hub, e.g. {DEFAULT_REPO_ID}")
    src.add_argument("--version", type=int, default=None, help="with --repo-id: branch v<N>")
    src.add_argument("--revision", default=None, help="with --repo-id: branch, tag or commit")
    src.add_argument("--endpoint", default=None, help="with --repo-id: Hub-compatible server URL")
    p.set_defaults(func=run)


def _set_endpoint(url: str) -> None:
    """Point huggingface_hub at ``url``, also when it was imported already."""
    os.environ["HF_ENDPOINT"] = url.rstrip("/")
    import huggingface_hub.constants as constants
    constants.ENDPOINT = url.rstrip("/")
    constants.HUGGINGFACE_CO_URL_TEMPLATE = constants.ENDPOINT + "/{repo_id}/resolve/{revision}/{filename}"


def load_ours(args):
    """Our package as users get it; returns (module, None) or (None, reason)."""
    try:
        import kernels
        if args.repo_id:
            if args.endpoint:
                _set_endpoint(args.endpoint)
            if (args.version is None) == (args.revision is None):
                return None, "--repo-id needs exactly one of --version / --revision"
            module = kernels.get_kernel(args.repo_id, version=args.version, revision=args.revision,
                                        trust_remote_code=True)
        else:
            path = args.kernel_dir.resolve() if args.kernel_dir else REPO_ROOT / "build"
            if args.kernel_dir is None and not path.is_dir():
                from ..build import build_variant
                print(f"no build in {path}: building the variant for this machine", flush=True)
                build_variant(path)
            module = kernels.get_local_kernel(path)
    except Exception as err:  # reported, and our providers are skipped
        return None, f"{type(err).__name__}: {err}"
    print(f"our kernel: {module.__name__} from {Path(module.__file__).parent}", flush=True)
    return module, None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


def run(args) -> int:
    import torch

    from .providers import CPU_DEFAULT, GPU_DEFAULT, make_providers
    from .report import write_run
    from .runner import Timing, run_suite
    from .workloads import grid_workloads

    bad = [m for m in args.modes if m not in MODES]
    if bad:
        print(f"--modes: {bad} not in {list(MODES)}")
        return 2
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    grid = args.grid
    if not cuda:
        print("No CUDA GPU here: running the tiny CPU grid (our CPU backend against SDPA math on CPU). "
              "It checks the benchmark pipeline; GPU numbers need a GPU.", flush=True)
        grid = "cpu"
    names = args.providers or list(GPU_DEFAULT if cuda else CPU_DEFAULT)
    try:
        workloads = grid_workloads(grid, seqlens=args.seqlens, head_dims=args.head_dims, match=args.match)
        providers = make_providers(names, None)
    except ValueError as err:
        print(err)
        return 2
    if not workloads:
        print(f"--seqlens/--head-dims/--match leave no workload in grid {grid!r}")
        return 2
    ours, reason = (None, None)
    if any(n.startswith("ours-") for n in names):
        ours, reason = load_ours(args)
        if reason:
            print(f"could not load our kernel: {reason}", flush=True)
        providers = make_providers(names, ours, reason)
    timing = Timing(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    records, skips, env = run_suite(workloads, providers, args.modes, device=device, dtype_name=args.dtype,
                                    timing=timing, ours_module=ours, progress=not args.no_progress)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    run_name = args.run_name or f"{stamp}-{_slug(env['gpu'] if cuda else 'cpu')}-{grid}"
    summary = write_run(args.out / run_name, records, skips, env, grids=[grid], append=args.append)
    print(f"{len(records)} measurements, {len(skips)} skips -> {summary}", flush=True)
    for r in records:
        if r["provider"].startswith("ours") and r["ratio_to_best_peer"] is not None:
            print(f"  {r['provider']:12s} {r['workload']:48s} {r['mode']:8s} {r['tflops']:8.3g} TFLOP/s "
                  f"{r['ratio_to_best_peer']:.2f}x {r['best_peer']}")
    return 0 if records else 1
