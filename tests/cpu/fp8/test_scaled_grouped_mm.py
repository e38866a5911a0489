"""cutlass_ops.scaled_grouped_mm on the CPU (issue 53): both recipes against the definition
written out element by element (float64, row by row), an empty expert, the refusals, the fake
(torch.compile fullgraph) and opcheck. The GPU routes (torch._scaled_grouped_mm, the CUTLASS
blockwise kernel, the dequantized fallback): tests/gpu."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.fp8 import scaled_grouped_mm_op as sgm
from custom_kernels.core.errors import UnsupportedInputError

FP8 = torch.float8_e4m3fn


def _operands(offs, recipe, k=256, n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts, m = len(offs), offs[-1]
    a = (torch.randn(m, k, generator=g) * 2).to(FP8)
    b = (torch.randn(experts, n, k, generator=g) * 2).to(FP8).transpose(1, 2)  # [E, K, N]
    if recipe == "rowwise":
        scale_a = torch.rand(m, generator=g) + 0.5
        scale_b = torch.rand(experts, n, generator=g) + 0.5
    else:
        scale_a = torch.rand(m, k // 128, generator=g) + 0.5
        scale_b = torch.rand(experts, k // 128, n // 128, generator=g) + 0.5
    return a, b, scale_a, scale_b, torch.tensor(offs, dtype=torch.int32)


def _by_definition(a, b, scale_a, scale_b, offs, recipe):
    m, k = a.shape
    n = b.shape[2]
    kb, nb = torch.arange(k) // 128, torch.arange(n) // 128
    out = torch.zeros(m, n, dtype=torch.float64)
    for i in range(m):
        g = int(torch.searchsorted(offs, torch.tensor(i, dtype=offs.dtype), right=True))
        if recipe == "rowwise":
            row = a[i].double() * float(scale_a[i])
            weight = b[g].double() * scale_b[g].double()[None, :]
        else:
            row = a[i].double() * scale_a[i].double()[kb]
            weight = b[g].double() * scale_b[g].double()[kb][:, nb]
        out[i] = row @ weight
    return out


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_both_recipes_are_the_definition_with_an_empty_expert(recipe):
    a, b, scale_a, scale_b, offs = _operands([3, 3, 8], recipe)
    out = cutlass_ops.scaled_grouped_mm(a, b, scale_a, scale_b, offs)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 128)
    expected = _by_definition(a, b, scale_a, scale_b, offs, recipe)
    torch.testing.assert_close(out.double(), expected.to(torch.bfloat16).double(), rtol=1e-2,
                               atol=1e-2)


def test_rowwise_scales_may_carry_torchs_unit_dimensions():
    a, b, scale_a, scale_b, offs = _operands([4, 9], "rowwise")
    plain = cutlass_ops.scaled_grouped_mm(a, b, scale_a, scale_b, offs)
    shaped = cutlass_ops.scaled_grouped_mm(a, b, scale_a[:, None], scale_b[:, None, :], offs)
    assert torch.equal(plain, shaped)


@pytest.mark.parametrize("change, message", [
    ("a_bf16", "float8_e4m3fn"), ("b_2d", "2d-3d form"), ("b_n_major", "K contiguous"),
    ("offs_int64", "int32"), ("offs_short", "int32 of shape"), ("out_fp32", "bfloat16"),
    ("scale_fp16", "float32"), ("scale_shape", "name no recipe"), ("block_k", "multiples of 128")])
def test_bad_input_is_refused_by_name(change, message):
    a, b, scale_a, scale_b, offs = _operands([4, 9], "blockwise")
    out_dtype = torch.bfloat16
    if change == "a_bf16":
        a = a.to(torch.bfloat16)
    elif change == "b_2d":
        b = b[0]
    elif change == "b_n_major":
        b = b.contiguous()
    elif change == "offs_int64":
        offs = offs.long()
    elif change == "offs_short":
        offs = offs[:1]
    elif change == "out_fp32":
        out_dtype = torch.float32
    elif change == "scale_fp16":
        scale_a = scale_a.half()
    elif change == "scale_shape":
        scale_b = scale_b[:, :, :0]
    elif change == "block_k":
        a, b = a[:, :200], b[:, :200]
        scale_a, scale_b = scale_a[:, :1], scale_b[:, :1]
    with pytest.raises(UnsupportedInputError, match=message):
        cutlass_ops.scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=out_dtype)


def test_a_non_tensor_is_refused_by_name():
    a, b, scale_a, scale_b, offs = _operands([4, 9], "rowwise")
    with pytest.raises(UnsupportedInputError, match="offs is a list"):
        cutlass_ops.scaled_grouped_mm(a, b, scale_a, scale_b, [4, 9])


def test_compiles_fullgraph_and_passes_opcheck():
    a, b, scale_a, scale_b, offs = _operands([5, 9], "blockwise")
    eager = cutlass_ops.scaled_grouped_mm(a, b, scale_a, scale_b, offs)
    compiled = torch.compile(lambda *t: cutlass_ops.scaled_grouped_mm(*t), fullgraph=True,
                             backend="aot_eager")
    assert torch.equal(compiled(a, b, scale_a, scale_b, offs), eager)
    # (test_schema compares FP8 inputs arithmetically, which torch does not implement)
    torch.library.opcheck(sgm.scaled_grouped_mm_op,
                          (a, b, scale_a, scale_b, offs, torch.bfloat16),
                          test_utils=("test_faketensor",))
