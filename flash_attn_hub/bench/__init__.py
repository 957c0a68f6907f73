"""``python -m flash_attn_hub bench``: our kernel against the peers (SDPA cuDNN / flash,
FlexAttention, FlashAttention-4, flash-attn 2 / 3 when installed), measured in one process,
verified against ``flash_attn_hub.reference`` first, written as a results page.

    python -m flash_attn_hub bench --into benchmarks/                          # the release grid (GPU)
    python -m flash_attn_hub bench --into benchmarks/ --head-dims 64            # the same, one head
    python -m flash_attn_hub bench --into benchmarks/ --head-dims 128 --append  # dim per command
    python -m flash_attn_hub bench --into benchmarks/ --head-dims 256 --append
    python -m flash_attn_hub bench --into /tmp/b --grid varlen --modes fwd --providers ours-triton,flex
    python -m flash_attn_hub bench --into /tmp/kv --grid kvcache   # flash_attn_with_kvcache decode steps
    python -m flash_attn_hub bench --into /tmp/sc --grid softcap   # Gemma 2's logit soft-capping

The page (``report.py``): ``RESULTS.md``, ``results.csv`` and ``plots/*.png`` in ``--into``,
replacing what was there; ``--append`` adds to it instead, and ``--resume`` continues a command
stopped part way (by a machine's time limit, say) by leaving out the workloads already on the
page. The release page is
``benchmarks/``, with the GPU, torch, triton, cuDNN, FlashAttention-4 and git sha recorded in
it. The release grid is 30 workloads per head dim; with every provider, FlexAttention
compiling one graph per shape, that is several minutes per head dim on an H100 or H200
(estimated from earlier runs, 7-8), so a GPU machine that stops a command after 10 minutes
takes one command per head dim.

Our package is loaded the way users load it, through ``kernels``: a local build
(``--kernel-dir``, default ``build/``, built with ``build_variant`` when missing) or a Hub
repository (``--repo-id`` with ``--version``/``--revision``, ``--endpoint`` for a
Hub-compatible server). Without a GPU it runs a tiny CPU grid (our CPU backend against
SDPA's math backend; ``cpu-kvcache`` stands in for the kv-cache grids, ``cpu-softcap`` for
the softcap grid): a check of the pipeline, not a measurement of the kernels. The data is
saved after every workload, so a command stopped by a time limit keeps what it finished.

The kv-cache grid (``kvcache``; ``kvcache-quick`` is its corners) times decode steps of
``flash_attn_with_kvcache`` (paged and contiguous caches, multi-token decode) against SDPA
cuDNN / flash on the contiguous cache and FlashInfer's paged decode when installed, inside
CUDA graphs, with their GB/s against a device copy and the eager host time per call; see the
page's Method.

The softcap grid (``softcap``) is Gemma 2's attention with its logits capped at 50 (D=256 16/8
and D=128 32/16 heads, causal at 4k and 8k, a 4k window at 8k) against the peers that cap:
FlashAttention-4, FlexAttention (a ``score_mod``) and flash-attn 2 / 3; SDPA has no
soft-capping and is skipped there.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

from .. import DEFAULT_REPO_ID, REPO_ROOT
from .workloads import CPU_GRIDS, GRIDS, MODES

DEFAULT_MODES = ("fwd", "bwd")


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
    p.add_argument("--into", type=Path, required=True,
                   help="the results page's folder (the release's: benchmarks/); its RESULTS.md, results.csv "
                        "and plots/ are replaced")
    p.add_argument("--append", action="store_true",
                   help="add to the page in --into (same GPU and software) instead of replacing it; a "
                        "workload and mode measured again replaces the old numbers whole")
    p.add_argument("--resume", action="store_true",
                   help="continue the page in --into (implies --append; a new page where there is none): "
                        "the workloads it already has in every requested mode are left out, so a "
                        "command stopped by a time limit goes on where it stopped when run again")
    p.add_argument("--grid", default="main",
                   help=f"workload grids, comma-separated: {', '.join(g for g in GRIDS if g not in CPU_GRIDS)}, "
                        "or all (default: main, the release grid; without a GPU the tiny CPU grids run)")
    p.add_argument("--providers", type=_csv, default=None,
                   help="comma-separated, e.g. ours-cuda,ours-triton,fa4,sdpa-cudnn,flex,flashinfer "
                        "(flashinfer: kv-cache grids only; default: all that run on this device)")
    p.add_argument("--modes", type=_csv, default=list(DEFAULT_MODES),
                   help="subset of fwd,bwd,fwd_bwd (fwd_bwd: a training step's attention); default fwd,bwd")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
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


def load_local_kernel(kernel_dir: Path | None):
    """Our package from a local build, as ``kernels.get_local_kernel`` loads it: ``kernel_dir``
    (a build directory or a repository holding build/), or this repository's ``build/``,
    built for this machine when it is missing."""
    import kernels

    path = Path(kernel_dir).resolve() if kernel_dir else REPO_ROOT / "build"
    if kernel_dir is None and not path.is_dir():
        from ..build import build_variant
        print(f"no build in {path}: building the variant for this machine", flush=True)
        build_variant(path)
    return kernels.get_local_kernel(path)


def load_ours(args):
    """Our package as users get it; returns (module, None) or (None, reason)."""
    try:
        if args.repo_id:
            import kernels
            if args.endpoint:
                _set_endpoint(args.endpoint)
            if (args.version is None) == (args.revision is None):
                return None, "--repo-id needs exactly one of --version / --revision"
            module = kernels.get_kernel(args.repo_id, version=args.version, revision=args.revision,
                                        trust_remote_code=True)
        else:
            module = load_local_kernel(args.kernel_dir)
    except Exception as err:  # reported, and our providers are skipped
        return None, f"{type(err).__name__}: {err}"
    print(f"our kernel: {module.__name__} from {Path(module.__file__).parent}", flush=True)
    return module, None


def run(args) -> int:
    import torch

    from .env import environment, git_sha
    from .providers import CPU_DEFAULT, GPU_DEFAULT, make_providers
    from .report import RESULTS_CSV, PageError, clear_page, combine, load, mismatches, write_data, write_page
    from .runner import available, run_suite
    from .timing import Timing
    from .workloads import cpu_stand_ins, grid_names, grid_workloads

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
    if not cuda:
        grids = cpu_stand_ins(grids)
        print(f"No CUDA GPU here: instead of --grid {args.grid}, the tiny CPU grid runs ({','.join(grids)}: our "
              "CPU backend against SDPA math on CPU). It checks the benchmark pipeline; GPU numbers need a GPU.",
              flush=True)
        if "cpu-softcap" in grids:
            print("cpu-softcap: SDPA has no soft-capping, so ours is checked against the oracle there, without "
                  "a peer to compare with.", flush=True)
    names = args.providers or list(GPU_DEFAULT if cuda else CPU_DEFAULT)
    try:
        workloads = grid_workloads(grids, seqlens=args.seqlens, head_dims=args.head_dims, match=args.match)
        make_providers(names, None)
    except ValueError as err:
        print(err)
        return 2
    if not workloads:
        print(f"--seqlens/--head-dims/--match leave no workload in grid {','.join(grids)!r}")
        return 2
    old_records, old_skips = [], []
    if args.resume and (Path(args.into) / RESULTS_CSV).is_file():
        args.append = True
    if args.append:
        try:
            old_records, old_skips = load(args.into)
        except PageError as err:
            print(f"--append: {err}")
            return 2

    ours, reason = (None, None)
    if any(n.startswith("ours-") for n in names):
        ours, reason = load_ours(args)
        if reason:  # measuring only the peers would spend the GPU time on numbers we have
            print(f"could not load our kernel: {reason}; fix that, or leave ours-* out of --providers",
                  flush=True)
            return 2
    device = torch.device("cuda" if cuda else "cpu")
    sha, source = git_sha()
    print(f"git_sha {sha} ({source})", flush=True)
    env = environment(device, ours, sha)
    argv = getattr(args, "argv", None) or []
    env["command"] = "python -m flash_attn_hub bench " + " ".join(
        a for a in argv[1:] if a != "--no-progress") if argv[:1] == ["bench"] else None
    clash = mismatches(old_records, [env], names)
    if clash:
        print(f"--append: {args.into} was measured elsewhere ({clash}); measure the whole page here instead")
        return 2
    if args.resume:  # a workload's results are saved once all of its cells are measured
        done = {(r["workload"], r["mode"], r["dtype"]) for r in old_records}
        left = [w for w in workloads if not all((w.name, m, args.dtype) in done for m in args.modes)]
        print(f"--resume: {len(workloads) - len(left)} of {len(workloads)} workloads are on the page already",
              flush=True)
        workloads = left
        if not workloads:
            print(f"--resume: nothing left to measure -> {write_page(args.into, old_records, old_skips)}")
            return 0
    providers = make_providers(names, ours, reason, explicit=args.providers is not None)
    usable, unavailable = available(providers, device)
    if not args.append:
        clear_page(args.into)
    print(f"{len(workloads)} workloads x {len(usable)} providers ({', '.join(p.name for p in usable)}), "
          f"modes {','.join(args.modes)}", flush=True)
    start = time.perf_counter()

    def page(result):
        return combine(old_records, old_skips, result.records,
                       [{"provider": s.provider, "workload": s.workload, "mode": s.mode, "reason": s.reason}
                        for s in unavailable + result.skips])

    result = run_suite(workloads, usable, args.modes, device=device, dtype_name=args.dtype,
                       timing=Timing(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms), ours_module=ours,
                       progress=not args.no_progress, env=env,
                       on_workload=lambda r: write_data(args.into, *page(r)))
    summary = write_page(args.into, *page(result))
    print(f"{len(result.records)} measurements, {len(result.skips) + len(unavailable)} skips in "
          f"{(time.perf_counter() - start) / 60:.1f} min -> {summary}", flush=True)
    for r in result.records:
        if not r["provider"].startswith("ours"):
            continue
        ratio = f"{r['ratio_to_best_peer']:.2f}x {r['best_peer']}" if r["ratio_to_best_peer"] is not None else ""
        if r["kv_cache"]:  # memory-bound: device time and bandwidth against the copy
            print(f"  {r['provider']:12s} {r['workload']:48s} {r['ms_p50'] * 1e3:8.1f} us {r['gbps']:6.0f} GB/s "
                  f"{r['pct_copy'] or 0:4.0f}% copy {ratio}")
        elif ratio:
            print(f"  {r['provider']:12s} {r['workload']:48s} {r['mode']:8s} {r['tflops']:8.3g} TFLOP/s {ratio}")
    if not cuda:
        print("CPU run: these numbers check the pipeline only; GPU numbers need a GPU.")
    return 0 if result.records else 1
