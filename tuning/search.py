"""The search: for each problem, select candidates, build them (in parallel, through the
artifact cache, all problems' kernels at once), verify and time them in rounds, and store the
winner with torch.matmul's time and the runners-up.

Rounds, so that tens of kernels cost seconds, not minutes, of GPU time per shape:
1. every built candidate, verified against a float32 reference, then timed briefly;
2. the run-time variants (raster order, swizzle, splits) of the best few, each verified too;
3. each of the best four beside torch.matmul, the pair timed interleaved repetition by
   repetition (clock and power drift would otherwise decide close calls); the best ratio wins.
Failures (rule, emission, compile, launch, wrong result) are results: kept in the entry, never
fatal. Each problem's entry is written as soon as it is done, so an interrupted tune keeps them.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
from typing import Callable

from cutlass_ops.gemms.config import GemmProblem
from tuning import candidates
from tuning.backend import Backend
from custom_kernels.core.tuned_store import TuningCache
from tuning.candidates import Strategy
from cutlass_ops.gemms.choice import Choice
from tuning.timing import GraphCaptureError

FIRST_ROUND_REPS = 15
FINALISTS = 4
FINAL_REPS = 60
RUNNERS_UP = 8
BUILD_SHARE = 0.75
MIN_MEASURE_S = 2.0

# Progress callback: (what, done, total, label), what in {"build", "problem"}.
Progress = Callable[[str, int, int, str], None]


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


def _build_order(plans: dict[GemmProblem, list[Choice]]) -> list[tuple]:
    """Kernels to build, interleaving the problems' rankings (every problem's best first) so that
    a time budget cut leaves each problem its best candidates."""
    order = []
    depth = max((len(p) for p in plans.values()), default=0)
    for i in range(depth):
        for problem, plan in plans.items():
            if i < len(plan):
                order.append((plan[i].operands_for(problem.operands), plan[i].config))
    return list(dict.fromkeys(order))


def _error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def tune(problems: list[GemmProblem], *, backend: Backend, strategy: Strategy | str = "default",
         budget_s: float | None = None, cache: TuningCache | None = None, force: bool = False,
         use_heuristics: bool = True, progress: Progress | None = None,
         build_chunk: int | None = None) -> TuneReport:
    """Tunes each problem not already in the cache (all of them with ``force``)."""
    strategy = Strategy(strategy)
    start = time.perf_counter()
    deadline = start + budget_s if budget_s is not None else None
    # Builds get most of a budget; measuring is quick but must not be starved.
    build_deadline = start + BUILD_SHARE * budget_s if budget_s is not None else None
    progress = progress or (lambda *args: None)
    device = backend.device()
    cache = cache if cache is not None else TuningCache(backend.scope())

    problems = list(dict.fromkeys(problems))
    results: dict[GemmProblem, TuneResult] = {}
    todo = []
    for problem in problems:
        entry = None if force else cache.get(problem)
        if entry is not None and entry.get("complete", True):
            results[problem] = TuneResult(problem, entry, cached=True)
        else:
            todo.append(problem)

    plans = {p: candidates.select(p, device, strategy, use_heuristics=use_heuristics)
             for p in todo}
    order = _build_order(plans)
    built: dict[tuple, object] = {}
    compiled = reused = 0
    chunk = max(1, build_chunk or (len(order) if deadline is None else _jobs(backend)))
    done = 0
    progress("build", 0, len(order), "")
    for i in range(0, len(order), chunk):
        if build_deadline is not None and time.perf_counter() > build_deadline and built:
            break

        def on_done(spec, result):
            nonlocal done
            done += 1
            progress("build", done, len(order), spec.name)

        part = backend.build(order[i:i + chunk], on_done=on_done)
        built.update(part)
        for result in part.values():
            seconds = getattr(result, "seconds", None)
            if seconds is not None:
                compiled += seconds > 0
                reused += seconds == 0
    build_seconds = time.perf_counter() - start

    measure_start = time.perf_counter()
    for n, problem in enumerate(todo):
        progress("problem", n, len(todo), problem.name)
        # Every problem gets a few seconds to measure its best candidates, budget or not.
        problem_deadline = None if deadline is None else max(
            deadline, time.perf_counter() + MIN_MEASURE_S)
        entry = _measure(problem, plans[problem], built, backend, strategy, problem_deadline)
        entry["build_seconds_total"] = round(build_seconds, 2)
        cache.put(problem, entry)
        results[problem] = TuneResult(problem, cache.get(problem) or entry, cached=False)
        progress("problem", n + 1, len(todo), problem.name)
    return TuneReport([results[p] for p in problems], build_seconds,
                      time.perf_counter() - measure_start, compiled, reused)


def _jobs(backend: Backend) -> int:
    from cutlass_ops.gemms.build import default_jobs

    return getattr(backend, "jobs", None) or default_jobs()


def _measure(problem: GemmProblem, plan: list[Choice], built: dict, backend: Backend,
             strategy: Strategy, deadline: float | None) -> dict:
    start = time.perf_counter()
    device = backend.device()
    failures: list[dict] = []
    times: dict[Choice, float] = {}
    complete = True

    def out_of_time() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    runnable = []
    for choice in plan:
        result = built.get((choice.operands_for(problem.operands), choice.config))
        if result is None:
            complete = False  # not built: the budget ran out first
        elif isinstance(result, Exception):
            failures.append({"choice": choice.name, "stage": "build", "error": _error_text(result)})
        else:
            runnable.append(choice)

    session = backend.session(problem)
    torch_by_choice: dict[Choice, float] = {}
    session_torch_ms = None
    try:
        def try_choice(choice: Choice) -> None:
            error = session.verify(choice)
            if error is None:
                try:
                    times[choice] = session.time_ms(choice, FIRST_ROUND_REPS)
                except GraphCaptureError as exc:  # it would break a user's CUDA graph too
                    error = f"capture: {exc}"
            if error is not None:
                failures.append({"choice": choice.name, "stage": error.split(":")[0],
                                 "error": error[:400]})

        for choice in runnable:
            if out_of_time() and times:
                complete = False
                break
            try_choice(choice)

        # Round 2: run-time variants of the best few kernels.
        for choice in sorted(times, key=times.get)[:strategy.finalists]:
            for variant in candidates.variants(problem, choice, device)[1:]:
                if out_of_time():
                    complete = False
                    break
                if variant not in times:
                    try_choice(variant)

        # Round 3: each of the best few against torch.matmul, the two interleaved repetition by
        # repetition. Pairs, not one group: how many kernels share a round changes the GPU's
        # power-limited clocks, and the benchmark compares one kernel with torch.
        finalists = sorted(times, key=times.get)[:FINALISTS]
        torch_by_choice: dict[Choice, float] = {}
        for choice in finalists:
            final, torch_by_choice[choice] = session.compare_ms([choice], FINAL_REPS)
            times[choice] = final[choice]
        if not finalists:  # nothing ran: torch's time still tells the user what to expect
            session_torch_ms = session.torch_ms(FINAL_REPS)
    finally:
        session.close()

    # The winner is the best ratio to torch among the finalists (each measured beside torch).
    ranked = sorted(times, key=lambda c: (c not in torch_by_choice,
                                          times[c] / torch_by_choice.get(c, 1.0), times[c]))
    winner = ranked[0] if ranked else None
    winner_ms = times[winner] if winner else None
    torch_ms = torch_by_choice[winner] if winner else session_torch_ms
    return {
        "winner": winner.to_dict() if winner else None,
        "winner_name": winner.name if winner else None,
        "winner_ms": winner_ms,
        "winner_tflops": round(problem.flops / winner_ms / 1e9, 2) if winner else None,
        "torch_ms": torch_ms,
        "torch_tflops": round(problem.flops / torch_ms / 1e9, 2),
        "prefer": "cutlass" if winner_ms is not None and winner_ms <= torch_ms else "torch",
        "runners_up": [{"choice": c.name, "ms": times[c], "torch_ms": torch_by_choice.get(c)}
                       for c in ranked[1:1 + RUNNERS_UP]],
        "failures": failures,
        "compiled_candidates": len(runnable),
        "timed_variants": len(times),
        "strategy": strategy.value,
        "complete": complete,
        "tune_seconds": round(time.perf_counter() - start, 2),
        "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def speedup(entry: dict) -> float:
    """torch time over the winner's: above 1 means the tuned kernel is faster."""
    if not entry.get("winner_ms"):
        return math.nan
    return entry["torch_ms"] / entry["winner_ms"]
