"""The only module that imports cutlass_cppgen. It runs in a child process, never in the user's.

Why a child process: importing cutlass_cppgen creates ``compiled_cache.db`` in the current working
directory, sets up CUDA-Python globals and wants a GPU to pick its option registry. Here it runs
with its working directory inside our cache, with the registry built for the target arch only (about
1 s for sm90a, 5 s for sm100a instead of 15-20 s for every arch) and no GPU needed.

Protocol: ``python -m cutlass_ops.gemms.cutlass_bridge REQUEST.json RESULT.json``. A request is
``{"op": "tile_descriptions" | "emit", "arch": "sm90a", "operands": {...}, "configs": [...]}``; the
result holds plain data only. The parent side is ``cutlass_ops.gemms.emit``.
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from typing import Any

from custom_kernels.core.elements import element
from cutlass_ops.gemms.config import (EPILOGUE_TILE_AUTO_CPP, Activation, Arch, BiasMode, DType,
                                      Epilogue, EpilogueSchedule, GemmConfig, GemmOperands,
                                      KernelSchedule, Layout, Scaling, TileScheduler)

def _cutlass_element(dtype: DType):
    """``cutlass_library.DataType`` of an element type (the name in ``core.elements``)."""
    import cutlass_library

    return getattr(cutlass_library.DataType, element(dtype).cutlass)


def _cutlass():
    import cutlass_cppgen
    import cutlass_library

    return cutlass_cppgen, cutlass_library


def _install_registry(arch: Arch) -> None:
    """Give cutlass_cppgen the options of one arch without asking a GPU which arch to use."""
    cutlass_cppgen, cutlass_library = _cutlass()
    from cutlass_cppgen.library_defaults import ArchOptions

    cutlass_cppgen._nvcc_version = cutlass_cppgen.nvcc_version()
    gemm_kinds = [cutlass_library.GemmKind.Universal, cutlass_library.GemmKind.Universal3x]
    options = ArchOptions(arch.cc, arch.cc, cutlass_library.OperationKind.Gemm, gemm_kinds)

    class SingleArchRegistry:
        def options_for_cc(self, cc: int, op_kind=None):
            return options if cc == arch.cc else None

    cutlass_cppgen.this._option_registry = SingleArchRegistry()


def _plan(operands: GemmOperands, arch: Arch):
    cutlass_cppgen, cutlass_library = _cutlass()
    lt = cutlass_library.LayoutType
    cutlass_type = _cutlass_element
    layout = {Layout.ROW: lt.RowMajor, Layout.COL: lt.ColumnMajor}
    return cutlass_cppgen.op.Gemm(
        element_A=cutlass_type(operands.element_a), element_B=cutlass_type(operands.element_b),
        element_C=cutlass_type(operands.element_c), element_D=cutlass_type(operands.element_d),
        element_accumulator=cutlass_type(operands.element_accumulator),
        layout_A=layout[operands.layout_a], layout_B=layout[operands.layout_b],
        layout_C=layout[operands.layout_c], cc=arch.cc, kernel_cc=arch.cc)


# Names the EVT frontend knows (cutlass_cppgen.backend.evt.frontend.python_ast); "gelu_tanh" is
# ours, mapped below onto CUTLASS's GELU_taylor, which cutlass_cppgen has but does not name.
_ACTIVATION_CALLS = {Activation.RELU: "relu", Activation.GELU: "gelu",
                     Activation.GELU_TANH: "gelu_tanh", Activation.SILU: "silu"}


# The launcher's slot of each epilogue parameter that a leaf of the tree reads (EpilogueSlot in
# csrc/gemm_launcher.cu); "accum" and "C" are fetches, not leaves.
_SLOTS = {"alpha": 0, "beta": 1, "bias": 2, "scale_a": 3, "scale_b": 4}


def scaled_epilogue_function(epilogue: Epilogue) -> str:
    """The tree of a tensorwise or rowwise FP8 kernel: ``D = accum * scale_a * scale_b
    (+ bias)``. Its leaves are visited in the order the expression names them, which
    ``epilogue_slots`` tells the launcher."""
    params, expr = ["accum", "scale_a", "scale_b"], "accum * scale_a * scale_b"
    if epilogue.bias is BiasMode.N:
        params.append("bias")
        expr += " + bias"
    return f"def epilogue({', '.join(params)}):\n    D = {expr}\n    return D\n"


def epilogue_slots(operands: GemmOperands) -> str:
    """The ``#define`` that lists a scaled tree's leaves' slots for the launcher (empty for the
    alpha/beta/bias trees, which the launcher fills by kind)."""
    if operands.scaling not in (Scaling.TENSORWISE, Scaling.ROWWISE):
        return ""
    source = scaled_epilogue_function(operands.epilogue)
    params = source[source.index("(") + 1:source.index(")")].split(", ")[1:]
    return "#define CUTLASS_OPS_EPILOGUE_SLOTS " + ", ".join(str(_SLOTS[p]) for p in params)


def epilogue_function(epilogue: Epilogue) -> str:
    """The Python source cutlass_cppgen traces into an epilogue visitor tree:
    ``D = activation(alpha * accum + bias) + beta * C``, each part only where the epilogue has
    it. The launcher fills the tree's arguments by node kind, in this order: alpha before beta."""
    params, expr = ["accum", "alpha"], "alpha * accum"
    if epilogue.bias is not BiasMode.NONE:
        params.append("bias")
        expr += " + bias"
    if epilogue.activation is not Activation.IDENTITY:
        expr = f"{_ACTIVATION_CALLS[epilogue.activation]}({expr})"
    if epilogue.residual:
        params += ["beta", "C"]
        expr += " + beta * C"
    return f"def epilogue({', '.join(params)}):\n    D = {expr}\n    return D\n"


