"""A converted model under torch.distributed, one rank per GPU over NCCL (world size 1 on any GPU
machine, and 2 where there are two GPUs): DDP and FSDP2 (``fully_shard``) train steps in bf16
run the converted modules and our kernels and match the same step without torch.distributed
(loss, every gradient, the clipped norm through our distributed clip); FSDP2's full state_dict
round trips."""

import pytest
import torch

pytest.importorskip("transformers")

import distributed_steps  # noqa: E402
from custom_kernels.core.tolerances import relative_error  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.distributed.is_nccl_available(), reason="no NCCL")]


@pytest.fixture(scope="module")
def reference():
    return distributed_steps.single("cuda", torch.bfloat16)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs"))])
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_ranks_train_like_no_distributed_run(tmp_path, reference, mode, world):
    got = distributed_steps.run(mode, world, "cuda", "bfloat16", str(tmp_path / "rank0.pt"))
    assert got["converted"] == reference["converted"]
    assert len(got["converted"]) > 1  # decoder blocks, norms and the loss, not only the head
    assert abs(float(got["loss"]) - float(reference["loss"])) <= 1e-2 * float(reference["loss"])
    assert got["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        assert relative_error(got["grads"][name], grad) < 3e-2, name
    assert abs(float(got["norm"]) - float(reference["norm"])) <= 2e-2 * float(reference["norm"])
    for name, value in reference["state"].items():
        assert torch.equal(got["state"][name].cpu(), value), name
