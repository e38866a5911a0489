"""Greedy decoding with each step one CUDA graph (cutlass_ops.graphed_decode) on a converted
Hugging Face Llama and an unconverted one: the graph is captured, its tokens are those of the same
loop run eagerly (bit for bit: the same kernels), its teacher-forced logits are the model's own
within the bf16 bound, an end-of-sequence token ends the loop early without a host wait per step,
and a step that synchronizes with the host is refused (or decoded step by step when asked)."""

import pytest
import torch
from torch import nn

import cutlass_ops
from cutlass_ops import graphed_decode, graphed_steps, step_graphs

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

VOCAB = 1024


def tiny_llama(convert=True):
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    if convert:
        cutlass_ops.convert(model)
    return model


def prompt(batch=2, length=24, seed=0):
    generator = torch.Generator("cuda").manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), device="cuda", generator=generator)


@pytest.mark.parametrize("convert", [True, False], ids=["converted", "hf"])
@pytest.mark.parametrize("batch", [1, 16])
def test_the_graphed_tokens_are_the_eager_loops_bit_for_bit(convert, batch):
    model, ids = tiny_llama(convert), prompt(batch)
    decoder = graphed_decode.graphed_decoder(model)
    first = decoder.generate(ids, max_new_tokens=40, eos_token_id=[])  # captures
    session = next(iter(decoder.sessions.values()))
    assert session.graph is not None and session.refusal is None
    replayed = decoder.generate(ids, max_new_tokens=40, eos_token_id=[])
    with step_graphs.paused():  # the same loop, every step eager
        eager = graphed_decode.graphed_decoder(model).generate(ids, max_new_tokens=40,
                                                              eos_token_id=[])
    assert torch.equal(first, eager) and torch.equal(replayed, eager)
    assert decoder.memory_bytes() > 0


def test_teacher_forced_steps_are_the_models_logits():
    model, ids = tiny_llama(), prompt(batch=2)
    forced = prompt(batch=2, length=12, seed=1)
    decoder = graphed_decode.graphed_decoder(model)
    steps = [decoder.start(ids, max_len=ids.shape[1] + 12)]
    steps += [decoder.feed(forced[:, i]) for i in range(11)]
    assert next(iter(decoder.sessions.values())).graph is not None
    with torch.no_grad():
        full = model(torch.cat([ids, forced[:, :11]], dim=1)).logits.float()
    for i, logits in enumerate(steps):
        expected = full[:, ids.shape[1] - 1 + i]
        error = (logits - expected).norm() / expected.norm()
        assert error < 2e-2, (i, float(error))


def test_an_end_of_sequence_ends_the_output_as_generate_would():
    model, ids = tiny_llama(), prompt(batch=1)
    free = cutlass_ops.generate(model, ids, max_new_tokens=60, eos_token_id=[])
    eos = int(free[0, ids.shape[1] + 5])
    got = cutlass_ops.generate(model, ids, max_new_tokens=60, eos_token_id=eos)
    assert got.shape[1] <= ids.shape[1] + 6 and int(got[0, -1]) == eos
    assert torch.equal(got, free[:, :got.shape[1]])


class SyncingNorm(nn.Module):
    """A norm that reads a value on the host each call: not capturable."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        if float(x.abs().max()) < 0:  # a host sync
            x = -x
        return self.norm(x)


def test_a_step_that_syncs_is_refused_or_decoded_step_by_step():
    model, ids = tiny_llama(convert=False), prompt(batch=1)
    expected = cutlass_ops.generate(model, ids, max_new_tokens=8, eos_token_id=[])
    model.model.norm = SyncingNorm(model.model.norm)
    with pytest.raises(graphed_steps.CaptureRefused, match="synchroniz"):
        graphed_decode.graphed_decoder(model).generate(ids, max_new_tokens=8, eos_token_id=[])
    decoder = graphed_decode.graphed_decoder(model, on_refusal="eager")
    assert torch.equal(decoder.generate(ids, max_new_tokens=8, eos_token_id=[]), expected)
    assert next(iter(decoder.sessions.values())).refusal is not None


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_a_converted_moe_model_decodes_in_graphs_as_its_eager_loop(family):
    """Mixture-of-experts layers route on the device, so a decode step is captured whole: the
    graphed tokens are those of the same loop run step by step eagerly."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "moe"))
    from test_moe_layers_gpu import tiny_model

    model = tiny_model(family)
    cutlass_ops.convert(model)
    ids = prompt(batch=4)
    decoder = graphed_decode.graphed_decoder(model)
    first = decoder.generate(ids, max_new_tokens=24, eos_token_id=[])
    session = next(iter(decoder.sessions.values()))
    assert session.graph is not None and session.refusal is None
    with step_graphs.paused():
        eager = graphed_decode.graphed_decoder(model).generate(ids, max_new_tokens=24,
                                                              eos_token_id=[])
    assert torch.equal(first, eager)
