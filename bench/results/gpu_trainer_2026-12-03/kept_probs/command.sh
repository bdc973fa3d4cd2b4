#!/bin/bash
# The trainer's CUDA tests, then bench.gpu_trainer with every section, on one H200.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/trainer/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu,power.draw --format=csv > $OUT/nvsmi.txt
cat .whl/trainer/commit.txt > $OUT/commit.txt
t0=$(date +%s)
timeout 120 python3 -m pytest -p no:cacheprovider -v -k "cuda or tensor_file" services/trainer/tests \
  services/sampler/tests libs/checkpoints/tests 2>&1 | grep -a -v -i "warn" | tail -60 > $OUT/cuda_tests.txt
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.txt
tail -6 $OUT/cuda_tests.txt
t0=$(date +%s)
timeout 430 python3 -m bench.gpu_trainer --out /tmp/b --deadline 410 2>&1 | grep -a -v -i "warn\|Loading weights" > $OUT/log.txt
echo "bench: $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.txt
cp /tmp/b/results.json /tmp/b/summary.md $OUT/ 2>/dev/null
cd /tmp/b && tar czf $OUT/profiles.tgz profile_*.txt 2>/dev/null
grep -a "!!" $OUT/log.txt | cut -c1-400 | head
grep -v "^$" $OUT/summary.md | head -90
