"""C++ of a blockwise-scaled FP8 GEMM (DeepSeek's recipe: A scales 1x128, B scales 128x128).

cutlass_cppgen's plan has no blockwise kernels, so these come from ``cutlass_library`` directly:
a ``GemmOperation`` of kind ``BlockwiseUniversal3x`` built from our config, emitted by
``EmitGemmUniversal3xInstance`` (the generator's own emitter), then two edits the launcher
relies on (docs/fp8_emission.md, section 3):

- the scale layouts: cutlass_library writes ``Sm90BlockwiseScaleConfig<1, 128, 128>`` (both
  scale tensors MN-major); torch's blockwise ``scale_b`` is a K-major (N/128, K/128) buffer, so
  the B major becomes ``K``. ``scale_a`` (M, K/128) column-major is MN-major as emitted;
- the names the launcher reads: ``DeviceKernel``, ``CutlassOpsScaleConfig`` and the
  ``CUTLASS_OPS_BLOCKWISE_SCALES`` switch that makes it fill the mainloop's scale arguments.

Runs in the emission child process (``cutlass_bridge``); needs neither cutlass_cppgen nor a GPU.
"""

from __future__ import annotations

import re

from custom_kernels.core.elements import element
from cutlass_ops.gemms.config import (Arch, EpilogueSchedule, GemmConfig, GemmOperands,
                                      KernelSchedule, Layout, Scaling, TileScheduler)

BLOCK = 128  # the recipe's block: 1 x 128 of A, 128 x 128 of B
# The emitted line whose B major the launcher needs as K (see the module docstring).
_SCALE_CONFIG = re.compile(
    r"(using (\w+)_ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<)"
    r"\s*1,\s*128,\s*128\s*(>;)")


def _library_types(operands: GemmOperands):
    from cutlass_library import library as lib

    def dtype(d):
        return getattr(lib.DataType, element(d).cutlass)

    layout = {Layout.ROW: lib.LayoutType.RowMajor, Layout.COL: lib.LayoutType.ColumnMajor}
    a = lib.TensorDescription(dtype(operands.element_a), layout[operands.layout_a],
                              operands.alignment_a)
    b = lib.TensorDescription(dtype(operands.element_b), layout[operands.layout_b],
                              operands.alignment_b)
    # No C is read (void), D in the operands' output type.
    c = lib.TensorDescription(lib.DataType.void, layout[operands.layout_c], operands.alignment_c)
    d = lib.TensorDescription(dtype(operands.element_d), layout[operands.layout_c],
                              operands.alignment_c)
    return lib, a, b, c, d, dtype


def _schedules(lib, config: GemmConfig):
    cooperative = config.kernel_schedule is KernelSchedule.COOPERATIVE
    ks, es = lib.KernelScheduleType, lib.EpilogueScheduleType
    kernel = (ks.BlockwiseTmaWarpSpecializedCooperative if cooperative
              else ks.BlockwiseTmaWarpSpecializedPingpong)
    if config.epilogue_schedule is EpilogueSchedule.NO_SMEM:
        epilogue = es.NoSmemWarpSpecialized
    else:
        epilogue = es.TmaWarpSpecializedCooperative if cooperative else es.TmaWarpSpecialized
    scheduler = (lib.TileSchedulerType.StreamK
                 if config.tile_scheduler is TileScheduler.STREAM_K
                 else lib.TileSchedulerType.Default)
    return kernel, epilogue, scheduler


def operation(operands: GemmOperands, config: GemmConfig):
    """The cutlass_library ``GemmOperation`` of this blockwise kernel."""
    if operands.scaling is not Scaling.BLOCKWISE or config.arch is not Arch.SM90A:
        raise ValueError("blockwise_emit emits sm90a blockwise-scaled FP8 kernels only")
    if config.kernel_schedule not in (KernelSchedule.COOPERATIVE, KernelSchedule.PINGPONG):
        raise ValueError(f"no blockwise {config.kernel_schedule.value} kernel: use cooperative "
                         "or pingpong")
    lib, a, b, c, d, dtype = _library_types(operands)
    tm, tn, tk = config.tile
    # The wgmma atom: 64 rows, the tile's width, 32 bytes of K.
    math = lib.MathInstruction([64, tn, 32], a.element, b.element,
                               dtype(operands.element_accumulator), lib.OpcodeClass.TensorOp,
                               lib.MathOperation.multiply_add)
    tile = lib.TileDescription([tm, tn, tk], config.stages, [4, 1, 1], math, 90, 90,
                               list(config.cluster), explicit_vector_sizes=[1, BLOCK, BLOCK])
    kernel, epilogue, scheduler = _schedules(lib, config)
    from cutlass_library.gemm_operation import GemmOperation

    return GemmOperation(lib.GemmKind.BlockwiseUniversal3x, 90, tile, a, b, c,
                         dtype(operands.element_accumulator), D=d, kernel_schedule=kernel,
                         epilogue_schedule=epilogue, tile_scheduler=scheduler,
                         ScaleFactorMVecSize=1, ScaleFactorNVecSize=BLOCK,
                         ScaleFactorKVecSize=BLOCK)


def with_launcher_names(body: str, name: str) -> str:
    """The two edits of the module docstring, each checked to have happened exactly once."""
    body, edits = _SCALE_CONFIG.subn(
        r"\1 1, 128, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K\3", body)
    if edits != 1:
        raise ValueError(f"expected one Sm90BlockwiseScaleConfig<1, 128, 128> in the emitted "
                         f"source, found {edits}")
    return (f"{body}\n#define CUTLASS_OPS_BLOCKWISE_SCALES 1\n"
            f"using CutlassOpsScaleConfig = {name}_ScaleConfig;\n"
            f"using DeviceKernel = cutlass::gemm::device::GemmUniversalAdapter<{name}>;\n")


def emit(operands: GemmOperands, config: GemmConfig) -> str:
    """C++ declaring ``DeviceKernel`` (and the launcher's blockwise names), with its includes."""
    from cutlass_library.gemm_operation import EmitGemmUniversal3xInstance

    op = operation(operands, config)
    emitter = EmitGemmUniversal3xInstance()
    includes = "".join(f'#include "{header}"\n' for header in emitter.includes)
    body = with_launcher_names(emitter.emit(op), op.procedural_name())
    return f"// cutlass-ops kernel {config.build_name} for {operands.name}\n{includes}{body}"
