#!/usr/bin/env bash
# After a kernel refactor: the GPU norm tests, the sanitizers on our kernels, a quick benchmark.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_TEST_CACHE_DIR=/tmp/cv CUTLASS_OPS_CACHE_DIR=/tmp/cv
timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_norms_gpu.py -p no:logging -p no:cacheprovider 2>&1 | tail -2
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --report-api-errors no --kernel-name kns=norm_ python3 tests/gpu/sanitize_norms.py > /tmp/san.txt 2>&1
  echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/san.txt | tail -1)"
done
export CUTLASS_OPS_CACHE_DIR=/tmp/bq
python3 benchmarks/norms.py --quick 2>&1 | grep -E "bf16|host"
