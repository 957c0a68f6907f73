#!/usr/bin/env bash
# One call on a GPU machine: set up, build the CUDA variant, test it, benchmark it against the
# peers, publish it to an embedded Hub and load it back, and train. Phases run in the order
# given (default: setup build test bench hub):
#
#   bash tools/gpu_run.sh [setup] [build] [lab] [test] [sanitize] [bench] [page] [ab] [host] [hub] [train]
#
# setup     installs the wheels carried in .whl/ (what the GPU image lacks: kernels,
#           huggingface_hub, CUTLASS's headers, ...) and .whl-transformers/ into /tmp/site, and FlashAttention-4 and
#           FlashInfer from the two halves of .fa4/ and .flashinfer/ (tools/README.md) when they
#           are there; records GPU and versions.
#           Every call needs it: what it exports does not outlive the call.
# build     the CUDA variant into build/ (python -m flash_attn_hub build --backend cuda), then
#           checked; the later phases load it from there. A carried .cuda-objects.tgz (the
#           $OUT/cuda-objects.tgz of an earlier call) spares recompiling unchanged sources.
# lab       a second build, for an A/B of two builds (tools.ab_bench --kernel-dir-of
#           NAME=$LAB_DIR, default /tmp/lab): this tree with the files carried under .lab/
#           (ignored, never committed; the same relative paths, e.g. .lab/csrc/hopper/softmax.h)
#           laid over it. Built in place after build, so the object cache's keys (absolute
#           include paths) match and only what .lab/ changes compiles; its variant then moves
#           to $LAB_DIR and the tree and build/ are put back as they were.
# test      the GPU tests (pytest -m gpu) against that build; TEST_ARGS narrows them
#           (e.g. "tests/test_cuda_bwd.py -k gqa").
# sanitize  compute-sanitizer's memcheck, racecheck and synccheck on the tests marked sanitize.
# bench     python -m flash_attn_hub bench (the release grid unless BENCH_ARGS says otherwise)
#           into $BENCH_PAGE (default /tmp/bench-page: it outlives the call on a warm machine),
#           archived to $OUT/bench.tgz. One head dim of the release grid takes a call
#           (BENCH_ARGS="--head-dims 64", then "--head-dims 128 --append", ...); the page phase
#           runs the whole release page over as many calls as it needs.
# page      the release page: bench's commands for it (PAGE_STEPS below) in order, each with
#           --resume, into $BENCH_PAGE, until PAGE_UNTIL seconds (default 570) after this script
#           started; what a call leaves undone the next call on the same warm machine goes on with
#           (PAGE_FRESH=1 starts a new page). Archived to $OUT/bench.tgz like bench's.
# ab        python -m tools.ab_bench with AB_ARGS: run-time variants of one build A/B'd in
#           alternating bench processes (tools/ab_bench.py), archived to $OUT/ab.tgz.
# host      python -m tools.host_overhead HOST_ROUNDS times (default 3) with HOST_ARGS (default
#           "--kvcache --seqlen-k 4096 --calls 3000"): eager and graph host time per call, ours
#           against SDPA in each process; every round's table is printed. HOST_BASE names a
#           second build directory (another lane, say) run alternately with build/ in each round.
# hub       python -m flash_attn_hub release: build, check, publish to an embedded Hub, verify.
# train     benchmarks/train_trl.py, loading ours from the embedded Hub that hub published to
#           (run hub first); TRAIN_ARGS adds flags.
#
# Logs go to $OUT (default ./gpu-out), archived with the results as a few .tgz files. A tree
# copied without .git names its commit in the file .git_sha (written by whoever copies it).
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
BENCH_PAGE=${BENCH_PAGE:-/tmp/bench-page}
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

