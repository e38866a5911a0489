#!/usr/bin/env bash
# Several rows per thread in the direct forward kernel (short rows) against torch.compile, and the
# long-row forward splits swept again (LayerNorm since one-reduction statistics; RMSNorm 262144).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/coc
HIDDEN=256 STAGES=0 timeout 200 python3 devrun/subwarp.py rms ln 2>&1 | grep -v "^W1121" > $OUT/rpt256.txt; echo "rpt256 rc=$?"
HIDDEN=1000 STAGES=0 timeout 90 python3 devrun/subwarp.py rms ln 2>&1 | grep -v "^W1121" > $OUT/rpt1000.txt; echo "rpt1000 rc=$?"
timeout 150 python3 devrun/ln_sweep.py ln 32768 65536 262144 > $OUT/ln_long.txt 2>&1; echo "ln_long rc=$?"
timeout 80 python3 devrun/ln_sweep.py rms 262144 > $OUT/rms_long.txt 2>&1; echo "rms_long rc=$?"
cat $OUT/*.txt | grep -v "^  *[0-9.]* us .*GB/s x" | head -5
