#!/usr/bin/env bash
# LayerNorm / RMSNorm long-row forward sweeps with the weight-register rule varied.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/ct
WEIGHT_REGS=-1,1 timeout 330 python3 devrun/long_sweep.py ln 32768 262144 65536 2>&1 | grep -v "^W1121" | tee $OUT/ln_long.txt
WEIGHT_REGS=-1,1 timeout 200 python3 devrun/long_sweep.py rms 262144 32768 2>&1 | grep -v "^W1121" | tee $OUT/rms_long.txt
