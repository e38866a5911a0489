#!/usr/bin/env bash
# Call A (GPU norm tests, sanitizers: norm_a.sh), then the LayerNorm forward sweeps again: short
# rows (direct splits, rows per thread) and long rows (staged splits).
bash devrun/norm_a.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUTLASS_OPS_CACHE_DIR=/tmp/ct
HIDDEN=256,1000 STAGES=0 timeout 150 python3 devrun/subwarp.py ln rms 2>&1 | grep -v "^W1121" > $OUT/short.txt; echo "short rc=$?"
timeout 120 python3 devrun/ln_sweep.py ln 32768 65536 262144 > $OUT/ln_long.txt 2>&1; echo "ln_long rc=$?"
