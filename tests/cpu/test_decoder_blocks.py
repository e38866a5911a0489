"""cutlass_ops.decoder_blocks on the CPU: recognition of Hugging Face decoder layers by
structure, the probe's refusals, the report, and the fused block's arithmetic against the
layer's own forward (float32, the kernels' torch fallbacks) for Llama, Mistral, Qwen2 and Qwen3:
logits, loss, gradients, generate(), state_dict, moves and gradient checkpointing."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cutlass_ops import decoder_blocks, fused_linear  # noqa: E402
from cutlass_ops.block_gemms import BF16  # noqa: E402
from cutlass_ops.nn import convert  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2, vocab_size=101,
             max_position_embeddings=128)


def _model(family: str, attention: str = "sdpa"):
    configs = {
        "llama": lambda: transformers.LlamaConfig(**SMALL),
        "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=6),
        "qwen2": lambda: transformers.Qwen2Config(**SMALL),
        "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
    }
    config = configs[family]()
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # no zero biases or unit norm weights that would hide a mix-up
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _fuse_all(model) -> int:
    fused = 0
    for module in list(model.modules()):
        if decoder_blocks.looks_like_decoder_layer(module):
            assert decoder_blocks.fuse(module, require_gpu=False) is None
            fused += 1
    return fused


FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_model_matches_the_model_forward_and_backward(family):
    model = _model(family)
    ours = copy.deepcopy(model)
    assert _fuse_all(ours) == 2
    assert all(decoder_blocks.is_fused(layer) for layer in ours.model.layers)
    assert_same_logits_and_gradients(ours, model)


def assert_same_logits_and_gradients(ours, model):
    """Logits and every parameter's gradient of a loss on random ids, ours against the model's
    (a parameter without a gradient in the model, as an expert no token reached, has none or a
    zero one in ours)."""
    ids = torch.randint(0, 101, (2, 12))
    out_theirs = model(ids, labels=ids)
    out_ours = ours(ids, labels=ids)
    torch.testing.assert_close(out_ours.logits, out_theirs.logits, rtol=1e-4, atol=1e-4)
    out_theirs.loss.backward()
    out_ours.loss.backward()
    theirs = dict(model.named_parameters())
    for name, p in ours.named_parameters():
        if theirs[name].grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-3, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_model_generates_the_same_tokens_with_the_cache(family):
    model = _model(family)
    ours = copy.deepcopy(model)
    _fuse_all(ours)
    ids = torch.randint(0, 101, (2, 5))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
    theirs, mine = model.generate(ids, **kwargs), ours.generate(ids, **kwargs)
    assert torch.equal(mine.sequences, theirs.sequences)
    for a, b in zip(mine.logits, theirs.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_eager_attention_and_a_sliding_window_take_the_model_s_path():
    model = _model("mistral", attention="eager")
    ours = copy.deepcopy(model)
    _fuse_all(ours)
    ids = torch.randint(0, 101, (1, 16))  # longer than the window of 6
    torch.testing.assert_close(ours(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_state_dict_and_parameters_are_unchanged():
    model = _model("qwen2")  # with q/k/v biases
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    _fuse_all(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert [n for n, _ in model.named_parameters()] == names
    assert all(a is b for a, b in zip(model.parameters(), params))
    layer = model.model.layers[0]
    assert isinstance(layer, type(_model("qwen2").model.layers[0]))
    # a checkpoint of the unconverted model loads into the fused one, and back
    fresh = _model("qwen2")
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(fresh.state_dict())
    assert fused_linear.is_packed([layer.self_attn.q_proj, layer.self_attn.k_proj,
                                   layer.self_attn.v_proj])


def test_a_copied_fused_model_is_packed_again_and_trains_with_the_same_bits():
    """Parameter.__deepcopy__ clones each weight into a storage of its own; the copy's fused
    blocks pack them again, so it takes the one-GEMM path as the original does."""
    model = _model("qwen2")  # with q/k/v biases
    _fuse_all(model)
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        assert fused_linear.is_packed([attention.q_proj, attention.k_proj, attention.v_proj])
        assert fused_linear.is_packed([mlp.gate_proj, mlp.up_proj])
        assert attention.q_proj.bias.untyped_storage().data_ptr() == \
            attention.v_proj.bias.untyped_storage().data_ptr()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    for m in (model, twin):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_loading_a_checkpoint_keeps_the_weights_packed_or_still_correct():
    model = _model("llama")
    _fuse_all(model)
    other = _model("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    model.load_state_dict(other.state_dict())  # copies into the packed storage
    ids = torch.randint(0, 101, (1, 7))
    torch.testing.assert_close(model(ids).logits, other(ids).logits, rtol=1e-4, atol=1e-4)


def test_moving_the_model_packs_the_weights_again():
    model = _model("llama")
    _fuse_all(model)
    model.to(torch.float64)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.dtype == torch.float64
    assert fused_linear.is_packed([attention.q_proj, attention.k_proj, attention.v_proj])
    mlp = model.model.layers[0].mlp
    assert fused_linear.is_packed([mlp.gate_proj, mlp.up_proj])


def test_gradient_checkpointing_still_works():
    model = _model("llama")
    ours = copy.deepcopy(model)
    _fuse_all(ours)
    ours.gradient_checkpointing_enable()
    ours.train()
    ids = torch.randint(0, 101, (2, 8))
    ours(ids, labels=ids).loss.backward()
    model.train()
    model(ids, labels=ids).loss.backward()
    torch.testing.assert_close(ours.model.layers[0].mlp.down_proj.weight.grad,
                               model.model.layers[0].mlp.down_proj.weight.grad,
                               rtol=1e-3, atol=1e-5)


def test_unfuse_restores_the_classes():
    model = _model("llama")
    layer = model.model.layers[0]
    classes = (type(layer), type(layer.self_attn), type(layer.mlp))
    assert decoder_blocks.fuse(layer, require_gpu=False) is None
    assert type(layer) is not classes[0]
    decoder_blocks.unfuse(layer)
    assert (type(layer), type(layer.self_attn), type(layer.mlp)) == classes


def test_sharded_weights_are_fused_only_through_an_adopter():
    """A layer a tensor-parallel plan sharded (DTensor weights, marked by their placements here)
    is refused without an adopter, and the adopter's refusal is the layer's (unchanged both
    times); its GEMMs stay the 16-bit ones."""
    model = _model("llama")
    layer = model.model.layers[0]
    layer.self_attn.q_proj.weight.placements = ()  # what fuse looks for on a DTensor weight
    classes = (type(layer), type(layer.self_attn), type(layer.mlp))
    why = decoder_blocks.fuse(layer, require_gpu=False)
    assert why is not None and "tensor-parallel" in why
    adopted = []
    why = decoder_blocks.fuse(layer, require_gpu=False,
                              adopt=lambda attention, mlp: adopted.append(mlp) or "not this plan")
    assert why == "not this plan" and adopted == [layer.mlp]
    assert (type(layer), type(layer.self_attn), type(layer.mlp)) == classes
    assert decoder_blocks.gemms_of(layer.self_attn) is BF16


def test_the_probe_refuses_a_look_alike_with_another_activation():
    model = _model("llama")
    layer = model.model.layers[0]
    layer.mlp.act_fn = torch.nn.GELU()  # same structure, other numerics
    classes = (type(layer), type(layer.self_attn), type(layer.mlp))
    why = decoder_blocks.fuse(layer, require_gpu=False)
    assert why is not None and "not SiLU" in why
    assert (type(layer), type(layer.self_attn), type(layer.mlp)) == classes


def test_the_probe_refuses_a_parallel_residual_layer():
    class Parallel(type(_model("llama").model.layers[0])):
        def forward(self, hidden_states, **kwargs):  # attention and MLP from the same norm
            x = self.input_layernorm(hidden_states)
            kwargs.pop("position_ids", None)
            a, _ = self.self_attn(x, kwargs["position_embeddings"], None)
            return hidden_states + a + self.mlp(x)

    model = _model("llama")
    layer = model.model.layers[0]
    layer.__class__ = Parallel
    assert "differs" in decoder_blocks.fuse(layer, require_gpu=False)


def test_structure_refusals_name_what_is_missing():
    model = _model("llama")
    layer = model.model.layers[0]
    assert decoder_blocks.structure_refusal(torch.nn.Linear(4, 4)) is not None
    extra = copy.deepcopy(layer)
    extra.pre_feedforward_layernorm = torch.nn.LayerNorm(64)  # Gemma 2's extra norms
    assert not decoder_blocks.looks_like_decoder_layer(extra)
    no_v = copy.deepcopy(layer)
    del no_v.self_attn.v_proj
    assert "q/k/v/o" in decoder_blocks.structure_refusal(no_v, require_gpu=False)
    odd = copy.deepcopy(layer)
    odd.mlp.gate_proj = torch.nn.Linear(64, 50, bias=False)
    assert "width" in decoder_blocks.structure_refusal(odd, require_gpu=False)
    # on the CPU with the GPU rule: refused, saying where the weights are
    assert "cpu" in decoder_blocks.structure_refusal(layer)


def test_convert_reports_each_decoder_layer():
    model = _model("llama")
    report = convert(model, fused_loss=False)
    layers = {d.name: d for d in report.decisions if d.kind == "LlamaDecoderLayer"}
    assert set(layers) == {"model.layers.0", "model.layers.1"}
    assert all(not d.converted and "cpu" in d.reason for d in layers.values())
    excluded = convert(_model("llama"), exclude=("model.layers.1",), fused_loss=False)
    reasons = {d.name: d.reason for d in excluded.decisions}
    assert reasons["model.layers.1"] == "excluded by the caller"


def test_fused_model_compiles_without_graph_breaks():
    model = _model("llama")
    _fuse_all(model)
    ids = torch.randint(0, 101, (1, 6))
    expected = model(ids).logits
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-4, atol=1e-4)


# ---- mixture-of-experts decoder layers: the attention half fused, the experts the model's ----

MOE_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=101, max_position_embeddings=128,
                 num_experts_per_tok=2)


def _moe_model(family: str):
    configs = {
        "mixtral": lambda: transformers.MixtralConfig(**MOE_SMALL, intermediate_size=96,
                                                      num_local_experts=4),
        "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**MOE_SMALL, moe_intermediate_size=32,
                                                         num_experts=8, head_dim=32,
                                                         norm_topk_prob=True),
        "qwen2-moe": lambda: transformers.Qwen2MoeConfig(**MOE_SMALL, moe_intermediate_size=32,
                                                         num_experts=4,
                                                         shared_expert_intermediate_size=48),
    }
    config = configs[family]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_moe_layers_fuse_their_attention_and_match_forward_and_backward(family):
    model = _moe_model(family)
    ours = copy.deepcopy(model)
    assert _fuse_all(ours) == 2
    for layer in ours.model.layers:
        assert decoder_blocks.is_fused(layer) and decoder_blocks.has_moe_mlp(layer)
        assert isinstance(layer.mlp, decoder_blocks.FusedMoEMLP)
        assert isinstance(layer.self_attn, decoder_blocks.FusedAttention)
    assert_same_logits_and_gradients(ours, model)


def test_moe_layers_generate_the_same_tokens_and_unfuse():
    model = _moe_model("qwen3-moe")
    ours = copy.deepcopy(model)
    _fuse_all(ours)
    prompt = torch.randint(0, 101, (1, 7))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kwargs), model.generate(prompt, **kwargs))
    layer = ours.model.layers[0]
    decoder_blocks.unfuse(layer)
    assert not decoder_blocks.is_fused(layer)
    assert type(layer.mlp) is type(model.model.layers[0].mlp)


def test_the_moe_probe_replaces_the_experts_and_still_refuses_a_wrong_block(monkeypatch):
    """The probe swaps the experts for a fixed map (routing is a step function of its input)
    and restores them; a fused attention half that computed something else is refused."""
    model = _moe_model("mixtral")
    layer = model.model.layers[0]
    experts_forward = type(layer.mlp).forward
    monkeypatch.setattr(decoder_blocks.FusedMoEMLP, "residual_forward",
                        lambda self, x, residual, x_fp8=None: self(x))  # forgets the residual
    why = decoder_blocks.fuse(layer, require_gpu=False)
    assert why is not None and "differs" in why
    assert not decoder_blocks.is_fused(layer) and "forward" not in vars(layer.mlp)
    assert type(layer.mlp).forward is experts_forward


def test_moe_structure_refusals_and_the_report():
    model = _moe_model("qwen3-moe")
    layer = model.model.layers[0]
    assert decoder_blocks.structure_refusal(layer, require_gpu=False) is None
    odd = copy.deepcopy(layer)
    del odd.mlp.gate
    assert "mixture of experts" in decoder_blocks.structure_refusal(odd, require_gpu=False)
    report = convert(model, fused_loss=False)
    layers = {d.name: d for d in report.decisions if d.kind == "Qwen3MoeDecoderLayer"}
    assert set(layers) == {"model.layers.0", "model.layers.1"}
    assert all(not d.converted and "cpu" in d.reason for d in layers.values())


def test_shared_experts_run_as_fused_mlps_and_unfuse():
    """Qwen2-MoE's shared expert (a dense SwiGLU MLP beside the routed experts) becomes a
    FusedMLP after its own probe; one with another activation stays as it is."""
    model = _moe_model("qwen2-moe")
    ours = copy.deepcopy(model)
    _fuse_all(ours)
    for layer in ours.model.layers:
        assert set(decoder_blocks.shared_expert_mlps(layer.mlp)) == {"shared_expert"}
        assert isinstance(layer.mlp.shared_expert, decoder_blocks.FusedMLP)
    decoder_blocks.unfuse(ours.model.layers[0])
    assert type(ours.model.layers[0].mlp.shared_expert) is \
        type(model.model.layers[0].mlp.shared_expert)
    gelu = _moe_model("qwen2-moe")
    for layer in gelu.model.layers:
        layer.mlp.shared_expert.act_fn = torch.nn.GELU()
    reference = copy.deepcopy(gelu)
    _fuse_all(gelu)
    assert not any(isinstance(layer.mlp.shared_expert, decoder_blocks.FusedMLP)
                   for layer in gelu.model.layers)
    assert all(decoder_blocks.is_fused(layer) for layer in gelu.model.layers)
    assert_same_logits_and_gradients(gelu, reference)
