"""Grouped GEMMs on the CuTe DSL path: QuACK's variable-length kernels (``cutlass-ops[dsl]``)
as candidates beside the CUTLASS C++ grouped kernels (``grouped_build``).

QuACK's sm90 GEMM takes cumulative sequence bounds on the device: ``cu_seqlens_m`` splits A's
rows and D's rows into groups, each multiplied by its own B (the 2d3d form: forward and dX of the
experts), and ``cu_seqlens_k`` splits the reduction (the 2d2d form: dW). The bounds are
``[0, offs...]``, made on the stream per call (no host sync; CUDA-graph safe). One kernel per
config and operand types / majors serves every group count and size. Swap-A/B does not apply to
variable lengths, so the configs are ``dsl.DslConfig`` tiles and clusters unswapped, with 1x1
clusters too (measured best on some MoE shapes: docs/measurements.md). Where the groups are short
(a 2d3d key's mean rows per group at most ``dsl.SMALL_EXTENT``), 64-row pingpong tiles join them
(``SHORT_GROUP_CONFIGS``). The tuner also tries the best static kernels with QuACK's dynamic
tile scheduler (``dynamic_twins``).

The kernels are ours to use only where ``grouped_runtime.group_starts_aligned`` holds (TMA
needs every group's rows at 16-byte aligned addresses), as for the C++ kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cutlass_ops.gemms import dsl
from cutlass_ops.gemms.dsl import DslConfig

FORMS = ("2d3d", "2d2d")  # varlen M, varlen K; 3d2d and 3d3d stay with the C++ kernels

# The measured best first (moe.py's 24 cases on an H100: pingpong 128x192 / 128x208 and
# cooperative 128x256 with 2x1 clusters won 40 of the 48 top-two places), then the rest.
_FIRST = (DslConfig(128, 192, 2, 1, True), DslConfig(128, 208, 2, 1, True),
          DslConfig(128, 256, 2, 1, False), DslConfig(128, 256, 1, 1, False),
          DslConfig(256, 192, 2, 1, False), DslConfig(128, 192, 1, 1, True),
          DslConfig(128, 128, 2, 1, True), DslConfig(256, 128, 2, 1, False))
CONFIGS = tuple(dict.fromkeys((
    *_FIRST,
    *(DslConfig(tm, tn, cm, cn, pingpong)
      for pingpong, tiles in ((True, dsl.PINGPONG_TILES), (False, dsl.COOPERATIVE_TILES))
      for tm, tn in tiles for cm, cn in ((2, 1), (1, 1))))))
# Pingpong 64x64 / 64x128 tiles, K tiles of 64 and 128, clusters 2x1 / 1x1: one of them beat
# every config above on a 2d3d key of 128 rows per group (DeepSeek-V3 at 4096 tokens), and they
# lost at 256 rows per group and up (benchmarks/sweeps/dsl_grouped_space.py,
# docs/measurements.md). That one leads; the strategy's count is on top of it.
SHORT_GROUP_CONFIGS = tuple(dict.fromkeys((
    DslConfig(64, 128, 2, 1, True, tile_k=128),
    *(DslConfig(64, tn, cm, cn, True, tile_k=tk)
      for tn in (128, 64) for tk in (128, 64) for cm, cn in ((2, 1), (1, 1))))))
_SHORT_GROUP_EXTRA = {"quick": 1, "default": 1, "exhaustive": None}
_LIMITS = {"quick": 4, "default": 8, "exhaustive": None}
_DYNAMIC_TWINS = {"quick": 1, "default": 2, "exhaustive": 4}


def refusal(problem) -> Optional[str]:
    """Why the DSL kernels cannot take a ``grouped_build.GroupedProblem``, or None."""
    return dsl.unavailable() or operands_refusal(problem)


def operands_refusal(problem) -> Optional[str]:
    """``refusal`` without the question whether the extra is installed: the forms and element
    types no DSL grouped kernel takes (a stored DSL winner for them is not one we tuned)."""
    if problem.form not in FORMS:
        return f"the {problem.form} form (the DSL path takes {' and '.join(FORMS)})"
    if problem.element not in ("bf16", "f16"):
        return f"{problem.element} operands (bf16 or f16)"
    return None


def has_short_groups(problem) -> bool:
    """Whether ``problem`` is a 2d3d key (forward or dX) with at most ``dsl.SMALL_EXTENT``
    rows per group on average, where the 64-row tiles are offered. dW (2d2d) groups its K, so
    its tiles span the weights' extents, which are never short in MoE."""
    return problem.form == "2d3d" and problem.m <= dsl.SMALL_EXTENT


