"""A Hugging Face causal LM converted with fused_loss: called with labels, its loss comes from the
chunked head (no logits) and equals the model's own; without labels nothing changes. On the CPU
(the chunked loss is torch's computation there and on a GPU alike)."""

import copy

import pytest
import torch

import cutlass_ops
from cutlass_ops import lm_loss

transformers = pytest.importorskip("transformers")


def tiny_llama(dtype=torch.float32):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=300, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def batch():
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def test_the_loss_and_gradients_equal_the_models_own():
    model = tiny_llama()
    reference = copy.deepcopy(model)
    report = cutlass_ops.convert(model)
    decision = next(d for d in report.decisions if d.name == "lm_head+loss")
    assert decision.converted, decision.reason
    ids, labels = batch()
    ours = model(input_ids=ids, labels=labels)
    theirs = reference(input_ids=ids, labels=labels)
    assert ours.logits is None and theirs.logits is not None
    assert torch.allclose(ours.loss, theirs.loss, rtol=1e-5)
    ours.loss.backward()
    theirs.loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_num_items_in_batch_and_positional_input_ids():
    model = tiny_llama()
    reference = copy.deepcopy(model)
    cutlass_ops.convert(model)
    ids, labels = batch()
    ours = model(ids, labels=labels, num_items_in_batch=torch.tensor(40))
    theirs = reference(ids, labels=labels, num_items_in_batch=torch.tensor(40))
    assert torch.allclose(ours.loss, theirs.loss, rtol=1e-5)


def test_without_labels_nothing_changes():
    model = tiny_llama()
    reference = copy.deepcopy(model)
    cutlass_ops.convert(model)
    ids, _ = batch()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        assert torch.equal(model.generate(ids[:1, :6], max_new_tokens=4, do_sample=False),
                           reference.generate(ids[:1, :6], max_new_tokens=4, do_sample=False))
    assert model.state_dict().keys() == reference.state_dict().keys()


def test_a_model_with_another_loss_keeps_its_forward():
    class Doubled(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            if out.loss is not None:
                out.loss = out.loss * 2
            return out

    model = tiny_llama()
    doubled = Doubled(model.config)
    why = lm_loss.route(doubled)
    assert "differs from ours" in why
    assert "forward" not in vars(doubled)


def test_routing_twice_and_unrouting():
    model = tiny_llama()
    assert lm_loss.route(model) is None
    assert lm_loss.structure_refusal(model) == "its loss is routed already"
    lm_loss.unroute(model)
    ids, labels = batch()
    assert model(input_ids=ids, labels=labels).logits is not None


def test_not_a_causal_lm():
    assert lm_loss.structure_refusal(torch.nn.Linear(4, 4)) == "no lm_head Linear"


def test_a_routed_model_compiles_with_fullgraph():
    model = tiny_llama()
    reference = copy.deepcopy(model)
    cutlass_ops.convert(model)
    ids, labels = batch()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ours = compiled(input_ids=ids, labels=labels)
    assert ours.logits is None
    assert torch.allclose(ours.loss, reference(input_ids=ids, labels=labels).loss, rtol=1e-5)
    ours.loss.backward()
    assert model.lm_head.weight.grad is not None


def test_with_activation_checkpointing():
    model = tiny_llama()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable()
        m.train()
    cutlass_ops.convert(model)
    ids, labels = batch()
    ours, theirs = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert torch.allclose(ours.loss, theirs.loss, rtol=1e-5)
    ours.loss.backward()
    theirs.loss.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
