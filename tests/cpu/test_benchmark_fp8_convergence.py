"""benchmarks/fp8_convergence.py's plumbing on the CPU (the GPU runs the check itself:
tests/gpu/fp8/test_fp8_convergence_gpu.py): the variants a run trains, the MoE families' models
and the LM head variant, each a row by the same rule, and the rule failing a curve that drifts."""

import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import fp8_convergence  # noqa: E402

TINY = {"qwen3-moe": dict(hidden_size=128, moe_intermediate_size=128, num_experts=4,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                          vocab_size=256),
        "llama": dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=256)}


def test_the_variants_and_the_cases():
    assert fp8_convergence.variants(["rowwise"], lm_head=True) == ["rowwise", "rowwise+lm_head"]
    assert fp8_convergence.case("blockwise", "mixtral") == \
        "convergence mixtral fp8 blockwise vs bf16"
    assert fp8_convergence.case("tensorwise") == "convergence fp8 tensorwise vs bf16"
    with pytest.raises(ValueError, match="unknown family"):
        fp8_convergence.model_config("gpt2")


def test_the_rule_fails_a_curve_that_drifts():
    reference = [7.0 - 0.02 * s for s in range(40)]
    assert fp8_convergence.compare(reference, [x * 1.01 for x in reference])["passed"]
    drifted = fp8_convergence.compare(reference, [x * (1 + 0.002 * s)
                                                  for s, x in enumerate(reference)])
    assert not drifted["passed"] and drifted["max_deviation"] > fp8_convergence.CURVE_BOUND


@pytest.mark.parametrize("family, lm_head", [("qwen3-moe", False), ("llama", True)])
def test_a_short_run_gives_a_row_per_variant(family, lm_head):
    result = fp8_convergence.run(["blockwise"], steps=2, device="cpu", batch=2, seq=128,
                                 family=family, lm_head=lm_head, **TINY[family])
    cases = [r["case"] for r in result["rows"]]
    expected = [fp8_convergence.case(v, family)
                for v in fp8_convergence.variants(["blockwise"], lm_head)]
    assert cases == expected
    assert result["config"]["family"] == family
    for r in result["rows"]:
        assert r["detail"]["fp8_layers"] > 0 and len(r["detail"]["losses"]) == 1
    if lm_head:  # the LM head is FP8 in the +lm_head variant only
        plain, with_head = result["rows"]
        assert "lm_head" in with_head["detail"]["fp8_modules"]
        assert "lm_head" not in plain["detail"]["fp8_modules"]
