"""benchmarks/moe.py without a GPU: the block row's reference is Hugging Face's grouped_mm
experts (the per-expert loop only in ``detail``), its ratio the division of its figures, its
check's bound and error recorded; HF's grouped_mm copy of a block runs the same weights."""

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import moe  # noqa: E402

MS = {"ours": 4.0626, moe.HF_GROUPED: 5.3378, moe.HF_EAGER: 214.8017}


def test_the_block_row_is_against_hf_grouped_mm_with_the_loop_in_detail():
    row = moe.block_result("Qwen3-30B-A3B", 4096, MS, {"ours": 6e-3, moe.HF_GROUPED: 5e-3},
                           ["experts"])
    assert row["case"] == "block Qwen3-30B-A3B forward+backward 4096 tokens ours vs hf grouped_mm"
    assert row["reference_name"] == "hf grouped_mm"
    assert row["ours"] == round(4096 / MS["ours"] * 1e3, 1)
    assert row["reference"] == round(4096 / MS[moe.HF_GROUPED] * 1e3, 1)
    assert row["ratio"] == round(row["ours"] / row["reference"], 4)
    assert 1.2 < row["ratio"] < 1.4  # not the loop's 52.9x
    detail = row["detail"]
    assert detail["reference_ms"] == MS[moe.HF_GROUPED]
    assert detail[moe.HF_EAGER] == round(4096 / MS[moe.HF_EAGER] * 1e3, 1)
    assert detail["hf_eager_experts_ms"] == MS[moe.HF_EAGER]
    assert (detail["relative_error"], detail["error_bound"]) == (6e-3, moe.BLOCK_BOUND)
    assert detail["hf_grouped_mm_relative_error"] == 5e-3
    assert row["correct"]


@pytest.mark.parametrize("error, converted", [(moe.BLOCK_BOUND, ["experts"]), (1e-3, [])])
def test_the_block_row_fails_past_its_bound_or_when_nothing_was_converted(error, converted):
    row = moe.block_result("Mixtral-8x7B", 4096, MS, {"ours": error, moe.HF_GROUPED: 1e-3},
                           converted)
    assert not row["correct"]


def test_without_hf_grouped_mm_the_row_says_it_is_against_the_loop():
    ms = {k: v for k, v in MS.items() if k != moe.HF_GROUPED}
    row = moe.block_result("Mixtral-8x7B", 4096, ms, {"ours": 1e-3}, ["experts"],
                           "RuntimeError: no grouped_mm")
    assert row["case"].endswith("ours vs hf eager experts")
    assert row["reference_name"] == moe.HF_EAGER
    assert row["ratio"] == round(row["ours"] / row["reference"], 4)
    assert row["detail"]["hf_grouped_mm_failed"] == "RuntimeError: no grouped_mm"
    assert moe.HF_EAGER not in row["detail"]


def test_rate_fields_ratio_is_the_division_of_the_rounded_figures():
    fields = moe.rate_fields("TFLOP/s", 612.349, 598.051, "torch._grouped_mm")
    assert (fields["ours"], fields["reference"]) == (612.3, 598.1)
    assert fields["ratio"] == round(612.3 / 598.1, 4)


def tiny_qwen3_block():
    config = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32,
                                         num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=True, num_hidden_layers=1)
    cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    return moe.eager_block(cls, config, "cpu"), config


def test_hf_grouped_copy_runs_grouped_mm_on_the_same_weights_as_the_loop():
    eager, config = tiny_qwen3_block()
    grouped = moe.hf_grouped_copy(eager, config)
    assert grouped.experts.config._experts_implementation == "grouped_mm"
    assert eager.experts.config._experts_implementation == "eager"  # left alone
    x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    grad = torch.randn_like(x)
    y_eager, dx_eager = moe.block_step(eager, x, grad)()
    y_grouped, dx_grouped = moe.block_step(grouped, x, grad)()
    assert moe.relative_error(y_grouped, y_eager) < moe.BLOCK_BOUND
    assert moe.relative_error(dx_grouped, dx_eager) < moe.BLOCK_BOUND
    # the copy's weights are the block's, not fresh ones
    for (name, a), b in zip(eager.named_parameters(), grouped.parameters()):
        assert torch.equal(a, b), name
