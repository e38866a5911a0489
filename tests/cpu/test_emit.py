import logging

import pytest

from cutlass_ops.gemms import emit
from cutlass_ops.gemms.config import GemmConfig, GemmOperands
from cutlass_ops.gemms.cutlass_bridge import cutlass_threadblock_shape
from custom_kernels.core.errors import EmissionError

BF16_TN = GemmOperands.make("bf16")
PINGPONG = GemmConfig(kernel_schedule="pingpong", tile=(64, 128, 64), cluster=(2, 1, 1))
TWO_SM = GemmConfig(arch="sm100a", kernel_schedule="2sm", tile=(256, 128, 64), cluster=(2, 1, 1))
STREAM_K = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64),
                      tile_scheduler="streamk")


def test_threadblock_shape_inverts_cutlass_cppgen_derivation():
    assert cutlass_threadblock_shape(PINGPONG) == [128, 128, 64]
    assert cutlass_threadblock_shape(TWO_SM) == [256, 128, 64]  # M doubled back by cutlass


def test_emitted_source_names_our_tile_cluster_and_schedules():
    sources = emit.emit_sources(BF16_TN, [PINGPONG, TWO_SM, STREAM_K])
    ping = sources[PINGPONG]
    assert "cute::Shape<cute::_64, cute::_128, cute::_64>" in ping
    assert "cute::Shape<cute::_2,cute::_1,cute::_1>" in ping
    assert "KernelTmaWarpSpecializedPingpong" in ping and "DeviceKernel" in ping
    assert "cutlass::bfloat16_t, cutlass::layout::ColumnMajor, 8" in ping
    assert "KernelTmaWarpSpecialized2SmSm100" in sources[TWO_SM]
    assert "cute::Shape<cute::_256, cute::_128, cute::_64>" in sources[TWO_SM]
    assert "StreamKScheduler" in sources[STREAM_K]


AUTO_128 = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), cluster=(2, 1, 1))
WIDE_EPILOGUE = AUTO_128.replace(epilogue_tile=(128, 64))
FUSED = GemmOperands.make("bf16", epilogue="bias,gelu_tanh,residual")


def test_an_explicit_epilogue_tile_replaces_cutlass_auto_and_nothing_else():
    sources = emit.emit_sources(BF16_TN, [AUTO_128, WIDE_EPILOGUE])
    auto, wide = sources[AUTO_128], sources[WIDE_EPILOGUE]
    assert "cutlass::epilogue::collective::EpilogueTileAuto," in auto
    assert "EpilogueTileAuto" not in wide and "cute::Shape<cute::_128, cute::_64>," in wide
    # Line 1 names the kernel; the rest differs in the epilogue tile type only.
    restored = wide.replace("cute::Shape<cute::_128, cute::_64>,",
                            "cutlass::epilogue::collective::EpilogueTileAuto,")
    assert restored.splitlines()[1:] == auto.splitlines()[1:]
    assert WIDE_EPILOGUE.build_name in wide.splitlines()[0]
    with pytest.raises(EmissionError, match="EpilogueTileAuto"):
        emit.check_emitted_shapes(wide, AUTO_128)
    with pytest.raises(EmissionError, match="cute::Shape<cute::_128, cute::_64>"):
        emit.check_emitted_shapes(auto, WIDE_EPILOGUE)


def test_a_visitor_tree_gets_the_explicit_epilogue_tile_everywhere():
    source = emit.emit_source(FUSED, WIDE_EPILOGUE)
    # The CollectiveBuilder's and the visitor tree's EpilogueDescriptor must agree.
    assert source.count("cute::Shape<cute::_128, cute::_64>,") == 2
    assert "EpilogueTileAuto" not in source and "Sm90RowBroadcast" in source


def test_the_emitted_source_cache_key_of_auto_configs_is_unchanged():
    # Keyed as before the epilogue tile existed: build fields without it.
    for config in (AUTO_128, PINGPONG, TWO_SM):
        old_fields = [str(getattr(config, name)) for name in GemmConfig.BUILD_FIELDS[:7]]
        key = emit._spec_hash(BF16_TN.to_dict(), old_fields, emit.cutlass_version())
        assert emit._emitted_path(BF16_TN, config).name == (
            f"{BF16_TN.name}-{config.build_name}-{key}.h")
    assert emit._emitted_path(BF16_TN, WIDE_EPILOGUE) != emit._emitted_path(BF16_TN, AUTO_128)


def test_emission_is_cached_on_disk(monkeypatch):
    emit.emit_source(BF16_TN, PINGPONG)

    def no_child_process(*args, **kwargs):
        raise AssertionError("cutlass_cppgen was started for a cached source")

    monkeypatch.setattr(emit, "run_bridge", no_child_process)
    # A config differing only in run-time fields shares the emitted source.
    varied = PINGPONG.replace(swizzle=4, raster_order="alongn")
    assert "Pingpong" in emit.emit_source(BF16_TN, varied)


def test_shape_check_refuses_a_mismatch():
    source = emit.emit_source(BF16_TN, PINGPONG)
    with pytest.raises(EmissionError, match="emitted TileShape"):
        emit.check_emitted_shapes(source, PINGPONG.replace(tile=(128, 128, 64)))


def test_cutlass_cppgen_errors_are_reported_per_config():
    bad = GemmConfig(kernel_schedule="pingpong", tile=(128, 128, 64), stages=99)
    result = emit.emit_sources(BF16_TN, [bad, PINGPONG])
    assert isinstance(result[bad], EmissionError) and "stage" in str(result[bad]).lower()
    assert isinstance(result[PINGPONG], str)


def test_tile_descriptions_cache_survives_corruption(cache_root, caplog):
    first = emit.cutlass_tile_descriptions(BF16_TN, GemmConfig().arch)
    [path] = list((emit.cache_dir.versioned_dir("tile_descriptions")).glob("sm90a-*.json"))
    path.write_text('[{"truncated": ')
    with caplog.at_level(logging.WARNING, logger="custom_kernels.core.cache_dir"):
        again = emit.cutlass_tile_descriptions(BF16_TN, GemmConfig().arch)
    assert "not valid JSON" in caplog.text
    assert again == first


def test_an_undecodable_cached_source_is_set_aside_and_emitted_again(cache_root, caplog):
    first = emit.emit_sources(BF16_TN, [PINGPONG])[PINGPONG]
    path = emit._emitted_path(BF16_TN, PINGPONG)
    path.write_bytes(b"\xff\xfe not a source")
    with caplog.at_level(logging.WARNING, logger="custom_kernels.core.cache_dir"):
        assert emit.cached_source(BF16_TN, PINGPONG) is None
    assert "not UTF-8" in caplog.text and not path.exists()
    assert emit.emit_sources(BF16_TN, [PINGPONG])[PINGPONG] == first
