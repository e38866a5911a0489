"""cutlass_ops.conversion_refusals on the CPU: each shared refusal with its words and when it does
not apply, on fake weights (CPU and meta tensors, a CUDA device named by a stand-in, an object
with ``to_local`` for a DTensor, the GPU's capability mocked), and the order ``weight_refusal``
checks them in."""

from types import SimpleNamespace

import pytest
import torch

from cutlass_ops import conversion_refusals as refusals

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


def fake_weight(device=CUDA, dtype=torch.bfloat16, dtensor=False):
    weight = SimpleNamespace(device=device, dtype=dtype)
    if dtensor:
        weight.to_local = lambda: None
    return weight


@pytest.fixture
def gpu(monkeypatch):
    """The CUDA driver as it would answer for one GPU: set ``gpu.capability`` (sm90 by default);
    ``gpu.asked`` counts the questions."""
    state = SimpleNamespace(capability=(9, 0), asked=0)

    def capability(device):
        state.asked += 1
        return state.capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    return state


def test_sharded_refuses_a_dtensor_and_nothing_else():
    assert refusals.sharded(fake_weight(dtensor=True)) == \
        "a tensor-parallel (DTensor) weight: left to its plan"
    assert refusals.sharded(torch.zeros(2)) is None


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_off_cuda_names_the_device_and_what_is_there(device):
    tensor = torch.zeros(2, device=device)
    assert refusals.off_cuda(tensor) == \
        f"weights on {device}: move the model to a CUDA device first"
    assert refusals.off_cuda(tensor, "buffers").startswith(f"buffers on {device}: ")
    assert refusals.off_cuda(fake_weight()) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float8_e4m3fn])
def test_not_sixteen_bit_names_the_dtype_and_the_kernels(dtype):
    assert refusals.not_sixteen_bit(dtype, "the fused blocks") == \
        f"{dtype} weights: the fused blocks are bf16/fp16"
    assert refusals.not_sixteen_bit(dtype, "our kernels", " (why)").endswith("bf16/fp16 (why)")


@pytest.mark.parametrize("dtype", refusals.SIXTEEN_BIT)
def test_not_sixteen_bit_takes_bf16_and_fp16(dtype):
    assert refusals.not_sixteen_bit(dtype, "our kernels") is None


def test_not_sm90_names_the_gpu(gpu):
    gpu.capability = (8, 0)
    assert refusals.not_sm90(CUDA) == "NVIDIA A100-SXM4-80GB is not an sm90 GPU"
    assert refusals.not_sm90(CUDA, ": FP8 layers need one").endswith("GPU: FP8 layers need one")
    gpu.capability = (10, 0)  # newer is not sm90 either: the kernels are sm90a
    assert refusals.not_sm90(CUDA) is not None
    gpu.capability = (9, 0)
    assert refusals.not_sm90(CUDA) is None


def test_unaligned_names_the_sizes():
    assert refusals.unaligned("16x12", 16, 12, " (TMA)") == \
        "16x12: both must be multiples of 8 for 16-byte aligned rows (TMA)"
    assert refusals.unaligned("hidden 4", 4, 16) is not None
    assert refusals.unaligned("16x32", 16, 32) is None


def test_weight_refusal_checks_a_dtensor_only_when_asked(gpu):
    sharded = fake_weight(dtensor=True)
    assert refusals.weight_refusal(sharded, dtensor=True) == refusals.sharded(sharded)
    assert refusals.weight_refusal(sharded) is None
    # first: a DTensor on the CPU in float32 is refused as a DTensor
    cpu_fp32 = fake_weight(torch.device("cpu"), torch.float32, dtensor=True)
    assert "DTensor" in refusals.weight_refusal(cpu_fp32, kernels="our kernels", dtensor=True)


def test_weight_refusal_asks_no_gpu_question_off_cuda(gpu):
    cpu_fp32 = fake_weight(torch.device("cpu"), torch.float32)
    why = refusals.weight_refusal(cpu_fp32, kernels="our kernels", sm90=True)
    assert why == "weights on cpu: move the model to a CUDA device first"
    assert gpu.asked == 0


def test_weight_refusal_checks_the_dtype_before_the_gpu(gpu):
    gpu.capability = (8, 0)
    fp32 = fake_weight(dtype=torch.float32)
    assert refusals.weight_refusal(fp32, kernels="the grouped GEMMs", sm90=True) == \
        "torch.float32 weights: the grouped GEMMs are bf16/fp16"
    assert refusals.weight_refusal(fp32, kernels="k", dtype_note=" (n)", sm90=True).endswith("(n)")
    assert refusals.weight_refusal(fp32, sm90=True) == \
        "NVIDIA A100-SXM4-80GB is not an sm90 GPU"  # no kernels named: the dtype is not checked
    assert gpu.asked == 1


def test_weight_refusal_asks_the_gpu_only_when_told(gpu):
    gpu.capability = (8, 0)
    assert refusals.weight_refusal(fake_weight(), kernels="our kernels") is None
    assert gpu.asked == 0
    assert refusals.weight_refusal(fake_weight(), kernels="our kernels", sm90=True) is not None
    gpu.capability = (9, 0)
    assert refusals.weight_refusal(fake_weight(), kernels="our kernels", sm90=True,
                                   dtensor=True) is None
