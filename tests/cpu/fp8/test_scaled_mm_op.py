"""cutlass_ops.scaled_mm without a GPU: the recipe read from the scales' shapes as
torch._scaled_mm reads it, every refusal naming its rule, the dequantized reference (checked
against torch._scaled_mm where torch runs it on a CPU), and the custom op under torch.compile."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.fp8 import scaled_mm_op
from cutlass_ops.gemms.fp8 import fp8_operands
from cutlass_ops.gemms.fp8.fp8_operands import ScaleRecipe
from custom_kernels.core.errors import UnsupportedInputError

E4M3 = torch.float8_e4m3fn


def operands(m=64, n=256, k=256, dtype_a=E4M3, dtype_b=E4M3):
    a = torch.randn(m, k).to(dtype_a)
    b = torch.randn(n, k).to(dtype_b).t()  # (K, N) column-major: the weight's transpose
    return a, b


def scales(recipe, m=64, n=256, k=256):
    if recipe is ScaleRecipe.TENSORWISE:
        return torch.rand(()) + 0.5, torch.rand(()) + 0.5
    if recipe is ScaleRecipe.ROWWISE:
        return torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5
    sa = (torch.rand(m, k // 128) + 0.5).t().contiguous().t()  # column-major (M, K/128)
    sb = (torch.rand(n // 128, k // 128) + 0.5).t()  # a weight's row-major scales, transposed
    return sa, sb


@pytest.mark.parametrize("recipe", list(ScaleRecipe))
def test_the_recipe_is_read_from_the_scales_shapes(recipe):
    a, b = operands()
    sa, sb = scales(recipe)
    assert scaled_mm_op.recipe(a, b, sa, sb) is recipe
    checked = fp8_operands.check_scaled(a, b, sa, sb)
    assert (checked.recipe, checked.m, checked.n, checked.k) == (recipe, 64, 256, 256)
    assert checked.out_dtype == torch.bfloat16 and not checked.has_bias


@pytest.mark.parametrize("recipe", [ScaleRecipe.TENSORWISE, ScaleRecipe.ROWWISE])
def test_the_reference_is_torch_scaled_mm_and_the_cpu_route_computes_it(recipe):
    a, b = operands()
    sa, sb = scales(recipe)
    bias = torch.randn(256).to(torch.bfloat16)
    ours = cutlass_ops.scaled_mm(a, b, sa, sb, bias=bias)
    expected = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    torch.testing.assert_close(ours.float(), expected.float(), rtol=2e-2, atol=2e-2)
    out32 = cutlass_ops.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert out32.dtype == torch.float32 and out32.shape == (64, 256)


def test_the_blockwise_reference_scales_each_block():
    a, b = operands()
    sa, sb = scales(ScaleRecipe.BLOCKWISE)
    got = fp8_operands.reference(a, b, sa, sb, out_dtype=torch.float32)
    expected = torch.empty(64, 256)
    for i in range(64):
        for j in range(256):
            expected[i, j] = sum(
                (a[i, kb * 128:(kb + 1) * 128].float() * sa[i, kb]) @
                (b[kb * 128:(kb + 1) * 128, j].float() * sb[kb, j // 128]) for kb in range(2))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)


def refused(match, *args, **kwargs):
    with pytest.raises(UnsupportedInputError, match=match):
        cutlass_ops.scaled_mm(*args, **kwargs)


def test_bad_operands_are_refused_by_name():
    a, b = operands()
    sa, sb = scales(ScaleRecipe.TENSORWISE)
    refused("a has dtype torch.bfloat16", a.to(torch.bfloat16), b, sa, sb)
    refused("both float8_e5m2", *operands(dtype_a=torch.float8_e5m2,
                                          dtype_b=torch.float8_e5m2), sa, sb)
    refused("b must be column-major", a, b.contiguous(), sa, sb)
    refused("a must be row-major", a.t().contiguous().t(), b, sa, sb)
    refused("not \\(M, K\\) and \\(K, N\\)", a, b[:128], sa, sb)
    refused("multiples of 16", *operands(k=200), sa, sb)
    refused("16-byte aligned", a.view(-1)[1:].as_strided((64, 240), (256, 1)),
            b[:240], sa, sb)
    refused("leading stride 250", a.view(-1).as_strided((64, 240), (250, 1)), b[:240], sa, sb)
    refused("out_dtype torch.float16", a, b, sa, sb, out_dtype=torch.float16)
    refused("b is a list", a, [1, 2], sa, sb)


def test_bad_scales_and_bias_are_refused_by_name():
    a, b = operands()
    sa, sb = scales(ScaleRecipe.ROWWISE)
    refused("name no scaling recipe", a, b, sa[:32], sb)
    refused("scale_a has dtype torch.bfloat16", a, b, sa.bfloat16(), sb)
    bsa, bsb = scales(ScaleRecipe.BLOCKWISE)
    refused("must be column-major \\(stride \\(1, 64\\)\\)", a, b, bsa.contiguous(), bsb)
    refused("transpose of a row-major", a, b, bsa, bsb.contiguous())
    a300, b300 = operands(n=320, k=256)
    refused("K and N multiples of 128", a300, b300, bsa, scales(ScaleRecipe.BLOCKWISE, n=384)[1][:, :3])
    refused("bias must be \\(256,\\)", a, b, sa, sb, bias=torch.randn(256))
    refused("bias must be \\(256,\\)", a, b, sa, sb, bias=torch.randn(128).bfloat16())


def test_operands_on_two_devices_are_refused():
    a, b = operands()
    sa, sb = scales(ScaleRecipe.TENSORWISE)
    with pytest.raises(UnsupportedInputError, match="different devices"):
        cutlass_ops.scaled_mm(a, b, sa.to("meta"), sb)


def test_the_custom_op_has_a_fake_that_torch_compile_traces():
    from cutlass_ops.fp8.scaled_mm_op import scaled_mm_op

    a, b = operands()
    sa, sb = scales(ScaleRecipe.TENSORWISE)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = scaled_mm_op(mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(sa),
                            mode.from_tensor(sb), None, torch.float32, False)
    assert fake.shape == (64, 256) and fake.dtype == torch.float32
    torch.library.opcheck(scaled_mm_op, (a, b, sa, sb, None, torch.bfloat16, False),
                          test_utils=("test_faketensor",))


def test_scaled_mm_compiles_without_a_graph_break():
    a, b = operands()
    sa, sb = scales(ScaleRecipe.ROWWISE)
    compiled = torch.compile(cutlass_ops.scaled_mm, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(a, b, sa, sb), cutlass_ops.scaled_mm(a, b, sa, sb))
