#!/usr/bin/env bash
# The cluster reduction through st.async and mbarriers: GPU norm tests, the sanitizers, and the
# forward against the cluster-barrier reduction at 262144 / 65536 (devrun/ln262_sweep.py).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_TEST_CACHE_DIR=/tmp/ct CUTLASS_OPS_CACHE_DIR=/tmp/ct
timeout 200 python3 -m pytest -q -x -m gpu tests/gpu/test_norms_gpu.py -p no:logging -p no:cacheprovider 2>&1 | tail -4
timeout 200 python3 devrun/ln262_sweep.py ln rms 2>&1 | tee $OUT/sweep.txt
HIDDEN=65536 timeout 100 python3 devrun/ln262_sweep.py lnh rmsh 2>&1 | tee -a $OUT/sweep.txt
python3 tests/gpu/sanitize_norms.py 2>&1 | tail -3
for tool in memcheck racecheck synccheck; do
  timeout 100 compute-sanitizer --tool $tool --report-api-errors no --kernel-name kns=norm_ python3 tests/gpu/sanitize_norms.py > $OUT/san_$tool.txt 2>&1
  echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/san_$tool.txt | tail -1)"
done
