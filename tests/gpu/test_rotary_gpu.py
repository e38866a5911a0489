"""Fused rotary embedding on an sm90 GPU (marker gpu): the forward pass bit for bit against Hugging
Face's apply_rotary_pos_emb (bf16, fp16, fp32) with q / k strided column slices of a merged QKV
output, GQA, cos / sin from HF's LlamaRotaryEmbedding with batch 1 and B, 16-byte and scalar
accesses, decode shapes, many heads (the grid's head loop), zero sizes; the backward pass against
autograd through HF's formula; cos / sin that require a gradient; opcheck; the eager path against
the custom op; torch.compile(fullgraph=True) forward and backward; CUDA graph replay."""

import pytest
import torch

from custom_kernels import rotary

pytestmark = pytest.mark.gpu
hf = pytest.importorskip("transformers.models.llama.modeling_llama")
from transformers import LlamaConfig  # noqa: E402  (after the importorskip)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def merged_qkv(batch, seq, heads_q, heads_k, d, dtype, offset=0):
    """q, k as HF's attention makes them from one merged QKV GEMM output: column slices of
    [B, S, (Hq + 2 Hk) D] (after ``offset`` leading columns: a misaligned start), viewed as
    [B, S, H, D]."""
    width = (heads_q + 2 * heads_k) * d
    merged = torch.randn(batch, seq, offset + width, device="cuda").to(dtype)
    q, k, _ = torch.split(merged[..., offset:], [heads_q * d, heads_k * d, heads_k * d], dim=-1)
    return q.view(batch, seq, heads_q, d), k.view(batch, seq, heads_k, d)


def hf_cos_sin(batch, seq, d, dtype, cos_batch):
    """cos / sin from HF's rotary module: [B, S, D] for per-row positions, [1, S, D] for one."""
    config = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=d, max_position_embeddings=8192)
    rope = hf.LlamaRotaryEmbedding(config).to("cuda")
    start = torch.randint(0, 4000, (cos_batch, 1), device="cuda")
    positions = start + torch.arange(seq, device="cuda")
    x = torch.empty(batch, seq, d, device="cuda", dtype=dtype)
    return rope(x, positions)


def hf_rotary(q, k, cos, sin):
    return hf.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def assert_same_bits(got, want):
    """``got``, a rotary output: HF's values bit for bit, laid out in the projection's order."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.transpose(1, 2).is_contiguous()
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    same = got.view(bits) == want.contiguous().view(bits)
    assert same.all(), f"{int((~same).sum())} of {got.numel()} elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256, 80, 6])
@pytest.mark.parametrize("cos_batch", ["B", 1])
@pytest.mark.parametrize("heads", [(8, 2), (32, 8), (5, 5)])
def test_forward_bits_equal_hf(dtype, d, cos_batch, heads):
    batch, seq = 3, 37
    q, k = merged_qkv(batch, seq, *heads, d, dtype)
    cos, sin = hf_cos_sin(batch, seq, d, dtype, batch if cos_batch == "B" else 1)
    q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
    want_q, want_k = hf_rotary(q, k, cos, sin)
    assert_same_bits(q_out, want_q)
    assert_same_bits(k_out, want_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [1, 2, 4])
def test_misaligned_and_strided_inputs(dtype, offset):
    """Narrower accesses where the pointers or strides do not allow 16 bytes, and strided
    cos / sin (a slice of a wider tensor)."""
    q, k = merged_qkv(2, 19, 8, 2, 128, dtype, offset)
    cos, sin = hf_cos_sin(2, 19, 128, dtype, 2)
    wide = torch.cat([cos, sin], dim=-1)
    cos, sin = wide[..., :128], wide[..., 128:]
    assert_same_bits(rotary.apply_rotary(q, k, cos, sin)[0], hf_rotary(q, k, cos, sin)[0])


@pytest.mark.parametrize("batch, seq", [(1, 1), (64, 1), (1, 4096), (4, 2048)])
def test_decode_and_prefill_shapes(batch, seq):
    q, k = merged_qkv(batch, seq, 32, 8, 128, torch.bfloat16)
    cos, sin = hf_cos_sin(batch, seq, 128, torch.bfloat16, batch)
    q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
    want_q, want_k = hf_rotary(q, k, cos, sin)
    assert_same_bits(q_out, want_q)
    assert_same_bits(k_out, want_k)


def test_many_heads_walk_the_grid_loop():
    """More head groups than a grid's y dimension holds (65535 of HEADS heads)."""
    heads_q = rotary.MAX_GRID_Y * rotary.HEADS + 37
    q, k = merged_qkv(1, 1, heads_q, 3, 8, torch.bfloat16)
    cos, sin = hf_cos_sin(1, 1, 8, torch.bfloat16, 1)
    q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
    want_q, want_k = hf_rotary(q, k, cos, sin)
    assert_same_bits(q_out, want_q)
    assert_same_bits(k_out, want_k)


