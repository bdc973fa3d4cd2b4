#!/bin/bash
# bench.gpu_trainer's engine rows on one H200: the default loss path and each path forced, every workload.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/trainer/megatron*.whl .whl/trainer/msgspec*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu,power.draw --format=csv > $OUT/nvsmi.txt
cat .whl/commit.txt > $OUT/commit.txt
t0=$(date +%s)
timeout 560 python3 -m bench.gpu_trainer --out /tmp/b --deadline 540 --sections env,attention,engine 2>&1 | grep -a -v -i "warn\|Loading weights" > $OUT/log.txt
echo "bench: $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.txt
cp /tmp/b/results.json /tmp/b/summary.md $OUT/ 2>/dev/null
cd /tmp/b && tar czf $OUT/profiles.tgz profile_*.txt 2>/dev/null
grep -a "!!\|skipping" $OUT/log.txt | cut -c1-300 | head
sed -n '/loss path/,/Attention op/p' $OUT/summary.md | grep -v "^$"
