"""Candidates for one problem: the config space, rules against the shape, ranking and the
run-time variants of a compiled kernel.

A search compiles tens of kernels, not hundreds: ``select`` keeps the best few of the space by our
model (``cutlass_ops.gemms.ranking``) and, when ``nvidia-matmul-heuristics`` is installed, NVIDIA's own picks,
with room kept for families the model ranks low (swap-A/B, stream-K, each schedule) because the
model is rough. Run-time knobs (raster order, swizzle, splits) need no compile: ``variants`` lists
those worth timing for a compiled kernel on this shape.
"""

from __future__ import annotations

import enum
import itertools
import math

from cutlass_ops.gemms import space
from cutlass_ops.gemms.config import (Arch, EpilogueSchedule, GemmConfig, GemmOperands, GemmProblem,
                                KernelSchedule, RasterOrder, Scaling, TileScheduler)
from cutlass_ops.gemms import ranking as model
from cutlass_ops.gemms.ranking import fits_shape, orientations, rank  # noqa: F401 (part of this module's API)
from cutlass_ops.gemms.choice import Choice
from custom_kernels.core.device import DeviceSpec


class Strategy(str, enum.Enum):
    QUICK = "quick"  # a handful of kernels: minutes cold, seconds warm
    DEFAULT = "default"
    EXHAUSTIVE = "exhaustive"  # every config the rules allow

    @property
    def compiled_per_problem(self) -> int | None:
        return {Strategy.QUICK: 4, Strategy.DEFAULT: 20, Strategy.EXHAUSTIVE: None}[self]

    @property
    def compiled_beside_dsl(self) -> int | None:
        """C++ kernels per problem when the DSL path's kernels are in the pool too. A C++
        kernel costs about 60 s of nvcc, a DSL one 2 s for every shape at once; on the 16 LLM
        shapes the DSL kernels won every shape, and before the small DSL configs the C++ ones
        won the small-M shapes with the model's first picks (swap-A/B pingpong;
        docs/measurements.md). So the default spends its compile time on the DSL side: a cold
        default tune of those shapes fits one wave of nvcc jobs instead of several."""
        return {Strategy.QUICK: 4, Strategy.DEFAULT: 4, Strategy.EXHAUSTIVE: None}[self]

    @property
    def dsl_kernels(self) -> int | None:
        """CuTe DSL kernels (``cutlass_ops.gemms.dsl``, with the extra) per problem, beside the
        C++ ones: each compiles in about 2 s for every shape of its operand types."""
        return {Strategy.QUICK: 8, Strategy.DEFAULT: 24, Strategy.EXHAUSTIVE: None}[self]

    @property
    def varied_kernels(self) -> int:
        """How many of the first round's best kernels get their run-time variants timed (the
        search's round 2)."""
        return {Strategy.QUICK: 2, Strategy.DEFAULT: 5, Strategy.EXHAUSTIVE: 8}[self]


# Tile N widths: powers of two, and the widths cuBLAS picks on Hopper to fit a shape's tiles into
# whole waves of SMs (112 makes 128x14336x4096 one wave of 128 tiles on 132 SMs). Widths outside
# CuTe's default wgmma set run one wgmma per k-step (full speed) only with its extended shapes
# (cutlass_ops.gemms.loader.build_defines). Measurements: docs/measurements.md.
_N_TILES = (16, 32, 64, 96, 112, 128, 160, 176, 192, 208, 224, 256)
# Wave-filling tiles are taken from the configs the model puts within this factor of its best.
_NEAR_BEST = 1.3
_CLUSTERS = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (4, 1, 1), (1, 4, 1))


