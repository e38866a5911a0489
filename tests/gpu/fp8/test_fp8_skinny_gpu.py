"""The few-rows FP8 kernel (custom_kernels.fp8.fp8_skinny) on the GPU: every recipe against the
dequantized float32 product on random data (scales that differ row by row and block by block,
rows that do not fill a block, a bias, a float32 output, an e5m2 operand, every split count),
the same bits on every run (the cluster sums its partial tiles in a fixed order), CUDA graphs,
and dispatch: a tuned skinny winner runs through cutlass_ops.scaled_mm, eagerly, in a graph and
under torch.compile, a blockwise call of M % 4 != 0 runs it without padded copies, and one whose
cubin is not in the cache is not compiled on a call."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.fp8 import fp8_routes
from cutlass_ops.gemms.fp8 import fp8_operands
from cutlass_ops.gemms.fp8.fp8_operands import ScaleRecipe
from custom_kernels.fp8 import fp8_skinny
from custom_kernels.core.tolerances import GEMM, relative_error, relative_tolerance
from custom_kernels.fp8.fp8_skinny import SkinnyConfig
from tuning.fp8_session import quantized_inputs

pytestmark = pytest.mark.gpu
E4M3 = (torch.float8_e4m3fn, torch.float8_e4m3fn)
RECIPES = list(ScaleRecipe)
TOLERANCE = relative_tolerance(torch.bfloat16, GEMM)


def inputs(recipe, m, n=384, k=1024, dtypes=E4M3, seed=0):
    return quantized_inputs(recipe, m, n, k, dtypes, "cuda", seed=seed)


def skinny(config, recipe, a, b, sa, sb, bias=None, out_dtype=torch.bfloat16):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=out_dtype, device="cuda")
    fp8_skinny.run(config, a, b, sa, sb, recipe.value, bias, out)
    return out


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("m, bm", [(1, 16), (5, 16), (16, 16), (20, 32), (70, 64), (128, 64),
                                   (100, 128), (128, 128)])
def test_each_recipe_matches_the_dequantized_product(recipe, m, bm):
    a, b, sa, sb = inputs(recipe, m, seed=m)
    expected = fp8_operands.reference(a, b, sa, sb, None, torch.float32, recipe)
    for splits in (1, 3, 8):
        got = skinny(SkinnyConfig(bm, splits, 4), recipe, a, b, sa, sb)
        assert relative_error(got, expected) < TOLERANCE, (splits, relative_error(got, expected))
    # Each row reads its own scales: with row 0's made 4 times larger, row 0 alone changes.
    if recipe is not ScaleRecipe.TENSORWISE and m > 1:
        sa[0] *= 4
        again = skinny(SkinnyConfig(bm, 2, 4), recipe, a, b, sa, sb)
        assert relative_error(again[0], expected[0]) > 0.1
        assert relative_error(again[1:], expected[1:]) < TOLERANCE


@pytest.mark.parametrize("recipe", RECIPES)
def test_bias_float32_output_and_e5m2(recipe):
    a, b, sa, sb = inputs(recipe, 24, 512, 2048, seed=3)
    for out_dtype in (torch.bfloat16, torch.float32):
        bias = torch.randn(512, device="cuda").to(out_dtype)
        got = skinny(SkinnyConfig(32, 4, 6), recipe, a, b, sa, sb, bias, out_dtype)
        expected = fp8_operands.reference(a, b, sa, sb, bias, torch.float32, recipe)
        assert got.dtype == out_dtype and relative_error(got, expected) < TOLERANCE
    a, b, sa, sb = inputs(recipe, 16, 256, 512, (torch.float8_e5m2, torch.float8_e4m3fn), seed=4)
    got = skinny(SkinnyConfig(16, 2, 4), recipe, a, b, sa, sb)
    expected = fp8_operands.reference(a, b, sa, sb, None, torch.float32, recipe)
    assert relative_error(got, expected) < TOLERANCE


def test_the_same_bits_every_run_and_in_a_graph():
    a, b, sa, sb = inputs(ScaleRecipe.BLOCKWISE, 16, 1024, 4096, seed=5)
    config = SkinnyConfig(16, 8, 4)
    first = skinny(config, ScaleRecipe.BLOCKWISE, a, b, sa, sb)
    for _ in range(3):
        assert torch.equal(skinny(config, ScaleRecipe.BLOCKWISE, a, b, sa, sb), first)
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_skinny.run(config, a, b, sa, sb, "blockwise", None, out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)


def tuned_skinny_winner(tmp_path, monkeypatch, recipe, m, n, k, fast, build=True):
    """A private tuning cache naming a skinny config the winner of (recipe, m, n, k), its cubin
    compiled unless ``build`` is False; dispatch's caches emptied."""
    from cutlass_ops.fp8.fp8_plan import scaled_problem
    from cutlass_ops.gemms import dispatch
    from cutlass_ops.gemms.gemm_entries import gemm_cache
    from custom_kernels.core.device import current_scope

    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dispatch, "_entries_by_scope", {})
    fp8_routes.reset()
    problem = scaled_problem(recipe, m, n, k, fast_accum=fast)
    winner = SkinnyConfig(16, 2, 4)
    gemm_cache(current_scope()).put(problem, {
        "winner": winner.to_dict(), "winner_name": winner.name, "backend": "skinny",
        "winner_ms": 0.01, "torch_ms": 0.011, "prefer": "cutlass", "problem": problem.to_dict()})
    if build:
        fp8_skinny.compile_fp8_skinny(winner, recipe.value)
    return winner


