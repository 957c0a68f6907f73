"""Tile configurations of the Triton kernels: in-code defaults, measured overrides in JSON.

Each kernel module (``fwd``, ``bwd``) owns one :class:`TileTable`:

* ``defaults``: the in-code table keyed by ``(arch, block_d)``, arch one of ``sm90``, ``sm80``,
  ``generic`` (another CUDA GPU) or ``interpreter`` (CPU tensors under ``TRITON_INTERPRET=1``),
  each entry with the reason it was chosen;
* a JSON file beside the module (``triton_fwd_configs.json``, ``triton_bwd_configs.json``,
  shipped through build.toml's ``pyext``), written on a GPU by ``python -m flash_attn_hub tune``,
  whose entries are keyed by the GPU's name (``torch.cuda.get_device_name``), the head-dim
  bucket ``block_d`` and a sequence-length bucket.

File format (one flat object per entry; config fields absent from an entry take the dataclass
defaults, so a file written before a field existed stays valid)::

    {"kernel": "forward",
     "entries": [{"gpu": "NVIDIA H200", "block_d": 128, "seqlen_bucket": 4096,
                  "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3,
                  "reason": "measured on NVIDIA H200 ..."}]}

Lookup for a call (head dim, longer of max_seqlen_q / max_seqlen_k, device): the file's entry
for (gpu, width, bucket); else the file's entry for (gpu, width) at the nearest bucket it
holds; else the same two for the padded width ``block_d`` when the kernel runs the head dim
narrower (the forward's split, [Note: split head dim]: D=192 runs 128 + 64 columns, width
192, and falls back to the 256 entries until 192 has its own); else the same for the table's
reference GPU of the arch (``TileTable.reference_gpus``: whose rows were measured to carry over
to the arch's other GPUs); else ``defaults[(arch, block_d)]``. The file is read once per
process and each lookup is cached, so a call costs two dictionary hits; nothing is timed at
import or on a first call.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from .._heuristics import tile_arch

logger = logging.getLogger("flash_attn")

HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256)
# Upper bounds of the sequence-length buckets (the last is open-ended): the standard grid of
# benchmarks (512..16k) splits into short (<= 1k: few programs per head, small tiles can win),
# medium and long.
SEQLEN_BUCKETS = (1024, 4096, 16384)
KEY_FIELDS = ("gpu", "block_d", "seqlen_bucket")


def block_d_for(head_dim: int) -> int:
    """The padded tile width, also the head-dim bucket: ``max(16, next_pow2(head_dim))``."""
    return max(16, 1 << max(0, head_dim - 1).bit_length())


# The narrowest padded width whose head dims the Triton forward splits into two tiles: the
# H200 measured 256 -> 128 + 64 at D=192 +8% (full, 4k and 16k) and 128 + 32 at D=160 +9-13%,
# but 128 -> 64 + 32 at D=96 and 64 + 16 at D=80 14-20% slower (B=4, S=4k, 16 heads).
SPLIT_MIN_PADDED = 256


def head_dim_split(head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_D, HEAD_DIM2, BLOCK_D2)`` of a head dim split into two tiles: the first
    ``block_d_for(head_dim) // 2`` columns in one, the other ``HEAD_DIM2`` in a second tile of
    ``BLOCK_D2 = block_d_for(HEAD_DIM2)`` columns, when the two are narrower than the padded
    tile and that is at least ``SPLIT_MIN_PADDED`` wide (D=192: 128 + 64 instead of 256);
    else ``(block_d_for(head_dim), 0, 0)``."""
    padded = block_d_for(head_dim)
    first = padded // 2
    rest = head_dim - first
    if padded >= SPLIT_MIN_PADDED and rest > 0 and first + block_d_for(rest) < padded:
        return first, rest, block_d_for(rest)
    return padded, 0, 0


def seqlen_bucket(seqlen: int) -> int:
    """The smallest bucket bound ``>= seqlen``; longer sequences fall into the last bucket."""
    return next((b for b in SEQLEN_BUCKETS if seqlen <= b), SEQLEN_BUCKETS[-1])


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_identity(device: torch.device) -> tuple[str, str]:
    """``(arch, gpu name)`` of a tensor's device; CPU tensors run under the interpreter."""
    if device.type != "cuda":
        return "interpreter", ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tile_arch(device), _gpu_name(index)


