"""Our CUTLASS FP8 kernels behind cutlass_ops.scaled_mm: one kernel per recipe against the
dequantized float32 product (scales that differ row by row and block by block, a bias, a float32
output, promoted and fast accumulation), dispatch to a built kernel, CUDA graphs and
torch.compile on that route, and the layouts our kernels refuse going to torch._scaled_mm."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.fp8 import fp8_plan, fp8_routes
from cutlass_ops.gemms import dispatch
from cutlass_ops.gemms.config import GemmConfig
from cutlass_ops.gemms.fp8 import fp8_operands
from cutlass_ops.gemms.fp8.fp8_operands import ScaleRecipe
from custom_kernels.core.tolerances import relative_error
from tuning.fp8_session import quantized_inputs

pytestmark = pytest.mark.gpu
E4M3 = (torch.float8_e4m3fn, torch.float8_e4m3fn)
COOPERATIVE = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 128))
# (recipe, bias, out dtype, fast accumulation): one built kernel each (tests/gpu/prebuild.py).
KERNELS = [(ScaleRecipe.TENSORWISE, True, torch.bfloat16, True),
           (ScaleRecipe.ROWWISE, False, torch.bfloat16, True),
           (ScaleRecipe.ROWWISE, True, torch.float32, False),
           (ScaleRecipe.BLOCKWISE, False, torch.bfloat16, False)]


def work():
    """(operands, config) of every kernel here, for prebuild."""
    return [(fp8_plan.scaled_operands(r, out_dtype=out, bias=bias, fast_accum=fast),
             COOPERATIVE) for r, bias, out, fast in KERNELS]


def inputs(recipe, m=1000, n=1536, k=2048, seed=0):
    return quantized_inputs(recipe, m, n, k, E4M3, "cuda", seed=seed)


@pytest.mark.parametrize("recipe,bias,out_dtype,fast", KERNELS)
def test_each_recipe_kernel_matches_the_dequantized_product(recipe, bias, out_dtype, fast):
    a, b, sa, sb = inputs(recipe)
    bias_t = torch.randn(b.shape[1], device="cuda").to(out_dtype) if bias else None
    checked = fp8_operands.check_scaled(a, b, sa, sb, bias=bias_t, out_dtype=out_dtype)
    launch = fp8_plan.plan(checked, COOPERATIVE, a, b, sa, sb, bias_t, fast_accum=fast)
    got = launch().clone()  # launch() writes one output tensor: keep this result
    expected = fp8_operands.reference(a, b, sa, sb, bias_t, torch.float32, recipe)
    assert got.dtype == out_dtype and relative_error(got, expected) < 1e-2
    # Each row reads its own scales: with row 0's made 4 times larger, row 0 alone changes.
    if recipe is not ScaleRecipe.TENSORWISE:
        sa[0] *= 4
        again = launch()
        changed = fp8_operands.reference(a, b, sa, sb, bias_t, torch.float32, recipe)
        assert relative_error(again[0], changed[0]) < 1e-2
        assert relative_error(again[0], expected[0]) > 0.1
        assert relative_error(again[1:], expected[1:]) < 1e-2
        sa[0] /= 4
    torch_out = fp8_routes.torch_scaled_mm(a, b, sa, sb, bias_t, out_dtype, fast, recipe)
    assert relative_error(got, torch_out.float()) < 1e-2


@pytest.mark.parametrize("recipe", [ScaleRecipe.TENSORWISE, ScaleRecipe.BLOCKWISE])
def test_dispatch_runs_a_built_kernel_in_graphs_and_under_compile(recipe, monkeypatch):
    # untuned shapes run torch._scaled_mm by default; the built-kernel route is what this tests,
    # so no tuned entry either (a tuned neighbour that preferred torch would decide it)
    monkeypatch.setattr(fp8_routes, "UNTUNED_BUILT_KERNELS", True)
    monkeypatch.setattr(dispatch, "_entries", lambda scope: {})
    fast = recipe is ScaleRecipe.TENSORWISE
    bias = recipe is ScaleRecipe.TENSORWISE
    a, b, sa, sb = inputs(recipe, 512, 1024, 1024, seed=1)
    bias_t = torch.randn(1024, device="cuda", dtype=torch.bfloat16) if bias else None
    fp8_routes.reset()
    decision = fp8_routes.explain(a, b, sa, sb, bias=bias_t, use_fast_accum=fast)
    assert decision.choice is not None and decision.source == "heuristic", decision
    expected = fp8_operands.reference(a, b, sa, sb, bias_t, torch.float32, recipe)
    out = cutlass_ops.scaled_mm(a, b, sa, sb, bias=bias_t, use_fast_accum=fast)
    assert relative_error(out, expected) < 1e-2
    compiled = torch.compile(lambda *t: cutlass_ops.scaled_mm(*t, bias=bias_t,
                                                               use_fast_accum=fast),
                             fullgraph=True)
    assert relative_error(compiled(a, b, sa, sb), expected) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cutlass_ops.scaled_mm(a, b, sa, sb, bias=bias_t, use_fast_accum=fast)
    sa.mul_(2)  # the kernel reads the scales on the device at each replay
    graph.replay()
    doubled = fp8_operands.reference(a, b, sa, sb, bias_t, torch.float32, recipe)
    assert relative_error(captured, doubled) < 1e-2


def test_blockwise_inputs_our_kernels_do_not_read_run_on_copies():
    # M % 4 != 0: neither our kernels nor cuBLAS take it; the rows are padded to 512.
    a, b, sa, sb = inputs(ScaleRecipe.BLOCKWISE, 510, 1024, 1024, seed=2)
    decision = fp8_routes.explain(a, b, sa, sb)
    assert decision.source == "copy" and "not a multiple of 4" in decision.reason
    expected = fp8_operands.reference(a, b, sa, sb, out_dtype=torch.float32)
    got = cutlass_ops.scaled_mm(a, b, sa, sb)
    assert got.shape == (510, 1024) and relative_error(got, expected) < 1e-2
    a, b, sa, sb = inputs(ScaleRecipe.BLOCKWISE, 512, 1024, 1024, seed=3)
    padded = torch.empty(sa.shape[1], 520, device="cuda")[:, :512].t()  # stride (1, 520)
    padded.copy_(sa)
    decision = fp8_routes.explain(a, b, padded, sb)  # our kernels read copies of them
    assert decision.source == "copy" and "compact" in decision.reason
    expected = fp8_operands.reference(a, b, padded, sb, out_dtype=torch.float32)
    assert relative_error(cutlass_ops.scaled_mm(a, b, padded, sb), expected) < 1e-2
