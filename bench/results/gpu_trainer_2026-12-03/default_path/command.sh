#!/bin/bash
# The CUDA tests of the trainer, sampler and checkpoint files, then bench.gpu_trainer's engine rows, on one H200.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
chmod +x /tmp/site/bin/* 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu,power.draw --format=csv > $OUT/nvsmi.txt
cat .whl/commit.txt > $OUT/commit.txt
t0=$(date +%s)
timeout 150 python3 -m pytest -p no:cacheprovider -p no:xdist -v -k "cuda or tensor_file" services/trainer/tests \
  services/sampler/tests libs/checkpoints/tests 2>&1 | grep -a -v -i "warn" | tail -60 > $OUT/cuda_tests.txt
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.txt
tail -8 $OUT/cuda_tests.txt
t0=$(date +%s)
timeout 300 python3 -m bench.gpu_trainer --out /tmp/b --deadline 280 --sections env,attention,engine,optimizer 2>&1 | grep -a -v -i "warn\|Loading weights" > $OUT/log.txt
echo "bench: $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.txt
cp /tmp/b/results.json /tmp/b/summary.md $OUT/ 2>/dev/null
grep -a "!!" $OUT/log.txt | cut -c1-400 | head
sed -n '/loss path/,$p' $OUT/summary.md | grep -v "^$" | head -40
