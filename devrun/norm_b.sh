#!/usr/bin/env bash
# Call B: stash QuACK's first half in /tmp (call C brings the second); sanitizers on our kernels.
mkdir -p /tmp/qa && cp .qa/* /tmp/qa/ && ls /tmp/qa | wc -l
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUTLASS_OPS_CACHE_DIR=/tmp/ct
for tool in memcheck racecheck synccheck; do
  timeout 150 compute-sanitizer --tool $tool --report-api-errors no --kernel-name kns=norm_ python3 tests/gpu/sanitize_norms.py > $OUT/san_$tool.txt 2>&1
  echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/san_$tool.txt | tail -1)"
done
