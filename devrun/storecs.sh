#!/usr/bin/env bash
# The short-row forward with and without streaming (evict-first) stores, each against torch.compile.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/coc
for e in "" "NORM_STORE_CS=1"; do echo "== EXTRA_DEFINES=$e"; EXTRA_DEFINES=$e HIDDEN=256,1000 STAGES=0,3 timeout 140 python3 devrun/subwarp.py rms ln 2>&1 | grep -E "rows=|t128_r8_c1_v8$|t64_r2_c1_v8$|t256_r8_c1_v8_s3|t128_r16_c1_v8$|WRONG" ; done
