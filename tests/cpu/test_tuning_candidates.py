import pytest

from cutlass_ops.gemms import space
from cutlass_ops.gemms.config import (GemmConfig, GemmOperands, GemmProblem, KernelSchedule, Layout,
                                TileScheduler)
from tuning import candidates, heuristics
from cutlass_ops.gemms import ranking as model
from cutlass_ops.gemms.choice import Choice, swapped_operands
from custom_kernels.core.device import named_spec, spec_for

OPS = GemmOperands.make("bf16")
H100 = named_spec("H100")


def test_swapped_operands_flip_layouts_and_round_trip():
    swapped = swapped_operands(OPS)
    assert swapped.layout_name == "tnn"
    assert swapped_operands(swapped) == OPS
    nn = GemmOperands.make("f16", layout_a="col", layout_b="row", out_dtype="f32")
    # A column-major, B row-major, D row-major: B^T is column-major, A^T row-major, D^T column.
    assert swapped_operands(nn).layout_name == "ntn"
    assert swapped_operands(nn).element_d.value == "f32"
    choice = Choice(GemmConfig(tile=(64, 16, 128)), swap_ab=True)
    assert Choice.from_name(choice.name) == choice == Choice.from_dict(choice.to_dict())
    p = choice.problem_for(GemmProblem(OPS, 16, 4096, 1024, 2))
    assert (p.m, p.n, p.k, p.batch) == (4096, 16, 1024, 2)


def test_space_obeys_the_rules_and_covers_small_tiles_and_stream_k():
    configs = candidates.config_space(OPS, "sm90a")
    assert configs and all(not space.violations(OPS, c) for c in configs)
    tiles = {(c.kernel_schedule, c.tile) for c in configs}
    assert (KernelSchedule.PINGPONG, (64, 16, 128)) in tiles
    assert (KernelSchedule.PINGPONG, (64, 32, 128)) in tiles
    assert any(c.tile_scheduler is TileScheduler.STREAM_K for c in configs)
    assert all(c.tile[0] >= 128 for c in configs
               if c.kernel_schedule is KernelSchedule.COOPERATIVE)
    exhaustive = candidates.config_space(OPS, "sm90a", exhaustive=True)
    assert len(exhaustive) > len(configs) and any(c.stages for c in exhaustive)
    assert all(not space.violations(OPS, c) for c in exhaustive)
    sm100 = candidates.config_space(OPS, "sm100a")
    assert any(c.kernel_schedule is KernelSchedule.SM100_2SM for c in sm100)


def test_swap_is_offered_only_when_m_is_the_smaller_extent():
    assert candidates.orientations(GemmProblem(OPS, 16, 4096, 4096)) == (False, True)
    assert candidates.orientations(GemmProblem(OPS, 8192, 4096, 4096)) == (False,)


def test_shape_rule_drops_tiles_that_would_be_mostly_padding():
    small = GemmProblem(OPS, 16, 4096, 4096)
    big_m = Choice(GemmConfig(kernel_schedule="cooperative", tile=(256, 128, 64)))
    assert not candidates.fits_shape(small, big_m)
    assert candidates.fits_shape(small, Choice(GemmConfig(tile=(64, 128, 64))))
    assert candidates.fits_shape(small, Choice(GemmConfig(tile=(64, 16, 128)), swap_ab=True))


@pytest.mark.parametrize("strategy,count", [("quick", 4), ("default", 20)])
@pytest.mark.parametrize("mnk", [(16, 4096, 4096), (128, 14336, 4096), (4096, 4096, 14336)])
def test_select_gives_a_ranked_diverse_list(strategy, count, mnk):
    problem = GemmProblem(OPS, *mnk)
    picked = candidates.select(problem, H100, strategy, use_heuristics=False)
    assert len(picked) == count == len(set(picked))
    allowed = set(candidates.all_choices(problem, "sm90a"))
    assert all(c in allowed for c in picked)
    if strategy == "default":
        families = {(c.swap_ab, c.config.kernel_schedule, c.config.tile_scheduler)
                    for c in picked}
        assert len(families) >= 3
        if mnk[0] == 16:
            assert any(c.swap_ab for c in picked)


