"""Fused rotary embedding without a GPU: the input rules (raised on every device), the torch
fallback against Hugging Face's apply_rotary_pos_emb (values, layouts, gradients, logged once),
zero-size and meta inputs, the fake impls' shapes (FakeTensorMode with CUDA tensors), and the
vector width the launcher picks."""


import pytest
import torch
from torch._subclasses import FakeTensorMode

from custom_kernels import rotary
from custom_kernels.core.errors import UnsupportedInputError

hf = pytest.importorskip("transformers.models.llama.modeling_llama")


def merged_qkv(batch, seq, heads_q, heads_k, d, dtype=torch.float32, device="cpu"):
    """q and k as HF's attention makes them from one merged QKV projection: column slices of
    [B, S, (Hq + 2 Hk) D], viewed as [B, S, H, D] (strided, last dimension contiguous)."""
    merged = torch.randn(batch, seq, (heads_q + 2 * heads_k) * d, device=device).to(dtype)
    q, k, _ = torch.split(merged, [heads_q * d, heads_k * d, heads_k * d], dim=-1)
    return q.view(batch, seq, heads_q, d), k.view(batch, seq, heads_k, d)


def projection_order(t):
    """A [B, H, S, D] output laid out as [B, S, H, D], as the projections wrote q and k."""
    return t.transpose(1, 2).is_contiguous()


def cos_sin(batch, seq, d, dtype=torch.float32, device="cpu"):
    """HF's default rotary embedding at positions with a per-batch offset."""
    pos = torch.arange(seq).float()[None] + torch.randint(0, 1000, (batch, 1))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = (pos[..., None] * inv_freq).repeat(1, 1, 2)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


# --- input rules -------------------------------------------------------------------------------

def test_input_rules():
    q, k = merged_qkv(2, 5, 4, 2, 8)
    cos, sin = cos_sin(2, 5, 8)

    def refused(match, *args):
        with pytest.raises(UnsupportedInputError, match=match):
            rotary.apply_rotary(*args)

    refused("even", *merged_qkv(2, 5, 4, 2, 7), *cos_sin(2, 5, 7))
    refused("batch, sequence or head size", q, k[:1], cos, sin)
    refused("batch, sequence or head size", q, k[:, :4], cos, sin)
    refused("batch, sequence or head size", q, k[..., :6], cos, sin)
    refused(r"cos has shape \(2, 4, 8\)", q, k, cos[:, :4], sin)
    refused(r"sin has shape \(3, 5, 8\)", q, k, cos, sin[[0, 1, 1]])
    refused(r"sin has shape \(5, 8\)", q, k, cos, sin[0])
    refused(r"\[B, S, H, D\]", q.flatten(2), k, cos, sin)
    refused("k is torch.float16 but q is torch.float32", q, k.half(), cos, sin)
    refused("cos is torch.bfloat16", q, k, cos.bfloat16(), sin)
    refused("float32, float16 or bfloat16, not torch.int64", q.long(), k.long(), cos.long(),
            sin.long())
    refused("float32, float16 or bfloat16, not torch.float64", q.double(), k.double(),
            cos.double(), sin.double())
    refused("q has a non-contiguous last dimension", torch.randn(2, 5, 4, 16)[..., ::2], k,
            cos, sin)
    refused("sin has a non-contiguous last dimension", q, k, cos,
            torch.randn(2, 5, 16)[..., ::2])
    refused("cos must be a torch.Tensor", q, k, 1.0, sin)
    refused("different devices", q, k, cos.to("meta"), sin)


def test_rules_hold_for_cuda_tensors_too():
    """What a GPU refuses is refused before anything runs (fake CUDA tensors: no GPU here)."""
    with FakeTensorMode():
        q = torch.empty(2, 3, 4, 7, device="cuda")
        cos = torch.empty(2, 3, 7, device="cuda")
        with pytest.raises(UnsupportedInputError, match="even"):
            rotary.apply_rotary(q, q, cos, cos)


# --- the torch fallback against HF -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cos_batch", ["B", 1])
def test_fallback_equals_hf(dtype, cos_batch, warnings):
    q, k = merged_qkv(3, 6, 8, 2, 16, dtype)
    cos, sin = cos_sin(3 if cos_batch == "B" else 1, 6, 16, dtype)
    q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
    want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert q_out.shape == (3, 8, 6, 16) and k_out.shape == (3, 2, 6, 16)
    assert projection_order(q_out) and projection_order(k_out)
    assert q_out.dtype == k_out.dtype == dtype
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
    rotary.apply_rotary(q, k, cos, sin)
    assert warnings() == ["apply_rotary uses rotary_reference: the tensors are on cpu, not a "
                          "CUDA device"]


