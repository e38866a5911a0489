"""CUTLASS GEMMs against torch.matmul on the LLM shapes: untuned (a fixed handful of configs) or
tuned (``--tuned``: the winners of ``cutlass-tune tune``, through the dispatch of
``cutlass_ops.matmul``, in a process that compiles nothing).

bf16, y = x @ W^T (A row-major M x K, B = W^T column-major), L2 flushed before each repetition.
Ours is timed through ``cutlass_ops.plan`` (kernel plus its C++ launcher, checks done once),
torch through torch.matmul; the Python overhead of ``cutlass_ops.gemm`` is the integration
issue's benchmark.
Untuned: "ours" is the best fixed config per shape; every config's figure is in ``detail``.
Writes benchmarks/results/gemm_untuned.json.
Tuned: two rows per shape, their case naming what was timed. "..., kernel": the CUTLASS kernel
the tuner chose for the shape, even where dispatch prefers torch.matmul (``detail.dispatch`` says
what cutlass_ops.matmul runs), its planned launcher replayed from a CUDA graph against
torch.matmul's, in interleaved repetitions: GPU time, no host. "..., whole call":
``cutlass_ops.matmul(x, w_t)`` called eagerly (checks, dispatch lookup and launch: host
included; whatever dispatch runs, torch.matmul included) against ``torch.matmul`` called the same
way, interleaved, inputs rotated out of L2 instead of a flush (see ``bench_whole_call``). A
claim "through cutlass_ops.matmul" is a whole-call figure. (``detail.matmul_call_tflops`` of a
kernel row times the call after an L2 flush, which hides up to the flush's length of host
work.) The file has the geometric mean and minimum ratio of each kind
(``geomean_ratio_kernel``, ``geomean_ratio_whole_call``, ...). Writes
benchmarks/results/gemm_tuned.json.

    cutlass-tune tune $(python benchmarks/gemm.py --print-shapes)
    python benchmarks/gemm.py --tuned
    python benchmarks/gemm.py --tuned --tune default   # both, the tune's wall time recorded
    python benchmarks/gemm.py --tuned --tune default --tune-gpus all   # the tune on every GPU
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import cutlass_ops  # noqa: E402
from benchmarks.common import (copy_bandwidth_gbs, print_table, require_gpu,  # noqa: E402
                               write_result)
from cutlass_ops import GemmConfig, GemmOperands  # noqa: E402
from cutlass_ops.gemms.loader import prepare  # noqa: E402
from tuning.timing import do_bench, do_bench_interleaved  # noqa: E402

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


TUNED_REPS = 100


def bench_tuned_shape(m, n, k):
    from cutlass_ops.gemms.build import compiles_in_process
    from tuning.backend import GpuSession
    from cutlass_ops.gemms.gemm_entries import gemm_cache
    from custom_kernels.core.device import current_scope
    from custom_kernels.core.tolerances import relative_error

    problem = cutlass_ops.GemmProblem(GemmOperands.make("bf16"), m, n, k)
    entry = gemm_cache(current_scope()).get(problem)
    case = f"bf16 M={m} N={n} K={k}"
    if entry is None or entry.winner is None:
        return {"case": case, "unit": "TFLOP/s", "ours": 0.0, "reference": 0.0,
                "reference_name": "torch.matmul", "ratio": 0.0, "correct": False,
                "detail": {"error": "not tuned: run cutlass-tune tune first"}}
    choice = entry.winner
    session = GpuSession(problem, torch.cuda.current_device())
    x, w_t = session.a, session.b  # x (M x K) row-major, w_t = W^T (K x N) column-major
    decision = cutlass_ops.explain(x, w_t)
    compiles_before = compiles_in_process()
    error = session.verify(choice)
    call_err = relative_error(cutlass_ops.matmul(x, w_t), session.reference)
    # Interleaved repetition by repetition (see tuning.timing.do_bench_interleaved).
    final, torch_ms = session.compare_ms([choice], TUNED_REPS)
    ours_ms = final[choice]
    session.close()
    ours_tf, ref_tf = tflops(m, n, k, ours_ms), tflops(m, n, k, torch_ms)
    return {
        "case": case, "unit": "TFLOP/s", "ours": round(ours_tf, 1),
        "reference": round(ref_tf, 1), "reference_name": "torch.matmul",
        "ratio": round(round(ours_tf, 1) / round(ref_tf, 1), 4),
        "correct": error is None and call_err < session.tolerance,
        "detail": {"config": choice.name, "path": choice.backend,
                   "swap_ab": choice.swap_ab if choice.backend == "cutlass" else
                   choice.name.endswith("-swap"),
                   # The best kernel of the other CUTLASS path in the same tune (its time
                   # there, beside torch when it was a finalist).
                   "other_path_best": entry.field("other_backend_best"),
                   "tune_seconds": entry.field("tune_seconds"),
                   "build_seconds_total": entry.field("build_seconds_total"),
                   "ours_ms": round(ours_ms, 5), "torch_ms": round(torch_ms, 5),
                   "dispatch": {"source": decision.source, "runs": decision.choice.name
                                if decision.choice else "torch.matmul",
                                "reason": decision.reason},
                   "tuner_ms": entry.winner_ms, "tuner_torch_ms": entry.torch_ms,
                   "compiled_in_this_process": compiles_in_process() - compiles_before,
                   "verify_error": error},
    }


def run_tune(shapes, strategy: str, gpus: str | None = None) -> dict:
    """``cutlass-tune tune`` of ``shapes`` in a child process (as a user runs it), timed;
    ``gpus``: its ``--gpus`` (one worker per GPU, one cache)."""
    import subprocess
    import time

    from custom_kernels.core.device import current_scope
    from cutlass_ops.gemms.gemm_entries import gemm_cache

    cache = gemm_cache(current_scope())
    operands = GemmOperands.make("bf16")
    cold = not any(cache.get(cutlass_ops.GemmProblem(operands, m, n, k)) for m, n, k in shapes)
    command = [sys.executable, "-m", "tuning.cli", "tune",
               *(f"{m}x{n}x{k}" for m, n, k in shapes), "--strategy", strategy]
    command += ["--gpus", gpus] if gpus else []
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return {"tune": {"strategy": strategy, "seconds": round(time.perf_counter() - start, 1),
                     "cold": cold, "command": "cutlass-tune " + " ".join(command[3:])}}


# What a tuned row timed, in its case name, so that the two are never confused: "kernel" is the
# tuned kernel alone (its planned launcher replayed from a CUDA graph, L2 flushed: GPU time);
# "whole call" is cutlass_ops.matmul called eagerly (argument checks, dispatch lookup, launch:
# host included), beside torch.matmul called the same way.
KERNEL, WHOLE_CALL = "kernel", "whole call"


def labelled(row: dict, what: str) -> dict:
    """``row`` with its case ending in what was timed (``KERNEL`` or ``WHOLE_CALL``)."""
    return {**row, "case": f"{row['case']}, {what}"}


def rotation_sets(set_bytes: int, l2_bytes: int) -> int:
    """How many input sets a timed loop cycles through so that each call finds its inputs out of
    L2 (BENCHMARKS.md: rotate among input sets when they fit): the sets other than the current
    one must hold at least twice the L2, as the flush buffer does."""
    return 1 + -(-2 * l2_bytes // max(set_bytes, 1)) if set_bytes < 2 * l2_bytes else 1


def whole_call_inputs(m, n, k) -> list[tuple]:
    """Random bf16 (x, W^T) pairs, x (M x K) row-major and W^T (K x N) column-major as a
    Linear's, enough of them to rotate out of L2 (``rotation_sets``)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    count = rotation_sets(2 * (m * k + n * k), l2)  # the output is written, never read
    return [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
             torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()) for _ in range(count)]


