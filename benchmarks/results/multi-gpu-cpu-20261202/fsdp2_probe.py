"""FSDP2 (torch.distributed.fsdp.fully_shard) on CPU processes over gloo, without accelerate
(whose FSDP needs an accelerator): the tiny Qwen2.5-0.5B-shaped model of
benchmarks/train_trl.py, one FSDP unit per decoder layer, fp32 master weights with bf16
compute (MixedPrecisionPolicy), AdamW; ours (LOCAL_KERNELS) against sdpa and eager on the
same unpacked rows. Prints the loss curves (mean over ranks) as JSON on rank 0.

    LOCAL_KERNELS=flash-attn-hub/flash-attn=$PWD/build OMP_NUM_THREADS=1 \\
        torchrun --nproc_per_node 2 benchmarks/results/multi-gpu-cpu-20261202/fsdp2_probe.py
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.integrations.hub_kernels import allow_all_hub_kernels

STEPS, ROWS, LENGTH, VOCAB = 6, 2, 256, 4096


def curve(impl: str, mesh) -> list[float]:
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, vocab_size=VOCAB, tie_word_embeddings=True)
    torch.manual_seed(0)  # the same initial weights on every rank and for every impl
    with allow_all_hub_kernels():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    assert isinstance(model.model.layers[0], FSDPModule)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own shard
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    curves = {name: curve(impl, mesh) for name, impl in
              (("ours", "flash-attn-hub/flash-attn@v3"), ("sdpa", "sdpa"), ("eager", "eager"))}
    if dist.get_rank() == 0:
        gaps = {k: max(abs(a - b) for a, b in zip(v, curves["sdpa"])) for k, v in curves.items() if k != "sdpa"}
        print(json.dumps({"world_size": dist.get_world_size(), "backend": dist.get_backend(),
                          "torch": torch.__version__, "losses": curves, "max_gap_to_sdpa": gaps}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
