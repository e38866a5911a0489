#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
mkdir -p /tmp/coc && tar xzf .coctgz/coc.tgz -C /tmp/coc && export CUTLASS_OPS_CACHE_DIR=/tmp/coc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size python3 devrun/smallm_ncu.py > $OUT/ncu_torch.txt 2>&1
echo "ncu rc=$?"
grep -E "^\s+[a-zA-Z_0-9]+.*\(|gpu__time|dram__|launch__" $OUT/ncu_torch.txt | head -120
timeout 400 python3 devrun/smallm.py $OUT/smallm.json 2>&1 | tail -120
