import pytest

from cutlass_ops.gemms import space
from cutlass_ops.gemms.config import Arch, GemmConfig, GemmOperands, KernelSchedule, TileScheduler
from custom_kernels.core.errors import InvalidConfigError

BF16_TN = GemmOperands.make("bf16")


def reasons(config, operands=BF16_TN):
    return " | ".join(space.violations(operands, config))


def test_the_issue_configs_are_valid():
    for config in (
        GemmConfig(kernel_schedule="pingpong", tile=(128, 128, 64)),
        GemmConfig(kernel_schedule="pingpong", tile=(64, 128, 64), cluster=(2, 1, 1)),
        GemmConfig(kernel_schedule="cooperative", tile=(128, 256, 64), cluster=(1, 2, 1)),
        GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), cluster=(2, 1, 1),
                   tile_scheduler="streamk", splits=2),
        GemmConfig(arch="sm100a", kernel_schedule="2sm", tile=(256, 128, 64), cluster=(2, 1, 1)),
    ):
        assert reasons(config) == "", config.name


@pytest.mark.parametrize("config, expected", [
    (GemmConfig(kernel_schedule="2sm"), "does not exist on sm90a"),
    (GemmConfig(kernel_schedule="cooperative", tile=(64, 128, 64)), "needs tile M in"),
    (GemmConfig(tile=(128, 100, 64)), "tile N must be a multiple of 8"),
    (GemmConfig(tile=(128, 128, 48)), "tile K must span"),
    (GemmConfig(cluster=(4, 4, 1)), "at most 8 CTAs"),
    (GemmConfig(cluster=(1, 1, 2)), "cluster K must be 1"),
    (GemmConfig(tile=(128, 256, 64)), "accumulators per thread"),
    (GemmConfig(tile=(128, 256, 128), stages=4), "exceed"),
    # 7 x 32 KB fits alone but not with a TMA epilogue's tiles (failed to initialize on a GPU).
    (GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), cluster=(2, 2, 1), stages=7),
     "epilogue"),
    (GemmConfig(stages=1), "at least 2 pipeline stages"),
    (GemmConfig(tile_scheduler="streamk"), "stream-K needs the cooperative"),
    (GemmConfig(splits=2), "splits > 1 needs the stream-K"),
    (GemmConfig(kernel_schedule="warpspecialized"), "no TMA epilogue"),
    (GemmConfig(arch="sm100a", kernel_schedule="2sm", tile=(256, 128, 64)), "even cluster M"),
    (GemmConfig(kernel_schedule="cooperative", tile=(128, 256, 64), cluster=(2, 1, 1)),
     "does not compile"),
])
def test_rules_reject_with_a_reason(config, expected):
    assert expected in reasons(config)
    with pytest.raises(InvalidConfigError, match=expected.split()[0]):
        space.check(BF16_TN, config)


def test_operand_rules():
    tf32_nt = GemmOperands.make("f32", layout_a="col")
    assert "K-major" in reasons(GemmConfig(tile=(128, 128, 32)), tf32_nt)
    low_align = GemmOperands(**{**BF16_TN.__dict__, "alignment_a": 4})
    assert "16-byte alignment" in reasons(GemmConfig(), low_align)
    assert reasons(GemmConfig(tile=(128, 128, 32)), GemmOperands.make("f32")) == ""


def test_valid_configs_from_cutlass_tile_descriptions():
    configs = space.valid_configs(BF16_TN, Arch.SM90A)
    schedules = {c.kernel_schedule for c in configs}
    assert {KernelSchedule.PINGPONG, KernelSchedule.COOPERATIVE} <= schedules
    assert any(c.cluster != (1, 1, 1) for c in configs)
    assert any(c.tile_scheduler is TileScheduler.STREAM_K for c in configs)
    assert all(space.violations(BF16_TN, c) == [] for c in configs)
    assert configs == sorted(configs, key=lambda c: c.name)
    assert len(configs) == len(set(configs)) > 20


def test_valid_configs_sm100_include_2sm():
    configs = space.valid_configs(BF16_TN, "sm100a")
    two_sm = [c for c in configs if c.kernel_schedule is KernelSchedule.SM100_2SM]
    assert two_sm and all(c.cluster[0] % 2 == 0 for c in two_sm)


def test_an_explicit_epilogue_tile_counts_its_shared_memory():
    auto = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), cluster=(2, 1, 1))
    # CUTLASS keeps max(min(E, 4), min(E, 2) + 1) epilogue tiles for E of them per CTA tile.
    assert space.epilogue_smem_bytes(BF16_TN, auto.replace(epilogue_tile=(128, 64))) == 3 * 16384
    assert space.epilogue_smem_bytes(BF16_TN, auto.replace(epilogue_tile=(128, 128))) == 2 * 32768
    big = GemmConfig(kernel_schedule="cooperative", tile=(256, 128, 64), epilogue_tile=(128, 64))
    assert space.epilogue_smem_bytes(BF16_TN, big) == 4 * 16384
    assert space.epilogue_smem_bytes(BF16_TN, auto.replace(epilogue_schedule="nosmem")) == 0
    # 6 stages of 32 KB fit beside auto's epilogue, not beside two 128x128 output tiles.
    assert reasons(auto.replace(stages=6)) == ""
    assert "exceed" in reasons(auto.replace(stages=6, epilogue_tile=(128, 128)))
    assert reasons(auto.replace(epilogue_tile=(128, 128))) == ""


def test_an_explicit_epilogue_tile_needs_a_16_bit_output():
    config = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), epilogue_tile=(128, 64))
    assert "16-bit" in reasons(config, GemmOperands.make("bf16", out_dtype="f32"))
    assert reasons(config, GemmOperands.make("f16", layout_c="col")) == ""
