#!/usr/bin/env bash
# FlashInfer (flashinfer-python) as a kv-cache benchmark peer on the GPU machine, which has no
# package index. Its wheel (~100 MB, ~700 MB unpacked, most of it CUDA sources for kernels the
# paged decode never compiles) is over one call's carry, so it travels pruned and in two halves,
# like FlashAttention-4 (tools/README.md). Run here, from the repository root, on a machine that
# reaches the package index:
#
#   bash tools/flashinfer-carry.sh      # writes .flashinfer/a and .flashinfer/b (ignored)
#
# GPU call 1 carries .flashinfer/a; call 2, on the same warm machine, carries .flashinfer/b.
# tools/gpu_run.sh's setup phase handles both (call 1 leaves the first half in /root/flashinfer,
# call 2 unpacks both and the wheels into /tmp/fisite and puts it on PYTHONPATH and PATH).
#
# What is kept:
# - the whole Python package and its header trees (data/include, cutlass, cccl, spdlog: the JIT
#   puts all of them on the include path) and every top-level file of data/csrc (the JIT
#   generators copy their sources and templates from there);
# - of data/csrc's subfolders, only those that the include closure of the paged decode and
#   prefill sources reaches (the tensor-core path FlashInfer takes for several new tokens
#   compiles the batch prefill module). Every #include is followed, whatever #if surrounds it.
# - the wheels `import flashinfer` and its JIT need that the GPU image may lack:
#   apache-tvm-ffi (its module loader and headers), nvidia-ml-py (pynvml), requests and its
#   own dependencies, ninja (the JIT's build tool). The rest of its Requires-Dist is not
#   imported by `import flashinfer` or by the fa2 decode path (cuda-python, cuDNN frontend,
#   CuTe DSL, NCCL, cuda-tile, einops, tabulate), or the image has it (torch, numpy, jinja2,
#   filelock, packaging, tqdm, click).
# FLASHINFER_WHEEL=path uses a wheel already downloaded; FLASHINFER_VERSION picks another one.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${FLASHINFER_VERSION:-0.7.4}
PY=${PYTHON:-python3}
out=.flashinfer
rm -rf "$out"
mkdir -p "$out/a" "$out/b" "$out/w" "$out/tree"
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
   --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform any)
fetch() { "$PY" -m pip download -q "${P[@]}" -d "$1" "$2" 2>&1 | grep -v "^WARNING: Location" || true; }
wheel=${FLASHINFER_WHEEL:-}
if [[ -z $wheel ]]; then
  mkdir -p "$out/fi" && fetch "$out/fi" "flashinfer-python==$V"
  wheel=$(ls "$out"/fi/flashinfer_python-*.whl)
fi
for p in "apache-tvm-ffi>=0.1.11,<0.2" nvidia-ml-py ninja requests urllib3 certifi charset-normalizer idna; do
  fetch "$out/w" "$p"
done
wheel=$(realpath "$wheel")
(cd "$out/tree" && "$PY" -m zipfile -e "$wheel" .)

"$PY" - "$out/tree/flashinfer/data" <<'PY'
"""Drop the data/csrc subfolders that the paged decode / prefill sources never include."""
import re
import shutil
import sys
from pathlib import Path

data = Path(sys.argv[1])
csrc = data / "csrc"
roots = [data / "include", csrc, data / "cutlass" / "include", data / "cutlass" / "tools" / "util" / "include",
         data / "spdlog" / "include", data / "cccl" / "cub", data / "cccl" / "libcudacxx" / "include",
         data / "cccl" / "thrust"]
include = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
seeds = [f for pattern in ("batch_decode*", "batch_prefill*", "single_decode*", "single_prefill*", "page*",
                           "tvm_ffi_utils.h") for f in csrc.glob(pattern) if f.is_file()]
seen, todo, unresolved = set(), list(seeds), set()
while todo:
    path = todo.pop()
    if path in seen:
        continue
    seen.add(path)
    for name in include.findall(path.read_text(errors="replace")):
        hits = [d / name for d in [path.parent, *roots] if (d / name).is_file()]
        if hits:
            todo.append(hits[0].resolve())
        else:
            unresolved.add(name)  # CUDA toolkit, tvm_ffi, the C++ library, or generated (*.inc)
reached = {p.relative_to(csrc.resolve()).parts[0] for p in seen if p.is_relative_to(csrc.resolve())}
dropped = []
for sub in sorted(p for p in csrc.iterdir() if p.is_dir()):
    if sub.name not in reached:
        dropped.append(sub.name)
        shutil.rmtree(sub)
kept = sorted(p.name for p in csrc.iterdir() if p.is_dir())
print(f"include closure: {len(seen)} files from {len(seeds)} decode/prefill/page sources; "
      f"csrc subfolders kept: {kept or 'none'}; dropped: {len(dropped)}")
PY

tar -C "$out/tree" -cf - . | xz -T0 -6 >"$out/fi.tar.xz"
split -n 2 -d "$out/fi.tar.xz" "$out/part."
mv "$out/part.00" "$out/a/"
mv "$out/part.01" "$out"/w/*.whl "$out/b/"
cat >"$out/b/install.sh" <<'SH'
#!/usr/bin/env bash
# GPU side: the pruned flashinfer tree from the two halves (call 1 left the first in $2,
# default /root/flashinfer) and the small wheels, into $1; then $1 goes on PYTHONPATH and $1/bin
# on PATH.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); site=${1:?target dir}; half=${2:-/root/flashinfer}; mkdir -p "$site"
cat "$half/part.00" "$here/part.01" | xz -d -T0 | tar -x -C "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site.w" "$here"/*.whl
cp -r "$site.w"/. "$site"/ && rm -rf "$site.w"
echo "flashinfer in $site"
SH
chmod +x "$out/b/install.sh"
rm -rf "$out/tree" "$out/w" "$out/fi" "$out/fi.tar.xz"
du -sh "$out/a" "$out/b"
