"""cutlass_ops.decode_attention: one query token's attention with grouped KV heads, the cache
read once, against SDPA on the cache repeated per head (what Hugging Face 5.17 runs); the cases
it declines; and a converted model's greedy decode still equal to Hugging Face's."""

import pytest
import torch
import torch.nn.functional as F

from cutlass_ops.decode_attention import packed_decode_attention


def _repeat(t, groups):
    return t.repeat_interleave(groups, dim=1)


def _reference(q, k, v, mask, scaling, groups):
    out = F.scaled_dot_product_attention(q, _repeat(k, groups), _repeat(v, groups),
                                         attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


@pytest.mark.parametrize("groups", [2, 4, 8])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_equals_sdpa_on_the_repeated_cache(groups, mask_kind):
    batch, kv_heads, length, dim = 3, 2, 37, 16
    q = torch.randn(batch, kv_heads * groups, 1, dim)
    k, v = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    mask = None
    if mask_kind != "none":
        visible = torch.rand(batch, 1, 1, length) < 0.7
        visible[..., 0] = True  # every row sees something
        mask = visible if mask_kind == "bool" else torch.where(visible, 0.0, float("-inf"))
    out = packed_decode_attention(q, k, v, mask, 0.25, groups)
    assert out.shape == (batch, 1, kv_heads * groups, dim)
    torch.testing.assert_close(out, _reference(q, k, v, mask, 0.25, groups), atol=1e-5,
                               rtol=1e-5)


def test_declines_what_it_does_not_implement():
    q, k = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 5, 16)
    assert packed_decode_attention(torch.randn(1, 8, 2, 16), k, k, None, None, 4) is None
    assert packed_decode_attention(torch.randn(1, 2, 1, 16), k, k, None, None, 1) is None
    assert packed_decode_attention(q, k, k, None, None, 2) is None  # heads do not match
    per_head = torch.ones(1, 8, 1, 5, dtype=torch.bool)
    assert packed_decode_attention(q, k, k, per_head, None, 4) is None
    assert packed_decode_attention(q, k, k, None, None, 4, softcap=30.0) is None
    assert packed_decode_attention(q, k, k, None, None, 4, position_bias=torch.zeros(1)) is None
    assert packed_decode_attention(q, k, k, None, None, 4, softcap=None) is not None


def test_a_converted_models_greedy_decode_equals_hugging_faces():
    transformers = pytest.importorskip("transformers")
    import copy

    import cutlass_ops

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=128,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval()
    ours = copy.deepcopy(model)
    cutlass_ops.convert(ours)
    ids = torch.randint(0, 128, (2, 7))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        got = ours.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(got, expected)
