"""``python -m flash_attn_hub verify ORG/flash-attn --version N [--endpoint URL] [--transformers]``

Loads a published version the way users do, in a fresh process with an empty
Hugging Face cache (``HF_HOME`` in a temporary folder, ``HF_ENDPOINT`` = the Hub):

1. ``kernels.get_kernel(repo, version=N)`` (publisher trust as the Hub reports it,
   unless ``--trust-remote-code``);
2. the downloaded variant against its ``metadata.json`` digest (kernels'
   ``Digest.hash_variant`` + ``Digest.validate``: a missing, extra or changed file fails);
3. GQA forward + backward of ``flash_attn_func`` and ``flash_attn_varlen_func`` on this
   machine's device against ``flash_attn_hub/reference.py`` with its tolerance rule;
4. with ``--transformers``: a tiny random Llama with GQA, ``attn_implementation=
   "<repo>@v<N>"``, whose logits and loss gradient (dense batch, padded batch and packed
   sequences) must match float64 SDPA as closely as bf16 SDPA does.

Prints the variant and the commit sha it loaded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import DEFAULT_REPO_ID, REPO_ROOT
from . import reference as ref  # the one oracle


def device_and_dtype():
    """(device, dtype) to check on: CUDA in bf16 when present, else CPU in fp16 (SPEC.md section 1:
    the Triton interpreter cannot run bf16 dots)."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float16


def variant_of(module) -> tuple[str, str | None, Path]:
    """(variant name, commit sha from the cache path or None, variant folder) of a loaded kernel."""
    folder = Path(module.__file__).parent  # not resolved: cache files are symlinks into blobs/
    parts = folder.parts
    sha = parts[parts.index("snapshots") + 1] if "snapshots" in parts else None
    return folder.name, sha, folder


def check_digest(folder: Path) -> int:
    """Validate ``folder`` against the digest in its metadata.json; returns the file count."""
    from kernels._rust import Digest, DigestValidationError, Metadata

    metadata = Metadata.read_from_file(folder / "metadata.json")
    if metadata.digest is None:
        raise AssertionError(f"{folder}: metadata.json has no digest")
    try:
        metadata.digest.validate(Digest.hash_variant(metadata.digest.algorithm, folder))
    except DigestValidationError as err:
        raise AssertionError(f"{folder}: digest mismatch: {'; '.join(str(v) for v in err.violations)}") from None
    return len(metadata.digest.files)


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def check_attention(module, device=None, dtype=None) -> None:
    """GQA (Hq=6, Hkv=2) causal forward + backward, batched and varlen, against the reference."""
    import torch

    if device is None:
        device, dtype = device_and_dtype()
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype).requires_grad_()

    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = 2, 37, 45, 6, 2, 64
    cases = {"flash_attn_func": (rand(batch, seqlen_q, heads_q, head_dim), rand(batch, seqlen_k, heads_kv, head_dim),
                                 rand(batch, seqlen_k, heads_kv, head_dim), {})}
    lens_q, lens_k = [17, 1, 40], [23, 5, 40]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cases["flash_attn_varlen_func"] = (
        rand(sum(lens_q), heads_q, head_dim), rand(sum(lens_k), heads_kv, head_dim),
        rand(sum(lens_k), heads_kv, head_dim),
        {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max(lens_q), "max_seqlen_k": max(lens_k)})
    for name, (q, k, v, extra) in cases.items():
        fn = getattr(module, name)
        if name == "flash_attn_varlen_func":
            out = _first(fn(q, k, v, extra["cu_seqlens_q"], extra["cu_seqlens_k"], extra["max_seqlen_q"],
                            extra["max_seqlen_k"], causal=True))
            ref_kwargs = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
        else:
            out = _first(fn(q, k, v, causal=True))
            ref_kwargs = {}
        dout = torch.randn(out.shape, generator=generator).to(device=device, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref64, _ = ref.attention_reference(q, k, v, causal=True, **ref_kwargs)
        grads64 = torch.autograd.grad(ref64, (q, k, v), dout.to(torch.float64))
        lowp, _ = ref.attention_reference(q, k, v, causal=True, dtype=dtype, **ref_kwargs)
        grads_lowp = torch.autograd.grad(lowp, (q, k, v), dout)
        ref.assert_close_to_reference(f"{name} out", out, ref64, lowp)
        for label, ours, want, torch_lowp in zip(("dq", "dk", "dv"), grads, grads64, grads_lowp):
            ref.assert_close_to_reference(f"{name} {label}", ours, want, torch_lowp)


def tiny_llama(seed: int = 0):
    """A 2-layer Llama with GQA (4 query heads, 2 kv heads, head dim 16) and random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attention_dropout=0.0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def qwen2_gqa(seed: int = 0, layers: int = 2):
    """A Qwen2 with Qwen2.5-0.5B's attention shape (hidden 896, 14 query heads, 2 kv heads, head
    dim 64, q/k/v biases, rope theta 1e6, tied embeddings), ``layers`` layers, a 256-token vocab
    and random weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_dropout=0.0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def _with_attention(model, attn_implementation: str, dtype, allow_all_kernels: bool):
    """A copy of ``model`` in ``dtype`` whose attention runs through ``attn_implementation``."""
    import copy

    copy_ = copy.deepcopy(model).to(dtype)
    if attn_implementation in ("sdpa", "eager"):
        copy_.set_attn_implementation(attn_implementation)
    else:
        copy_.set_attn_implementation(attn_implementation, allow_all_kernels=allow_all_kernels)
    return copy_


