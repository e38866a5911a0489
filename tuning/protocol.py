"""The one tuner protocol: the steps by which every kernel family's tuner picks and records a
winner. A family (``tuning.search`` for GEMMs, ``tuning.norm_search`` for the norms) provides its
candidates, its builds and a session per problem; this module runs the steps alike for all:

1. ``candidates(problem)``, the family's best guess first;
2. ``build`` them all (in parallel, through the build cache): a failure is recorded, never fatal;
3. each built candidate verified against the family's float32 reference (the bounds of
   ``custom_kernels.core.tolerances``), then timed briefly with the one clock (``tuning.timing``):
   the first round, one candidate after another or (``Rounds.interleaved``) as one group beside
   torch's call. Optionally a round 2 of candidates derived from the best (GEMM: run-time
   variants of a compiled kernel), verified and timed alike;
4. the finalists (and the family's baseline, the heuristic's choice, whatever its rank) timed
   again beside torch's same call, interleaved repetition by repetition, so that clock and power
   drift reach both alike; the best ratio to torch wins; where its kernel is short enough for
   the host to count, the winner's and torch's whole eager calls are timed too (``whole_call``):
   the record says which is faster called eagerly;
5. the winner, runners-up and failures stored in the tuned-results store
   (``custom_kernels.core.tuned_store``, the family's directory) as soon as each problem is done,
   so an interrupted tune keeps every problem it finished.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Hashable, Iterable, Protocol

from custom_kernels.core.tolerances import relative_error
from custom_kernels.core.tuned_store import TuningCache
from tuning.timing import GraphCaptureError

Candidate = Hashable  # a family's candidate (a GEMM Choice, a NormConfig), with a ``name``
# Progress callback: (what, done, total, label), what in {"build", "problem"}.
Progress = Callable[[str, int, int, str], None]


@dataclasses.dataclass(frozen=True)
class Rounds:
    """How much each round measures: one set for every family, overridden where a family's
    kernels need otherwise."""

    first_reps: int = 15  # enough to rank candidates, not to separate close ones
    finalists: int = 4  # the best of the first rounds, timed again beside torch
    final_reps: int = 60
    runners_up: int = 8  # stored with the winner
    # Each finalist timed beside torch alone, not all in one group: how many compute-bound kernels
    # share a round changes the GPU's power-limited clocks, and users compare one kernel to torch.
    paired: bool = True
    # The first round and round 2 each timed as one group with torch's call, interleaved
    # repetition by repetition, and ranked by time over torch's in the same group. Timed one
    # after another instead, a kernel's rank depends on when it ran: the clocks of a long tune
    # drift by more than the kernels differ (docs/measurements.md, "Every FP8 kernel's tile
    # orders").
    interleaved: bool = False


class Session(Protocol):
    """One problem's inputs on the device, its float32 reference and torch's same call."""

    def verify(self, candidate: Candidate) -> str | None:
        """None if the candidate computes the right result (``check``), else why not, as
        "stage: detail" (stages: launch, wrong result)."""

    # Times are the GPU's (tuning.timing). A call that cannot be captured in a CUDA graph, where
    # the family times graph replays, raises tuning.timing.GraphCaptureError.
    def time_ms(self, candidate: Candidate, reps: int) -> float: ...

    def torch_ms(self, reps: int) -> float: ...

    def compare_ms(self, candidates: list, reps: int) -> tuple[dict, float]:
        """The candidates and torch's call timed interleaved: ({candidate: ms}, torch ms)."""

    def close(self) -> None: ...


class Family(Protocol):
    """What a kernel family provides to be tuned."""

    rounds: Rounds

    def candidates(self, problem) -> list:
        """What to build and measure for ``problem``, the best guess first."""

    def build(self, plans: dict[Any, list]) -> dict[Any, dict]:
        """Builds every problem's candidates: {problem: {candidate: None when ready, else the
        build error}}. A candidate left out was not built (a time budget ran out first)."""

    def session(self, problem) -> Session: ...

    def derived(self, problem, ranked: list) -> Iterable:
        """Round 2: candidates made from the first round's ranking without a new build."""

    def baseline(self, problem, plan: list) -> Candidate | None:
        """A candidate timed in the final round whatever its rank (the heuristic's), or None."""

    def deadline(self) -> float | None:
        """When (``time.perf_counter``) the next problem's measuring must stop; None: never."""

    def entry(self, problem, measured: Measured) -> dict:
        """The stored entry of ``problem`` (the family's format)."""


