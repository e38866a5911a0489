"""``clip_grad_norm_`` over gradients sharded across ranks (FSDP2's ``fully_shard``: DTensor
gradients with ``Shard`` placements, or plain tensors that are each rank's own part): the local
norm in our kernels (``custom_kernels.clip_grad.total_norm``: two launches, no host sync), one
all-reduce of it through torch.distributed (the p-th powers summed for norms 1 and 2, the
maximum for inf), then every local gradient scaled by ``min(1, max_norm / (norm + 1e-6))`` as
``torch.nn.utils.clip_grad_norm_`` scales (in place, the coefficient in the gradients' dtype,
as torch's foreach path multiplies). The result is the total norm of the whole, unsharded
gradients, the same on every rank.

Replicated gradients (DDP's, or a DTensor with a ``Replicate`` placement) are the same on every
rank: clip them with ``custom_kernels.clip_grad.clip_grad_norm_`` on each rank instead; a
``Replicate`` placement here is refused (it would be counted once per rank).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from custom_kernels.clip_grad import gradients, total_norm
from custom_kernels.core.errors import UnsupportedInputError


def local_parts(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's local tensor: a DTensor's ``to_local()`` (Shard placements only)."""
    out = []
    for g in grads:
        placements = getattr(g, "placements", None)
        if placements is None:
            out.append(g)
            continue
        if any(type(p).__name__ == "Replicate" for p in placements):
            raise UnsupportedInputError(
                "clip_grad_norm_ (distributed): a DTensor gradient with a Replicate placement "
                "would be counted once per rank; clip replicated gradients with "
                "custom_kernels.clip_grad.clip_grad_norm_ on each rank")
        out.append(g.to_local())
    return out


def clip_grad_norm_(parameters_or_grads, max_norm: float, norm_type: float = 2.0, *,
                    group: Optional[object] = None) -> torch.Tensor:
    """The total norm of the sharded gradients, equal on every rank, after scaling them in
    place: a 0-d float32 tensor on the local gradients' device, or for DTensor gradients (one
    1-D mesh, FSDP2's case) a DTensor replicated on their mesh, as torch returns it.
    ``group``: the process group (for DTensors their mesh's; else torch.distributed's default
    one when None)."""
    norm_type = float(norm_type)
    if norm_type not in (1.0, 2.0, math.inf):
        raise UnsupportedInputError(f"clip_grad_norm_ (distributed): norm types 1, 2 and inf, "
                                    f"not {norm_type}")
    grads = gradients(parameters_or_grads)
    mesh = _one_mesh(grads)
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Replicate

        norm = _clip_local(local_parts(grads), max_norm, norm_type,
                           group if group is not None else mesh.get_group())
        return DTensor.from_local(norm, mesh, [Replicate()], run_check=False)
    return _clip_local(local_parts(grads), max_norm, norm_type, group)


def _one_mesh(grads: list):
    """The device mesh of DTensor gradients (None for plain tensors); refuses a mix, several
    meshes or a multi-dimensional one (HSDP, tensor parallel: not ours to reduce)."""
    meshes = {getattr(g, "device_mesh", None) for g in grads}
    if meshes <= {None}:
        return None
    if None in meshes or len(meshes) > 1 or next(iter(meshes)).ndim != 1:
        raise UnsupportedInputError(
            "clip_grad_norm_ (distributed): DTensor gradients must all be sharded over one 1-D "
            "device mesh (FSDP2's fully_shard); use torch.nn.utils.clip_grad_norm_ for others")
    return next(iter(meshes))


def _clip_local(local: list, max_norm: float, norm_type: float, group) -> torch.Tensor:
    import torch.distributed as dist

    device = local[0].device if local else torch.device(
        "cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    norm = total_norm(local, norm_type, out_dtype=torch.float32).to(device)
    if norm_type == math.inf:
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
    else:
        norm = norm.pow(norm_type)
        dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
        norm = norm.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in local:
        g.mul_(coefficient.to(g.device))
    return norm


__all__ = ["clip_grad_norm_", "local_parts"]