def _flat(parameters, grads):
    """``grads`` of ``parameters`` concatenated into one vector (zeros where a gradient is None)."""
    import torch

    return torch.cat([p.new_zeros(p.numel()) if g is None else g.reshape(-1) for p, g in zip(parameters, grads)])


def _copy_run(model, attn_implementation: str, dtype, inputs: dict, labels, allow_all_kernels: bool):
    """(logits, concatenated parameter gradients of the loss) of ``model`` copied to ``dtype``."""
    import torch

    copy_ = _with_attention(model, attn_implementation, dtype, allow_all_kernels)
    out = copy_(**inputs, labels=labels)
    parameters = list(copy_.parameters())
    return out.logits, _flat(parameters, torch.autograd.grad(out.loss, parameters, allow_unused=True))


def check_transformers(attn_implementation: str, *, allow_all_kernels: bool = False, seed: int = 0,
                       device=None) -> dict:
    """Dense, padded (2-D mask) and packed (position_ids) batches through a tiny GQA Llama with
    ``attn_implementation`` in bf16, against float64 SDPA, with the tolerance rule applied to
    bf16 SDPA, on ``device`` (default: this machine's, see :func:`device_and_dtype`); returns
    the measured errors."""
    import torch

    device = device if device is not None else device_and_dtype()[0]
    model = tiny_llama(seed).to(device)
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 128, (2, 24), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding on the second row
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    lengths = [9, 15, 24]
    packed = torch.randint(0, 128, (1, sum(lengths)), generator=generator).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    batches = {
        "dense": ({"input_ids": ids}, ids, torch.ones_like(ids, dtype=torch.bool)),
        "padded": ({"input_ids": ids, "attention_mask": mask}, labels, mask.bool()),
        "packed": ({"input_ids": packed, "position_ids": positions}, _packed_labels(packed, lengths),
                   torch.ones_like(packed, dtype=torch.bool)),
    }
    errors = {}
    for name, (inputs, labels_, valid) in batches.items():
        if name == "packed":
            ref_logits, ref_grads = _packed_reference(model, packed, lengths)
        else:
            ref_logits, ref_grads = _copy_run(model, "sdpa", torch.float64, inputs, labels_, False)
        sdpa_logits, sdpa_grads = _copy_run(model, "sdpa", torch.bfloat16, inputs, labels_, False) \
            if name != "packed" else _packed_reference(model, packed, lengths, torch.bfloat16)
        ours_logits, ours_grads = _copy_run(model, attn_implementation, torch.bfloat16, inputs, labels_,
                                            allow_all_kernels)
        ref.assert_close_to_reference(f"{name} logits", ours_logits[valid], ref_logits[valid], sdpa_logits[valid])
        ref.assert_close_to_reference(f"{name} loss gradient", ours_grads, ref_grads, sdpa_grads)
        errors[name] = {"logits": ref.relative_error(ours_logits[valid], ref_logits[valid]),
                        "sdpa_logits": ref.relative_error(sdpa_logits[valid], ref_logits[valid]),
                        "grad": ref.relative_error(ours_grads, ref_grads),
                        "sdpa_grad": ref.relative_error(sdpa_grads, ref_grads)}
    return errors


def _packed_labels(packed, lengths):
    """Labels for packed sequences: the first token of each sequence after the first is -100,
    so no sequence is trained to predict the start of the next one."""
    import torch

    labels = packed.clone()
    starts = torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)
    labels[0, starts[1:]] = -100
    return labels


