"""Untuned baseline: a fixed handful of CUTLASS configs against torch.matmul on the LLM shapes.

bf16, y = x @ W^T (A row-major M x K, B = W^T column-major), L2 flushed before each repetition.
Ours is timed through ``cutlass_ops.plan`` (kernel plus its C++ launcher, checks done once),
torch through torch.matmul; the Python overhead of ``cutlass_ops.gemm`` is the integration
issue's benchmark.
"ours" is the best fixed config per shape; every config's figure is in ``detail``. Writes
benchmarks/results/gemm_untuned.json.

    python benchmarks/gemm.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import cutlass_ops  # noqa: E402
from benchmarks.common import copy_bandwidth_gbs, print_table, write_result  # noqa: E402
from cutlass_ops import GemmConfig, GemmOperands  # noqa: E402
from cutlass_ops.kernels import prepare  # noqa: E402
from tuning.timing import do_bench  # noqa: E402

FIXED_CONFIGS = [
    GemmConfig(kernel_schedule="cooperative", tile=(128, 256, 64), cluster=(1, 2, 1)),
    GemmConfig(kernel_schedule="cooperative", tile=(256, 128, 64), cluster=(1, 2, 1)),
    GemmConfig(kernel_schedule="cooperative", tile=(128, 256, 64), cluster=(1, 2, 1),
               tile_scheduler="streamk"),
    GemmConfig(kernel_schedule="pingpong", tile=(128, 128, 64), cluster=(1, 1, 1)),
    GemmConfig(kernel_schedule="pingpong", tile=(64, 256, 64), cluster=(1, 1, 1)),
    GemmConfig(kernel_schedule="pingpong", tile=(64, 128, 64), cluster=(2, 1, 1)),
]
LLM_SHAPES = [(m, n, k) for m in (16, 128, 1024, 4096, 16384)
              for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))] + [(8192, 8192, 8192)]


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def bench_shape(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    torch_ms = do_bench(lambda: torch.matmul(x, w.t())).median_ms
    per_config, correct = {}, True
    for config in FIXED_CONFIGS:
        try:
            out.fill_(float("nan"))
            launch = cutlass_ops.plan(x, w.t(), config=config, out=out)
            launch()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                correct = False
                per_config[config.name] = f"wrong: relative error {err:.3g}"
                continue
            ms = do_bench(launch).median_ms
            per_config[config.name] = round(tflops(m, n, k, ms), 1)
        except cutlass_ops.CutlassOpsError as exc:
            per_config[config.name] = f"failed: {exc}"[:300]
    timed = {name: v for name, v in per_config.items() if isinstance(v, float)}
    best = max(timed, key=timed.get) if timed else None
    ours = timed[best] if best else 0.0
    reference = round(tflops(m, n, k, torch_ms), 1)
    return {
        "case": f"bf16 M={m} N={n} K={k}", "unit": "TFLOP/s", "ours": ours,
        "reference": reference, "reference_name": "torch.matmul",
        "ratio": round(ours / reference, 4), "correct": correct and best is not None,
        "detail": {"config": best, "torch_ms": round(torch_ms, 5),
                   "ours_ms": round(2 * m * n * k / ours / 1e9, 5) if ours else None,
                   "configs": per_config},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="three shapes only, written to gemm_untuned_quick.json")
    args = parser.parse_args()
    shapes = LLM_SHAPES[::6] if args.quick else LLM_SHAPES
    operands = GemmOperands.make("bf16")
    built = prepare(operands, FIXED_CONFIGS)
    for config, result in built.items():
        status = "ok" if not isinstance(result, Exception) else f"FAILED: {result}"
        print(f"build {config.build_name}: {status}", flush=True)
    rows = [bench_shape(*shape) for shape in shapes]
    print_table(["case", "ours TFLOP/s", "torch TFLOP/s", "ratio", "correct", "config"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"],
                  r["detail"]["config"]] for r in rows])
    # --quick must not overwrite the full result that the issue names.
    path = write_result("gemm_untuned_quick" if args.quick else "gemm_untuned", rows,
                        copy_bandwidth_gbs=round(copy_bandwidth_gbs(), 1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
