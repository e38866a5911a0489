"""Mixture-of-experts experts as grouped GEMMs on the GPU: convert() swaps a Hugging Face
Mixtral / Qwen3-MoE block's experts after its probe, the block's forward and gradients stay
within bf16 tolerance of the eager loop, and the converted block replays in a CUDA graph."""

import copy

import pytest
import torch

from custom_kernels.core.tolerances import relative_error

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def block(kind: str):
    if kind == "mixtral":
        config = transformers.MixtralConfig(hidden_size=256, intermediate_size=512,
                                            num_local_experts=8, num_experts_per_tok=2,
                                            num_hidden_layers=1)
        cls = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128,
                                             num_experts=16, num_experts_per_tok=4,
                                             norm_topk_prob=True, num_hidden_layers=1)
        cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    with torch.device("cuda"):
        module = cls(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return module.bfloat16()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_converted_block_matches_the_eager_loop_forward_and_backward(kind):
    import cutlass_ops
    from cutlass_ops.moe.experts import GroupedExperts

    eager = block(kind)
    ours = copy.deepcopy(eager)
    report = cutlass_ops.convert(ours)
    assert isinstance(ours.experts, GroupedExperts), str(report)
    x = torch.randn(2, 96, 256, device="cuda").bfloat16()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = eager(x1), ours(x2)
    assert relative_error(y2, y1) < 2e-2
    grad = torch.randn_like(y1)
    y1.backward(grad)
    y2.backward(grad)
    assert relative_error(x2.grad, x1.grad) < 2e-2
    for (name, p1), (_, p2) in zip(eager.named_parameters(), ours.named_parameters()):
        assert relative_error(p2.grad, p1.grad) < 3e-2, name


def test_the_converted_block_replays_in_a_cuda_graph_with_new_tokens():
    import cutlass_ops

    eager = block("mixtral")
    ours = copy.deepcopy(eager)
    cutlass_ops.convert(ours)
    x = torch.randn(1, 64, 256, device="cuda").bfloat16()
    with torch.no_grad():
        ours(x)  # warm: kernels loaded before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = ours(x)
        x.copy_(torch.randn_like(x))  # new tokens: new routing, no host sync anywhere
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(y, eager(x)) < 2e-2
