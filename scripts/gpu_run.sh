#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA variant, check it, run the GPU
# tests, benchmark against the peers, publish to an embedded Hub and load it
# back, and train. Phases run in the order given (default: all but train):
#
#   bash scripts/gpu_run.sh [setup] [build] [ab|abbuild] [cudafwd] [cudabwd] [sanitize] [test] [tune] [ktimes] [profile] [bench] [hub] [train]
#
# ab builds the tree and the tree with each AB_PATCH applied (or takes builds of the same sources
# made ahead by abbuild), and times them (see the phase); the phases after it test the top build.
#
# train loads ours from the embedded Hub that hub publishes to, so hub goes before it.
#
# build leaves the CUDA variant in build/, and the test phases load it from there
# (FLASH_ATTN_HUB_TEST_REPO) instead of building once per test process. A tree copied without
# .git names its commit in the file .git_sha (written by whoever copies it).
#
# Logs and results go to $OUT (default: ./gpu-out). Python packages the GPU
# image lacks are installed from wheels in .whl/ (see README "GPU runs").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
phases=("$@")
[[ ${#phases[@]} -eq 0 ]] && phases=(setup build test bench hub)
export PYTHONUNBUFFERED=1
export FLASH_ATTN_HUB_TEST_REPO=$PWD
if [[ -z ${FLASH_ATTN_HUB_GIT_SHA:-} && -f .git_sha ]]; then
  FLASH_ATTN_HUB_GIT_SHA=$(cat .git_sha)
  export FLASH_ATTN_HUB_GIT_SHA
fi
status=0

log() { echo "[gpu_run $(date +%H:%M:%S)] $*"; }

run_phase() {
  local name=$1; shift
  local start=$SECONDS
  log "phase $name: $*"
  if "$@" >"$OUT/$name.log" 2>&1; then
    log "phase $name ok ($((SECONDS - start)) s); tail of $name.log:"
    tail -n 6 "$OUT/$name.log"
  else
    log "phase $name FAILED ($((SECONDS - start)) s); tail of $name.log:"
    tail -n 40 "$OUT/$name.log"
    status=1
    return 1
  fi
}

# The digest of what a CUDA build is made of (the phase ab matches carried builds on it).
source_digest() {
  find csrc torch-ext flash_attn_hub build.toml -type f -not -path '*/__pycache__/*' \
    \( -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.py' \
       -o -name '*.json' -o -name '*.toml' \) -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

# Whether the build in $1 (a build/ folder) loads and runs here: one small forward and backward.
ab_loads() {
  timeout 120 python3 scripts/kernel_times.py --kernel-dir "$1" --iters 1 --batch 1 \
    --seqlen 256 --heads 2/2 --head-dim 64 >/dev/null 2>&1
}

for phase in "${phases[@]}"; do
  case $phase in
    setup)
      if [[ -d .whl ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      fi
      export CUTLASS_INCLUDE=${CUTLASS_INCLUDE:-/tmp/site/cutlass_library/source/include}
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
      python3 -c "import torch, triton, kernels, huggingface_hub, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__, 'kernels', kernels.__version__, 'hf_hub', huggingface_hub.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
      ;;
    build)
      run_phase build python3 -m flash_attn_hub build --backend cuda
      variant=$(tail -n 1 "$OUT/build.log")  # build prints the variant path last
      [[ -n $variant ]] && run_phase check python3 -m flash_attn_hub check "$variant"
      ;;
    ab|abbuild)
      # A stack of CUDA changes against the tree. AB_PATCH names one patch or several
      # (space-separated, applied in that order), each a diff from the repository root (e.g.
      # `git diff main my-branch`). Build "base" is the tree; build k is the tree with patches
      # 1..k, named after its patch file ("exp" when there is one patch). Each goes to
      # $AB_DIR/<name>/build, compiled in place one after another with one object cache
      # ($AB_CACHE), so a patch recompiles only what it changes; $AB_DIR/<name>/SOURCES records
      # the digest of the sources it was built from (source_digest). A build whose SOURCES
      # matches is reused, so abbuild (the builds alone, on any machine with nvcc) can make
      # them ahead of a GPU call that carries AB_DIR. ab then times each KT_ARGS workload
      # (";"-separated) with scripts/kernel_times.py, one process per build, the stack's top
      # first, AB_REPS rounds, into ab.log, and scripts/ab_table.py prints the table. The tree
      # stays patched and build/ holds the top build, so later phases (cudabwd, sanitize) test it;
      # with AB_REPS=0 that is all ab does (a second call on a warm machine, say).
      read -ra ab_patches <<< "${AB_PATCH:-}"
      ab_bad=""
      [[ ${#ab_patches[@]} -eq 0 ]] && ab_bad="AB_PATCH names no file"
      for patch in "${ab_patches[@]}"; do
        [[ -f $patch ]] || ab_bad="AB_PATCH names no file $patch"
      done
      ab_names=(base)
      if [[ ${#ab_patches[@]} -eq 1 ]]; then ab_names+=(exp); else
        for patch in "${ab_patches[@]}"; do ab_names+=("$(basename "$patch" .patch)"); done
      fi
      # each build's folder is named after its patch file: two of one name would share it
      if [[ $(printf '%s\n' "${ab_names[@]}" | sort | uniq -d) ]]; then
        ab_bad="AB_PATCH's file names must differ from each other and from base: ${ab_names[*]}"
      fi
      if [[ -n $ab_bad ]]; then
        log "phase $phase FAILED: $ab_bad"; status=1; continue
      fi
      ab_ok=1
      ab_dir=${AB_DIR:-/tmp/ab}
      for i in "${!ab_names[@]}"; do
        name=${ab_names[$i]}
        if [[ $i -gt 0 ]]; then
          # git apply works outside a repository; patch(1) where git is missing
          apply=(patch -p1 -i "${ab_patches[$((i - 1))]}")
          command -v git >/dev/null && apply=(git apply "${ab_patches[$((i - 1))]}")
          run_phase "ab-apply-$name" "${apply[@]}" || { ab_ok=0; break; }
          # a patch to generate.py's tables may leave out the headers it generates
          run_phase "ab-generate-$name" python3 csrc/hopper/generate.py || { ab_ok=0; break; }
        fi
        digest=$(source_digest)
        if [[ -d $ab_dir/$name/build && $(cat "$ab_dir/$name/SOURCES" 2>/dev/null) == "$digest" ]] &&
           { [[ $phase == abbuild ]] || ab_loads "$ab_dir/$name/build"; }; then
          log "ab: $name was built from these sources already ($digest)"
          continue
        fi
        rm -rf "${ab_dir:?}/$name"
        run_phase "ab-build-$name" env FLASH_ATTN_HUB_CACHE="${AB_CACHE:-/tmp/ab-cache}" \
          python3 -m flash_attn_hub build --backend cuda --out "$ab_dir/$name/build" ||
          { ab_ok=0; break; }
        echo "$digest" >"$ab_dir/$name/SOURCES"
      done
      [[ $ab_ok -eq 1 && $phase == ab ]] || continue
      rm -rf build && cp -a "$ab_dir/${ab_names[-1]}/build" build
      # AB_REPS=0: the patched tree and its build for the phases after, nothing timed
      [[ ${AB_REPS:-2} -gt 0 ]] || continue
      IFS=';' read -ra kt_sets <<< "${KT_ARGS:-}"
      [[ ${#kt_sets[@]} -eq 0 ]] && kt_sets=("")
      for rep in $(seq "${AB_REPS:-2}"); do
        for args in "${kt_sets[@]}"; do
          for ((i = ${#ab_names[@]} - 1; i >= 0; i--)); do
            side=${ab_names[$i]}
            echo "== $side rep$rep: $args" >>"$OUT/ab.log"
            # shellcheck disable=SC2086
            timeout 300 python3 scripts/kernel_times.py --kernel-dir "$ab_dir/$side/build" \
              --iters 10 $args >>"$OUT/ab.log" 2>&1 ||
              { log "kernel_times failed ($side): $args"; status=1; }
          done
        done
      done
      python3 scripts/ab_table.py "$OUT/ab.log" --builds "$(IFS=,; echo "${ab_names[*]}")" |
        tee "$OUT/ab-table.md" || status=1
      ;;
    cudafwd)
      # The sm90 forward called directly, every feature against the float64 reference.
      run_phase cudafwd timeout "${CUDAFWD_TIMEOUT:-300}" python3 -m pytest -q -rfE \
        -p no:cacheprovider tests/test_cuda_fwd.py
      ;;
    cudabwd)
      # The sm90 backward called directly: one smoke case first (a hang or a fault stops here),
      # then every feature against the float64 reference.
      run_phase cudabwd-smoke timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider \
        tests/test_cuda_bwd.py -k "test_head_dims and bf16 and full and (128 or 256)"
      if [[ $status -eq 0 ]]; then
        run_phase cudabwd timeout "${CUDABWD_TIMEOUT:-300}" python3 -m pytest -q -rfE \
          -p no:cacheprovider -n "${TEST_WORKERS:-12}" tests/test_cuda_bwd.py
      fi
      ;;
    sanitize)
      # The sanitize tests keep cuBLAS out of the run where they can (references on the CPU):
      # racecheck reported hazards inside cuBLAS's own Hopper GEMMs (nvjet_*, 2026-12-04), and
      # excluding those kernels from instrumentation made the tool fail on a hardware exception.
      for tool in memcheck racecheck synccheck; do
        run_phase "sanitize-$tool" timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer \
          --tool "$tool" --error-exitcode 1 \
          python3 -m pytest -m "gpu and sanitize" -q -p no:cacheprovider tests
      done
      ;;
    test)
      # TEST_ARGS narrows the run, e.g. "tests/test_gpu.py -k gqa". Triton compiles on the
      # CPU, so the tests run in TEST_WORKERS processes sharing the GPU.
      # shellcheck disable=SC2086
      run_phase test timeout "${TEST_TIMEOUT:-1200}" python3 -m pytest -m gpu -q -rfE \
        -p no:cacheprovider -n "${TEST_WORKERS:-12}" ${TEST_ARGS:-tests}
      ;;
    tune)
      # TUNE_ARGS e.g. "--head-dims 128 --quick"; TUNE_KERNELS "fwd", "bwd" or both (default);
      # several TUNE_ARGS separated by ";" run one after another into the same tables. The
      # tuned tables land in $OUT/tune.
      mkdir -p "$OUT/tune"
      IFS=';' read -ra tune_sets <<< "${TUNE_ARGS:---quick}"
      for kernel in ${TUNE_KERNELS:-fwd bwd}; do
        j=0
        for args in "${tune_sets[@]}"; do
          j=$((j + 1))
          # shellcheck disable=SC2086
          run_phase "tune-$kernel-$j" timeout "${TUNE_TIMEOUT:-300}" \
            python3 "benchmarks/tune_triton_$kernel.py" $args --out "$OUT/tune/triton_$kernel.json"
        done
      done
      ;;
    ktimes)
      # GPU time per kernel of ours against SDPA cuDNN (scripts/kernel_times.py); KT_ARGS holds
      # workloads separated by ";", e.g. "--seqlen 1024 --batch 16 --heads 32/8; --causal".
      IFS=';' read -ra kt_sets <<< "${KT_ARGS:-}"
      [[ ${#kt_sets[@]} -eq 0 ]] && kt_sets=("")
      for args in "${kt_sets[@]}"; do
        # shellcheck disable=SC2086
        timeout 300 python3 scripts/kernel_times.py --kernel-dir build --iters 10 $args \
          >>"$OUT/kernel_times.log" 2>&1 || { log "kernel_times failed: $args"; status=1; }
      done
      grep -E '^(B=|ours|sdpa)' "$OUT/kernel_times.log"
      ;;
    profile)
      # Nsight Compute counters of the sm90 forward and backward kernels (second launch of each)
      # on D=128 S=4k, full and causal. PROFILE_ARGS adds profile_kernels.py flags
      # (e.g. "--heads 32/8"); NCU_SECTIONS replaces the sections read.
      sections=${NCU_SECTIONS:-SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis WarpStateStats SchedulerStats Occupancy}
      ncu_args=(--clock-control none -k 'regex:fwd_kernel|bwd_kernel' --launch-skip 2 --launch-count 2)
      for section in $sections; do ncu_args+=(--section "$section"); done
      # PROFILE_SOURCE=1: also each kernel's stall samples per SASS instruction, as CSV under
      # $OUT/profile/ (the report is written to a file, then printed and exported from it)
      [[ ${PROFILE_SOURCE:-0} == 1 ]] && ncu_args+=(--section SourceCounters) && mkdir -p "$OUT/profile"
      for mask in "" --causal; do
        name="profile${mask:+-causal}"
        report=()
        [[ ${PROFILE_SOURCE:-0} == 1 ]] && report=(-f -o "$OUT/profile/$name")
        # shellcheck disable=SC2086
        run_phase "$name" timeout "${PROFILE_TIMEOUT:-240}" ncu "${ncu_args[@]}" "${report[@]}" \
          python3 scripts/profile_kernels.py --kernel-dir build $mask ${PROFILE_ARGS:-}
        if [[ ${PROFILE_SOURCE:-0} == 1 && -f $OUT/profile/$name.ncu-rep ]]; then
          ncu -i "$OUT/profile/$name.ncu-rep" >>"$OUT/$name.log" 2>&1
          ncu -i "$OUT/profile/$name.ncu-rep" --page source --csv --print-source sass \
            >"$OUT/profile/$name-sass.csv" 2>&1
          rm -f "$OUT/profile/$name.ncu-rep"
        fi
      done
      ;;
    bench)
      # BENCH_ARGS narrows the run, e.g. "--grid standard --seqlens 4k,16k --head-dims 128";
      # several commands separated by ";" run one after another (logs bench.log, bench-2.log, ...),
      # each into its own run folder under $OUT/bench.
      IFS=';' read -ra bench_sets <<< "${BENCH_ARGS:---grid standard}"
      i=0
      for args in "${bench_sets[@]}"; do
        i=$((i + 1))
        # shellcheck disable=SC2086
        run_phase "bench$([[ $i -gt 1 ]] && echo "-$i")" timeout "${BENCH_TIMEOUT:-1200}" \
          python3 -m flash_attn_hub bench $args --kernel-dir build --out "$OUT/bench" --no-progress
      done
      ;;
    hub)
      # HUB_ARGS adds flags, e.g. "--no-transformers" when only the train phase needs the Hub.
      # shellcheck disable=SC2086
      run_phase hub python3 -m flash_attn_hub release --allow-dirty ${HUB_ARGS:-}
      ;;
    train)
      # Ours comes from the embedded Hub that the hub phase published to (run it first), served
      # here on 127.0.0.1 for the length of the run. TRAIN_ARGS adds flags, e.g. "--steps 200".
      python3 -m flash_attn_hub hub serve --port 8765 >"$OUT/train-hub.log" 2>&1 &
      hub_pid=$!
      for _ in $(seq 50); do
        grep -q "Hub serving" "$OUT/train-hub.log" 2>/dev/null && break
        sleep 0.2
      done
      if ! grep -q "Hub serving" "$OUT/train-hub.log" 2>/dev/null; then
        log "phase train FAILED: the embedded Hub did not start; tail of train-hub.log:"
        tail -n 20 "$OUT/train-hub.log"
        status=1
      else
        # shellcheck disable=SC2086
        run_phase train timeout "${TRAIN_TIMEOUT:-900}" python3 benchmarks/train_trl.py \
          --endpoint http://127.0.0.1:8765 --out "$OUT/train" ${TRAIN_ARGS:-}
      fi
      kill "$hub_pid" 2>/dev/null
      ;;
    *)
      log "unknown phase $phase"; status=1 ;;
  esac
done
# Results come back as few files (a GPU machine may return only a handful): one archive per
# result folder, and one for every log.
# A second invocation into the same $OUT archives under a new name (NAME-<time>-<pid>.tgz), so
# the first one's archives survive.
archive_name() {
  if [[ -e $OUT/$1.tgz ]]; then echo "$1-$(date +%H%M%S)-$$.tgz"; else echo "$1.tgz"; fi
}
for dir in bench train tune profile; do
  if [[ -d $OUT/$dir ]]; then
    tar czf "$OUT/$(archive_name "$dir")" -C "$OUT" "$dir" && rm -rf "${OUT:?}/$dir"
  fi
done
(cd "$OUT" && shopt -s nullglob && logs=(*.log gpu*.txt) && [[ ${#logs[@]} -gt 0 ]] &&
  tar czf "$(archive_name logs)" "${logs[@]}" && rm -f "${logs[@]}")
log "done, status $status"
exit $status
