"""custom_kernels.parallel.sharding_rules on two GPUs (marker gpu; NCCL ranks): the cases of
tests/cpu/parallel/test_sharding.py with the ops' own CUDA kernels instead of the CPU stand-ins. Norms,
rotary and SwiGLU on DTensors sharded on the sequence, the batch or the heads stay local (no
collective forward or backward, results sharded, weight gradients Partial) and equal the torch
references on the whole tensors; a last-dimension shard is gathered by DTensor and still right."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cpu" / "parallel"))
from gloo_ranks import on_ranks  # noqa: E402
from test_sharding import _cases  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or
    not torch.distributed.is_nccl_available(), reason="needs two GPUs and NCCL")]


def test_the_ops_stay_local_on_cuda_dtensors(tmp_path):
    cases = [(c, d, True) for c in ("rms", "rms_residual", "ln", "ln_residual") for d in (0, 1)]
    cases += [(c, d, True) for c in ("rotary", "rotary_batch_cos") for d in (0, 1, 2)]
    cases += [("swiglu", d, True) for d in (0, 1)]
    on_ranks(tmp_path, _cases, cases, "cuda", backend="nccl")


def test_a_last_dimension_shard_is_gathered_and_still_right(tmp_path):
    counts = on_ranks(tmp_path, _cases, [("rms_residual", 2, False), ("ln", 2, False),
                                         ("swiglu", 2, False), ("rotary", 3, False)], "cuda",
                      backend="nccl")[0]
    assert all(fwd > 0 for fwd, _ in counts.values()), counts
