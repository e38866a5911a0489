"""``gemm``: one CUTLASS GEMM with an explicit config on torch tensors.

D = activation(alpha * (A @ B) + bias) + beta * C, for 2-D operands or batches of them (3-D, batch
first); bias and activation are fused into the kernel's epilogue (a CUTLASS epilogue visitor
tree), so a fused problem has kernels of its own (``GemmOperands.epilogue``). The kernel
for (operands, config) is emitted, built and loaded on first use and memoized; it runs on torch's
current stream on the tensors' own device, with its workspace from torch's caching allocator.

``plan`` checks the inputs once (``check``: the device rule for a named kernel, then
``inputs.check_gemm`` and the GPU's arch); ``launcher`` and ``prepare`` take the checked problem
as it is and check nothing again (the config's own rules are ``space.check``, run by the loader).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from cutlass_ops.gemms import inputs, loader, runtime
from cutlass_ops.gemms.config import Activation, GemmConfig
from cutlass_ops.gemms.inputs import CheckedGemm, bias_mode
from custom_kernels.core.device import device_facts
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.core.fallback import require_cuda


def as_config(config: GemmConfig | str | dict[str, Any]) -> GemmConfig:
    if isinstance(config, GemmConfig):
        return config
    if isinstance(config, str):
        return GemmConfig.from_name(config)
    if isinstance(config, dict):
        return GemmConfig.from_dict(config)
    raise TypeError(f"config must be a GemmConfig, its name or its dict, not {type(config)}")


def gemm(a, b, c=None, *, alpha: float = 1.0, beta: float = 0.0, bias=None,
         activation: Activation | str = Activation.IDENTITY,
         config: GemmConfig | str | dict, out=None, out_dtype=None):
    """D = activation(alpha * (a @ b) + bias) + beta * c with the CUTLASS kernel ``config``
    describes.

    a: (M, K) or (L, M, K); b: (K, N) or (L, K, N); c and out: the output's shape. Each operand
    may be row- or column-major with any 16-byte aligned leading dimension. bf16, f16 and f32
    (tf32) operands; the output type is ``out_dtype``, else out's, else c's, else a's. Like
    torch.addmm, beta = 0 ignores c (NaNs included). ``bias``: (N,) or (1, N), one value per
    output column (nn.Linear's), or (M, 1), one per row; contiguous, the output's dtype, shared
    by every batch. ``activation``: identity, relu, gelu (erf), gelu_tanh or silu. Returns ``out``
    (allocated if not given).
    """
    return plan(a, b, c, alpha=alpha, beta=beta, bias=bias, activation=activation, config=config,
                out=out, out_dtype=out_dtype)()


def plan(a, b, c=None, *, alpha: float = 1.0, beta: float = 0.0, bias=None,
         activation: Activation | str = Activation.IDENTITY,
         config: GemmConfig | str | dict, out=None, out_dtype=None) -> Callable[[], Any]:
    """Checks everything, loads the kernel and returns ``launch()``, which runs the GEMM on the
    current stream and returns ``out``. Repeated launches redo no Python-side work: for
    benchmarks and the tuner, which time the kernel and its C++ launcher alone."""
    config = as_config(config)
    return launcher(check(a, b, c, alpha=alpha, beta=beta, bias=bias, activation=activation,
                          out=out, out_dtype=out_dtype, config=config), config)


def check(a, b, c=None, *, alpha: float = 1.0, beta: float = 0.0, bias=None,
          activation: Activation | str = Activation.IDENTITY, out=None, out_dtype=None,
          config: GemmConfig) -> CheckedGemm:
    """``plan``'s checks, once: CUDA tensors on one device (the rule for an entry point that
    names a kernel), every input (``inputs.check_gemm``), a GPU of the config's arch; then the
    output allocated where none is given."""
    device = require_cuda({"A": a, "B": b, "C": c, "out": out, "bias": bias}, "cutlass_ops.gemm")
    checked = inputs.check_gemm(a, b, c, alpha=alpha, beta=beta, bias=bias,
                                activation=activation, out=out, out_dtype=out_dtype)
    refusal = inputs.arch_refusal(config.arch, device)
    if refusal is not None:
        raise UnsupportedInputError(f"config {config.name} is for {config.arch.value}, but "
                                    f"{refusal}")
    if checked.out is None:
        checked = inputs.with_output(checked, inputs.new_output(
            checked.shape, checked.out_dtype, checked.out_layout, device))
    return checked


def launcher(checked: CheckedGemm, config: GemmConfig) -> Callable[[], Any]:
    """``launch()`` for a checked problem with its output bound (see ``plan``)."""
    import torch

    out = checked.out
    if checked.problem is None:
        return _empty_launcher(checked)
    kernel, args = prepare(checked, config)
    workspace_bytes = kernel.workspace_bytes(args)
    workspace = (torch.empty(workspace_bytes, dtype=torch.uint8, device=checked.device)
                 if workspace_bytes else None)
    workspace_ptr = workspace.data_ptr() if workspace is not None else 0
    device = checked.device

    def launch():
        stream = torch.cuda.current_stream(device).cuda_stream
        kernel.run(args, workspace_ptr, workspace_bytes, stream)
        return out

    launch.workspace = workspace  # keeps the workspace alive as long as the launcher
    launch.bias = checked.bias
    return launch


def prepare(checked: CheckedGemm, config: GemmConfig) -> tuple[runtime.LoadedKernel,
                                                                runtime.GemmArgs]:
    """The loaded kernel for a (non-empty) checked problem and its launch arguments, whose
    pointers are the views' (dispatch swaps in each call's own)."""
    kernel = loader.kernel_for(checked.problem.operands, config)
    sm_count, _, _ = device_facts(checked.device.index)
    return kernel, _launch_args(checked, config, sm_count)


def _empty_launcher(checked: CheckedGemm) -> Callable[[], Any]:
    """An empty product: an empty output, or (K = 0) the epilogue of a zero accumulator."""
    out = checked.out
    if math.prod(checked.shape) == 0:
        return lambda: out

    def empty_sum():
        import torch

        from cutlass_ops.gemms import epilogues

        zero = torch.zeros(checked.shape, dtype=torch.float32, device=checked.device)
        return out.copy_(epilogues.apply(zero, bias=checked.bias, activation=checked.activation,
                                         c=checked.c, beta=checked.beta))

    return empty_sum


def _launch_args(checked: CheckedGemm, config: GemmConfig, sm_count: int) -> runtime.GemmArgs:
    views, problem = checked.views, checked.problem
    a, b, d = views["A"], views["B"], views["out"]
    c = views.get("C", d)  # no C: point at D; with beta = 0 CUTLASS does not read it
    args = runtime.GemmArgs(
        m=problem.m, n=problem.n, k=problem.k, l=problem.batch,
        a=a.ptr, a_stride_m=a.stride_rows, a_stride_k=a.stride_cols, a_stride_l=a.batch_stride,
        # CUTLASS sees B as N x K: its N stride is our column stride, its K stride our row stride.
        b=b.ptr, b_stride_n=b.stride_cols, b_stride_k=b.stride_rows, b_stride_l=b.batch_stride,
        c=c.ptr, c_stride_m=c.stride_rows, c_stride_n=c.stride_cols, c_stride_l=c.batch_stride,
        d=d.ptr, d_stride_m=d.stride_rows, d_stride_n=d.stride_cols, d_stride_l=d.batch_stride,
        alpha=checked.alpha, beta=checked.beta, device_id=checked.device.index,
        sm_count=sm_count, raster_order=config.raster_order.abi_value, swizzle=config.swizzle,
        splits=config.splits)
    args.bias = checked.bias.data_ptr() if checked.bias is not None else None
    return args


__all__ = ["gemm", "plan", "check", "launcher", "prepare", "as_config", "bias_mode"]
