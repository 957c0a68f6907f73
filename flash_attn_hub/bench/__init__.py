"""``python -m flash_attn_hub bench``: our kernel against the peers (SDPA flash / cuDNN /
mem-efficient, FlexAttention, flash-attn 2 and 3 when installed), measured in one process,
verified against ``flash_attn_hub.reference`` first, written to ``benchmarks/results/<run>/``.

    python -m flash_attn_hub bench --grid all              # every table and plot (GPU)
    python -m flash_attn_hub bench --grid all --dry-run    # the estimate, split into commands
    python -m flash_attn_hub bench --grid gqa --seqlens 4k --modes bwd --providers ours-triton,sdpa-flash
    python -m flash_attn_hub bench merge OUT1/bench.tgz OUT2/bench --into benchmarks/results/NAME

Our package is loaded the way users load it, through ``kernels``: a local build
(``--kernel-dir``, default ``build/``, built with ``build_variant`` when missing) or a Hub
repository (``--repo-id`` with ``--version``/``--revision``, ``--endpoint`` for a
Hub-compatible server). Without a GPU it runs a tiny CPU grid (our CPU backend against
SDPA's math backend): a check of the pipeline, not a measurement of the kernels.

A run saves its data after every workload, so a command stopped by a time limit keeps what
it finished; ``--budget-s`` stops cleanly before the estimate says the limit would be hit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import time
from pathlib import Path

from .. import DEFAULT_REPO_ID, REPO_ROOT
from .workloads import GRIDS, MODES

RESULTS_ROOT = REPO_ROOT / "benchmarks" / "results"
SPLIT_S = 480.0  # one command on the GPU machine may run ~9 minutes; keep a margin for set-up


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
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--grid", default="standard",
                   help=f"workload grids, comma-separated: {', '.join(g for g in GRIDS if g != 'cpu')}, or all "
                        "(= every grid but small; default: standard; without a GPU the tiny CPU grid runs)")
    p.add_argument("--providers", type=_csv, default=None,
                   help="comma-separated, e.g. ours-cuda,ours-triton,sdpa-cudnn,flex "
                        "(default: all that run on this device)")
    p.add_argument("--modes", type=_csv, default=list(MODES), help="subset of fwd,bwd,fwd_bwd")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--out", type=Path, default=RESULTS_ROOT, help="results root; the run goes to OUT/RUN_NAME/")
    p.add_argument("--run-name", default=None, help="default: <date>-<gpu>-<grid>")
    p.add_argument("--append", action="store_true",
                   help="add to an existing run (re-measured workloads are replaced whole)")
    p.add_argument("--allow-mixed", action="store_true",
                   help="with --append: accept a run measured on another GPU or software version")
    p.add_argument("--seqlens", type=_ints, default=None, help="only these key lengths, e.g. 1k,4k")
    p.add_argument("--head-dims", type=_ints, default=None, help="only these head dims, e.g. 64,128")
    p.add_argument("--match", default=None, help="only workloads whose name matches this regular expression")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--dry-run", action="store_true",
                   help="print the workloads, the H200 estimate and a split into commands of at most "
                        "--split-s seconds; measure nothing")
    p.add_argument("--split-s", type=float, default=SPLIT_S, help=f"with --dry-run (default {SPLIT_S:.0f})")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop before a workload the estimate says would end past this many seconds")
    src = p.add_argument_group("our kernel (loaded through kernels)")
    src.add_argument("--kernel-dir", type=Path, default=None,
                     help="a build directory (or a repository holding build/) for get_local_kernel")
    src.add_argument("--repo-id", default=None, help=f"load from a Hub, e.g. {DEFAULT_REPO_ID}")
    src.add_argument("--version", type=int, default=None, help="with --repo-id: branch v<N>")
    src.add_argument("--revision", default=None, help="with --repo-id: branch, tag or commit")
    src.add_argument("--endpoint", default=None, help="with --repo-id: Hub-compatible server URL")
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="bench_command", metavar="{merge,index}")
    m = sub.add_parser("merge", help="combine runs (folders or GPU-machine archives) into one run folder",
                       description="Combine runs into one folder, oldest first: a (workload, mode) measured "
                                   "again replaces the older numbers whole. Redraws plots, RESULTS.md, INDEX.md.")
    m.add_argument("sources", nargs="+", type=Path,
                   help="run folders, folders holding runs, or .tgz archives of them")
    m.add_argument("--into", type=Path, required=True,
                   help="the merged run folder (its own results, if any, are merged too)")
    m.add_argument("--allow-mixed", action="store_true", help="accept runs from different GPUs or software")
    m.set_defaults(func=run_merge)
    i = sub.add_parser("index", help="rewrite INDEX.md of a results root")
    i.add_argument("--out", type=Path, default=RESULTS_ROOT)
    i.set_defaults(func=run_index)


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


def _filters(args, *, grid: str | None = None, head_dims=None, seqlens=None) -> list[str]:
    """The bench arguments that choose what is measured (recorded in run.json, printed by
    --dry-run); ``head_dims`` / ``seqlens`` replace the user's filters when given."""
    out = ["--grid", grid or args.grid]
    head_dims, seqlens = head_dims or args.head_dims, seqlens or args.seqlens
    if head_dims:
        out += ["--head-dims", ",".join(map(str, head_dims))]
    if seqlens:
        out += ["--seqlens", ",".join(f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in seqlens)]
    if args.match:
        out += ["--match", repr(args.match)]
    if list(args.modes) != list(MODES):
        out += ["--modes", ",".join(args.modes)]
    if args.providers:
        out += ["--providers", ",".join(args.providers)]
    if args.dtype != "bf16":
        out += ["--dtype", args.dtype]
    if (args.warmup_ms, args.rep_ms) != (25.0, 100.0):
        out += ["--warmup-ms", f"{args.warmup_ms:g}", "--rep-ms", f"{args.rep_ms:g}"]
    return out


