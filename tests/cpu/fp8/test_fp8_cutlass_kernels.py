"""The CUTLASS FP8 kernels behind cutlass_ops.scaled_mm, without a GPU: the scaled operands and
their keys, each recipe's rules, what the emitter writes for the launcher (the epilogue slot
list, the blockwise scale layouts, the CTA tile of a visitor tree, stream-K with fast
accumulation), the loader's checks, the candidates, the CLI and the dispatch rules."""

import pytest
import torch

from cutlass_ops.fp8 import fp8_routes
from cutlass_ops.fp8.fp8_plan import layout_refusal, scaled_operands, scaled_problem
from cutlass_ops.gemms import cutlass_bridge, loader, space
from cutlass_ops.gemms.config import (GemmConfig, GemmOperands, GemmProblem, KernelSchedule,
                                      Scaling)
from cutlass_ops.gemms.fp8 import blockwise_emit
from cutlass_ops.gemms.fp8.fp8_operands import ScaleRecipe, check_scaled
from custom_kernels.core.device import DeviceSpec
from custom_kernels.core.errors import InvalidConfigError
from tuning import candidates

COOP = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 128))
H100 = DeviceSpec("H100", 90, 132, 989.0, 3350.0, 50 * 2**20)


def test_scaled_operands_carry_the_recipe_in_their_key_and_round_trip():
    ops = scaled_operands("rowwise", bias=True, fast_accum=True)
    assert ops.name.endswith("_bias_n_fastaccum_rowwise") and ops.scaling is Scaling.ROWWISE
    assert GemmOperands.from_dict(ops.to_dict()) == ops
    plain = GemmOperands.make("bf16")
    assert "scaling" not in plain.to_dict()  # keys of every GEMM from before FP8 unchanged
    blockwise = scaled_operands("blockwise", bias=True, fast_accum=True, out_dtype=torch.float32)
    # blockwise kernels promote every block and add the bias after: neither is in the key
    assert not blockwise.fast_accum and blockwise.epilogue.is_default
    assert blockwise.alignment_c == 4 and blockwise.element_d.value == "f32"
    problem = scaled_problem("tensorwise", 128, 256, 512)
    assert GemmProblem.from_dict(problem.to_dict()) == problem


@pytest.mark.parametrize("config,rule", [
    (COOP.replace(tile=(128, 256, 128)), "tile N 128"),
    (COOP.replace(tile=(256, 128, 128)), "tile M 64 or 128"),
])
def test_blockwise_rules(config, rule):
    with pytest.raises(InvalidConfigError, match=rule):
        space.check(scaled_operands("blockwise"), config)
    space.check(scaled_operands("blockwise"), COOP)


def test_scaling_needs_fp8_operands_and_scaled_epilogues_are_limited():
    bf16 = GemmOperands.make("bf16")
    import dataclasses

    assert any("FP8 operands" in why for why in space.violations(
        dataclasses.replace(bf16, scaling=Scaling.TENSORWISE), COOP.replace(tile=(128, 128, 64))))
    gelu = dataclasses.replace(scaled_operands("tensorwise"),
                               epilogue=bf16.epilogue.parse("bias,gelu"))
    assert any("at most a bias" in why for why in space.violations(gelu, COOP))


def test_the_emitted_slot_list_names_each_leaf_of_the_scaled_trees():
    assert cutlass_bridge.epilogue_slots(scaled_operands("tensorwise")) == \
        "#define CUTLASS_OPS_EPILOGUE_SLOTS 3, 4"
    assert cutlass_bridge.epilogue_slots(scaled_operands("rowwise", bias=True)) == \
        "#define CUTLASS_OPS_EPILOGUE_SLOTS 3, 4, 2"
    assert cutlass_bridge.epilogue_slots(scaled_operands("blockwise")) == ""
    assert cutlass_bridge.epilogue_slots(GemmOperands.make("bf16", epilogue="bias")) == ""


def test_loader_expects_each_recipes_scales():
    assert loader.expected_scale_slots(scaled_operands("tensorwise")) == (2, 0, 0)
    assert loader.expected_scale_slots(scaled_operands("rowwise")) == (0, 2, 0)
    assert loader.expected_scale_slots(scaled_operands("blockwise")) == (0, 0, 2)
    assert loader.expected_epilogue_slots(scaled_operands("rowwise", bias=True)) == (0, 1)
    assert loader.expected_epilogue_slots(scaled_operands("blockwise")) == (2, 0)


