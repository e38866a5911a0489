"""From (operands, config) to a loaded kernel: emit, build, load, each cached.

``prepare`` does the first two for many configs at once (emission batched in one cutlass_cppgen
process per arch, builds in parallel); ``kernel_for`` returns a loaded kernel and memoizes it in the
process, so the per-call cost after the first call is one dictionary lookup. The config's rules
(``space.check``) are checked here, once per (operands, config) in a process: ``plan`` leaves
them to this layer.
"""

from __future__ import annotations

from typing import Callable, Iterable

from cutlass_ops.gemms import build, emit, runtime, space
from cutlass_ops.gemms.config import Arch, BiasMode, GemmConfig, GemmOperands, Scaling
from custom_kernels.core import cache_trust, fallback
from custom_kernels.core.errors import CutlassOpsError, KernelLaunchError, UnsafeCacheError

_loaded: dict[tuple, runtime.LoadedKernel] = {}
_valid: set[tuple[GemmOperands, GemmConfig]] = set()


# The wgmma widths CuTe's sm90 selector (cute/arch/mma_sm90.hpp) knows by default. It splits any
# other tile width into the largest of these that divides it (a 176-wide tile then runs 16-wide
# wgmmas, at under half speed). CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED adds every multiple of 8 up
# to 256 but makes nvcc much slower, so only the tiles that need it get it; for the others it
# changes nothing (identical SASS). Timings in docs/measurements.md.
_DEFAULT_WGMMA_WIDTHS = (8, 16, 32, 64, 96, 128, 192, 256)


def build_defines(config: GemmConfig) -> tuple[str, ...]:
    if config.arch is Arch.SM90A and config.tile[1] not in _DEFAULT_WGMMA_WIDTHS:
        return ("CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",)
    return ()


def build_spec(operands: GemmOperands, config: GemmConfig, source: str) -> build.BuildSpec:
    return build.BuildSpec(f"{operands.name}-{config.build_name}", source, config.arch,
                           build_defines(config))


def check_config(operands: GemmOperands, config: GemmConfig) -> None:
    """``space.check``, remembered once passed: raises InvalidConfigError with every rule the
    config breaks for these operands."""
    if (operands, config) not in _valid:
        space.check(operands, config)
        _valid.add((operands, config))


def prepare(operands: GemmOperands, configs: Iterable[GemmConfig], *, jobs: int | None = None,
            retry_failed: bool = False,
            on_done: Callable | None = None) -> dict[GemmConfig, build.Artifact | Exception]:
    """Emits and builds every config; maps each to its Artifact or to the error that stopped it
    (a rule violation, an emission error, or a BuildError with its log)."""
    results: dict[GemmConfig, build.Artifact | Exception] = {}
    todo = []
    for config in dict.fromkeys(configs):
        try:
            check_config(operands, config)
            todo.append(config)
        except CutlassOpsError as exc:
            results[config] = exc
    sources = emit.emit_sources(operands, todo)
    specs, spec_configs = [], []
    for config in todo:
        source = sources[config]
        if isinstance(source, Exception):
            results[config] = source
        else:
            specs.append(build_spec(operands, config, source))
            spec_configs.append(config)
    built = build.build_many(specs, jobs=jobs, retry_failed=retry_failed, on_done=on_done)
    results.update(zip(spec_configs, built))
    return results


def prepare_many(items: Iterable[tuple[GemmOperands, GemmConfig]], *, jobs: int | None = None,
                 retry_failed: bool = False, on_done: Callable | None = None,
                 ) -> dict[tuple[GemmOperands, GemmConfig], build.Artifact | Exception]:
    """``prepare`` for kernels of several operand sets at once: emission per operand set, then
    one parallel build of everything, so that the slowest compile does not serialize the rest."""
    items = list(dict.fromkeys(items))
    results: dict[tuple[GemmOperands, GemmConfig], build.Artifact | Exception] = {}
    specs, keys = [], []
    by_operands: dict[GemmOperands, list[GemmConfig]] = {}
    for operands, config in items:
        by_operands.setdefault(operands, []).append(config)
    for operands, configs in by_operands.items():
        todo = []
        for config in configs:
            try:
                check_config(operands, config)
                todo.append(config)
            except CutlassOpsError as exc:
                results[(operands, config)] = exc
        sources = emit.emit_sources(operands, todo) if todo else {}
        for config in todo:
            source = sources[config]
            if isinstance(source, Exception):
                results[(operands, config)] = source
            else:
                specs.append(build_spec(operands, config, source))
                keys.append((operands, config))
    built = build.build_many(specs, jobs=jobs, retry_failed=retry_failed, on_done=on_done)
    results.update(zip(keys, built))
    return results


