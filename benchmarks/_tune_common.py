"""The candidate loop shared by tune_triton_fwd.py and tune_triton_bwd.py (GPU only).

A script describes its kernel (the package module, the config dataclass, candidate values per
config field, a correctness check and the timed workloads); this module does the rest: command
line, search, timing, the long-format log, the tuning file and the summary table.

Search: ``--quick`` walks the fields one at a time from the table's default (coordinate descent:
each field takes its best value before the next is tried, so the cost is the sum of the value
counts, not their product), then tries every combination of each pair of fields a script names
as coupled (warps with the tile they split: one alone can lose where both together win; the
H200's 4-warp, 64-key dK/dV tiles were missed that way). It repeats both passes from the new
best until a round changes nothing (at most ``QUICK_ROUNDS``): a field settled early is tried
again once the others have moved (the D=192 forward's first round settled ``tma`` at 2 stages
and kept it at 3 stages untimed). Timed configs are cached, so a repeat costs only the new
neighbours. Unless told otherwise it tunes only D=128 at S=4096, the anchor configuration.
Without ``--quick`` every combination of the candidate values is timed.

Timing: ``triton.testing.do_bench`` median after warm-up, bf16, fresh random inputs, 16k tokens
per batch (ANCHORS.md). A candidate's score is the geometric mean of its TFLOP/s over the
workloads (causal and non-causal). A candidate is first checked against the float64 reference;
one that fails, or does not compile (shared memory, registers), is reported and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import itertools
import json
import math
import os
import sys
import types
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "torch-ext" / "flash_attn"

TOKENS = 16384  # per batch: B = TOKENS // S (ANCHORS.md)


def load(*names: str, package: Path = PACKAGE,
         alias: str = "flash_attn_tune") -> list[types.ModuleType]:
    """Modules of the package straight from a source tree (no build, no ``_ops``): this
    repository's by default, or another copy of it (``package``) under its own ``alias``."""
    if alias not in sys.modules:
        module = types.ModuleType(alias)
        module.__path__ = [str(package)]
        sys.modules[alias] = module
    return [importlib.import_module(f"{alias}.{name}") for name in names]


