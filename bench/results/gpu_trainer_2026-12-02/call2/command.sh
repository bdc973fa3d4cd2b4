#!/bin/bash
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/gpu-trainer-whl/megatron*.whl .gpu/gpu-trainer-whl/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
O=/tmp/o; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu,power.draw --format=csv > $O/nvsmi.txt
cd .gpu/gpu-trainer
t0=$(date +%s)
PYTHONPATH=/tmp/site:$PWD timeout 85 python3 -m bench.gpu_trainer --out $O/new --deadline 400 \
  --sections engine,optimizer --backends "" --ce-workloads "" 2>&1 | grep -a -v -i "warn\|Loading weights" > $O/new_log.txt
echo "new: $(( $(date +%s) - t0 )) s" | tee -a $O/times.txt
cd /tmp && tar czf $OUT/all.tgz o
grep -a "choices\|!!" $O/new_log.txt | cut -c1-600
grep -v "^$" $O/new/summary.md | head -40
