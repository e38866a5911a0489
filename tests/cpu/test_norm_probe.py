"""Norm modules that are not torch's own: recognised by structure, swapped only after the numeric
probe agrees, and the report says why not otherwise. On the CPU our module runs its torch
reference (the CPU rule), so these tests check the probe's logic and the formulas; the GPU test
checks the kernels against Hugging Face's modules."""

import pytest
import torch
from torch import nn

from cutlass_ops import norm_probe
from cutlass_ops.nn import RMSNorm, convert


class HfStyleRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, written out: float32 statistics, rounded before the weight."""

    def __init__(self, hidden, eps=1e-6, dtype=torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class MeanSubtracting(HfStyleRMSNorm):
    """Built like an RMSNorm, computes a LayerNorm without bias."""

    def forward(self, x):
        h = x.float()
        h = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False)
                                                         + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class GemmaStyle(HfStyleRMSNorm):
    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class IgnoresWeight(HfStyleRMSNorm):
    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


def test_structure_is_one_weight_no_buffers_and_an_epsilon():
    assert norm_probe.looks_like_rms_norm(HfStyleRMSNorm(64))
    assert not norm_probe.looks_like_rms_norm(nn.RMSNorm(64))  # torch's own converts directly
    assert not norm_probe.looks_like_rms_norm(RMSNorm(64))  # ours already
    with_bias = HfStyleRMSNorm(64)
    with_bias.bias = nn.Parameter(torch.zeros(64))
    assert "single 1-D weight" in norm_probe.structure_refusal(with_bias)
    no_eps = HfStyleRMSNorm(64)
    del no_eps.variance_epsilon
    assert "epsilon" in norm_probe.structure_refusal(no_eps)
    buffered = HfStyleRMSNorm(64)
    buffered.register_buffer("scale", torch.ones(1))
    assert "buffers" in norm_probe.structure_refusal(buffered)
    assert norm_probe.epsilon(HfStyleRMSNorm(64, eps=1e-5)) == 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_probe_accepts_hugging_face_numerics(dtype):
    assert norm_probe.probe(HfStyleRMSNorm(256, dtype=dtype)) is None


@pytest.mark.parametrize("cls, words", [(MeanSubtracting, "differs from an RMSNorm"),
                                        (IgnoresWeight, "differs from an RMSNorm")])
def test_probe_refuses_look_alikes_and_says_what_differs(cls, words):
    why = norm_probe.probe(cls(4096))
    assert why is not None and words in why and "left to torch" in why


def test_probe_leaves_the_module_untouched():
    module = HfStyleRMSNorm(64)
    before = module.weight.detach().clone()
    norm_probe.probe(module)
    assert torch.equal(module.weight, before)


def test_drop_in_shares_the_weight_and_the_state_dict():
    module = HfStyleRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        module.weight.normal_()
    ours = norm_probe.drop_in(module)
    assert ours.weight is module.weight and ours.eps == 1e-5
    assert list(ours.state_dict()) == list(module.state_dict()) == ["weight"]


def test_convert_reports_recognised_norms_off_the_gpu():
    model = nn.Sequential(HfStyleRMSNorm(64), nn.Linear(64, 64), MeanSubtracting(64))
    report = convert(model)
    assert report.skipped["0"].startswith("weights on cpu")
    assert report.skipped["2"].startswith("weights on cpu")
    assert type(model[0]) is HfStyleRMSNorm


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_hugging_face_norm_classes_are_recognised_and_agree(family):
    modeling = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    cls = next(getattr(modeling, name) for name in dir(modeling) if name.endswith("RMSNorm"))
    module = cls(256, eps=1e-6).to(torch.bfloat16)
    assert norm_probe.looks_like_rms_norm(module)
    assert norm_probe.probe(module) is None


def test_gemma_style_is_matched_as_the_offset_variant():
    offset, why = norm_probe.match(GemmaStyle(4096))
    assert offset and why is None
    assert "OffsetRMSNorm" in norm_probe.probe(GemmaStyle(4096))  # not the plain RMSNorm
    assert norm_probe.match(HfStyleRMSNorm(256)) == (False, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma_norm_class_gets_offset_rms_norm_with_its_numerics_and_gradients(dtype):
    modeling = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    module = modeling.GemmaRMSNorm(256, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.normal_(0, 0.5)
    assert norm_probe.looks_like_rms_norm(module)
    offset, why = norm_probe.match(module)
    assert offset and why is None
    ours = norm_probe.drop_in(module, offset)
    assert ours.weight is module.weight and list(ours.state_dict()) == ["weight"]
    x = torch.randn(8, 256, dtype=dtype, requires_grad=True)
    y_ours, y_theirs = ours(x), module(x)
    torch.testing.assert_close(y_ours, y_theirs)
    grad = torch.randn_like(y_ours)
    mine = torch.autograd.grad(y_ours, (x, module.weight), grad)
    theirs = torch.autograd.grad(y_theirs, (x, module.weight), grad)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
