"""benchmarks/moe_fp8.py without a GPU: its quantizers give the shapes and layouts
``scaled_grouped_mm`` takes and scale each row / block to e4m3's range, their product is the bf16
product to FP8's rounding; a row's ratio is the division of its figures and its check can fail."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import moe_fp8  # noqa: E402
from cutlass_ops.fp8 import scaled_grouped_mm_op as sgm  # noqa: E402

OFFS = torch.tensor([100, 100, 300, 512], dtype=torch.int32)  # expert 1 empty


def _bf16_product(x, w):
    out, start = [], 0
    for g, end in enumerate(OFFS.tolist()):
        out.append(x[start:end].float() @ w[g].float().T)
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("quantize", [moe_fp8.quantize_rowwise, moe_fp8.quantize_blockwise])
def test_the_quantized_product_is_the_bf16_product_to_fp8_rounding(quantize):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=generator).bfloat16()
    w = (torch.randn(4, 384, 256, generator=generator) * 3).bfloat16()
    a, b, sa, sb = quantize(x, w)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and b.shape == (4, 256, 384)
    assert b.stride(1) == 1  # each expert's weight K-contiguous, as the op takes it
    # Each scale maps its row or block's amax onto e4m3's largest value.
    assert a.float().abs().amax().item() == moe_fp8.E4M3_MAX
    out = sgm.reference(a, b, sa, sb, OFFS)
    expected = _bf16_product(x, w)
    error = ((out.float() - expected).norm() / expected.norm()).item()
    assert error < 0.06, error


def test_a_row_is_the_division_of_its_figures_and_fails_past_its_bound():
    ms = {"ours": 1.25, "reference": 2.5, "torch_grouped_mm_bf16": 2.75}
    row = moe_fp8.fp8_result("blockwise", "Qwen3-30B-A3B up", 4096, "zipf", [10000, 0, 30000],
                             (2048, 768), ms, "cutlass_ops.grouped_mm bf16", 2e-3, 0.03, {})
    assert row["case"] == "scaled_grouped_mm blockwise Qwen3-30B-A3B up 768x2048 4096 tokens zipf"
    assert row["ratio"] == round(row["ours"] / row["reference"], 4)
    assert abs(row["ratio"] - 2.0) < 0.01
    assert row["detail"]["torch_grouped_mm_bf16_ms"] == 2.75
    assert row["detail"]["empty_experts"] == 1 and row["correct"]
    bad = moe_fp8.fp8_result("rowwise", "x up", 4096, "uniform", [40000], (2048, 768), ms, "t",
                             moe_fp8.BOUND, 0.03, {})
    assert not bad["correct"]
