"""From torch tensors to a checked GEMM problem, with every check a kernel needs, in one place.

``check_gemm`` (``check_product``, then ``check_epilogue``) checks dtypes, shapes, strides, TMA
alignment, overlap, the epilogue's tensors and that every extent and stride fits the launcher's
integer type, and returns a ``CheckedGemm``: the problem and its operands' memory, which
``plan`` builds launch arguments from without checking anything again.
``cutlass_ops.gemm / plan`` and ``cutlass_ops.matmul``'s dispatch both decide from these
functions; the device rule comes before them (``custom_kernels.core.fallback``) and the GPU's
arch beside them (``arch_refusal``). Pure tensor metadata work: nothing is allocated or launched.
Each refusal raises UnsupportedInputError naming the tensor and what to do about it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from typing import Any

from cutlass_ops.gemms.config import (Activation, Arch, BiasMode, DType, Epilogue, GemmOperands,
                                      GemmProblem, Layout)
from custom_kernels.core import int_limits
from custom_kernels.core.elements import element
from custom_kernels.core.errors import UnsupportedInputError

TMA_ALIGNMENT_BYTES = 16
# The C types of the launcher's integers (CutlassOpsGemmArgs in csrc/gemm_launcher.cu;
# runtime.GemmArgs declares its fields with these): M, N, K and the batch are int32, strides int64.
# ctypes would store a value that does not fit modulo 2**bits, so the checks refuse it first.
EXTENT_TYPE = ctypes.c_int32
STRIDE_TYPE = ctypes.c_int64


def element_type(torch_dtype, name: str) -> DType:
    """The GEMM element type of a tensor's dtype (``custom_kernels.core.elements``), where the
    plain GEMMs take it."""
    try:
        found = element(torch_dtype)
    except ValueError:
        found = None
    if found is not None and found.is_fp8:
        raise UnsupportedInputError(f"{name} has dtype {torch_dtype}: FP8 operands need their "
                                    "scales, so they go through cutlass_ops.scaled_mm")
    if found is None or found.name not in {d.value for d in DType}:
        raise UnsupportedInputError(f"{name} has dtype {torch_dtype}; supported: bfloat16, "
                                    "float16, float32 (run as tf32)")
    return DType(found.name)


def dtype_of(tensor, name: str) -> DType:
    return element_type(tensor.dtype, name)


def torch_dtype(dtype: DType):
    return element(dtype).torch_dtype


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """A (batch of) rows x cols matrix in memory: layout, leading dimension and batch stride,
    all in elements, normalized so that strides of extent-1 dimensions take packed values."""

    rows: int
    cols: int
    batch: int
    layout: Layout
    ld: int
    batch_stride: int
    ptr: int
    dtype: DType

    @property
    def stride_rows(self) -> int:
        return self.ld if self.layout is Layout.ROW else 1

    @property
    def stride_cols(self) -> int:
        return 1 if self.layout is Layout.ROW else self.ld

    def transposed(self) -> MatrixView:
        """The same memory read as the transposed matrix."""
        return dataclasses.replace(self, rows=self.cols, cols=self.rows,
                                   layout=transposed_layout(self.layout))


def transposed_layout(layout: Layout) -> Layout:
    return Layout.COL if layout is Layout.ROW else Layout.ROW


def matrix_view(tensor, name: str, batch: int) -> MatrixView:
    """Describes a 2-D tensor, or a 3-D one whose first dimension is the batch."""
    dtype = dtype_of(tensor, name)
    rows, cols = tensor.shape[-2], tensor.shape[-1]
    s_rows, s_cols = tensor.stride(-2), tensor.stride(-1)
    # The stride of an extent-1 dimension is never used: take the layout that the other
    # dimension's unit stride asks for, with a packed leading dimension.
    if rows == 1 and s_cols == 1:
        layout, ld = Layout.ROW, cols
    elif cols == 1 and s_rows == 1:
        layout, ld = Layout.COL, rows
    elif s_cols == 1 and s_rows >= cols:
        layout, ld = Layout.ROW, s_rows
    elif s_rows == 1 and s_cols >= rows:
        layout, ld = Layout.COL, s_cols
    else:
        raise UnsupportedInputError(
            f"{name} (shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}) needs a unit "
            "stride in one of its last two dimensions and no overlap; call .contiguous() on it")
    packed = rows * ld if layout is Layout.ROW else cols * ld
    batch_stride = tensor.stride(0) if tensor.dim() == 3 and batch > 1 else packed
    if batch > 1 and batch_stride == 0:
        raise UnsupportedInputError(f"{name} is broadcast over the batch (batch stride 0); TMA "
                                    "cannot read it: materialize it with .contiguous()")
    return MatrixView(rows, cols, batch, layout, ld, batch_stride, tensor.data_ptr(), dtype)


def check_tma_alignment(view: MatrixView, name: str) -> None:
    """TMA needs 16-byte aligned base pointers and strides; CUTLASS also needs the contiguous
    extent to be a multiple of the vector width."""
    size = view.dtype.bytes
    vector = TMA_ALIGNMENT_BYTES // size
    contiguous_extent = view.cols if view.layout is Layout.ROW else view.rows
    problems = []
    if view.ptr % TMA_ALIGNMENT_BYTES:
        problems.append(f"its data pointer is {view.ptr % TMA_ALIGNMENT_BYTES} bytes past a "
                        "16-byte boundary (a view at an odd offset?)")
    if (view.ld * size) % TMA_ALIGNMENT_BYTES:
        problems.append(f"its leading dimension is {view.ld} elements = {view.ld * size} bytes, "
                        "not a multiple of 16")
    if view.batch > 1 and (view.batch_stride * size) % TMA_ALIGNMENT_BYTES:
        problems.append(f"its batch stride is {view.batch_stride} elements, not a multiple of "
                        "16 bytes")
    if contiguous_extent % vector:
        problems.append(f"its contiguous dimension has {contiguous_extent} elements, not a "
                        f"multiple of {vector}")
    if problems:
        raise UnsupportedInputError(
            f"{name} is misaligned for TMA: " + "; ".join(problems) +
            ". Pad the dimension or copy into a fresh tensor (torch.matmul handles this case)")


def strides(view: MatrixView, name: str) -> dict[str, int]:
    """The strides the launcher receives for a view (the unit one is 1), by name."""
    return {f"{name}'s leading dimension": view.ld, f"{name}'s batch stride": view.batch_stride}


def check_launcher_integers(values: dict[str, int], c_type) -> None:
    """Refuses values that the launcher's integer fields of ``c_type`` cannot hold, naming the
    value and the limit (ctypes would keep only their low bits: another problem, silently)."""
    why = int_limits.misfit(values, c_type, "the CUTLASS launcher's")
    if why is not None:
        raise UnsupportedInputError(f"{why}; split the problem, or use torch.matmul "
                                    "(cutlass_ops.matmul runs it there)")


def gemm_operands(a: MatrixView, b: MatrixView, d: MatrixView) -> GemmOperands:
    return GemmOperands(a.dtype, b.dtype, d.dtype, d.dtype, DType.F32, a.layout, b.layout,
                        d.layout, TMA_ALIGNMENT_BYTES // a.dtype.bytes,
                        TMA_ALIGNMENT_BYTES // b.dtype.bytes, TMA_ALIGNMENT_BYTES // d.dtype.bytes)


# ---- the checked problem ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CheckedGemm:
    """One GEMM whose inputs passed every check: what launch arguments are built from, as it is.

    ``problem`` is None for an empty product (M, N, K or the batch is 0: nothing for a kernel
    to do), and ``views`` then is empty; otherwise ``views`` holds "A", "B", "out" and, with a
    residual, "C". ``out`` None stands for a fresh output that the caller allocates
    (``new_output`` in ``out_layout``): ``views["out"]`` describes it at address 0 until
    ``with_output`` binds it. ``beta`` is 0 without C."""

    problem: GemmProblem | None
    views: dict[str, MatrixView]
    shape: tuple[int, ...]  # the output tensor's
    out_dtype: Any
    device: Any
    out: Any = None
    out_layout: Layout = Layout.ROW
    c: Any = None
    bias: Any = None
    alpha: float = 1.0
    beta: float = 0.0
    activation: Activation = Activation.IDENTITY


def check_gemm(a, b, c=None, *, alpha: float = 1.0, beta: float = 0.0, bias=None,
               activation: Activation | str = Activation.IDENTITY, out=None,
               out_dtype=None) -> CheckedGemm:
    """Every check of D = activation(alpha * (a @ b) + bias) + beta * c (see
    ``cutlass_ops.gemm``). The output type is ``out_dtype``, else out's, else c's, else a's; a
    fresh output (``out`` None) is laid out as C, else row-major."""
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else c.dtype if c is not None else a.dtype
    out_layout = Layout.ROW
    if out is None and c is not None and beta != 0 and c.numel():
        out_layout = matrix_view(c, "C", 1).layout
    product = check_product(a, b, out=out, out_dtype=out_dtype, out_layout=out_layout)
    return check_epilogue(product, c=c, alpha=alpha, beta=beta, bias=bias,
                          activation=activation)


def check_product(a, b, *, out=None, out_dtype=None,
                  out_layout: Layout = Layout.ROW) -> CheckedGemm:
    """The checks of a @ b into ``out`` (or a fresh output in ``out_layout``): dtypes, shapes,
    strides, TMA alignment, and no overlap of out with A or B. The caller has applied the device
    rule (``custom_kernels.core.fallback``)."""
    a_type, b_type = dtype_of(a, "A"), dtype_of(b, "B")
    if a_type is not b_type:
        raise UnsupportedInputError(f"A is {a.dtype} but B is {b.dtype}; mixed operand types are "
                                    "not supported, convert one of them")
    m, n, k, batch, shape = _shapes(a, b)
    out_dtype = out_dtype or (out.dtype if out is not None else a.dtype)
    element_type(out_dtype, "the output")
    if out is not None:
        _check_like(out, "out", shape, out_dtype)
    checked = CheckedGemm(None, {}, shape, out_dtype, a.device, out, out_layout)
    if k == 0 or math.prod(shape) == 0:
        return checked
    check_launcher_integers({"M": m, "N": n, "K": k, "the batch": batch}, EXTENT_TYPE)
    described = out if out is not None else new_output(shape, out_dtype, out_layout, "meta")
    views = {"A": matrix_view(a, "A", batch), "B": matrix_view(b, "B", batch),
             "out": matrix_view(described, "out", batch)}
    for name, view in views.items():
        check_tma_alignment(view, name)
        check_launcher_integers(strides(view, name), STRIDE_TYPE)
    for name, t in (("A", a), ("B", b)):
        if out is not None and _overlap(out, t):
            raise UnsupportedInputError(f"out overlaps {name} in memory; the result would be "
                                        "wrong: write to a separate tensor")
    problem = GemmProblem(gemm_operands(views["A"], views["B"], views["out"]), m, n, k, batch)
    return dataclasses.replace(checked, problem=problem, views=views)


def check_epilogue(product: CheckedGemm, *, c=None, alpha: float = 1.0, beta: float = 0.0,
                   bias=None, activation: Activation | str = Activation.IDENTITY) -> CheckedGemm:
    """The checks of the epilogue's inputs on a checked product: C (the residual, read when
    beta is not 0), the bias and the activation. The residual needs kernels of its own only
    beside a bias or an activation: every plain kernel computes alpha * AB + beta * C."""
    import torch

    for name, t in (("C", c), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise UnsupportedInputError(f"{name} is a {type(t).__name__}, not a tensor")
    if beta != 0 and c is None:
        raise UnsupportedInputError("beta is non-zero but no C was given")
    c = c if beta != 0 else None
    if c is not None:
        _check_like(c, "C", product.shape, product.out_dtype)
    activation = _activation(activation)
    mode = bias_mode(bias, *product.shape[-2:])
    if bias is not None:
        _check_bias(bias, product.out_dtype)
    checked = dataclasses.replace(product, c=c, bias=bias, alpha=float(alpha),
                                  beta=float(beta) if c is not None else 0.0,
                                  activation=activation)
    if product.problem is None:
        return checked
    views = dict(product.views)
    if c is not None:
        views["C"] = matrix_view(c, "C", product.problem.batch)
        if views["C"].layout is not views["out"].layout:
            raise UnsupportedInputError("C and out must share one layout (both row-major or both "
                                        "column-major)")
        check_tma_alignment(views["C"], "C")
        check_launcher_integers(strides(views["C"], "C"), STRIDE_TYPE)
    fused = mode is not BiasMode.NONE or activation is not Activation.IDENTITY
    epilogue = Epilogue(activation, mode, residual=fused and c is not None)
    problem = dataclasses.replace(
        product.problem, operands=product.problem.operands.with_epilogue(epilogue))
    return dataclasses.replace(checked, problem=problem, views=views)


def arch_refusal(arch: Arch, device) -> str | None:
    """Why kernels built for ``arch`` cannot run on the CUDA ``device`` ("<GPU> is compute
    capability 8.0"), or None."""
    from custom_kernels.core.device import device_facts

    _, cc, gpu = device_facts(device.index)
    return None if cc == arch.cc else f"{gpu} is compute capability {cc / 10:.1f}"


def new_output(shape, dtype, layout: Layout, device):
    """An uninitialized output of ``shape`` in ``layout`` (its last two dimensions)."""
    import torch

    if layout is Layout.ROW:
        return torch.empty(shape, dtype=dtype, device=device)
    transposed = (*shape[:-2], shape[-1], shape[-2])
    return torch.empty(transposed, dtype=dtype, device=device).transpose(-1, -2)


def with_output(checked: CheckedGemm, out) -> CheckedGemm:
    """``checked`` writing into ``out``, a ``new_output`` of its shape, dtype and layout."""
    views = dict(checked.views)
    if "out" in views:
        views["out"] = dataclasses.replace(views["out"], ptr=out.data_ptr())
    return dataclasses.replace(checked, out=out, views=views)


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


def _activation(activation: Activation | str) -> Activation:
    try:
        return Activation(activation)
    except ValueError:
        raise UnsupportedInputError(
            f"activation {activation!r}: the epilogue fuses "
            f"{', '.join(a.value for a in Activation)}") from None


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


def _check_like(t, name: str, shape, dtype) -> None:
    if tuple(t.shape) != tuple(shape):
        raise UnsupportedInputError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} "
                                    "(no broadcasting)")
    if t.dtype != dtype:
        raise UnsupportedInputError(f"{name} has dtype {t.dtype}, expected {dtype}")


def _check_bias(bias, dtype) -> None:
    if bias.dtype != dtype:
        raise UnsupportedInputError(f"bias has dtype {bias.dtype}; the fused epilogue reads it "
                                    f"in the output's dtype {dtype} (convert it)")
    if not bias.is_contiguous() or bias.data_ptr() % 16:
        raise UnsupportedInputError("bias must be contiguous and 16-byte aligned")


def _span(t) -> tuple[int, int]:
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlap(x, y) -> bool:
    (x0, x1), (y0, y1) = _span(x), _span(y)
    return x0 < y1 and y0 < x1
