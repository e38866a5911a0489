"""cutlass_ops.scaled_mm on the GPU: each recipe against the dequantized float32 product, with a
bias and a float32 output, under torch.compile(fullgraph=True), and replayed in a CUDA graph."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.gemms.fp8 import fp8_operands
from cutlass_ops.gemms.fp8.fp8_operands import ScaleRecipe
from custom_kernels.core.tolerances import relative_error

pytestmark = pytest.mark.gpu
E4M3 = torch.float8_e4m3fn


def quantized(recipe, m=1000, n=1536, k=2048):
    """Random a (M, K) and w (N, K) quantized per the recipe: (aq, w^T as b, scale_a, scale_b)."""
    a, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    if recipe is ScaleRecipe.TENSORWISE:
        sa, sw = a.abs().amax() / 448, w.abs().amax() / 448
        return (a / sa).to(E4M3), (w / sw).to(E4M3).t(), sa, sw
    if recipe is ScaleRecipe.ROWWISE:
        sa, sw = a.abs().amax(1, keepdim=True) / 448, w.abs().amax(1, keepdim=True) / 448
        return (a / sa).to(E4M3), (w / sw).to(E4M3).t(), sa, sw.t().contiguous()
    sa = a.view(m, k // 128, 128).abs().amax(-1) / 448
    sw = w.view(n // 128, 128, k // 128, 128).abs().amax((1, 3)) / 448
    aq = (a.view(m, k // 128, 128) / sa[..., None]).to(E4M3).view(m, k)
    wq = (w.view(n // 128, 128, k // 128, 128) / sw[:, None, :, None]).to(E4M3).view(n, k)
    return aq, wq.t(), sa.t().contiguous().t(), sw.t()


@pytest.mark.parametrize("recipe", list(ScaleRecipe))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_each_recipe_matches_the_dequantized_product(recipe, out_dtype):
    aq, b, sa, sb = quantized(recipe)
    bias = torch.randn(b.shape[1], device="cuda").to(out_dtype)
    got = cutlass_ops.scaled_mm(aq, b, sa, sb, bias=bias, out_dtype=out_dtype)
    expected = fp8_operands.reference(aq, b, sa, sb, bias, torch.float32)
    assert got.dtype == out_dtype and relative_error(got, expected) < 1e-2


def test_compiled_and_graph_replayed():
    aq, b, sa, sb = quantized(ScaleRecipe.ROWWISE, 256, 512, 256)
    compiled = torch.compile(lambda *t: cutlass_ops.scaled_mm(*t), fullgraph=True)
    expected = fp8_operands.reference(aq, b, sa, sb, out_dtype=torch.float32)
    assert relative_error(compiled(aq, b, sa, sb), expected) < 1e-2
    cutlass_ops.scaled_mm(aq, b, sa, sb)  # resolved before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cutlass_ops.scaled_mm(aq, b, sa, sb)
    sa.mul_(2)  # scales are read on the device at each replay
    graph.replay()
    assert relative_error(out, 2 * expected) < 1e-2


@pytest.mark.parametrize("k", [128, 256, 384, 640, 1024])
def test_the_torch_route_is_right_for_blockwise_k_cublas_gets_wrong(k):
    """torch._scaled_mm's blockwise GEMM is wrong (silently) unless K % 512 == 0 on torch 2.11;
    the torch route pads K, so its answer is the dequantized product's at every K."""
    from cutlass_ops.fp8.fp8_routes import torch_scaled_mm

    aq, b, sa, sb = quantized(ScaleRecipe.BLOCKWISE, m=200, n=384, k=k)
    bias = torch.randn(384, device="cuda").bfloat16()
    got = torch_scaled_mm(aq, b, sa, sb, bias, torch.bfloat16, False, ScaleRecipe.BLOCKWISE)
    expected = fp8_operands.reference(aq, b, sa, sb, bias, torch.float32)
    assert relative_error(got, expected) < 1e-2
