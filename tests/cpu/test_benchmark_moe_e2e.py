"""benchmarks/moe_e2e.py without a GPU: the models' configs (the published shapes, MoE layers
built as convert recognises them), the rows' names, the per-layer report, the arguments."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from benchmarks import moe_e2e  # noqa: E402
from cutlass_ops import decoder_blocks  # noqa: E402


@pytest.mark.parametrize("family, experts, top_k, hidden", [("qwen3-moe", 128, 8, 2048),
                                                             ("mixtral", 8, 2, 4096)])
def test_the_models_have_the_published_shapes_and_moe_layers(family, experts, top_k, hidden):
    config_class, layers, keywords = moe_e2e.MODELS[family]
    config = getattr(transformers, config_class)(num_hidden_layers=1, **keywords)
    assert config.num_experts_per_tok == top_k and config.hidden_size == hidden
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    assert decoder_blocks.looks_like_decoder_layer(layer) and decoder_blocks.has_moe_mlp(layer)
    assert layer.mlp.experts.gate_up_proj.shape[0] == experts
    assert layers == {"qwen3-moe": 4, "mixtral": 2}[family]


@pytest.mark.parametrize("case, want", [
    ("train ours vs eager", "train qwen3-moe ours vs eager"),
    ("train ours vs compile", "train qwen3-moe ours vs compile"),
    ("peak memory train ours vs eager", "peak memory train qwen3-moe ours vs eager"),
    ("prefill ours vs eager", "prefill qwen3-moe ours vs eager"),
    ("decode batch 16 ours vs eager", "decode batch 16 qwen3-moe ours vs eager"),
])
def test_rows_carry_the_family_after_their_section(case, want):
    row = moe_e2e.named({"case": case, "ratio": 1.5}, "qwen3-moe")
    assert row == {"case": want, "ratio": 1.5}


def test_the_layer_report_names_each_decoder_layer_and_experts_module():
    from cutlass_ops.nn import convert

    config = transformers.Qwen3MoeConfig(hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2,
                                         vocab_size=101, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    report = moe_e2e.layer_report(convert(model, fused_loss=False))
    assert {"model.layers.0", "model.layers.1"} <= set(report)
    assert any(name.endswith("mlp.experts") for name in report)
    assert all(text.startswith("unchanged: ") and "cpu" in text for text in report.values())


def test_quick_arguments():
    args = moe_e2e.parse_args(["--quick", "--models", "mixtral"])
    assert (args.layers, args.tokens, args.new_tokens, args.models) == (1, 1024, 16, ["mixtral"])
    assert moe_e2e.parse_args([]).models == ["qwen3-moe", "mixtral"]
