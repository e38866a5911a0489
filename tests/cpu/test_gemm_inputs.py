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


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def test_check_gemm_refusals_name_the_problem():
    """The checks plan() and dispatch share are pure metadata work: CPU tensors test them."""
    a, b = bf16(128, 128), bf16(128, 128).t()
    cases = [
        ((a, b.half()), {}, "mixed operand types"),
        ((a.double(), b.double()), {}, "supported: bfloat16"),
        ((a, b[:64]), {}, "shapes do not multiply"),
        ((a[None].expand(2, -1, -1), b), {}, "must both be 2-D"),
        ((a, b), {"beta": 1.0}, "no C was given"),
        ((a, b, bf16(128, 64)), {"beta": 1.0}, "no broadcasting"),
        ((a, b), {"out": a}, "overlaps A"),
        ((a, b), {"out": bf16(128, 128), "out_dtype": torch.float32}, "expected torch.float32"),
        ((a, b), {"bias": bf16(100)}, "bias has shape"),
        ((a, b), {"bias": torch.randn(128)}, "bias has dtype"),
        ((a, b), {"bias": bf16(128, 2)[:, 0].reshape(128, 1)}, "contiguous and 16-byte"),
        ((a, b, bf16(128, 128).t()), {"beta": 1.0, "out": bf16(128, 128)}, "share one layout"),
        ((a, b), {"activation": "tanh"}, "activation 'tanh'"),
    ]
    for args, kwargs, expected in cases:
        with pytest.raises(UnsupportedInputError, match=expected):
            ops.check_gemm(*args, **kwargs)


def test_checked_problem_and_fresh_output():
    a, b, c, bias = bf16(64, 32), bf16(32, 48), bf16(48, 64).t(), bf16(48)
    checked = ops.check_gemm(a, b, c, beta=1.0, bias=bias, activation="relu")
    assert checked.out is None and checked.out_layout is Layout.COL  # a fresh output takes C's
    assert checked.views["out"].ptr == 0 and checked.views["C"].layout is Layout.COL
    assert checked.problem.operands.epilogue.name == "bias_n-relu-res"
    out = ops.new_output(checked.shape, checked.out_dtype, checked.out_layout, "cpu")
    bound = ops.with_output(checked, out)
    assert bound.views["out"] == ops.matrix_view(out, "out", 1)
    empty = ops.check_gemm(bf16(0, 32), b)
    assert empty.problem is None and empty.views == {} and empty.shape == (0, 48)


@pytest.mark.parametrize("bias", [False, True])
def test_swapped_choice_is_the_problem_of_the_transposed_tensors(bias):
    """Choice.orient reads the checked views transposed: the same problem and views as checking
    D^T = B^T A^T on the transposed tensors (a bias along N runs along M there)."""
    from cutlass_ops.gemms.choice import Choice

    a, b, out, vector = bf16(16, 64), bf16(256, 64).t(), bf16(16, 256), bf16(256)
    bias_kw = {"bias": vector} if bias else {}
    swapped = Choice(GemmConfig(), swap_ab=True).orient(ops.check_gemm(a, b, out=out, **bias_kw))
    bias_kw = {"bias": vector.view(-1, 1)} if bias else {}
    direct = ops.check_gemm(b.t(), a.t(), out=out.t(), **bias_kw)
    assert swapped.problem == direct.problem and swapped.views == direct.views
    assert swapped.out is out
