"""FP8 operands in the GEMM chain (issue 38, the first part of the kernels): their names and
dicts leave every earlier GEMM's unchanged, the space's FP8 rules, the plain entry points'
refusal, and the emission of an sm90 FP8 fast-accumulation kernel through cutlass_cppgen."""

import dataclasses

import pytest
import torch

from cutlass_ops.gemms import emit, inputs, space
from cutlass_ops.gemms.config import DType, GemmConfig, GemmOperands
from custom_kernels.core.errors import UnsupportedInputError

FP8 = dataclasses.replace(GemmOperands.make("e4m3", out_dtype="bf16"), fast_accum=True)
COOPERATIVE = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 128))
PINGPONG = GemmConfig(kernel_schedule="pingpong", tile=(64, 128, 128), cluster=(2, 1, 1))


def test_fp8_operands_name_their_types_and_mode_and_leave_older_names_alone():
    assert FP8.name == "e4m3_e4m3_bf16_bf16_f32_tnt_align16x16x8_fastaccum"
    assert (FP8.alignment_a, FP8.alignment_b, FP8.alignment_c) == (16, 16, 8)
    assert GemmOperands.from_dict(FP8.to_dict()) == FP8 and FP8.is_fp8
    bf16 = GemmOperands.make("bf16")
    assert "fast_accum" not in bf16.to_dict() and not bf16.name.endswith("fastaccum")
    assert GemmOperands.from_dict(bf16.to_dict()) == bf16
    assert DType.E4M3.bytes == 1


def test_the_space_keeps_fp8_to_what_cutlass_builds():
    assert space.violations(FP8, COOPERATIVE) == [] and space.violations(FP8, PINGPONG) == []
    mixed = dataclasses.replace(FP8, element_b=DType.E5M2)
    assert space.violations(mixed, COOPERATIVE) == []

    def why(operands=FP8, config=COOPERATIVE):
        return "; ".join(space.violations(operands, config))

    assert "K = 128" in why(config=COOPERATIVE.replace(tile=(128, 128, 64)))
    assert "K-major" in why(dataclasses.replace(FP8, layout_b=FP8.layout_a))
    assert "e5m2 x e5m2" in why(dataclasses.replace(mixed, element_a=DType.E5M2))
    assert "writes bf16" in why(dataclasses.replace(FP8, element_c=DType.E4M3,
                                                    element_d=DType.E4M3, alignment_c=16))
    assert "sm90a only" in why(config=GemmConfig(arch="sm100a", kernel_schedule="1sm",
                                                 tile=(128, 128, 128)))
    assert "two FP8 operands" in why(dataclasses.replace(FP8, element_b=DType.BF16,
                                                         alignment_b=8))
    assert "FP8 mode" in why(dataclasses.replace(GemmOperands.make("bf16"), fast_accum=True),
                             GemmConfig())
    assert "Tile Size" not in why() and "at least 128" not in why()  # cooperative M = 128 is fine


def test_the_plain_gemm_entry_points_send_fp8_to_scaled_mm():
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    with pytest.raises(UnsupportedInputError, match="go through cutlass_ops.scaled_mm"):
        inputs.check_product(a, a.t())


@pytest.mark.parametrize("config", [COOPERATIVE, PINGPONG], ids=["cooperative", "pingpong"])
def test_an_fp8_fast_accumulation_kernel_is_emitted(config):
    source = emit.emit_sources(FP8, [config])[config]
    assert "cutlass::float_e4m3_t, cutlass::layout::RowMajor, 16" in source
    assert "cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, 16" in source
    schedule = "Cooperative" if config is COOPERATIVE else "Pingpong"
    assert f"KernelTmaWarpSpecialized{schedule}FP8FastAccum" in source
    assert "cute::Shape<cute::_{}, cute::_128, cute::_128>".format(config.tile[0]) in source