def test_fallback_gradients_equal_hf():
    q, k = merged_qkv(2, 5, 4, 2, 8)
    cos, sin = cos_sin(2, 5, 8)
    cos.requires_grad_()
    leaves = [t.detach().requires_grad_() for t in (q, k)]
    q_out, k_out = rotary.apply_rotary(*leaves, cos, sin)
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward([q_out, k_out], [gq, gk])
    ours = [t.grad for t in (*leaves, cos)]
    for t in (*leaves, cos):
        t.grad = None
    want = hf.apply_rotary_pos_emb(leaves[0].transpose(1, 2), leaves[1].transpose(1, 2), cos,
                                   sin)
    torch.autograd.backward(list(want), [gq, gk])
    for got, expected in zip(ours, [t.grad for t in (*leaves, cos)]):
        torch.testing.assert_close(got, expected)


def test_reference_is_the_kernels_backward_formula():
    """The backward kernel's formula (dq = g cos + rotate_half^T(g sin), rotate_half^T([z1, z2])
    = [z2, -z1]) is the transpose of the forward map: checked here in float64 through autograd,
    in the same [B, H, S, D] -> [B, S, H, D] layouts."""
    q, k = merged_qkv(2, 3, 2, 1, 6, torch.float64)
    cos, sin = cos_sin(1, 3, 6, torch.float64)
    q = q.detach().requires_grad_()
    q_out, _ = rotary.rotary_reference(q, k, cos, sin)
    g = torch.randn_like(q_out)
    (dq,) = torch.autograd.grad(q_out, q, g)
    z = g * sin.unsqueeze(1)
    half = z.shape[-1] // 2
    formula = g * cos.unsqueeze(1) + torch.cat((z[..., half:], -z[..., :half]), -1)
    torch.testing.assert_close(dq, formula.transpose(1, 2))


def test_zero_size_and_meta():
    for shape in [(0, 5, 4, 8), (2, 0, 4, 8), (2, 5, 0, 8)]:
        q = torch.randn(shape)
        k = torch.randn(*shape[:2], 2, 8)
        cos = torch.randn(shape[0] or 1, shape[1], 8)
        q_out, k_out = rotary.apply_rotary(q, k, cos, cos)
        assert q_out.shape == (shape[0], shape[2], shape[1], 8)
        assert k_out.shape == (shape[0], 2, shape[1], 8)
    q, k = merged_qkv(2, 5, 4, 2, 8, device="meta")
    q_out, k_out = rotary.apply_rotary(q, k, *cos_sin(1, 5, 8, device="meta"))
    assert q_out.shape == (2, 4, 5, 8) and projection_order(q_out) and q_out.device.type == "meta"


# --- fakes -------------------------------------------------------------------------------------

def test_fakes_give_contiguous_head_major_outputs():
    with FakeTensorMode():
        q, k = merged_qkv(2, 7, 8, 2, 128, torch.bfloat16, device="cuda")
        cos = torch.empty(1, 7, 128, dtype=torch.bfloat16, device="cuda")
        sin = torch.empty_like(cos)
        q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
        assert q_out.shape == (2, 8, 7, 128) and k_out.shape == (2, 2, 7, 128)
        assert q_out.is_contiguous() and k_out.is_contiguous()
        assert q_out.dtype == torch.bfloat16 and q_out.device.type == "cuda"
        dq, dk = torch.ops.custom_kernels.rotary_bwd(q_out, k_out, cos, sin)
        assert dq.shape == q.shape and dk.shape == k.shape
        assert dq.is_contiguous() and dk.is_contiguous()
        dq, dk = torch.ops.custom_kernels.rotary_bwd(None, k_out, cos, sin)
        assert dq.numel() == 0 and dk.shape == k.shape


# --- the ops' wiring, with a torch stand-in for the kernel ---------------------------------------

def torch_launch(a, b, ya, yb, cos, sin, backward):
    """What the kernel writes, in torch: a, b, ya, yb are [B, S, H, D] views, cos / sin
    [B or 1, S, D]."""
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    for x, y in ((a, ya), (b, yb)):
        if x is None:
            continue
        if backward:
            z = x.float() * s.float()
            half = z.shape[-1] // 2
            y.copy_(x.float() * c.float() + torch.cat((z[..., half:], -z[..., :half]), -1))
        else:
            y.copy_(x * c + rotary.rotate_half(x) * s)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(rotary, "_launch", torch_launch)


