"""cutlass_ops.graphed_decode on the CPU (its loop runs eagerly there, the same code a graph
captures on a GPU), against Hugging Face's greedy generate() on tiny random Llama and Mistral
models in float32: the tokens, end-of-sequence padding and trimming, min_new_tokens, left
padding, sessions reused across prompt lengths, start / feed against the model's own logits,
and what it refuses."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cutlass_ops  # noqa: E402
from cutlass_ops import graphed_decode, graphed_steps  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2, vocab_size=97,
             max_position_embeddings=1024)


def model(family="llama"):
    configs = {"llama": lambda: transformers.LlamaConfig(**SMALL),
               "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=8)}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[family]()).eval()


def prompt(batch=3, length=7, seed=1):
    return torch.randint(0, SMALL["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def hf_greedy(m, ids, mask=None, **options):
    mask = torch.ones_like(ids) if mask is None else mask
    return m.generate(ids, attention_mask=mask, do_sample=False, **options)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_tokens_are_generates_greedy_tokens(family):
    m, ids = model(family), prompt()
    got = cutlass_ops.generate(m, ids, max_new_tokens=20, eos_token_id=[])
    expected = hf_greedy(m, ids, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    assert got.shape == (3, 27)
    assert torch.equal(got, expected)


def test_a_sequence_that_ends_is_padded_and_the_output_ends_with_the_last():
    m, ids = model(), prompt()
    free = cutlass_ops.generate(m, ids, max_new_tokens=30, eos_token_id=[])
    # The end-of-sequence token: one row's fourth new token, so rows end at different steps.
    eos = int(free[0, 7 + 3])
    got = cutlass_ops.generate(m, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=5)
    expected = hf_greedy(m, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=5)
    assert torch.equal(got, expected)
    assert (got[0, 7 + 4:] == 5).all()


def test_min_new_tokens_holds_the_end_of_sequence_back():
    m, ids = model(), prompt(batch=1)
    free = cutlass_ops.generate(m, ids, max_new_tokens=12, eos_token_id=[])
    eos = int(free[0, 7 + 1])
    got = cutlass_ops.generate(m, ids, max_new_tokens=12, min_new_tokens=6, eos_token_id=eos,
                               pad_token_id=0)
    expected = hf_greedy(m, ids, max_new_tokens=12, min_new_tokens=6, eos_token_id=eos,
                         pad_token_id=0)
    assert torch.equal(got, expected)
    assert not (got[0, 7:7 + 6] == eos).any()


def test_left_padded_prompts_decode_as_generate_decodes_them():
    m, ids = model(), prompt(batch=2, length=9)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0
    got = cutlass_ops.generate(m, ids, max_new_tokens=10, attention_mask=mask, eos_token_id=[])
    expected = hf_greedy(m, ids, mask, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, expected)


def test_the_model_generation_configs_end_of_sequence_is_the_default():
    m, ids = model(), prompt(batch=1)
    free = cutlass_ops.generate(m, ids, max_new_tokens=10, eos_token_id=[])
    m.generation_config.eos_token_id = int(free[0, 7 + 2])
    got = cutlass_ops.generate(m, ids, max_new_tokens=10)
    assert got.shape[1] == 7 + 3  # ended at its third new token; pad defaults to eos
    assert torch.equal(got, hf_greedy(m, ids, max_new_tokens=10))


def test_prompts_of_other_lengths_reuse_one_session():
    m = model()
    decoder = graphed_decode.graphed_decoder(m)
    for length in (5, 40, 3):
        ids = prompt(batch=2, length=length, seed=length)
        got = decoder.generate(ids, max_new_tokens=8, eos_token_id=[])
        assert torch.equal(got, hf_greedy(m, ids, max_new_tokens=8, eos_token_id=None,
                                          pad_token_id=0))
    assert len(decoder.sessions) == 1
    assert next(iter(decoder.sessions))[1] == graphed_decode.CACHE_ROUNDING
    assert decoder.memory_bytes() > 0


def test_sessions_past_the_limit_drop_the_oldest():
    m = model()
    decoder = graphed_decode.graphed_decoder(m, max_sessions=2)
    for batch in (1, 2, 3):
        decoder.generate(prompt(batch=batch), max_new_tokens=2, eos_token_id=[])
    assert [key[0] for key in decoder.sessions] == [2, 3]
    decoder.reset()
    assert not decoder.sessions


def test_start_and_feed_give_the_models_own_logits():
    m, ids = model(), prompt(batch=2)
    decoder = graphed_decode.graphed_decoder(m)
    forced = torch.randint(0, SMALL["vocab_size"], (2, 5),
                           generator=torch.Generator().manual_seed(9))
    steps = [decoder.start(ids, max_len=ids.shape[1] + 5)]
    steps += [decoder.feed(forced[:, i]) for i in range(4)]
    with torch.no_grad():
        full = m(torch.cat([ids, forced[:, :4]], dim=1)).logits
    for i, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[:, ids.shape[1] - 1 + i], rtol=1e-4, atol=1e-4)


def test_a_copied_model_gets_its_own_decoder():
    m, ids = model(), prompt(batch=1)
    cutlass_ops.generate(m, ids, max_new_tokens=3, eos_token_id=[])
    twin = copy.deepcopy(m)
    cutlass_ops.generate(twin, ids, max_new_tokens=3, eos_token_id=[])
    holder = graphed_decode._DecoderHolder
    from cutlass_ops import module_state
    assert module_state.get(twin, holder).decoder.model is twin
    assert module_state.get(m, holder).decoder.model is m


def test_new_parameter_tensors_drop_the_sessions():
    m = model()
    decoder = graphed_decode.graphed_decoder(m)
    decoder.generate(prompt(batch=1), max_new_tokens=2, eos_token_id=[])
    m.load_state_dict(copy.deepcopy(m.state_dict()), assign=True)
    decoder.generate(prompt(batch=2), max_new_tokens=2, eos_token_id=[])
    assert [key[0] for key in decoder.sessions] == [2]


@pytest.mark.parametrize("call, message", [
    (lambda m: cutlass_ops.generate(m, torch.zeros(3, dtype=torch.long), max_new_tokens=2),
     "input_ids"),
    (lambda m: cutlass_ops.generate(m, prompt().float(), max_new_tokens=2), "input_ids"),
    (lambda m: cutlass_ops.generate(m, prompt(), max_new_tokens=0), "max_new_tokens"),
    (lambda m: cutlass_ops.generate(m, prompt(), max_new_tokens=2, min_new_tokens=3),
     "min_new_tokens"),
    (lambda m: cutlass_ops.generate(m, prompt(), max_new_tokens=2, eos_token_id=97),
     "eos_token_id"),
    (lambda m: cutlass_ops.generate(m, prompt(), max_new_tokens=2,
                                    attention_mask=torch.ones(3, 2)), "attention_mask"),
    (lambda m: graphed_decode.graphed_decoder(m).feed(torch.zeros(3, dtype=torch.long)),
     "start"),
    (lambda m: cutlass_ops.generate(m, prompt(), max_new_tokens=2, eos_token_id=[],
                                    pad_token_id=97), "pad_token_id"),
    (lambda m: cutlass_ops.generate(m, prompt(), max_new_tokens=2, eos_token_id=[],
                                    pad_token_id=-1), "pad_token_id"),
    (lambda m: graphed_decode.graphed_decoder(m).start(prompt(), max_len=7), "max_len"),
])
def test_bad_input_is_refused_with_a_message(call, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        call(model())


def test_feeding_past_the_cache_is_refused():
    decoder = graphed_decode.graphed_decoder(model())
    ids = prompt(batch=1, length=graphed_decode.CACHE_ROUNDING - 1)
    decoder.start(ids, max_len=graphed_decode.CACHE_ROUNDING)
    decoder.feed(torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="static cache"):
        decoder.feed(torch.zeros(1, dtype=torch.long))


def test_a_model_without_a_config_is_refused():
    with pytest.raises(graphed_steps.CaptureRefused, match="Hugging Face"):
        graphed_decode.graphed_decoder(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="on_refusal"):
        graphed_decode.graphed_decoder(model(), on_refusal="ignore")


def test_a_sliding_window_cache_is_refused_for_graphs_and_a_full_one_is_not():
    """Mistral's static sliding layers count their length in a Python int: a replayed step
    would attend as the captured one did. (On a CPU the loop is eager, so the tokens above
    are right; on a GPU the capture is refused.)"""
    for family, refused in (("mistral", True), ("llama", False)):
        m = model(family)
        cache = transformers.StaticCache(config=m.config, max_cache_len=16)
        why = graphed_decode.cache_refusal(cache)
        assert (why is not None) is refused, family
        if refused:
            assert "sliding window" in why
