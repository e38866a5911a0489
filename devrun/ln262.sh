#!/usr/bin/env bash
# LayerNorm / RMSNorm forward at 262144 (devrun/ln262_sweep.py), and the heuristic's configs
# with NORM_FULL_ROW / NORM_FMA_FORM / NORM_SPLIT_ACC at 32768 / 65536.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/ncl
timeout 300 python3 devrun/ln262_sweep.py ln rms 2>&1 | tee $OUT/sweep.txt
for h in 4096 8192 32768 65536; do HIDDEN=$h timeout 150 python3 devrun/ln262_sweep.py lnh rmsh 2>&1 | tee -a $OUT/sweep.txt; done
export CUTLASS_OPS_TEST_CACHE_DIR=/tmp/ct CUTLASS_OPS_CACHE_DIR=/tmp/ct
timeout 240 python3 -m pytest -q -x -m gpu tests/gpu/test_norms_gpu.py -p no:logging -p no:cacheprovider 2>&1 | tail -8
