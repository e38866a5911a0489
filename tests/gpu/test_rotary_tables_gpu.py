"""Rotary cos / sin tables in one launch on an sm90 GPU (marker gpu): the kernel bit for bit against
Hugging Face's LlamaRotaryEmbedding (default and llama3 RoPE; bf16, fp16, fp32 tables; batch 1
and 3; positions up to 32k; a bf16 inv_freq) and against the torch formula; the custom op's
opcheck; torch.compile(fullgraph=True); CUDA graph replay with new positions; a converted model's
rotary module (report, forward, the decoder's output unchanged)."""

import pytest
import torch

from custom_kernels import rotary_tables as rt

pytestmark = pytest.mark.gpu
hf = pytest.importorskip("transformers.models.llama.modeling_llama")
from transformers import LlamaConfig  # noqa: E402  (after the importorskip)

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 500000.0},
}


def _module(rope="default", head_dim=128):
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         rope_parameters=ROPES[rope], max_position_embeddings=32768)
    return hf.LlamaRotaryEmbedding(config).to("cuda")


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3])
def test_same_bits_as_hugging_face(rope, dtype, batch):
    module = _module(rope)
    positions = torch.randint(0, 32768, (batch, 333), device="cuda")
    theirs = module(torch.empty(0, device="cuda", dtype=dtype), positions)
    ours = rt.rotary_tables(module.inv_freq, positions, module.attention_scaling, dtype)
    formula = rt.torch_tables(module.inv_freq, positions, module.attention_scaling, dtype)
    for a, b, c in zip(ours, theirs, formula):
        assert a.shape == b.shape and a.dtype == dtype
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_bf16_inv_freq_and_a_scaling():
    module = _module().to(torch.bfloat16)
    positions = torch.arange(4096, device="cuda", dtype=torch.int32)[None]
    ours = rt.rotary_tables(module.inv_freq, positions, 0.75, torch.bfloat16)
    theirs = rt.torch_tables(module.inv_freq, positions, 0.75, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_empty_positions():
    cos, sin = rt.rotary_tables(torch.rand(64, device="cuda"),
                                torch.empty(2, 0, dtype=torch.int64, device="cuda"))
    assert cos.shape == sin.shape == (2, 0, 128)


def test_opcheck_and_compile():
    inv_freq = _module().inv_freq
    positions = torch.arange(64, device="cuda").view(2, 32)
    torch.library.opcheck(torch.ops.custom_kernels.rotary_tables.default,
                          (inv_freq, positions, 1.0, torch.bfloat16))
    compiled = torch.compile(lambda p: rt.rotary_tables(inv_freq, p, 1.0, torch.bfloat16),
                             fullgraph=True)
    expected = rt.torch_tables(inv_freq, positions, 1.0, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(compiled(positions), expected))


def test_graph_replay_with_new_positions():
    inv_freq = _module().inv_freq
    positions = torch.arange(16, device="cuda")[None].clone()
    rt.rotary_tables(inv_freq, positions)  # compiled and loaded before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cos, sin = rt.rotary_tables(inv_freq, positions)
    positions.copy_(torch.arange(1000, 1016, device="cuda")[None])
    graph.replay()
    expected = rt.torch_tables(inv_freq, positions, 1.0, torch.bfloat16)
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])


def test_a_converted_model_uses_the_kernel_with_unchanged_outputs():
    import cutlass_ops
    from cutlass_ops.rotary_embedding import FusedRotaryEmbedding
    from transformers import LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (2, 48), device="cuda")
    positions = torch.arange(48, device="cuda")[None].expand(2, -1)
    x = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    expected = model.model.rotary_emb(x, positions)
    report = cutlass_ops.convert(model)
    decision = next(d for d in report.decisions if d.name == "model.rotary_emb")
    assert decision.converted, decision.reason
    assert isinstance(model.model.rotary_emb, FusedRotaryEmbedding)
    got = model.model.rotary_emb(x, positions)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
