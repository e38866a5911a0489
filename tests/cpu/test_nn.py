"""cutlass_ops.nn.convert as passes, on the CPU: the order the passes are declared in, each
ConvertConfig option turning off exactly its passes, FP8's decisions amending the earlier ones,
each module decided by one pass, and the Linear refusals (cutlass_ops.conversion_refusals' words)
in the report, on a GPU stand-in where the refusal needs one."""

import pytest
import torch
from torch import nn

from cutlass_ops import nn as cnn

PASSES = [step.run.__name__ for step in cnn._STEPS]
LayerDecision = cnn.LayerDecision


def test_the_passes_run_in_the_order_their_inputs_need():
    def before(first, then):
        return PASSES.index(first) < PASSES.index(then)

    assert before("_experts_pass", "_router_pass")  # a router is fused beside grouped experts
    assert before("_norm_pass", "_decoder_block_pass")  # a block runs the norms it holds
    assert before("_linear_pass", "_decoder_block_pass")
    assert before("_decoder_block_pass", "_causal_mask_pass")  # only with fused blocks
    assert before("_fused_loss_pass", "_fp8_pass")  # the LM head's FP8 reason names the loss
    assert PASSES[-1] == "_fp8_pass"
    assert [step.run.__name__ for step in cnn._STEPS if step.amends] == ["_fp8_pass"]


@pytest.fixture
def ran(monkeypatch):
    """The names of the passes convert runs, each recorded instead of run."""
    names = []

    def recorded(step):
        def run(model, config):
            names.append(step.run.__name__)
            return []

        return step._replace(run=run)

    monkeypatch.setattr(cnn, "_STEPS", tuple(recorded(step) for step in cnn._STEPS))
    return names


@pytest.mark.parametrize("option,skipped", [
    ("experts", {"_experts_pass", "_router_pass"}),
    ("norms", {"_norm_pass"}),
    ("fuse_blocks", {"_decoder_block_pass", "_rotary_pass", "_causal_mask_pass"}),
    ("fused_loss", {"_fused_loss_pass"}),
    ("fuse_activations", set()),  # an option of the Linear pass, which always runs
])
def test_an_option_turned_off_skips_exactly_its_passes(ran, option, skipped):
    cnn.convert(nn.Linear(8, 8), cnn.ConvertConfig(**{option: False}))
    assert ran == [name for name in PASSES if name not in skipped | {"_fp8_pass"}]


def test_fp8_runs_last_and_only_with_a_recipe(ran):
    cnn.convert(nn.Linear(8, 8))
    assert "_fp8_pass" not in ran
    ran.clear()
    cnn.convert(nn.Linear(8, 8), fp8="tensorwise")
    assert ran == PASSES


def test_fp8_decisions_amend_the_earlier_ones(monkeypatch):
    def bf16(model, config):
        return [LayerDecision("a", "Linear", True, "bf16"),
                LayerDecision("b", "Linear", True, "bf16"),
                LayerDecision("c", "Linear", False, "cpu"),
                LayerDecision("d", "Linear", True, "bf16")]

    def fp8(model, config):
        return [LayerDecision("a", "Linear", True, "FP8", "rowwise"),
                LayerDecision("b", "Linear", False, "64x8: no"),
                LayerDecision("c", "Linear", True, "FP8", "rowwise"),
                LayerDecision("e", "FusedBlock", True, "FP8 block", "rowwise")]

    monkeypatch.setattr(cnn, "_STEPS", (cnn._Step(None, bf16), cnn._Step("fp8", fp8, amends=True)))
    assert cnn.convert(nn.Linear(8, 8), fp8="rowwise").decisions == [
        LayerDecision("a", "Linear", True, "FP8", "rowwise"),
        LayerDecision("b", "Linear", True, "bf16; not FP8: 64x8: no"),
        LayerDecision("c", "Linear", True, "FP8", "rowwise"),
        LayerDecision("d", "Linear", True, "bf16"),
        LayerDecision("e", "FusedBlock", True, "FP8 block", "rowwise")]


class LookAlikeExperts(nn.Module):
    """Built like Hugging Face's experts: [E, 2I, H] and [E, H, I] weights and a SiLU."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 32, 16))
        self.down_proj = nn.Parameter(torch.zeros(2, 16, 16))
        self.act_fn = nn.SiLU()


class LookAlikeRMSNorm(nn.Module):
    """Built like Hugging Face's LlamaRMSNorm: one 1-D weight and a float epsilon."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))
        self.variance_epsilon = 1e-6


def test_each_module_is_decided_by_one_pass_the_report_in_pass_order():
    model = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16), LookAlikeRMSNorm(),
                          LookAlikeExperts(), nn.LayerNorm(16))
    report = cnn.convert(model)
    assert [(d.name, d.kind) for d in report.decisions] == [
        ("3", "LookAlikeExperts"),  # the experts pass
        ("1", "RMSNorm"), ("2", "LookAlikeRMSNorm"), ("4", "LayerNorm"),  # the norm pass
        ("0", "Linear")]  # the Linear pass
    assert set(report.skipped.values()) == {"weights on cpu: move the model to a CUDA device first"}


def test_a_dtensor_weight_is_left_to_its_plan():
    sharded = nn.Linear(16, 16)
    sharded.weight.to_local = lambda: None  # what the refusal looks for on a DTensor
    report = cnn.convert(nn.Sequential(sharded, nn.Linear(16, 16)))
    assert report.skipped == {"0": "a tensor-parallel (DTensor) weight: left to its plan",
                              "1": "weights on cpu: move the model to a CUDA device first"}


@pytest.fixture
def gpu(monkeypatch):
    """Every tensor reports a CUDA device, on a GPU of the capability set in the returned list
    (sm90 by default). Only refusals can run: a swap would make tensors on that device."""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    return capability


def linears_only(model) -> dict:
    return cnn.convert(model, norms=False, experts=False, fuse_blocks=False,
                       fused_loss=False).skipped


def test_linear_refusals_on_a_gpu(gpu):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 12).bfloat16(),
                          nn.Linear(16, 16).half())
    gpu[0] = (8, 0)
    assert linears_only(model) == {
        "0": "torch.float32 weights: our kernels are bf16/fp16 (fp32 would run as tf32 and "
             "change the numbers)",
        "1": "NVIDIA A100-SXM4-80GB is not an sm90 GPU",
        "2": "NVIDIA A100-SXM4-80GB is not an sm90 GPU"}
    gpu[0] = (9, 0)
    assert linears_only(model[:2])["1"] == \
        "16x12: both must be multiples of 8 for 16-byte aligned rows (TMA)"
