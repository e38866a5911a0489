"""An FP8 scaled GEMM as a GEMM problem of this library, and one CUTLASS kernel's launch of it.

``torch._scaled_mm``'s call (``fp8_operands.CheckedScaled``) becomes a ``GemmProblem`` whose
operands carry the recipe (``GemmOperands.scaling``) and torch's ``use_fast_accum``: the key
under which the tuner stores its winner and dispatch finds it. ``plan`` binds a kernel to one
call's tensors and returns ``launch()``; the tuner and the benchmarks time that, dispatch copies
its arguments and swaps in each call's pointers (``fp8_routes``).

What a kernel reads (csrc/gemm_launcher.cu, ABI 3): A (M, K) and B (N, K) K-major, D (M, N)
row-major; the scales through ``scale_a`` / ``scale_b``: device scalars (tensorwise), M and N
contiguous floats (rowwise), or the blockwise layouts, compact: scale_a (M, K/128) with strides
(1, M), scale_b (K/128, N/128) with strides (1, K/128) (``layout_refusal`` checks them, as it
checks the rules a kernel has beyond torch's: blockwise M % 4 for the TMA load of scale_a).
A blockwise kernel has no fused epilogue: its bias is added after it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from cutlass_ops.gemms import loader, runtime
from cutlass_ops.gemms.config import (BiasMode, DType, Epilogue, GemmConfig, GemmOperands,
                                      GemmProblem, Layout, Scaling)
from cutlass_ops.gemms.fp8.fp8_operands import BLOCK, CheckedScaled, ScaleRecipe
from custom_kernels.core.device import device_facts
from custom_kernels.core.elements import element


def scaled_operands(recipe: ScaleRecipe | str, *, element_a: str = "e4m3", element_b: str = "e4m3",
                    out_dtype: Any = "bf16", bias: bool = False,
                    fast_accum: bool = False) -> GemmOperands:
    """The kernel operands of a scaled GEMM: FP8 A row-major and B column-major, D row-major of
    ``out_dtype`` (bf16 or f32), float32 accumulation. A bias is fused into tensorwise and
    rowwise kernels; blockwise ones promote every K block (no fast accumulation) and take the
    bias after."""
    recipe = ScaleRecipe(recipe)
    out = DType(element(out_dtype).name)
    blockwise = recipe is ScaleRecipe.BLOCKWISE
    epilogue = Epilogue(bias=BiasMode.N if bias and not blockwise else BiasMode.NONE)
    return GemmOperands(DType(element_a), DType(element_b), out, out, DType.F32, Layout.ROW,
                        Layout.COL, Layout.ROW, 16, 16, 16 // out.bytes, epilogue,
                        fast_accum=fast_accum and not blockwise, scaling=Scaling(recipe.value))


def scaled_problem(recipe: ScaleRecipe | str, m: int, n: int, k: int, **operands: Any) -> GemmProblem:
    """The tuned problem of ``scaled_mm`` at M x N x K (keywords: ``scaled_operands``'s)."""
    return GemmProblem(scaled_operands(recipe, **operands), m, n, k)


def problem_of(checked: CheckedScaled, fast_accum: bool) -> GemmProblem:
    return scaled_problem(checked.recipe, checked.m, checked.n, checked.k,
                          element_a=checked.element_a, element_b=checked.element_b,
                          out_dtype=checked.out_dtype, bias=checked.has_bias,
                          fast_accum=fast_accum)


def layout_refusal(checked: CheckedScaled, scale_a, scale_b) -> str | None:
    """Why our kernels cannot read these scales (torch._scaled_mm may still), else None."""
    m, n, k = checked.m, checked.n, checked.k
    if checked.recipe is ScaleRecipe.ROWWISE:
        if m > 1 and scale_a.stride(0) != 1 or n > 1 and scale_b.stride(1) != 1:
            return "rowwise scales must be contiguous vectors"
    elif checked.recipe is ScaleRecipe.BLOCKWISE:
        blocks_k = k // BLOCK
        if blocks_k > 1 and (scale_a.stride(1) != m or scale_b.stride(1) != blocks_k):
            return (f"blockwise scales must be compact: scale_a strides (1, {m}), scale_b "
                    f"(1, {blocks_k}); got {tuple(scale_a.stride())} and "
                    f"{tuple(scale_b.stride())}")
        if m % 4:  # fp8_routes pads such calls
            return f"blockwise kernels load scale_a by TMA, which needs M % 4 == 0, got M={m}"
        if scale_a.data_ptr() % 16:
            return "blockwise scale_a must start at a 16-byte aligned address (TMA)"
    return None


def launch_args(checked: CheckedScaled, config: GemmConfig, a, b, out, scale_a, scale_b,
                bias, sm_count: int) -> runtime.GemmArgs:
    """The launcher's arguments for one call (``module docstring``). CUTLASS sees B (K, N)
    column-major as N x K: its N stride is b.stride(1), its K stride 1."""
    m, n, k = checked.m, checked.n, checked.k
    d_ptr = out.data_ptr()
    args = runtime.GemmArgs(
        m=m, n=n, k=k, l=1,
        a=a.data_ptr(), a_stride_m=a.stride(0), a_stride_k=1, a_stride_l=m * k,
        b=b.data_ptr(), b_stride_n=b.stride(1), b_stride_k=1, b_stride_l=n * k,
        c=d_ptr, c_stride_m=out.stride(0), c_stride_n=1, c_stride_l=m * n,
        d=d_ptr, d_stride_m=out.stride(0), d_stride_n=1, d_stride_l=m * n,
        alpha=1.0, beta=0.0, device_id=out.device.index, sm_count=sm_count,
        raster_order=config.raster_order.abi_value, swizzle=config.swizzle,
        splits=config.splits)
    fused_bias = bias is not None and checked.recipe is not ScaleRecipe.BLOCKWISE
    args.bias = bias.data_ptr() if fused_bias else None
    args.scale_a, args.scale_b = scale_a.data_ptr(), scale_b.data_ptr()
    return args


def plan(checked: CheckedScaled, config: GemmConfig, a, b, scale_a, scale_b, bias=None, *,
         fast_accum: bool = False, out=None) -> Callable[[], Any]:
    """Loads (building if needed) the kernel of ``config`` for this call and returns
    ``launch()``, which runs it on torch's current stream and returns ``out``."""
    import torch

    operands = problem_of(checked, fast_accum).operands
    kernel = loader.kernel_for(operands, config)
    if out is None:
        out = torch.empty((checked.m, checked.n), dtype=checked.out_dtype, device=a.device)
    if math.prod(out.shape) == 0:
        return lambda: out
    sm_count, _, _ = device_facts(a.device.index)
    args = launch_args(checked, config, a, b, out, scale_a, scale_b, bias, sm_count)
    workspace_bytes = kernel.workspace_bytes(args)
    workspace = (torch.empty(workspace_bytes, dtype=torch.uint8, device=a.device)
                 if workspace_bytes else None)
    workspace_ptr = workspace.data_ptr() if workspace is not None else 0
    late_bias = bias if bias is not None and checked.recipe is ScaleRecipe.BLOCKWISE else None

    def launch():
        kernel.run(args, workspace_ptr, workspace_bytes,
                   torch.cuda.current_stream(a.device).cuda_stream)
        return out if late_bias is None else out.add_(late_bias)

    launch.workspace = workspace  # alive as long as the launcher
    launch.kernel, launch.args, launch.workspace_bytes = kernel, args, workspace_bytes
    return launch


__all__ = ["layout_refusal", "launch_args", "plan", "problem_of", "scaled_operands",
           "scaled_problem"]
