#!/usr/bin/env bash
# Group splits (blocks of a row reducing through global memory): GPU test, then sweeps.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_TEST_CACHE_DIR=/tmp/ct CUTLASS_OPS_CACHE_DIR=/tmp/ct
timeout 200 python3 -m pytest -q -x -m gpu tests/gpu/test_norms_gpu.py -k persistent_forward -p no:cacheprovider 2>&1 | tail -4
SELECT=group timeout 220 python3 devrun/param_sweep.py ln 262144 65536 2>&1 | grep -v "^W1121" | tee $OUT/ln.txt
SELECT=group timeout 120 python3 devrun/param_sweep.py rms 262144 2>&1 | grep -v "^W1121" | tee $OUT/rms.txt
