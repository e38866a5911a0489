"""GEMM config sweep: chosen CUTLASS configs on chosen shapes, timed beside torch.matmul.

bf16, y = x W^T. Each config is built (in parallel), checked against a float32 torch.matmul, then
timed.

Every config of a shape is timed in one interleaved group with torch.matmul (each repetition runs
each once, in rotating order, L2 flushed before each call), every call replayed from a CUDA graph
as the tuner does, so that no Python launch cost is counted. A config named ``swap:NAME`` runs
swap-A/B (D^T = W x^T, the small M on the tile's N side). Stream-K configs are also run with each
of ``--splits``. Prints a table per shape and writes
``benchmarks/results/sweep_gemm_<preset>.json`` (``sweep_gemm_custom.json`` for ``--configs``).
The presets are the config lists of the studies in docs/measurements.md.

    python benchmarks/sweeps/gemm_configs.py --preset small-m
    python benchmarks/sweeps/gemm_configs.py --shapes 1024x14336x4096 \\
        --configs sm90a-cooperative-t128x176x64-c2x1x1-sauto-epitma-persistent-split1-rheuristic-sw1
    python benchmarks/sweeps/gemm_configs.py --list-presets
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cutlass_ops  # noqa: E402
from benchmarks.common import print_table, require_gpu, write_result  # noqa: E402
from cutlass_ops import GemmConfig, GemmOperands  # noqa: E402
from cutlass_ops.gemms.choice import Choice  # noqa: E402

OPERANDS = GemmOperands.make("bf16")  # x row-major, W^T column-major, y row-major
SMS = 132  # H100 SXM and H200: waves are reported against this count


def _coop(tile, cluster=(1, 1, 1), swap=False, **fields):
    return Choice(GemmConfig(kernel_schedule="cooperative", tile=tile, cluster=cluster, **fields),
                  swap)


def _pingpong(tile, cluster=(1, 1, 1), swap=False, **fields):
    return Choice(GemmConfig(kernel_schedule="pingpong", tile=tile, cluster=cluster, **fields),
                  swap)


def _small_m():
    """Swap-A/B pingpong and stream-K tiles for M = 16 and 128, with unswapped narrow tiles (more
    CTAs on the weight) and the unswapped 64x64 / 128x128 kernels as yardsticks."""
    out = [_pingpong((tm, tn, tk), cl, swap=True)
           for (tm, tn), tk, cl in itertools.product(((64, 16), (64, 32), (64, 64), (128, 16)),
                                                     (64, 128), ((1, 1, 1), (2, 1, 1)))]
    out += [_coop((128, tn, 128), swap=True, tile_scheduler="streamk") for tn in (16, 32, 64)]
    out += [_pingpong((64, tn, tk)) for tn, tk in itertools.product((16, 32), (64, 128))]
    out += [_pingpong((64, 64, 64)), _coop((128, 128, 64)), _coop((128, 128, 64), (4, 1, 1))]
    return out


def _wide():
    """Tile widths that fill whole waves of SMs (cuBLAS's 112, 176, 224...), beside 128 and 256."""
    out = [_coop((128, tn, 64), cl) for tn, cl in itertools.product(
        (112, 128, 160, 176, 192, 208, 224), ((1, 1, 1), (2, 1, 1)))]
    out += [_pingpong((64, tn, 64)) for tn in (176, 224)]
    return out + [_coop((256, 128, 64), (1, 2, 1)), _coop((128, 256, 64), (1, 2, 1))]


def _streamk():
    """Stream-K against data-parallel scheduling of the same tiles."""
    out = []
    for tile, cl in itertools.product(((128, 128, 64), (256, 128, 64), (128, 192, 64)),
                                      ((1, 1, 1), (1, 2, 1), (2, 1, 1))):
        out += [_coop(tile, cl, tile_scheduler="streamk"), _coop(tile, cl)]
    return out


def _stages():
    """Explicit pipeline stage counts and the register epilogue against CUTLASS's defaults."""
    out = []
    for tile, cl, stages in (((256, 128, 64), (1, 2, 1), (0, 3)),
                             ((128, 256, 64), (1, 2, 1), (0, 3)),
                             ((128, 128, 64), (2, 1, 1), (0, 3, 4, 5))):
        out += [_coop(tile, cl, stages=s) for s in stages]
        out.append(_coop(tile, cl, epilogue_schedule="nosmem"))
    return out


def _epilogue_tiles():
    """Explicit epilogue tiles (a multiple of 16 that divides the tile) against CUTLASS's
    automatic 128 x gcd(32, tile N)."""
    study = [((128, 176, 64), (2, 1, 1), [None, (128, 176)]),
             ((128, 128, 64), (2, 1, 1), [None, (128, 64), (128, 128)]),
             ((128, 192, 64), (2, 1, 1), [None, (128, 64), (128, 96)]),
             ((256, 128, 64), (1, 2, 1), [None, (128, 64)])]
    return [_coop(tile, cl, epilogue_tile=e or (0, 0))
            for tile, cl, tiles in study for e in tiles]


_SMALL_M_SHAPES = [(m, n, k) for m in (16, 128)
                   for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))]
