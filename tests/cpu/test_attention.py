"""cutlass_ops.attention against Hugging Face's sdpa_attention_forward on the CPU (float32):
without a mask, with a padding mask, with a materialized causal mask (recognised), decode with a
longer cache, gradients eagerly and through the custom ops under torch.compile, and opcheck."""

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from cutlass_ops import attention  # noqa: E402

B, H, HKV, D = 2, 4, 2, 16


def _module():
    return types.SimpleNamespace(num_key_value_groups=H // HKV, is_causal=True, training=False,
                                 config=types.SimpleNamespace(_attn_implementation="sdpa"))


def _inputs(q_len=9, kv_len=9, grad=False):
    g = torch.Generator().manual_seed(q_len * 100 + kv_len)
    q, k, v = (torch.randn(B, h, n, D, generator=g)
               for h, n in ((H, q_len), (HKV, kv_len), (HKV, kv_len)))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _hf(q, k, v, mask):
    return sdpa_attention_forward(_module(), q, k, v, mask, scaling=D ** -0.5)[0]


def _causal(n, batch=B):
    return torch.ones(n, n, dtype=torch.bool).tril().expand(batch, 1, n, n)


def _padded(n):
    mask = _causal(n).clone()
    mask[0, :, :, :3] = False  # the first sequence is left-padded
    mask[0, :, torch.arange(3), torch.arange(3)] = True
    return mask


@pytest.mark.parametrize("case", ["no mask", "causal mask", "padding mask", "decode"])
def test_matches_hugging_face_forward_and_gradients(case):
    q_len, kv_len = (1, 12) if case == "decode" else (9, 9)
    mask = {"no mask": None, "causal mask": _causal(9), "padding mask": _padded(9),
            "decode": None}[case]
    ours_in, theirs_in = _inputs(q_len, kv_len, True), _inputs(q_len, kv_len, True)
    ours = attention.attention(*ours_in, mask, D ** -0.5)
    theirs = _hf(*theirs_in, mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours.is_contiguous() and ours.shape == (B, q_len, H, D)
    grad = torch.randn_like(ours)
    ours.backward(grad), theirs.backward(grad)
    for a, b in zip(ours_in, theirs_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_the_causal_mask_is_recognised_once_per_tensor_and_others_are_not():
    mask = _causal(9)
    assert attention._is_causal_mask(mask, 9, 9)
    assert attention._causal_masks[id(mask)][1] is True
    assert not attention._is_causal_mask(_padded(9), 9, 9)
    assert not attention._is_causal_mask(mask.float(), 9, 9)  # additive masks are kept
    assert not attention._is_causal_mask(_causal(9), 9, 12)
    window = _causal(9).clone()
    window[:, :, 8, 0] = False  # a sliding window is not the causal mask
    assert not attention._is_causal_mask(window, 9, 9)


@pytest.mark.parametrize("mask", [None, "causal", "padding"])
def test_compiled_custom_ops_match_hugging_face(mask):
    mask = {None: None, "causal": _causal(9), "padding": _padded(9)}[mask]
    ours_in, theirs_in = _inputs(grad=True), _inputs(grad=True)
    fn = torch.compile(lambda q, k, v: attention.attention(q, k, v, mask, D ** -0.5),
                       fullgraph=True, backend="aot_eager")
    ours = fn(*ours_in)
    theirs = _hf(*theirs_in, mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    ours.sum().backward(), theirs.sum().backward()
    for a, b in zip(ours_in, theirs_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_opcheck():
    q, k, v = _inputs(grad=True)
    torch.library.opcheck(attention.sdpa_op, (q, k, v, None, D ** -0.5, True))
    torch.library.opcheck(attention.sdpa_op, (q, k, v, _padded(9), D ** -0.5, True))


def test_supports_only_what_it_computes():
    module = _module()
    q = torch.zeros(1, H, 2, D)
    assert attention.supports(module, q, 0.0, {})
    assert not attention.supports(module, q, 0.1, {})
    assert not attention.supports(module, q, 0.0, {"output_attentions": True})
    module.config._attn_implementation = "eager"
    assert not attention.supports(module, q, 0.0, {})
