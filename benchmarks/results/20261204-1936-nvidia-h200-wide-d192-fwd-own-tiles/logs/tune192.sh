#!/usr/bin/env bash
# Tune the Triton forward's D=192 bucket into the package's table, then build and benchmark it.
R=$OUT
export OUT=$R/a; mkdir -p $OUT
bash scripts/gpu_run.sh setup
export PYTHONPATH=/tmp/site
for s in 4096 16384; do
  timeout 200 python3 benchmarks/tune_triton_fwd.py --quick --head-dims 192 --seqlens $s \
    > $OUT/tune-192-$s.log 2>&1; tail -n 4 $OUT/tune-192-$s.log
done
cp torch-ext/flash_attn/triton_fwd_configs.json $OUT/
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_fwd.py -k "realistic and d192" > $OUT/test-d192.log 2>&1; tail -n 2 $OUT/test-d192.log
BENCH_ARGS="--grid wide --head-dims 192 --modes fwd" bash scripts/gpu_run.sh setup build bench
cd $R && tar czf all.tgz --remove-files a
