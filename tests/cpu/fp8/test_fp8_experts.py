"""FP8 experts on the CPU (cutlass_ops.fp8.fp8_experts, issue 53): the forward and the input
gradient are the float32 products of the operands as quantized (1x128 activations and output
gradients, 128x128 weights in both orientations), so every scale and layout is checked, not
just an FP8-sized error; the weight gradient is bf16's; the module keeps the parameters and
trains within FP8's error of the bf16 experts; convert makes experts FP8 only where it should."""

import pytest
import torch

from cutlass_ops.fp8 import fp8_experts
from cutlass_ops.moe.experts import GroupedExperts
from custom_kernels.core.tolerances import relative_error
from custom_kernels.fp8.fp8_quant import torch_quantize
from fp8_reference import kept_operand_sequence

COUNTS = [100, 0, 60, 96]  # an empty expert among them
E, N, K = len(COUNTS), 256, 384


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(COUNTS), K, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(E, N, K, generator=g) / 20).bfloat16().requires_grad_()
    dy = torch.randn(sum(COUNTS), N, generator=g).bfloat16()
    return x, w, dy, torch.tensor(COUNTS).cumsum(0).to(torch.int32)


def _dequantized(t, granularity):
    """``t`` as quantized with ``granularity``, widened back to float32."""
    q, scale = torch_quantize(t.detach(), granularity)
    rows = 1 if granularity == "block_1x128" else 128
    return q.float() * scale.repeat_interleave(rows, 0).repeat_interleave(128, 1)


def _per_expert(a, b_of):
    out, start = [], 0
    for e, count in enumerate(COUNTS):
        out.append(a[start:start + count] @ b_of(e))
        start += count
    return torch.cat(out)


def test_each_product_is_the_float32_product_of_its_quantized_operands():
    x, w, dy, offs = _operands()
    y = fp8_experts.fp8_routed_gemm(x, w, offs)
    y.backward(dy)
    w_q = _dequantized(w.reshape(E * N, K), "block_128x128").view(E, N, K)
    expected_y = _per_expert(_dequantized(x, "block_1x128"), lambda e: w_q[e].t())
    expected_dx = _per_expert(_dequantized(dy, "block_1x128"), lambda e: w_q[e])
    expected_dw = torch.stack([
        dy[s:s + c].float().t() @ x.detach()[s:s + c].float()
        for s, c in zip([0, *offs[:-1].tolist()], COUNTS)])
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert w.grad.shape == w.shape and w.grad.is_contiguous()
    assert relative_error(y, expected_y) < 5e-3  # bf16's rounding of the output only
    assert relative_error(x.grad, expected_dx) < 5e-3
    assert relative_error(w.grad, expected_dw) < 5e-3
    assert w.grad[1].abs().sum() == 0  # the empty expert's weight gets no gradient


def test_the_module_keeps_the_parameters_and_trains_within_fp8s_error_of_bf16():
    torch.manual_seed(0)
    hidden, inter, tokens, top_k = 256, 128, 64, 2
    experts = type("Experts", (torch.nn.Module,), {})()
    experts.gate_up_proj = torch.nn.Parameter((torch.randn(E, 2 * inter, hidden) / 16).bfloat16())
    experts.down_proj = torch.nn.Parameter((torch.randn(E, hidden, inter) / 11).bfloat16())
    experts.act_fn = torch.nn.SiLU()
    bf16 = GroupedExperts(experts)
    fp8 = fp8_experts.Fp8GroupedExperts(experts)
    assert fp8.state_dict().keys() == bf16.state_dict().keys()
    assert fp8.gate_up_proj is experts.gate_up_proj and "FP8" in repr(fp8)
    x = torch.randn(tokens, hidden).bfloat16()
    weights, index = torch.rand(tokens, E).topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    grads = []
    for module in (bf16, fp8):
        xi = x.clone().requires_grad_()
        module.zero_grad()
        out = module(xi, index, weights)
        out.float().square().sum().backward()
        grads.append((out, xi.grad, module.gate_up_proj.grad.clone(),
                      module.down_proj.grad.clone()))
    # e4m3 keeps 3 mantissa bits: each FP8 product on a value's path (both operands quantized)
    # adds about 4% of relative error, and a weight gradient's path holds three of them; a
    # misplaced scale or transposed operand would be off by 100% or more.
    for ours, theirs in zip(grads[1], grads[0]):
        assert relative_error(ours, theirs) < 0.12


def test_experts_it_cannot_run_are_refused_by_name():
    experts = type("Experts", (torch.nn.Module,), {})()
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 256, 256, dtype=torch.float16))
    experts.down_proj = torch.nn.Parameter(torch.zeros(E, 256, 128, dtype=torch.float16))
    assert "writes bf16" in fp8_experts.refusal(experts)
    experts.gate_up_proj.data = experts.gate_up_proj.data.bfloat16()
    experts.down_proj.data = torch.zeros(E, 256, 96, dtype=torch.bfloat16)
    assert "multiples of 128" in fp8_experts.refusal(experts)


@pytest.mark.parametrize("recipe, enabled, fp8", [("blockwise", True, True),
                                                  ("blockwise", False, False),
                                                  ("rowwise", True, False)])
def test_convert_makes_experts_fp8_only_under_blockwise_and_the_switch(recipe, enabled, fp8,
                                                                       monkeypatch):
    transformers = pytest.importorskip("transformers")
    from cutlass_ops.fp8.convert import convert_fp8

    monkeypatch.setattr(fp8_experts, "ENABLED", enabled)
    config = transformers.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128,
                                         num_experts=4, num_experts_per_tok=2,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=256, head_dim=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).bfloat16()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mlp = model.model.layers[0].mlp  # as cutlass_ops.convert leaves it on a GPU
    mlp.experts = GroupedExperts(mlp.experts)
    choices = {c.name: c for c in convert_fp8(model, recipe)}
    name = "model.layers.0.mlp.experts"
    experts = model.get_submodule(name)
    assert isinstance(experts, fp8_experts.Fp8GroupedExperts) == fp8
    assert (choices[name].recipe == recipe) == fp8
    if not fp8:
        assert "stay 16-bit" in choices[name].reason
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    assert experts.gate_up_proj.grad is not None


def test_a_call_that_trains_nothing_keeps_the_weights_operand_until_the_weight_changes():
    """Prefill and decoding read each weight's forward operand, quantized once: the same
    products as a training call's forward, bit for bit; made again after an optimizer step or
    an in-place write, never kept for an inference tensor, dropped with its weight."""
    x, w, _, offs = _operands()
    out, kept = kept_operand_sequence(x, w, offs)
    trained, first = out["trained"], out["first"]
    assert torch.equal(first, trained.detach()) and torch.equal(out["again"], first)
    assert kept["kept_twice"]  # not quantized again
    assert kept["renewed"]
    assert relative_error(out["doubled"], 2 * first.float()) < 1e-2
    with torch.inference_mode():
        frozen = w.detach().clone()
        fp8_experts.fp8_routed_gemm(x.detach(), frozen, offs)
    assert fp8_experts._kept(frozen) is None
    del frozen, w, trained, out  # (trained's graph holds w)
    assert not fp8_experts._FORWARD_OPERANDS  # an entry goes with its weight