def _packed_reference(model, packed, lengths, dtype=None):
    """Each packed sequence run on its own through SDPA (what packing must equal), logits
    concatenated and the summed per-sequence losses normalised like the packed loss."""
    import torch

    dtype = dtype or torch.float64
    copy_ = _with_attention(model, "sdpa", dtype, False)
    labels = _packed_labels(packed, lengths)
    logits, total, count = [], 0.0, 0
    start = 0
    for n in lengths:
        piece = packed[:, start:start + n]
        piece_labels = labels[:, start:start + n]
        out = copy_(input_ids=piece)
        logits.append(out.logits)
        shift_logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        shift_logits = shift_logits if dtype == torch.float64 else shift_logits.float()  # as transformers' loss
        targets = piece_labels[:, 1:].reshape(-1)
        total = total + torch.nn.functional.cross_entropy(shift_logits, targets, ignore_index=-100,
                                                          reduction="sum")
        count += int((targets != -100).sum())
        start += n
    loss = total / count
    parameters = list(copy_.parameters())
    return torch.cat(logits, dim=1), _flat(parameters, torch.autograd.grad(loss, parameters, allow_unused=True))


# SGD without momentum (no optimizer state for the weight copy to leave behind); 0.1 moves the
# weights ~1% a step, above bf16's rounding of them, so the steps train rather than round away.
TRAINING_LR = 0.1


def _training_batch(generator, batch: int, seqlen: int, vocab: int, padded: bool, device):
    """Random ids and labels; ``padded``: the last row is right-padded by a quarter of
    ``seqlen`` (attention_mask 0, label -100), which the kernel path turns into varlen."""
    import torch

    ids = torch.randint(0, vocab, (batch, seqlen), generator=generator)
    inputs = {"input_ids": ids}
    labels = ids.clone()
    if padded:
        mask = torch.ones_like(ids)
        mask[-1, seqlen - seqlen // 4:] = 0
        labels[mask == 0] = -100
        inputs["attention_mask"] = mask
    return {k: v.to(device) for k, v in inputs.items()}, labels.to(device)


def _token_losses(logits, labels):
    """Causal LM cross-entropy of each labelled token, in float64: the terms whose mean is the
    loss. (The mean alone is a poor witness: bf16 rounding errors cancel in it by chance, so
    SDPA's own error on it can be near zero.)"""
    import torch

    targets = labels[:, 1:].reshape(-1)
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), targets,
                                               ignore_index=-100, reduction="none")
    return losses[targets != -100]


def _train_step(model, optimizer, inputs: dict, labels):
    """One optimizer step of the causal LM loss; returns (per-token losses, {parameter name:
    gradient}) at the weights before the step."""
    optimizer.zero_grad(set_to_none=True)
    out = model(**inputs, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() if p.grad is not None else p.new_zeros(p.shape)
             for name, p in model.named_parameters()}
    optimizer.step()
    return _token_losses(out.logits.detach(), labels), grads


ATTENTION_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


def check_transformers_training(attn_implementation: str, *, steps: int = 3, seqlen: int = 256, batch: int = 2,
                                device=None, allow_all_kernels: bool = False, seed: int = 0) -> list[dict]:
    """``steps`` SGD steps of a Qwen2.5-0.5B-shaped GQA model (:func:`qwen2_gqa`) with attention
    through ``attn_implementation`` in bf16, against float64 SDPA, the tolerance rule applied to
    bf16 SDPA, on ``device`` (default: this machine's, see :func:`device_and_dtype`).

    The three copies see the same batch at each step; even steps (the first included) carry a
    right-padded row with an attention_mask, so the varlen path trains too. At every step ours'
    per-token losses, its flattened parameter gradient and the gradient of each attention
    projection weight (where the kernel's dq, dk and dv land first; the flat vector is mostly
    embedding and MLP) are checked against float64's; an ``AssertionError`` names the step.
    bf16 and float64 updates differ by bf16's rounding of the weights, so after each step the
    float64 copy's updated weights are cast into both bf16 copies: every step compares
    gradients at the same weights. Returns one dict of errors per step."""
    import torch

    device = device if device is not None else device_and_dtype()[0]
    model = qwen2_gqa(seed).to(device)
    copies = {"ref": _with_attention(model, "sdpa", torch.float64, False),
              "sdpa": _with_attention(model, "sdpa", torch.bfloat16, False),
              "ours": _with_attention(model, attn_implementation, torch.bfloat16, allow_all_kernels)}
    optimizers = {name: torch.optim.SGD(m.train().parameters(), lr=TRAINING_LR) for name, m in copies.items()}
    generator = torch.Generator().manual_seed(seed + 1)
    errors = []
    for step in range(steps):
        padded = step % 2 == 0
        inputs, labels = _training_batch(generator, batch, seqlen, model.config.vocab_size, padded, device)
        results = {name: _train_step(m, optimizers[name], inputs, labels) for name, m in copies.items()}
        (loss, grads), (ref_loss, ref_grads), (sdpa_loss, sdpa_grads) = (results[k] for k in ("ours", "ref", "sdpa"))
        compared = {"loss": (loss, ref_loss, sdpa_loss),
                    "grad": tuple(torch.cat([g.reshape(-1) for g in named.values()])
                                  for named in (grads, ref_grads, sdpa_grads))}
        compared.update({name: (grads[name], ref_grads[name], sdpa_grads[name])
                         for name in grads if name.endswith(ATTENTION_WEIGHTS)})
        step_errors = {"padded": padded, "ref_loss": ref_loss.mean().item()}
        for name, (ours_, ref_, sdpa_) in compared.items():
            ref.assert_close_to_reference(f"step {step} {name}", ours_, ref_, sdpa_)
            step_errors[name] = (ref.relative_error(ours_, ref_), ref.relative_error(sdpa_, ref_))
        errors.append(step_errors)
        with torch.no_grad():
            for name in ("sdpa", "ours"):
                for dst, src in zip(copies[name].parameters(), copies["ref"].parameters()):
                    dst.copy_(src)
    return errors


