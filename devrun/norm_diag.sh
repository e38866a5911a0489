#!/usr/bin/env bash
# Norm diagnostics: config sweep with padded timing, host costs, ncu of the heuristic kernels.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/coc
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
python3 devrun/norm_sweep.py --json $OUT/sweep.json 2>&1 | tee $OUT/sweep.txt | grep -v "^   " | head -5
NCU="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis"
for c in "8192 fwd" "32768 fwd" "262144 fwd" "32768 bwd"; do
  set -- $c
  k=norm_fwd; [ $2 = bwd ] && k=norm_bwd
  timeout 120 $NCU -k regex:$k --launch-skip 2 --launch-count 1 python3 devrun/norm_one.py $1 $2 > $OUT/ncu_$1_$2.txt 2>&1
  echo "ncu $1 $2 rc=$?"
done
cat $OUT/sweep.txt
grep -h -E "Achieved Occupancy|Theoretical Occupancy|Registers Per|DRAM Throughput|Memory Throughput|Duration|Block Limit|Waves Per SM|Stall" $OUT/ncu_*.txt | head -80