@pytest.mark.parametrize("recipe", RECIPES)
def test_dispatch_runs_a_tuned_skinny_winner_eagerly_in_graphs_and_under_compile(
        tmp_path, monkeypatch, recipe):
    fast = recipe is not ScaleRecipe.BLOCKWISE
    winner = tuned_skinny_winner(tmp_path, monkeypatch, recipe, 16, 1024, 2048, fast)
    a, b, sa, sb = inputs(recipe, 16, 1024, 2048, seed=6)
    decision = fp8_routes.explain(a, b, sa, sb, use_fast_accum=fast)
    assert decision.choice == winner and decision.source == "exact", decision
    expected = fp8_operands.reference(a, b, sa, sb, None, torch.float32, recipe)
    assert relative_error(cutlass_ops.scaled_mm(a, b, sa, sb, use_fast_accum=fast),
                          expected) < TOLERANCE
    a8, _, sa8, _ = inputs(recipe, 8, 1024, 2048, seed=7)  # fewer rows: the nearest tuned shape
    assert fp8_routes.explain(a8, b, sa8, sb, use_fast_accum=fast).choice == winner
    assert relative_error(cutlass_ops.scaled_mm(a8, b, sa8, sb, use_fast_accum=fast),
                          fp8_operands.reference(a8, b, sa8, sb, None, torch.float32,
                                                 recipe)) < TOLERANCE
    compiled = torch.compile(lambda *t: cutlass_ops.scaled_mm(*t, use_fast_accum=fast),
                             fullgraph=True)
    assert relative_error(compiled(a, b, sa, sb), expected) < TOLERANCE
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cutlass_ops.scaled_mm(a, b, sa, sb, use_fast_accum=fast)
    sa.mul_(2)  # the kernel reads the scales on the device at each replay
    graph.replay()
    torch.cuda.synchronize()
    doubled = fp8_operands.reference(a, b, sa, sb, None, torch.float32, recipe)
    assert relative_error(captured, doubled) < TOLERANCE


@pytest.mark.parametrize("m", [1, 3])
def test_a_blockwise_call_of_m_not_a_multiple_of_4_runs_the_skinny_winner_without_copies(
        tmp_path, monkeypatch, m):
    """Blockwise calls of M % 4 != 0 (decode) are padded for the CUTLASS kernels and cuBLAS;
    where the padded call's winner is the skinny kernel, it runs on the call's own tensors."""
    winner = tuned_skinny_winner(tmp_path, monkeypatch, ScaleRecipe.BLOCKWISE, 4, 1024, 2048, False)
    a, b, sa, sb = inputs(ScaleRecipe.BLOCKWISE, m, 1024, 2048, seed=9)
    decision = fp8_routes.explain(a, b, sa, sb)
    assert decision.choice == winner, decision
    copies = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *args, **kw: copies.append(1) or real_cat(*args,
                                                                                        **kw))
    out = cutlass_ops.scaled_mm(a, b, sa, sb)
    assert not copies and out.shape == (m, 1024)
    expected = fp8_operands.reference(a, b, sa, sb, None, torch.float32, ScaleRecipe.BLOCKWISE)
    assert relative_error(out, expected) < TOLERANCE


def test_a_skinny_winner_without_its_cubin_runs_torch_rather_than_compile(tmp_path,
                                                                          monkeypatch):
    tuned_skinny_winner(tmp_path, monkeypatch, ScaleRecipe.ROWWISE, 16, 1024, 2048, True,
                        build=False)
    a, b, sa, sb = inputs(ScaleRecipe.ROWWISE, 16, 1024, 2048, seed=8)
    decision = fp8_routes.explain(a, b, sa, sb, use_fast_accum=True)
    assert decision.choice is None, decision
    out = cutlass_ops.scaled_mm(a, b, sa, sb, use_fast_accum=True)
    expected = fp8_operands.reference(a, b, sa, sb, None, torch.float32, ScaleRecipe.ROWWISE)
    assert relative_error(out, expected) < TOLERANCE
