"""End-to-end SFT benchmark: TRL's SFTTrainer on a Qwen2.5-0.5B-shaped model, one run per
attention implementation, same seed, same packed data.

    python benchmarks/train_trl.py --out /tmp/train                        # GPU defaults
    python benchmarks/train_trl.py --impls ours,sdpa --kernel-dir build    # a local build
    python benchmarks/train_trl.py --endpoint http://127.0.0.1:8000        # an embedded Hub
    python benchmarks/train_trl.py --tiny                                  # CPU smoke test
    accelerate launch --config_file benchmarks/fsdp2.yaml --num_processes 2 \
        benchmarks/train_trl.py --impls ours,sdpa                         # FSDP2, 2 GPUs

Model: Qwen2 architecture with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query and
2 key-value heads of dim 64, MLP 4864, tied embeddings), randomly initialised from the
config below (nothing is downloaded). The vocabulary is reduced from 151,936 to 32,000
(``--vocab``) so the embedding does not dominate time and memory; the attention work per
token is unchanged.

Data: synthetic documents generated here (lognormal lengths, a long tail of long ones;
each document repeats a short Zipf-distributed motif, so the loss falls as the model
learns unigram statistics and then to copy), packed by TRL (``packing_strategy="bfd"``)
into padding-free batches: every step is one flattened row of ``batch_size * max_length``
tokens with document boundaries given by position ids. The row is padded to exactly that
length (a few percent of pad tokens, outside the loss and not counted in tokens/s) so that
every step has the same shape: FlexAttention, which transformers compiles, then compiles
once instead of once per packed length.

Implementations (``--impls``): ``ours`` = ``attn_implementation="<repo>@v3"`` loaded through
kernels (``--kernel``; ``--kernel-dir`` maps it to a local build with LOCAL_KERNELS;
``--endpoint`` points huggingface_hub at a Hub-compatible server), ``sdpa`` (PyTorch picks
the backend), ``sdpa-cudnn`` and ``sdpa-flash`` (backend forced with ``sdpa_kernel``),
``flex`` (``flex_attention``), ``eager`` (transformers' matmul-softmax attention, softmax in
float32: a second PyTorch implementation, whose loss gap to ``sdpa`` is the yardstick for
ours; not in the GPU default, it keeps every score matrix for the backward). Packed batches need a document mask, which transformers
gives SDPA and FlexAttention as a mask; SDPA's flash backend takes no mask, so
``sdpa-flash`` is expected to fail on packed data, and the failure is recorded.

Per implementation: tokens/s (after ``--warmup-steps``), peak memory, the loss curve.
Written to ``--out`` (default ``$OUT/train``, else ``train/`` in the system's temporary
folder; never into the source tree): ``train.json``, ``loss.png``, ``TRAIN.md``.

Distributed (``accelerate launch``/``torchrun``, one process per GPU; ``tools/multi_gpu.sh``
runs it with FSDP2): every rank trains on its own shard of the same packed data (each step is
``world_size`` rows of ``batch_size * max_length`` tokens), the logged loss is the mean over
ranks, tokens/s is the global count (transformers gathers it) and per GPU that divided by
the world size; peak memory, step time and wall time are gathered from every rank into the
``ranks`` list of each result. Only rank 0 prints the summary and writes files. On CPU
(gloo) accelerate has no FSDP and trains with DDP; ``distributed`` in each result says
which strategy actually ran.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import tempfile
import time
import traceback
from pathlib import Path

DEFAULT_KERNEL = "flash-attn-hub/flash-attn@v3"  # the package's Hub repository, branch v3
IMPLS = ("ours", "sdpa", "sdpa-cudnn", "sdpa-flash", "flex", "eager")
GPU_DEFAULT = ("ours", "sdpa", "sdpa-cudnn", "sdpa-flash", "flex")  # eager stores every score matrix
SPECIAL = ("<pad>", "<eos>", "<unk>")
KNOWN_FAILURES = {  # why an implementation cannot run packed batches, printed with its error
    "sdpa-flash": "SDPA's flash backend takes no attn_mask and packed batches need a document mask: ",
}


TINY = {"layers": 2, "steps": 10, "max_length": 256, "batch_size": 2, "vocab": 4096, "warmup_steps": 3}


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place in a distributed launch (torchrun's environment; 0 of 1 alone)."""
    rank: int
    world_size: int

    @classmethod
    def from_env(cls) -> Ranks:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def gather(self, obj) -> list:
        """``obj`` from every rank, in rank order (``[obj]`` when not distributed)."""
        import torch.distributed as dist
        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def _ours_source(results):
    """One sentence saying where ours was loaded from (a Hub revision or a local build)."""
    for r in results:
        for rank in r.get("ranks", []):
            for k in rank.get("kernel") or []:
                if k.get("hub"):
                    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
                    return f" Ours was loaded through kernels from {endpoint}: `{k['hub']}`."
                return f" Ours was loaded through kernels from the local build {k['path']}."
    return ""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default=None, help=f"comma-separated subset of {','.join(IMPLS)} "
                   "(default: all but eager on a GPU, ours,sdpa on CPU)")
    p.add_argument("--kernel", default=DEFAULT_KERNEL, help="attn_implementation for ours: <repo>@<rev>")
    p.add_argument("--kernel-dir", type=Path, default=None,
                   help="serve --kernel's repo from this local build (LOCAL_KERNELS)")
    p.add_argument("--endpoint", default=None, help="Hub-compatible server for --kernel")
    p.add_argument("--ours-backend", default=None, choices=["cuda", "triton", "cpu"],
                   help="force our dispatch (FLASH_ATTN_HUB_BACKEND); default: its own choice")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of tokens/s")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-length", type=int, default=4096, help="packed row length")
    p.add_argument("--batch-size", type=int, default=4, help="packed rows per step (flattened)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help="smoke test: 2 layers, 10 steps, rows of 256 tokens, vocab 4096, 3 warm-up steps "
                        "(runs on CPU; flags given explicitly still win)")
    p.add_argument("--out", type=Path, default=None)
    if p.parse_known_args(argv)[0].tiny:
        p.set_defaults(**TINY)
    return p.parse_args(argv)


