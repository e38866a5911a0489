"""The configs worth compiling for a set of operands on an arch.

Two sources: cutlass_cppgen's tile descriptions (what CUTLASS's own generator offers) and our rules,
which reject before nvcc runs what is known not to compile or not to fit. ``violations`` gives the
reasons a config is refused; ``check`` raises with them; ``valid_configs`` lists the space.
"""

from __future__ import annotations

import math

from cutlass_ops.gemms.config import (Activation, Arch, BiasMode, DType, EpilogueSchedule,
                                      GemmConfig, GemmOperands, KernelSchedule, Layout, Scaling,
                                      TileScheduler)
from custom_kernels.core.errors import InvalidConfigError

# Usable dynamic shared memory per CTA on sm90 and sm100 (228 KB less 1 KB reserved by the system).
SMEM_BYTES = 227 * 1024
# What CUTLASS's sm90 builders share out among stages and epilogue (sm90_smem_capacity_bytes).
SMEM_CAPACITY = 232448
# The least shared memory a TMA epilogue is counted for (epilogue_smem_bytes is the exact figure).
_TMA_EPILOGUE_BYTES = 16 * 1024
# Consumer threads holding one tile's accumulators: a warpgroup, or two for cooperative kernels.
_CONSUMER_THREADS = {KernelSchedule.PINGPONG: 128, KernelSchedule.WARP_SPECIALIZED: 128,
                     KernelSchedule.COOPERATIVE: 256}
# Beyond this many fp32 accumulators per thread the kernel spills or fails to compile.
_MAX_ACCUMULATORS_PER_THREAD = 128

_SCHEDULES = {
    Arch.SM90A: (KernelSchedule.PINGPONG, KernelSchedule.COOPERATIVE,
                 KernelSchedule.WARP_SPECIALIZED),
    Arch.SM100A: (KernelSchedule.SM100_1SM, KernelSchedule.SM100_2SM),
}
_TILE_M = {
    KernelSchedule.PINGPONG: (64, 128),
    KernelSchedule.WARP_SPECIALIZED: (64, 128),
    KernelSchedule.COOPERATIVE: (128, 256),  # two warpgroups of 64 rows each, at least
    KernelSchedule.SM100_1SM: (64, 128),
    KernelSchedule.SM100_2SM: (128, 256),
}

# Configs seen failing to compile with nvidia-cutlass 4.2 and nvcc 13.0 (see DESIGN.md).
_KNOWN_BROKEN = {
    (Arch.SM90A, KernelSchedule.COOPERATIVE, (128, 256, 64), (2, 1, 1), EpilogueSchedule.TMA):
        "128x256x64 cooperative with cluster 2x1x1 and a TMA epilogue does not compile "
        "with CUTLASS 4.2",
}


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def epilogue_tile_shape(config: GemmConfig) -> tuple[int, int]:
    """The (M, N) epilogue tile an sm90a kernel stores at a time: the config's, or what CUTLASS
    4.2 picks for an auto one (sm90_compute_tile_shape_or_override): (min(128, tile M),
    gcd(32, tile N)) for cooperative kernels, (min(64, tile M), gcd(32, tile N)) otherwise."""
    if not config.epilogue_tile_is_auto:
        return config.epilogue_tile
    tm, tn, _ = config.tile
    rows = 128 if config.kernel_schedule is KernelSchedule.COOPERATIVE else 64
    return min(rows, tm), math.gcd(32, tn)