def test_blockwise_source_has_the_launchers_names_and_torchs_scale_layouts():
    source = blockwise_emit.emit(scaled_operands("blockwise"), COOP)
    assert "Sm90BlockwiseScaleConfig< 1, 128, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K>" \
        in source
    assert "#define CUTLASS_OPS_BLOCKWISE_SCALES 1" in source
    assert "using CutlassOpsScaleConfig =" in source and "using DeviceKernel =" in source
    assert "KernelTmaWarpSpecializedCooperativeFP8Blockwise" in source
    pingpong = blockwise_emit.emit(scaled_operands("blockwise"),
                                   COOP.replace(kernel_schedule="pingpong", tile=(64, 128, 128)))
    assert "KernelTmaWarpSpecializedPingpongFP8Blockwise" in pingpong
    with pytest.raises(ValueError, match="one Sm90BlockwiseScaleConfig"):
        blockwise_emit.with_launcher_names("no scale config here", "name")


def test_a_visitor_trees_descriptor_gets_the_cta_tile():
    body = ("using EpilogueDescriptor = cutlass::epilogue::collective::detail::"
            "EpilogueDescriptor<\n  cute::Shape<_128, _320, _128>, EpilogueTileAuto,")
    config = GemmConfig(kernel_schedule="pingpong", tile=(64, 160, 128), cluster=(2, 2, 1))
    assert "cute::Shape<cute::_64, cute::_160, cute::_128>" in \
        cutlass_bridge.with_cta_descriptor(body, config)
    assert cutlass_bridge.with_cta_descriptor("plain kernel", config) == "plain kernel"


def test_stream_k_fast_accumulation_gets_its_schedule_after_emission():
    body = "CollectiveBuilder<..., cutlass::gemm::KernelTmaWarpSpecializedCooperative\n>"
    stream_k = COOP.replace(tile_scheduler="streamk")
    fast = scaled_operands("tensorwise", fast_accum=True)
    assert "CooperativeFP8FastAccum\n>" in cutlass_bridge.with_fast_accum_stream_k(
        body, fast, stream_k)
    assert cutlass_bridge.with_fast_accum_stream_k(body, fast, COOP) == body
    assert cutlass_bridge.with_fast_accum_stream_k(body, scaled_operands("tensorwise"),
                                                   stream_k) == body


@pytest.mark.parametrize("recipe", list(ScaleRecipe))
@pytest.mark.parametrize("m", [16, 128, 4096])
def test_fp8_candidates_are_unswapped_and_obey_the_rules(recipe, m):
    problem = scaled_problem(recipe, m, 4096, 4096, fast_accum=recipe is not ScaleRecipe.BLOCKWISE)
    picked = candidates.select(problem, H100, "quick", use_heuristics=False)
    seeds = [c for c in candidates.fp8_seeds(problem) if candidates.fits_shape(problem, c)]
    assert picked and not any(c.swap_ab for c in picked)
    assert set(picked) >= {c for c in seeds if not space.violations(problem.operands, c.config)}
    for choice in picked:
        assert not space.violations(problem.operands, choice.config), choice.name


