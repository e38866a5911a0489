"""``gemm``: one CUTLASS GEMM with an explicit config on torch tensors.

D = activation(alpha * (A @ B) + bias) + beta * C, for 2-D operands or batches of them (3-D, batch
first); bias and activation are fused into the kernel's epilogue (a CUTLASS epilogue visitor
tree), so a fused problem has kernels of its own (``GemmOperands.epilogue``). The kernel
for (operands, config) is emitted, built and loaded on first use and memoized; it runs on torch's
current stream on the tensors' own device, with its workspace from torch's caching allocator.
"""

from __future__ import annotations

from typing import Any, Callable

from cutlass_ops.gemms import loader as kernels, inputs as ops, runtime, space
from cutlass_ops.gemms.config import Activation, BiasMode, Epilogue, GemmConfig, Layout
from custom_kernels.core.device import device_facts
from custom_kernels.core.errors import UnsupportedInputError


def as_config(config: GemmConfig | str | dict[str, Any]) -> GemmConfig:
    if isinstance(config, GemmConfig):
        return config
    if isinstance(config, str):
        return GemmConfig.from_name(config)
    if isinstance(config, dict):
        return GemmConfig.from_dict(config)
    raise TypeError(f"config must be a GemmConfig, its name or its dict, not {type(config)}")


def _check_devices(tensors: dict[str, Any]):
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise UnsupportedInputError(f"tensors are on different devices ({where})")
    if not next(iter(present.values())).is_cuda:
        raise UnsupportedInputError(f"the tensors are on {next(iter(devices))}; cutlass_ops.gemm "
                                    "needs CUDA tensors (move them with .cuda())")
    return next(iter(devices))


def _shapes(a, b) -> tuple[int, int, int, int, tuple[int, ...]]:
    """(M, N, K, batch, output shape), refusing what we do not broadcast."""
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise UnsupportedInputError(f"A and B must be 2-D or 3-D (batch first), got {a.dim()}-D "
                                    f"and {b.dim()}-D")
    if a.shape[-1] != b.shape[-2]:
        raise UnsupportedInputError(f"shapes do not multiply: A {tuple(a.shape)} @ B "
                                    f"{tuple(b.shape)} (A's last dimension must equal B's "
                                    "second to last)")
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return m, n, k, 1, (m, n)
    if a.dim() == 3 and b.dim() == 3:
        if a.shape[0] != b.shape[0]:
            raise UnsupportedInputError(f"batch sizes differ: A has {a.shape[0]}, B {b.shape[0]}")
        return m, n, k, a.shape[0], (a.shape[0], m, n)
    raise UnsupportedInputError("A and B must both be 2-D or both 3-D; for a shared weight, "
                                "reshape A to 2-D (rows of all batches) first")


def _output(shape, dtype, layout: Layout, device):
    import torch

    if layout is Layout.ROW:
        return torch.empty(shape, dtype=dtype, device=device)
    transposed = (*shape[:-2], shape[-1], shape[-2])
    return torch.empty(transposed, dtype=dtype, device=device).transpose(-1, -2)


def _check_like(t, name: str, shape, dtype) -> None:
    if tuple(t.shape) != tuple(shape):
        raise UnsupportedInputError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} "
                                    "(no broadcasting)")
    if t.dtype != dtype:
        raise UnsupportedInputError(f"{name} has dtype {t.dtype}, expected {dtype}")


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


def bias_mode(bias, m: int, n: int) -> BiasMode:
    """Which extent ``bias`` runs along, from its shape as torch would broadcast it."""
    if bias is None:
        return BiasMode.NONE
    shape = tuple(bias.shape)
    if shape in ((n,), (1, n)):
        return BiasMode.N
    if shape == (m, 1):
        return BiasMode.M
    raise UnsupportedInputError(f"bias has shape {shape}; a fused bias is ({n},) or (1, {n}) "
                                f"(one per output column) or ({m}, 1) (one per row)")


def _check_bias(bias, dtype, device) -> None:
    if bias.device != device:
        raise UnsupportedInputError(f"bias is on {bias.device}, the operands on {device}")
    if bias.dtype != dtype:
        raise UnsupportedInputError(f"bias has dtype {bias.dtype}; the fused epilogue reads it "
                                    f"in the output's dtype {dtype} (convert it)")
    if not bias.is_contiguous() or bias.data_ptr() % 16:
        raise UnsupportedInputError("bias must be contiguous and 16-byte aligned")


