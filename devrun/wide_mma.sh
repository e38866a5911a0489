#!/usr/bin/env bash
# GPU run of devrun/wide_mma.py (wave-filling tile widths with full-width wgmmas).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=${CUTLASS_OPS_CACHE_DIR:-/tmp/coc}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv
REPS=${REPS:-100} timeout ${LIMIT_S:-560} python3 devrun/wide_mma.py 2>&1 | tail -150
