"""Tuning the FP8 grouped kernels (``cutlass_ops.gemms.grouped.grouped_build.GroupedFp8Config``,
issue 53): the FP8 grouped family's side of the tuner protocol (``tuning.protocol``).

Per ``GroupedFp8Problem`` (experts, mean rows per expert as a bucket, N, K, recipe): the
candidates (``grouped_build.fp8_candidates``) built in parallel through the build cache, each
run on random e4m3 operands with random scales of the recipe, the rows split evenly and
Zipf-skewed (``grouped_search.skewed_offsets``), checked on both and with the first expert empty
against the float32 reference (``cutlass_ops.fp8.scaled_grouped_mm_op.reference``), timed as
CUDA-graph replays after an L2 flush; the finalists each timed again beside torch's call,
interleaved.

- Blockwise: torch has no blockwise grouped GEMM; its call is ``torch._grouped_mm`` on the same
  values in bf16 (what a user runs without FP8), measured beside, and the fastest finalist wins
  (geometric mean over the routings). ``scaled_grouped_mm`` runs the stored winner, and
  ``GroupedFp8Config()`` where none is stored.
- Rowwise: torch's call is ``torch._scaled_grouped_mm`` on the same operands, and the winner is
  the fastest finalist that beat it on every routing timed (``prefer`` "cutlass"); with none,
  ``scaled_grouped_mm`` keeps running torch's kernel (``prefer`` "torch").

Entries live in the tuning cache of this GPU, family ``grouped_fp8``.
"""

from __future__ import annotations

from statistics import geometric_mean
from typing import Callable, Iterable

from cutlass_ops.gemms.grouped import grouped_build
from cutlass_ops.gemms.grouped.grouped_build import GroupedFp8Config, GroupedFp8Problem
from cutlass_ops.gemms.grouped.grouped_fp8_entries import grouped_fp8_cache
from tuning import protocol
from tuning.grouped_search import GpuGroupedBackend, GroupedFamily, skewed_offsets

TOLERANCE = 1e-2  # norm-wise against float32 (docs/measurements.md has the measured errors)


def moe_problems(experts: int, n: int, k: int, rows: int,
                 recipe: str = "blockwise") -> list[GroupedFp8Problem]:
    """An MoE layer's forward expert GEMM ``rows`` x K -> N over ``experts`` experts in FP8."""
    if recipe not in grouped_build.FP8_RECIPES:
        recipes = " and ".join(grouped_build.FP8_RECIPES)
        raise ValueError(f"FP8 grouped GEMMs are tuned for the {recipes} recipes, not {recipe}")
    return [GroupedFp8Problem(experts, grouped_build.bucket(rows / experts), n, k, recipe)]


def tune(problems: Iterable[GroupedFp8Problem], *, strategy: str = "default",
         force: bool = False, backend=None, cache=None,
         progress: Callable[[str], None] = print) -> list[protocol.Result]:
    """Tunes each problem not yet in the cache (all with ``force``), storing each entry as soon
    as its problem is done."""
    family = GroupedFp8Family(strategy, backend or GpuGroupedFp8Backend(), progress)
    return protocol.run(list(problems), family,
                        cache if cache is not None else grouped_fp8_cache(), force=force)


class GroupedFp8Family(GroupedFamily):
    """The bf16 grouped family's builds (nvcc in parallel through the build cache) and sessions
    (kept for their per-routing ratios), with FP8 candidates, no round 2 (no DSL twins, no skew
    dispatch: one kernel serves both routings) and its own entry."""

    def __init__(self, strategy: str, backend, progress: Callable[[str], None]):
        super().__init__(strategy, backend, progress, dynamic_twins=False)

    def candidates(self, problem: GroupedFp8Problem) -> list[GroupedFp8Config]:
        return grouped_build.fp8_candidates(problem, self.strategy)

    def derived(self, problem, ranked):
        return ()

    def baseline(self, problem, plan):
        # The default blockwise kernel (what runs untuned) is timed in the final round whatever
        # its rank, so the entry says what tuning gained.
        default = GroupedFp8Config()
        return default if default in plan else None

    def entry(self, problem: GroupedFp8Problem, measured: protocol.Measured) -> dict:
        times = measured.times
        ratios = getattr(self._sessions.pop(problem, None), "ratios", {})
        finalists = sorted(measured.final_ms, key=times.get)
        if problem.recipe == "rowwise":  # it must beat torch's kernel on every routing
            safe = [c for c in finalists if c in ratios and max(ratios[c]) <= 1.0]
            winner = (safe or finalists or [None])[0]
            prefer = "cutlass" if safe else "torch"
        else:
            winner, prefer = (finalists or [None])[0], "cutlass"
        torch_ms = measured.torch_beside.get(winner) if winner else measured.torch_ms
        ranked = sorted(times, key=times.get)
        reference = ("torch._scaled_grouped_mm on the same operands" if problem.recipe ==
                     "rowwise" else "torch._grouped_mm on the same values in bf16")
        return {
            "problem": problem.to_dict(),
            "winner": winner.name if winner else None,
            "prefer": prefer,
            "winner_ms": times[winner] if winner else None,
            "torch_ms": torch_ms,
            "winner_tflops": round(problem.flops / times[winner] / 1e9, 2) if winner else None,
            "timed_on": "geometric mean of an even and a Zipf-skewed routing; torch_ms: "
                        + reference,
            **self.measured_fields(measured, ranked, winner, ratios),
        }