@pytest.mark.parametrize("strategy", ["quick", "default"])
def test_measured_small_m_winners_are_always_searched(strategy):
    decode = GemmProblem(OPS, 16, 4096, 14336)
    picked = candidates.select(decode, H100, strategy, use_heuristics=False)
    best = Choice(GemmConfig(kernel_schedule="pingpong", tile=(64, 16, 128)), swap_ab=True)
    assert best in picked
    if strategy == "default":
        assert Choice(GemmConfig(kernel_schedule="pingpong", tile=(64, 32, 128)),
                      swap_ab=True) in picked
    prefill = GemmProblem(OPS, 128, 4096, 4096)
    assert Choice(GemmConfig(kernel_schedule="pingpong", tile=(64, 64, 64))) in \
        candidates.select(prefill, H100, strategy, use_heuristics=False)
    assert candidates.measured_seeds(GemmProblem(OPS, 4096, 4096, 4096)) == []
    # A small N is the same problem transposed: the seeds run the other way round.
    assert not any(c.swap_ab for c in candidates.measured_seeds(GemmProblem(OPS, 4096, 16, 4096)))
    assert all(c.swap_ab for c in candidates.measured_seeds(GemmProblem(OPS, 4096, 128, 4096)))


def test_wave_fill_prefers_tiles_that_fill_whole_waves():
    problem = GemmProblem(OPS, 128, 14336, 4096)

    def fill(tile, cluster=(1, 1, 1), **kw):
        return candidates.wave_fill(problem, Choice(GemmConfig(
            kernel_schedule="cooperative", tile=tile, cluster=cluster, **kw)), H100)

    assert fill((128, 112, 64)) == pytest.approx(128 / 132)  # one wave, as cuBLAS tiles it
    assert fill((128, 128, 64)) == pytest.approx(112 / 132)
    assert fill((128, 112, 64), (2, 2, 1)) < 0.5  # half of each cluster hangs past M = 128
    assert fill((128, 112, 64), tile_scheduler="streamk") == 0.0
    picked = candidates.select(problem, H100, "default", use_heuristics=False)
    assert any(c.config.tile[:2] in ((128, 112), (64, 224)) for c in picked)


def test_exhaustive_selects_every_candidate_default_picks_first():
    problem = GemmProblem(OPS, 1024, 4096, 4096)
    picked = candidates.select(problem, H100, "exhaustive", use_heuristics=False)
    assert set(picked) == set(candidates.all_choices(problem, "sm90a", exhaustive=True))
    assert len(picked) == len(set(picked))
    default = candidates.select(problem, H100, "default", use_heuristics=False)
    assert picked[:len(default)] == default  # a budget cut leaves it no worse than default


def test_model_prefers_big_tiles_for_big_gemms_and_swap_for_skinny_ones():
    big = GemmProblem(OPS, 8192, 8192, 8192)
    coop = Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 256, 64)))
    tiny = Choice(GemmConfig(tile=(64, 16, 128)))
    assert model.estimate_us(big, coop, H100) < model.estimate_us(big, tiny, H100)
    skinny = GemmProblem(OPS, 16, 4096, 4096)
    wide = Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64)))
    assert model.estimate_us(skinny, Choice(tiny.config, True), H100) < \
        model.estimate_us(skinny, wide, H100)
    # More SMs, more throughput: an unknown GPU is scaled from Hopper per-SM figures.
    assert spec_for("Some GPU", 90, 66).peak_tflops == pytest.approx(H100.peak_tflops / 2)


def test_variants_cover_run_time_knobs_where_they_matter():
    big = GemmProblem(OPS, 8192, 8192, 8192)
    base = Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 256, 64)))
    many = candidates.variants(big, base, H100)
    assert many[0] == base and len(many) == 9
    assert {v.config.swizzle for v in many} == {1, 2, 4, 8}
    small = GemmProblem(OPS, 128, 1024, 8192)
    streamk = Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64),
                                tile_scheduler="streamk"))
    splits = {v.config.splits for v in candidates.variants(small, streamk, H100)}
    assert splits >= {1, 2, 4}
    for v in candidates.variants(small, streamk, H100):
        assert not space.violations(OPS, v.config)


def test_heuristics_are_optional(monkeypatch):
    problem = GemmProblem(OPS, 1024, 4096, 4096)
    monkeypatch.setattr(heuristics, "available", lambda: False)
    assert heuristics.suggest(problem, H100) == []
    assert len(candidates.select(problem, H100, "quick")) == 4


@pytest.mark.skipif(not heuristics.available(), reason="nvidia-matmul-heuristics not installed")
def test_heuristics_map_onto_our_space():
    problem = GemmProblem(OPS, 4096, 4096, 4096)
    suggested = heuristics.suggest(problem, named_spec("H200"), count=6)
    assert suggested and all(isinstance(c, Choice) for c in suggested)
    layouts = {c.operands_for(problem.operands).layout_c for c in suggested}
    assert layouts <= {Layout.ROW, Layout.COL}
    picked = candidates.select(problem, named_spec("H200"), "default")
    assert any(candidates.base_choice(c, c.operands_for(OPS)) in picked for c in suggested)
