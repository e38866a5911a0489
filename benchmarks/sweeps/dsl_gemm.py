"""The CuTe DSL GEMM path (``cutlass_ops.gemms.dsl``, QuACK's sm90 kernels) over the 16 LLM
shapes: every config, each shape's best beside torch.matmul. Needs ``cutlass-ops[dsl]``.

bf16, y = x W^T (W row-major [N, K], as nn.Linear holds it). Each config is compiled on its
first use (the cold time is recorded), checked against a float32 product on random data, then
timed as the tuner times (CUDA-graph replays, L2 flushed): every config briefly, then the best
three each interleaved with torch.matmul. A config whose launch cannot be captured in a CUDA
graph is recorded as a capture failure. Last, a second process plans the best kernels of three
shapes and times its first launch: what a warm disk cache costs instead of a compile.
Prints a table and writes ``benchmarks/results/sweep_dsl_gemm.json``
(``sweep_dsl_gemm_quick.json`` with ``--quick``: 3 shapes, 8 configs).

    python benchmarks/sweeps/dsl_gemm.py [--quick] [--shapes 4096x14336x4096 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.common import print_table, require_gpu_and_dsl, write_result  # noqa: E402
from benchmarks.gemm import LLM_SHAPES, tflops  # noqa: E402
from cutlass_ops.gemms import dsl  # noqa: E402
from cutlass_ops.gemms.config import DType  # noqa: E402
from custom_kernels.core.errors import CutlassOpsError  # noqa: E402
from custom_kernels.core.tolerances import GEMM, relative_error, relative_tolerance  # noqa: E402
from tuning.timing import GraphCaptureError, do_bench, do_bench_interleaved  # noqa: E402

FINALISTS = 3


def operands(m, n, k, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).div_(math.sqrt(k)).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    return x, w


def sweep_shape(m, n, k, configs, tolerance, compile_s: dict) -> dict:
    x, w = operands(m, n, k)
    reference = x.float() @ w.float().t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    first, failures = {}, {}
    for config in configs:
        try:
            launch = dsl.plan(config, x, w.t(), out)
            out.fill_(float("nan"))
            start = time.perf_counter()
            launch()
            torch.cuda.synchronize()
            compile_s.setdefault(config.name, time.perf_counter() - start)
            error = relative_error(out, reference)
            if not error <= tolerance:
                failures[config.name] = f"wrong result: relative error {error:.3g}"
                continue
            first[config] = do_bench(launch, warmup=3, reps=10, graph=True).median_ms
        except GraphCaptureError as exc:
            failures[config.name] = f"capture: {exc}"[:300]
        except (CutlassOpsError, RuntimeError, AssertionError, ValueError) as exc:
            failures[config.name] = f"launch: {type(exc).__name__}: {exc}"[:300]
    final = {}
    for config in sorted(first, key=first.get)[:FINALISTS]:
        launch = dsl.plan(config, x, w.t(), out)
        timings = do_bench_interleaved({"dsl": launch, "torch": lambda: torch.matmul(x, w.t())},
                                       reps=40, graph=True)
        final[config] = (timings["dsl"].median_ms, timings["torch"].median_ms)
    best = min(final, key=lambda c: final[c][0] / final[c][1]) if final else None
    ours_ms, torch_ms = final[best] if best else (math.nan, math.nan)
    if best is None:
        torch_ms = do_bench(lambda: torch.matmul(x, w.t()), reps=40, graph=True).median_ms
    return {
        "case": f"dsl best vs torch.matmul bf16 M={m} N={n} K={k}", "unit": "TFLOP/s",
        "ours": round(tflops(m, n, k, ours_ms), 1) if best else 0.0,
        "reference": round(tflops(m, n, k, torch_ms), 1), "reference_name": "torch.matmul",
        "ratio": round(torch_ms / ours_ms, 4) if best else 0.0, "correct": best is not None,
        "detail": {"config": best.name if best else None, "ours_ms": ours_ms,
                   "reference_ms": torch_ms,
                   "finalists": {c.name: {"ms": v[0], "torch_ms": v[1]}
                                 for c, v in final.items()},
                   "first_round_ms": {c.name: round(v, 5) for c, v in first.items()},
                   "failures": failures},
    }


def warm_process(picks: list[tuple]) -> dict:
    """A fresh process plans and launches each (shape, config) once: its first-launch times
    with the disk cache warm (import time apart)."""
    code = (
        "import json, sys, time, torch\n"
        "from cutlass_ops.gemms import dsl\n"
        "start = time.perf_counter(); dsl._interface(); imported = time.perf_counter() - start\n"
        "out = {'import_s': imported}\n"
        "for m, n, k, name in json.loads(sys.argv[1]):\n"
        "    x = torch.randn(m, k, device='cuda').bfloat16()\n"
        "    w = torch.randn(n, k, device='cuda').bfloat16()\n"
        "    y = torch.empty(m, n, device='cuda', dtype=torch.bfloat16)\n"
        "    torch.cuda.synchronize(); start = time.perf_counter()\n"
        "    dsl.plan(dsl.DslConfig.from_name(name), x, w.t(), y)(); torch.cuda.synchronize()\n"
        "    out[f'{m}x{n}x{k} {name}'] = time.perf_counter() - start\n"
        "print(json.dumps(out))\n")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(picks)], capture_output=True,
                            text=True, timeout=300)
    if result.returncode:
        return {"error": result.stderr[-600:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 shapes, 8 configs")
    parser.add_argument("--shapes", nargs="+", help="MxNxK (default: the 16 LLM shapes)")
    args = parser.parse_args()
    require_gpu_and_dsl()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else \
        (LLM_SHAPES[::6] if args.quick else LLM_SHAPES)
    tolerance = relative_tolerance(DType.BF16, GEMM)
    compile_s: dict = {}
    rows = []
    start = time.perf_counter()
    for m, n, k in shapes:
        configs = dsl.candidates(m, n, k)[:8] if args.quick else dsl.candidates(m, n, k)
        rows.append(sweep_shape(m, n, k, configs, tolerance, compile_s))
        r = rows[-1]
        print(f"{m}x{n}x{k}: {r['ratio']}x torch ({r['detail']['config']}), "
              f"{len(r['detail']['failures'])} failures", flush=True)
    wall = time.perf_counter() - start
    picks = [(*map(int, r["case"].split("M=")[1].replace("N=", "").replace("K=", "").split()),
              r["detail"]["config"]) for r in rows if r["detail"]["config"]][:3]
    warm = warm_process(picks)
    ratios = [r["ratio"] for r in rows if r["ratio"] > 0]
    geomean = statistics.geometric_mean(ratios) if ratios else 0.0
    print_table(["case", "ours", "reference", "ratio", "config"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["detail"]["config"]]
                 for r in rows])
    print(f"geomean {geomean:.4f} over {len(ratios)} shapes; sweep {wall:.0f} s; cold compiles "
          f"{sum(compile_s.values()):.0f} s for {len(compile_s)} kernels; warm process {warm}")
    import quack

    write_result("sweep_dsl_gemm_quick" if args.quick else "sweep_dsl_gemm", rows,
                 geomean=round(geomean, 4), sweep_seconds=round(wall, 1),
                 quack=getattr(quack, "__version__", "?"),
                 cold_compile_seconds={k: round(v, 2) for k, v in compile_s.items()},
                 warm_process_seconds=warm)


if __name__ == "__main__":
    main()
