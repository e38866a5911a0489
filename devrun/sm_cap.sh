#!/usr/bin/env bash
# devrun/sm_cap.py: is the long-row forward capped by the SMs its clusters occupy?
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/ncl
timeout 400 python3 devrun/sm_cap.py 2>&1 | tee $OUT/sm_cap.txt
