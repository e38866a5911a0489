"""The GEMM search: the GEMM family's side of the tuner protocol (``tuning.protocol``).

For each problem: candidates from our model (and NVIDIA's heuristics when installed), built in
parallel through the artifact cache, all problems' kernels at once (one kernel serves every shape
it fits); then the protocol's rounds, so that tens of kernels cost seconds, not minutes, of GPU
time per shape: every built candidate verified against a float32 reference and timed briefly;
the run-time variants (raster order, swizzle, splits) of the best few (of all, for FP8), verified
too; each of the best four timed beside torch.matmul, the pair interleaved repetition by
repetition; the best ratio wins and is stored with torch's time and the runners-up.

A time budget goes mostly to builds (each problem's best candidates first); measuring gets the
rest, and each problem at least a few seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time

from cutlass_ops.gemms import dsl
from cutlass_ops.gemms.choice import Choice
from cutlass_ops.gemms.config import GemmProblem
from cutlass_ops.gemms.fp8 import fp8_skinny_route
from cutlass_ops.gemms.gemm_entries import gemm_cache
from custom_kernels.core.tuned_store import TuningCache
from tuning import candidates, protocol
from tuning.backend import Backend
from tuning.candidates import Strategy
from tuning.protocol import Progress

# The protocol's own (GEMMs are what it was set for), with each round timed as one interleaved
# group: a long FP8 tune's clock drift otherwise ranked the kernels by when they ran.
ROUNDS = protocol.Rounds(interleaved=True)
BUILD_SHARE = 0.75  # of a time budget, for builds: measuring is quick but must not be starved
MIN_MEASURE_S = 2.0  # every problem's measuring time, budget or not
# Kernels at most this long (ms of GPU time) are also timed as whole eager calls beside
# torch.matmul's (``protocol.whole_call``): a call's host work, 10 to 45 us, is of their order.
WHOLE_CALL_BELOW_MS = 0.05


@dataclasses.dataclass
class TuneResult:
    problem: GemmProblem
    entry: dict
    cached: bool  # True when the cache already had it and nothing ran


@dataclasses.dataclass
class TuneReport:
    results: list[TuneResult]
    build_seconds: float
    measure_seconds: float
    built: int  # kernels compiled now
    reused: int  # kernels found in the artifact cache


def tune(problems: list[GemmProblem], *, backend: Backend, strategy: Strategy | str = "default",
         budget_s: float | None = None, cache: TuningCache | None = None, force: bool = False,
         use_heuristics: bool = True, progress: Progress | None = None,
         build_chunk: int | None = None) -> TuneReport:
    """Tunes each problem not already in the cache (all of them with ``force``)."""
    family = GemmFamily(backend, Strategy(strategy), budget_s=budget_s,
                        use_heuristics=use_heuristics, progress=progress, build_chunk=build_chunk)
    cache = cache if cache is not None else gemm_cache(backend.scope())
    results = protocol.run(problems, family, cache, force=force, progress=progress)
    return TuneReport([TuneResult(r.problem, r.entry, r.cached) for r in results],
                      family.build_seconds, time.perf_counter() - family.build_end,
                      family.compiled, family.reused)


class GemmFamily:
    """Candidates, builds within a budget, sessions and entries of GEMM problems."""

    rounds = ROUNDS
    whole_call_below_ms = WHOLE_CALL_BELOW_MS

    def __init__(self, backend: Backend, strategy: Strategy, *, budget_s: float | None,
                 use_heuristics: bool, progress: Progress | None, build_chunk: int | None):
        self.backend, self.strategy, self.use_heuristics = backend, strategy, use_heuristics
        self.progress = progress or (lambda *args: None)
        self.build_chunk = build_chunk
        self.start = time.perf_counter()
        self.budget_end = None if budget_s is None else self.start + budget_s
        self.build_budget_end = None if budget_s is None else self.start + BUILD_SHARE * budget_s
        self.device = backend.device()
        self.build_seconds = 0.0
        self.build_end = self.start
        self.compiled = self.reused = 0

    def candidates(self, problem: GemmProblem) -> list:
        """The C++ kernels (``candidates.select``), then, with the DSL extra on an sm90 GPU, the
        CuTe DSL kernels that take the problem, and for a scaled FP8 problem of few rows on an
        sm90 GPU, the skinny kernel's configs (``fp8_skinny_route``): one pool, ranked by
        measurement."""
        dsl_beside = self.device.arch == "sm90a" and dsl.refusal(problem) is None
        plan: list = candidates.select(problem, self.device, self.strategy,
                                       use_heuristics=self.use_heuristics,
                                       dsl_beside=dsl_beside)
        if dsl_beside:
            plan += dsl.candidates(problem.m, problem.n, problem.k,
                                   self.device.sm_count)[:self.strategy.dsl_kernels]
        if self.device.arch == "sm90a":
            plan += fp8_skinny_route.candidates(problem)
        return plan

    def build(self, plans: dict[GemmProblem, list[Choice]]) -> dict:
        """Builds in chunks (with a budget) in the order of ``_build_order``."""
        order = _build_order(plans)
        built: dict[tuple, object] = {}
        chunk = max(1, self.build_chunk or (len(order) if self.budget_end is None
                                            else _jobs(self.backend)))
        done = 0
        self.progress("build", 0, len(order), "")

        def on_done(spec, result):
            nonlocal done
            done += 1
            self.progress("build", done, len(order), spec.name)

        for i in range(0, len(order), chunk):
            if self.build_budget_end is not None and built \
                    and time.perf_counter() > self.build_budget_end:
                break
            part = self.backend.build(order[i:i + chunk], on_done=on_done)
            built.update(part)
            for result in part.values():
                seconds = getattr(result, "seconds", None)
                if seconds is not None:
                    self.compiled += seconds > 0
                    self.reused += seconds == 0
        self.build_end = time.perf_counter()
        self.build_seconds = self.build_end - self.start
        out = {}
        for problem, plan in plans.items():
            keys = {choice: (choice.operands_for(problem.operands), choice.config)
                    for choice in plan if isinstance(choice, Choice)}
            out[problem] = {choice: _build_error(built[key]) for choice, key in keys.items()
                            if key in built}
            # DSL and skinny kernels compile in process on their first launch (in the session's
            # verify step: 2 to 5 s each, once per build); a failure is recorded there.
            out[problem].update((c, None) for c in plan
                                if isinstance(c, (dsl.DslConfig, fp8_skinny_route.SkinnyConfig)))
        return out

    def session(self, problem: GemmProblem):
        return self.backend.session(problem)

    def derived(self, problem: GemmProblem, ranked: list[Choice]) -> list[Choice]:
        """The run-time variants of the best few kernels (no new build). For scaled FP8
        problems, those of every kernel of the seed pool (``candidates.fp8_seeds``): a kernel's
        first-round time at the default tile order says little about its best order, and an
        H100 tune's winners ranked last unswizzled (docs/measurements.md, "Every FP8 kernel's
        tile orders"). That includes the stream-K kernel's forced split counts wherever it
        ranked: its first-round time is CUTLASS's own split count, and small-M, long-K shapes
        need the forced splits."""
        choices = [c for c in ranked if isinstance(c, Choice)]
        count = self.strategy.varied_kernels
        if problem.operands.scaling.value != "none":
            count = max(count, len(candidates.fp8_seeds(problem)))
        return [variant for choice in choices[:count]
                for variant in candidates.variants(problem, choice, self.device)[1:]]

    def baseline(self, problem: GemmProblem, plan: list[Choice]) -> None:
        return None  # torch.matmul, timed beside each finalist, is the GEMMs' baseline

    def deadline(self) -> float | None:
        if self.budget_end is None:
            return None
        return max(self.budget_end, time.perf_counter() + MIN_MEASURE_S)

    def entry(self, problem: GemmProblem, measured: protocol.Measured) -> dict:
        times, winner = measured.times, measured.winner
        winner_ms = times[winner] if winner else None
        torch_ms = measured.torch_ms
        ranked = measured.ranked()
        other = next((c for c in ranked if winner is not None and c.backend != winner.backend),
                     None)
        return {
            "winner": winner.to_dict() if winner else None,
            "winner_name": winner.name if winner else None,
            "backend": winner.backend if winner else None,
            # The best of the other CUTLASS path, measured beside torch when it was a finalist.
            "other_backend_best": {"choice": other.name, "backend": other.backend,
                                   "ms": times[other],
                                   "torch_ms": measured.torch_beside.get(other)}
            if other is not None else None,
            "winner_ms": winner_ms,
            "winner_tflops": round(problem.flops / winner_ms / 1e9, 2) if winner else None,
            "torch_ms": torch_ms,
            "torch_tflops": round(problem.flops / torch_ms / 1e9, 2),
            "prefer": "cutlass" if winner_ms is not None and winner_ms <= torch_ms else "torch",
            "runners_up": [{"choice": c.name, "backend": c.backend, "ms": times[c],
                            "torch_ms": measured.torch_beside.get(c)}
                           for c in ranked[1:1 + self.rounds.runners_up]],
            "failures": [{"choice": f.candidate, "stage": f.stage, "error": f.error[:400]}
                         for f in measured.failures],
            "compiled_candidates": measured.runnable,
            "timed_variants": len(times),
            "strategy": self.strategy.value,
            "complete": measured.complete,
            "tune_seconds": round(measured.seconds, 2),
            "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "build_seconds_total": round(self.build_seconds, 2),
            # Called eagerly, host included (protocol.whole_call): where the call's order is not
            # the kernels', dispatch runs the kernel that won on GPU time inside CUDA graphs only
            # and the other eagerly (GemmEntry.eager_prefers_torch / eager_prefers_kernel).
            "whole_call_ms": measured.whole_call[0] if measured.whole_call else None,
            "torch_whole_call_ms": measured.whole_call[1] if measured.whole_call else None,
        }


def _build_order(plans: dict[GemmProblem, list[Choice]]) -> list[tuple]:
    """Kernels to build, interleaving the problems' rankings (every problem's best first) so that
    a time budget cut leaves each problem its best candidates."""
    order = []
    depth = max((len(p) for p in plans.values()), default=0)
    for i in range(depth):
        for problem, plan in plans.items():
            if i < len(plan) and isinstance(plan[i], Choice):  # DSL kernels build in process
                order.append((plan[i].operands_for(problem.operands), plan[i].config))
    return list(dict.fromkeys(order))


def _build_error(result) -> str | None:
    """None for a built kernel, else its error as the entry records it."""
    if isinstance(result, Exception):
        return f"{type(result).__name__}: {result}"[:400]
    return None


def _jobs(backend: Backend) -> int:
    from cutlass_ops.gemms.build import default_jobs

    return getattr(backend, "jobs", None) or default_jobs()


def speedup(entry: dict) -> float:
    """torch time over the winner's: above 1 means the tuned kernel is faster."""
    if not entry.get("winner_ms"):
        return math.nan
    return entry["torch_ms"] / entry["winner_ms"]
