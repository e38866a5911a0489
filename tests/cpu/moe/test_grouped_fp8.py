"""The FP8 blockwise grouped kernel's operands on the CPU (cutlass_ops.gemms.grouped.
grouped_fp8_runtime, issue 53): the layouts it reads mean what cutlass_ops.scaled_grouped_mm means
(whose reference tests/cpu/fp8 checks against the definition), the scale layouts, the inputs it
refuses, and the kernel configs' names. The kernel itself: tests/compile (it builds) and, once run, tests/gpu."""

import pytest
import torch

from cutlass_ops.fp8 import scaled_grouped_mm_op as sgm
from cutlass_ops.gemms.grouped import grouped_build
from cutlass_ops.gemms.grouped import grouped_fp8_runtime as fp8g

FP8 = torch.float8_e4m3fn


def _operands(offs, n=256, k=384, experts=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts = experts or len(offs)
    m = max(offs) if offs else 0
    a = (torch.randn(m, k, generator=g) * 2).to(FP8)
    b = (torch.randn(experts, n, k, generator=g) * 2).to(FP8)
    scale_a = torch.rand(m, k // 128, generator=g) + 0.5
    scale_b = torch.rand(experts, n // 128, k // 128, generator=g) + 0.5
    return a, b, scale_a, scale_b, torch.tensor(offs, dtype=torch.int32)


def _op_reference(a, b, scale_a, scale_b, offs):
    """The public op's reference on the kernel's operands: b [E, N, K] and scale_b
    [E, N/128, K/128] are the op's [E, K, N] and [E, K/128, N/128] transposed."""
    return sgm.reference(a, b.transpose(1, 2), scale_a, scale_b.transpose(1, 2), offs)


def test_the_kernels_layouts_are_the_public_ops_semantics_with_an_empty_expert():
    """The scales as the kernel takes them (scale_a in any strides, scale_b re-laid by
    weight_scale_layout, b's transposed) and as contiguous tensors in the op's orientation give
    one product: the layouts mean what the op means (whose reference is checked against the
    definition in tests/cpu/fp8)."""
    a, b, scale_a, scale_b, offs = _operands([3, 3, 7], n=256, k=384)
    sa, sb = scale_a.t().contiguous().t(), fp8g.weight_scale_layout(scale_b)
    got = _op_reference(a, b, sa, sb, offs)
    expected = sgm.reference(a, b.transpose(1, 2), scale_a.contiguous(),
                             scale_b.transpose(1, 2).contiguous(), offs)
    assert torch.equal(got, expected)
    assert got[:3].abs().sum() > 0 and got[3:7].abs().sum() > 0


def test_rows_past_the_last_offset_stay_zero():
    a, b, scale_a, scale_b, _ = _operands([4, 8])
    out = _op_reference(a, b, scale_a, scale_b, torch.tensor([4, 6], dtype=torch.int32))
    assert out[6:].abs().sum() == 0 and out[:6].abs().sum() > 0


def test_weight_scales_come_out_in_the_layout_the_kernel_reads():
    a, b, scale_a, scale_b, offs = _operands([5, 9])
    sb = fp8g.weight_scale_layout(scale_b)
    assert sb.transpose(1, 2).is_contiguous() and torch.equal(sb, scale_b)
    assert fp8g.weight_scale_layout(sb).data_ptr() == sb.data_ptr()  # no second copy


def test_the_kernel_takes_activation_scales_in_any_strides():
    """CUTLASS's mainloop reads each expert's scale_a as a packed block of its own; the launcher
    packs them on the device, so any layout of [M, K/128] is taken."""
    a, b, scale_a, scale_b, offs = _operands([5, 9])
    sb = fp8g.weight_scale_layout(scale_b)
    for sa in (scale_a.contiguous(), scale_a.t().contiguous().t()):
        assert fp8g.refusal(a, b, sa, sb, offs) == \
            "every tensor on one CUDA device"  # (CPU tensors: only the device rule is left)


@pytest.mark.parametrize("change, message", [
    ("a_dtype", "e4m3"), ("k", "multiples of 128"), ("offs_dtype", "int32"),
    ("scale_a_shape", "scale_a must be float32"), ("scale_b_shape", "N blocks"), ("cpu", "CUDA")])
def test_the_kernel_refuses_what_it_cannot_read(change, message):
    a, b, scale_a, scale_b, offs = _operands([5, 9])
    scale_b = fp8g.weight_scale_layout(scale_b)
    if change == "a_dtype":
        a = a.to(torch.bfloat16)
    elif change == "k":
        a, b = a[:, :200], b[:, :, :200]
    elif change == "offs_dtype":
        offs = offs.long()
    elif change == "scale_a_shape":
        scale_a = scale_a[:, :1]
    elif change == "scale_b_shape":
        scale_b = scale_b[:, :1]
    why = fp8g.refusal(a, b, scale_a, scale_b, offs)
    assert why is not None and message in why


def test_config_names_round_trip_and_bad_configs_are_refused():
    config = grouped_build.GroupedFp8Config(pingpong=True, tile=(64, 128), cluster=(2, 1))
    assert grouped_build.GroupedFp8Config.from_name(config.name) == config
    assert config.launcher.name == "grouped_fp8_launcher.cu" and config.launcher.is_file()
    for bad in (dict(tile=(64, 128)), dict(tile=(128, 256)), dict(cluster=(2, 2))):
        with pytest.raises(ValueError, match="grouped FP8 config"):
            grouped_build.GroupedFp8Config(**bad)


@pytest.mark.parametrize("change, message", [
    (None, "CUDA"),  # every rule of the rowwise kernel holds: only the device is left
    ("k", "multiples of 16"), ("scale_a_shape", "rowwise scale_a"),
    ("scale_a_strided", "rowwise scale_a"), ("scale_b_blockwise", "rowwise scale_b")])
def test_a_rowwise_kernel_refuses_what_it_cannot_read(change, message):
    """The rowwise build reads torch's scales, [M] and [E, N], contiguous, in its epilogue."""
    a, b, _, _, offs = _operands([5, 9])
    m, (experts, n, k) = a.shape[0], b.shape
    scale_a, scale_b = torch.rand(m), torch.rand(experts, n)
    if change == "k":
        a, b = a[:, :200], b[:, :, :200]
    elif change == "scale_a_shape":
        scale_a = scale_a[:, None]
    elif change == "scale_a_strided":
        scale_a = torch.rand(2 * m)[::2]
    elif change == "scale_b_blockwise":
        scale_b = torch.rand(experts, n // 128, k // 128)
    why = fp8g.refusal(a, b, scale_a, scale_b, offs, "rowwise")
    assert why is not None and message in why
