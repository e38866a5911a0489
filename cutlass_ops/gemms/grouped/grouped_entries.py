"""The grouped GEMMs' tuned entries (``tuning.grouped_search`` writes them): one typed record per
stored problem, the schema that reads it, and the lookup ``cutlass_ops.moe.grouped`` runs.

A grouped winner is named (``grouped-bf16-tn-...``, ``dsl-sm90-...``, or a ``skew-...`` pair of
them), and the name says which element type and layouts a C++ kernel was compiled for. An entry
is accepted only if its key is its own problem's name, its winner is a config of this library
whose element type and A and B layouts are the problem's (a DSL kernel's form and element type
its path takes; a skew pair in the 2d3d form only, both of its kernels checked), and every time
is a finite number above zero. The launcher checks the element type again at launch
(``grouped_runtime.run``).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional

from cutlass_ops.gemms import dsl
from cutlass_ops.gemms.grouped import dsl_grouped, skew_dispatch
from cutlass_ops.gemms.dsl import DslConfig
from cutlass_ops.gemms.grouped.grouped_build import ELEMENTS, GroupedConfig, GroupedProblem
from custom_kernels.core import tuned_fields as f
from custom_kernels.core.tuned_store import CacheScope, TuningCache, family_dir

GROUPED = "grouped"  # the family's name in exports
_FORMS = ("2d3d", "2d2d", "3d2d", "3d3d")
_PATHS = ("cutlass", "dsl", "cutlass+dsl")
_FIELDS = {"problem", "winner", "backend", "other_backend_best", "winner_ms", "torch_ms",
           "winner_tflops", "prefer", "routing_speedups", "runners_up", "failures", "timed_on",
           "strategy", "complete", "tune_seconds", "build_seconds_total", "tuned_at"}


@dataclasses.dataclass(frozen=True)
class GroupedEntry(f.StoredRecord):
    key: str
    problem: GroupedProblem
    winner: Any  # GroupedConfig, DslConfig or SkewDispatch; None: every candidate failed
    prefer: str  # "cutlass": the winner beat torch._grouped_mm on every routing timed
    winner_ms: Optional[float]
    torch_ms: float
    runners_up: tuple[tuple[str, float], ...]
    failures: tuple[tuple[str, str, str], ...]
    complete: bool
    stored: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)

    @property
    def uses_kernel(self) -> bool:
        return self.prefer == "cutlass" and self.winner is not None


def parse_problem(value: Any) -> GroupedProblem:
    data = f.mapping(value, "problem")
    problem = f.parsed("problem", lambda: GroupedProblem.from_dict(data))
    f.require_canonical(data, problem.to_dict(), "problem")
    f.text(data, "form", choices=_FORMS)
    f.text(data, "element", choices=ELEMENTS)
    f.text(data, "layout_a", choices=("t", "n"))
    f.text(data, "layout_b", choices=("t", "n"))
    for name in ("groups", "m", "n", "k"):
        f.integer(data, name)  # groups is an int32 of the launcher's arguments
    return problem


def parse_winner(name: str, problem: GroupedProblem) -> Any:
    """The config a stored winner names, if it can compute ``problem``'s operands."""
    if name.startswith(skew_dispatch.PREFIX + "-"):
        f.require(problem.form in skew_dispatch.FORMS,
                  f"a skew dispatch for the {problem.form} form (only {skew_dispatch.FORMS})")
        return f.parsed("winner", lambda: skew_dispatch.SkewDispatch.from_name(
            name, lambda part: _kernel(part, problem)))
    return _kernel(name, problem)


def _kernel(name: str, problem: GroupedProblem):
    if name.startswith("dsl-"):
        config = f.parsed("winner", lambda: DslConfig.from_name(name))
        why = dsl_grouped.operands_refusal(problem)
        f.require(why is None, f"its DSL winner cannot run {problem.name}: {why}")
        return config
    config = f.parsed("winner", lambda: GroupedConfig.from_name(name))
    ours = (problem.element, problem.layout_a, problem.layout_b)
    theirs = (config.element, config.layout_a, config.layout_b)
    f.require(ours == theirs, f"its winner {name} is compiled for {'/'.join(theirs)} operands, "
              f"the problem's are {'/'.join(ours)}")
    return config


class GroupedSchema:
    """``EntrySchema`` of the grouped GEMM family."""

    family = GROUPED
    directory = GROUPED

    def parse(self, key: str, raw: Any, scope: CacheScope) -> GroupedEntry:
        data = f.entry_fields(raw, _FIELDS)
        problem = parse_problem(data.get("problem"))
        f.own_key(key, problem)
        f.require(scope.compute_capability == 90, "grouped kernels are sm90 kernels; the "
                  f"scope's GPU is cc {scope.compute_capability}")
        name = f.text(data, "winner", optional=True)
        winner = None if name is None else parse_winner(name, problem)
        prefer = f.text(data, "prefer", choices=("cutlass", "torch"), default="torch")
        outcome = f.measured(data, winner, "config")
        f.text(data, "backend", optional=True, choices=_PATHS)
        _check_display_fields(data)
        return GroupedEntry(key, problem, winner, prefer, *outcome, copy.deepcopy(dict(data)))


def _check_display_fields(data: Mapping[str, Any]) -> None:
    f.display_fields(data, ("winner_tflops", "tune_seconds", "build_seconds_total"),
                     ("timed_on", "strategy", "tuned_at"))
    f.short_ratios(data, "routing_speedups")
    other = data.get("other_backend_best")
    if other is not None:
        other = f.mapping(other, "other_backend_best")
        f.text(other, "backend", choices=_PATHS)
        f.measured_alternative("config")(other)


SCHEMA = GroupedSchema()


def grouped_cache(device: int | None = None, root: Path | None = None) -> TuningCache:
    """The tuned grouped kernels of this GPU and software scope (``tuning.grouped_search``)."""
    from custom_kernels.core.device import current_scope

    return TuningCache(current_scope(device), SCHEMA, root)


def tuned_config(problem: GroupedProblem, device: int | None = None):
    """The stored winner of ``problem`` when it beat torch._grouped_mm and can run here (a DSL
    kernel, or a pair holding one, needs the extra): a ``GroupedConfig``, a ``DslConfig`` or a
    ``SkewDispatch``; else None (nothing tuned: no device query at all)."""
    if not family_dir(SCHEMA).is_dir():
        return None
    entry = grouped_cache(device).get(problem)
    if entry is None or not entry.uses_kernel:
        return None
    return entry.winner if runnable(entry.winner) else None


def runnable(config) -> bool:
    """Whether this process can launch ``config``: DSL kernels need the extra installed."""
    if skew_dispatch.is_skew_dispatch(config):
        return runnable(config.even) and runnable(config.skewed)
    return not dsl_grouped.is_dsl(config) or dsl.unavailable() is None


__all__ = ["GROUPED", "GroupedEntry", "GroupedSchema", "SCHEMA", "grouped_cache",
           "parse_problem", "parse_winner", "runnable", "tuned_config"]