def is_built(operands: GemmOperands, config: GemmConfig) -> bool:
    """Whether the kernel is emitted and built already, so that running it compiles nothing.
    Reads the cache only: never emits or compiles. A kernel in a cache that another user can
    write to counts as not built (it would not be loaded: ``cache_trust``), with one warning
    naming the path and the fix, so that ``cutlass_ops.matmul`` runs torch.matmul instead."""
    try:
        source = emit.cached_source(operands, config)
        if source is None:
            return False
        spec = build_spec(operands, config, source)
        if not build.is_built(spec):
            return False
        cache_trust.require_private(spec.directory / build.LIBRARY)
    except UnsafeCacheError as exc:
        fallback.log_once("cutlass-ops sees no built kernels", str(exc))
        return False
    return True


def expected_epilogue_slots(operands: GemmOperands) -> tuple[int, int]:
    """(scalars, bias pointers) a kernel for these operands must take: a plain kernel alpha and
    beta (a blockwise FP8 kernel's epilogue is plain too); a fused one alpha, beta with a
    residual, and one bias pointer with a bias; a tensorwise or rowwise FP8 one no scalar (its
    scales have slots of their own) and a bias pointer with a bias."""
    epilogue, scaling = operands.epilogue, operands.scaling
    bias = int(epilogue.bias is not BiasMode.NONE)
    if scaling in (Scaling.TENSORWISE, Scaling.ROWWISE):
        return 0, bias
    if epilogue.is_default:
        return 2, 0
    return 1 + int(epilogue.residual), bias


def expected_scale_slots(operands: GemmOperands) -> tuple[int, int, int]:
    """FP8 scales a kernel must read: (epilogue scalars, epilogue vectors, mainloop)."""
    return {Scaling.NONE: (0, 0, 0), Scaling.TENSORWISE: (2, 0, 0),
            Scaling.ROWWISE: (0, 2, 0), Scaling.BLOCKWISE: (0, 0, 2)}[operands.scaling]


def check_epilogue_slots(operands: GemmOperands, kernel: runtime.LoadedKernel) -> None:
    """Refuses a kernel whose launcher fills other epilogue values or scales than the operands
    name: it would compute something else."""
    expected = expected_epilogue_slots(operands)
    if kernel.epilogue_slots != expected:
        raise KernelLaunchError(
            f"{kernel.name} for {operands.name}: the launcher fills {kernel.epilogue_slots} "
            f"(scalars, bias pointers) of the epilogue, the operands need {expected}; this "
            "kernel would compute something else, so it is refused")
    expected = expected_scale_slots(operands)
    if kernel.scale_slots != expected:
        raise KernelLaunchError(
            f"{kernel.name} for {operands.name}: the kernel reads {kernel.scale_slots} FP8 "
            f"scales (epilogue scalars, epilogue vectors, mainloop), the operands' "
            f"{operands.scaling.value} scaling needs {expected}; refused")


def kernel_for(operands: GemmOperands, config: GemmConfig) -> runtime.LoadedKernel:
    """The loaded kernel for a config, built if needed. Raises the error that prevented it."""
    check_config(operands, config)  # the memo below is per build: run-time fields need it too
    key = (operands, config.build_fields())
    kernel = _loaded.get(key)
    if kernel is None:
        result = prepare(operands, [config])[config]
        if isinstance(result, Exception):
            raise result
        kernel = runtime.load(str(result.library), config.build_name)
        check_epilogue_slots(operands, kernel)
        _loaded[key] = kernel
    return kernel
