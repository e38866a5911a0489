"""The FP8 grouped GEMMs' tuned entries (``tuning.grouped_fp8_search`` writes them): one typed
record per stored problem (``GroupedFp8Problem``), the schema that reads it, and the lookup
``cutlass_ops.scaled_grouped_mm`` runs for its blockwise calls.

An entry is accepted only if its key is its own problem's name, its recipe is one this library
has kernels for, its winner is a ``GroupedFp8Config`` of that recipe, and every time is a finite
number above zero. Its ``torch_ms``: for blockwise, ``torch._grouped_mm`` on the same values in
bf16 (torch has no blockwise grouped GEMM; the winner always runs); for rowwise,
``torch._scaled_grouped_mm`` on the same operands, and the winner runs only where it beat it on
every routing timed (``prefer`` "cutlass"; "torch" otherwise).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional

from cutlass_ops.gemms.grouped.grouped_build import GroupedFp8Config, GroupedFp8Problem
from custom_kernels.core import tuned_fields as f
from custom_kernels.core.tuned_store import CacheScope, TuningCache, family_dir

GROUPED_FP8 = "grouped_fp8"  # the family's name in exports
RECIPES = ("blockwise", "rowwise")
_FIELDS = {"problem", "winner", "prefer", "winner_ms", "torch_ms", "winner_tflops", "routing_speedups",
           "runners_up", "failures", "timed_on", "strategy", "complete", "tune_seconds",
           "build_seconds_total", "tuned_at"}


@dataclasses.dataclass(frozen=True)
class GroupedFp8Entry(f.StoredRecord):
    key: str
    problem: GroupedFp8Problem
    winner: Optional[GroupedFp8Config]  # None: every candidate failed
    prefer: str  # "cutlass": the winner runs; "torch": torch._scaled_grouped_mm does (rowwise)
    winner_ms: Optional[float]
    torch_ms: float
    runners_up: tuple[tuple[str, float], ...]
    failures: tuple[tuple[str, str, str], ...]
    complete: bool
    stored: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)


def parse_problem(value: Any) -> GroupedFp8Problem:
    data = f.mapping(value, "problem")
    problem = f.parsed("problem", lambda: GroupedFp8Problem.from_dict(data))
    f.require_canonical(data, problem.to_dict(), "problem")
    f.text(data, "recipe", choices=RECIPES)
    for name in ("groups", "m", "n", "k"):
        f.integer(data, name)
    return problem


class GroupedFp8Schema:
    """``EntrySchema`` of the FP8 grouped GEMM family."""

    family = GROUPED_FP8
    directory = GROUPED_FP8

    def parse(self, key: str, raw: Any, scope: CacheScope) -> GroupedFp8Entry:
        data = f.entry_fields(raw, _FIELDS)
        problem = parse_problem(data.get("problem"))
        f.own_key(key, problem)
        f.require(scope.compute_capability == 90, "FP8 grouped kernels are sm90 kernels; the "
                  f"scope's GPU is cc {scope.compute_capability}")
        name = f.text(data, "winner", optional=True)
        winner = None if name is None else f.parsed(
            "winner", lambda: GroupedFp8Config.from_name(name))
        f.require(winner is None or winner.recipe == problem.recipe,
                  f"its winner {name} is a {getattr(winner, 'recipe', '')} kernel, the problem "
                  f"{problem.recipe}")
        prefer = f.text(data, "prefer", choices=("cutlass", "torch"), default="cutlass")
        f.require(prefer == "cutlass" or problem.recipe == "rowwise",
                  "a blockwise winner always runs (torch has no blockwise grouped GEMM)")
        outcome = f.measured(data, winner, "config")
        f.display_fields(data, ("winner_tflops", "tune_seconds", "build_seconds_total"),
                         ("timed_on", "strategy", "tuned_at"))
        f.short_ratios(data, "routing_speedups")
        return GroupedFp8Entry(key, problem, winner, prefer, *outcome, copy.deepcopy(dict(data)))


SCHEMA = GroupedFp8Schema()


def grouped_fp8_cache(device: int | None = None, root: Path | None = None) -> TuningCache:
    """The tuned FP8 grouped kernels of this GPU and software scope."""
    from custom_kernels.core.device import current_scope

    return TuningCache(current_scope(device), SCHEMA, root)


def tuned_config(problem: GroupedFp8Problem, device: int | None = None):
    """The stored winner of ``problem`` (a ``GroupedFp8Config``) where it is to run, or None:
    nothing tuned (no device query at all when nothing of this family was ever stored), or a
    rowwise winner that did not beat ``torch._scaled_grouped_mm``."""
    if not family_dir(SCHEMA).is_dir():
        return None
    entry = grouped_fp8_cache(device).get(problem)
    return None if entry is None or entry.prefer != "cutlass" else entry.winner


__all__ = ["GROUPED_FP8", "GroupedFp8Entry", "GroupedFp8Schema", "SCHEMA", "grouped_fp8_cache",
           "parse_problem", "tuned_config"]
