#!/usr/bin/env bash
# The CUTLASS/CuTe headers the CUDA build needs, as .whl/cutlass-include.tar.xz (~1 MB), from the
# nvidia-cutlass wheel in .whl/ (6.4 MB, mostly its Python generator and examples), which it
# replaces: room in a GPU call's carry for FlashAttention-4's first half beside the other wheels.
# `gpu_run.sh setup` unpacks it into $CUTLASS_INCLUDE (the path the wheel's headers had there, so
# carried objects still match the build's cache). Run here, from the repository root.
set -euo pipefail
wheel=$(compgen -G ".whl/nvidia_cutlass-*.whl" | head -n 1) ||
  { echo "no .whl/nvidia_cutlass-*.whl to take the headers from"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m zipfile -e "$wheel" "$tmp"
tar -C "$tmp/cutlass_library/source/include" -cf - . | xz -T0 -6 >.whl/cutlass-include.tar.xz
rm "$wheel"
echo "$wheel -> .whl/cutlass-include.tar.xz ($(du -h .whl/cutlass-include.tar.xz | cut -f1))"
