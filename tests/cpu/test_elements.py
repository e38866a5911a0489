"""The one table of element types (custom_kernels.core.elements): every reader agrees with it,
and the kernel sources switch on its codes."""

import re
from pathlib import Path

import pytest
import torch

from custom_kernels.core import elements
from custom_kernels.core.elements import ELEMENTS, FLOATS, element
from cutlass_ops.gemms.config import DType

ROOT = Path(__file__).resolve().parents[2]
CUDA_TYPES = {"float": "f32", "__half": "f16", "__nv_bfloat16": "bf16"}


@pytest.mark.parametrize("entry", ELEMENTS, ids=lambda e: e.name)
def test_each_element_matches_torch_and_cutlass(entry):
    import cutlass_library

    assert entry.torch_dtype.itemsize == entry.bytes
    assert getattr(cutlass_library.DataType, entry.cutlass).name == entry.cutlass
    for key in (entry.name, entry.torch_name, entry.torch_dtype, entry):
        assert element(key) is entry


def test_names_and_codes_are_unique_and_fp8_is_in_the_table():
    for field in ("name", "torch_name", "cutlass", "code"):
        values = [getattr(e, field) for e in ELEMENTS]
        assert len(set(values)) == len(values), field
    assert {e.name for e in ELEMENTS if e.is_fp8} == {"e4m3", "e5m2"}
    assert elements.from_code(3).torch_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="no element type has kernel code 9"):
        elements.from_code(9)


def test_the_gemm_dtypes_are_table_entries_with_its_sizes():
    for dtype in DType:
        assert element(dtype).name == dtype.value and dtype.bytes == element(dtype).bytes


@pytest.mark.parametrize("bad", ["bf17", "int8", torch.int32, 3, None])
def test_unknown_element_types_are_a_value_error(bad):
    with pytest.raises(ValueError, match="unknown element type"):
        element(bad)
    assert elements.float_code(bad) is None


def test_float_codes_are_the_nvrtc_families_and_fp8_is_not_one():
    assert elements.float_codes() == {torch.bfloat16: 2, torch.float16: 1, torch.float32: 0}
    assert elements.float_code(torch.float8_e4m3fn) is None and elements.float_code("bf16") == 2


def test_the_kernel_sources_switch_on_the_tables_codes():
    """norm_common.cuh's DType<CODE> (every NVRTC family includes it or mirrors it) and the
    grouped launcher's GROUPED_ELEMENT take the table's codes."""
    text = (ROOT / "custom_kernels/csrc/norm_common.cuh").read_text()
    found = dict(re.findall(r"struct DType<(\d)> \{ using type = (\w+); \};", text))
    assert {int(code): CUDA_TYPES[name] for code, name in found.items()} == {
        e.code: e.name for e in FLOATS}
    launcher = (ROOT / "cutlass_ops/gemms/csrc/grouped_launcher.cu").read_text()
    bf16 = element("bf16").code
    assert f"GROUPED_ELEMENT == {bf16}, cutlass::bfloat16_t, cutlass::half_t" in launcher


def test_the_grouped_build_passes_the_tables_code():
    from cutlass_ops.gemms.grouped.grouped_build import GroupedConfig

    for name in ("bf16", "f16"):
        assert f"GROUPED_ELEMENT={element(name).code}" in GroupedConfig(name).defines()


def test_the_sources_with_their_own_code_lists_agree_with_the_table():
    clip = (ROOT / "custom_kernels/csrc/clip_grad.cu").read_text()
    assert "enum : int { kF32 = 0, kF16 = 1, kBF16 = 2 };" in clip
    assert [element(n).code for n in ("f32", "f16", "bf16")] == [0, 1, 2]
    ragged = (ROOT / "custom_kernels/csrc/ragged.cu").read_text()
    assert "DTYPE 0 fp32 / 1 fp16 / 2 bf16" in ragged