def _k_tiles(operands: GemmOperands) -> tuple[int, ...]:
    """Tile K spanning 128 or 256 bytes of A (64 and 128 elements of bf16)."""
    return tuple(b // operands.element_a.bytes for b in (128, 256))


def _tiles(schedule: KernelSchedule) -> list[tuple[int, int]]:
    rows = {KernelSchedule.PINGPONG: (64, 128), KernelSchedule.COOPERATIVE: (128, 256),
            KernelSchedule.SM100_1SM: (64, 128), KernelSchedule.SM100_2SM: (128, 256)}[schedule]
    return [(tm, tn) for tm in rows for tn in _N_TILES]


def config_space(operands: GemmOperands, arch: Arch | str, *,
                 exhaustive: bool = False) -> list[GemmConfig]:
    """Every config our rules accept for the operands: tiles x clusters x schedules x tile
    schedulers (x explicit stage counts and both epilogues when exhaustive)."""
    arch = Arch(arch)
    schedules = ((KernelSchedule.PINGPONG, KernelSchedule.COOPERATIVE) if arch is Arch.SM90A
                 else (KernelSchedule.SM100_1SM, KernelSchedule.SM100_2SM))
    epilogues = (EpilogueSchedule.TMA, EpilogueSchedule.NO_SMEM)
    stages = (0, 3, 4, 5, 6, 7) if exhaustive else (0,)
    out = []
    for schedule in schedules:
        schedulers = [TileScheduler.PERSISTENT]
        if schedule is KernelSchedule.COOPERATIVE:
            schedulers.append(TileScheduler.STREAM_K)
        for (tm, tn), tk, cluster, scheduler, stage, epilogue in itertools.product(
                _tiles(schedule), _k_tiles(operands), _CLUSTERS, schedulers, stages, epilogues):
            config = GemmConfig(arch=arch, tile=(tm, tn, tk), cluster=cluster, stages=stage,
                                kernel_schedule=schedule, epilogue_schedule=epilogue,
                                tile_scheduler=scheduler)
            if space.violations(operands, config):
                continue
            # Without a smem epilogue only where the TMA one is refused (or when exhaustive).
            if epilogue is EpilogueSchedule.NO_SMEM and not exhaustive and not space.violations(
                    operands, config.replace(epilogue_schedule=EpilogueSchedule.TMA)):
                continue
            out.append(config)
    return out


def all_choices(problem: GemmProblem, arch: Arch | str, *,
                exhaustive: bool = False) -> list[Choice]:
    out = []
    for swap in orientations(problem):
        operands = Choice(GemmConfig(), swap).operands_for(problem.operands)
        for config in config_space(operands, arch, exhaustive=exhaustive):
            choice = Choice(config, swap)
            if fits_shape(problem, choice):
                out.append(choice)
    return out


def _family(choice: Choice) -> tuple:
    c = choice.config
    return (choice.swap_ab, c.kernel_schedule, c.tile_scheduler)


def select(problem: GemmProblem, device: DeviceSpec, strategy: Strategy | str, *,
           use_heuristics: bool = True, dsl_beside: bool = False) -> list[Choice]:
    """The configs to compile for a problem, best first (``dsl_beside``: with the DSL path's
    kernels in the pool, ``Strategy.compiled_beside_dsl`` of them)."""
    strategy = Strategy(strategy)
    choices = all_choices(problem, device.arch,
                          exhaustive=strategy is Strategy.EXHAUSTIVE)
    ranked = rank(problem, device, choices)
    limit = strategy.compiled_beside_dsl if dsl_beside else strategy.compiled_per_problem
    if limit is None:
        # Everything, but the default strategy's diverse picks first: a budget that cuts an
        # exhaustive search short must leave it no worse than the default one.
        first = select(problem, device, Strategy.DEFAULT, use_heuristics=use_heuristics)
        return list(dict.fromkeys(first + ranked))
    picked: list[Choice] = []
    allowed = set(choices)
    if use_heuristics:
        from tuning import heuristics

        suggested = [base_choice(c, c.operands_for(problem.operands))
                     for c in heuristics.suggest(problem, device, count=limit)]
        picked += list(dict.fromkeys(c for c in suggested if c in allowed))[: max(1, limit // 3)]

    seeds = [c for c in measured_seeds(problem) if c in allowed]
    if problem.operands.scaling is not Scaling.NONE:
        # FP8: the tiles FP8 kernels are known to run well with (the model was fitted to bf16
        # kernels).
        fp8 = [c for c in fp8_seeds(problem) if fits_shape(problem, c)
               and not space.violations(problem.operands, c.config)]
        # Only those, short of an exhaustive search: the strategy then sets how many of them
        # get their run-time variants timed, at no extra compile.
        limit = len(fp8)
        seeds = fp8 + seeds

    def take(candidates, quota, key=None):
        seen = {key(c) for c in picked} if key else set()
        for choice in candidates:
            if len(picked) >= quota:
                return
            if choice in picked or (key and key(choice) in seen):
                continue
            picked.append(choice)
            if key:
                seen.add(key(choice))

    take(seeds, min(limit, len(picked) + len(seeds)))
    # Most of the budget by the model, one per tile shape and family (clusters and tile K of one
    # tile shape rank alike: the measurement decides between them later); then the best of each
    # family the model ranked low; then the rest in model order.
    take(ranked, max(len(picked), (3 * limit + 3) // 5),
         key=lambda c: (_family(c), c.config.tile[:2]))
    take(ranked, limit, key=_family)
    # Tiles that fill whole waves of SMs (see _N_TILES), among those the model puts near the best:
    # its per-wave costs are too rough to rank them first, but they are the ones to measure on
    # mid-sized shapes.
    cutoff = _NEAR_BEST * model.estimate_us(problem, ranked[0], device) if ranked else 0.0
    near = list(itertools.takewhile(
        lambda c: model.estimate_us(problem, c, device) <= cutoff, ranked))
    take(sorted(near, key=lambda c: -wave_fill(problem, c, device)),
         min(limit, len(picked) + 2), key=lambda c: c.config.tile[:2])
    # The model cannot tell which operand a cluster should multicast (that depends on which one
    # L2 holds): try the other small clusters of the leading tile shapes.
    alternatives = [c.replace(cluster=cluster) for c in picked[:4]
                    for cluster in ((2, 1, 1), (1, 2, 1), (1, 1, 1))]
    take([c for c in alternatives if c in allowed], limit)
    take(ranked, limit)
    return picked


def wave_fill(problem: GemmProblem, choice: Choice, device: DeviceSpec) -> float:
    """The fraction of SM time a persistent kernel's waves spend on real tiles: 1.0 when the
    tiles are a multiple of the SMs, less for a last wave left partly empty, for one wave that
    leaves SMs idle, or for clusters that hang past the edge of the problem (tiles are launched
    in whole clusters). Stream-K kernels balance their own work: 0."""
    if choice.config.tile_scheduler is TileScheduler.STREAM_K:
        return 0.0
    p = choice.problem_for(problem)
    tm, tn, _ = choice.config.tile
    cm, cn, _ = choice.config.cluster
    tiles = math.ceil(p.m / tm) * math.ceil(p.n / tn) * p.batch
    clusters = math.ceil(p.m / (tm * cm)) * math.ceil(p.n / (tn * cn)) * p.batch
    slots = device.sm_count // (cm * cn)
    return tiles / (math.ceil(clusters / slots) * slots * cm * cn)


def measured_seeds(problem: GemmProblem) -> list[Choice]:
    """Kernels that measured best against torch.matmul on skinny problems (H200;
    docs/measurements.md), searched first whatever the model says: its per-cluster and per-tile
    costs cannot separate them from their neighbours, and the heuristics package leans to larger
    clusters there.

    - M (or N) up to 64: swap-A/B pingpong with a 64-row tile, the small extent padded to 16 or
      32, K tiles of 128 (then 64), no cluster or 2x1.
    - M from 65 to 128: unswapped pingpong 64x64x64 and cooperative 128x128x64."""
    small, swap = (problem.m, True) if problem.m <= problem.n else (problem.n, False)
    if small <= 64:
        pad = 16 if small <= 16 else 32 if small <= 32 else 64
        tiles = [((64, pad, 128), (1, 1, 1)), ((64, pad, 128), (2, 1, 1)),
                 ((64, 2 * pad if pad < 64 else pad, 128), (1, 1, 1)), ((64, pad, 64), (1, 1, 1))]
        return [Choice(GemmConfig(kernel_schedule=KernelSchedule.PINGPONG, tile=tile,
                                  cluster=cluster), swap) for tile, cluster in tiles]
    if small <= 128:  # these ran unswapped with the small extent as M: swap when it is N
        return [Choice(GemmConfig(kernel_schedule=KernelSchedule.PINGPONG, tile=(64, 64, 64),
                                  cluster=cluster), not swap)
                for cluster in ((1, 1, 1), (2, 1, 1))] + [
            Choice(GemmConfig(kernel_schedule=KernelSchedule.COOPERATIVE, tile=(128, 128, 64)),
                   not swap)]
    return []


def fp8_seeds(problem: GemmProblem) -> list[Choice]:
    """Kernels for scaled FP8 problems (tile K 128, unswapped), searched before the model's:
    pingpong 128x128 and cooperative 128x256 / 256x128 tiles with 2-CTA clusters above M 128
    (the shapes vLLM's and CUTLASS's own sm90 FP8 dispatch settle on), pingpong 64-row tiles
    with long clusters at small M and 64x64 ones with short clusters (cuBLAS's tensorwise tile
    at M = 128 on an H100: 64x64, cluster 1x2), stream-K cooperative tiles where K is long
    beside M x N.

    Promoted accumulation (blockwise scaling, and tensorwise / rowwise without fast
    accumulation: the backward GEMMs of convert(fp8=...)) keeps a second float32 accumulator a
    warp group, so its tiles stop at 64 x 128 a warp group: cooperative 128x128 (with and
    without stream-K) and pingpong 64x128. The wider ones spill their second accumulator and
    run at a fraction of torch._scaled_mm's rate (docs/measurements.md, "FP8 GEMMs"). They
    also try cooperative 128x128 with a 1x4 cluster (cuBLAS's blockwise tile at M = 128)."""
    pp, coop = KernelSchedule.PINGPONG, KernelSchedule.COOPERATIVE
    persistent, stream_k = TileScheduler.PERSISTENT, TileScheduler.STREAM_K
    promoted = problem.operands.scaling is Scaling.BLOCKWISE or not problem.operands.fast_accum
    if promoted and (problem.m > 128 or problem.operands.scaling is Scaling.BLOCKWISE):
        shapes = [(coop, (128, 128), (1, 1), persistent), (coop, (128, 128), (2, 1), persistent),
                  (coop, (128, 128), (1, 2), persistent), (coop, (128, 128), (1, 1), stream_k),
                  (coop, (128, 128), (2, 1), stream_k), (coop, (128, 128), (1, 4), persistent),
                  (pp, (64, 128), (1, 1), persistent),
                  (pp, (64, 128), (2, 1), persistent), (pp, (64, 128), (1, 2), persistent)]
    elif problem.m <= 128:
        shapes = [(pp, (64, 128), (2, 1), persistent), (pp, (64, 128), (1, 2), persistent),
                  (pp, (64, 128), (1, 1), persistent), (pp, (64, 64), (1, 8), persistent),
                  (pp, (64, 64), (1, 4), persistent), (pp, (64, 64), (1, 2), persistent),
                  (pp, (64, 64), (1, 1), persistent), (pp, (64, 64), (2, 1), persistent),
                  *([] if promoted else [(pp, (64, 256), (1, 2), persistent)]),
                  (coop, (128, 128), (1, 2), persistent), (coop, (128, 128), (1, 1), stream_k)]
    else:
        shapes = [(pp, (128, 128), (2, 1), persistent), (pp, (128, 128), (1, 2), persistent),
                  (pp, (128, 128), (1, 1), persistent), (coop, (128, 256), (2, 1), persistent),
                  (coop, (128, 256), (1, 2), persistent), (coop, (128, 256), (1, 1), persistent),
                  (coop, (256, 128), (1, 2), persistent), (coop, (256, 128), (2, 1), persistent),
                  (coop, (128, 128), (1, 1), stream_k), (coop, (128, 256), (1, 1), stream_k)]
    return [Choice(GemmConfig(kernel_schedule=schedule, tile=(tm, tn, 128),
                              cluster=(cm, cn, 1), tile_scheduler=scheduler))
            for schedule, (tm, tn), (cm, cn), scheduler in shapes]


def base_choice(choice: Choice, operands: GemmOperands) -> Choice:
    """The compiled part of a choice (run-time knobs at their defaults), with the epilogue that
    our rules accept for it."""
    base = choice.replace(raster_order=RasterOrder.HEURISTIC, swizzle=1, splits=1)
    if base.config.epilogue_schedule is EpilogueSchedule.TMA:
        no_smem = base.replace(epilogue_schedule=EpilogueSchedule.NO_SMEM)
        if space.violations(operands, base.config) and not space.violations(operands,
                                                                           no_smem.config):
            return no_smem
    return base


def variants(problem: GemmProblem, choice: Choice, device: DeviceSpec) -> list[Choice]:
    """Run-time variants of a compiled kernel worth timing on this shape (the kernel itself first).

    Raster order and swizzle only change the order of tiles, which matters for L2 reuse once
    there are more tiles than SMs; splits (stream-K kernels) matter when there are too few."""
    p = choice.problem_for(problem)
    tm, tn, _ = choice.config.tile
    tiles = math.ceil(p.m / tm) * math.ceil(p.n / tn) * p.batch
    base = choice.replace(raster_order=RasterOrder.HEURISTIC, swizzle=1, splits=1)
    out = [base]
    if tiles > device.sm_count:
        for raster, swizzle in itertools.product((RasterOrder.ALONG_M, RasterOrder.ALONG_N),
                                                 (1, 2, 4, 8)):
            out.append(choice.replace(raster_order=raster, swizzle=swizzle, splits=1))
    elif choice.config.tile_scheduler is TileScheduler.STREAM_K:
        k_steps = math.ceil(p.k / choice.config.tile[2])
        out += [choice.replace(raster_order=RasterOrder.HEURISTIC, swizzle=1, splits=s)
                for s in (2, 3, 4, 8) if s <= k_steps and tiles * s <= 2 * device.sm_count]
    return list(dict.fromkeys(out))
