"""The e2e benchmark's checks (benchmarks/model_checks.py) on the GPU, on a small bf16 Llama
converted by convert() (fused decoder blocks, fused norms, the chunked loss head): the converted
model passes the train check (loss and every parameter's gradient against eager's) and the
teacher-forced decode check, and the same checks fail it with one decoder layer skipped or one
MLP zeroed. NVRTC only: without tuned GEMMs dispatch runs torch's, so no nvcc is needed."""

import copy
import sys
from pathlib import Path

import pytest
import torch

import cutlass_ops
from cutlass_ops import decoder_blocks

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import model_checks  # noqa: E402
from model_faults import skip_layer, zero_mlp  # noqa: E402

VOCAB, LAYERS, PROMPT, NEW = 2048, 4, 32, 16


def llama():
    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)


@pytest.fixture(scope="module")
def models():
    eager = llama()
    ours = copy.deepcopy(eager)
    report = cutlass_ops.convert(ours)
    assert all(decoder_blocks.is_fused(layer) for layer in ours.model.layers), str(report)
    return eager, ours


def train_check(model, eager):
    ids = torch.randint(0, VOCAB, (2, 512), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    steps = []
    for m in (model, eager):
        m.train()
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        steps.append((loss.float().item(), model_checks.gradients(m)))
        m.zero_grad(set_to_none=True)
    return model_checks.check_train_step(*steps[0], *steps[1],
                                         model_checks.gradient_tolerance(eager))


def decode_check(model, eager, batch=4):
    prompt = torch.randint(0, VOCAB, (batch, PROMPT), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(batch))
    eager.eval(), model.eval()
    with torch.no_grad():
        tokens = eager.generate(prompt, attention_mask=torch.ones_like(prompt),
                                max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                pad_token_id=0)
    return model_checks.teacher_forced_decode(model, eager, tokens, PROMPT)


def test_the_converted_model_passes_the_train_check(models):
    eager, ours = models
    check = train_check(ours, eager)
    assert check.ok, check.detail()
    assert check.gradients.parameters == len(list(eager.parameters()))


@pytest.mark.parametrize("batch", [1, 4])
def test_the_converted_model_passes_teacher_forced_decoding(models, batch):
    eager, ours = models
    check = decode_check(ours, eager, batch)
    assert check.ok, check.detail()
    assert len(check.step_errors) == NEW


@pytest.mark.parametrize("broken", [lambda m: skip_layer(m, 1), lambda m: zero_mlp(m, 1)],
                         ids=["skipped layer", "zeroed MLP"])
def test_a_broken_converted_model_fails_the_train_check_its_loss_would_pass(models, broken):
    eager, ours = models
    check = train_check(broken(copy.deepcopy(ours)), eager)
    assert model_checks.loss_within(check.loss, check.reference_loss)  # the old blind spot
    assert not check.ok and check.gradients.worst_error >= 1.0, check.detail()


def test_a_converted_model_with_its_last_layer_skipped_fails_teacher_forced_decoding(models):
    eager, ours = models
    check = decode_check(skip_layer(copy.deepcopy(ours), LAYERS - 1), eager)
    assert not check.ok and min(check.step_errors) > 2 * check.tolerance, check.detail()