def parse_args(doc: str, head_dims: list[int], *, heads: bool = False) -> argparse.Namespace:
    """The tuning scripts' command line; ``heads`` adds ``--heads HQ/HKV ...`` (the timed head
    shapes, parsed to ``[(hq, hkv), ...]``; None when not given)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if heads:
        parser.add_argument("--heads", type=_parse_heads, nargs="+", default=None,
                            help="query/kv head counts of the timed shapes, e.g. 16/16 32/8")
    parser.add_argument("--head-dims", type=int, nargs="+", default=None,
                        help=f"default {head_dims}; with --quick 128")
    parser.add_argument("--seqlens", type=int, nargs="+", default=None,
                        help="sequence lengths, one tuning-file bucket each; default 1024 4096 "
                             "16384, with --quick 4096")
    parser.add_argument("--quick", action="store_true",
                        help="coordinate descent and coupled pairs instead of every "
                             "combination (minutes, not hours)")
    parser.add_argument("--out", type=Path, default=None,
                        help="tuning file to merge into (default: the package's)")
    parser.add_argument("--space", action="append", default=[], metavar="FIELD=V1,V2",
                        help="search only these fields, over these values (repeatable), e.g. "
                             "--space atomic_dq=0,1 --space dkdv_block_m=32,64")
    args = parser.parse_args()
    args.space = dict(_parse_space(item) for item in args.space)
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
    if not field or not values:
        raise SystemExit(f"--space: expected FIELD=V1,V2, got {item!r}")
    return field, tuple(int(v) for v in values.split(","))


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
class Workload:
    """One timed call: ``run(config)`` launches the kernels, ``flops`` counts as ANCHORS.md."""
    label: str  # "full" | "causal", after the head shape when a script times several ("32/8 full")
    run: Callable
    flops: float
    shape: dict


def full_and_causal(problem: Callable, flops: float, shape: dict) -> list[Workload]:
    """The non-causal and the causal workload of one shape: ``problem(causal)`` builds the
    object whose ``run(config)`` is timed; ``flops`` is the non-causal count (causal: half)."""
    return [Workload("causal" if causal else "full", problem(causal).run,
                     flops / (2 if causal else 1), shape) for causal in (False, True)]


def head_shape_workloads(shapes, problem: Callable, flops: Callable, shape: Callable) -> list[Workload]:
    """:func:`full_and_causal` for each ``(hq, hkv)`` in ``shapes`` (a config is scored over
    all of them): ``problem(heads, causal)``, ``flops(heads)`` and ``shape(heads)`` as there.
    With several shapes each label names its heads, e.g. ``32/8 causal``."""
    workloads = []
    for heads in shapes:
        for w in full_and_causal(lambda causal: problem(heads, causal), flops(heads), shape(heads)):
            label = w.label if len(shapes) == 1 else f"{heads[0]}/{heads[1]} {w.label}"
            workloads.append(dataclasses.replace(w, label=label))
    return workloads


def short(config) -> str:
    """A config without its reason, compact: ``block_m=128 block_n=64 ...``."""
    fields = dataclasses.asdict(config)
    fields.pop("reason", None)
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in fields.items())


class Session:
    """Timing, logging and the tuning file of one script run."""

    def __init__(self, script: str, tuning, table):
        import triton
        from triton.testing import do_bench

        self._do_bench = do_bench
        self.script, self.tuning, self.table = script, tuning, table
        self.gpu = torch.cuda.get_device_name()
        self.stamp = datetime.date.today().isoformat()
        self.versions = f"torch {torch.__version__}, triton {triton.__version__}"
        out = os.environ.get("OUT")
        self.log = Path(out) / f"{script}.jsonl" if out else None
        self.entries: list[dict] = []
        self.summary: list[tuple] = []

    def measure(self, config, check: Callable, workloads: list[Workload], tag: str = ""):
        """``(geo-mean TFLOP/s, {label: TFLOP/s})`` of ``config``, or None if it fails."""
        name = f"{tag} {short(config)}".strip()
        try:
            if not check(config):
                print(f"{name}: WRONG RESULT, skipped", flush=True)
                return None
            rates = {}
            for work in workloads:
                ms = self._do_bench(lambda: work.run(config), warmup=25, rep=100,
                                    return_mode="median")
                rates[work.label] = work.flops / ms * 1e-9
                if self.log:
                    with self.log.open("a") as log:
                        log.write(json.dumps(dict(
                            provider="ours-triton", mode=self.table.kernel, config=short(config),
                            mask=work.label, ms=ms, tflops=rates[work.label], gpu=self.gpu,
                            versions=self.versions, **work.shape)) + "\n")
        except Exception as err:  # out of shared memory / registers: not a candidate
            print(f"{name}: failed ({type(err).__name__}: {err})"[:240], flush=True)
            return None
        score = math.exp(sum(math.log(r) for r in rates.values()) / len(rates))
        print(f"{name}: " + " / ".join(f"{r:.0f}" for r in rates.values())
              + f" TFLOP/s ({' / '.join(rates)})", flush=True)
        return score, rates

    def scorer(self, check: Callable, workloads: list[Workload], tag: str):
        """``(score, results)``: ``score(config)`` measures a config once (``results`` keeps
        each :meth:`measure` by :func:`short`) and returns its geo-mean, None if it failed."""
        results = {}

        def score(config):
            key = short(config)
            if key not in results:
                results[key] = self.measure(config, check, workloads, tag)
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
        reason = (f"measured {self.stamp} on {self.gpu} ({self.versions}): bf16 {shape}, "
                  + ", ".join(f"{lab} {r:.0f}" for lab, r in rates.items())
                  + f" TFLOP/s, geo-mean {score:.0f}{versus}")
        bucket = self.tuning.seqlen_bucket(seqlen)
        config = dataclasses.replace(best, reason=reason)
        self.entries.append(self.tuning.entry_of(config, gpu=self.gpu, block_d=block_d,
                                                 bucket=bucket))
        base = default_result[0] if default_result else float("nan")
        self.summary.append((block_d, seqlen, short(best), rates, score, base))

    def finish(self, out: Path | None) -> int:
        target = out or self.table.path
        if self.entries:
            self.tuning.write_entries(target, self.table.kernel, self.entries)
            print(f"wrote {len(self.entries)} entries to {target}")
            if os.environ.get("OUT") and Path(os.environ["OUT"]) not in target.parents:
                Path(os.environ["OUT"], target.name).write_text(target.read_text())
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


def require_gpu(script: str) -> bool:
    if torch.cuda.is_available():
        return True
    print(f"{script} needs a CUDA GPU", file=sys.stderr)
    return False
