"""The DSL grouped kernels (``cutlass_ops.gemms.dsl_grouped``, QuACK's variable-length M) with
the 64-row pingpong tiles of ``dsl.SMALL_TILES`` beside the grouped candidates' measured best,
on ``benchmarks/moe.py``'s 24 expert GEMMs (forward, 2d3d): do short tiles help experts with few
routed rows? Needs ``cutlass-ops[dsl]``.

Each config is checked against a float32 product on the largest experts, timed as the tuner
times (CUDA-graph replays, L2 flushed), and the best two of the new tiles and the best two of the
current candidates are timed interleaved with ``torch._grouped_mm``. Prints a table and writes
``benchmarks/results/sweep_dsl_grouped_space.json`` after every case: "ours" is the best new
tile, ``detail.current_best_ratio`` the best of the current candidates in the same run.

    python benchmarks/sweeps/dsl_grouped_space.py [--models DeepSeek-V3 ...] [--reps 20]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.common import print_table, require_gpu_and_dsl, write_result  # noqa: E402
from benchmarks.moe import MODELS, ROUTINGS, TOKENS, expert_operands  # noqa: E402
from cutlass_ops.gemms import dsl, dsl_grouped  # noqa: E402
from cutlass_ops.gemms.dsl import DslConfig  # noqa: E402
from custom_kernels.core.tolerances import relative_error  # noqa: E402
from tuning.timing import do_bench, do_bench_interleaved  # noqa: E402

CURRENT = dsl_grouped.CONFIGS[:8]  # what the default grouped tune tries
SHORT = tuple(DslConfig(tm, tn, cm, cn, True, False, tk) for tm, tn in dsl.SMALL_TILES
              if tn >= 64 for cm, cn in ((1, 1), (2, 1)) for tk in dsl.TILE_KS)


def sweep_case(model, direction, tokens, routing, reps) -> dict:
    counts, offs, x, wt = expert_operands(model, direction, tokens, routing)
    experts, rows, (k, n) = len(counts), x.shape[0], wt.shape[1:]
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    starts = [0] + torch.tensor(counts).cumsum(0).tolist()[:-1]
    largest = sorted(range(experts), key=lambda e: -counts[e])[:3]
    first, failures = {}, {}
    for config in (*CURRENT, *SHORT):
        def launch(config=config):
            return dsl_grouped.run(config, "2d3d", x, wt, offs, out)
        try:
            out.fill_(float("nan"))
            launch()
            error = max(relative_error(out[starts[e]:starts[e] + counts[e]],
                                       x[starts[e]:starts[e] + counts[e]].float()
                                       @ wt[e].float()) for e in largest)
            if not error < 2e-2:
                failures[config.name] = f"wrong result: relative error {error:.3g}"
                continue
            first[config] = do_bench(launch, warmup=2, reps=8, graph=True).median_ms
        except Exception as exc:  # recorded per config, not fatal
            failures[config.name] = f"{type(exc).__name__}: {exc}"[:300]
    ratios = {}
    for group in (CURRENT, SHORT):
        for config in sorted((c for c in first if c in group), key=first.get)[:2]:
            timings = do_bench_interleaved(
                {"dsl": lambda c=config: dsl_grouped.run(c, "2d3d", x, wt, offs, out),
                 "torch": lambda: torch._grouped_mm(x, wt, offs)}, reps=reps, graph=True)
            ratios[config] = timings["torch"].median_ms / timings["dsl"].median_ms
    short = max((c for c in ratios if c in SHORT), key=ratios.get, default=None)
    current = max((c for c in ratios if c in CURRENT), key=ratios.get, default=None)
    flops = 2 * rows * n * k
    ours_ms = first[short] if short else math.nan
    return {
        "case": f"grouped {model} {direction} {n}x{k} {tokens} tokens {routing}",
        "unit": "TFLOP/s", "ours": round(flops / ours_ms / 1e9, 1) if short else 0.0,
        "reference": round(flops / ours_ms / 1e9 / ratios[short], 1) if short else 0.0,
        "reference_name": "torch._grouped_mm",
        "ratio": round(ratios[short], 4) if short else 0.0, "correct": short is not None,
        "detail": {"config": short.name if short else None,
                   "current_best": current.name if current else None,
                   "current_best_ratio": round(ratios[current], 4) if current else None,
                   "finalists": {c.name: round(r, 4) for c, r in ratios.items()},
                   "first_round_ms": {c.name: round(v, 5) for c, v in
                                      sorted(first.items(), key=lambda item: item[1])},
                   "empty_experts": counts.count(0), "largest_expert_rows": max(counts),
                   "failures": failures},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    require_gpu_and_dsl()
    rows, start = [], time.perf_counter()
    for model in args.models:
        for direction in ("up", "down"):
            for tokens in TOKENS:
                for routing in ROUTINGS:
                    rows.append(sweep_case(model, direction, tokens, routing, args.reps))
                    write_result("sweep_dsl_grouped_space", rows, cases_done=len(rows))
                    r = rows[-1]
                    print(f"{r['case']}: {r['ratio']} ({r['detail']['config']}); current "
                          f"{r['detail']['current_best_ratio']}; "
                          f"{time.perf_counter() - start:.0f} s", flush=True)
                    torch.cuda.empty_cache()
    print_table(["case", "short tiles", "current", "config"],
                [[r["case"][8:], r["ratio"], r["detail"]["current_best_ratio"],
                  r["detail"]["config"]] for r in rows])
    pairs = [(r["ratio"], r["detail"]["current_best_ratio"]) for r in rows
             if r["ratio"] and r["detail"]["current_best_ratio"]]
    if pairs:
        def geomean(values):
            return math.exp(sum(map(math.log, values)) / len(values))

        print(f"geomean, current candidates {geomean([b for _, b in pairs]):.4f}; best of both "
              f"{geomean([max(a, b) for a, b in pairs]):.4f}")


if __name__ == "__main__":
    main()