def candidates(problem, strategy: str = "default") -> list[DslConfig]:
    """The DSL kernels to try on ``problem`` (none when ``refusal`` says why): quick 4,
    default 8, exhaustive all of ``CONFIGS``; short groups (``has_short_groups``) get the
    first of ``SHORT_GROUP_CONFIGS`` before them (all of them when exhaustive)."""
    if refusal(problem) is not None:
        return []
    short = SHORT_GROUP_CONFIGS[:_SHORT_GROUP_EXTRA[strategy]] if has_short_groups(problem) \
        else ()
    return [*short, *CONFIGS[:_LIMITS[strategy]]]


def dynamic_twins(ranked, strategy: str = "default") -> list[DslConfig]:
    """The dynamic-scheduler twins (``DslConfig.dynamic``) of the best static DSL kernels in
    ``ranked`` (a tuner's first round, best first): 1, 2 or 4 by strategy. A grouped GEMM's
    tiles differ in cost (the partial tiles of short groups, memory-bound tiles of experts with
    few rows beside compute-bound ones of busy experts); a static schedule deals them out
    round-robin and its last CTAs finish late, where an atomic counter gives each free CTA the
    next tile. Which wins depends on the shape and the routing (docs/measurements.md), so the
    twins are measured, not assumed."""
    static = [c for c in ranked if is_dsl(c) and not c.dynamic]
    return [dataclasses.replace(c, dynamic=True) for c in static[:_DYNAMIC_TWINS[strategy]]]


def is_dsl(config) -> bool:
    return isinstance(config, DslConfig)


def config_from_name(name: str) -> Optional[DslConfig]:
    """The DSL config a tuning entry names, or None where the extra is missing (the caller
    falls back to torch._grouped_mm)."""
    return None if dsl.unavailable() else DslConfig.from_name(name)


def _bounds(offs: torch.Tensor) -> torch.Tensor:
    """``[0, offs...]`` as int32, on the stream (QuACK's cu_seqlens)."""
    return torch.nn.functional.pad(offs.to(torch.int32), (1, 0))


def run(config: DslConfig, form: str, a: torch.Tensor, b: torch.Tensor,
        offs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = the grouped product of a 2d3d (rows of ``a`` and ``out`` grouped) or 2d2d
    (``a``'s columns and ``b``'s rows grouped; ``out`` [groups, M, N]) call, with ``config``'s
    kernel (compiled on first use, or loaded from the DSL's disk cache)."""
    if form not in FORMS:
        raise ValueError(f"the DSL grouped path takes the {FORMS} forms, not {form}")
    gemm = dsl._interface().gemm_tuned.fn
    bounds = _bounds(offs)
    quack_config = config.to_quack()
    if form == "2d3d":
        gemm(a, b, out, None, None, 1.0, 1.0, cu_seqlens_m=bounds, config=quack_config)
    else:
        gemm(a, b, out, None, None, 1.0, 1.0, cu_seqlens_k=bounds, config=quack_config)
    return out


__all__ = ["CONFIGS", "SHORT_GROUP_CONFIGS", "FORMS", "refusal", "has_short_groups", "candidates",
           "dynamic_twins", "is_dsl", "config_from_name", "run"]
