"""End-to-end SFT benchmark: TRL's SFTTrainer on a Qwen2.5-0.5B-shaped model, one run per
attention implementation, same seed, same packed data.

    python benchmarks/train_trl.py --out results/train                     # GPU defaults
    python benchmarks/train_trl.py --impls ours,sdpa --kernel-dir build    # a local build
    python benchmarks/train_trl.py --endpoint http://127.0.0.1:8000        # an embedded Hub
    python benchmarks/train_trl.py --tiny                                  # CPU smoke test

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
``flex`` (``flex_attention``). Packed batches need a document mask, which transformers
gives SDPA and FlexAttention as a mask; SDPA's flash backend takes no mask, so
``sdpa-flash`` is expected to fail on packed data, and the failure is recorded.

Per implementation: tokens/s (after ``--warmup-steps``), peak memory, the loss curve.
Written to ``--out`` (default ``$OUT/train`` or ``benchmarks/results/train-<date>``):
``train.json``, ``loss.png``, ``TRAIN.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
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
IMPLS = ("ours", "sdpa", "sdpa-cudnn", "sdpa-flash", "flex")
SPECIAL = ("<pad>", "<eos>", "<unk>")
KNOWN_FAILURES = {  # why an implementation cannot run packed batches, printed with its error
    "sdpa-flash": "SDPA's flash backend takes no attn_mask and packed batches need a document mask: ",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default=None, help=f"comma-separated subset of {','.join(IMPLS)} "
                   "(default: all on a GPU, ours,sdpa on CPU)")
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
                   help="smoke test: 2 layers, 10 steps, rows of 256 tokens, vocab 4096 (runs on CPU)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.steps, args.max_length, args.batch_size, args.vocab = 2, 10, 256, 2, 4096
        args.warmup_steps = min(args.warmup_steps, 3)
    return args


def model_config(args):
    from transformers import Qwen2Config
    return Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=args.layers,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        vocab_size=args.vocab, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )


def make_documents(args) -> list[list[int]]:
    """Enough synthetic documents for ``steps`` full batches (and some slack)."""
    import numpy as np
    rng = np.random.default_rng(args.seed)
    budget = int(1.15 * args.steps * args.batch_size * args.max_length)
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
    if impl == "flex":
        return "flex_attention", contextlib.nullcontext()
    forced = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}
    if impl in forced:
        return "sdpa", sdpa_kernel([forced[impl]])
    if impl == "sdpa":
        return "sdpa", contextlib.nullcontext()
    raise ValueError(f"--impls: unknown implementation {impl!r}; known: {', '.join(IMPLS)}")


def train_one(impl: str, args, dataset, tokenizer) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback
    from transformers.integrations.hub_kernels import allow_all_hub_kernels
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    attn, context = _attention(impl, args)
    result = {"impl": impl, "attn_implementation": attn}
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
            result["kernel_module"] = [k.module.__name__ for k in kernels.get_loaded_kernels()]
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
            result["wall_s"] = time.perf_counter() - start
        steady = slice(min(args.warmup_steps, len(clock.times) - 2), None)
        times, tokens = clock.times[steady], clock.tokens[steady]
        if len(times) >= 2 and times[-1] > times[0]:
            result["tokens_per_s"] = (tokens[-1] - tokens[0]) / (times[-1] - times[0])
            step_s = [b - a for a, b in zip(times, times[1:])]
            result["step_ms_median"] = 1e3 * statistics.median(step_s)
        result["tokens_seen"] = clock.tokens[-1] if clock.tokens else 0
        result["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated()) if cuda else None
        result["losses"] = clock.losses
        result["final_loss"] = clock.losses[-1][1] if clock.losses else None
    except Exception as err:  # recorded and reported; the next implementation still runs
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        result["error"] = KNOWN_FAILURES.get(impl, "") + f"{type(err).__name__}: {first_line}"
        result["traceback"] = traceback.format_exc(limit=6)
        print(f"{impl} failed: {result['error']}", flush=True)
    finally:
        if old_backend is None:
            os.environ.pop("FLASH_ATTN_HUB_BACKEND", None)
        else:
            os.environ["FLASH_ATTN_HUB_BACKEND"] = old_backend
        model = trainer = None
        if cuda:
            torch.cuda.empty_cache()
    return result


def environment() -> dict:
    import torch
    import transformers
    import trl
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "trl": trl.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    try:
        import kernels
        env["kernels"] = kernels.__version__
    except ImportError:
        env["kernels"] = None
    return env


def write_outputs(out: Path, results: list[dict], args, env: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (out / "train.json").write_text(json.dumps({"env": env, "args": setup, "results": results}, indent=1) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if r.get("losses"):
            ax.plot([s for s, _ in r["losses"]], [v for _, v in r["losses"]], label=r["impl"],
                    linewidth=2.2 if r["impl"] == "ours" else 1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"SFT, Qwen2.5-0.5B shape ({args.layers} layers, vocab {args.vocab}), packed bf16 | "
                 f"{env['gpu']} | torch {env['torch']}, transformers {env['transformers']}", fontsize=8)
    ax.grid(alpha=0.3)
    if any(r.get("losses") for r in results):
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)

    base = next((r for r in results if r["impl"] == "sdpa" and r.get("tokens_per_s")), None)
    lines = [f"# SFT training benchmark ({env['date']})", "",
             f"{env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
             f"trl {env['trl']}, kernels {env['kernels']}.", "",
             f"Model: Qwen2.5-0.5B shape, {args.layers} layers, vocab {args.vocab} (reduced from 151,936), "
             f"random init, bf16 weights. Data: synthetic, packed padding-free, one row of "
             f"{args.batch_size} x {args.max_length} tokens per step (padded to that length), {args.steps} steps, "
             f"seed {args.seed}; tokens/s counts non-pad tokens after {args.warmup_steps} warm-up steps. "
             "Packed rows need a document mask: transformers passes SDPA a dense one (which SDPA's "
             "flash backend cannot take), FlexAttention a block mask, and ours cu_seqlens.", "",
             "| implementation | attn_implementation | tokens/s | vs sdpa | step ms (median) | peak memory (GiB) "
             "| loss step 1 | final loss | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tps = r.get("tokens_per_s")
        ratio = f"{tps / base['tokens_per_s']:.2f}x" if tps and base else "-"
        mem = f"{r['peak_mem_bytes'] / 2**30:.1f}" if r.get("peak_mem_bytes") else "-"
        first = f"{r['losses'][0][1]:.4f}" if r.get("losses") else "-"
        final = f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else "-"
        step = f"{r['step_ms_median']:.1f}" if r.get("step_ms_median") else "-"
        note = (r.get("error") or "").replace("|", "/")[:160]
        lines.append(f"| {r['impl']} | `{r['attn_implementation']}` | {f'{tps:,.0f}' if tps else '-'} | {ratio} "
                     f"| {step} | {mem} | {first} | {final} | {note} |")
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

    cuda = torch.cuda.is_available()
    impls = args.impls.split(",") if args.impls else list(IMPLS if cuda else ("ours", "sdpa"))
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        print(f"--impls: unknown {unknown}; known: {', '.join(IMPLS)}")
        return 2
    if not cuda:
        print("No CUDA GPU: running on CPU (smoke test; tokens/s here say nothing about a GPU).", flush=True)
    out = args.out or (Path(os.environ["OUT"]) / "train" if os.environ.get("OUT") else
                       Path(__file__).resolve().parent / "results" /
                       f"train-{datetime.datetime.now():%Y%m%d-%H%M}")
    docs = make_documents(args)
    dataset = Dataset.from_dict({"input_ids": docs})
    tokenizer = make_tokenizer(args.vocab)
    env = environment()
    results = []
    for impl in impls:
        print(f"== {impl}: {args.steps} steps", flush=True)
        r = train_one(impl, args, dataset, tokenizer)
        if r.get("tokens_per_s"):
            print(f"   {r['tokens_per_s']:,.0f} tokens/s, final loss {r['final_loss']:.4f}, "
                  f"peak {(r['peak_mem_bytes'] or 0) / 2**30:.1f} GiB", flush=True)
        results.append(r)
        write_outputs(out, results, args, env)  # after each run: a later crash keeps earlier numbers
    print(f"results: {out / 'TRAIN.md'}", flush=True)
    return 0 if any(r.get("tokens_per_s") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