def check(results: Iterable, references: Iterable, tolerance: float) -> str | None:
    """The verification step: None when each result is within ``tolerance``
    (``custom_kernels.core.tolerances.relative_tolerance``) of its float32 reference, else the
    failure. NaN (an unwritten output) fails."""
    errors = [relative_error(r, ref) for r, ref in zip(results, references)]
    worst = max(errors, key=lambda e: math.inf if math.isnan(e) else e)
    if not worst <= tolerance:
        return f"wrong result: relative error {worst:.3g} > {tolerance:g}"
    return None


@dataclasses.dataclass(frozen=True)
class Failure:
    candidate: str  # its name
    stage: str  # build, launch, wrong result, capture
    error: str


@dataclasses.dataclass
class Measured:
    """One problem's rounds."""

    runnable: int  # candidates built and ready
    # {candidate: ms} of the first round and round 2, in the order timed. Interleaved rounds
    # (Rounds.interleaved) scale each time by the first group's torch time over its own group's,
    # so that times of both rounds rank alike.
    first_ms: dict
    final_ms: dict  # {finalist: ms} beside torch
    torch_beside: dict  # {finalist: torch's ms beside it}
    torch_alone_ms: float | None  # torch's time when no candidate ran
    failures: list[Failure]
    complete: bool  # False when a budget left candidates unbuilt or untimed
    seconds: float
    # (the winner's, torch's) whole eager calls in ms, host included: step 4b, where the
    # family asks for it (``whole_call_below_ms``) and its session can time it; else None.
    whole_call: tuple[float, float] | None = None

    @property
    def times(self) -> dict:
        """The best-known time of each timed candidate: the final round's for the finalists."""
        return {**self.first_ms, **self.final_ms}

    def ranked(self) -> list:
        """The finalists by their ratio to torch (each measured beside torch), then the rest."""
        times = self.times
        return sorted(times, key=lambda c: (c not in self.torch_beside,
                                            times[c] / self.torch_beside.get(c, 1.0), times[c],
                                            self.first_ms[c]))

    @property
    def winner(self) -> Candidate | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    @property
    def torch_ms(self) -> float:
        """torch's time beside the winner (alone when nothing ran: what to expect)."""
        winner = self.winner
        return self.torch_beside[winner] if winner is not None else self.torch_alone_ms


