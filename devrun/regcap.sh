#!/usr/bin/env bash
# Short-row forward with registers capped at 32 (NORM_MAX_REGS, __launch_bounds__ minimum
# blocks) against uncapped, each run against torch.compile (hidden 256: t128_r8 uses 38-40).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/rc
for rep in 1 2; do
for e in "" "NORM_MAX_REGS=32"; do echo "== EXTRA_DEFINES=$e"; EXTRA_DEFINES=$e HIDDEN=256 STAGES=0 timeout 100 python3 devrun/subwarp.py ${KINDS:-rms ln} 2>&1 | grep -E "rows=|(torch.compile|t128_r8_c1_v8|t64_r4_c1_v8|t128_r4_c1_v8)$|WRONG"; done
done