class GpuGroupedFp8Backend(GpuGroupedBackend):
    """Builds as the bf16 grouped family builds (nvcc in parallel, the build cache); measures
    with ``GroupedFp8Session``."""

    def session(self, problem):
        return GroupedFp8Session(problem)


class GroupedFp8Session:
    """One problem's random FP8 operands and scales of its recipe, its float32 reference per
    routing, and torch's call (``tuning.protocol.Session``; the module docstring says which)."""

    def __init__(self, problem: GroupedFp8Problem):
        import torch

        from cutlass_ops.fp8 import scaled_grouped_mm_op as sgm
        from cutlass_ops.gemms.grouped import grouped_fp8_runtime as runtime

        p = self.problem = problem
        g = torch.Generator("cuda").manual_seed(0)
        fp8, rows, blocks_k, blocks_n = torch.float8_e4m3fn, p.groups * p.m, p.k // 128, p.n // 128
        self.a = (torch.randn(rows, p.k, device="cuda", generator=g) * 2).to(fp8)
        self.b = (torch.randn(p.groups, p.n, p.k, device="cuda", generator=g) * 2).to(fp8)
        if p.recipe == "rowwise":
            self.scale_a = torch.rand(rows, device="cuda", generator=g) + 0.5
            self.scale_b = torch.rand(p.groups, p.n, device="cuda", generator=g) + 0.5
            public_scale_b = self.scale_b
        else:
            self.scale_a = torch.rand(rows, blocks_k, device="cuda", generator=g) + 0.5
            self.scale_b = runtime.weight_scale_layout(
                torch.rand(p.groups, blocks_n, blocks_k, device="cuda", generator=g) + 0.5)
            public_scale_b = self.scale_b.transpose(1, 2)
            # The same values in bf16, the weights as [E, K, N] views: the call without FP8.
            self.a16 = self.a.to(torch.bfloat16)
            self.b16 = self.b.to(torch.bfloat16).transpose(1, 2)
        even = torch.full((p.groups,), p.m, device="cuda", dtype=torch.int32).cumsum(0)
        self.routings = [even.to(torch.int32)]
        if p.groups > 1:
            self.routings.append(skewed_offsets(p.groups, p.m, even.device))
        checked = list(self.routings)
        if p.groups > 1:
            empty_first = self.routings[0].clone()
            empty_first[0] = 0
            checked.append(empty_first)
        self.checked = [(offs, sgm.reference(self.a, self.b.transpose(1, 2), self.scale_a,
                                             public_scale_b, offs))
                        for offs in checked]
        self.ratios: dict = {}

    def _launch(self, config, offs):
        from cutlass_ops.gemms.grouped import grouped_fp8_runtime as runtime

        return lambda: runtime.run(config, self.a, self.b, self.scale_a, self.scale_b, offs)

    def _torch(self, offs):
        import torch

        if self.problem.recipe == "rowwise":
            a, b, scale_a, scale_b = self.a, self.b.transpose(1, 2), self.scale_a, self.scale_b
            return lambda: torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs,
                                                    out_dtype=torch.bfloat16)
        return lambda: torch._grouped_mm(self.a16, self.b16, offs)

    def verify(self, config) -> str | None:
        import torch

        from custom_kernels.core.errors import CutlassOpsError

        names = ["an even split", "a skewed split", "an empty expert"]
        for i, (offs, reference) in enumerate(self.checked):
            try:
                out = self._launch(config, offs)()
                torch.cuda.synchronize()
            except CutlassOpsError as exc:
                return f"launch: {exc}"[:400]
            end = int(offs[-1])  # rows past the last offset are not written
            why = protocol.check([out[:end]], [reference[:end]], TOLERANCE)
            if why:
                return why if i == 0 else f"with {names[i]}: {why}"
        return None

    def time_ms(self, config, reps: int) -> float:
        from tuning.timing import do_bench

        return geometric_mean(do_bench(self._launch(config, offs), reps=reps, graph=True)
                              .median_ms for offs in self.routings)

    def torch_ms(self, reps: int) -> float:
        from tuning.timing import do_bench

        return geometric_mean(do_bench(self._torch(offs), reps=reps, graph=True).median_ms
                              for offs in self.routings)

    def compare_ms(self, configs, reps: int):
        from tuning.timing import do_bench_interleaved

        fns = {}
        for i, offs in enumerate(self.routings):
            fns.update({(c, i): self._launch(c, offs) for c in configs})
            fns[("torch", i)] = self._torch(offs)
        timings = do_bench_interleaved(fns, reps=reps, graph=True)
        times = {key: t.median_ms for key, t in timings.items()}
        n = len(self.routings)
        for c in configs:
            self.ratios[c] = [times[(c, i)] / times[("torch", i)] for i in range(n)]

        def combined(who):
            return geometric_mean(times[(who, i)] for i in range(n))

        return {c: combined(c) for c in configs}, combined("torch")

    def close(self) -> None:
        self.a = self.b = self.scale_a = self.scale_b = None
        self.a16 = self.b16 = None
        self.routings = self.checked = []


__all__ = ["GroupedFp8Family", "GpuGroupedFp8Backend", "GroupedFp8Session", "moe_problems",
           "tune"]
