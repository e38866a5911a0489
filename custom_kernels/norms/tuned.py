"""The norm tuner's stored winners (``tuning.norm_search`` writes them): one typed record per
problem, the schema that reads it, and the lookup a norm plan runs.

An entry is accepted only if its key is its own problem's name, its winner is a launch config
valid for that problem (``NormConfig.why_invalid``: vector width, cluster, shared memory), and
every time is a finite number above zero.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional

from custom_kernels.core import tuned_fields as f
from custom_kernels.core.tuned_store import CacheScope, TuningCache, family_dir
from custom_kernels.norms import norm_config as nc

NORMS = "norms"  # the family's name in exports, and its folder
_FIELDS = {"problem", "winner", "winner_ms", "heuristic", "heuristic_ms", "torch_ms",
           "reference", "rows", "strategy", "gbps", "runners_up", "failures", "timings_s"}


@dataclasses.dataclass(frozen=True)
class NormEntry(f.StoredRecord):
    key: str
    problem: nc.NormProblem
    winner: nc.NormConfig
    winner_ms: float
    torch_ms: Optional[float]
    heuristic_ms: Optional[float]
    stored: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)
    complete = True  # a norm tune has no time budget to cut it short

    @property
    def failures(self) -> dict[str, str]:
        return dict(self.stored.get("failures") or {})


def parse_problem(value: Any) -> nc.NormProblem:
    data = f.mapping(value, "problem")
    for name in ("kind", "direction", "dtype", "out_dtype", "weight_dtype"):
        f.text(data, name)
    f.integer(data, "hidden")
    problem = f.parsed("problem", lambda: nc.NormProblem.from_dict(data))
    f.require_canonical(data, problem.to_dict(), "problem")
    return problem


def parse_winner(name: Any, problem: nc.NormProblem) -> nc.NormConfig:
    name = f.text({"winner": name}, "winner")
    config = f.parsed("winner", lambda: nc.NormConfig.from_name(name))
    why = config.why_invalid(problem)
    f.require(why is None, f"its winner {name} cannot run {problem.name}: {why}")
    return config


class NormSchema:
    """``EntrySchema`` of the norm family."""

    family = NORMS
    directory = NORMS

    def parse(self, key: str, raw: Any, scope: CacheScope) -> NormEntry:
        data = f.entry_fields(raw, _FIELDS)
        problem = parse_problem(data.get("problem"))
        f.own_key(key, problem)
        winner = parse_winner(data.get("winner"), problem)
        f.text(data, "heuristic", optional=True)
        for name in ("reference", "strategy"):
            f.text(data, name, optional=True)
        if data.get("rows") is not None:
            f.integer(data, "rows")
        f.figure(data, "gbps")
        f.items(data, "runners_up", f.measured_alternative("config"))
        failures = f.mapping(data.get("failures") or {}, "failures")
        f.require(len(failures) <= f.MAX_LIST, "too many failures")
        for name in failures:
            f.text(failures, name, limit=f.MAX_ERROR_TEXT)
        timings = f.mapping(data.get("timings_s") or {}, "timings_s")
        for name in timings:
            f.figure(timings, name)
        return NormEntry(key, problem, winner, f.milliseconds(data, "winner_ms"),
                         f.milliseconds(data, "torch_ms", optional=True),
                         f.milliseconds(data, "heuristic_ms", optional=True),
                         copy.deepcopy(dict(data)))


SCHEMA = NormSchema()


def norm_cache(device: int | None = None, root: Path | None = None) -> TuningCache:
    from custom_kernels.core.device import current_scope

    return TuningCache(current_scope(device), SCHEMA, root)


def tuned_config(problem: nc.NormProblem, device: int | None = None) -> Optional[nc.NormConfig]:
    """The stored winner of ``problem`` on this GPU, or None."""
    if not family_dir(SCHEMA).is_dir():  # nothing was ever tuned: no device query at all
        return None
    entry = norm_cache(device).get(problem)
    return entry.winner if entry is not None else None
