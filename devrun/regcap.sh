#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/coc
for v in "0 -1 0" "0 -1 1"; do timeout 150 python3 devrun/regcap.py $v 2>&1 | grep -v Warning | tail -12; done
