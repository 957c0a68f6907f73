#!/usr/bin/env bash
# Builds the sm90 extension straight from csrc/ on a GPU machine (independent of the build
# tooling), assembles a package from torch-ext/flash_attn, then runs tests/test_cuda_fwd.py, the
# forward benchmark and, with SANITIZE=1, compute-sanitizer on the small all-features test.
#
#   OUT=/path bash scripts/cuda_dev_check.sh            # logs and cuda_bench.json land in $OUT
#
# Needs nvcc, a CUDA torch, triton and the nvidia-cutlass headers (CUTLASS_INCLUDE, else the
# installed cutlass_library package).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
CUTLASS_INCLUDE=${CUTLASS_INCLUDE:-$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include}
TORCH_DIR=$(python3 -c "import torch, os; print(os.path.dirname(torch.__file__))")
PY_INCLUDE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
NAME=_flash_attn_cuda_check
WORK=$(mktemp -d /tmp/flash_cuda_check.XXXX)
PKG=$WORK/pkg/flash_attn
mkdir -p "$PKG" "$WORK/obj" "$WORK/tests"
FLAGS=(-std=c++17 -O3 -Xcompiler -fPIC -DTORCH_TARGET_VERSION=0x020b000000000000
       -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
       -DTORCH_EXTENSION_NAME=$NAME -I"$CUTLASS_INCLUDE" -I"$TORCH_DIR/include" -I"$PY_INCLUDE"
       -gencode arch=compute_90a,code=sm_90a)

echo "[cuda_dev_check] compiling into $WORK"
start=$SECONDS
ls csrc/hopper/fwd_dispatch.cu csrc/hopper/instantiations/*.cu torch-ext/torch_binding.cpp |
  xargs -P "$(nproc)" -I{} sh -c 'nvcc "$@" -Xptxas -v -c {} -o '"$WORK"'/obj/$(basename {}).o > '"$WORK"'/obj/$(basename {}).log 2>&1 || { cat '"$WORK"'/obj/$(basename {}).log; exit 255; }' _ "${FLAGS[@]}" || exit 1
cat "$WORK"/obj/*.log > "$OUT/ptxas.log"
grep -h "spill" "$OUT/ptxas.log" | sort | uniq -c
nvcc -shared -o "$PKG/$NAME.abi3.so" "$WORK"/obj/*.o -L"$TORCH_DIR/lib" -Xlinker --no-as-needed \
  -ltorch_cuda -ltorch_cpu -lc10 -cudart shared || exit 1
echo "[cuda_dev_check] built in $((SECONDS - start)) s"

cp torch-ext/flash_attn/*.py "$PKG/"
cat > "$PKG/_ops.py" <<PY
import torch
from . import $NAME
ops = torch.ops.$NAME
def add_op_namespace_prefix(op_name: str) -> str:
    return f"$NAME::{op_name}"
PY
cp tests/test_cuda_fwd.py "$WORK/tests/"  # the oracle: flash_attn_hub.reference, from the repository root
cat > "$WORK/tests/conftest.py" <<PY
import sys
import pytest
sys.path.insert(0, "$WORK/pkg")
@pytest.fixture(scope="session")
def flash_attn():
    import flash_attn
    return flash_attn
PY

status=0
timeout 500 python3 -m pytest "$WORK/tests/test_cuda_fwd.py" -q -p no:cacheprovider \
  --rootdir="$WORK/tests" -c /dev/null -W ignore --maxfail=40 2>&1 | tee "$OUT/test_cuda_fwd.log" || status=1
timeout 300 python3 scripts/cuda_bench.py --import-path "$WORK/pkg" 2>&1 | tee "$OUT/cuda_bench.log" || status=1
if [[ ${SANITIZE:-0} == 1 ]]; then
  for tool in memcheck racecheck synccheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 1 python3 -m pytest \
      "$WORK/tests/test_cuda_fwd.py" -q -p no:cacheprovider --rootdir="$WORK/tests" -c /dev/null \
      -W ignore -k small_all_features_once 2>&1 | tee "$OUT/sanitize_$tool.log" || status=1
  done
fi
exit $status