def verify_in_process(repo_id: str, version: int, *, trust_remote_code: bool = False,
                      transformers: bool = False) -> dict:
    """Steps 1-4 in this process (the caller has pointed huggingface_hub at the Hub)."""
    import kernels
    from huggingface_hub import HfApi

    tips = {b.name: b.target_commit for b in HfApi().list_repo_refs(repo_id, repo_type="kernel").branches}
    module = kernels.get_kernel(repo_id, version=version, trust_remote_code=trust_remote_code)
    variant, sha, folder = variant_of(module)
    if sha != tips.get(f"v{version}"):
        raise AssertionError(f"loaded {sha} but v{version} is at {tips.get(f'v{version}')}")
    files = check_digest(folder)
    check_attention(module)
    result = {"variant": variant, "sha": sha, "files": files}
    if transformers:
        result["transformers"] = check_transformers(f"{repo_id}@v{version}", allow_all_kernels=trust_remote_code)
    return result


def child_env(endpoint: str, hf_home: str) -> dict[str, str]:
    """The environment of a fresh user process pointed at ``endpoint`` with an empty cache."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_HUB_DISABLE_TELEMETRY",
                        "KERNELS_CACHE", "LOCAL_KERNELS", "HF_TOKEN")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=hf_home, HF_HUB_DISABLE_PROGRESS_BARS="1")
    return env


def verify(repo_id: str, version: int, endpoint: str, *, trust_remote_code: bool = False,
           transformers: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run :func:`verify_in_process` in a fresh interpreter; its output is streamed through."""
    with tempfile.TemporaryDirectory(prefix="verify-hf-home-") as hf_home:
        command = [sys.executable, "-m", "flash_attn_hub", "verify", repo_id, "--version", str(version),
                   "--endpoint", endpoint, "--in-process"]
        command += ["--trust-remote-code"] if trust_remote_code else []
        command += ["--transformers"] if transformers else []
        return subprocess.run(command, env=child_env(endpoint, hf_home), cwd=str(REPO_ROOT), timeout=timeout)


def run(args: argparse.Namespace) -> int:
    if not args.in_process:
        if args.endpoint is None:
            print("verify: --endpoint is required (the Hub to load from)", file=sys.stderr)
            return 2
        return verify(args.repo_id, args.version, args.endpoint, trust_remote_code=args.trust_remote_code,
                      transformers=args.transformers).returncode
    try:
        result = verify_in_process(args.repo_id, args.version, trust_remote_code=args.trust_remote_code,
                                   transformers=args.transformers)
    except AssertionError as err:
        print(f"verify: FAILED: {err}", file=sys.stderr)
        return 1
    print(f"verify: {args.repo_id} v{args.version}: variant {result['variant']} sha {result['sha']} "
          f"(digest ok over {result['files']} files; GQA forward+backward ok)")
    for name, errs in result.get("transformers", {}).items():
        print(f"verify: transformers {name}: logits err {errs['logits']:.2e} (sdpa bf16 {errs['sdpa_logits']:.2e}), "
              f"grad err {errs['grad']:.2e} (sdpa bf16 {errs['sdpa_grad']:.2e})")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("verify", help="load a published version in a fresh process and check it")
    parser.add_argument("repo_id", nargs="?", default=DEFAULT_REPO_ID, help=f"kernel repo (default {DEFAULT_REPO_ID})")
    parser.add_argument("--version", type=int, required=True, help="major version (branch v<N>)")
    parser.add_argument("--endpoint", help="Hub URL to load from")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load even if the Hub does not report the org as a trusted publisher")
    parser.add_argument("--transformers", action="store_true",
                        help="also run a tiny GQA Llama with attn_implementation=<repo>@v<N>")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(func=run)
