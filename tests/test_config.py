import pytest
from hypothesis import given, strategies as st

from cutlass_ops.config import (Arch, DType, EpilogueSchedule, GemmConfig, GemmOperands,
                                GemmProblem, KernelSchedule, Layout, RasterOrder, TileScheduler)

configs = st.builds(
    GemmConfig,
    arch=st.sampled_from(list(Arch)),
    tile=st.tuples(st.sampled_from([64, 128, 256]), st.sampled_from([16, 64, 128, 256]),
                   st.sampled_from([32, 64, 128])),
    cluster=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.just(1)),
    stages=st.integers(0, 8),
    kernel_schedule=st.sampled_from(list(KernelSchedule)),
    epilogue_schedule=st.sampled_from(list(EpilogueSchedule)),
    tile_scheduler=st.sampled_from(list(TileScheduler)),
    splits=st.integers(1, 8),
    raster_order=st.sampled_from(list(RasterOrder)),
    swizzle=st.sampled_from([1, 2, 4, 8]),
)


@given(configs)
def test_config_round_trips_through_dict_and_name(config):
    assert GemmConfig.from_dict(config.to_dict()) == config
    assert GemmConfig.from_name(config.name) == config
    assert hash(GemmConfig.from_name(config.name)) == hash(config)


@given(configs, configs)
def test_names_differ_when_configs_differ(a, b):
    assert (a.name == b.name) == (a == b)
    assert (a.build_name == b.build_name) == (a.build_fields() == b.build_fields())


def test_run_time_fields_do_not_change_the_build():
    base = GemmConfig(kernel_schedule="cooperative", tile_scheduler="streamk")
    varied = base.replace(splits=3, raster_order="alongn", swizzle=4)
    assert varied.build_fields() == base.build_fields()
    assert varied.build_name == base.build_name and varied.name != base.name


def test_config_is_frozen_and_validates():
    config = GemmConfig()
    with pytest.raises(AttributeError):
        config.stages = 3
    with pytest.raises(ValueError):
        GemmConfig(tile=(128, 128))
    with pytest.raises(ValueError):
        GemmConfig(swizzle=3)
    with pytest.raises(ValueError):
        GemmConfig(kernel_schedule="fast")
    with pytest.raises(ValueError):
        GemmConfig.from_dict({**config.to_dict(), "colour": "red"})
    with pytest.raises(ValueError):
        GemmConfig.from_name("not-a-config")


def test_operands_and_problem():
    operands = GemmOperands.make("bf16")
    assert operands.layout_name == "tnt" and operands.alignment_a == 8
    assert operands.name == "bf16_bf16_bf16_bf16_f32_tnt_align8x8x8"
    assert GemmOperands.from_dict(operands.to_dict()) == operands
    mixed = GemmOperands.make(DType.F16, layout_a=Layout.COL, out_dtype="f32")
    assert mixed.alignment_c == 4 and mixed.layout_name == "nnt"
    problem = GemmProblem(operands, 16, 4096, 4096, batch=2)
    assert problem.flops == 2 * 16 * 4096 * 4096 * 2
    assert GemmProblem.from_dict(problem.to_dict()) == problem
    assert problem.name.endswith("16x4096x4096x2")
    with pytest.raises(ValueError):
        GemmProblem(operands, -1, 1, 1)
    with pytest.raises(ValueError):
        GemmOperands.make("bf16").__class__(**{**operands.__dict__, "alignment_a": 3})
    with pytest.raises(ValueError):
        GemmOperands(**{**operands.__dict__, "element_c": DType.F32})