def rotating(fn, sets):
    """``fn`` called on the next input set each time (the same cycling for ours and torch)."""
    pending = itertools.cycle(sets)
    return lambda: fn(*next(pending))


def whole_call_row(m, n, k, ours_ms, torch_ms, correct, **detail) -> dict:
    """A whole-call row: ``ratio`` is ours / torch's TFLOP/s as printed (BENCHMARKS.md)."""
    ours, reference = round(tflops(m, n, k, ours_ms), 1), round(tflops(m, n, k, torch_ms), 1)
    return {"case": f"bf16 M={m} N={n} K={k}, {WHOLE_CALL}", "unit": "TFLOP/s", "ours": ours,
            "reference": reference, "reference_name": "torch.matmul",
            "ratio": round(ours / reference, 4) if reference else 0.0, "correct": correct,
            "detail": {"ours_ms": round(ours_ms, 5), "torch_ms": round(torch_ms, 5), **detail}}


def bench_whole_call(m, n, k) -> dict:
    """``cutlass_ops.matmul(x, w_t)`` and ``torch.matmul(x, w_t)``, each called eagerly as a
    model calls them: no CUDA graph, no spin before the call, no L2 flush (a flush keeps the
    GPU busy while the host prepares the next call and hides the host's cost); the inputs
    rotate instead. Interleaved repetition by repetition (tuning.timing.do_bench_interleaved).
    Where the kernel is shorter than the host's work, the events time the host."""
    from cutlass_ops.gemms.build import compiles_in_process
    from custom_kernels.core.tolerances import GEMM, relative_error, relative_tolerance

    sets = whole_call_inputs(m, n, k)
    x, w_t = sets[0]
    compiles_before = compiles_in_process()
    error = relative_error(cutlass_ops.matmul(x, w_t), x.float() @ w_t.float())
    decision = cutlass_ops.explain(x, w_t)
    times = do_bench_interleaved({"ours": rotating(cutlass_ops.matmul, sets),
                                  "torch": rotating(torch.matmul, sets)},
                                 warmup=5, reps=TUNED_REPS, flush_l2=False)
    return whole_call_row(
        m, n, k, times["ours"].median_ms, times["torch"].median_ms,
        error < relative_tolerance(torch.bfloat16, GEMM), relative_error=round(error, 6),
        input_sets=len(sets), compiled_in_this_process=compiles_in_process() - compiles_before,
        dispatch={"source": decision.source,
                  "runs": decision.choice.name if decision.choice else "torch.matmul"})


