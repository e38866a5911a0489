"""Hugging Face decoder models through convert(): their RMSNorm modules (not torch's own) are
recognised, probed on the GPU against our kernels and swapped; the model computes what it did,
its state_dict is unchanged, and a look-alike with other numerics stays."""

import copy

import pytest
import torch

import cutlass_ops
from custom_kernels.core.tolerances import relative_error

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def tiny_model(family):
    config_name, model_name = CONFIGS[family]
    config = getattr(transformers, config_name)(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():  # norm weights away from their initial ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", list(CONFIGS))
def test_convert_swaps_hugging_face_norms_and_keeps_the_numbers(family):
    model = tiny_model(family)
    reference = copy.deepcopy(model)
    report = cutlass_ops.convert(model)
    norms = [d for d in report.decisions if d.kind.endswith("RMSNorm")]
    # input and post-attention norms per layer, the final norm, and Qwen3's q / k norms
    assert norms and all(d.converted for d in norms), report
    assert type(model.model.norm).__name__ == "RMSNorm"
    assert model.state_dict().keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    ids = torch.randint(0, 1024, (2, 64), device="cuda")
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    assert relative_error(ours, theirs) < 2e-2


def test_training_step_matches_the_unconverted_model():
    model = tiny_model("llama").train()
    reference = copy.deepcopy(model)
    cutlass_ops.convert(model)
    ids = torch.randint(0, 1024, (2, 64), device="cuda")
    for m in (model, reference):
        m(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if "norm" in name:
            assert relative_error(p.grad, q.grad) < 5e-2, name


def test_a_look_alike_with_other_numerics_stays():
    class MeanSubtracting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(256, device="cuda", dtype=torch.bfloat16))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            h = x.float()
            h = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(
                h.var(-1, keepdim=True, unbiased=False) + self.variance_epsilon)
            return self.weight * h.to(x.dtype)

    model = torch.nn.Sequential(MeanSubtracting())
    report = cutlass_ops.convert(model)
    assert "differs from an RMSNorm" in report.skipped["0"]
    assert type(model[0]) is MeanSubtracting


def test_gemma_norms_convert_to_the_offset_variant_and_keep_the_numbers():
    config = transformers.GemmaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():  # Gemma's norm weights start at zero (an offset from one)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    ours = copy.deepcopy(model)
    report = cutlass_ops.convert(ours)
    norms = [d for d in report.decisions if d.kind == "GemmaRMSNorm"]
    assert norms and all(d.converted and "Gemma" in d.reason for d in norms), str(report)
    layers = [d for d in report.decisions if d.kind == "GemmaDecoderLayer"]
    assert layers and all(not d.converted and "not SiLU" in d.reason for d in layers)
    assert type(ours.model.norm).__name__ == "OffsetRMSNorm"
    ids = torch.randint(0, 1024, (2, 32), device="cuda")
    with torch.no_grad():
        assert relative_error(ours(ids).logits, model(ids).logits) < 2e-2
