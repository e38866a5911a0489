"""Wave-filling tile widths with one wgmma per k-step (CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, now
in cutlass_ops.kernels.build_defines): without the macro CuTe split a 176-wide tile into 64x16
wgmmas and ran at 0.35-0.45x cuBLAS (devrun/epi_tile.py). Builds the widths that fill whole
waves of 132 SMs on the shapes below 1.0 in gemm_tuned.json, beside those shapes' tuned winners,
checks each on random data and times each beside torch.matmul, interleaved with the L2 flushed
(tuning.timing). Prints a table per shape; writes $OUT/wide_mma.json.

H200 at 6575466, ratio to torch.matmul (tuned winner first): 1024x14336x4096 128x128 c2x1 0.925,
64x224 0.940, 128x176 c1x1 / c2x1 / c1x2 0.933 / 0.931 / 0.927, 64x176 0.915, 128x160 0.875;
128x14336x4096 0.965, 128x112 0.960-0.962, 64x224 0.942; 4096x14336x4096 0.973, 128x224 c2x1
0.968, 128x208 0.95; 16384x14336x4096 0.988, 128x208 c2x1 0.949; 16384x4096x4096 1.005, swapped
128x160 0.998; 4096^3 0.980, 128x224 c2x1 0.895, 64x112 0.55-0.75; 8192^3 128x192 1.015,
128x224 c2x1 1.026, 128x176 0.996.
H200 at 48ae922 (SHAPES=1024x14336x4096 REPS=200, torch.matmul 695.6 TFLOP/s): 64x224 pingpong
0.950, 128x176 c1x1 0.940, c2x1 0.934, c1x2 0.929, 64x176 pingpong 0.925; 128x176 c2x1 with the
whole tile as one epilogue store (e128x176) 0.832: storing 176 columns at once loses 10%.
"""
import json
import os
import sys
import time
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root)]

import torch  # noqa: E402

from benchmarks.common import print_table, versions  # noqa: E402
from cutlass_ops.config import GemmConfig, GemmOperands, GemmProblem  # noqa: E402
from cutlass_ops.kernels import prepare_many  # noqa: E402
from tuning.backend import GpuSession  # noqa: E402
from tuning.choice import Choice  # noqa: E402

REPS = int(os.environ.get("REPS", 100))
OPS = GemmOperands.make("bf16")
WINNERS = {tuple(int(v.split("=")[1]) for v in r["case"].split()[1:]): r["detail"]["config"]
           for r in json.load(open(root / "benchmarks/results/gemm_tuned.json"))["rows"]}


def coop(tn, cluster=(1, 1, 1), tm=128, swap=False, **kw):
    return Choice(GemmConfig(kernel_schedule="cooperative", tile=(tm, tn, 64), cluster=cluster,
                             **kw), swap)


def pp(tn, cluster=(1, 1, 1), swap=False):
    return Choice(GemmConfig(kernel_schedule="pingpong", tile=(64, tn, 64), cluster=cluster), swap)


# Shape -> the wide tiles worth timing there (tiles / 132 SMs just under a whole number of waves).
STUDY = {
    (1024, 14336, 4096): [coop(176), coop(176, (2, 1, 1)), coop(176, (1, 2, 1)), pp(176),
                          pp(176, (2, 1, 1)), coop(160), pp(224),
                          # Not yet timed: the whole 176-wide tile in one epilogue store, instead
                          # of CUTLASS's eleven 128x16 ones (compiles since the extended shapes).
                          coop(176, (2, 1, 1), epilogue_tile=(128, 176))],
    (128, 14336, 4096): [coop(112), coop(112, (1, 2, 1)), pp(224), pp(112), pp(112, (1, 2, 1))],
    (4096, 14336, 4096): [coop(176), coop(176, (2, 1, 1)), coop(208), coop(208, (2, 1, 1)),
                          coop(224, (2, 1, 1))],
    (16384, 14336, 4096): [coop(208), coop(208, (2, 1, 1)), coop(176, (2, 1, 1))],
    (16384, 4096, 4096): [coop(160, swap=True), coop(160, (2, 1, 1), swap=True)],
    (4096, 4096, 4096): [coop(224, (2, 1, 1)), pp(112), pp(112, (2, 1, 1))],
    (8192, 8192, 8192): [coop(224, (2, 1, 1)), coop(208, (2, 1, 1)), coop(176, (2, 1, 1))],
}


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def main():
    torch.manual_seed(0)
    # SHAPES=MxNxK,... limits the study (and its builds) to those shapes.
    wanted = {tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", "").split(",") if s}
    study = {shape: [Choice.from_name(WINNERS[shape])] + extra for shape, extra in STUDY.items()
             if not wanted or shape in wanted}
    items = {(c.operands_for(OPS), c.replace(raster_order="heuristic", swizzle=1).config)
             for cs in study.values() for c in cs}
    start = time.time()
    built = prepare_many(sorted(items, key=lambda i: i[1].name), jobs=os.cpu_count())
    failed = {c.name: str(r)[:400] for (_, c), r in built.items() if isinstance(r, Exception)}
    print(f"built {len(items) - len(failed)} of {len(items)} in {time.time() - start:.0f} s",
          flush=True)
    for name, error in failed.items():
        print("  FAILED", name, error, flush=True)
    rows = []
    for (m, n, k), choices in study.items():
        problem = GemmProblem(OPS, m, n, k)
        choices = [c for c in choices if c.config.name not in failed
                   and c.replace(raster_order="heuristic", swizzle=1).config.name not in failed]
        session = GpuSession(problem, torch.cuda.current_device())
        errors = {c: session.verify(c) for c in choices}
        ok = [c for c in choices if errors[c] is None]
        times, torch_ms = session.compare_ms(ok, REPS)
        session.close()
        ref = tflops(m, n, k, torch_ms)
        shape_rows = []
        for c in choices:
            ms = times.get(c)
            ours = tflops(m, n, k, ms) if ms else 0.0
            p = c.problem_for(problem)
            tm, tn, _ = c.config.tile
            tiles = -(-p.m // tm) * -(-p.n // tn)
            shape_rows.append({"shape": [m, n, k], "choice": c.name,
                               "tuned_winner": c is choices[0],
                               "tflops": round(ours, 1), "torch_tflops": round(ref, 1),
                               "ratio": round(ours / ref, 4), "waves": round(tiles / 132, 2),
                               "error": errors[c]})
        shape_rows.sort(key=lambda r: -r["tflops"])
        rows += shape_rows
        print(f"== {m}x{n}x{k}: torch.matmul {ref:.1f} TFLOP/s ({torch_ms * 1e3:.1f} us)")
        print_table(["TFLOP/s", "ratio", "waves", "winner", "error", "choice"],
                    [[r["tflops"], r["ratio"], r["waves"], r["tuned_winner"], r["error"] or "",
                      r["choice"].removesuffix("-split1-rheuristic-sw1")] for r in shape_rows])
        sys.stdout.flush()
    out = Path(os.environ.get("OUT", "/tmp")) / "wide_mma.json"
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "versions": versions(),
                               "reps": REPS, "build_failures": failed, "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
