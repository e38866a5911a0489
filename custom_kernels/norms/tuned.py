"""The norm tuner's stored winners, read when a norm plan is built (``tuning.norm_search`` writes
them): entries in the tuning cache of this GPU and software scope, family ``norms``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from custom_kernels.core.tuned_store import TuningCache, family_dir
from custom_kernels.norms import config as nc

NORMS = "norms"  # the tuning cache family of these kernels (a key of tuned_store.FAMILIES)


def norm_cache(device: int | None = None, root: Path | None = None) -> TuningCache:
    from custom_kernels.core.device import current_scope

    return TuningCache(current_scope(device), root, family=NORMS)


def tuned_config_name(problem: nc.NormProblem, device: int | None = None) -> Optional[str]:
    """The stored winner of ``problem`` on this GPU, or None."""
    path = family_dir(NORMS)
    if not path.is_dir():  # nothing was ever tuned: no device query at all
        return None
    entry = norm_cache(device).get(problem)
    return entry.get("winner") if entry else None