def leaves(dtype=torch.float32):
    q, k = merged_qkv(2, 5, 4, 2, 8, dtype)
    return q.detach().requires_grad_(), k.detach().requires_grad_(), *cos_sin(1, 5, 8, dtype)


def grads_of(fn, q, k, cos, sin, layout=projection_order):
    q_out, k_out = fn(q, k, cos, sin)
    assert layout(q_out) and layout(k_out)
    gq, gk = (torch.arange(t.numel(), dtype=t.dtype).view(t.shape).sin() for t in (q_out, k_out))
    dq, dk = torch.autograd.grad([q_out, k_out], [q, k], [gq, gk])
    return q_out, k_out, dq, dk


@pytest.mark.parametrize("path", ["eager", "op", "compiled"])
def test_paths_and_autograd(stand_in, path):
    """The direct path (_EagerRotary), the custom op with its registered autograd, and the op
    under torch.compile(fullgraph=True) all give HF's values and gradients."""
    q, k, cos, sin = leaves()
    fn = {"eager": rotary._rotary, "op": torch.ops.custom_kernels.rotary_fwd,
          "compiled": torch.compile(rotary._rotary, backend="aot_eager", fullgraph=True)}[path]
    # Eagerly the projection's memory order; the op (what torch.compile sees) contiguous.
    layout = projection_order if path == "eager" else torch.Tensor.is_contiguous
    got = grads_of(fn, q, k, cos, sin, layout)
    want = grads_of(rotary._torch_rotary, q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_one_gradient_only(monkeypatch):
    """A k that needs no gradient is skipped by the backward launch (and the reverse)."""
    calls = []

    def recording(a, b, ya, yb, cos, sin, backward):
        calls.append((backward, a is None, b is None))
        torch_launch(a, b, ya, yb, cos, sin, backward)

    monkeypatch.setattr(rotary, "_launch", recording)
    q, k, cos, sin = leaves()
    for fn in (rotary._rotary, torch.ops.custom_kernels.rotary_fwd):
        calls.clear()
        q_out, k_out = fn(q, k.detach(), cos, sin)
        (dq,) = torch.autograd.grad((q_out.sum(), k_out.sum()), q)
        assert dq.shape == q.shape and calls == [(False, False, False), (True, False, True)]
        calls.clear()
        q_out, k_out = fn(q.detach(), k, cos, sin)
        (dk,) = torch.autograd.grad(k_out.sum(), k)
        assert dk.shape == k.shape and calls == [(False, False, False), (True, True, False)]
    with torch.no_grad():
        q_out, _ = rotary._rotary(q, k, cos, sin)
    assert not q_out.requires_grad


def test_opcheck(stand_in):
    q, k, cos, sin = leaves()
    torch.library.opcheck(torch.ops.custom_kernels.rotary_fwd.default, (q, k, cos, sin))
    q_out, k_out = torch.ops.custom_kernels.rotary_fwd(q, k, cos, sin)
    torch.library.opcheck(torch.ops.custom_kernels.rotary_bwd.default,
                          (q_out.detach(), k_out.detach(), cos, sin))
    torch.library.opcheck(torch.ops.custom_kernels.rotary_bwd.default,
                          (None, k_out.detach(), cos, sin))


# --- launcher pieces ---------------------------------------------------------------------------

def test_vector_width():
    assert rotary.vector_width(2, 64) == 8        # bf16, D = 128: 16 bytes
    assert rotary.vector_width(4, 64) == 4        # fp32: 16 bytes
    assert rotary.vector_width(2, 36) == 4        # D = 72: 8 bytes
    assert rotary.vector_width(2, 3) == 1         # D = 6
    assert rotary.vector_width(4, 3) == 1
    assert rotary.vector_width(2, 64, strides=(4096, 12, 0)) == 4
    assert rotary.vector_width(2, 64, pointers=(2,)) == 1
    assert rotary.vector_width(2, 64, pointers=(4,)) == 2
    assert rotary.vector_width(4, 64, pointers=(8,)) == 2
    assert rotary.kernel_name(False) == "rotary_kernel<false>"


def test_public_name():
    import custom_kernels

    assert custom_kernels.apply_rotary is rotary.apply_rotary
