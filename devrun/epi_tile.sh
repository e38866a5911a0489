#!/usr/bin/env bash
# GPU run of the epilogue-tile study (devrun/epi_tile.py): wheels as the other devrun scripts.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=${CUTLASS_OPS_CACHE_DIR:-/tmp/coc}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv
REPS=${REPS:-100} timeout 560 python3 devrun/epi_tile.py 2>&1 | tail -120
