#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/coc CUTLASS_OPS_TEST_CACHE_DIR=/tmp/coc
REPS=40 timeout 330 python3 devrun/smallm.py $OUT/sk.json sk_list 2>&1 | tail -70
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_tuning_gpu.py -p no:cacheprovider -p no:logging 2>&1 | tail -4