def _patch_evt_frontend() -> None:
    """Two gaps in cutlass_cppgen 4.2's EVT frontend: tracing from source text uses ``ast`` and
    ``textwrap`` without importing them, and the tanh GELU has no name."""
    import ast
    import textwrap

    import cutlass_cppgen.epilogue.epilogue as epilogue_module
    from cutlass_cppgen.backend.evt.frontend.python_ast import PythonASTFrontend
    from cutlass_cppgen.backend.library import ActivationOp

    epilogue_module.ast, epilogue_module.textwrap = ast, textwrap
    if getattr(PythonASTFrontend, "_cutlass_ops_patched", False):
        return
    known = PythonASTFrontend.ast_op_to_bindings

    def bindings(op):
        return ActivationOp.GeluTaylor if op == "gelu_tanh" else known(op)

    PythonASTFrontend.ast_op_to_bindings = staticmethod(bindings)
    PythonASTFrontend._cutlass_ops_patched = True


def _epilogue_visitor(operands: GemmOperands, arch: Arch):
    """The traced visitor tree. Example operands are described, not allocated: C and D in the
    operands' layout with dynamic batch strides (so batched GEMMs work), the bias as a (1, 1, N)
    or (1, M, 1) broadcast."""
    cutlass_cppgen, cutlass_library = _cutlass()
    from cutlass_cppgen.backend.evt.ir.tensor import Tensor

    _patch_evt_frontend()
    cutlass_type = _cutlass_element
    batch, m, n = 2, 256, 512  # any sizes: only the layouts and broadcasts are read

    def matrix(dtype: DType, layout: Layout):
        stride = (m * n, n, 1) if layout is Layout.ROW else (m * n, 1, m)
        return Tensor(element=cutlass_type(dtype), shape=(batch, m, n), stride=stride)

    epilogue = operands.epilogue
    examples = {"accum": matrix(operands.element_accumulator, Layout.ROW), "alpha": 1.0,
                "D": matrix(operands.element_d, operands.layout_c)}
    function = epilogue_function(epilogue)
    if operands.scaling is Scaling.TENSORWISE:  # device scalars (Sm90ScalarBroadcast)
        examples.update(scale_a=1.0, scale_b=1.0)
        function = scaled_epilogue_function(epilogue)
    elif operands.scaling is Scaling.ROWWISE:  # M values (column broadcast), N values (row)
        examples["scale_a"] = Tensor(element=cutlass_type(DType.F32), shape=(1, m, 1),
                                     stride=(m, 1, 1))
        examples["scale_b"] = Tensor(element=cutlass_type(DType.F32), shape=(1, 1, n),
                                     stride=(n, n, 1))
        function = scaled_epilogue_function(epilogue)
    if epilogue.bias is BiasMode.N:
        examples["bias"] = Tensor(element=cutlass_type(operands.element_d), shape=(1, 1, n),
                                  stride=(n, n, 1))
    elif epilogue.bias is BiasMode.M:
        examples["bias"] = Tensor(element=cutlass_type(operands.element_d), shape=(1, m, 1),
                                  stride=(m, 1, 1))
    if epilogue.residual:
        examples["beta"] = 1.0
        examples["C"] = matrix(operands.element_c, operands.layout_c)
    return cutlass_cppgen.epilogue.trace(function, examples, cc=arch.cc)


