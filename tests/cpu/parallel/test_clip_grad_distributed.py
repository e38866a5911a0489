"""The distributed clip's math on the CPU: gradients sharded across two gloo ranks (plain local
tensors and DTensors with a Shard placement) clipped to what torch.nn.utils.clip_grad_norm_
gives on the whole gradients in one process; the local norm without scaling; refusals."""

import math
import sys
from pathlib import Path

import pytest
import torch

from custom_kernels import clip_grad
from custom_kernels.parallel import clip_grad_distributed
from custom_kernels.core.errors import UnsupportedInputError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gloo_ranks import on_ranks  # noqa: E402


def full_gradients(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 4, generator=g) * 3, torch.randn(10, generator=g),
            torch.randn(4, 2, generator=g), torch.zeros(0)]


CASES = [(norm_type, use_dtensor) for use_dtensor in (False, True)
         for norm_type in (2.0, 1.0, math.inf)]


def _clip(rank, world, norm_type, use_dtensor):
    grads = [t.chunk(world)[rank].clone() if t.numel() else t.clone()
             for t in full_gradients()]
    if use_dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        grads = [DTensor.from_local(g, mesh, [Shard(0)]) for g in grads]
    norm = clip_grad_distributed.clip_grad_norm_(grads, 1.0, norm_type)
    if use_dtensor:  # replicated on the gradients' mesh, as torch returns it
        assert [type(p).__name__ for p in norm.placements] == ["Replicate"]
        norm = norm.to_local()
    local = [g.to_local() if use_dtensor else g for g in grads]
    return {"norm": norm, "grads": local}


def _clip_every_case(rank, world):
    """Every case on the same two ranks (a spawn of ranks costs seconds; a case microseconds)."""
    return [_clip(rank, world, *case) for case in CASES]


def test_two_ranks_clip_like_torch_on_the_whole_gradients(tmp_path):
    per_rank = on_ranks(tmp_path, _clip_every_case)
    for index, (norm_type, use_dtensor) in enumerate(CASES):
        results = [cases[index] for cases in per_rank]
        params = []
        for g in full_gradients():  # torch clips .grad (and refuses an empty one's inf norm)
            if not g.numel():
                continue
            params.append(torch.nn.Parameter(torch.zeros_like(g)))
            params[-1].grad = g
        expected_norm = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type)
        expected = [p.grad for p in params] + [torch.zeros(0)]
        case = f"norm_type={norm_type}, dtensor={use_dtensor}"
        for result in results:
            torch.testing.assert_close(result["norm"], expected_norm.float(), rtol=1e-5,
                                       atol=1e-6, msg=case)
        for i, whole in enumerate(expected):
            if whole.numel():
                torch.testing.assert_close(torch.cat([r["grads"][i] for r in results]), whole,
                                           msg=case)


def test_the_local_norm_scales_nothing_and_keeps_float32():
    grads = [g.bfloat16() for g in full_gradients()]
    before = [g.clone() for g in grads]
    norm = clip_grad.total_norm(grads, 2.0, out_dtype=torch.float32)
    assert norm.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(grads, before))
    expected = torch.cat([g.float().reshape(-1) for g in grads]).norm()
    torch.testing.assert_close(norm, expected)
    assert clip_grad.total_norm(grads, 2.0).dtype == torch.bfloat16  # torch's default


def test_replicated_dtensors_and_other_norms_are_refused_by_name():
    class Replicate:  # a placement named like torch's
        pass

    class FakeDTensor(torch.Tensor):
        placements = (Replicate(),)

    with pytest.raises(UnsupportedInputError, match="Replicate"):
        clip_grad_distributed.local_parts([torch.zeros(2).as_subclass(FakeDTensor)])
    with pytest.raises(UnsupportedInputError, match="norm types 1, 2 and inf"):
        clip_grad_distributed.clip_grad_norm_([torch.ones(2)], 1.0, 3.0)


def test_dtensor_gradients_mixed_with_plain_ones_are_refused_by_name(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = DTensor.from_local(torch.ones(4), mesh, [Shard(0)])
        with pytest.raises(UnsupportedInputError, match="one 1-D device mesh"):
            clip_grad_distributed.clip_grad_norm_([sharded, torch.ones(3)], 1.0)
        norm = clip_grad_distributed.clip_grad_norm_([sharded], 1.0)  # alone: clipped to 1
        assert abs(float(norm.to_local()) - 2.0) < 1e-6
        assert abs(float(sharded.to_local().norm()) - 1.0) < 1e-5
    finally:
        dist.destroy_process_group()
