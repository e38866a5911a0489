"""Builds, in parallel, every kernel the GPU tests and the GEMM benchmark use (and the grouped
kernels a default ``cutlass-tune tune --grouped ... --backward`` tries), so that the tests then
run without compiling one kernel at a time. Run on the GPU machine before the GPU tests (or on a
machine with nvcc, carrying the cache over):

    CUTLASS_OPS_CACHE_DIR=... python tests/gpu/prebuild.py
"""

import itertools
import sys
import time
from pathlib import Path

root = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(root), str(Path(__file__).parent), str(Path(__file__).parent / "fp8")]

from benchmarks.gemm import FIXED_CONFIGS  # noqa: E402
from cutlass_ops import GemmConfig, GemmOperands  # noqa: E402
from cutlass_ops.gemms.loader import prepare  # noqa: E402
from test_epilogue_gpu import work as epilogue_work  # noqa: E402
from test_gemm_gpu import CONFIGS, STREAM_K  # noqa: E402
from test_fp8_cutlass_kernels_gpu import work as scaled_work  # noqa: E402

PINGPONG = CONFIGS["pingpong"]
WORK = [
    *((GemmOperands.make(dtype, layout_a=la, layout_b=lb), config)
      for dtype, (la, lb), config in itertools.product(
          ["bf16", "f16"], itertools.product(["row", "col"], repeat=2), CONFIGS.values())),
    (GemmOperands.make("bf16"), STREAM_K),
    (GemmOperands.make("bf16", out_dtype="f32"), PINGPONG),
    (GemmOperands.make("bf16", layout_c="col"), PINGPONG),
    (GemmOperands.make("f32"), GemmConfig(kernel_schedule="pingpong", tile=(128, 128, 32))),
    *((GemmOperands.make("bf16"), config) for config in FIXED_CONFIGS),
    *epilogue_work(),
    *scaled_work(),
]


def grouped_work():
    """The grouped kernels of the GPU tests (the default tile in each layout the forms use) and
    of a default grouped tune of an MoE layer's forward, dX and dW."""
    from cutlass_ops.gemms.grouped.grouped_build import GroupedConfig, GroupedProblem, candidates

    configs = [GroupedConfig(layout_a=la, layout_b=lb) for la, lb in ("tn", "nt", "tt")]
    for la, lb, m in (("t", "n", 64), ("t", "n", 1024), ("t", "t", 1024), ("n", "t", 4096)):
        configs += candidates(GroupedProblem("2d3d", 8, m, 4096, 4096, "bf16", la, lb))
    return list(dict.fromkeys(configs))


def main():
    import concurrent.futures

    start = time.time()
    by_operands = {}
    for operands, config in WORK:
        by_operands.setdefault(operands, []).append(config)
    # Emission is one cutlass_cppgen process per operand set; run those side by side too.
    from cutlass_ops.gemms.build import default_jobs
    from cutlass_ops.gemms.grouped.grouped_build import build as build_grouped
    from custom_kernels.core.errors import BuildError

    failed = 0
    if "--grouped-only" not in sys.argv:
        with concurrent.futures.ThreadPoolExecutor(len(by_operands)) as pool:
            futures = {pool.submit(prepare, operands, configs): operands
                       for operands, configs in by_operands.items()}
            for future in concurrent.futures.as_completed(futures):
                for config, result in future.result().items():
                    if isinstance(result, Exception):
                        failed += 1
                        print(f"FAILED {futures[future].name} {config.build_name}: {result}")
    grouped = grouped_work()
    with concurrent.futures.ThreadPoolExecutor(default_jobs()) as pool:
        for config, future in [(c, pool.submit(build_grouped, c)) for c in grouped]:
            try:
                future.result()
            except BuildError as exc:
                failed += 1
                print(f"FAILED {config.name}: {exc}")
    print(f"prebuilt {len(WORK)} GEMM and {len(grouped)} grouped kernels in "
          f"{time.time() - start:.0f} s, {failed} failed", flush=True)


if __name__ == "__main__":
    main()
