"""Developer tools: profiling helpers and GPU-machine scripts, apart from the product (the
kernel under torch-ext/ and csrc/) and the maintainer tooling (flash_attn_hub). Run from the
repository root as ``python3 -m tools.<name>``; README.md lists them."""