def measure(problem, family: Family, plan: list, built: dict,
            deadline: float | None = None) -> Measured:
    """Steps 3 and 4 for one problem: its built candidates verified and timed in rounds."""
    start = time.perf_counter()
    rounds = family.rounds
    failures: list[Failure] = []
    complete = True
    runnable = []
    for candidate in plan:
        if candidate not in built:
            complete = False  # not built: the budget ran out first
        elif built[candidate] is not None:
            failures.append(Failure(candidate.name, "build", built[candidate]))
        else:
            runnable.append(candidate)

    first: dict = {}
    final: dict = {}
    torch_beside: dict = {}
    torch_alone = None
    tried = set()

    def out_of_time() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    def verified(candidates) -> list:
        nonlocal complete
        out = []
        for candidate in candidates:
            if out_of_time() and (first or out):
                complete = False
                break
            tried.add(candidate)
            error = session.verify(candidate)
            if error is None:
                out.append(candidate)
            else:
                failures.append(Failure(candidate.name, error.split(":")[0], error))
        return out

    def time_alone(candidate) -> None:
        try:
            first[candidate] = session.time_ms(candidate, rounds.first_reps)
        except GraphCaptureError as exc:  # it would break a user's CUDA graph too
            failures.append(Failure(candidate.name, "capture", f"capture: {exc}"))

    def time_round(candidates) -> None:
        """Verifies, then times, a round's candidates (``Rounds.interleaved``: as one group)."""
        nonlocal first_torch_ms
        group = verified(candidates)
        if rounds.interleaved and group:
            try:
                times, torch_ms = session.compare_ms(group, rounds.first_reps)
            except GraphCaptureError:
                pass  # some candidate cannot be captured: time each alone to find which
            else:
                first_torch_ms = first_torch_ms or torch_ms
                scale = first_torch_ms / torch_ms
                first.update((c, ms * scale) for c, ms in times.items())
                return
        for candidate in group:
            time_alone(candidate)

    first_torch_ms = None  # torch's time in the first interleaved group: the rounds' scale
    session = family.session(problem)
    try:
        time_round(runnable)
        time_round([c for c in family.derived(problem, sorted(first, key=first.get))
                    if c not in tried])

        finalists = sorted(first, key=first.get)[:rounds.finalists]
        baseline = family.baseline(problem, plan)
        if baseline in first and baseline not in finalists:
            finalists.append(baseline)
        if rounds.paired:
            for candidate in finalists:
                ms, torch_beside[candidate] = session.compare_ms([candidate], rounds.final_reps)
                final[candidate] = ms[candidate]
        elif finalists:
            final, torch_ms = session.compare_ms(finalists, rounds.final_reps)
            torch_beside = dict.fromkeys(finalists, torch_ms)
        if not finalists:  # nothing ran: torch's time still tells the user what to expect
            torch_alone = session.torch_ms(rounds.final_reps)
        measured = Measured(len(runnable), first, final, torch_beside, torch_alone, failures,
                            complete, 0.0)
        measured.whole_call = whole_call(family, session, measured, rounds.final_reps)
    finally:
        session.close()
    measured.seconds = time.perf_counter() - start
    return measured


# A winner slower than torch on GPU time by at most this factor is still timed as a whole eager
# call: where the host's work is of the kernel's order, the winner's cheaper launch may win the
# eager call all the same (dispatch then runs it eagerly only: GemmEntry.eager_prefers_kernel).
WHOLE_CALL_SLOWER_KERNEL = 1.15


def whole_call(family, session, measured: Measured, reps: int) -> tuple[float, float] | None:
    """Step 4b: where the winner's kernel is short enough for the host's work to count (under
    the family's ``whole_call_below_ms``) and beat torch's on GPU time or came near it (within
    ``WHOLE_CALL_SLOWER_KERNEL``), both called eagerly as a model calls them
    (``session.whole_call_ms``): (the winner's ms, torch's ms), else None."""
    limit = getattr(family, "whole_call_below_ms", None)
    winner = measured.winner
    if limit is None or winner is None or not hasattr(session, "whole_call_ms"):
        return None
    kernel_ms = measured.times[winner]
    if kernel_ms > limit or kernel_ms > measured.torch_ms * WHOLE_CALL_SLOWER_KERNEL:
        return None
    return session.whole_call_ms(winner, reps)


@dataclasses.dataclass
class Result:
    problem: Any
    entry: dict  # as the family wrote it; from the store, the fields its schema accepted
    cached: bool  # True when the store already had it and nothing ran


def run(problems: Iterable, family: Family, cache: TuningCache | None, *, force: bool = False,
        progress: Progress | None = None) -> list[Result]:
    """Every step for each problem not already in ``cache`` (all of them with ``force``); each
    entry is stored as soon as its problem is done. ``cache`` None: nothing is read or stored."""
    progress = progress or (lambda *args: None)
    problems = list(dict.fromkeys(problems))
    results: dict = {}
    todo = []
    for problem in problems:
        stored = None if force or cache is None else cache.get(problem)
        if stored is not None and stored.complete:
            results[problem] = Result(problem, stored.to_dict(), cached=True)
        else:
            todo.append(problem)

    plans = {problem: family.candidates(problem) for problem in todo}
    built = family.build(plans)
    for n, problem in enumerate(todo):
        progress("problem", n, len(todo), problem.name)
        measured = measure(problem, family, plans[problem], built[problem], family.deadline())
        entry = family.entry(problem, measured)
        if cache is not None:
            cache.put(problem, entry)
        results[problem] = Result(problem, entry, cached=False)
        progress("problem", n + 1, len(todo), problem.name)
    return [results[problem] for problem in problems]