_LARGE_SHAPES = [(1024, 14336, 4096), (4096, 14336, 4096), (1024, 4096, 4096)]
PRESETS = {  # name: (what it asks, default shapes, configs)
    "small-m": ("swap-A/B, narrow and stream-K tiles at M = 16 / 128", _SMALL_M_SHAPES, _small_m),
    "wide": ("wave-filling tile widths", _LARGE_SHAPES + [(8192, 8192, 8192)], _wide),
    "streamk": ("stream-K against data-parallel", _LARGE_SHAPES + [(128, 14336, 4096)], _streamk),
    "stages": ("explicit stage counts, register epilogue", _LARGE_SHAPES + [(4096, 4096, 4096)],
               _stages),
    "epilogue-tile": ("explicit epilogue tiles", _LARGE_SHAPES, _epilogue_tiles),
}


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a shape MxNxK: {text!r}") from None
    return m, n, k


def parse_choice(text: str) -> Choice:
    try:
        return Choice.from_name(text)
    except (ValueError, KeyError) as exc:
        raise argparse.ArgumentTypeError(f"not a config name: {text!r} ({exc})") from None


def with_splits(choices: list[Choice], splits: list[int]) -> list[Choice]:
    """Each stream-K choice once per split count (a run-time argument: one kernel serves all)."""
    out = []
    for choice in choices:
        if choice.config.tile_scheduler.value == "streamk":
            out += [choice.replace(splits=s) for s in splits]
        else:
            out.append(choice)
    return list(dict.fromkeys(out))


def kernel_of(choice: Choice) -> tuple[GemmOperands, GemmConfig]:
    """What gets compiled: run-time fields (splits, raster order, swizzle) share one artifact."""
    return (choice.operands_for(OPERANDS),
            choice.config.replace(splits=1, raster_order="heuristic", swizzle=1))


