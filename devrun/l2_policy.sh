#!/usr/bin/env bash
# GPU run of devrun/l2_policy.py (the L2 flush's dirty lines and a streaming access policy).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=${CUTLASS_OPS_CACHE_DIR:-/tmp/coc}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv
python3 -c "import cuda.bindings; print('cuda-bindings', cuda.bindings.__version__)"
timeout ${LIMIT_S:-500} python3 devrun/l2_policy.py 2>&1 | tail -80
