"""Operand checks on CPU tensors: layouts, leading dimensions, alignment, and gemm's refusals."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.gemms import inputs as ops
from cutlass_ops.gemms.config import GemmConfig, Layout
from custom_kernels.core.errors import UnsupportedInputError


def test_layouts_and_leading_dimensions():
    a = torch.randn(64, 48, dtype=torch.bfloat16)
    view = ops.matrix_view(a, "A", 1)
    assert (view.layout, view.ld, view.stride_rows, view.stride_cols) == (Layout.ROW, 48, 48, 1)
    t = ops.matrix_view(a.t(), "A", 1)
    assert (t.layout, t.ld, t.stride_rows, t.stride_cols) == (Layout.COL, 48, 1, 48)
    padded = ops.matrix_view(torch.randn(64, 56, dtype=torch.bfloat16)[:, :48], "A", 1)
    assert padded.ld == 56
    batched = ops.matrix_view(torch.randn(3, 64, 48, dtype=torch.bfloat16), "A", 3)
    assert batched.batch_stride == 64 * 48
    row = ops.matrix_view(torch.randn(1, 4096, dtype=torch.bfloat16), "x", 1)
    assert (row.layout, row.ld) == (Layout.ROW, 4096)
    column = ops.matrix_view(torch.randn(1, 4096, dtype=torch.bfloat16).t(), "w", 1)
    assert (column.layout, column.ld) == (Layout.COL, 4096)


def test_refusals_name_the_problem():
    with pytest.raises(UnsupportedInputError, match="unit stride"):
        ops.matrix_view(torch.randn(64, 64)[::2, ::2], "A", 1)
    with pytest.raises(UnsupportedInputError, match="broadcast over the batch"):
        ops.matrix_view(torch.randn(64, 64).expand(2, 64, 64), "B", 2)
    with pytest.raises(UnsupportedInputError, match="float64"):
        ops.dtype_of(torch.randn(2, 2, dtype=torch.float64), "A")
    base = torch.randn(64 * 64 + 8, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInputError, match="data pointer"):
        ops.check_tma_alignment(ops.matrix_view(base[1:4097].view(64, 64), "A", 1), "A")
    with pytest.raises(UnsupportedInputError, match="leading dimension is 65"):
        view = ops.matrix_view(torch.randn(64, 65, dtype=torch.bfloat16)[:, :64], "A", 1)
        ops.check_tma_alignment(view, "A")
    with pytest.raises(UnsupportedInputError, match="contiguous dimension has 60"):
        ops.check_tma_alignment(ops.matrix_view(torch.randn(64, 60, dtype=torch.bfloat16),
                                                "A", 1), "A")
    ops.check_tma_alignment(ops.matrix_view(torch.randn(64, 64, dtype=torch.bfloat16), "A", 1),
                            "A")


def test_gemm_refuses_cpu_tensors_before_anything_else():
    a = torch.randn(64, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInputError, match="needs CUDA tensors"):
        cutlass_ops.gemm(a, a, config=GemmConfig())
    with pytest.raises(ValueError, match="not a GemmConfig name"):
        cutlass_ops.gemm(a, a, config="fastest")
