#!/usr/bin/env bash
# ncu of the long-row forward: LayerNorm 262144 (one stage, and persistent with two) against
# RMSNorm's persistent split, to see why LayerNorm sits at 0.86 of copy and RMSNorm at 0.90.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/ncl
NCU="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SchedulerStats --metrics l1tex__t_sector_hit_rate.pct,lts__t_sector_hit_rate.pct,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_membar"
run() { python3 devrun/norm_one_kind.py $1 $2 $3 >/dev/null 2>&1; timeout 100 $NCU -k regex:norm_fwd --launch-skip 2 --launch-count 1 python3 devrun/norm_one_kind.py $1 $2 $3 > $OUT/ncu_$1_$2_$3.txt 2>&1; echo "ncu $1 $2 $3 rc=$?"; }
run ln 262144 t512_r1_c8_v8_s1
run ln 262144 t512_r1_c8_v8_s2
run rms 262144 t512_r1_c8_v8_s2
run ln 32768 t512_r1_c1_v8_s1
for f in $OUT/ncu_*.txt; do echo "== $f"; grep -E "Duration|DRAM Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|l1tex__t_sector_hit|lts__t_sector_hit|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps Per" $f | head -30; done
