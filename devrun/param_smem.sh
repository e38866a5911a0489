#!/usr/bin/env bash
# Parameters in shared memory: the GPU test of the new configs, then the placement sweeps.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_TEST_CACHE_DIR=/tmp/ct CUTLASS_OPS_CACHE_DIR=/tmp/ct
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_norms_gpu.py -k parameters_in_shared -p no:cacheprovider 2>&1 | tail -4
timeout 200 python3 devrun/param_sweep.py ln 32768 65536 262144 2>&1 | grep -v "^W1121" | tee $OUT/ln.txt
timeout 120 python3 devrun/param_sweep.py rms 32768 262144 2>&1 | grep -v "^W1121" | tee $OUT/rms.txt