def plan(a, b, c=None, *, alpha: float = 1.0, beta: float = 0.0, bias=None,
         activation: Activation | str = Activation.IDENTITY,
         config: GemmConfig | str | dict, out=None, out_dtype=None) -> Callable[[], Any]:
    """Checks everything, loads the kernel and returns ``launch()``, which runs the GEMM on the
    current stream and returns ``out``. Repeated launches redo no Python-side work: for
    benchmarks and the tuner, which time the kernel and its C++ launcher alone."""
    import torch

    config = as_config(config)
    device = _check_devices({"A": a, "B": b, "C": c, "out": out})
    a_dtype, b_dtype = ops.dtype_of(a, "A"), ops.dtype_of(b, "B")
    if a_dtype is not b_dtype:
        raise UnsupportedInputError(f"A is {a.dtype} but B is {b.dtype}; mixed operand types are "
                                    "not supported, convert one of them")
    m, n, k, batch, out_shape = _shapes(a, b)
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else c.dtype if c is not None else a.dtype
    ops.element_type(out_dtype, "the output")
    if beta != 0 and c is None:
        raise UnsupportedInputError("beta is non-zero but no C was given")
    c = c if beta != 0 else None
    if c is not None:
        _check_like(c, "C", out_shape, out_dtype)
    if out is not None:
        _check_like(out, "out", out_shape, out_dtype)
    else:
        layout = ops.matrix_view(c, "C", batch).layout if c is not None and c.numel() else \
            Layout.ROW
        out = _output(out_shape, out_dtype, layout, device)

    activation = Activation(activation)
    mode = bias_mode(bias, m, n)
    if bias is not None:
        _check_bias(bias, out_dtype, device)
    if out.numel() == 0:
        return lambda: out
    if k == 0:  # an empty sum: the epilogue of a zero accumulator
        def empty_sum():
            from cutlass_ops.gemms import epilogues

            zero = torch.zeros(out_shape, dtype=torch.float32, device=device)
            return out.copy_(epilogues.apply(zero, bias=bias, activation=activation, c=c,
                                             beta=beta))

        return empty_sum

    views = {"A": ops.matrix_view(a, "A", batch), "B": ops.matrix_view(b, "B", batch),
             "out": ops.matrix_view(out, "out", batch)}
    if c is not None:
        views["C"] = ops.matrix_view(c, "C", batch)
        if views["C"].layout is not views["out"].layout:
            raise UnsupportedInputError("C and out must share one layout (both row-major or both "
                                        "column-major)")
    for name, view in views.items():
        ops.check_tma_alignment(view, name)
    for name, t in (("A", a), ("B", b)):
        if _overlap(out, t):
            raise UnsupportedInputError(f"out overlaps {name} in memory; the result would be "
                                        "wrong: write to a separate tensor")

    # The residual needs its own kernels only beside a bias or an activation: every plain kernel
    # already computes alpha * AB + beta * C.
    fused = mode is not BiasMode.NONE or activation is not Activation.IDENTITY
    epilogue = Epilogue(activation, mode, residual=fused and c is not None)
    problem_operands = ops.gemm_operands(views["A"], views["B"], views["out"]).with_epilogue(
        epilogue)
    sm_count, cc, gpu = device_facts(device.index)
    if config.arch.cc != cc:
        raise UnsupportedInputError(f"config {config.name} is for {config.arch.value}, but {gpu} "
                                    f"is compute capability {cc / 10:.1f}")
    space.check(problem_operands, config)
    kernel = kernels.kernel_for(problem_operands, config)
    args = _launch_args(views, alpha, beta if c is not None else 0.0, config, device.index,
                        sm_count, m, n, k, batch)
    args.bias = bias.data_ptr() if bias is not None else None
    workspace_bytes = kernel.workspace_bytes(args)
    workspace = (torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
                 if workspace_bytes else None)
    workspace_ptr = workspace.data_ptr() if workspace is not None else 0

    def launch():
        stream = torch.cuda.current_stream(device).cuda_stream
        kernel.run(args, workspace_ptr, workspace_bytes, stream)
        return out

    launch.workspace = workspace  # keeps the workspace alive as long as the launcher
    launch.bias = bias
    # For callers that relaunch the same checked problem on other tensors (dispatch's fast path).
    launch.kernel, launch.args, launch.workspace_bytes = kernel, args, workspace_bytes
    return launch


def _span(t) -> tuple[int, int]:
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlap(x, y) -> bool:
    (x0, x1), (y0, y1) = _span(x), _span(y)
    return x0 < y1 and y0 < x1


def _launch_args(views, alpha, beta, config: GemmConfig, device_index: int, sm_count: int,
                 m: int, n: int, k: int, batch: int) -> runtime.GemmArgs:
    a, b, d = views["A"], views["B"], views["out"]
    c = views.get("C", d)  # no C: point at D; with beta = 0 CUTLASS does not read it
    return runtime.GemmArgs(
        m=m, n=n, k=k, l=batch,
        a=a.ptr, a_stride_m=a.stride_rows, a_stride_k=a.stride_cols, a_stride_l=a.batch_stride,
        # CUTLASS sees B as N x K: its N stride is our column stride, its K stride our row stride.
        b=b.ptr, b_stride_n=b.stride_cols, b_stride_k=b.stride_rows, b_stride_l=b.batch_stride,
        c=c.ptr, c_stride_m=c.stride_rows, c_stride_n=c.stride_cols, c_stride_l=c.batch_stride,
        d=d.ptr, d_stride_m=d.stride_rows, d_stride_n=d.stride_cols, d_stride_l=d.batch_stride,
        alpha=float(alpha), beta=float(beta), device_id=device_index, sm_count=sm_count,
        raster_order=config.raster_order.abi_value, swizzle=config.swizzle, splits=config.splits)


__all__ = ["gemm", "plan", "as_config", "bias_mode"]