def test_zero_sizes():
    for batch, seq, heads_q, heads_k in [(0, 5, 4, 2), (2, 0, 4, 2), (2, 5, 0, 2),
                                         (2, 5, 4, 0)]:
        q = torch.randn(batch, seq, heads_q, 64, device="cuda", requires_grad=True)
        k = torch.randn(batch, seq, heads_k, 64, device="cuda", requires_grad=True)
        cos = torch.randn(1, seq, 64, device="cuda")
        q_out, k_out = rotary.apply_rotary(q, k, cos, cos)
        assert q_out.shape == (batch, heads_q, seq, 64) and k_out.shape == (batch, heads_k,
                                                                              seq, 64)
        (q_out.sum() + k_out.sum()).backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


# --- gradients ---------------------------------------------------------------------------------

def grads(fn, q, k, cos, sin, gq, gk):
    q, k = (t.detach().requires_grad_() for t in (q, k))
    q_out, k_out = fn(q, k, cos, sin)
    torch.autograd.backward([q_out, k_out], [gq, gk])
    return q.grad, k.grad


@pytest.mark.parametrize("cos_batch", ["B", 1])
@pytest.mark.parametrize("d", [128, 6])
def test_gradients_equal_autograd_float32(cos_batch, d):
    q, k = merged_qkv(2, 33, 8, 2, d, torch.float32)
    cos, sin = hf_cos_sin(2, 33, d, torch.float32, 2 if cos_batch == "B" else 1)
    gq = torch.randn(2, 8, 33, d, device="cuda")
    gk = torch.randn(2, 2, 33, d, device="cuda")
    dq, dk = grads(rotary.apply_rotary, q, k, cos, sin, gq, gk)
    want_q, want_k = grads(hf_rotary, q, k, cos, sin, gq, gk)
    assert dq.shape == q.shape and dq.is_contiguous() and dk.is_contiguous()
    torch.testing.assert_close(dq, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dk, want_k, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_low_precision(dtype):
    """fp32 math rounded once: within one rounding of the fp32 autograd gradient."""
    q, k = merged_qkv(2, 33, 8, 2, 128, dtype)
    cos, sin = hf_cos_sin(2, 33, 128, dtype, 2)
    gq = torch.randn(2, 8, 33, 128, device="cuda").to(dtype)
    gk = torch.randn(2, 2, 33, 128, device="cuda").to(dtype)
    dq, dk = grads(rotary.apply_rotary, q, k, cos, sin, gq, gk)
    want_q, want_k = grads(hf_rotary, q.float(), k.float(), cos.float(), sin.float(),
                           gq.float(), gk.float())
    torch.testing.assert_close(dq, want_q.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(dk, want_k.to(dtype), rtol=0, atol=0)


def test_one_gradient_and_non_contiguous_gradients():
    q, k = merged_qkv(2, 9, 8, 2, 64, torch.bfloat16)
    cos, sin = hf_cos_sin(2, 9, 64, torch.bfloat16, 1)
    q = q.detach().requires_grad_()
    q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
    g = torch.randn(2, 9, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    (dq,) = torch.autograd.grad(q_out, q, g)  # a transposed gradient, as SDPA may give
    want = grads(hf_rotary, q.float(), k.float(), cos.float(), sin.float(), g.float(),
                 torch.zeros(2, 2, 9, 64, device="cuda"))[0]
    torch.testing.assert_close(dq, want.to(torch.bfloat16), rtol=0, atol=0)


def test_cos_sin_that_require_grad_run_the_reference():
    q, k = merged_qkv(2, 9, 4, 2, 64, torch.float32)
    cos, sin = (t.requires_grad_() for t in hf_cos_sin(2, 9, 64, torch.float32, 2))
    q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
    assert q_out.transpose(1, 2).is_contiguous()
    (q_out.sum() + k_out.sum()).backward()
    assert cos.grad is not None and sin.grad is not None and cos.grad.abs().sum() > 0


# --- the op: opcheck, the eager path, torch.compile, CUDA graphs -------------------------------

def test_opcheck():
    q, k = merged_qkv(2, 9, 8, 2, 128, torch.bfloat16)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = hf_cos_sin(2, 9, 128, torch.bfloat16, 1)
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.rotary_fwd.default, (q, k, cos, sin))
    q_out, k_out = ops.rotary_fwd(q, k, cos, sin)
    # The backward op has no autograd of its own (no double backward): detached inputs.
    torch.library.opcheck(ops.rotary_bwd.default, (q_out.detach(), k_out.detach(), cos, sin))
    torch.library.opcheck(ops.rotary_bwd.default, (None, k_out.detach(), cos, sin))


def test_eager_path_equals_the_custom_op():
    q, k = merged_qkv(2, 9, 8, 2, 128, torch.bfloat16)
    cos, sin = hf_cos_sin(2, 9, 128, torch.bfloat16, 2)
    gq, gk = torch.randn(2, 8, 9, 128, device="cuda"), torch.randn(2, 2, 9, 128, device="cuda")
    gq, gk = gq.bfloat16(), gk.bfloat16()
    eager = grads(rotary.apply_rotary, q, k, cos, sin, gq, gk)
    op = grads(torch.ops.custom_kernels.rotary_fwd, q, k, cos, sin, gq, gk)
    for a, b in zip(eager, op):
        assert torch.equal(a, b)
    with torch.no_grad():
        for a, b in zip(rotary.apply_rotary(q, k, cos, sin),
                        torch.ops.custom_kernels.rotary_fwd(q, k, cos, sin)):
            assert torch.equal(a, b)


def attention(x, w_qkv, cos, sin, rope):
    """The attention front of a GQA layer: merged QKV projection, split, rotary, SDPA (k and v
    repeated to q's heads as HF's repeat_kv does)."""
    batch, seq, _ = x.shape
    d, heads_q, heads_k = 64, 8, 2
    q, k, v = (x @ w_qkv).split([heads_q * d, heads_k * d, heads_k * d], dim=-1)
    q, k = q.view(batch, seq, -1, d), k.view(batch, seq, -1, d)
    v = v.view(batch, seq, -1, d).transpose(1, 2)
    q, k = rope(q, k, cos, sin)
    k, v = (t.repeat_interleave(heads_q // heads_k, dim=1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.float().square().mean()


def test_torch_compile_fullgraph_forward_and_backward():
    x = torch.randn(2, 64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(512, 768, device="cuda") / 512 ** 0.5).bfloat16().requires_grad_()
    cos, sin = hf_cos_sin(2, 64, 64, torch.bfloat16, 1)
    compiled = torch.compile(attention, fullgraph=True)
    loss = compiled(x, w, cos, sin, rotary.apply_rotary)
    loss.backward()
    ours = [loss.detach(), x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    loss = attention(x, w, cos, sin, hf_rotary)
    loss.backward()
    for got, want in zip(ours, [loss.detach(), x.grad, w.grad]):
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, f"relative error {err:.3g}"


def test_cuda_graph_replay():
    q, k = merged_qkv(4, 128, 32, 8, 128, torch.bfloat16)
    cos, sin = hf_cos_sin(4, 128, 128, torch.bfloat16, 4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compile, load) outside the capture
            rotary.apply_rotary(q, k, cos, sin)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
    for seed in range(3):
        torch.manual_seed(seed)
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        graph.replay()
        want_q, want_k = hf_rotary(q, k, cos, sin)
        assert_same_bits(q_out, want_q)
        assert_same_bits(k_out, want_k)


@pytest.mark.parametrize("backend", ["CUDNN_ATTENTION", "FLASH_ATTENTION", None])
def test_attention_output_comes_back_in_projection_order(backend):
    """What the output layout is for: scaled_dot_product_attention writes its output in its
    query's memory order, so that HF's ``out.transpose(1, 2).contiguous()`` before o_proj is
    free, and the gradient arrives in the output's layout."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k = merged_qkv(2, 256, 32, 8, 128, torch.bfloat16)
    cos, sin = hf_cos_sin(2, 256, 128, torch.bfloat16, 1)
    q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
    v = torch.randn_like(k_out)
    context = sdpa_kernel([getattr(SDPBackend, backend)]) if backend else nullcontext()
    with context:
        out = torch.nn.functional.scaled_dot_product_attention(q_out, k_out, v, is_causal=True,
                                                                enable_gqa=True)
    assert out.transpose(1, 2).is_contiguous()
