"""custom_kernels.rotary_tables and cutlass_ops.rotary_embedding on the CPU: the torch formula is
Hugging Face's rotary embedding bit for bit (the kernel's GPU test compares the kernel with it);
refusals; the custom op's fake and schema; which modules are taken by structure, which are
refused (dynamic and per-layer RoPE), the conversion's report, unfuse."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

from cutlass_ops import rotary_embedding  # noqa: E402
from custom_kernels import rotary_tables as rt  # noqa: E402
from custom_kernels.core.errors import UnsupportedInputError  # noqa: E402

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024,
               "rope_theta": 500000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


def _hf(rope="default", head_dim=32):
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                         rope_parameters=ROPES[rope], max_position_embeddings=4096)
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("rope", ["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_formula_is_hugging_faces(rope, dtype, batch):
    module = _hf(rope)
    positions = torch.randint(0, 4096, (batch, 37), generator=torch.Generator().manual_seed(1))
    theirs = module(torch.empty(0, dtype=dtype), positions)
    ours = rt.rotary_tables(module.inv_freq, positions, module.attention_scaling, dtype)
    for a, b in zip(ours, theirs):
        assert a.dtype == dtype and a.shape == (batch, 37, module.inv_freq.numel() * 2)
        assert torch.equal(a, b)


def test_a_bf16_inv_freq_is_widened_as_hugging_face_does():
    module = _hf().to(torch.bfloat16)  # a model cast with its buffers
    assert module.inv_freq.dtype == torch.bfloat16
    positions = torch.arange(100)[None]
    theirs = module(torch.empty(0, dtype=torch.bfloat16), positions)
    ours = rt.rotary_tables(module.inv_freq, positions, 1.0, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("inv_freq, positions, dtype, words", [
    (torch.ones(2, 4), torch.arange(3), torch.bfloat16, "1-D float"),
    (torch.ones(4, dtype=torch.int32), torch.arange(3), torch.bfloat16, "1-D float"),
    (torch.ones(4), torch.arange(3.0), torch.bfloat16, "int64 or int32"),
    (torch.ones(4), torch.arange(3), torch.int8, "bf16, fp16 or float32"),
])
def test_refusals(inv_freq, positions, dtype, words):
    with pytest.raises(UnsupportedInputError, match=words):
        rt.rotary_tables(inv_freq, positions, 1.0, dtype)


def test_the_custom_op():
    inv_freq, positions = torch.rand(8), torch.arange(12).view(2, 6)
    torch.library.opcheck(torch.ops.custom_kernels.rotary_tables.default,
                          (inv_freq, positions, 1.5, torch.bfloat16))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        cos, sin = torch.ops.custom_kernels.rotary_tables(torch.empty(8), torch.empty(
            2, 6, dtype=torch.int64), 1.0, torch.float16)
    assert cos.shape == sin.shape == (2, 6, 16) and cos.dtype == torch.float16


def test_static_ropes_are_taken_and_dynamic_ones_refused():
    assert rotary_embedding.looks_like_rotary_embedding(_hf())
    assert rotary_embedding.structure_refusal(_hf()) is None
    assert rotary_embedding.structure_refusal(_hf("llama3")) is None
    assert "follows the positions" in rotary_embedding.structure_refusal(_hf("dynamic"))
    per_layer = _hf()
    per_layer.rope_type = {"full_attention": "default", "sliding_attention": "default"}
    assert "per layer type" in rotary_embedding.structure_refusal(per_layer)
    assert not rotary_embedding.looks_like_rotary_embedding(torch.nn.Linear(2, 2))


def test_off_cuda_the_module_stays_and_the_report_says_why():
    module = _hf()
    assert "move the model to a CUDA device" in rotary_embedding.fuse(module, torch.bfloat16)
    assert type(module) is LlamaRotaryEmbedding


def test_a_fused_module_runs_hugging_faces_forward_off_cuda_and_unfuses():
    """The swap itself (normally after the GPU probe): off CUDA the forward is Hugging Face's,
    and unfuse gives the class back."""
    module = _hf()
    positions = torch.arange(20)[None]
    expected = module(torch.empty(0), positions)
    module.__class__ = rotary_embedding._fused_class(LlamaRotaryEmbedding)
    assert isinstance(module, LlamaRotaryEmbedding)  # transformers' isinstance checks hold
    assert all(torch.equal(a, b) for a, b in zip(module(torch.empty(0), positions), expected))
    rotary_embedding.unfuse(module)
    assert type(module) is LlamaRotaryEmbedding


def test_convert_reports_the_rotary_embedding():
    import cutlass_ops
    from transformers import LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    report = cutlass_ops.convert(LlamaForCausalLM(config))
    decision = next(d for d in report.decisions if d.name == "model.rotary_emb")
    assert not decision.converted and "CUDA device" in decision.reason
