"""From torch tensors to a GEMM problem and launch arguments, with every check a kernel needs.

Pure tensor metadata work: shapes, strides, dtypes, devices and pointers. Each refusal raises
UnsupportedInputError naming the tensor and what to do about it.
"""

from __future__ import annotations

import dataclasses

from cutlass_ops.gemms.config import DType, GemmOperands, Layout
from custom_kernels.core.errors import UnsupportedInputError

TMA_ALIGNMENT_BYTES = 16


def element_type(torch_dtype, name: str) -> DType:
    import torch

    table = {torch.bfloat16: DType.BF16, torch.float16: DType.F16, torch.float32: DType.F32}
    if torch_dtype not in table:
        raise UnsupportedInputError(f"{name} has dtype {torch_dtype}; supported: bfloat16, "
                                    "float16, float32 (run as tf32)")
    return table[torch_dtype]


def dtype_of(tensor, name: str) -> DType:
    return element_type(tensor.dtype, name)


def torch_dtype(dtype: DType):
    import torch

    return {DType.BF16: torch.bfloat16, DType.F16: torch.float16, DType.F32: torch.float32}[dtype]


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


def gemm_operands(a: MatrixView, b: MatrixView, d: MatrixView) -> GemmOperands:
    return GemmOperands(a.dtype, b.dtype, d.dtype, d.dtype, DType.F32, a.layout, b.layout,
                        d.layout, TMA_ALIGNMENT_BYTES // a.dtype.bytes,
                        TMA_ALIGNMENT_BYTES // b.dtype.bytes, TMA_ALIGNMENT_BYTES // d.dtype.bytes)