def tile_descriptions(operands: GemmOperands, arch: Arch) -> list[dict[str, Any]]:
    """cutlass_cppgen's own list, as plain dicts; ``tile`` is the emitted TileShape."""
    _install_registry(arch)
    out = []
    for td in _plan(operands, arch).tile_descriptions():
        out.append({
            "threadblock_shape": list(td.threadblock_shape),
            "tile": list(td.blackwell_threadblock_shape),
            "cluster": list(td.cluster_shape),
            "stages": td.stages or 0,
            "kernel_schedule": getattr(td.kernel_schedule, "name", None),
            "epilogue_schedule": getattr(td.epilogue_schedule, "name", None),
            "tile_scheduler": getattr(td.tile_scheduler, "name", None),
        })
    # cutlass_cppgen's order varies from one process to the next; make ours stable.
    return sorted(out, key=lambda td: json.dumps(td, sort_keys=True))


def _schedules(config: GemmConfig, operands: GemmOperands):
    _, cutlass_library = _cutlass()
    ks = cutlass_library.KernelScheduleType
    es = cutlass_library.EpilogueScheduleType
    kernel = {
        KernelSchedule.PINGPONG: ks.TmaWarpSpecializedPingpong,
        KernelSchedule.COOPERATIVE: ks.TmaWarpSpecializedCooperative,
        KernelSchedule.WARP_SPECIALIZED: ks.TmaWarpSpecialized,
        KernelSchedule.SM100_1SM: ks.TmaWarpSpecialized1SmSm100,
        KernelSchedule.SM100_2SM: ks.TmaWarpSpecialized2SmSm100,
    }[config.kernel_schedule]
    # FP8 without periodic promotion to float32 (space.violations). cutlass_cppgen 4.2 accepts
    # stream-K only beside the plain cooperative schedule: such a kernel is emitted with it and
    # given its fast-accumulation schedule after (``with_fast_accum_stream_k``).
    if operands.fast_accum and config.tile_scheduler is not TileScheduler.STREAM_K:
        kernel = getattr(ks, f"{kernel.name}FP8FastAccum")
    tma = config.epilogue_schedule is EpilogueSchedule.TMA
    epilogue = {
        KernelSchedule.PINGPONG: es.TmaWarpSpecialized if tma else es.NoSmemWarpSpecialized,
        KernelSchedule.COOPERATIVE:
            es.TmaWarpSpecializedCooperative if tma else es.NoSmemWarpSpecialized,
        KernelSchedule.WARP_SPECIALIZED:
            es.TmaWarpSpecialized if tma else es.NoSmemWarpSpecialized,
        KernelSchedule.SM100_1SM:
            es.TmaWarpSpecialized1Sm if tma else es.NoSmemWarpSpecialized1Sm,
        KernelSchedule.SM100_2SM:
            es.TmaWarpSpecialized2Sm if tma else es.NoSmemWarpSpecialized2Sm,
    }[config.kernel_schedule]
    scheduler = cutlass_library.TileSchedulerType
    tile_scheduler = (scheduler.StreamK if config.tile_scheduler is TileScheduler.STREAM_K
                      else scheduler.Default)
    return kernel, epilogue, tile_scheduler


def cutlass_threadblock_shape(config: GemmConfig) -> list[int]:
    """cutlass_cppgen's ``threadblock_shape`` is the cluster's tile: it divides it by the cluster
    shape (and doubles M back for 2-SM kernels) to get the emitted TileShape. Invert that."""
    tm, tn, tk = config.tile
    cm, cn, ck = config.cluster
    m = tm * cm // 2 if config.kernel_schedule is KernelSchedule.SM100_2SM else tm * cm
    return [m, tn * cn, tk * ck]


def with_epilogue_tile(body: str, config: GemmConfig) -> str:
    """cutlass_cppgen 4.2 writes EpilogueTileAuto into every sm90 kernel (its templates have no
    parameter for it): an explicit epilogue tile replaces each occurrence, the epilogue
    CollectiveBuilder's and, for a visitor tree, its EpilogueDescriptor's, so that both agree."""
    if config.epilogue_tile_is_auto:
        return body
    if EPILOGUE_TILE_AUTO_CPP not in body:
        raise ValueError("no EpilogueTileAuto in cutlass_cppgen's source to replace with the "
                         f"epilogue tile {config.epilogue_tile}")
    return body.replace(EPILOGUE_TILE_AUTO_CPP, config.epilogue_tile_cpp)


_DESCRIPTOR_TILE = re.compile(r"(EpilogueDescriptor<\s*)cute::Shape<_\d+, _\d+, _\d+>")


