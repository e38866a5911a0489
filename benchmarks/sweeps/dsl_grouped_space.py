"""The DSL grouped kernels (``cutlass_ops.gemms.grouped.dsl_grouped``, QuACK's variable-length M) with
the 64-row pingpong tiles of ``dsl.SMALL_TILES`` beside the grouped candidates' measured best,
on ``benchmarks/moe.py``'s 24 expert GEMMs (forward, 2d3d): do short tiles help experts with few
routed rows? Needs ``cutlass-ops[dsl]``.

Each config is checked against a float32 product on the largest experts, timed as the tuner
times (CUDA-graph replays, L2 flushed), and the best two of the new tiles and the best two of the
current candidates are timed interleaved with ``torch._grouped_mm``. Prints a table and writes
``benchmarks/results/sweep_dsl_grouped_space.json`` after every case: "ours" is the best new
tile, ``detail.current_best_ratio`` the best of the current candidates in the same run.

With ``--knobs scheduler`` it asks instead whether QuACK's persistent tile scheduler, static by
default with L2 swizzle groups of 8 N tiles inside each expert, is what holds the
skewed and short-expert rows back: each case's best two of the current candidates are also run
with swizzle groups of 1 to 64 and with the dynamic scheduler (``DslConfig.dynamic``, an atomic
tile counter), and the best two variants are timed interleaved beside the best base and its
dynamic twin. That writes ``benchmarks/results/sweep_dsl_grouped_scheduler.json``: "ours" the
best variant, ``detail.base_ratio`` the best base and ``detail.dynamic_twin_ratio`` its twin,
all in one interleaved run.

    python benchmarks/sweeps/dsl_grouped_space.py [--models DeepSeek-V3 ...] [--reps 20]
        [--knobs short|scheduler]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.common import print_table, require_gpu_and_dsl, write_result  # noqa: E402
from benchmarks.moe import MODELS, ROUTINGS, TOKENS, expert_operands  # noqa: E402
from cutlass_ops.gemms import dsl
from cutlass_ops.gemms.grouped import dsl_grouped  # noqa: E402
from cutlass_ops.gemms.dsl import DslConfig  # noqa: E402
from custom_kernels.core.tolerances import relative_error  # noqa: E402
from tuning.timing import do_bench, do_bench_interleaved  # noqa: E402

CURRENT = dsl_grouped.CONFIGS[:8]  # what the default grouped tune tries
SHORT = tuple(DslConfig(tm, tn, cm, cn, True, False, tk) for tm, tn in dsl.SMALL_TILES
              if tn >= 64 for cm, cn in ((1, 1), (2, 1)) for tk in dsl.TILE_KS)
SWIZZLES = (1, 2, 4, 16, 64)  # QuACK's default is 8


@dataclasses.dataclass(frozen=True)
class SwizzleVariant(DslConfig):
    """A DSL config with another L2 swizzle in QuACK's tile scheduler: the most N tiles of one
    expert in a group (``DslConfig`` keeps QuACK's 8)."""
    max_swizzle: int = 8

    @classmethod
    def of(cls, base: DslConfig, max_swizzle: int) -> SwizzleVariant:
        return cls(**dataclasses.asdict(base), max_swizzle=max_swizzle)

    @property
    def name(self) -> str:
        return f"{super().name}-sw{self.max_swizzle}"

    def to_quack(self):
        return dataclasses.replace(super().to_quack(), max_swizzle_size=self.max_swizzle)


class Case:
    """One moe.py expert GEMM's operands, with each config checked against float32 on the
    largest experts and timed as the tuner times (CUDA-graph replays, L2 flushed)."""

    def __init__(self, model, direction, tokens, routing):
        self.counts, self.offs, self.x, self.wt = expert_operands(model, direction, tokens,
                                                                  routing)
        self.rows, (self.k, self.n) = self.x.shape[0], self.wt.shape[1:]
        self.name = f"grouped {model} {direction} {self.n}x{self.k} {tokens} tokens {routing}"
        self.out = torch.empty(self.rows, self.n, device="cuda", dtype=torch.bfloat16)
        self.first, self.failures = {}, {}

    def launch(self, config):
        return dsl_grouped.run(config, "2d3d", self.x, self.wt, self.offs, self.out)

    def first_round(self, configs) -> None:
        starts = [0] + torch.tensor(self.counts).cumsum(0).tolist()[:-1]
        largest = sorted(range(len(self.counts)), key=lambda e: -self.counts[e])[:3]
        for config in configs:
            try:
                self.out.fill_(float("nan"))
                self.launch(config)
                error = max(relative_error(
                    self.out[starts[e]:starts[e] + self.counts[e]],
                    self.x[starts[e]:starts[e] + self.counts[e]].float() @ self.wt[e].float())
                    for e in largest)
                if not error < 2e-2:
                    self.failures[config.name] = f"wrong result: relative error {error:.3g}"
                    continue
                self.first[config] = do_bench(lambda c=config: self.launch(c), warmup=2, reps=8,
                                              graph=True).median_ms
            except Exception as exc:  # recorded per config, not fatal
                self.failures[config.name] = f"{type(exc).__name__}: {exc}"[:300]

    def best(self, group, count=2) -> list:
        return sorted((c for c in self.first if c in group), key=self.first.get)[:count]

    def ratio_to_torch(self, config, reps) -> float:
        return self.ratios_to_torch([config], reps)[config]

    def ratios_to_torch(self, configs, reps) -> dict:
        """Each config's speedup over torch._grouped_mm, all timed in one interleaved run, so
        that they compare with each other too."""
        timings = do_bench_interleaved(
            {"torch": lambda: torch._grouped_mm(self.x, self.wt, self.offs),
             **{config: lambda c=config: self.launch(c) for config in configs}},
            reps=reps, graph=True)
        return {c: timings["torch"].median_ms / timings[c].median_ms for c in configs}

    def row(self, ours, ratios, **detail) -> dict:
        flops = 2 * self.rows * self.n * self.k
        ours_ms = self.first[ours] if ours else math.nan
        return {
            "case": self.name, "unit": "TFLOP/s",
            "ours": round(flops / ours_ms / 1e9, 1) if ours else 0.0,
            "reference": round(flops / ours_ms / 1e9 / ratios[ours], 1) if ours else 0.0,
            "reference_name": "torch._grouped_mm",
            "ratio": round(ratios[ours], 4) if ours else 0.0, "correct": ours is not None,
            "detail": {"config": ours.name if ours else None, **detail,
                       "finalists": {c.name: round(r, 4) for c, r in ratios.items()},
                       "first_round_ms": {c.name: round(v, 5) for c, v in
                                          sorted(self.first.items(), key=lambda item: item[1])},
                       "empty_experts": self.counts.count(0),
                       "largest_expert_rows": max(self.counts), "failures": self.failures},
        }


def sweep_case(model, direction, tokens, routing, reps) -> dict:
    case = Case(model, direction, tokens, routing)
    case.first_round((*CURRENT, *SHORT))
    ratios = {config: case.ratio_to_torch(config, reps)
              for group in (CURRENT, SHORT) for config in case.best(group)}
    short = max((c for c in ratios if c in SHORT), key=ratios.get, default=None)
    current = max((c for c in ratios if c in CURRENT), key=ratios.get, default=None)
    return case.row(short, ratios, current_best=current.name if current else None,
                    current_best_ratio=round(ratios[current], 4) if current else None)


def scheduler_case(model, direction, tokens, routing, reps) -> dict:
    case = Case(model, direction, tokens, routing)
    bases = (*CURRENT, dsl_grouped.SHORT_GROUP_CONFIGS[0])
    case.first_round(bases)
    variants = tuple(variant for base in case.best(bases) for variant in (
        *(SwizzleVariant.of(base, s) for s in SWIZZLES), dataclasses.replace(base, dynamic=True)))
    case.first_round(variants)
    # The best base beside its own dynamic twin and the best two variants, in one interleaved
    # run: the twin is the like-for-like measure of the dynamic scheduler.
    base = case.best(bases, 1)
    twin = [t for t in (dataclasses.replace(b, dynamic=True) for b in base) if t in case.first]
    finalists = list(dict.fromkeys((*base, *twin, *case.best(variants))))
    ratios = case.ratios_to_torch(finalists, reps) if finalists else {}
    best = max((c for c in ratios if c in variants), key=ratios.get, default=None)
    return case.row(best, ratios, base=base[0].name if base else None,
                    base_ratio=round(ratios[base[0]], 4) if base else None,
                    dynamic_twin_ratio=round(ratios[twin[0]], 4) if twin else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--knobs", choices=("short", "scheduler"), default="short",
                        help="short: the 64-row tiles; scheduler: swizzle and dynamic scheduling")
    args = parser.parse_args()
    require_gpu_and_dsl()
    measure, name, baseline, new = {
        "short": (sweep_case, "sweep_dsl_grouped_space", "current_best_ratio", "short tiles"),
        "scheduler": (scheduler_case, "sweep_dsl_grouped_scheduler", "base_ratio", "scheduler"),
    }[args.knobs]
    rows, start = [], time.perf_counter()
    for model in args.models:
        for direction in ("up", "down"):
            for tokens in TOKENS:
                for routing in ROUTINGS:
                    rows.append(measure(model, direction, tokens, routing, args.reps))
                    write_result(name, rows, cases_done=len(rows))
                    r = rows[-1]
                    twin = r["detail"].get("dynamic_twin_ratio")
                    print(f"{r['case']}: {r['ratio']} ({r['detail']['config']}); baseline "
                          f"{r['detail'][baseline]}" + (f", its dynamic twin {twin}" if twin
                                                        else "") +
                          f"; {time.perf_counter() - start:.0f} s", flush=True)
                    torch.cuda.empty_cache()
    print_table(["case", new, "baseline", "config"],
                [[r["case"][8:], r["ratio"], r["detail"][baseline], r["detail"]["config"]]
                 for r in rows])
    pairs = [(r["ratio"], r["detail"][baseline]) for r in rows
             if r["ratio"] and r["detail"][baseline]]
    if pairs:
        baseline_geomean = statistics.geometric_mean([b for _, b in pairs])
        best_geomean = statistics.geometric_mean([max(a, b) for a, b in pairs])
        print(f"geomean, baseline {baseline_geomean:.4f}; best of both {best_geomean:.4f}")


if __name__ == "__main__":
    main()