def build(choices: list[Choice], jobs: int) -> dict[str, str]:
    """Builds every kernel in parallel; returns {choice name: error} for those that failed."""
    from cutlass_ops.gemms.loader import prepare_many

    start = time.time()
    results = prepare_many({kernel_of(c) for c in choices}, jobs=jobs)
    failed = {c.name: f"{type(results[kernel_of(c)]).__name__}: {results[kernel_of(c)]}"[:300]
              for c in choices if isinstance(results[kernel_of(c)], Exception)}
    print(f"built {len(results)} kernels in {time.time() - start:.0f} s, "
          f"{len(failed)} choices failed", flush=True)
    for name, error in failed.items():
        print(f"  FAILED {name}: {error}", flush=True)
    return failed


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def waves(shape, choice: Choice) -> float:
    m, n, _ = shape
    if choice.swap_ab:
        m, n = n, m
    tm, tn, _ = choice.config.tile
    return round(-(-m // tm) * -(-n // tn) / SMS, 2)


def sweep_shape(shape, choices: list[Choice], failed: dict[str, str], reps: int) -> list[dict]:
    import torch

    from custom_kernels.core.tolerances import relative_tolerance
    from tuning.timing import GraphCaptureError, do_bench_interleaved

    m, n, k = shape
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    reference = x.float() @ w.float().t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)  # shared: launches overwrite it
    errors, fns = dict(failed), {}
    for choice in choices:
        if choice.name in errors:
            continue
        try:
            launch = cutlass_ops.plan(w, x.t(), config=choice.config, out=out.t()) \
                if choice.swap_ab else cutlass_ops.plan(x, w.t(), config=choice.config, out=out)
            out.fill_(float("nan"))
            launch()
            torch.cuda.synchronize()
        except cutlass_ops.CutlassOpsError as exc:
            errors[choice.name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        error = ((out.float() - reference).norm() / reference.norm()).item()
        if not error < relative_tolerance(OPERANDS.element_d):
            errors[choice.name] = f"wrong result: relative error {error:.3g}"
            continue
        fns[choice.name] = launch
    del reference
    fns["torch.matmul"] = lambda: torch.matmul(x, w.t())
    try:
        timings = do_bench_interleaved(fns, reps=reps, graph=True)
    except GraphCaptureError as exc:  # one uncapturable call would spoil the group
        print(f"  CUDA-graph capture failed, timing without graphs: {exc}", flush=True)
        timings = do_bench_interleaved(fns, reps=reps, pad_host=True)
    torch_ms = timings.pop("torch.matmul").median_ms
    ref = round(tflops(m, n, k, torch_ms), 1)
    case = f"bf16 M={m} N={n} K={k}"
    rows = []
    for choice in choices:
        timing = timings.get(choice.name)
        ours = round(tflops(m, n, k, timing.median_ms), 1) if timing else 0.0
        rows.append({
            "case": f"{case} {choice.name}", "unit": "TFLOP/s", "ours": ours, "reference": ref,
            "reference_name": "torch.matmul", "ratio": round(ours / ref, 4),
            "correct": timing is not None,
            "detail": {"config": choice.config.name, "swap_ab": choice.swap_ab,
                       "waves": waves(shape, choice),
                       "ours_ms": round(timing.median_ms, 5) if timing else None,
                       "torch_ms": round(torch_ms, 5), "error": errors.get(choice.name)}})
    rows.sort(key=lambda r: -r["ours"])
    print(f"== {case}: torch.matmul {ref} TFLOP/s ({torch_ms * 1e3:.1f} us)", flush=True)
    print_table(["TFLOP/s", "ratio", "waves", "ok", "config"],
                [[r["ours"], r["ratio"], r["detail"]["waves"], r["correct"],
                  r["case"].removeprefix(case + " ")] for r in rows])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="example: python benchmarks/sweeps/gemm_configs.py --preset small-m --reps 60")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a study's config list and shapes (see --list-presets)")
    parser.add_argument("--configs", nargs="+", type=parse_choice, metavar="NAME",
                        help="GemmConfig names (GemmConfig.name), 'swap:' before a name for "
                             "swap-A/B; added to the preset's configs")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="MxNxK",
                        help="shapes to run (default: the preset's)")
    parser.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4],
                        help="split counts for stream-K configs (default: 1 2 4)")
    parser.add_argument("--reps", type=int, default=50,
                        help="timed repetitions per config, at least 20 (default: 50)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(),
                        help="parallel nvcc processes (default: the CPU count)")
    parser.add_argument("--list-presets", action="store_true",
                        help="print the presets with their shapes and config counts, and exit")
    args = parser.parse_args()
    if args.list_presets:
        for name, (what, shapes, configs) in PRESETS.items():
            print(f"{name:14s} {what}: {len(configs())} configs, shapes "
                  + " ".join("x".join(map(str, s)) for s in shapes))
        return
    if not args.preset and not args.configs:
        parser.error("give --preset or --configs")
    if args.reps < 20:
        parser.error("--reps must be at least 20 (BENCHMARKS.md)")
    _, preset_shapes, preset_configs = PRESETS[args.preset] if args.preset else ("", [], list)
    shapes = args.shapes or preset_shapes
    if not shapes:
        parser.error("give --shapes with --configs")
    choices = with_splits(preset_configs() + (args.configs or []), args.splits)
    require_gpu()
    failed = build(choices, args.jobs)
    rows = [row for shape in shapes for row in sweep_shape(shape, choices, failed, args.reps)]
    path = write_result(f"sweep_gemm_{args.preset or 'custom'}", rows, reps=args.reps,
                        timing="CUDA-graph replays, interleaved with torch.matmul, L2 flushed")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
