"""Decode steps of fused decoder layers replayed from CUDA graphs (cutlass_ops.step_graphs): the
same logits as without graphs and as the unconverted model, graphs really captured and replayed,
outputs that outlive the step, weights replaced after a capture, hooks, inference mode, several
batch sizes."""

import copy

import pytest
import torch

import cutlass_ops
from cutlass_ops import module_state, step_graphs
from custom_kernels.core.tolerances import relative_error

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

VOCAB = 1024


def tiny_llama(family="llama"):
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64})}
    config_name, model_name, extra = names[family]
    config = getattr(transformers, config_name)(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ours = copy.deepcopy(model)
    cutlass_ops.convert(ours)
    return model, ours


def graph_count(model) -> int:
    holders = [module_state.get(layer, step_graphs.Holder) for layer in model.model.layers]
    return sum(len(h.graphs) for h in holders if h is not None)


def describe(model) -> str:
    holders = [module_state.get(layer, step_graphs.Holder) for layer in model.model.layers]
    return "; ".join(f"layer {i}: graphs {list(h.graphs.values()) if h else None}, "
                     f"seen {len(h.seen) if h else 0}" for i, h in enumerate(holders))


def generate(model, prompt, steps=8):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 5])
def test_graphed_decoding_matches_eager_decoding_and_the_model(family, batch, monkeypatch):
    model, ours = tiny_llama(family)
    prompt = torch.randint(0, VOCAB, (batch, 12), device="cuda")
    monkeypatch.setenv("CUTLASS_OPS_STEP_GRAPHS", "0")
    plain = generate(ours, prompt)
    assert graph_count(ours) == 0
    monkeypatch.delenv("CUTLASS_OPS_STEP_GRAPHS")
    graphed = generate(ours, prompt)
    assert graph_count(ours) == 2, describe(ours)  # one per layer, for this batch size
    theirs = generate(model, prompt)
    assert torch.equal(graphed.sequences, plain.sequences)
    for step, (a, b, c) in enumerate(zip(graphed.logits, plain.logits, theirs.logits)):
        assert relative_error(a, b) < 1e-3, f"step {step}: graphed against eager"
        if torch.equal(graphed.sequences[:, :12 + step], theirs.sequences[:, :12 + step]):
            assert relative_error(a, c) < 2e-2, f"step {step}: against the unconverted model"


def layer_call(layer, model, x, position):
    positions = torch.full((x.shape[0], 1), position, device="cuda")
    cos, sin = model.model.rotary_emb(x, positions)
    return layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))


def test_outputs_outlive_the_next_replay_and_inputs_are_read_afresh(monkeypatch):
    _, ours = tiny_llama()
    layer = ours.model.layers[0]
    inputs = [torch.randn(3, 1, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    with torch.no_grad():
        outputs = [layer_call(layer, ours, x, i) for i, x in enumerate(inputs)]
        assert graph_count(ours) == 1
        monkeypatch.setenv("CUTLASS_OPS_STEP_GRAPHS", "0")
        expected = [layer_call(layer, ours, x, i) for i, x in enumerate(inputs)]
    for got, want in zip(outputs, expected):
        assert relative_error(got, want) < 1e-3


def test_weights_replaced_after_a_capture_are_read(monkeypatch):
    _, ours = tiny_llama()
    layer = ours.model.layers[0]
    x = torch.randn(2, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            layer_call(layer, ours, x, 0)
        assert graph_count(ours) == 1
        new = {k: v * 0.5 for k, v in layer.state_dict().items()}
        layer.load_state_dict(new, assign=True)  # new tensors at new addresses
        got = layer_call(layer, ours, x, 0)
        monkeypatch.setenv("CUTLASS_OPS_STEP_GRAPHS", "0")
        want = layer_call(layer, ours, x, 0)
    assert relative_error(got, want) < 1e-3
    with torch.no_grad():  # and in place, as an optimizer or load_state_dict does
        monkeypatch.delenv("CUTLASS_OPS_STEP_GRAPHS")
        for _ in range(2):
            layer_call(layer, ours, x, 0)
        for p in layer.parameters():
            p.mul_(1.5)
        got = layer_call(layer, ours, x, 0)
        monkeypatch.setenv("CUTLASS_OPS_STEP_GRAPHS", "0")
        want = layer_call(layer, ours, x, 0)
    assert relative_error(got, want) < 1e-3


def test_a_hooked_layer_runs_eagerly_and_its_hook_sees_every_call():
    _, ours = tiny_llama()
    layer = ours.model.layers[0]
    seen = []
    layer.self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.append(o.sum().item()))
    with torch.no_grad():
        for i in range(4):
            layer_call(layer, ours, torch.randn(2, 1, 256, device="cuda", dtype=torch.bfloat16),
                       i)
    assert len(seen) == 4 and len(set(seen)) == 4
    assert graph_count(ours) == 0


def test_inference_mode_and_no_grad_keep_their_own_graphs():
    _, ours = tiny_llama()
    prompt = torch.randint(0, VOCAB, (2, 12), device="cuda")
    with torch.inference_mode():
        first = ours.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    second = generate(ours, prompt, steps=6).sequences
    assert torch.equal(first, second)
    assert graph_count(ours) == 4  # two layers, two modes


def test_gradients_enabled_never_capture():
    _, ours = tiny_llama()
    x = torch.randn(2, 1, 256, device="cuda", dtype=torch.bfloat16)
    for i in range(3):
        layer_call(ours.model.layers[0], ours, x, i)
    assert graph_count(ours) == 0


def test_a_copy_of_a_model_with_graphs_decodes_on_its_own_weights():
    _, ours = tiny_llama()
    prompt = torch.randint(0, VOCAB, (2, 12), device="cuda")
    first = generate(ours, prompt).sequences
    assert graph_count(ours) == 2
    twin = copy.deepcopy(ours)
    assert graph_count(twin) == 0
    assert torch.equal(generate(twin, prompt).sequences, first)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    assert torch.equal(generate(ours, prompt).sequences, first)  # ours read its own weights