def arch_of(device: torch.device) -> str:
    return tile_arch(device)


def _config_fields(config_type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(config_type))


def entry_of(config, *, gpu: str, block_d: int, bucket: int) -> dict[str, Any]:
    """The JSON entry recording ``config`` (a config dataclass) for one key."""
    return dict(gpu=gpu, block_d=block_d, seqlen_bucket=bucket, **dataclasses.asdict(config))


def parse_entries(raw: dict, config_type, source: str = "<json>") -> dict:
    """``{(gpu, block_d, seqlen_bucket): config}`` from a file's parsed JSON. An entry with an
    unknown field or a missing key is skipped with a warning (a newer or broken file must not
    stop a user's call)."""
    fields = set(_config_fields(config_type))
    parsed = {}
    for entry in raw.get("entries", []):
        unknown = set(entry) - fields - set(KEY_FIELDS)
        if unknown or not all(k in entry for k in KEY_FIELDS):
            logger.warning("%s: skipping tile entry %s (unknown fields %s or missing key)",
                           source, {k: entry.get(k) for k in KEY_FIELDS}, sorted(unknown))
            continue
        key = (str(entry["gpu"]), int(entry["block_d"]), int(entry["seqlen_bucket"]))
        parsed[key] = config_type(**{k: v for k, v in entry.items() if k in fields})
    return parsed


@functools.cache
def _measured(path: Path, config_type) -> dict:
    """The file's entries, read once per process (absent file: none)."""
    if not path.exists():
        return {}
    entries = parse_entries(json.loads(path.read_text()), config_type, path.name)
    logger.info("Triton tiles: %d measured entries from %s", len(entries), path.name)
    return entries


@dataclasses.dataclass(frozen=True, eq=False)
class TileTable:
    """The tile table of one kernel module: ``defaults`` keyed by ``(arch, block_d)`` plus the
    measured entries of the JSON file at ``path``; ``config_type`` is the entry dataclass."""
    kernel: str  # "forward" | "backward": the file's "kernel" field
    path: Path
    defaults: dict
    config_type: type
    # arch -> the GPU whose measured rows a GPU of that arch without rows of its own takes,
    # bucket by bucket, before the in-code defaults (one row per head dim, which cannot say
    # that short sequences want other tiles); only where that was measured on another GPU
    reference_gpus: dict = dataclasses.field(default_factory=dict)

    def measured(self) -> dict:
        return _measured(self.path, self.config_type)

    def default(self, arch: str, head_dim: int):
        return self.defaults[(arch, block_d_for(head_dim))]

    @functools.cache
    def lookup(self, arch: str, gpu: str, block_d: int, bucket: int, width: int | None = None):
        """The config for one key (see the module docstring for the order), cached. ``width``:
        the columns the kernel runs when narrower than ``block_d`` (its own entries first)."""
        measured = self.measured()
        for g in filter(None, dict.fromkeys((gpu, self.reference_gpus.get(arch)))):
            for d in dict.fromkeys((width or block_d, block_d)):
                if (g, d, bucket) in measured:
                    return measured[(g, d, bucket)]
                near = [b for gg, dd, b in measured if gg == g and dd == d]
                if near:
                    # Nearest bucket on a log scale; on a tie the longer one (the tuner's default).
                    nearest = min(near, key=lambda b: (abs(math.log2(b / bucket)), -b))
                    return measured[(g, d, nearest)]
        return self.defaults[(arch, block_d)]

    def for_call(self, device: torch.device, head_dim: int, seqlen: int,
                 width: int | None = None):
        arch, gpu = device_identity(device)
        return self.lookup(arch, gpu, block_d_for(head_dim), seqlen_bucket(seqlen), width)


def write_entries(path: Path, kernel: str, new_entries: list[dict]) -> list[dict]:
    """Merge ``new_entries`` into the tuning file at ``path`` (same key: replaced; other keys:
    kept) and write it sorted; returns the written entries."""
    old = json.loads(path.read_text()).get("entries", []) if path.exists() else []
    merged = {tuple(e[k] for k in KEY_FIELDS): e for e in [*old, *new_entries]}
    ordered = [merged[key] for key in sorted(merged)]
    path.write_text(json.dumps({"kernel": kernel, "entries": ordered}, indent=1) + "\n")
    return ordered
