#!/usr/bin/env bash
# A/B of the D=64 backward: the branch's tree (exp) against main's two bwd headers (base).
R=$OUT
export OUT=$R/exp; mkdir -p $OUT
bash scripts/gpu_run.sh setup build cudabwd
rm -rf /tmp/exprepo; mkdir -p /tmp/exprepo; mv build /tmp/exprepo/build
cp .device-carry/main_csrc/bwd_kernel.h .device-carry/main_csrc/bwd_traits.h csrc/hopper/
export OUT=$R/base; mkdir -p $OUT
bash scripts/gpu_run.sh setup build
export PYTHONPATH=/tmp/site
for w in "--head-dim 64 --heads 32/32" "--head-dim 64 --heads 32/32 --causal" "--head-dim 64 --heads 32/8" "--head-dim 64 --heads 32/32 --seqlen 16384 --batch 1"; do
  reps="1 2"; [[ $w == *32/8* || $w == *16384* ]] && reps=1
  for rep in $reps; do
    for v in exp base; do
      d=build; [[ $v == exp ]] && d=/tmp/exprepo/build
      echo "== $v rep$rep: $w" >> $R/ab.log
      timeout 200 python3 scripts/kernel_times.py --kernel-dir $d --iters 10 $w >> $R/ab.log 2>&1
    done
  done
done
grep -E '^(==|B=|ours|sdpa)|bwd_kernel' $R/ab.log | head -120
cd $R && tar czf all.tgz --remove-files exp base ab.log