for phase in "${phases[@]}"; do
  case $phase in
    setup)
      # .whl-transformers/ (transformers 5.22: the image's 5.17 refuses the carried
      # huggingface_hub 2.x) only where transformers runs: the GPU tests, hub, train. A later call
      # on the same warm machine may leave either behind (to carry .fa4/b, say): /tmp/site stays
      # from the call that installed it.
      for wheels in .whl .whl-transformers; do
        compgen -G "$wheels/*.whl" >/dev/null || continue
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site "$wheels"/*.whl || exit 1
      done
      [[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      export CUTLASS_INCLUDE=${CUTLASS_INCLUDE:-/tmp/site/cutlass_library/source/include}
      # CUTLASS's headers alone (tools/cutlass-headers.sh), where the nvidia-cutlass wheel is not
      if [[ -f .whl/cutlass-include.tar.xz && ! -d $CUTLASS_INCLUDE/cute ]]; then
        mkdir -p "$CUTLASS_INCLUDE" && tar -xJf .whl/cutlass-include.tar.xz -C "$CUTLASS_INCLUDE" || exit 1
      fi
      # FlashAttention-4 travels in two halves (over one call's carry limit): a call carrying
      # .fa4/a leaves the first in /root/fa4, a later call carrying .fa4/b installs both.
      if [[ -f .fa4/a/part.00 ]]; then
        mkdir -p /root/fa4 && cp .fa4/a/* /root/fa4/
      fi
      if [[ -f .fa4/b/install.sh && -f /root/fa4/part.00 ]]; then
        [[ -d /tmp/fa4site/flash_attn ]] || bash .fa4/b/install.sh /tmp/fa4site >"$OUT/fa4-install.log" 2>&1 ||
          { log "FA4 install failed; tail of fa4-install.log:"; tail -n 20 "$OUT/fa4-install.log"; status=1; }
        export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
      fi
      # FlashInfer the same way (tools/flashinfer-carry.sh): .flashinfer/a, then .flashinfer/b.
      # Its kernels compile on first use into FLASHINFER_WORKSPACE_BASE (kept on a warm machine);
      # ninja, its build tool, comes as a wheel whose script lands in $fisite/bin.
      fihalf=${FLASHINFER_HALF_DIR:-/root/flashinfer} fisite=${FLASHINFER_SITE:-/tmp/fisite}
      if [[ -f .flashinfer/a/part.00 ]]; then
        mkdir -p "$fihalf" && cp .flashinfer/a/* "$fihalf"/
      fi
      if [[ -f .flashinfer/b/install.sh && -f $fihalf/part.00 ]]; then
        [[ -d $fisite/flashinfer ]] || bash .flashinfer/b/install.sh "$fisite" "$fihalf" \
          >"$OUT/flashinfer-install.log" 2>&1 ||
          { log "FlashInfer install failed; tail of flashinfer-install.log:"; tail -n 20 "$OUT/flashinfer-install.log"
            status=1; }
        export PYTHONPATH=$fisite${PYTHONPATH:+:$PYTHONPATH}
        export PATH=$fisite/bin:$PATH
        export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
      fi
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
      # Versions from the installed metadata: importing transformers fails when the image's copy
      # does not accept the carried huggingface_hub (the train and hub phases need the carried one).
      python3 -c "import torch; from importlib.metadata import version as v; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), *(f'{n} {v(n)}' for n in ('triton', 'kernels', 'huggingface_hub', 'transformers')))" | tee -a "$OUT/gpu.txt"
      python3 -c "from flash_attn.cute import flash_attn_func; from importlib.metadata import version; print('flash-attn-4', version('flash-attn-4'))" 2>/dev/null | tee -a "$OUT/gpu.txt"
      python3 -c "import flashinfer; from importlib.metadata import version; print('flashinfer-python', version('flashinfer-python'))" 2>/dev/null | tee -a "$OUT/gpu.txt"
      ;;
    build)
      # Objects compiled on an earlier GPU machine travel as $CUDA_OBJECTS (carry it): the
      # build reuses each one whose compiler, flags, source and headers are unchanged
      # (build_cuda.py's cache), so a fresh machine recompiles only what changed. The objects
      # after this build go back as $OUT/cuda-objects.tgz, to carry next time.
      cache=${FLASH_ATTN_HUB_CACHE:-build/.cache/cuda}
      if [[ -f ${CUDA_OBJECTS:-.cuda-objects.tgz} ]]; then
        mkdir -p "$cache" && tar xzf "${CUDA_OBJECTS:-.cuda-objects.tgz}" -C "$cache"
      fi
      run_phase build python3 -m flash_attn_hub build --backend cuda
      [[ -d $cache/obj ]] && tar czf "$OUT/cuda-objects.tgz" -C "$cache" obj
      variant=$(tail -n 1 "$OUT/build.log")  # build prints the variant path last
      [[ -n $variant ]] && run_phase check python3 -m flash_attn_hub check "$variant"
      ;;
    lab)
      lab=${LAB_DIR:-/tmp/lab} keep=/tmp/lab-keep
      if [[ ! -d .lab ]] || ! compgen -G "build/*/" >/dev/null; then
        log "phase lab FAILED: it needs a carried .lab/ and the build phase's build/"; status=1; continue
      fi
      rm -rf "$lab" "$keep" && mkdir -p "$lab" "$keep/tree" "$keep/build"
      mapfile -t files < <(cd .lab && find . -type f -printf '%P\n')
      for f in "${files[@]}"; do  # the originals (a file .lab/ adds has none: it is removed after)
        [[ -f $f ]] && mkdir -p "$keep/tree/$(dirname "$f")" && cp -p "$f" "$keep/tree/$f"
      done
      mv build/* "$keep/build/"
      cp -r .lab/. .
      run_phase lab-build python3 -m flash_attn_hub build --backend cuda
      compgen -G "build/*" >/dev/null && mv build/* "$lab/"
      mv "$keep/build/"* build/
      for f in "${files[@]}"; do
        if [[ -f $keep/tree/$f ]]; then cp -p "$keep/tree/$f" "$f"; else rm -f "$f"; fi
      done
      log "lab build in $lab: $(ls "$lab")"
      ;;
    test)
      # Triton compiles on the CPU, so the tests run in TEST_WORKERS processes sharing the GPU.
      # 12 ran an 80 GB card out of memory (the transformers end-to-end tests load models).
      # shellcheck disable=SC2086
      run_phase test timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -m gpu -q -rfE \
        -p no:cacheprovider -n "${TEST_WORKERS:-6}" ${TEST_ARGS:-tests}
      ;;
    sanitize)
      # The sanitize tests keep cuBLAS out of the run where they can (references on the CPU):
      # racecheck reported hazards inside cuBLAS's own Hopper GEMMs, and excluding those kernels
      # from instrumentation made the tool fail on a hardware exception.
      for tool in memcheck racecheck synccheck; do
        run_phase "sanitize-$tool" timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer \
          --tool "$tool" --error-exitcode 1 \
          python3 -m pytest -m "gpu and sanitize" -q -p no:cacheprovider tests
      done
      ;;
    bench)
      # shellcheck disable=SC2086
      run_phase bench timeout "${BENCH_TIMEOUT:-570}" python3 -m flash_attn_hub bench --into "$BENCH_PAGE" \
        --kernel-dir build --no-progress ${BENCH_ARGS:-}
      [[ -f $BENCH_PAGE/results.csv ]] && tar czf "$OUT/bench.tgz" -C "$BENCH_PAGE" .
      ;;
    page)
      [[ ${PAGE_FRESH:-0} == 1 ]] && rm -rf "$BENCH_PAGE"
      peers=ours-cuda,ours-triton,fa4,sdpa-cudnn,flex
      PAGE_STEPS=("--head-dims 128 --providers $peers" "--head-dims 64 --providers $peers"
                  "--head-dims 256 --providers $peers" "--grid softcap --providers ours-cuda,ours-triton,fa4,flex")
      steps_done=0
      for i in "${!PAGE_STEPS[@]}"; do
        left=$((${PAGE_UNTIL:-570} - SECONDS))
        if ((left < 30)); then log "page: no time left for step $i (${PAGE_STEPS[$i]})"; status=1; break; fi
        # shellcheck disable=SC2086
        run_phase "page-$i" timeout "$left" python3 -m flash_attn_hub bench --into "$BENCH_PAGE" \
          --kernel-dir build --no-progress --resume ${PAGE_STEPS[$i]} || break
        steps_done=$((i + 1))
      done
      if ((steps_done == ${#PAGE_STEPS[@]})); then
        log "page: complete, all $steps_done steps"
      else
        log "page: $steps_done of ${#PAGE_STEPS[@]} steps done; the page phase again goes on from there"
      fi
      [[ -f $BENCH_PAGE/results.csv ]] && tar czf "$OUT/bench.tgz" -C "$BENCH_PAGE" .
      ;;
    ab)
      # tools/ab_bench.py: AB_ARGS holds its flags, then -- and bench's (e.g. "--variant
      # old=FAH_X=0 --variant new= --rounds 2 -- --grid main --modes bwd --head-dims 128
      # --providers ours-cuda,sdpa-cudnn"); the pages and summary.csv go back as $OUT/ab.tgz.
      # AB_ARGS is split on white space and nothing else: quotes inside it stay literal. A value
      # that starts with "-" takes the --flag=value form (--match=-b1-sq1-.*page16). A lab copy of
      # build/ for run-time variants belongs outside the tree (/tmp/lab): an untracked folder in
      # the repository is not kept between calls.
      rm -rf /tmp/ab
      # shellcheck disable=SC2086
      run_phase ab timeout "${AB_TIMEOUT:-570}" python3 -m tools.ab_bench --out /tmp/ab ${AB_ARGS:-}
      [[ -d /tmp/ab ]] && tar czf "$OUT/ab.tgz" -C /tmp ab
      ;;
    host)
      # The host is noisy from process to process: compare ours with SDPA inside one process,
      # and builds only in alternating processes (docs/performance.md, Decode).
      for round in $(seq "${HOST_ROUNDS:-3}"); do
        for dir in ${HOST_BASE:-} build; do
          log "host round $round, $dir"
          # shellcheck disable=SC2086
          timeout "${HOST_TIMEOUT:-90}" python3 -m tools.host_overhead --kernel-dir "$dir" \
            --profile-lines 0 ${HOST_ARGS:---kvcache --seqlen-k 4096 --calls 3000} 2>&1 |
            grep -E "host time|eager|Error" || status=1
        done
      done
      ;;
    hub)
      # HUB_ARGS adds flags, e.g. "--no-transformers" when only the train phase needs the Hub.
      # shellcheck disable=SC2086
      run_phase hub python3 -m flash_attn_hub release --allow-dirty ${HUB_ARGS:-}
      ;;
    train)
      # Ours comes from the embedded Hub that the hub phase published to, served here on
      # 127.0.0.1 for the length of the run.
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
        run_phase train timeout "${TRAIN_TIMEOUT:-540}" python3 benchmarks/train_trl.py \
          --endpoint http://127.0.0.1:8765 --out "$OUT/train" ${TRAIN_ARGS:-}
      fi
      kill "$hub_pid" 2>/dev/null
      ;;
    *)
      log "unknown phase $phase"; status=1 ;;
  esac
done
# A GPU machine may return only a handful of files: the train folder and the logs as archives.
if [[ -d $OUT/train ]]; then
  tar czf "$OUT/train.tgz" -C "$OUT" train && rm -rf "${OUT:?}/train"
fi
(cd "$OUT" && shopt -s nullglob && logs=(*.log gpu*.txt) && [[ ${#logs[@]} -gt 0 ]] &&
  tar czf logs.tgz "${logs[@]}" && rm -f "${logs[@]}")
log "done, status $status"
exit $status
