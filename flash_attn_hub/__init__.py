"""Maintainer tooling for the flash-attn Hub kernel: build, check, publish,
verify, benchmark, and an embedded Hub-compatible server. ``python -m flash_attn_hub --help``."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPO_ID = "flash-attn-hub/flash-attn"
