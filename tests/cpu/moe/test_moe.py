"""Mixture-of-experts experts as grouped GEMMs (cutlass_ops.moe) on the CPU, against Hugging
Face's own experts modules (Mixtral, Qwen3-MoE; tiny configs): the forward and every gradient,
empty experts, the state_dict, structure recognition, the probe's refusal of a look-alike and
convert's report."""

import pytest
import torch

from cutlass_ops.moe import experts as moe_experts

transformers = pytest.importorskip("transformers")


def _block(cls, config, seed, dtype):
    torch.manual_seed(seed)
    block = cls(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return block.to(dtype)


def mixtral(dtype=torch.float32, experts=4):
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=96,
                                        num_local_experts=experts, num_experts_per_tok=2,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128)
    return _block(transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock, config, 0,
                  dtype)


def qwen3_moe(dtype=torch.float32):
    config = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=3, norm_topk_prob=True,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128)
    return _block(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
                  config, 1, dtype)


def grouped_copy(block):
    import copy

    ours = copy.deepcopy(block)
    ours.experts = moe_experts.GroupedExperts(ours.experts)
    return ours


def assert_same_block(ours, theirs, x_rtol=1e-5):
    """The two blocks' outputs, input gradients and every parameter's gradient agree on a
    random float32 input."""
    x = torch.randn(2, 24, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_theirs, y_ours = theirs(x1), ours(x2)
    torch.testing.assert_close(y_ours, y_theirs, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(y_ours)
    y_theirs.backward(grad)
    y_ours.backward(grad)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=x_rtol, atol=1e-5)
    theirs_grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs_grads[name].grad, rtol=1e-4, atol=1e-5,
                                   msg=name)


@pytest.mark.parametrize("make", [mixtral, qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_the_block_forward_and_gradients_match_hugging_faces(make):
    theirs = make()
    assert_same_block(grouped_copy(theirs), theirs)


def test_bfloat16_within_its_tolerance_and_experts_that_get_no_token():
    theirs = mixtral(torch.bfloat16, experts=8)
    ours = grouped_copy(theirs)
    x = torch.randn(1, 3, 64).bfloat16()  # 3 tokens x 2 slots: most of the 8 experts idle
    from custom_kernels.core.tolerances import relative_error

    assert relative_error(ours(x), theirs(x)) < 1e-2


def test_state_dict_and_parameters_are_the_modules_own():
    theirs = mixtral()
    ours = grouped_copy(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    block = mixtral()
    experts = block.experts
    grouped = moe_experts.GroupedExperts(experts)
    assert grouped.gate_up_proj is experts.gate_up_proj and grouped.down_proj is experts.down_proj


def test_structure_recognition_and_the_probe():
    block = mixtral()
    assert moe_experts.looks_like_experts(block.experts)
    assert not moe_experts.looks_like_experts(block)
    assert not moe_experts.looks_like_experts(block.gate)
    assert moe_experts.probe(block.experts) is None

    class GeluExperts(torch.nn.Module):  # built like them, with another activation
        def __init__(self, experts):
            super().__init__()
            self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
            self.act_fn = torch.nn.SiLU()

        def forward(self, x, index, weights):
            out = torch.zeros_like(x)
            for slot in range(index.shape[1]):
                for t in range(x.shape[0]):
                    e = index[t, slot]
                    gate, up = (self.gate_up_proj[e] @ x[t]).chunk(2)
                    out[t] += weights[t, slot] * (self.down_proj[e] @ (
                        torch.nn.functional.gelu(gate) * up))
            return out

    look_alike = GeluExperts(block.experts)
    assert moe_experts.looks_like_experts(look_alike)
    assert "differs" in moe_experts.probe(look_alike)


def test_convert_reports_experts_off_cuda_and_leaves_them():
    import cutlass_ops

    block = mixtral()
    model = torch.nn.Sequential(block)
    report = cutlass_ops.convert(model)
    decision = next(d for d in report.decisions if d.name == "0.experts")
    assert not decision.converted and "CUDA" in decision.reason
    assert type(block.experts).__name__ == "MixtralExperts"
    assert all(d.name != "0.experts" for d in cutlass_ops.convert(
        torch.nn.Sequential(mixtral()), experts=False).decisions)


def test_the_experts_forward_compiles_with_fullgraph():
    block = mixtral()
    x = torch.randn(16, 64)
    _, weights, index = block.gate(x)
    args = (x, index, weights, block.experts.gate_up_proj.detach(),
            block.experts.down_proj.detach())
    compiled = torch.compile(moe_experts.experts_forward, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), moe_experts.experts_forward(*args))
