"""What a skew dispatch (``cutlass_ops.gemms.grouped.skew_dispatch``) costs beside the kernel it picks:
the routing split and the idle kernel's launch, on ``benchmarks/moe.py``'s expert GEMMs.

For each case and routing (even, Zipf), interleaved as the tuner times (CUDA-graph replays, L2
flushed): the pair, each of its kernels alone, the split alone, each kernel idle (all-empty
groups) and ``torch._grouped_mm``. The overhead is the pair's time minus the time of the kernel
the split picked, run alone. The pair defaults to the one ``moe.json`` stored for DeepSeek-V3 at
4096 tokens (a 64-row DSL tile on even routing, the C++ cooperative 128x256 on skewed); it is
also run on Qwen3-30B-A3B at 4096 tokens, whose GEMMs are ten times shorter. Needs
``cutlass-ops[dsl]``. Prints a table and writes ``benchmarks/results/sweep_skew_dispatch_cost.json``
("ours" is the pair, against ``torch._grouped_mm``).

    python benchmarks/sweeps/skew_dispatch_cost.py [--reps 40]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.common import print_table, require_gpu_and_dsl, write_result  # noqa: E402
from benchmarks.moe import ROUTINGS, expert_operands  # noqa: E402
from custom_kernels.core.tolerances import relative_error  # noqa: E402
from custom_kernels.moe import routing_split  # noqa: E402
from cutlass_ops.moe import grouped  # noqa: E402
from cutlass_ops.gemms.grouped import grouped_build, grouped_runtime  # noqa: E402
from cutlass_ops.gemms.grouped.skew_dispatch import SkewDispatch  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

CASES = (("DeepSeek-V3", "up", 4096), ("DeepSeek-V3", "down", 4096),
         ("Qwen3-30B-A3B", "up", 4096))
EVEN = "dsl-sm90-pingpong-t64x128x128-c2x1"
SKEWED = "grouped-bf16-tn-cooperative-t128x256x64-c2x1"
SKEW = 7.1  # moe.json's threshold for 256 experts; the routings here fall clearly either side


def cost_row(model, direction, tokens, routing, pair: SkewDispatch, reps: int) -> dict:
    counts, offs, x, wt = expert_operands(model, direction, tokens, routing)
    rows, (k, n) = x.shape[0], wt.shape[1:]
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    empty = torch.zeros_like(offs)

    def run(config, offsets):
        return lambda: grouped_runtime.launch(config, "2d3d", x, wt, offsets, out)

    out.fill_(float("nan"))
    run(pair, offs)()
    error = relative_error(out, grouped.reference(x, wt, offs))
    fns = {"pair": run(pair, offs), "even": run(pair.even, offs),
           "skewed": run(pair.skewed, offs),
           "split": lambda: routing_split.split_by_skew(offs, pair.skew),
           "even idle": run(pair.even, empty), "skewed idle": run(pair.skewed, empty),
           "torch": lambda: torch._grouped_mm(x, wt, offs)}
    ms = {key: t.median_ms for key, t in
          do_bench_interleaved(fns, reps=reps, graph=True).items()}
    picked = "skewed" if routing_split.reference(offs, pair.skew)[1].any() else "even"
    flops = 2 * rows * n * k
    return {
        "case": f"skew dispatch {model} {direction} {n}x{k} {tokens} tokens {routing}",
        "unit": "TFLOP/s", "ours": round(flops / ms["pair"] / 1e9, 1),
        "reference": round(flops / ms["torch"] / 1e9, 1), "reference_name": "torch._grouped_mm",
        "ratio": round(ms["torch"] / ms["pair"], 4), "correct": error < 2e-2,
        "detail": {"pair": pair.name, "picked": picked,
                   "overhead_us": round((ms["pair"] - ms[picked]) * 1e3, 1),
                   "ms": {key: round(v, 5) for key, v in ms.items()},
                   "largest_over_mean": round(max(counts) * len(counts) / rows, 2),
                   "relative_error": error},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    require_gpu_and_dsl()
    pair = SkewDispatch(grouped_build.config_from_name(EVEN),
                        grouped_build.config_from_name(SKEWED), SKEW)
    rows = []
    for model, direction, tokens in CASES:
        for routing in ROUTINGS:
            rows.append(cost_row(model, direction, tokens, routing, pair, args.reps))
            write_result("sweep_skew_dispatch_cost", rows)
    print_table(["case", "picked", "pair ms", "alone ms", "overhead us", "split us",
                 "idle us", "vs torch"],
                [[r["case"][14:], d["picked"], d["ms"]["pair"], d["ms"][d["picked"]],
                  d["overhead_us"], round(d["ms"]["split"] * 1e3, 1),
                  round(d["ms"][("skewed" if d["picked"] == "even" else "even") + " idle"]
                        * 1e3, 1), r["ratio"]]
                 for r in rows for d in [r["detail"]]])


if __name__ == "__main__":
    main()
