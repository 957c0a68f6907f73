#!/usr/bin/env bash
# A/B of the CUDA backward's pipeline depth: 2 stages (base, the tree) against 3 (exp) at
# D=64, 128 and 192, both builds on this machine, timed in alternating processes.
R=$OUT
export OUT=$R/base; mkdir -p $OUT
bash scripts/gpu_run.sh setup build
rm -rf /tmp/baserepo; mkdir -p /tmp/baserepo; mv build /tmp/baserepo/build
python3 - <<'PY'
p = 'csrc/hopper/generate.py'
s = open(p).read()
for d in ("64: (64, 128, 2,", "128: (64, 128, 2,", "192: (64, 64, 2,"):
    assert d in s
    s = s.replace(d, d.replace(", 2,", ", 3,"))
open(p, 'w').write(s)
PY
python3 csrc/hopper/generate.py
export OUT=$R/exp; mkdir -p $OUT
CUDABWD_TIMEOUT=150 bash scripts/gpu_run.sh setup build cudabwd
export PYTHONPATH=/tmp/site
for w in "--head-dim 64 --heads 32/32" "--head-dim 64 --heads 32/32 --causal" "--head-dim 128 --heads 16/16" "--head-dim 128 --heads 16/16 --causal"; do
  for v in exp base; do
    d=build; [[ $v == base ]] && d=/tmp/baserepo/build
    echo "== $v: $w" >> $R/ab.log
    timeout 100 python3 scripts/kernel_times.py --kernel-dir $d --iters 10 $w >> $R/ab.log 2>&1
  done
done
grep -E '^(==|ours-cuda bwd|sdpa-cudnn bwd)' $R/ab.log
cd $R && tar czf all.tgz --remove-files exp base ab.log