def _blockwise(m=64, n=256, k=512, scale_a=None):
    a = torch.zeros(m, k).to(torch.float8_e4m3fn)
    b = torch.zeros(n, k).to(torch.float8_e4m3fn).t()
    sa = scale_a if scale_a is not None else torch.ones(k // 128, m).t()
    sb = torch.ones(n // 128, k // 128).t()
    return a, b, sa, sb


def test_layouts_our_kernels_do_not_read_are_named():
    a, b, sa, sb = _blockwise()
    assert layout_refusal(check_scaled(a, b, sa, sb), sa, sb) is None
    padded = torch.ones(4, 72)[:, :64].t()  # (64, 4) column-major with a leading stride of 72
    a, b, sa, sb = _blockwise(scale_a=padded)
    assert "compact" in layout_refusal(check_scaled(a, b, sa, sb), sa, sb)
    a, b, sa, sb = _blockwise(m=62)
    assert "M % 4" in layout_refusal(check_scaled(a, b, sa, sb), sa, sb)


def test_dispatch_off_a_gpu_names_the_device_and_memoizes_the_route():
    a, b, sa, sb = _blockwise()
    fp8_routes.reset()
    decision = fp8_routes.explain(a, b, sa, sb)
    assert decision.choice is None and "cpu" in decision.reason
    assert fp8_routes.known_route(a, b, sa, sb, None, torch.bfloat16, False) is None
    checked = check_scaled(a, b, sa, sb)
    made = fp8_routes.route(a, b, sa, sb, None, checked, False)
    key = fp8_routes._signature(a, b, sa, sb, None, torch.bfloat16, False)
    assert fp8_routes._routes[key] is made
    # The eager fast path serves CUDA tensors only: off a GPU, scaled_mm computes the reference.
    assert fp8_routes.known_route(a, b, sa, sb, None, torch.bfloat16, False) is None
    fp8_routes.reset()  # dispatch.reset() forgets scaled routes too
    assert key not in fp8_routes._routes


def test_cli_fp8_operands_and_refusals():
    from tuning.cli import build_parser, _operands

    args = build_parser().parse_args(["tune", "--fp8", "rowwise", "--fast-accum",
                                      "--epilogue", "bias", "1024x4096x4096"])
    assert _operands(args) == scaled_operands("rowwise", bias=True, fast_accum=True)
    for extra in (["--layout", "nn"], ["--epilogue", "gelu"], ["--out-dtype", "f16"]):
        args = build_parser().parse_args(["tune", "--fp8", "tensorwise", *extra, "16x16x16"])
        with pytest.raises(ValueError, match="--fp8"):
            _operands(args)


@pytest.mark.parametrize("recipe, fast", [("tensorwise", False), ("rowwise", False),
                                          ("blockwise", False), ("rowwise", True)])
@pytest.mark.parametrize("m", [16, 4096])
def test_promoted_seeds_keep_a_warp_groups_tile_within_64x128(recipe, fast, m):
    """Promoted accumulation holds two float32 accumulators: a warp group's share of the tile
    (cooperative: half the rows; pingpong: all of it) stays within 64 x 128 (wider ones spilled
    and ran 3x slower on an H200); fast accumulation keeps the wide tiles."""
    problem = scaled_problem(recipe, m, 4096, 4096, fast_accum=fast)
    seeds = candidates.fp8_seeds(problem)
    assert seeds

    def per_warp_group(c):
        tm, tn, _ = c.config.tile
        rows = tm // 2 if c.config.kernel_schedule is KernelSchedule.COOPERATIVE else tm
        return rows * tn

    widest = max(per_warp_group(c) for c in seeds)
    if fast:
        assert widest > 64 * 128
    else:
        assert widest <= 64 * 128


@pytest.mark.parametrize("k", [128, 256, 384, 640])
def test_blockwise_operands_padded_along_k_keep_the_product_and_layouts(k):
    """cuBLAS gets blockwise K % 512 != 0 wrong (measured on an H200): the torch route pads
    K with zeros and unit scales, which leaves the dequantized product as it was."""
    from cutlass_ops.gemms.fp8.fp8_operands import reference

    g = torch.Generator().manual_seed(k)
    m, n = 64, 256
    a = (torch.randn(m, k, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn).t()
    sa = torch.rand(k // 128, m, generator=g).t() + 0.5
    sb = (torch.rand(n // 128, k // 128, generator=g) + 0.5).t()
    a2, b2, sa2, sb2 = fp8_routes.padded_k(a, b, sa, sb, 512)
    kp = -(-k // 512) * 512
    assert a2.shape == (m, kp) and b2.shape == (kp, n) and b2.stride() == (1, kp)
    assert sa2.shape == (m, kp // 128) and sa2.stride() == (1, m)
    assert sb2.shape == (kp // 128, n // 128) and sb2.stride() == (1, kp // 128)
    want = reference(a, b, sa, sb, None, torch.float32, ScaleRecipe.BLOCKWISE)
    got = reference(a2, b2, sa2, sb2, None, torch.float32, ScaleRecipe.BLOCKWISE)
    assert ((got - want).norm() / want.norm()).item() < 1e-6  # float32 summation order only


@pytest.mark.parametrize("allowed", [False, True])
def test_an_untuned_fp8_shape_runs_torch_unless_built_kernels_are_allowed(monkeypatch, allowed):
    """With a kernel built and nothing tuned, dispatch picks torch._scaled_mm and says how to
    tune; only with UNTUNED_BUILT_KERNELS does the performance model's pick run."""
    import types

    from custom_kernels.core import device
    from cutlass_ops.fp8 import fp8_plan
    from cutlass_ops.gemms import dispatch
    from cutlass_ops.gemms.choice import Choice

    a, b, sa, sb = _blockwise()
    checked = check_scaled(a, b, sa, sb)
    built = Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 128)))
    monkeypatch.setattr(device, "current_spec", lambda index=None: H100)
    monkeypatch.setattr(device, "current_scope", lambda index=None: "test-scope")
    monkeypatch.setattr(fp8_plan, "layout_refusal", lambda *args: None)
    monkeypatch.setattr(dispatch, "_entries", lambda scope: {})
    monkeypatch.setattr(dispatch, "built_choices", lambda operands, arch: [built])
    monkeypatch.setattr(loader, "is_built", lambda operands, config: True)
    monkeypatch.setattr(fp8_routes, "UNTUNED_BUILT_KERNELS", allowed)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    decision = fp8_routes.decide(checked, False, on_gpu, sb)
    if allowed:
        assert decision.source == "heuristic" and decision.choice is not None
    else:
        assert decision.choice is None and decision.source == "torch"
        assert "cutlass-tune tune --fp8 blockwise" in decision.reason
