"""Our ranking model: a rough time estimate of a candidate on a problem, used to decide which few
configs to compile and measure, never to pick a winner (measurements do that).

It counts what decides a Hopper GEMM's speed at the level of whole tiles: how many waves of CTA
tiles the SMs run (and how full the last one is), how much of each tile is padding, how efficient
the tile shape keeps the tensor cores (a wgmma tile narrower in N re-reads A from shared memory
more often), and the bytes each SM must pull from L2 (less with cluster multicast) and from HBM.
Stream-K and split-K spread the K loop over idle SMs at the cost of a fix-up pass.
"""

from __future__ import annotations

import math

from cutlass_ops.gemms.config import GemmProblem, KernelSchedule, TileScheduler
from cutlass_ops.gemms.choice import Choice
from custom_kernels.core.device import DeviceSpec

# Fraction of the datasheet peak a large, well-shaped tile sustains on Hopper (clocks under load).
_SUSTAINED = 0.80
# Bytes per clock one SM can pull from L2, at ~1.75 GHz: about 110 GB/s per SM.
_SM_LOAD_GBS = 110.0
# Fixed costs: launch and prologue, and one epilogue + pipeline fill per wave of tiles.
_LAUNCH_US = 4.0
_PER_WAVE_US = 1.2
_STREAM_K_FIXUP = 1.06
# L2 to SM bandwidth of the whole chip per SM (GH100: about 6.5 TB/s over 132 SMs). Skinny
# GEMMs re-read the small operand from L2 for every tile; cluster multicast divides that.
_L2_GBS_PER_SM = 6500.0 / 132
# Shared memory the epilogue and barriers keep from the mainloop's stages (bytes).
_EPILOGUE_SMEM = 32 * 1024


def tile_efficiency(schedule: KernelSchedule, tile_m: int, tile_n: int) -> float:
    """Tensor-core efficiency of a CTA tile shape relative to the best (128x256 / 256x128).

    Narrow tiles re-read the other operand from shared memory for less math; one consumer
    warpgroup (pingpong) hides its epilogue behind the other's math but does less per tile."""
    base = 1.0 / (1.0 + 24.0 / tile_n + 16.0 / tile_m)
    best = 1.0 / (1.0 + 24.0 / 256 + 16.0 / 128)
    bonus = 1.03 if schedule is KernelSchedule.PINGPONG and tile_m == 64 else 1.0
    return min(1.0, base / best * bonus)


def estimate_us(problem: GemmProblem, choice: Choice, device: DeviceSpec) -> float:
    """Estimated microseconds for ``choice`` on ``problem``."""
    p = choice.problem_for(problem)
    config = choice.config
    m, n, k, batch = p.m, p.n, p.k, p.batch
    tm, tn, _ = config.tile
    cm, cn, _ = config.cluster
    cluster_size = cm * cn
    if config.kernel_schedule is KernelSchedule.SM100_2SM:
        tm //= 2  # the tile names the SM pair's tile
    elt = p.operands.element_a.bytes
    out_elt = p.operands.element_d.bytes

    tiles_m = math.ceil(m / tm)
    tiles_n = math.ceil(n / tn)
    tiles = tiles_m * tiles_n * batch
    # Clusters are placed whole: SMs left over in a GPC cannot take a cluster.
    usable_sms = max(cluster_size, device.sm_count - device.sm_count % cluster_size
                     - (2 if cluster_size >= 4 else 0))
    sm_flops = device.peak_tflops * 1e12 / device.sm_count * _SUSTAINED * \
        tile_efficiency(config.kernel_schedule, tm, tn)
    tile_flops = 2.0 * tm * tn * k
    # Each SM takes in its whole tile; multicast only spares L2 (a cluster loads a shared operand
    # tile once for all its CTAs).
    tile_load_bytes = (tm + tn) * k * elt
    tile_l2_bytes = (tm * k / cn + tn * k / cm) * elt

    splits = config.splits
    if config.tile_scheduler is TileScheduler.STREAM_K:
        # Work is divided evenly over the SMs (splits > 1 fixes the split instead).
        units = tiles * splits if splits > 1 else max(tiles, usable_sms)
        per_sm_share = tiles / min(units, usable_sms) if splits == 1 else \
            math.ceil(units / usable_sms) / splits
        compute_s = per_sm_share * tile_flops / sm_flops * _STREAM_K_FIXUP
        load_s = per_sm_share * tile_load_bytes / (_SM_LOAD_GBS * 1e9)
        waves = math.ceil(units / usable_sms)
        fixup_bytes = (tiles * tm * tn * 4 * 2) if (splits > 1 or tiles < usable_sms) else 0
    else:
        waves = math.ceil(tiles / usable_sms)
        compute_s = waves * tile_flops / sm_flops
        load_s = waves * tile_load_bytes / (_SM_LOAD_GBS * 1e9)
        fixup_bytes = 0

    dram_bytes = (m * k + n * k) * elt * batch + m * n * out_elt * batch + fixup_bytes
    # A tile row of A is re-read for every column of tiles; L2 absorbs most of it, but what does
    # not fit comes from HBM again.
    reread = (tiles_n - 1) * m * k * elt * batch + (tiles_m - 1) * n * k * elt * batch
    l2_resident = min(1.0, device.l2_bytes / max(1.0, (m * k + n * k) * elt))
    dram_bytes += reread * (1.0 - l2_resident) * 0.25
    dram_s = dram_bytes / (device.dram_gbs * 1e9 * 0.9)
    l2_s = tiles * tile_l2_bytes / (_L2_GBS_PER_SM * device.sm_count * 1e9)

    # Too few stages cannot hide the load latency; a deep pipeline costs nothing more.
    stage_bytes = (tm + tn) * config.tile[2] * elt
    stages = config.stages or max(1, (228 * 1024 - _EPILOGUE_SMEM) // stage_bytes)
    pipeline = 1.0 + 0.08 * max(0, 4 - stages)

    # The slowest resource bounds the time; the others still cost something (they compete for
    # power and issue slots), which also separates configs that tie on the bound.
    terms = (compute_s * pipeline, load_s * pipeline, dram_s, l2_s)
    busy_s = max(terms) + 0.15 * (sum(terms) - max(terms))
    return busy_s * 1e6 + _LAUNCH_US + _PER_WAVE_US * waves


def fits_shape(problem: GemmProblem, choice: Choice) -> bool:
    """Rejects clusters of tiles far larger than the (possibly swapped) problem: such a kernel
    computes mostly padding and can never win."""
    p = choice.problem_for(problem)
    tm, tn, _ = choice.config.tile
    cm, cn, _ = choice.config.cluster
    return (cm * tm <= 2 * max(64, math.ceil(p.m / 64) * 64)
            and cn * tn <= 2 * max(16, math.ceil(p.n / 16) * 16))


def rank(problem: GemmProblem, device: DeviceSpec, choices: list[Choice]) -> list[Choice]:
    """Fastest first by our model; ties broken by name for a stable order."""
    return sorted(choices, key=lambda c: (estimate_us(problem, c, device), c.name))


def orientations(problem: GemmProblem) -> tuple[bool, ...]:
    """Swap-A/B is worth trying when M is the smaller extent (it never helps the other way).
    Scaled FP8 problems run as given: their scales' roles are not symmetric in A and B."""
    from cutlass_ops.gemms.config import Scaling

    if problem.operands.scaling is not Scaling.NONE:
        return (False,)
    return (False, True) if problem.m < problem.n else (False,)