def dry_run(args, workloads, names) -> int:
    """The plan of a GPU run: workloads per grid, the H200 estimate, and commands that each fit
    ``--split-s`` (their run folders are combined with ``bench merge``)."""
    from . import plan
    from .providers import FlashAttnPackage, make_providers

    providers = make_providers(names, None)
    counted = [p for p in providers if not (isinstance(p, FlashAttnPackage) and p.unavailable())]
    left = [p.name for p in providers if p not in counted]
    cost = {w.name: plan.workload_s(w, counted, args.modes, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
            for w in workloads}
    print(f"providers counted: {', '.join(p.name for p in counted)}"
          + (f" (not counted, not importable here: {', '.join(left)})" if left else ""))
    for grid in dict.fromkeys(w.grid for w in workloads):
        ws = [w for w in workloads if w.grid == grid]
        print(f"grid {grid}: {len(ws)} workloads, ~{sum(cost[w.name] for w in ws) / 60:.1f} min")
        for w in ws:
            print(f"  {w.name:56s} ~{cost[w.name]:.0f} s")
    total = sum(cost.values())
    print(f"total: {len(workloads)} workloads, modes {','.join(args.modes)}, ~{total / 60:.1f} min on an H200 "
          f"(cost model in flash_attn_hub/bench/plan.py)")
    chunks = plan.split(workloads, cost, args.split_s)
    print(f"as commands of at most ~{args.split_s / 60:.1f} min each (--split-s {args.split_s:g}):")
    for c in chunks:
        over = "  (over the limit: cannot be split further)" if c.seconds > args.split_s else ""
        cmd = " ".join(["python -m flash_attn_hub bench",
                        *_filters(args, grid=",".join(c.grids), head_dims=c.head_dims, seqlens=c.seqlens)])
        print(f"  {cmd}   # {len(c.workloads)} workloads, ~{c.seconds / 60:.1f} min{over}")
    print("then: python -m flash_attn_hub bench merge <each command's run folder or bench.tgz> "
          "--into benchmarks/results/<name>")
    return 0


def run(args) -> int:
    import torch

    from . import plan
    from .env import environment, git_sha
    from .providers import CPU_DEFAULT, GPU_DEFAULT, make_providers
    from .report import Run, combine, load_run, mismatches, skip_dict, write_data, write_run
    from .runner import Timing, available, run_suite
    from .workloads import grid_names, grid_workloads

    bad = [m for m in args.modes if m not in MODES]
    if bad:
        print(f"--modes: {bad} not in {list(MODES)}")
        return 2
    try:
        grids = grid_names(args.grid)
    except ValueError as err:
        print(err)
        return 2
    cuda = torch.cuda.is_available()
    plan_for_gpu = cuda or args.dry_run
    if not plan_for_gpu:
        print(f"No CUDA GPU here: instead of --grid {args.grid}, the tiny CPU grid runs (our CPU backend against "
              "SDPA math on CPU). It checks the benchmark pipeline; GPU numbers need a GPU.", flush=True)
        grids = ["cpu"]
    names = args.providers or list(GPU_DEFAULT if plan_for_gpu else CPU_DEFAULT)
    try:
        workloads = grid_workloads(grids, seqlens=args.seqlens, head_dims=args.head_dims, match=args.match)
        make_providers(names, None)
    except ValueError as err:
        print(err)
        return 2
    if not workloads:
        print(f"--seqlens/--head-dims/--match leave no workload in grid {','.join(grids)!r}")
        return 2
    if args.dry_run:
        return dry_run(args, workloads, names)

    device = torch.device("cuda" if cuda else "cpu")
    label = args.grid.replace(",", "-") if cuda else "cpu"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    gpu_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    run_dir = args.out / (args.run_name or f"{stamp}-{_slug(gpu_name)}-{label}")
    if (run_dir / "results.json").exists() and not args.append:
        print(f"{run_dir} holds a run already: --append adds to it, --run-name picks another folder")
        return 2
    ours, reason = (None, None)
    if any(n.startswith("ours-") for n in names):
        ours, reason = load_ours(args)
        if reason:  # measuring only the peers would spend the GPU time on numbers we have
            print(f"could not load our kernel: {reason}; fix that, or leave ours-* out of --providers",
                  flush=True)
            return 2
    providers = make_providers(names, ours, reason, explicit=args.providers is not None)
    sha, source = git_sha()
    print(f"git_sha {sha} ({source})", flush=True)
    env = environment(device, ours, sha)
    base = load_run(run_dir) if args.append and (run_dir / "results.json").exists() else Run()
    part = {"argv": ["bench", *_filters(args, grid=args.grid if cuda else "cpu")], "grids": grids, "env": env,
            "seconds": {}, "not_run": [], "elapsed_s": None, "estimate_s": None}
    clash = mismatches(base.parts + [part])
    if clash and not args.allow_mixed:
        print(f"{run_dir} was measured elsewhere ({clash}); --allow-mixed adds to it anyway")
        return 2
    usable, unavailable = available(providers, device)
    cost = {w.name: plan.workload_s(w, usable, args.modes, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
            for w in workloads} if cuda else {}
    if cuda:
        part["estimate_s"] = round(sum(cost.values()))
        print(f"{len(workloads)} workloads x {len(usable)} providers ({', '.join(p.name for p in usable)}), "
              f"modes {','.join(args.modes)}: estimate ~{sum(cost.values()) / 60:.1f} min on an H200", flush=True)
        if sum(cost.values()) > SPLIT_S and args.budget_s is None:
            print("  longer than one command may run on the GPU machine: `--dry-run` prints a split into "
                  "commands to combine with `bench merge`; --budget-s stops cleanly", flush=True)
    start = time.perf_counter()

    def current(result) -> Run:
        part.update(seconds=dict(result.seconds), not_run=list(result.not_run),
                    elapsed_s=round(time.perf_counter() - start, 1))
        this = Run(result.records, [skip_dict(s) for s in unavailable + result.skips], [part])
        return combine([base, this], allow_mixed=True)

    def keep_going(w, elapsed: float) -> bool:
        return args.budget_s is None or elapsed + cost.get(w.name, 0.0) <= args.budget_s

    result = run_suite(workloads, usable, args.modes, device=device, dtype_name=args.dtype,
                       timing=Timing(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms), ours_module=ours,
                       progress=not args.no_progress, env=env,
                       on_workload=lambda r: write_data(run_dir, current(r)), keep_going=keep_going)
    summary = write_run(run_dir, current(result))
    print(f"{len(result.records)} measurements, {len(result.skips) + len(unavailable)} skips in "
          f"{part['elapsed_s'] / 60:.1f} min -> {summary}", flush=True)
    if result.not_run:
        names_re = "^(" + "|".join(re.escape(n) for n in result.not_run) + ")$"
        print(f"--budget-s {args.budget_s:g}: {len(result.not_run)} workloads not measured; measure them with "
              f"`--grid {args.grid} --match '{names_re}'` and combine with `bench merge`", flush=True)
    for r in result.records:
        if r["provider"].startswith("ours") and r["ratio_to_best_peer"] is not None:
            print(f"  {r['provider']:12s} {r['workload']:48s} {r['mode']:8s} {r['tflops']:8.3g} TFLOP/s "
                  f"{r['ratio_to_best_peer']:.2f}x {r['best_peer']}")
    if not cuda:
        print("CPU run: these numbers check the pipeline only; GPU numbers need a GPU.")
    return 0 if result.records else 1


def run_merge(args) -> int:
    from .report import MergeError, merge_sources
    try:
        path = merge_sources(args.sources, args.into, allow_mixed=args.allow_mixed)
    except MergeError as err:
        print(f"bench merge: {err}")
        return 2
    print(f"merged -> {path}")
    return 0


def run_index(args) -> int:
    from .report import update_index
    print(update_index(args.out))
    return 0
