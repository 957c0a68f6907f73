"""The candidate search shared by ``python -m flash_attn_hub tune fwd`` and ``tune bwd`` (GPU only).

A kernel's module (``fwd.py``, ``bwd.py``) describes its kernel (the package modules, the config
dataclass, candidate values per config field, a correctness check and the timed problems); this
module does the rest: command line, search, timing, the long-format log, the tuning file and the
summary table.

Search: ``--quick`` walks the fields one at a time from the table's default (coordinate descent:
each field takes its best value before the next is tried, so the cost is the sum of the value
counts, not their product), then tries every combination of each pair of fields a kernel names
as coupled (warps with the tile they split: one alone can lose where both together win; the
H200's 4-warp, 64-key dK/dV tiles were missed that way). It repeats both passes from the new
best until a round changes nothing (at most ``QUICK_ROUNDS``): a field settled early is tried
again once the others have moved (the D=192 forward's first round settled ``tma`` at 2 stages
and kept it at 3 stages untimed). Timed configs are cached, so a repeat costs only the new
neighbours. Unless told otherwise it tunes only D=128 at S=4096, the anchor configuration.
Without ``--quick`` every combination of the candidate values is timed.

Timing and counting are the benchmark's (``bench.timing``, ``bench.workloads``): the median of
``triton.testing.do_bench``, bf16, fresh random inputs, 16k tokens per batch, FLOPs by the one
rule. A candidate's score is the geometric mean of its TFLOP/s over the timed problems (causal
and non-causal). A candidate is first checked against the float64 oracle; one that fails, or
does not compile (shared memory, registers), is reported and skipped.

Our package is loaded from a local build, the way users load it (``kernels``); the tuned
entries go to the source tree's table (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import math
import sys
import types
from pathlib import Path
from typing import Callable

import torch

from .. import REPO_ROOT
from ..bench.timing import Timing, median_ms
from ..bench.workloads import TOKENS_PER_BATCH, Workload, attention_flops

SOURCE_PACKAGE = REPO_ROOT / "torch-ext" / "flash_attn"


def load(kernel_dir: Path | None, *names: str) -> tuple[types.ModuleType, list[types.ModuleType]]:
    """Our package loaded from a local build (``kernel_dir``, else this repository's build/,
    built when missing) and its submodules ``names``."""
    from ..bench import load_local_kernel

    package = load_local_kernel(kernel_dir)
    return package, [importlib.import_module(f"{package.__name__}.{name}") for name in names]


def source_path(package: types.ModuleType, path: Path) -> Path:
    """The source tree's counterpart of ``path``, a file of the loaded ``package`` (the tuning
    file a table reads: tuning writes the source, which the next build ships)."""
    root = Path(package.__file__).resolve().parent
    return SOURCE_PACKAGE / Path(path).resolve().relative_to(root)


def add_arguments(parser: argparse.ArgumentParser, head_dims: list[int]) -> None:
    """The command line of ``tune fwd`` / ``tune bwd``."""
    parser.add_argument("--heads", type=_parse_heads, nargs="+", default=None,
                        help="query/kv head counts of the timed shapes, e.g. 16/16 32/8")
    parser.add_argument("--head-dims", type=int, nargs="+", default=None,
                        help=f"default {' '.join(map(str, head_dims))}; with --quick 128")
    parser.add_argument("--seqlens", type=int, nargs="+", default=None,
                        help="sequence lengths, one tuning-file bucket each; default 1024 4096 "
                             "16384, with --quick 4096")
    parser.add_argument("--quick", action="store_true",
                        help="coordinate descent and coupled pairs instead of every "
                             "combination (minutes, not hours)")
    parser.add_argument("--out", type=Path, default=None,
                        help="tuning file to merge into (default: the source tree's, which the next build ships)")
    parser.add_argument("--log", type=Path, default=None,
                        help="also append every timed candidate to this JSON-lines file")
    parser.add_argument("--space", action="append", default=[], type=_parse_space, metavar="FIELD=V1,V2",
                        help="search only these fields, over these values (repeatable), e.g. "
                             "--space atomic_dq=0,1 --space dkdv_block_m=32,64")
    parser.add_argument("--kernel-dir", type=Path, default=None,
                        help="the build to load (default: build/, built when missing)")


def finish_arguments(args: argparse.Namespace, head_dims: list[int]) -> argparse.Namespace:
    """Defaults that depend on ``--quick``; ``--space`` as a dict."""
    args.space = dict(args.space)
    args.head_dims = args.head_dims or ([128] if args.quick else head_dims)
    args.seqlens = args.seqlens or ([4096] if args.quick else [1024, 4096, 16384])
    return args


def _parse_heads(item: str) -> tuple[int, int]:
    hq, sep, hkv = item.partition("/")
    if not sep or not hq.isdigit() or not hkv.isdigit() or int(hq) % max(int(hkv), 1) or not int(hkv):
        raise argparse.ArgumentTypeError(f"expected HQ/HKV with HQ a multiple of HKV, got {item!r}")
    return int(hq), int(hkv)


def _parse_space(item: str) -> tuple[str, tuple]:
    field, _, values = item.partition("=")
    try:
        parsed = tuple(int(v) for v in values.split(","))
    except ValueError:
        parsed = ()
    if not field or not parsed:
        raise argparse.ArgumentTypeError(f"expected FIELD=V1,V2 with integer values, got {item!r}")
    return field, parsed


def narrow(space: dict[str, tuple], override: dict[str, tuple]) -> dict[str, tuple]:
    """``space`` as the command line narrows it: with ``--space`` given, only its fields that
    belong to this search, with its values (booleans as 0/1)."""
    if not override:
        return space
    return {field: tuple(bool(v) if isinstance(space[field][0], bool) else v for v in values)
            for field, values in override.items() if field in space}


def candidates(base, space: dict[str, tuple]) -> list:
    """Every combination of ``space`` (field -> values) applied to ``base``."""
    return [dataclasses.replace(base, **dict(zip(space, values)))
            for values in itertools.product(*space.values())]


QUICK_ROUNDS = 3  # rounds of the quick search at most (see the module docstring)


def search(base, space: dict[str, tuple], score: Callable, quick: bool,
           pairs: tuple[tuple[str, str], ...] = ()):
    """The best-scoring config: coordinate descent from ``base`` when ``quick`` followed by every
    combination of each coupled pair in ``pairs`` (fields of ``space`` only), repeated from the
    new best until a round changes nothing (``QUICK_ROUNDS`` at most), else exhaustive.
    ``score(config)`` returns a number or None (failed); ``base`` wins when nothing runs."""
    scored = {}

    def value(config):
        key = dataclasses.replace(config, reason="")
        if key not in scored:
            scored[key] = score(config)
        return scored[key]

    def best_of(best, options):
        results = [(value(c), c) for c in [best, *options]]
        results = [(s, c) for s, c in results if s is not None]
        return max(results, key=lambda sc: sc[0])[1] if results else best

    best = base
    if quick:
        for _ in range(QUICK_ROUNDS):
            start = best
            for field, values in space.items():
                best = best_of(best, [dataclasses.replace(best, **{field: v}) for v in values])
            for pair in pairs:
                if all(field in space for field in pair):
                    best = best_of(best, candidates(best, {field: space[field] for field in pair}))
            if best is start:
                break
        return best
    results = [(value(c), c) for c in [base, *candidates(base, space)]]
    results = [(s, c) for s, c in results if s is not None]
    return max(results, key=lambda sc: sc[0])[1] if results else base


def attn_params(params_cls, head_dim: int, causal: bool, seqlen: int):
    """The ``AttnParams`` of a timed workload: default scale, full or causal, no window,
    softcap or dropout, non-deterministic, Sq = Sk = ``seqlen``."""
    return params_cls(softmax_scale=head_dim ** -0.5, causal=causal, window_left=-1,
                      window_right=0 if causal else -1, softcap=0.0, dropout_p=0.0, seed=0,
                      deterministic=False, max_seqlen_q=seqlen, max_seqlen_k=seqlen)


@dataclasses.dataclass
class Timed:
    """One timed call: ``run(config)`` launches the kernels on ``workload`` in ``mode``."""
    label: str  # "full" | "causal", after the head shape when several are timed ("32/8 full")
    run: Callable
    workload: Workload
    mode: str  # "fwd" | "bwd"

    @property
    def flops(self) -> float:
        return attention_flops(self.workload, self.mode)

    @property
    def shape(self) -> dict:
        w = self.workload
        return dict(head_dim=w.head_dim, heads=[w.heads_q, w.heads_kv], batch=w.batch, seqlen=w.seqlen_q)


def tuning_workload(batch: int, seqlen: int, heads: tuple[int, int], head_dim: int, causal: bool) -> Workload:
    return Workload("tune", batch, seqlen, seqlen, heads[0], heads[1], head_dim, causal)


def batch_for(seqlen: int) -> int:
    """16k tokens per batch, as the benchmark's grids."""
    return max(1, TOKENS_PER_BATCH // seqlen)


def head_shape_problems(shapes, problem: Callable, *, seqlen: int, head_dim: int, mode: str) -> list[Timed]:
    """The non-causal and the causal problem of each ``(hq, hkv)`` in ``shapes`` (a config is
    scored over all of them), 16k tokens per batch; ``problem(heads, causal)`` builds the object
    whose ``run(config)`` is timed. With several shapes each label names its heads
    (``32/8 causal``)."""
    batch = batch_for(seqlen)
    timed = []
    for heads in shapes:
        for causal in (False, True):
            label = "causal" if causal else "full"
            timed.append(Timed(label if len(shapes) == 1 else f"{heads[0]}/{heads[1]} {label}",
                               problem(heads, causal).run,
                               tuning_workload(batch, seqlen, heads, head_dim, causal), mode))
    return timed


def short(config) -> str:
    """A config without its reason, compact: ``block_m=128 block_n=64 ...``."""
    fields = dataclasses.asdict(config)
    fields.pop("reason", None)
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in fields.items())


