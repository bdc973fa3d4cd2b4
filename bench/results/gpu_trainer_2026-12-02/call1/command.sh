#!/bin/bash
# device call: CUDA tests of the branch, the baseline (dbc376a) engine+optimizer, the branch's bench
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/gpu-trainer-whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
O=/tmp/o; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu,power.draw --format=csv > $O/nvsmi.txt
ROOT=$PWD
cd $ROOT/.gpu/gpu-trainer
t0=$(date +%s)
PYTHONPATH=/tmp/site:$PWD timeout 80 python3 -m pytest -p no:cacheprovider -v -k cuda \
  services/trainer/tests/test_lora_copies.py services/trainer/tests/test_isolation.py \
  services/trainer/tests/test_fused_ce.py services/trainer/tests/test_optim_fused.py \
  services/trainer/tests/test_optim_cuda.py 2>&1 | grep -a -v -i "warn" | tail -60 > $O/cuda_tests.txt
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a $O/times.txt
tail -15 $O/cuda_tests.txt
cd $ROOT/.gpu/gpu-trainer-base
t0=$(date +%s)
PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m bench.gpu_trainer --out $O/base --deadline 400 \
  --sections engine,optimizer --backends "" --ce-workloads "" 2>&1 | grep -a -v -i "warn\|Loading weights" > $O/base_log.txt
echo "base: $(( $(date +%s) - t0 )) s" | tee -a $O/times.txt
cd $ROOT/.gpu/gpu-trainer
t0=$(date +%s)
PYTHONPATH=/tmp/site:$PWD timeout 185 python3 -m bench.gpu_trainer --out $O/new --deadline 400 \
  --sections env,engine,optimizer,hf,liger --backends "" --ce-workloads "4x1024,8x1024 8 tenants" 2>&1 | grep -a -v -i "warn\|Loading weights" > $O/new_log.txt
echo "new: $(( $(date +%s) - t0 )) s" | tee -a $O/times.txt
cd /tmp && tar czf $OUT/all.tgz o
cat $O/base/summary.md $O/new/summary.md 2>/dev/null | grep -v "^$" | head -80
