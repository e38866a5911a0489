#!/usr/bin/env bash
# After norm_a.sh-style install (A) and .qa in /tmp/qa (B): QuACK part b, then the norms benchmark.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
cp .qb/* /tmp/qa/ && cd /tmp/qa && cat cu13.part.aa cu13.part.ab > nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl && rm -f cu13.part.* && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/qsite *.whl; cd - >/dev/null
export PYTHONPATH=$PYTHONPATH:/tmp/qsite:/tmp/qsite/nvidia_cutlass_dsl/dsl_packages
python3 -c "import quack.rmsnorm; print('quack ok')" 2>&1 | tail -1
export CUTLASS_OPS_CACHE_DIR=/tmp/bench_cache CUTLASS_OPS_COMMIT=${COMMIT:-unknown}
timeout 540 python3 benchmarks/norms.py --plot 2>&1 | grep -v "^W1121" | tail -45
cp benchmarks/results/norms.json benchmarks/results/norms.png $OUT/ 2>/dev/null
