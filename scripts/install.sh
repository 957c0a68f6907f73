#!/usr/bin/env bash
# Creates .venv/ beside the repository and installs what the tooling and the
# tests need (requirements-dev.txt). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
.venv/bin/python -c "import torch, triton, kernels, huggingface_hub, transformers; print('installed: torch', torch.__version__, '| triton', triton.__version__, '| kernels', kernels.__version__, '| huggingface_hub', huggingface_hub.__version__, '| transformers', transformers.__version__)"
