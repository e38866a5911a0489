#!/usr/bin/env bash
# Issue 3 on the GPU: cold tune of the LLM shapes, then (time permitting) the tuned benchmark in a
# separate process. The artifact and tuning caches come back as $OUT/coc.tgz for a later call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export CUTLASS_OPS_CACHE_DIR=/tmp/coc CUTLASS_OPS_COMMIT=${COMMIT:-unknown}
mkdir -p /tmp/coc; [ -f .coctgz/coc.tgz ] && tar xzf .coctgz/coc.tgz -C /tmp/coc
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee -a $LOG
REPO=$PWD
SHAPES=${SHAPES:-$(python3 benchmarks/gemm.py --print-shapes)}
cd /tmp
start=$SECONDS
timeout ${TUNE_S:-400} python3 -m tuning.cli tune $SHAPES --strategy ${STRATEGY:-default} --no-progress > /tmp/tune.txt 2> /tmp/tune.err
echo "tune rc=$? wall=$((SECONDS-start))s" | tee -a $LOG
cat /tmp/tune.txt >> $LOG; tail -5 /tmp/tune.err | tee -a $LOG
python3 -m tuning.cli export $OUT/tuning_export.json
du -sh /tmp/coc | tee -a $LOG
cd $REPO
if [ -n "$BENCH" ]; then
  timeout ${BENCH_S:-150} python3 benchmarks/gemm.py --tuned 2>&1 | tee -a $LOG
  cp benchmarks/results/gemm_tuned.json $OUT/ 2>/dev/null
fi
if [ -n "$WARM" ]; then
  cd /tmp; start=$SECONDS
  python3 -m tuning.cli tune $WARM --strategy ${STRATEGY:-default} --force --no-progress > /tmp/warm.txt 2>&1
  echo "warm re-tune of $WARM rc=$? wall=$((SECONDS-start))s" | tee -a $LOG; tail -8 /tmp/warm.txt | tee -a $LOG
fi
