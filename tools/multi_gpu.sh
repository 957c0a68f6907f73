#!/usr/bin/env bash
# The SFT benchmark (benchmarks/train_trl.py) on NPROC processes of one host with FSDP2
# (accelerate launch --config_file benchmarks/fsdp2.yaml), every rank loading the kernel
# from an embedded Hub on 127.0.0.1 that this script starts and publishes to:
#
#   bash tools/multi_gpu.sh [--cpu] [--local] [-- <train_trl.py arguments>]
#
#   --cpu    no GPU: the noarch torch-cpu variant, gloo, --tiny (a smoke test of the same path;
#            accelerate has no FSDP on CPU, so it trains with DDP and the results say so)
#   --local  skip the Hub: every rank loads the build through LOCAL_KERNELS (--kernel-dir)
#
# Environment: PYTHON (default .venv/bin/python, else python3 with the carried wheels),
# NPROC (default 2), IMPLS (default ours,sdpa), OUT (default /tmp/multi-gpu-out),
# BUILD_DIR (default build), BUILD_ARGS (more `flash_attn_hub build` arguments, e.g.
# "--backend cuda"), TRAIN_TIMEOUT (seconds, default 480).
# Results: $OUT/train/{train.json,TRAIN.md,loss.png} (train.json holds every rank's numbers
# under results[i].ranks), logs in $OUT/*.log. Python packages the GPU image lacks are
# installed from the wheels in .whl/ into /tmp/site, as tools/gpu_run.sh's setup does.
set -uo pipefail
cd "$(dirname "$0")/.."

# NVLink SHARP / multicast stay off on the lent multi-GPU machines: NCCL, torch's symmetric
# memory and NVSHMEM each have their own switch. Exported, so every rank inherits them.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# kernels 0.17.2 + huggingface_hub 2.4 reject every request when this is set (an empty
# user-agent part); the embedded Hub needs no telemetry switch anyway.
unset HF_HUB_DISABLE_TELEMETRY
if [[ -z ${FLASH_ATTN_HUB_GIT_SHA:-} && -f .git_sha ]]; then  # a tree copied without .git
  FLASH_ATTN_HUB_GIT_SHA=$(cat .git_sha)
  export FLASH_ATTN_HUB_GIT_SHA
fi

cpu=0 hub=1 train_args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --cpu) cpu=1 ;;
    --local) hub=0 ;;
    --) shift; train_args=("$@"); break ;;
    *) echo "multi_gpu.sh: unknown argument $1 (use -- before train_trl.py arguments)" >&2; exit 2 ;;
  esac
  shift
done
NPROC=${NPROC:-2}
IMPLS=${IMPLS:-ours,sdpa}
OUT=${OUT:-${TMPDIR:-/tmp}/multi-gpu-out}
BUILD_DIR=${BUILD_DIR:-build}
mkdir -p "$OUT"
log() { echo "[multi_gpu $(date +%H:%M:%S)] $*"; }

if [[ -n ${PYTHON:-} ]]; then  # an interpreter named by the caller (a test runs its own)
  PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else  # the GPU image: its python plus the carried wheels
  PY=python3
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export CUTLASS_INCLUDE=${CUTLASS_INCLUDE:-/tmp/site/cutlass_library/source/include}
  if [[ -f .whl/cutlass-include.tar.xz && ! -d $CUTLASS_INCLUDE/cute ]]; then  # tools/cutlass-headers.sh
    mkdir -p "$CUTLASS_INCLUDE" && tar -xJf .whl/cutlass-include.tar.xz -C "$CUTLASS_INCLUDE" || exit 1
  fi
fi
"$PY" -c "import torch, transformers, trl, accelerate, datasets, kernels; print('torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__, '| accelerate', accelerate.__version__, '| datasets', datasets.__version__, '| kernels', kernels.__version__, '| GPUs', torch.cuda.device_count())" \
  | tee "$OUT/versions.txt" || exit 1

if [[ $cpu == 1 ]]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # NPROC processes share the cores
  BUILD_ARGS=${BUILD_ARGS:---backend cpu}
  train_args=(--tiny "${train_args[@]}")
fi

# shellcheck disable=SC2086
"$PY" -m flash_attn_hub build --out "$BUILD_DIR" $BUILD_ARGS >"$OUT/build.log" 2>&1 || { tail -n 20 "$OUT/build.log"; exit 1; }
variant=$(tail -n 1 "$OUT/build.log")  # build prints the variant path last
"$PY" -m flash_attn_hub check "$variant" >"$OUT/check.log" 2>&1 || { tail -n 20 "$OUT/check.log"; exit 1; }
log "built and checked $variant"

work=$(mktemp -d "${TMPDIR:-/tmp}/multi-gpu.XXXXXX")
hub_pid=
cleanup() {
  [[ -n $hub_pid ]] && kill "$hub_pid" 2>/dev/null && wait "$hub_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

if [[ $hub == 1 ]]; then
  # A fresh Hub and a fresh download cache: every rank fetches what was just published.
  "$PY" -m flash_attn_hub hub serve --data "$work/hub" --port 0 >"$OUT/hub.log" 2>&1 &
  hub_pid=$!
  endpoint=
  for _ in $(seq 100); do
    endpoint=$(sed -n 's/^Hub serving .* at \(http:[^ ]*\) .*/\1/p' "$OUT/hub.log")
    [[ -n $endpoint ]] && break
    kill -0 "$hub_pid" 2>/dev/null || break
    sleep 0.2
  done
  [[ -n $endpoint ]] || { log "the embedded Hub did not start"; cat "$OUT/hub.log"; exit 1; }
  export HF_ENDPOINT=$endpoint HF_HOME=$work/hf-home
  "$PY" -m flash_attn_hub publish --build-dir "$BUILD_DIR" --endpoint "$endpoint" --token "$(cat "$work/hub/token")" --allow-dirty \
    >"$OUT/publish.log" 2>&1 || { tail -n 20 "$OUT/publish.log"; exit 1; }
  "$PY" -m flash_attn_hub verify --version 3 --endpoint "$endpoint" >"$OUT/verify.log" 2>&1 \
    || { tail -n 20 "$OUT/verify.log"; exit 1; }
  log "published to and loaded back from the embedded Hub at $endpoint"
  source_args=(--endpoint "$endpoint")
else
  source_args=(--kernel-dir "$BUILD_DIR")
fi

port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
log "accelerate launch: FSDP2 config, $NPROC processes, --impls $IMPLS ${train_args[*]}"
timeout "${TRAIN_TIMEOUT:-480}" "$PY" -m accelerate.commands.launch --config_file benchmarks/fsdp2.yaml \
  --num_processes "$NPROC" --main_process_port "$port" \
  benchmarks/train_trl.py --impls "$IMPLS" "${source_args[@]}" --out "$OUT/train" "${train_args[@]}" \
  2>&1 | tee "$OUT/train.log"
status=${PIPESTATUS[0]}
log "done, status $status; results in $OUT/train"
exit "$status"