class Session:
    """Timing, logging and the tuning file of one tuning run."""

    def __init__(self, tuning, table, out: Path, log: Path | None = None):
        import triton

        self.tuning, self.table, self.out, self.log = tuning, table, out, log
        self.gpu = torch.cuda.get_device_name()
        self.versions = f"torch {torch.__version__}, triton {triton.__version__}"
        self.entries: list[dict] = []
        self.summary: list[tuple] = []

    def measure(self, config, check: Callable, problems: list[Timed], tag: str = ""):
        """``(geo-mean TFLOP/s, {label: TFLOP/s})`` of ``config``, or None if it fails."""
        name = f"{tag} {short(config)}".strip()
        try:
            if not check(config):
                print(f"{name}: WRONG RESULT, skipped", flush=True)
                return None
            rates = {}
            for work in problems:
                ms = median_ms(lambda: work.run(config), device="cuda", timing=Timing())
                rates[work.label] = work.flops / ms * 1e-9
                if self.log:
                    with self.log.open("a") as log:
                        log.write(json.dumps(dict(
                            provider="ours-triton", mode=work.mode, config=short(config),
                            mask=work.label, ms=ms, tflops=rates[work.label], gpu=self.gpu,
                            versions=self.versions, **work.shape)) + "\n")
        except Exception as err:  # out of shared memory / registers: not a candidate
            print(f"{name}: failed ({type(err).__name__}: {err})"[:240], flush=True)
            return None
        score = math.exp(sum(math.log(r) for r in rates.values()) / len(rates))
        print(f"{name}: " + " / ".join(f"{r:.0f}" for r in rates.values())
              + f" TFLOP/s ({' / '.join(rates)})", flush=True)
        return score, rates

    def scorer(self, check: Callable, problems: list[Timed], tag: str):
        """``(score, results)``: ``score(config)`` measures a config once (``results`` keeps
        each :meth:`measure` by :func:`short`) and returns its geo-mean, None if it failed."""
        results = {}

        def score(config):
            key = short(config)
            if key not in results:
                results[key] = self.measure(config, check, problems, tag)
            return results[key] and results[key][0]
        return score, results

    def record(self, *, block_d: int, seqlen: int, shape: str, best, default, results: dict,
               tag: str, default_label: str = "table default"):
        """Keep ``best`` for (this GPU, block_d, bucket of seqlen) with its measured reason;
        ``default`` is the config the search started from (the in-code table's, or what
        ``default_label`` names), ``results`` the :meth:`scorer`'s."""
        result, default_result = results.get(short(best)), results.get(short(default))
        if result is None:
            print(f"{tag}: no candidate ran", file=sys.stderr)
            return
        score, rates = result
        versus = ""
        if default_result and short(best) != short(default):
            versus = f"; {default_label} {short(default)}: {default_result[0]:.0f}"
        reason = (f"measured on {self.gpu} ({self.versions}): bf16 {shape}, "
                  + ", ".join(f"{lab} {r:.0f}" for lab, r in rates.items())
                  + f" TFLOP/s, geo-mean {score:.0f}{versus}")
        bucket = self.tuning.seqlen_bucket(seqlen)
        config = dataclasses.replace(best, reason=reason)
        self.entries.append(self.tuning.entry_of(config, gpu=self.gpu, block_d=block_d,
                                                 bucket=bucket))
        base = default_result[0] if default_result else float("nan")
        self.summary.append((block_d, seqlen, short(best), rates, score, base))

    def finish(self) -> int:
        if self.entries:
            self.tuning.write_entries(self.out, self.table.kernel, self.entries)
            print(f"wrote {len(self.entries)} entries to {self.out}")
        print(f"\n{self.table.kernel} on {self.gpu}: TFLOP/s of the best config "
              "(geo-mean vs the table default)")
        print(f"{'D':>4} {'S':>6}  {'full':>5} {'causal':>6} {'geo':>5} {'default':>7} "
              f"{'gain':>5}  config")
        for block_d, seqlen, config, rates, score, base in self.summary:
            gain = score / base if base == base else float("nan")
            print(f"{block_d:>4} {seqlen:>6}  {_geo_mean(rates, 'full'):>5.0f} "
                  f"{_geo_mean(rates, 'causal'):>6.0f} {score:>5.0f} {base:>7.0f} {gain:>5.2f}x  "
                  f"{config}")
        return 0 if self.entries else 1


def _geo_mean(rates: dict[str, float], mask: str) -> float:
    """Geo-mean of the rates whose label is ``mask`` or ends with it (``"16/16 full"``)."""
    picked = [r for label, r in rates.items() if label.split()[-1] == mask]
    return math.exp(sum(math.log(r) for r in picked) / len(picked)) if picked else 0.0


def hopper_fields(*names: str) -> dict[str, tuple]:
    """``{name: (False, True)}`` on sm90 or newer (tensor descriptors), else nothing."""
    return {n: (False, True) for n in names} if torch.cuda.get_device_capability()[0] >= 9 \
        else {}


def blackwell_fields(*names: str) -> dict[str, tuple]:
    """``{name: (False, True)}`` on sm100 or newer, else nothing."""
    return {n: (False, True) for n in names} if torch.cuda.get_device_capability()[0] >= 10 \
        else {}


def require_gpu(command: str) -> bool:
    if torch.cuda.is_available():
        return True
    print(f"{command} needs a CUDA GPU", file=sys.stderr)
    return False
