"""cutlass_ops.parallel.tensor_parallel on 2 and 4 GPUs (marker gpu; NCCL ranks): the CPU test's model
(tests/cpu/parallel/test_tensor_parallel.py) in bf16 with the ops' own kernels, sharded by
``parallelize`` after fusing or by torch's Llama plan before, 8 query and 4 key/value
heads so that 4 ranks divide them. The sharded model's loss, every gradient and its logits
against the same fused model on one GPU (bf16 tolerances: the ranks' partial sums round
otherwise), the merged GEMMs packed a rank, the state_dict round trips, and the collectives of a
step counted exactly."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cpu" / "parallel"))
from gloo_ranks import on_ranks  # noqa: E402
from test_tensor_parallel import CONFIG, _train_and_infer  # noqa: E402

from custom_kernels.core.tolerances import relative_error  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or
    not torch.distributed.is_nccl_available(), reason="needs two GPUs and NCCL")]
GPU_CONFIG = {**CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 128}


@pytest.mark.parametrize("how", ["parallelize", "torch_plan"])
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 4, reason="needs four GPUs"))])
def test_the_sharded_model_trains_and_infers_as_one_gpu(tmp_path, world, how):
    results = on_ranks(tmp_path, _train_and_infer, "cuda", GPU_CONFIG, how, world=world,
                       backend="nccl")
    got, expected = results[0]
    assert relative_error(got["loss"], expected["loss"]) < 1e-2
    assert all(torch.equal(r[0]["loss"].cpu(), got["loss"].cpu()) for r in results)
    for name, grad in expected["grads"].items():
        assert relative_error(got["grads"][name], grad) < 5e-2, name
    assert relative_error(got["logits"], expected["logits"]) < 2e-2
    assert got["packed"] == [True, True]
    assert got["local_q_rows"] == 8 * 16 // world
    assert got["state"] == {"sharded_types": ["DTensor", "Tensor"], "reloaded": True,
                            "into_unsharded": True, "keys": True}
    layers = GPU_CONFIG["num_hidden_layers"]
    assert got["forward_comms"] == {"c10d.allreduce_": 2 * layers, "c10d._allgather_base_": 2}
    assert got["backward_comms"] == {"c10d.allreduce_": 2 * layers + 1}