def with_cta_descriptor(body: str, config: GemmConfig) -> str:
    """cutlass_cppgen 4.2 gives a visitor tree's EpilogueDescriptor its ``threadblock_shape``,
    which is the cluster's tile (``cutlass_threadblock_shape``), not the CTA's. The broadcast
    nodes size their shared memory by it (a 128x128 tile in a 2x2 cluster kept buffers for
    256x256), and a tile such as 64x160 in a 2x2 cluster names ``_320``, which cute does not
    define. The epilogue works on the CTA tile: write that one."""
    if "EpilogueDescriptor<" not in body:
        return body
    tm, tn, tk = config.tile
    body, count = _DESCRIPTOR_TILE.subn(
        rf"\1cute::Shape<cute::_{tm}, cute::_{tn}, cute::_{tk}>", body, count=1)
    if count != 1:
        raise ValueError("no EpilogueDescriptor tile shape in cutlass_cppgen's source")
    return body


_COOPERATIVE_SCHEDULE = re.compile(r"cutlass::gemm::KernelTmaWarpSpecializedCooperative(?=\W)")


def with_fast_accum_stream_k(body: str, operands: GemmOperands, config: GemmConfig) -> str:
    """A stream-K FP8 kernel with fast accumulation: the emitted mainloop's plain cooperative
    schedule becomes its FP8FastAccum form (a subclass of it, which CUTLASS's stream-K
    scheduler takes as it takes the plain one)."""
    if not (operands.fast_accum and config.tile_scheduler is TileScheduler.STREAM_K):
        return body
    body, count = _COOPERATIVE_SCHEDULE.subn(
        "cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum", body)
    if count != 1:
        raise ValueError(f"expected one cooperative kernel schedule in the emitted source, "
                         f"found {count}")
    return body


def emit(operands: GemmOperands, config: GemmConfig) -> str:
    """C++ declaring ``DeviceKernel`` for this config, with the includes it needs (blockwise FP8
    kernels from cutlass_library: ``blockwise_emit``)."""
    from cutlass_cppgen.backend.gemm_operation import EmitGemmUniversalInstance3x

    if operands.scaling is Scaling.BLOCKWISE:
        from cutlass_ops.gemms.fp8 import blockwise_emit

        return with_epilogue_tile(blockwise_emit.emit(operands, config), config)

    plan = _plan(operands, config.arch)
    kernel, epilogue, tile_scheduler = _schedules(config, operands)
    base = plan.tile_descriptions()[0]
    td = base.clone_and_update({
        "threadblock_shape": cutlass_threadblock_shape(config),
        "cluster_shape": list(config.cluster),
        "stages": config.stages,
        "kernel_schedule": kernel,
        "epilogue_schedule": epilogue,
        "tile_scheduler": tile_scheduler,
    })
    if not operands.epilogue.is_default or operands.scaling is not Scaling.NONE:
        plan.epilogue_visitor = _epilogue_visitor(operands, config.arch)
    operation = plan.construct(td, operands.alignment_a, operands.alignment_b, operands.alignment_c)
    emitter = EmitGemmUniversalInstance3x("_type")
    includes = "".join(f'#include "{header}"\n' for header in emitter.includes)
    body = with_cta_descriptor(with_epilogue_tile(emitter.emit(operation.device_op()), config),
                               config)
    body = with_fast_accum_stream_k(body, operands, config)
    if "using DeviceKernel" not in body:  # the visitor template declares the kernel type only
        name = operation.device_op().procedural_name()
        body += ("\nusing DeviceKernel = "
                 f"cutlass::gemm::device::GemmUniversalAdapter<{name}_type>;\n")
    slots = epilogue_slots(operands)
    return (f"// cutlass-ops kernel {config.build_name} for {operands.name}\n{includes}{body}"
            + (f"\n{slots}\n" if slots else ""))


def handle(request: dict[str, Any]) -> dict[str, Any]:
    arch = Arch(request["arch"])
    operands = GemmOperands.from_dict(request["operands"])
    if request["op"] == "tile_descriptions":
        return {"tile_descriptions": tile_descriptions(operands, arch)}
    if request["op"] == "emit":
        _install_registry(arch)
        results = []
        for data in request["configs"]:
            config = GemmConfig.from_dict(data)
            try:
                results.append({"source": emit(operands, config)})
            except Exception as exc:  # one bad config must not sink the batch
                results.append({"error": f"{type(exc).__name__}: {exc}"})
        return {"results": results}
    raise ValueError(f"unknown request {request['op']!r}")


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    with open(request_path) as f:
        request = json.load(f)
    try:
        result = handle(request)
    except Exception:
        result = {"fatal": traceback.format_exc()}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
