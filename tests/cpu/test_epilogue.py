"""Fused epilogues as data: names, keys, the transposed (swap-A/B) form, the CLI's spelling, the
traced function, the emitted visitor tree, and the space rule. No GPU."""

import pytest

from cutlass_ops.gemms import space
from cutlass_ops.gemms.config import (Activation, BiasMode, Epilogue, EpilogueSchedule, GemmConfig,
                                GemmOperands, Layout)
from cutlass_ops.gemms.cutlass_bridge import epilogue_function
from cutlass_ops.gemms.choice import Choice, swapped_operands

FUSED = Epilogue(Activation.GELU_TANH, BiasMode.N, residual=True)


def test_default_epilogue_keeps_plain_names_and_dicts():
    plain = GemmOperands.make("bf16")
    assert plain.epilogue.is_default and plain.epilogue.name == ""
    assert plain.name == "bf16_bf16_bf16_bf16_f32_tnt_align8x8x8"
    assert "epilogue" not in plain.to_dict()  # cache keys of plain GEMMs did not change
    assert GemmOperands.from_dict(plain.to_dict()) == plain


def test_fused_epilogue_is_part_of_the_name_and_round_trips():
    fused = GemmOperands.make("bf16", epilogue=FUSED)
    assert fused.name.endswith("_bias_n-gelu_tanh-res")
    assert fused != GemmOperands.make("bf16") and hash(fused) != hash(GemmOperands.make("bf16"))
    assert GemmOperands.from_dict(fused.to_dict()) == fused


@pytest.mark.parametrize("text,expected", [
    ("", Epilogue()), ("none", Epilogue()),
    ("bias", Epilogue(bias=BiasMode.N)),
    ("gelu_tanh, bias, residual", FUSED),
    ("bias_m,silu", Epilogue(Activation.SILU, BiasMode.M)),
    ("relu,res", Epilogue(Activation.RELU, residual=True)),
])
def test_cli_spelling(text, expected):
    assert Epilogue.parse(text) == expected


def test_cli_spelling_rejects_unknown_parts():
    with pytest.raises(ValueError, match="tanh.*gelu_tanh"):
        Epilogue.parse("bias,tanh")


def test_swap_ab_moves_the_bias_to_the_other_extent():
    ops = GemmOperands.make("bf16", epilogue=FUSED)
    swapped = swapped_operands(ops)
    assert swapped.epilogue == Epilogue(Activation.GELU_TANH, BiasMode.M, residual=True)
    assert swapped.layout_c is Layout.COL
    assert swapped_operands(swapped) == ops
    assert Choice(GemmConfig(), swap_ab=True).operands_for(ops) == swapped


@pytest.mark.parametrize("epilogue,source", [
    (Epilogue(bias=BiasMode.N), "def epilogue(accum, alpha, bias):\n"
                                "    D = alpha * accum + bias\n    return D\n"),
    (FUSED, "def epilogue(accum, alpha, bias, beta, C):\n"
            "    D = gelu_tanh(alpha * accum + bias) + beta * C\n    return D\n"),
    (Epilogue(Activation.RELU), "def epilogue(accum, alpha):\n    D = relu(alpha * accum)\n"
                                "    return D\n"),
])
def test_traced_function(epilogue, source):
    assert epilogue_function(epilogue) == source


def test_fused_epilogue_needs_the_tma_epilogue():
    ops = GemmOperands.make("bf16", epilogue=FUSED)
    nosmem = GemmConfig(tile=(128, 128, 64), epilogue_schedule=EpilogueSchedule.NO_SMEM)
    assert any("visitor tree" in why for why in space.violations(ops, nosmem))
    assert not space.violations(ops, nosmem.replace(epilogue_schedule=EpilogueSchedule.TMA))


def test_emitted_visitor_tree():
    """cutlass_cppgen traces our function into an Sm90 EVT: a row broadcast for nn.Linear's
    bias, the column broadcast and column-major C/D strides once swapped, the tanh GELU as
    GELU_taylor, and a DeviceKernel for our launcher."""
    from cutlass_ops.gemms import emit

    config = GemmConfig(tile=(128, 128, 64))
    ops = GemmOperands.make("bf16", epilogue=FUSED)
    sources = emit.emit_sources(ops, [config])
    source = sources[config]
    assert "Sm90RowBroadcast" in source and "GELU_taylor" in source
    assert "Sm90SrcFetch" in source and "using DeviceKernel" in source
    assert "using StrideD = cute::Stride<int64_t, cute::Int<1>, int64_t>;" in source
    swapped = swapped_operands(ops)
    source = emit.emit_sources(swapped, [config])[config]
    assert "Sm90ColBroadcast" in source
    assert "using StrideD = cute::Stride<cute::Int<1>, int64_t, int64_t>;" in source
    silu = emit.emit_sources(GemmOperands.make("bf16", epilogue="silu"), [config])[config]
    assert "SiLu" in silu and "using ElementC = void;" in silu
