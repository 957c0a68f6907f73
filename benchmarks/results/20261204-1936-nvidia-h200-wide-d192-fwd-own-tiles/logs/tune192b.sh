#!/usr/bin/env bash
# The D=192 forward tile at 3 stages with and without descriptors, at 4k and 16k (the quick
# search of 20261204-1936 timed only one of the two at each length).
R=$OUT; export OUT=$R/a; mkdir -p $OUT
bash scripts/gpu_run.sh setup > /dev/null
export PYTHONPATH=/tmp/site
for s in 4096 16384; do
  timeout 120 python3 benchmarks/tune_triton_fwd.py --quick --head-dims 192 --seqlens $s \
    --space num_stages=3 --space tma=0,1 --out $OUT/t.json > $OUT/tune-192b-$s.log 2>&1
  cut -c1-200 $OUT/tune-192b-$s.log | tail -n 8
done