def model_config(args):
    from transformers import Qwen2Config
    return Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=args.layers,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        vocab_size=args.vocab, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )


def make_documents(args, world_size: int = 1) -> list[list[int]]:
    """Enough synthetic documents for ``steps`` full batches on each of ``world_size`` ranks
    (and some slack). The same seed on every rank: every rank builds the same list and the
    sampler gives each its shard."""
    import numpy as np
    rng = np.random.default_rng(args.seed)
    budget = int(1.15 * args.steps * args.batch_size * args.max_length * world_size)
    ranks = np.arange(1, args.vocab - len(SPECIAL) + 1)
    zipf = 1.0 / ranks
    zipf /= zipf.sum()
    docs, total = [], 0
    while total < budget:
        length = int(np.clip(rng.lognormal(math.log(max(args.max_length // 8, 16)), 1.0), 8, args.max_length))
        motif = rng.choice(len(ranks), size=int(rng.integers(4, 65)), p=zipf) + len(SPECIAL)
        doc = np.resize(motif, length - 1).tolist() + [1]  # ends with <eos>
        docs.append(doc)
        total += length
    return docs


def make_tokenizer(vocab: int):
    """A word-level tokenizer over the ids themselves: SFTTrainer wants one for the pad
    token; the data is already tokenised."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    table = {tok: i for i, tok in enumerate(SPECIAL)}
    table.update({str(i): i for i in range(len(SPECIAL), vocab)})
    tok = Tokenizer(WordLevel(table, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _callback_class():
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall time and tokens seen at the end of every step, and the logged losses."""

        def __init__(self):
            self.times, self.tokens, self.losses = [], [], []

        def on_step_end(self, args, state, control, **kwargs):
            import torch
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            self.tokens.append(state.num_input_tokens_seen)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append((state.global_step, float(logs["loss"])))

    return StepClock


def _attention(impl: str, args):
    """attn_implementation and the context to train under."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if impl == "ours":
        return args.kernel, contextlib.nullcontext()
    if impl in ("flex", "eager"):
        return {"flex": "flex_attention", "eager": "eager"}[impl], contextlib.nullcontext()
    forced = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}
    if impl in forced:
        return "sdpa", sdpa_kernel([forced[impl]])
    if impl == "sdpa":
        return "sdpa", contextlib.nullcontext()
    raise ValueError(f"--impls: unknown implementation {impl!r}; known: {', '.join(IMPLS)}")


def _strategy(trainer) -> str:
    """How the trainer's accelerator distributed the model: FSDP2, FSDP1, MULTI_GPU (DDP), ..."""
    acc = trainer.accelerator
    kind = getattr(acc.distributed_type, "value", str(acc.distributed_type))
    if kind == "FSDP":
        return "FSDP2" if acc.is_fsdp2 else "FSDP1"
    return kind


def train_one(impl: str, args, dataset, tokenizer, ranks: Ranks) -> dict:
    """Train ``impl`` on every rank; the result (complete on rank 0) has the global numbers
    and, under ``ranks``, what each rank measured."""
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback
    from transformers.integrations.hub_kernels import allow_all_hub_kernels
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    attn, context = _attention(impl, args)
    result = {"impl": impl, "attn_implementation": attn}
    local = {"rank": ranks.rank}
    old_backend = os.environ.get("FLASH_ATTN_HUB_BACKEND")
    if impl == "ours" and args.ours_backend:
        os.environ["FLASH_ATTN_HUB_BACKEND"] = args.ours_backend
    try:
        torch.manual_seed(args.seed)
        with allow_all_hub_kernels():  # our org is not a trusted kernel publisher
            model = AutoModelForCausalLM.from_config(model_config(args), attn_implementation=attn,
                                                     dtype=torch.bfloat16)
        result["params"] = sum(p.numel() for p in model.parameters())
        if impl == "ours":
            import kernels
            loaded = kernels.get_loaded_kernels()
            result["kernel_module"] = [k.module.__name__ for k in loaded]
            local["kernel"] = [  # where this rank's copy came from: the Hub (a snapshot) or a local build
                {"hub": f"{k.repo_info.repo_id}@{k.repo_info.revision}" if k.repo_info else None,
                 "path": str(Path(k.module.__file__).parent)} for k in loaded]
        clock = _callback_class()()
        with tempfile.TemporaryDirectory() as tmp:
            config = SFTConfig(
                output_dir=tmp, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=min(20, args.steps // 10),
                weight_decay=0.0, logging_steps=1, save_strategy="no", report_to="none",
                bf16=cuda, use_cpu=not cuda, seed=args.seed, data_seed=args.seed,
                packing=True, packing_strategy="bfd", padding_free=True, max_length=args.max_length,
                pad_to_multiple_of=args.batch_size * args.max_length,
                include_num_input_tokens_seen="non_padding", dataloader_num_workers=0, disable_tqdm=True,
                log_level="warning",
            )
            trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[clock])
            trainer.remove_callback(PrinterCallback)  # one dict per step: the curve goes to the outputs
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            with context:
                trainer.train()
            local["wall_s"] = time.perf_counter() - start
            result["distributed"] = _strategy(trainer)
        steady = slice(min(args.warmup_steps, len(clock.times) - 2), None)
        times, tokens = clock.times[steady], clock.tokens[steady]  # tokens: all ranks together
        if len(times) >= 2 and times[-1] > times[0]:
            local["tokens_per_s"] = (tokens[-1] - tokens[0]) / (times[-1] - times[0])
            step_s = [b - a for a, b in zip(times, times[1:])]
            local["step_ms_median"] = 1e3 * statistics.median(step_s)
        result["tokens_seen"] = clock.tokens[-1] if clock.tokens else 0
        local["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated()) if cuda else None
        result["losses"] = clock.losses  # the mean over ranks (transformers gathers it)
        result["final_loss"] = clock.losses[-1][1] if clock.losses else None
    except Exception as err:  # recorded and reported; the next implementation still runs
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        result["error"] = KNOWN_FAILURES.get(impl, "") + f"{type(err).__name__}: {first_line}"
        result["traceback"] = traceback.format_exc(limit=6)
        local["error"] = result["error"]
        print(f"{impl} failed on rank {ranks.rank}: {result['error']}", flush=True)
    finally:
        if old_backend is None:
            os.environ.pop("FLASH_ATTN_HUB_BACKEND", None)
        else:
            os.environ["FLASH_ATTN_HUB_BACKEND"] = old_backend
        model = trainer = None
        gc.collect()  # the sharded model and its optimizer state, before the next one is built
        if cuda:
            torch.cuda.empty_cache()
    return _combine(result, ranks.gather(local), ranks.world_size)


def _combine(result: dict, per_rank: list[dict], world_size: int) -> dict:
    """Rank 0's result with every rank's measurements: tokens/s is global (every rank sees
    the same gathered token count; the slowest rank's clock counts), per GPU divides it by
    the world size, peak memory is the largest rank's."""
    result["world_size"] = world_size
    result["ranks"] = per_rank
    rates = [r["tokens_per_s"] for r in per_rank if r.get("tokens_per_s")]
    if len(rates) == len(per_rank):
        result["tokens_per_s"] = min(rates)
        result["tokens_per_s_per_gpu"] = min(rates) / world_size
        result["step_ms_median"] = max(r["step_ms_median"] for r in per_rank)
        result["wall_s"] = max(r["wall_s"] for r in per_rank)
    mems = [r["peak_mem_bytes"] for r in per_rank if r.get("peak_mem_bytes")]
    result["peak_mem_bytes"] = max(mems) if mems else None
    errors = [f"rank {r['rank']}: {r['error']}" for r in per_rank if r.get("error")]
    if errors and "error" not in result:
        result["error"] = "; ".join(errors)
    return result


def environment(ranks: Ranks) -> dict:
    import accelerate
    import datasets
    import torch
    import torch.distributed as dist
    import transformers
    import trl
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "trl": trl.__version__, "accelerate": accelerate.__version__, "datasets": datasets.__version__,
           "python": platform.python_version(), "world_size": ranks.world_size,
           "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    try:
        import kernels
        env["kernels"] = kernels.__version__
    except ImportError:
        env["kernels"] = None
    return env


BASELINES = ("sdpa", "sdpa-cudnn")  # the yardstick: PyTorch's own choice, else its cuDNN backend


def baseline(results: list[dict]) -> str:
    """The implementation the others are compared with: the first of BASELINES that trained."""
    ran = {r["impl"] for r in results if r.get("tokens_per_s")}
    return next((b for b in BASELINES if b in ran), BASELINES[0])


def loss_gap(results: list[dict], impl: str, base: str) -> float | None:
    """Largest |loss(impl) - loss(base)| over the steps both logged: the two runs share the
    seed, the initial weights and the data order, so the gap is the attention's numerics."""
    curves = {r["impl"]: dict(r["losses"]) for r in results if r.get("losses")}
    if impl not in curves or base not in curves:
        return None
    steps = curves[impl].keys() & curves[base].keys()
    return max((abs(curves[impl][s] - curves[base][s]) for s in steps), default=None)


def write_outputs(out: Path, results: list[dict], args, env: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (out / "train.json").write_text(json.dumps({"env": env, "args": setup, "results": results}, indent=1) + "\n")

    world = env["world_size"]
    strategy = next((r["distributed"] for r in results if r.get("distributed")), None)
    on_gpu = env["gpu"] != "none (CPU)"
    where = env["gpu"] if world == 1 else (f"{world} x {env['gpu']}" if on_gpu else f"{world} CPU processes") + \
        f", {strategy or 'distributed'}"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if r.get("losses"):
            ax.plot([s for s, _ in r["losses"]], [v for _, v in r["losses"]], label=r["impl"],
                    linewidth=2.2 if r["impl"] == "ours" else 1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token)" + (", mean over ranks" if world > 1 else ""))
    ax.set_title(f"SFT, Qwen2.5-0.5B shape ({args.layers} layers, vocab {args.vocab}), packed bf16 | "
                 f"{where} | torch {env['torch']}, transformers {env['transformers']}", fontsize=8)
    ax.grid(alpha=0.3)
    if any(r.get("losses") for r in results):
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)

    ref = baseline(results)
    base = next((r for r in results if r["impl"] == ref and r.get("tokens_per_s")), None)
    unit = "GPU" if on_gpu else "process"
    lines = [f"# SFT training benchmark ({env['date']})", "",
             f"{where}; torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
             f"trl {env['trl']}, accelerate {env['accelerate']}, kernels {env['kernels']}"
             + (f", {world} processes over {env['backend']}." if world > 1 else "."), "",
             f"Model: Qwen2.5-0.5B shape, {args.layers} layers, vocab {args.vocab} (reduced from 151,936), "
             f"random init, bf16 weights. Data: synthetic, packed padding-free, one row of "
             f"{args.batch_size} x {args.max_length} tokens per step per {unit} (padded to that length), "
             f"{args.steps} steps, seed {args.seed}; tokens/s counts non-pad tokens after {args.warmup_steps} "
             "warm-up steps" + (f", summed over the {world} ranks (per {unit}: divided by {world}); "
                                "the loss is the mean over ranks" if world > 1 else "") + ". "
             "Packed rows need a document mask: transformers passes SDPA a dense one (which SDPA's "
             "flash backend cannot take), FlexAttention a block mask, and ours cu_seqlens."
             + _ours_source(results), "",
             f"| implementation | attn_implementation | tokens/s | tokens/s per {unit} | vs {ref} | step ms (median) "
             f"| peak memory per {unit} (GiB) | loss step 1 | final loss | max loss gap to {ref} | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tps = r.get("tokens_per_s")
        ratio = f"{tps / base['tokens_per_s']:.2f}x" if tps and base else "-"
        mems = [m["peak_mem_bytes"] for m in r.get("ranks", []) if m.get("peak_mem_bytes")]
        mem = " / ".join(f"{m / 2**30:.1f}" for m in mems) or "-"
        first = f"{r['losses'][0][1]:.4f}" if r.get("losses") else "-"
        final = f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else "-"
        step = f"{r['step_ms_median']:.1f}" if r.get("step_ms_median") else "-"
        gap = loss_gap(results, r["impl"], ref) if r["impl"] != ref else None
        per = r.get("tokens_per_s_per_gpu")
        note = (r.get("error") or "").replace("|", "/")[:160]
        lines.append(f"| {r['impl']} | `{r['attn_implementation']}` | {f'{tps:,.0f}' if tps else '-'} "
                     f"| {f'{per:,.0f}' if per else '-'} | {ratio} | {step} | {mem} | {first} | {final} "
                     f"| {f'{gap:.2e}' if gap is not None else '-'} | {note} |")
    lines += ["", "![loss curves](loss.png)", ""]
    (out / "TRAIN.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.endpoint:  # before huggingface_hub is imported: it reads the endpoint once
        os.environ["HF_ENDPOINT"] = args.endpoint.rstrip("/")
    if args.kernel_dir:
        repo_id = args.kernel.partition("@")[0]
        os.environ["LOCAL_KERNELS"] = f"{repo_id}={args.kernel_dir.resolve()}"
    import datasets
    import torch
    from datasets import Dataset

    datasets.disable_progress_bars()
    ranks = Ranks.from_env()
    say = print if ranks.main else (lambda *a, **k: None)

    cuda = torch.cuda.is_available()
    if ranks.world_size > 1:  # the process group up front, so results can be gathered even if a run fails
        from accelerate import PartialState
        PartialState(cpu=not cuda)
    impls = args.impls.split(",") if args.impls else list(GPU_DEFAULT if cuda else ("ours", "sdpa"))
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        say(f"--impls: unknown {unknown}; known: {', '.join(IMPLS)}")
        return 2
    if not cuda:
        say("No CUDA GPU: running on CPU (smoke test; tokens/s here say nothing about a GPU).", flush=True)
    out = args.out or Path(os.environ.get("OUT") or tempfile.gettempdir()) / "train"
    docs = make_documents(args, ranks.world_size)
    dataset = Dataset.from_dict({"input_ids": docs})
    tokenizer = make_tokenizer(args.vocab)
    env = environment(ranks)
    results = []
    for impl in impls:
        say(f"== {impl}: {args.steps} steps on {ranks.world_size} process(es)", flush=True)
        r = train_one(impl, args, dataset, tokenizer, ranks)
        if r.get("tokens_per_s"):
            mems = " / ".join(f"{m['peak_mem_bytes'] / 2**30:.1f}" for m in r["ranks"] if m["peak_mem_bytes"])
            how = "one process" if r["distributed"] == "NO" else r["distributed"]  # accelerate's names
            say(f"   {how}: {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s_per_gpu']:,.0f} per "
                f"rank), final loss {r['final_loss']:.4f}" + (f", peak per rank {mems} GiB" if mems else ""),
                flush=True)
        results.append(r)
        if ranks.main:
            write_outputs(out, results, args, env)  # after each run: a later crash keeps earlier numbers
    ref = baseline(results)
    for impl in impls:
        gap = loss_gap(results, impl, ref) if impl != ref else None
        if gap is not None:
            say(f"max |loss({impl}) - loss({ref})| over {args.steps} steps: {gap:.2e}", flush=True)
    say(f"results: {out / 'TRAIN.md'}", flush=True)
    if ranks.world_size > 1:
        # Every rank leaves together and tears the group down itself: a rank that exits with the
        # group alive can abort in a communicator thread at interpreter shutdown ("terminate
        # called without an active exception"), and the launcher then kills the others.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0 if any(r.get("tokens_per_s") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
