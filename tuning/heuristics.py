"""NVIDIA's matmul heuristics (pip ``nvidia-matmul-heuristics``, optional), as our Choices.

nvMatmulHeuristics models a GEMM's runtime for a GPU without needing one and proposes CUTLASS 3
configs (CTA tile, cluster, stages, split-K, swizzle, CTA order). We map its picks onto our config
space: a 64-row tile runs pingpong, larger ones cooperative, split-K becomes our stream-K
scheduler with that many splits. Without the package, ``suggest`` returns nothing and the search
relies on our own model.
"""

from __future__ import annotations

import functools
import logging

from cutlass_ops.gemms.config import (Arch, DType, GemmConfig, GemmProblem, KernelSchedule, Layout,
                                RasterOrder, TileScheduler)
from cutlass_ops.gemms.ranking import orientations
from cutlass_ops.gemms.choice import Choice
from custom_kernels.core.device import DeviceSpec

log = logging.getLogger("cutlass_ops.tuning")

_PRECISION_LETTER = {DType.BF16: "T", DType.F16: "H", DType.F32: "S"}
_GPU_NAMES = [("H100 PCIe", "H100_PCIE"), ("H100 NVL", "H100_NVL"), ("H200", "H200_SXM"),
              ("H100", "H100_SXM"), ("H20", "H20_SXM"), ("B200", "B200")]


def available() -> bool:
    try:
        import nvMatmulHeuristics  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@functools.cache
def _interface(gpu_key: str | None):
    import nvMatmulHeuristics as nvmmh

    gpu = getattr(nvmmh.NvMatmulHeuristicsNvidiaGpu, gpu_key) if gpu_key else None
    return nvmmh.NvMatmulHeuristicsInterfaceEx(
        backend=nvmmh.NvMatmulHeuristicsTarget.CUTLASS3,
        flags=nvmmh.NvMatmulHeuristicsFlags.PERF_MODEL_BASED_AUTO_TUNING, gpu=gpu)


def _gpu_key(device: DeviceSpec) -> str | None:
    for fragment, key in _GPU_NAMES:
        if fragment.lower() in device.name.lower():
            return key
    return None


def _precision(problem: GemmProblem) -> str:
    ops = problem.operands
    compute = "F" if ops.element_a is DType.F32 else "S"
    return _PRECISION_LETTER[ops.element_a] + compute + _PRECISION_LETTER[ops.element_d]


def _layout(nvmmh, problem: GemmProblem):
    # Its layouts are row-major with "transposed while loading" flags: our column-major A
    # (stored K x M) is a transposed A, our column-major B (stored N x K) a transposed B.
    trans_a = problem.operands.layout_a is Layout.COL
    trans_b = problem.operands.layout_b is Layout.COL
    name = f"{'T' if trans_a else 'N'}{'T' if trans_b else 'N'}_ROW_MAJOR"
    return getattr(nvmmh.NvMatmulHeuristicsMatmulLayout, name)


def _to_choice(kernel, swap: bool, arch: Arch) -> Choice | None:
    tm, tn, tk = kernel.cta_tile_m, kernel.cta_tile_n, kernel.cta_tile_k
    split = int(kernel.split_k or 1)
    if arch is Arch.SM90A:
        schedule = KernelSchedule.PINGPONG if tm == 64 and split == 1 else \
            KernelSchedule.COOPERATIVE
    else:
        schedule = KernelSchedule.SM100_1SM
    if schedule is KernelSchedule.COOPERATIVE and tm < 128:
        return None
    swizzle = int(kernel.swizzle_factor or 1)
    try:
        config = GemmConfig(
            arch=arch, tile=(tm, tn, tk), cluster=(kernel.cluster_m or 1, kernel.cluster_n or 1, 1),
            kernel_schedule=schedule,
            tile_scheduler=TileScheduler.STREAM_K if split > 1 else TileScheduler.PERSISTENT,
            splits=split,
            # ctaOrder 0 maps tiles along N onto the grid's x (raster along N), 1 along M.
            raster_order=RasterOrder.ALONG_M if kernel.cta_order == 1 else RasterOrder.ALONG_N,
            swizzle=swizzle if swizzle in (1, 2, 4, 8) else 1)
    except ValueError:
        return None
    return Choice(config, swap)


def suggest(problem: GemmProblem, device: DeviceSpec, *, count: int = 8) -> list[Choice]:
    """nvMatmulHeuristics' picks for the problem (both orientations where swap-A/B applies),
    fastest estimate first; empty without the package or for what it does not model. The
    returned choices carry stage count 0 (auto): its stage counts are what fits, as ours."""
    if not available() or device.arch not in ("sm90a", "sm100a"):
        return []
    import nvMatmulHeuristics as nvmmh

    arch = Arch(device.arch)
    try:
        interface = _interface(_gpu_key(device))
        estimates = []
        for swap in orientations(problem):
            p = Choice(GemmConfig(), swap).problem_for(problem)
            nv_problem = interface.makeNvMatmulHeuristicsProblem(
                p.m, p.n, p.k, _layout(nvmmh, p), p.batch)
            for result in interface.get(nv_problem, count, precision=_precision(p)):
                choice = _to_choice(result["kernel"], swap, arch)
                if choice is not None:
                    estimates.append((result["runtime"], choice))
    except Exception as exc:  # an optional adviser must never stop a tune
        log.warning("nvidia-matmul-heuristics failed (%s); ranking with our model only", exc)
        return []
    estimates.sort(key=lambda item: item[0])
    # Its picks differ in warp tiles we do not expose: keep each config once, and compile-level
    # duplicates (same kernel, other swizzle) too, as run-time variants are timed anyway.
    seen, out = set(), []
    for _, choice in estimates:
        key = (choice.swap_ab, choice.config.build_fields())
        if key not in seen:
            seen.add(key)
            out.append(choice)
    return out[:count]
