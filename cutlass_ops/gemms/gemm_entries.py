"""The GEMM family's tuned entries: one typed record per stored problem, and the schema that reads
it (``custom_kernels.core.tuned_store.EntrySchema``).

What ``tuning.search`` stores for a problem: the winner (a C++ kernel's ``Choice``, a DSL
kernel's ``DslConfig`` or, for a scaled FP8 problem of few rows, the skinny kernel's
``SkinnyConfig``), its time and torch.matmul's, which of them to use, the runners-up and
the failures. An entry is accepted only if its key is its own problem's name, its winner is a
config of this library that can run the problem's operands on the scope's architecture (the
space's rules, or the DSL path's), and every time is a finite number above zero. Dispatch and
the CLI read ``GemmEntry`` records, never the stored dict.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping, Optional, Union

from cutlass_ops.gemms import dsl, space
from cutlass_ops.gemms.choice import Choice, candidate_from_dict
from cutlass_ops.gemms.config import GemmProblem
from cutlass_ops.gemms.fp8 import fp8_skinny_route
from custom_kernels.core import tuned_fields as f
from custom_kernels.core.tuned_store import CacheScope

Winner = Union[Choice, "dsl.DslConfig", "fp8_skinny_route.SkinnyConfig"]

_FIELDS = {"problem", "winner", "winner_name", "backend", "other_backend_best", "winner_ms",
           "winner_tflops", "torch_ms", "torch_tflops", "prefer", "runners_up", "failures",
           "compiled_candidates", "timed_variants", "strategy", "complete", "tune_seconds",
           "tuned_at", "build_seconds_total", "whole_call_ms", "torch_whole_call_ms"}


@dataclasses.dataclass(frozen=True)
class GemmEntry(f.StoredRecord):
    key: str
    problem: GemmProblem
    winner: Optional[Winner]  # None: every candidate failed
    prefer: str  # "cutlass" (the winner runs) or "torch" (torch.matmul was faster)
    winner_ms: Optional[float]
    torch_ms: float
    runners_up: tuple[tuple[str, float], ...]
    failures: tuple[tuple[str, str, str], ...]  # (candidate, stage, error)
    complete: bool  # False: a time budget cut the tune short
    stored: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)
    # The winner's and torch.matmul's whole eager calls (host included), timed where the kernel
    # is short enough for the host to matter (``tuning.search.WHOLE_CALL_BELOW_MS``); else None.
    whole_call_ms: Optional[float] = None
    torch_whole_call_ms: Optional[float] = None

    @property
    def uses_kernel(self) -> bool:
        """Whether dispatch runs the winner (else torch.matmul)."""
        return self.prefer == "cutlass" and self.winner is not None

    @property
    def eager_prefers_torch(self) -> bool:
        """The winner's kernel is faster, but called eagerly torch.matmul's whole call is: the
        kernel then runs inside CUDA graphs only (``dispatch``)."""
        return self.uses_kernel and self.whole_call_ms is not None and \
            self.torch_whole_call_ms is not None and self.whole_call_ms > self.torch_whole_call_ms

    @property
    def eager_prefers_kernel(self) -> bool:
        """The mirror: torch.matmul's kernel is faster, but called eagerly the winner's whole
        call is (its launch costs the host less than torch's): the kernel then runs eagerly
        only, torch.matmul inside CUDA graphs (``dispatch``)."""
        return not self.uses_kernel and self.winner is not None and \
            self.whole_call_ms is not None and self.torch_whole_call_ms is not None and \
            self.whole_call_ms < self.torch_whole_call_ms

    @property
    def backend(self) -> Optional[str]:
        """Which CUTLASS path won: "cutlass" (C++) or "dsl"."""
        return self.winner.backend if self.winner is not None else None


def parse_problem(value: Any) -> GemmProblem:
    data = f.mapping(value, "problem")
    problem = f.parsed("problem", lambda: GemmProblem.from_dict(data))
    f.require_canonical(data, problem.to_dict(), "problem")
    for name in ("m", "n", "k", "batch"):
        f.integer(data, name, default=1 if name == "batch" else None)
    return problem


def parse_winner(value: Any, problem: GemmProblem, scope: CacheScope) -> Winner:
    """A stored winner that can run ``problem`` on ``scope``'s GPU, else EntryRejected."""
    data = f.mapping(value, "winner")
    winner = f.parsed("winner", lambda: candidate_from_dict(data))
    f.require_canonical(data, winner.to_dict(), "winner")
    if winner.backend == "dsl":
        f.require(scope.compute_capability == 90, "a DSL winner on a GPU that is not sm90")
        why = dsl.operands_refusal(problem)
        f.require(why is None, f"its DSL winner cannot run {problem.operands.name}: {why}")
        return winner
    if winner.backend == fp8_skinny_route.BACKEND:
        f.require(scope.compute_capability == 90, "a skinny FP8 winner on a GPU that is not sm90")
        why = fp8_skinny_route.operands_refusal(problem)
        f.require(why is None, f"its skinny FP8 winner cannot run {problem.name}: {why}")
        return winner
    f.require(winner.config.arch.cc == scope.compute_capability,
              f"its winner is an {winner.config.arch.value} kernel, the scope's GPU is "
              f"cc {scope.compute_capability}")
    why = space.violations(winner.operands_for(problem.operands), winner.config)
    f.require(not why, f"its winner cannot run {problem.operands.name}: {'; '.join(why)[:300]}")
    return winner


class GemmSchema:
    """``EntrySchema`` of the GEMM family."""

    family = "gemm"
    directory = ""

    def parse(self, key: str, raw: Any, scope: CacheScope) -> GemmEntry:
        data = f.entry_fields(raw, _FIELDS)
        problem = parse_problem(data.get("problem"))
        f.own_key(key, problem)
        winner = None if data.get("winner") is None else \
            parse_winner(data["winner"], problem, scope)
        prefer = f.text(data, "prefer", choices=("cutlass", "torch"), default="cutlass")
        f.require(winner is not None or prefer == "torch", "it prefers a kernel but names none")
        outcome = f.measured(data, winner, "choice")
        f.require(f.text(data, "winner_name", optional=True) in (None, _name(winner)),
                  "winner_name is not its winner's name")
        f.require(f.text(data, "backend", optional=True) in (None, _backend(winner)),
                  "backend is not its winner's path")
        _check_display_fields(data)
        whole = [f.milliseconds(data, name, optional=True)
                 for name in ("whole_call_ms", "torch_whole_call_ms")]
        f.require((whole[0] is None) == (whole[1] is None),
                  "one whole-call time without the other")
        f.require(whole[0] is None or winner is not None, "a whole-call time without a winner")
        return GemmEntry(key, problem, winner, prefer, *outcome, copy.deepcopy(dict(data)),
                         *whole)


def _check_display_fields(data: Mapping[str, Any]) -> None:
    """The fields only ``cutlass-tune list`` / ``show`` read: their types, so that a listing
    never stumbles on one."""
    for name in ("winner_tflops", "torch_tflops", "tune_seconds", "build_seconds_total"):
        f.figure(data, name)
    for name in ("compiled_candidates", "timed_variants"):
        if data.get(name) is not None:
            f.integer(data, name, 0, 1_000_000)
    f.text(data, "strategy", optional=True)
    f.text(data, "tuned_at", optional=True)
    other = data.get("other_backend_best")
    if other is not None:
        f.measured_alternative("choice")(f.mapping(other, "other_backend_best"))


def _name(winner: Optional[Winner]) -> Optional[str]:
    return winner.name if winner is not None else None


def _backend(winner: Optional[Winner]) -> Optional[str]:
    return winner.backend if winner is not None else None


SCHEMA = GemmSchema()


def gemm_cache(scope: CacheScope, root=None):
    """The GEMM tuning cache of ``scope`` (``custom_kernels.core.tuned_store.TuningCache``)."""
    from custom_kernels.core.tuned_store import TuningCache

    return TuningCache(scope, SCHEMA, root)


__all__ = ["GemmEntry", "GemmSchema", "SCHEMA", "gemm_cache", "parse_problem", "parse_winner"]
