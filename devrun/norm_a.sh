#!/usr/bin/env bash
# Call A: GPU norm + tuning tests, sanitizers, host costs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_TEST_CACHE_DIR=/tmp/ct CUTLASS_OPS_CACHE_DIR=/tmp/ct
LOG=$OUT/a.txt
start=$SECONDS
timeout 420 python3 -m pytest -q -m gpu tests/gpu/test_norms_gpu.py -p no:logging -p no:cacheprovider 2>&1 | tail -25 > $OUT/pytest.txt
echo "pytest rc=$? wall=$((SECONDS-start))s" | tee -a $LOG; tail -5 $OUT/pytest.txt | tee -a $LOG
python3 tests/gpu/sanitize_norms.py 2>&1 | tail -6 | tee -a $LOG
for tool in memcheck racecheck synccheck; do
  timeout 150 compute-sanitizer --tool $tool --report-api-errors no --kernel-name kns=norm_ python3 tests/gpu/sanitize_norms.py > $OUT/san_$tool.txt 2>&1
  echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/san_$tool.txt | tail -1)" | tee -a $LOG
done
echo "total wall=$((SECONDS-start))s" | tee -a $LOG
