"""GPU half of the epilogue-tile study (devrun/epi_tile_list.py; the compile-only half is
devrun/epi_tile_compile.py): builds the study's kernels in parallel, checks each on fresh random
bf16 data against a float32 torch.matmul, and times each beside torch.matmul, interleaved
repetition by repetition with the L2 flushed before each call (tuning.timing, BENCHMARKS.md), at
1024x14336x4096 (the shape where cuBLAS runs a 176-wide tile), 4096x14336x4096 and
1024x4096x4096. Prints a table per shape; writes $OUT/epi_tile.json (OUT defaults to /tmp).

    REPS=100 python devrun/epi_tile.py         # on the GPU machine; devrun/epi_tile.sh installs
                                               # the wheels first
"""
import json
import os
import sys
import time
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(Path(__file__).parent)]

import torch  # noqa: E402

import epi_tile_list  # noqa: E402
from benchmarks.common import print_table, versions  # noqa: E402
from cutlass_ops import space  # noqa: E402
from cutlass_ops.config import GemmProblem  # noqa: E402
from cutlass_ops.kernels import prepare_many  # noqa: E402
from tuning.backend import GpuSession  # noqa: E402
from tuning.choice import Choice  # noqa: E402

SHAPES = [(1024, 14336, 4096), (4096, 14336, 4096), (1024, 4096, 4096)]
REPS = int(os.environ.get("REPS", 100))


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def build(configs):
    start = time.time()
    ops = epi_tile_list.OPERANDS
    results = prepare_many([(ops, c) for c in configs], jobs=os.cpu_count())
    failed = {c.name: str(r)[:300] for (_, c), r in results.items() if isinstance(r, Exception)}
    print(f"built {len(configs) - len(failed)} of {len(configs)} in {time.time() - start:.0f} s",
          flush=True)
    for name, error in failed.items():
        print(f"  FAILED {name}: {error}", flush=True)
    built = [c for c in configs if not isinstance(results[(ops, c)], Exception)]
    smem = {c: _shared_storage_bytes(ops, c) for c in built}
    return built, failed, smem


def _shared_storage_bytes(ops, config):
    from cutlass_ops.kernels import kernel_for

    return kernel_for(ops, config).shared_storage_bytes


def bench_shape(m, n, k, configs, smem):
    problem = GemmProblem(epi_tile_list.OPERANDS, m, n, k)
    session = GpuSession(problem, torch.cuda.current_device())
    choices = [Choice(c) for c in configs]
    errors = {c: session.verify(c) for c in choices}
    ok = [c for c in choices if errors[c] is None]
    times, torch_ms = session.compare_ms(ok, REPS) if ok else ({}, session.torch_ms(REPS))
    session.close()
    case = f"bf16 M={m} N={n} K={k}"
    ref = round(tflops(m, n, k, torch_ms), 1)
    rows = []
    for c in choices:
        ms = times.get(c)
        ours = round(tflops(m, n, k, ms), 1) if ms else 0.0
        config = c.config
        rows.append({
            "case": case, "unit": "TFLOP/s", "ours": ours, "reference": ref,
            "reference_name": "torch.matmul", "ratio": round(ours / ref, 4),
            "correct": errors[c] is None,
            "detail": {"config": c.name, "tile": config.tile, "cluster": config.cluster,
                       "epilogue_tile": list(space.epilogue_tile_shape(config)),
                       "epilogue_tile_explicit": not config.epilogue_tile_is_auto,
                       "mainloop_stages": space.auto_stages(problem.operands, config),
                       "shared_storage_bytes": smem.get(config),
                       "ours_ms": round(ms, 5) if ms else None, "torch_ms": round(torch_ms, 5),
                       "verify_error": errors[c]}})
    rows.sort(key=lambda r: -r["ours"])
    print(f"== {case}: torch.matmul {ref} TFLOP/s ({torch_ms * 1e3:.1f} us)", flush=True)
    print_table(["TFLOP/s", "ratio", "ok", "tile", "cluster", "epilogue", "stages", "kernel"],
                [[r["ours"], r["ratio"], r["correct"], "x".join(map(str, r["detail"]["tile"][:2])),
                  "x".join(map(str, r["detail"]["cluster"][:2])),
                  "x".join(map(str, r["detail"]["epilogue_tile"]))
                  + ("" if r["detail"]["epilogue_tile_explicit"] else " auto"),
                  r["detail"]["mainloop_stages"],
                  r["detail"]["config"].removesuffix("-split1-rheuristic-sw1")] for r in rows])
    return rows


def main():
    torch.manual_seed(0)
    configs, failed, smem = build(epi_tile_list.configs())
    rows = [row for shape in SHAPES for row in bench_shape(*shape, configs, smem)]
    out = Path(os.environ.get("OUT", "/tmp")) / "epi_tile.json"
    out.write_text(json.dumps({
        "benchmark": "epi_tile", "gpu": torch.cuda.get_device_name(), "versions": versions(),
        "reps": REPS, "build_failures": failed, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