def ratio_summary(rows: list, what: str) -> dict:
    """The geometric mean and minimum ratio of the rows whose case ends in ``what`` (rows
    without a figure, ratio 0, left out), keyed by it: ``geomean_ratio_kernel`` ..."""
    suffix = what.replace(" ", "_")
    ratios = [r["ratio"] for r in rows if r["case"].endswith(f", {what}") and r["ratio"] > 0]
    return {f"geomean_ratio_{suffix}": round(statistics.geometric_mean(ratios), 4)
            if ratios else 0.0, f"min_ratio_{suffix}": min(ratios, default=0.0)}


def tuned_rows(shapes) -> list:
    """Per shape, the kernel row then the whole-call row."""
    rows = []
    for shape in shapes:
        rows.append(labelled(bench_tuned_shape(*shape), KERNEL))
        rows.append(bench_whole_call(*shape))
        print(f"{rows[-2]['case']}: {rows[-2]['ratio']}; {WHOLE_CALL}: {rows[-1]['ratio']}",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="three shapes only, written to gemm_untuned_quick.json")
    parser.add_argument("--tuned", action="store_true",
                        help="the tuned winners through cutlass_ops.matmul's dispatch")
    parser.add_argument("--print-shapes", action="store_true",
                        help="print the shape list as MxNxK arguments and exit")
    parser.add_argument("--tune", choices=("quick", "default", "exhaustive"),
                        help="with --tuned: first run `cutlass-tune tune` on the shapes with "
                        "this strategy, in its own process, and record its wall time (cold when "
                        "the cache held none of them)")
    parser.add_argument("--tune-gpus", metavar="GPUS",
                        help="with --tune: the tune's --gpus (all, or indices like 0,1)")
    args = parser.parse_args()
    shapes = LLM_SHAPES[::6] if args.quick else LLM_SHAPES
    if args.print_shapes:
        print(" ".join(f"{m}x{n}x{k}" for m, n, k in shapes))
        return
    require_gpu()
    if args.tuned:
        tune = run_tune(shapes, args.tune, args.tune_gpus) if args.tune else {}
        rows = tuned_rows(shapes)
        print_table(["case", "ours TFLOP/s", "torch TFLOP/s", "ratio", "correct", "dispatch",
                     "config"],
                    [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"],
                      r["detail"].get("dispatch", {}).get("source"),
                      r["detail"].get("config") or r["detail"].get("dispatch", {}).get("runs")]
                     for r in rows])
        summary = {**ratio_summary(rows, KERNEL), **ratio_summary(rows, WHOLE_CALL)}
        print(", ".join(f"{key} {value}" for key, value in summary.items()))
        path = write_result("gemm_tuned_quick" if args.quick else "gemm_tuned", rows,
                            copy_bandwidth_gbs=round(copy_bandwidth_gbs(), 1), **summary,
                            **tune)
        print(f"wrote {path}")
        return
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