def epilogue_smem_bytes(operands: GemmOperands, config: GemmConfig) -> int:
    """Shared memory a TMA epilogue keeps from the mainloop's stages. sm90a, CUTLASS 4.2
    (sm90_get_tma_dispatch_policy): for E epilogue tiles per CTA tile, StagesD = min(E, 2) and,
    as C and D share one element type (and so their buffers), StagesC = max(min(E, 4),
    StagesD + 1) buffers of one epilogue tile. A whole-width epilogue tile (E = 1) thus keeps two
    CTA tiles of output: 64 KB for 128x128 in bf16; auto ones keep 16 or 32 KB (an upper bound
    for fused epilogues without C, whose D has min(E, 2) buffers of its own)."""
    if config.epilogue_schedule is not EpilogueSchedule.TMA:
        return 0
    if config.arch is not Arch.SM90A:
        return _TMA_EPILOGUE_BYTES  # sm100a's epilogue builder has rules of its own
    em, en = epilogue_tile_shape(config)
    tiles = (config.tile[0] // em) * (config.tile[1] // en)
    stages_c = max(min(tiles, 4), min(tiles, 2) + 1)
    return stages_c * em * en * operands.element_d.bytes


def auto_stages(operands: GemmOperands, config: GemmConfig) -> int:
    """The mainloop stages of a config: its own count, or what CUTLASS's StageCountAutoCarveout
    fits beside the epilogue (sm90 compute_stage_count_or_override: 128-byte rounding, 16 bytes
    of barriers a stage)."""
    if config.stages:
        return config.stages
    tm, tn, tk = config.tile
    stage = -(-(tm + tn) * tk * operands.element_a.bytes // 128) * 128 + 16
    return (SMEM_CAPACITY - epilogue_smem_bytes(operands, config) - 128) // stage


def violations(operands: GemmOperands, config: GemmConfig) -> list[str]:
    """Every rule the config breaks for these operands; empty when it should compile and run."""
    why: list[str] = []
    arch, schedule = config.arch, config.kernel_schedule
    tm, tn, tk = config.tile
    cm, cn, ck = config.cluster

    if schedule not in _SCHEDULES[arch]:
        why.append(f"kernel schedule {schedule.value} does not exist on {arch.value} "
                   f"(choose from {', '.join(s.value for s in _SCHEDULES[arch])})")
        return why
    why += _fp8_violations(operands, config)
    if operands.element_a is not operands.element_b and not operands.is_fp8:
        why.append("A and B must have the same element type")
    if operands.element_accumulator is DType.F16 and operands.element_a is not DType.F16:
        why.append("an f16 accumulator needs f16 operands")
    if operands.element_accumulator is DType.BF16:
        why.append("bf16 accumulation is not supported; use f32")
    if operands.element_a is DType.F32 and (operands.layout_a is not Layout.ROW
                                            or operands.layout_b is not Layout.COL):
        why.append("f32 (tf32) operands must both be K-major: A row-major and B column-major")
    for name, dtype, alignment in (("A", operands.element_a, operands.alignment_a),
                                   ("B", operands.element_b, operands.alignment_b),
                                   ("C", operands.element_c, operands.alignment_c)):
        if alignment * dtype.bytes != 16:
            why.append(f"TMA needs 16-byte alignment: {name} alignment {alignment} x "
                       f"{dtype.bytes} bytes = {alignment * dtype.bytes} bytes")

    if tm not in _TILE_M[schedule]:
        why.append(f"{schedule.value} needs tile M in {_TILE_M[schedule]}, got {tm}")
    n_step = 16 if arch is Arch.SM100A else 8
    if tn % n_step or not n_step <= tn <= 256:
        why.append(f"tile N must be a multiple of {n_step} from {n_step} to 256, got {tn}")
    k_bytes = tk * operands.element_a.bytes
    if k_bytes not in (64, 128, 256):
        why.append(f"tile K must span 64, 128 or 256 bytes of A, got {tk} elements = {k_bytes}")

    if ck != 1:
        why.append("cluster K must be 1")
    if not (_power_of_two(cm) and _power_of_two(cn)) or cm * cn > 8:
        why.append(f"cluster {cm}x{cn} must be powers of two with at most 8 CTAs (portable)")
    if schedule is KernelSchedule.SM100_2SM and cm % 2:
        why.append("2-SM kernels need an even cluster M")

    if arch is Arch.SM90A:
        per_thread = tm * tn // _CONSUMER_THREADS[schedule]
        if operands.element_accumulator is DType.F32 and per_thread > _MAX_ACCUMULATORS_PER_THREAD:
            why.append(f"{tm}x{tn} {schedule.value} holds {per_thread} accumulators per thread "
                       f"(at most {_MAX_ACCUMULATORS_PER_THREAD})")
        if schedule is KernelSchedule.WARP_SPECIALIZED and \
                config.epilogue_schedule is EpilogueSchedule.TMA:
            why.append("the plain warp-specialized kernel has no TMA epilogue; use nosmem")

    stage_bytes = (tm + tn) * tk * operands.element_a.bytes
    if schedule is KernelSchedule.SM100_2SM:
        stage_bytes //= 2  # each CTA of the pair loads half of A's tile
    min_stages = config.stages or 2
    # A TMA epilogue stages output tiles in shared memory too: seen on an H200, 7 stages of a
    # 128x128x64 tile (224 KB) built but failed to initialize with it.
    epilogue_bytes = epilogue_smem_bytes(operands, config)
    if config.epilogue_schedule is EpilogueSchedule.TMA:
        epilogue_bytes = max(epilogue_bytes, _TMA_EPILOGUE_BYTES)
    if min_stages < 2:
        why.append("at least 2 pipeline stages are needed")
    if min_stages * stage_bytes + epilogue_bytes > SMEM_BYTES:
        why.append(f"{min_stages} stages of {stage_bytes} bytes (+ {epilogue_bytes} for the "
                   f"epilogue) exceed {SMEM_BYTES} bytes of shared memory")

    if not config.epilogue_tile_is_auto and operands.element_d.bytes != 2:
        why.append("an explicit epilogue tile needs a 16-bit output: GemmConfig's rule for it "
                   "(config.epilogue_tile_widths) was worked out for the 16-bit stmatrix copies")
    if not operands.epilogue.is_default and config.epilogue_schedule is not EpilogueSchedule.TMA:
        why.append(f"a fused epilogue ({operands.epilogue.name}) is an epilogue visitor tree, "
                   "which needs the TMA epilogue schedule")
    if config.tile_scheduler is TileScheduler.STREAM_K and schedule in (
            KernelSchedule.PINGPONG, KernelSchedule.WARP_SPECIALIZED):
        why.append("stream-K needs the cooperative schedule on sm90a")
    if config.splits > 1 and config.tile_scheduler is not TileScheduler.STREAM_K:
        why.append("splits > 1 needs the stream-K tile scheduler")

    known = _KNOWN_BROKEN.get((arch, schedule, config.tile, config.cluster,
                               config.epilogue_schedule))
    if known:
        why.append(known)
    return why


_FP8 = (DType.E4M3, DType.E5M2)


def _fp8_violations(operands: GemmOperands, config: GemmConfig) -> list[str]:
    """FP8's own rules (CUTLASS 4.2's sm90 builders; docs/fp8_emission.md)."""
    if not operands.is_fp8:
        why = ["fast accumulation is an FP8 mode"] if operands.fast_accum else []
        if operands.scaling is not Scaling.NONE:
            why.append(f"{operands.scaling.value} scaling is for FP8 operands")
        return why
    why = _scaling_violations(operands, config)
    if operands.element_a not in _FP8 or operands.element_b not in _FP8:
        why.append("FP8 takes two FP8 operands")
    elif operands.element_a is operands.element_b is DType.E5M2:
        why.append("e5m2 x e5m2 has no tensor-core instruction; one operand must be e4m3")
    if operands.element_d in _FP8:
        why.append("an FP8 GEMM writes bf16, f16 or f32, not FP8")
    if operands.layout_a is not Layout.ROW or operands.layout_b is not Layout.COL:
        why.append("FP8 wgmma reads K-major operands only: A row-major and B column-major")
    if operands.element_accumulator is not DType.F32:
        why.append("FP8 accumulates in f32")
    if config.arch is not Arch.SM90A:
        why.append("FP8 kernels are emitted for sm90a only")
    if config.tile[2] != 128:
        why.append(f"FP8 tiles span K = 128 elements (128 bytes), got {config.tile[2]}")
    return why


def _scaling_violations(operands: GemmOperands, config: GemmConfig) -> list[str]:
    """What each recipe's kernel can take (docs/fp8_emission.md). Tensorwise and rowwise scales
    ride in an epilogue visitor tree that may add a bias along N and nothing else; blockwise
    scales are applied in CUTLASS 4.2's FP8Blockwise mainloop, which promotes every 128-wide K
    block (no fast accumulation), compiles with tile N 128 only (with 1x128 A scales tile N 256
    fails a static_assert) and keeps the plain epilogue (the bias is added after it)."""
    scaling, epilogue = operands.scaling, operands.epilogue
    why = []
    if scaling in (Scaling.TENSORWISE, Scaling.ROWWISE):
        if epilogue.activation is not Activation.IDENTITY or epilogue.residual \
                or epilogue.bias is BiasMode.M:
            why.append(f"a {scaling.value} kernel's epilogue adds at most a bias along N")
    elif scaling is Scaling.BLOCKWISE:
        if not epilogue.is_default:
            why.append("a blockwise kernel has no fused epilogue; the bias is added after it")
        if operands.fast_accum:
            why.append("blockwise kernels promote each 128-wide K block: no fast accumulation")
        if config.tile[1] != 128:
            why.append(f"blockwise kernels take tile N 128 (one 128x128 B scale per tile), got "
                       f"{config.tile[1]}")
        if config.tile[0] > 128:  # CUTLASS issue #3596: the cooperative blockwise mainloop
            # reapplies an earlier M wave's A scales in tiles of several M scale blocks
            why.append(f"blockwise kernels take tile M 64 or 128 here, got {config.tile[0]} "
                       "(CUTLASS issue #3596)")
    return why


def check(operands: GemmOperands, config: GemmConfig) -> None:
    why = violations(operands, config)
    if why:
        raise InvalidConfigError(f"{config.name} cannot run {operands.name}: " + "; ".join(why))


_KERNEL_NAMES = {
    "TmaWarpSpecializedPingpong": KernelSchedule.PINGPONG,
    "TmaWarpSpecializedCooperative": KernelSchedule.COOPERATIVE,
    "TmaWarpSpecialized": KernelSchedule.WARP_SPECIALIZED,
    "TmaWarpSpecialized1SmSm100": KernelSchedule.SM100_1SM,
    "TmaWarpSpecialized2SmSm100": KernelSchedule.SM100_2SM,
}


def config_from_tile_description(td: dict, arch: Arch) -> GemmConfig | None:
    """Our config for one of cutlass_cppgen's tile descriptions, or None if we do not offer it
    (cp.async kernels, 'auto' schedules, dynamic cluster shapes)."""
    schedule = _KERNEL_NAMES.get(td["kernel_schedule"] or "")
    # Clusters given as 0 are dynamic (chosen at launch on sm100): we compile static ones only.
    if schedule is None or min(td["cluster"]) <= 0 or min(td["tile"]) <= 0:
        return None
    epilogue_name = td["epilogue_schedule"] or ""
    epilogue = EpilogueSchedule.NO_SMEM if "NoSmem" in epilogue_name else EpilogueSchedule.TMA
    scheduler = (TileScheduler.STREAM_K if td["tile_scheduler"] == "StreamK"
                 else TileScheduler.PERSISTENT)
    return GemmConfig(arch=arch, tile=tuple(td["tile"]), cluster=tuple(td["cluster"]),
                      stages=td["stages"], kernel_schedule=schedule, epilogue_schedule=epilogue,
                      tile_scheduler=scheduler)


def valid_configs(operands: GemmOperands, arch: Arch | str) -> list[GemmConfig]:
    """cutlass_cppgen's tile descriptions for the operands, as our configs, minus those our rules
    reject; sorted by name for a stable order."""
    from cutlass_ops.gemms.emit import cutlass_tile_descriptions

    arch = Arch(arch)
    configs = {config_from_tile_description(td, arch)
               for td in cutlass_tile_descriptions(operands, arch)}
    return sorted((c for c in configs if c is not None and not violations(operands, c)),
                  key=lambda c: c.name)
