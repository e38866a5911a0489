"""Two grouped kernels behind one tuning entry, the routing's skew choosing between them on the
device: ``SkewDispatch(even, skewed, skew)``.

A grouped key holds the mean rows per group, not the skew: reading the offsets on the host would
cost a sync per call. The tuner times every candidate on an even and a Zipf-skewed routing, and
the best kernel on one is often not the best on the other (docs/measurements.md). A
``SkewDispatch`` launches ``custom_kernels.moe.routing_split`` (one block) and then both kernels: the
``even`` one gets the offsets when the largest group holds at most ``skew`` times the mean rows,
the ``skewed`` one otherwise, and the other gets all-empty groups, computes no tile and writes
nothing. Only the 2d3d form (groups of rows: forward and dX) qualifies: in the 2d2d form (dW) an
empty group's output is zeros, which the idle kernel would write over the other's result.

The cost beside one kernel: the split's launch and the idle kernel's (a grid that finds no
tile), and two more host launches; the tuner times the pair as it times any candidate, so it
wins only where the better kernel per routing pays for them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

from custom_kernels.moe.routing_split import split_checked

PREFIX = "skew"
FORMS = ("2d3d",)
_NAME = re.compile(r"skew-x(?P<skew>\d+(?:\.\d+)?)-(?P<even>[^+]+)\+(?P<skewed>[^+]+)")


@dataclasses.dataclass(frozen=True)
class SkewDispatch:
    even: Any  # a grouped_build.GroupedConfig or a dsl.DslConfig
    skewed: Any
    skew: float  # the routing is skewed when its largest group exceeds skew x the mean

    def __post_init__(self) -> None:
        if self.even == self.skewed:
            raise ValueError(f"a skew dispatch needs two different kernels, got {self.even.name} "
                             "twice")
        if not (math.isfinite(self.skew) and self.skew >= 1):
            raise ValueError(f"skew must be a finite number of at least 1 (largest group over "
                             f"the mean), got {self.skew}")

    @property
    def name(self) -> str:
        return f"{PREFIX}-x{self.skew:g}-{self.even.name}+{self.skewed.name}"

    @classmethod
    def from_name(cls, name: str, parse) -> Optional[SkewDispatch]:
        """The dispatch ``name`` describes, each kernel read by ``parse`` (a name to a config,
        or None where its path is not installed: then None)."""
        match = _NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"not a skew dispatch name: {name!r} (expected "
                             f"'skew-x<skew>-<even kernel>+<skewed kernel>')")
        even, skewed = parse(match["even"]), parse(match["skewed"])
        if even is None or skewed is None:
            return None
        return cls(even, skewed, float(match["skew"]))


def is_skew_dispatch(config) -> bool:
    return isinstance(config, SkewDispatch)


def threshold(skewed_ratio: float) -> float:
    """The ``skew`` a tune stores, from the skewed routing's largest group over the mean (the
    even routing's is 1): their geometric mean, rounded to one decimal, so that a routing the
    tuner did not time goes to the kernel of the routing it is nearer to on a log scale."""
    return max(1.0, round(max(1.0, skewed_ratio) ** 0.5, 1))


def launch(config: SkewDispatch, launch_one, form: str, a, b, offs, out):
    """``out`` = the grouped product of a 2d3d call: the split, then both kernels through
    ``launch_one`` (``grouped_runtime.launch``), each on its share of the offsets. The
    operands are ``cutlass_ops.moe.grouped``'s, checked there (int32 offsets on the GPU); ``skew``
    was checked when the config was made."""
    if form not in FORMS:
        raise ValueError(f"a skew dispatch runs the {FORMS} form only, not {form}")
    even, uneven = split_checked(offs, config.skew)
    launch_one(config.even, form, a, b, even, out)
    return launch_one(config.skewed, form, a, b, uneven, out)


__all__ = ["SkewDispatch", "FORMS", "is_skew_dispatch", "threshold", "launch"]
