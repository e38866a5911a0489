#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/coc
timeout 200 python3 devrun/short_rows.py 2>&1 | tail -150
M="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__waves_per_multiprocessor,smsp__cycles_active.avg"
for h in 256 1000; do
  timeout 120 ncu --clock-control none --metrics $M -k regex:"norm|triton" python3 devrun/short_rows.py ncu $h > $OUT/ncu_$h.txt 2>&1
  echo "== ncu $h"; grep -E "^\s+[a-zA-Z_].*\(.*\)x\(|duration|dram__|warps_active|grid_size|block_size|registers|shared_mem|occupancy_limit|waves|cycles_active" $OUT/ncu_$h.txt | sed 's/Context.*//' | tail -28
done
