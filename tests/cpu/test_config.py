import pytest
from hypothesis import given, strategies as st

from cutlass_ops.gemms.config import (Arch, DType, EpilogueSchedule, GemmConfig, GemmOperands,
                                GemmProblem, KernelSchedule, Layout, RasterOrder, TileScheduler,
                                epilogue_tile_widths)

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


@st.composite
def explicit_epilogue_configs(draw):
    """sm90a TMA configs with an explicit epilogue tile that CUTLASS accepts."""
    schedule = draw(st.sampled_from(["pingpong", "cooperative"]))
    rows = 64 if schedule == "pingpong" else 128
    tile = (draw(st.sampled_from([rows, 2 * rows])), draw(st.sampled_from([64, 128, 192, 256])),
            draw(st.sampled_from([64, 128])))
    base = GemmConfig(kernel_schedule=schedule, tile=tile,
                      cluster=draw(st.sampled_from([(1, 1, 1), (2, 1, 1)])),
                      tile_scheduler=draw(st.sampled_from(list(TileScheduler))),
                      splits=draw(st.integers(1, 4)), swizzle=draw(st.sampled_from([1, 8])))
    return base.replace(epilogue_tile=(rows, draw(st.sampled_from(epilogue_tile_widths(base)))))


@given(st.one_of(configs, explicit_epilogue_configs()))
def test_config_round_trips_through_dict_and_name(config):
    assert GemmConfig.from_dict(config.to_dict()) == config
    assert GemmConfig.from_name(config.name) == config
    assert hash(GemmConfig.from_name(config.name)) == hash(config)


@given(st.one_of(configs, explicit_epilogue_configs()),
       st.one_of(configs, explicit_epilogue_configs()))
def test_names_differ_when_configs_differ(a, b):
    assert (a.name == b.name) == (a == b)
    assert (a.build_name == b.build_name) == (a.build_fields() == b.build_fields())


def test_run_time_fields_do_not_change_the_build():
    base = GemmConfig(kernel_schedule="cooperative", tile_scheduler="streamk")
    varied = base.replace(splits=3, raster_order="alongn", swizzle=4)
    assert varied.build_fields() == base.build_fields()
    assert varied.build_name == base.build_name and varied.name != base.name


def test_an_auto_epilogue_tile_keeps_names_dicts_and_build_fields():
    # Names and dicts of configs from before the field: tuning and artifact caches keyed by them
    # stay valid.
    config = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), cluster=(2, 1, 1))
    name = ("sm90a-cooperative-t128x128x64-c2x1x1-sauto-epitma-persistent-split1-rheuristic-sw1")
    assert config.name == name and GemmConfig.from_name(name) == config
    assert config.build_name == name.removesuffix("-split1-rheuristic-sw1")
    assert "epilogue_tile" not in config.to_dict()
    assert GemmConfig.from_dict(config.to_dict()) == config
    assert len(config.build_fields()) == len(GemmConfig.BUILD_FIELDS) - 1
    assert config.epilogue_tile == (0, 0) and config.epilogue_tile_is_auto


def test_an_explicit_epilogue_tile_is_a_build_field_with_a_name_part():
    auto = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), cluster=(2, 1, 1))
    wide = auto.replace(epilogue_tile=[128, 64])
    assert wide.epilogue_tile == (128, 64) and not wide.epilogue_tile_is_auto
    assert wide.build_name == auto.build_name + "-e128x64"
    assert wide.name == auto.build_name + "-e128x64-split1-rheuristic-sw1"
    assert GemmConfig.from_name(wide.name) == wide
    assert GemmConfig.from_dict(wide.to_dict()) == wide and wide.to_dict()["epilogue_tile"] == [
        128, 64]
    assert wide.build_fields() != auto.build_fields()
    # What cutlass_ops.gemms.dispatch rebuilds from an artifact directory name.
    assert GemmConfig.from_name(wide.build_name + "-split1-rheuristic-sw1") == wide
    pingpong = GemmConfig(kernel_schedule="pingpong", tile=(64, 256, 64), epilogue_tile=(64, 128))
    assert GemmConfig.from_name(pingpong.name) == pingpong


def test_epilogue_tile_widths_are_the_multiples_of_16_that_divide_the_tile():
    # With CuTe's extended wgmma shapes a thread hands N / 2 values to each epilogue copy, which
    # every such width's fragment divides (docs/measurements.md, "Epilogue tiles").
    assert epilogue_tile_widths(GemmConfig(tile=(128, 128, 64))) == [16, 32, 64, 128]
    assert epilogue_tile_widths(GemmConfig(tile=(128, 192, 64))) == [16, 32, 48, 64, 96, 192]
    assert epilogue_tile_widths(GemmConfig(tile=(128, 160, 64))) == [16, 32, 80, 160]
    assert epilogue_tile_widths(GemmConfig(tile=(128, 176, 64))) == [16, 176]
    assert epilogue_tile_widths(GemmConfig(tile=(128, 240, 64))) == [16, 48, 80, 240]


@pytest.mark.parametrize("changes, expected", [
    (dict(epilogue_tile=(64, 16)), "cooperative needs epilogue tile M = 128"),
    (dict(kernel_schedule="pingpong", epilogue_tile=(128, 16)), "epilogue tile M = 64"),
    (dict(epilogue_tile=(128, 88)), "multiple of 16"),
    (dict(epilogue_tile=(128, 32)), "must divide the tile 128x176"),
    (dict(epilogue_tile=(0, 16)), "two positive integers"),
    (dict(epilogue_tile=(-128, -16)), "two positive integers"),
    (dict(epilogue_tile=(128, 16, 1)), "two integers"),
    (dict(epilogue_schedule="nosmem", epilogue_tile=(128, 16)), "needs the TMA epilogue"),
    (dict(arch="sm100a", kernel_schedule="1sm", epilogue_tile=(128, 16)), "sm90a only"),
])
def test_invalid_epilogue_tiles_are_refused(changes, expected):
    base = dict(kernel_schedule="cooperative", tile=(128, 176, 64))
    with pytest.raises(ValueError, match=expected):
        GemmConfig(**{**base, **changes})
    for width in (16, 176):  # the widths a 176-wide tile allows
        GemmConfig(**base, epilogue_tile=(128, width))


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
