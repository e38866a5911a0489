"""Tuning the grouped (mixture-of-experts) GEMM kernels (``cutlass_ops.gemms.grouped.grouped_build``):
the grouped family's side of the tuner protocol (``tuning.protocol``), with the CuTe DSL path's
variable-length kernels (``cutlass_ops.gemms.grouped.dsl_grouped``, with the ``dsl`` extra on an sm90 GPU)
in the same pool for the 2d3d and 2d2d forms.

Per ``GroupedProblem`` (form, groups, per-group extents with the grouped one bucketed, element,
layouts): the candidates built in parallel (nvcc, through the build cache; about 35 s each, once
per config and layouts: the sizes are run-time values), each run on random operands with the
rows spread evenly over the groups and Zipf-skewed (``GroupedSession``), checked against the
per-group float32 reference
(``cutlass_ops.moe.grouped.reference``), timed as CUDA-graph replays after an L2 flush, the best
few beside ``torch._grouped_mm`` interleaved; the winner is the best of those that beat torch on
every routing (``GroupedFamily.entry``). Where the first round's best on the even routing is not
its best on the skewed one, the pair joins as a ``skew_dispatch.SkewDispatch`` (2d3d keys;
``GroupedFamily.derived``), chosen between on the device per call; before it, the best DSL
kernels' dynamic-scheduler twins. Entries live in the tuning
cache of this GPU, family ``grouped``; ``cutlass_ops.grouped_mm`` runs a stored winner that beat
torch and ``torch._grouped_mm`` otherwise.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time
from statistics import geometric_mean
from typing import Callable, Iterable

from cutlass_ops.gemms import dsl
from cutlass_ops.gemms.grouped import dsl_grouped, grouped_build, skew_dispatch
from cutlass_ops.gemms.grouped.grouped_build import GroupedConfig, GroupedProblem
from cutlass_ops.gemms.grouped.grouped_entries import GROUPED, grouped_cache
from custom_kernels.core.elements import element
from tuning import protocol

STRATEGIES = ("quick", "default", "exhaustive")


def moe_problems(experts: int, n: int, k: int, rows: int, *, backward: bool = False,
                 element: str = "bf16") -> list[GroupedProblem]:
    """An MoE layer's expert GEMM ``rows`` x K -> N over ``experts`` experts, its weights as
    Hugging Face stores them ([E, N, K]): the forward (2d3d, B column-major), and with
    ``backward`` dX (2d3d, B row-major) and dW, computed in the weights' layout as
    dY^T X (2d2d, A column-major: ``cutlass_ops.moe.grouped``'s backward)."""
    per_group = grouped_build.bucket(rows / experts)
    problems = [GroupedProblem("2d3d", experts, per_group, n, k, element, "t", "n")]
    if backward:
        problems += [GroupedProblem("2d3d", experts, per_group, k, n, element, "t", "t"),
                     GroupedProblem("2d2d", experts, n, k, per_group, element, "n", "t")]
    return problems


def parse(spec: str) -> tuple[int, int, int]:
    """``E:N:K`` (experts, output and input features of one expert GEMM) as integers."""
    try:
        experts, n, k = (int(part) for part in spec.split(":"))
    except ValueError:
        raise ValueError(f"--grouped takes E:N:K (experts:N:K, e.g. 8:14336:4096), got "
                         f"{spec!r}") from None
    if min(experts, n, k) < 1:
        raise ValueError(f"--grouped {spec}: every extent must be positive")
    return experts, n, k


def tune(problems: Iterable[GroupedProblem], *, strategy: str = "default",
         force: bool = False, backend: "GroupedBackend | None" = None, cache=None,
         progress: Callable[[str], None] = print,
         dynamic_twins: bool = True) -> list[protocol.Result]:
    """Tunes each problem not yet in the cache (all with ``force``), storing each entry as soon
    as its problem is done. ``dynamic_twins=False`` leaves the DSL kernels' dynamic-scheduler
    twins out of round 2 (the tune as it was before them, for a benchmark's comparison)."""
    family = GroupedFamily(strategy, backend or GpuGroupedBackend(), progress,
                           dynamic_twins=dynamic_twins)
    return protocol.run(list(problems), family, cache if cache is not None else grouped_cache(),
                        force=force)


class GroupedFamily:
    rounds = protocol.Rounds()

    def __init__(self, strategy: str, backend, progress: Callable[[str], None], *,
                 dynamic_twins: bool = True):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
        self.strategy, self.backend, self.progress = strategy, backend, progress
        self.dynamic_twins = dynamic_twins
        self.build_seconds = 0.0
        self._sessions: dict = {}

    def candidates(self, problem: GroupedProblem) -> list:
        """The C++ kernels, then (``backend.dsl``: the extra on an sm90 GPU) the DSL ones."""
        plan: list = grouped_build.candidates(problem, self.strategy)
        if self.backend.dsl:
            plan += dsl_grouped.candidates(problem, self.strategy)
        return plan

    def build(self, plans: dict) -> dict:
        """nvcc builds of the C++ kernels, in parallel; a DSL kernel compiles in process on its
        first launch (the session's verify step, about 2 s), and a failure is recorded there."""
        start = time.perf_counter()
        configs = list(dict.fromkeys(c for plan in plans.values() for c in plan
                                     if not dsl_grouped.is_dsl(c)))
        self.progress(f"building {len(configs)} grouped kernels")
        errors = self.backend.build(configs)
        self.build_seconds = time.perf_counter() - start
        return {problem: {c: errors.get(c) for c in plan} for problem, plan in plans.items()}

    def session(self, problem: GroupedProblem):
        session = self.backend.session(problem)
        self._sessions[problem] = session  # its per-routing ratios, for ``entry``
        return session

    def derived(self, problem, ranked):
        """Round 2, yielded one at a time (each is timed before the next is made): the
        dynamic-scheduler twins of the first round's best DSL kernels
        (``dsl_grouped.dynamic_twins``), then a ``skew_dispatch.SkewDispatch`` of the best
        kernel so far on the even routing and the best on the skewed one, where they differ
        (2d3d only): timed like any candidate, it wins where choosing per routing pays for its
        two extra launches."""
        if self.dynamic_twins:
            yield from dsl_grouped.dynamic_twins(ranked, self.strategy)
        session = self._sessions.get(problem)
        times = getattr(session, "routing_times", {})
        timed = [c for c, pair in times.items()
                 if len(pair) == 2 and not skew_dispatch.is_skew_dispatch(c)]
        if problem.form not in skew_dispatch.FORMS or not timed:
            return
        even = min(timed, key=lambda c: times[c][0])
        skewed = min(timed, key=lambda c: times[c][1])
        if even != skewed:
            yield skew_dispatch.SkewDispatch(even, skewed,
                                             skew_dispatch.threshold(session.skewed_ratio))

    def baseline(self, problem, plan):
        return None  # torch._grouped_mm, timed beside each finalist

    def deadline(self):
        return None

    def entry(self, problem: GroupedProblem, measured: protocol.Measured) -> dict:
        """The winner is the best finalist (geometric mean over the routings) that beat
        torch._grouped_mm on every routing timed: one that wins on skewed routing but loses
        on an even one would be a surprise on a load-balanced model. With none, torch runs."""
        times, ranked = measured.times, measured.ranked()
        ratios = getattr(self._sessions.pop(problem, None), "ratios", {})
        safe = [c for c in ranked if c in measured.torch_beside
                and max(ratios.get(c, [times[c] / measured.torch_beside[c]])) <= 1.0]
        winner = safe[0] if safe else measured.winner
        winner_ms = times[winner] if winner else None
        torch_ms = measured.torch_beside.get(winner, measured.torch_ms) if winner else \
            measured.torch_ms
        other = [c for c in ranked if winner and _path(c) != _path(winner)]
        return {
            "problem": problem.to_dict(),
            "winner": winner.name if winner else None,
            "backend": _path(winner) if winner else None,
            "other_backend_best": {"backend": _path(other[0]), "config": other[0].name,
                                   "ms": times[other[0]]} if other else None,
            "winner_ms": winner_ms, "torch_ms": torch_ms,
            "winner_tflops": round(problem.flops / winner_ms / 1e9, 2) if winner else None,
            "prefer": "cutlass" if safe else "torch",
            "timed_on": "geometric mean of an even and a Zipf-skewed routing",
            **self.measured_fields(measured, ranked, winner, ratios),
        }

    def measured_fields(self, measured: protocol.Measured, ranked: list, winner,
                        ratios: dict) -> dict:
        """The entry fields every grouped family stores alike: torch's time over the winner's
        on each routing (even, skewed) when measured, the runners-up, the failures, and how
        the tune ran."""
        times = measured.times
        return {
            "routing_speedups": [round(1 / r, 4) for r in ratios[winner]]
            if winner in ratios else None,
            "runners_up": [{"config": c.name, "ms": times[c],
                            "torch_ms": measured.torch_beside.get(c)}
                           for c in ranked if c != winner][:self.rounds.runners_up],
            "failures": [{"config": f.candidate, "stage": f.stage, "error": f.error[:400]}
                         for f in measured.failures],
            "strategy": self.strategy, "complete": measured.complete,
            "tune_seconds": round(measured.seconds, 2),
            "build_seconds_total": round(self.build_seconds, 2),
            "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
        }


def _path(config) -> str:
    """Which CUTLASS path a candidate is on: ``cutlass`` (C++) or ``dsl``; a skew dispatch's
    kernels' paths, ``cutlass+dsl`` where they differ."""
    if skew_dispatch.is_skew_dispatch(config):
        return "+".join(sorted({_path(config.even), _path(config.skewed)}))
    return "dsl" if dsl_grouped.is_dsl(config) else "cutlass"


class GroupedBackend:
    """Where grouped candidates are built and measured (a fake one in the CPU tests)."""

    dsl = False  # whether DSL candidates can run here

    def build(self, configs: list[GroupedConfig]) -> dict:
        """{config: error text} of the configs that failed to build."""

    def session(self, problem: GroupedProblem): ...


class GpuGroupedBackend(GroupedBackend):
    def __init__(self, jobs: int | None = None):
        import torch

        from cutlass_ops.gemms.build import default_jobs

        if not torch.cuda.is_available():  # before any nvcc build, not after them
            from custom_kernels.core.errors import UnsupportedInputError

            raise UnsupportedInputError("tuning grouped GEMMs needs a CUDA GPU, and torch sees "
                                        "none")
        self.jobs = jobs or default_jobs()
        self.dsl = torch.cuda.get_device_capability()[0] == 9 and dsl.unavailable() is None

    def build(self, configs):
        from custom_kernels.core.errors import BuildError

        errors = {}
        with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
            futures = {pool.submit(grouped_build.build, c): c for c in configs}
            for future, config in futures.items():
                try:
                    future.result()
                except BuildError as exc:
                    errors[config] = f"build: {exc}"[:400]
        return errors

    def session(self, problem):
        return GroupedSession(problem)


class GroupedSession:
    """One problem's random operands, its reference and torch's same call
    (``tuning.protocol.Session``).

    The tuning key holds the mean rows per group, not the routing's skew (reading the offsets
    would cost a host sync per call), so one winner must serve every routing of that mean. A
    candidate's time is therefore the geometric mean over two routings of the same rows: an even
    split, and a Zipf-skewed one (group g takes a share proportional to 1 / rank, ranks in a
    fixed random order), as MoE routers skew in practice. torch._grouped_mm is timed the same
    way."""

    def __init__(self, problem: GroupedProblem):
        import torch

        from cutlass_ops.moe import grouped
        from custom_kernels.core.tolerances import GEMM, relative_tolerance

        self.problem = p = problem
        dtype = element(p.element).torch_dtype
        g = torch.Generator("cuda").manual_seed(0)

        def matrix(*shape, layout, scale=1.0):
            rows, cols = shape[-2:]
            stored = (*shape[:-2], rows, cols) if layout == "t" else (*shape[:-2], cols, rows)
            t = (torch.randn(stored, device="cuda", generator=g) * scale).to(dtype)
            return t if layout == "t" else t.transpose(-1, -2)

        self.offs = None
        if p.form == "2d3d":
            self.a = matrix(p.groups * p.m, p.k, layout=p.layout_a, scale=p.k ** -0.5)
            self.b = matrix(p.groups, p.k, p.n, layout=p.layout_b)
            self.offs = self._offsets(per_group := p.m)
        elif p.form == "2d2d":
            self.a = matrix(p.m, p.groups * p.k, layout=p.layout_a, scale=p.k ** -0.5)
            self.b = matrix(p.groups * p.k, p.n, layout=p.layout_b)
            self.offs = self._offsets(per_group := p.k)
        elif p.form == "3d2d":
            self.a = matrix(p.groups, p.m, p.k, layout=p.layout_a, scale=p.k ** -0.5)
            self.b = matrix(p.k, p.groups * p.n, layout=p.layout_b)
            self.offs = self._offsets(per_group := p.n)
        else:
            self.a = matrix(p.groups, p.m, p.k, layout=p.layout_a, scale=p.k ** -0.5)
            self.b = matrix(p.groups, p.k, p.n, layout=p.layout_b)
        # The routings timed, and those verified (timed ones plus the first group left empty).
        self.routings = [self.offs]
        self.skewed_ratio = 1.0  # the skewed routing's largest group over the mean
        if self.offs is not None and p.groups > 1:
            self.routings.append(skewed_offsets(p.groups, per_group, self.offs.device))
            sizes = torch.diff(self.routings[1], prepend=self.routings[1].new_zeros(1))
            self.skewed_ratio = float(sizes.max()) / per_group
        checked = list(self.routings)
        if self.offs is not None and p.groups > 1:
            empty_first = self.offs.clone()
            empty_first[0] = 0
            checked.append(empty_first)
        self.checked = [(offs, grouped.reference(self.a, self.b, offs)) for offs in checked]
        self.out = torch.empty_like(self.checked[0][1])
        self.tolerance = relative_tolerance(p.element, GEMM)
        self.ratios: dict = {}
        self.routing_times: dict = {}  # each timed candidate's time on each routing (rounds 1, 2)

    def _offsets(self, per_group: int):
        import torch

        return torch.full((self.problem.groups,), per_group, device="cuda",
                          dtype=torch.int32).cumsum(0).to(torch.int32)

    def _launch(self, config, offs):
        from cutlass_ops.gemms.grouped import grouped_runtime

        return lambda: grouped_runtime.launch(config, self.problem.form, self.a, self.b, offs,
                                              self.out)

    def verify(self, config) -> str | None:
        """Checked on each routing timed and with the first group empty (routing leaves
        experts empty; their rows of D, or their whole D in the 2d2d form, must come out right
        all the same)."""
        import torch

        from custom_kernels.core.errors import CutlassOpsError

        names = ["an even split", "a skewed split", "an empty group"]
        for i, (offs, reference) in enumerate(self.checked):
            try:
                self.out.fill_(float("nan"))
                self._launch(config, offs)()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a DSL compile raises what it raises
                kind = "launch" if isinstance(exc, CutlassOpsError) else type(exc).__name__
                return f"{kind}: {exc}"[:400]
            why = protocol.check([self.out], [reference], self.tolerance)
            if why:
                return why if i == 0 else f"with {names[i]}: {why}"
        return None

    def _torch(self, offs):
        import torch

        a, b = self.a, self.b
        return lambda: torch._grouped_mm(a, b, offs)

    def _fns(self, configs) -> dict:
        """{(candidate or "torch", routing index): fn}"""
        fns = {}
        for i, offs in enumerate(self.routings):
            fns.update({(c, i): self._launch(c, offs) for c in configs})
            fns[("torch", i)] = self._torch(offs)
        return fns

    def _combined(self, times: dict, who) -> float:
        return geometric_mean(times[(who, i)] for i in range(len(self.routings)))

    def time_ms(self, config, reps: int) -> float:
        from tuning.timing import do_bench

        times = [do_bench(self._launch(config, offs), reps=reps, graph=True).median_ms
                 for offs in self.routings]
        self.routing_times[config] = times  # for GroupedFamily.derived
        return geometric_mean(times)

    def torch_ms(self, reps: int) -> float:
        from tuning.timing import do_bench

        return geometric_mean(do_bench(self._torch(offs), reps=reps, graph=True).median_ms
                              for offs in self.routings)

    def compare_ms(self, configs, reps: int):
        from tuning.timing import do_bench_interleaved

        timings = do_bench_interleaved(self._fns(configs), reps=reps, graph=True)
        times = {key: t.median_ms for key, t in timings.items()}
        for c in configs:  # each routing's time over torch's beside it (GroupedFamily.entry)
            self.ratios[c] = [times[(c, i)] / times[("torch", i)]
                              for i in range(len(self.routings))]
        return {c: self._combined(times, c) for c in configs}, self._combined(times, "torch")

    def close(self) -> None:
        self.a = self.b = self.out = self.offs = None
        self.routings = self.checked = []
        self.routing_times = {}


def skewed_offsets(groups: int, per_group: int, device=None):
    """Cumulative ends of ``groups * per_group`` rows split Zipf-like (group g's share
    proportional to 1 / rank, ranks in a fixed random order), each group a multiple of 8 rows
    (16-byte aligned starts whatever the layouts), the remainder on the largest group."""
    import torch

    total = groups * per_group
    ranks = torch.randperm(groups, generator=torch.Generator().manual_seed(0)).tolist()
    shares = [1.0 / (rank + 1) for rank in ranks]
    scale = total / sum(shares)
    counts = [int(share * scale) // 8 * 8 for share in shares]
    counts[ranks.index(0)] += total - sum(counts)
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


__all__ = ["GROUPED", "GroupedFamily", "GpuGroupedBackend", "grouped_cache", "moe_problems",
           "parse", "skewed_offsets", "tune"]
