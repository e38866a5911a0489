#!/usr/bin/env bash
# The staging alignment: devrun/ab_align.py against 757d2e4's kernels (.old_csrc, from
# `git archive 757d2e4 custom_kernels/csrc`), then the GPU norm tests; then copies .qa for the
# benchmark call that follows (norm_bench_c.sh).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
CUTLASS_OPS_CACHE_DIR=/tmp/ncl timeout 120 python3 devrun/ab_align.py .old_csrc/custom_kernels/csrc 2>&1 | grep -v Traceback | tail -30 | tee $OUT/ab_align.txt
export CUTLASS_OPS_TEST_CACHE_DIR=/tmp/ct CUTLASS_OPS_CACHE_DIR=/tmp/ct
timeout 200 python3 -m pytest -q -x -m gpu tests/gpu/test_norms_gpu.py -p no:logging -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/tests.txt
