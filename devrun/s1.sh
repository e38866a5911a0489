#!/usr/bin/env bash
# Session call 1: the whole-tile epilogue at 1024x14336x4096, then the GPU tests' prebuild beside
# the norm sanitizer runs (correctness only, so the compile load does not matter there).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/coc CUTLASS_OPS_TEST_CACHE_DIR=/tmp/coc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv | tee $OUT/log.txt
start=$SECONDS
SHAPES=1024x14336x4096 REPS=200 timeout 300 python3 devrun/wide_mma.py 2>&1 | tail -40 | tee -a $OUT/log.txt
echo "wide_mma wall=$((SECONDS-start))s" | tee -a $OUT/log.txt
(python3 tests/gpu/prebuild.py > $OUT/prebuild.txt 2>&1; echo "prebuild rc=$? at $((SECONDS-start))s" >> $OUT/prebuild.txt) &
python3 tests/gpu/sanitize_norms.py 2>&1 | tail -6 | tee -a $OUT/log.txt
for tool in memcheck racecheck synccheck; do
  timeout 150 compute-sanitizer --tool $tool --report-api-errors no --kernel-name kns=norm_ python3 tests/gpu/sanitize_norms.py > $OUT/san_$tool.txt 2>&1
  echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/san_$tool.txt | tail -1)" | tee -a $OUT/log.txt
done
wait
tail -5 $OUT/prebuild.txt | tee -a $OUT/log.txt
echo "total wall=$((SECONDS-start))s" | tee -a $OUT/log.txt
