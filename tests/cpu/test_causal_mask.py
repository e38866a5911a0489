"""cutlass_ops.causal_mask on the CPU: the registered mask function returns no mask exactly for a
plain causal mask over a full unpadded block, a routed model computes what it did (eagerly,
compiled, padded, generate()), and unroute restores SDPA."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import masking_utils  # noqa: E402

from cutlass_ops import causal_mask  # noqa: E402


def _model():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=101)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _mask_function():
    causal_mask.route(_model())
    return masking_utils.AttentionMaskInterface._global_mapping[causal_mask.NAME]


BASE = dict(batch_size=2, q_length=8, kv_length=8, q_offset=0, kv_offset=0,
            mask_function=masking_utils.causal_mask_function, attention_mask=None,
            allow_is_causal_skip=True, device=torch.device("cpu"))


@pytest.mark.parametrize("change", [
    {"attention_mask": torch.tensor([[0] * 3 + [1] * 5, [1] * 8], dtype=torch.bool)},
    {"kv_length": 12, "kv_offset": 4},
    {"local_size": 4},
    {"allow_is_causal_skip": False},
    {"mask_function": masking_utils.and_masks(masking_utils.causal_mask_function,
                                              masking_utils.causal_mask_function)},
])
def test_anything_but_the_plain_causal_block_gets_hugging_face_s_mask(change):
    mask = _mask_function()
    assert mask(**BASE) is None
    ours, theirs = mask(**{**BASE, **change}), masking_utils.sdpa_mask(**{**BASE, **change})
    assert (ours is None) == (theirs is None)
    if theirs is not None:
        assert torch.equal(ours, theirs)


def test_a_routed_model_computes_what_it_did():
    model = _model()
    ours = copy.deepcopy(model)
    assert causal_mask.structure_refusal(ours) is None
    causal_mask.route(ours)
    assert ours.model.layers[0].self_attn.config._attn_implementation == causal_mask.NAME
    ids = torch.randint(0, 101, (2, 9))
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, model(ids).logits)
        torch.testing.assert_close(ours(ids, attention_mask=padding).logits,
                                   model(ids, attention_mask=padding).logits)
        compiled = torch.compile(ours, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
        kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:, :4], **kwargs), model.generate(ids[:, :4], **kwargs))
    causal_mask.unroute(ours)
    assert ours.config._attn_implementation == "sdpa"


def test_only_sdpa_models_are_routed():
    model = _model()
    model.config._attn_implementation = "eager"
    assert "SDPA" in causal_mask.structure_refusal(model)
    assert causal_mask.structure_refusal(torch.nn.Linear(2, 2)) is not None
