"""The GEMMs of a fused decoder block on each rank's shards of its weights (tensor
parallelism): ``TensorParallelGemms`` stands in for ``cutlass_ops.fused_linear``'s
merged and residual GEMMs (``decoder_blocks`` calls them as its blocks' ``BlockGemms``) and reads
each DTensor weight's local shard; ``adopt(attention, mlp)`` checks that a layer's weights are
sharded the Megatron way (q, k, v, gate, up ``Shard(0)``; o_proj, down_proj ``Shard(1)``; one
1-D mesh, as torch's Llama plan or ``cutlass_ops.parallel.tensor_parallel.parallelize`` leaves them)
and lays each rank's q, k, v (and gate, up) end to end in one buffer, so that the merged GEMMs
stay one GEMM a rank. ``cutlass_ops.parallel.tensor_parallel`` says what runs where.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cutlass_ops import fused_linear
from cutlass_ops.gemms import dispatch


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; the gradient summed over the ranks (each rank's sharded GEMM gives a
    part of the input's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """The partial products summed over the ranks forward; identity backward (each rank's
    shard needs the whole output gradient, which every rank holds)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# Overlap of the layer's all-reduces with its GEMMs (issue 52), off until measured on GPUs
# (benchmarks/multigpu.py --tp-overlap): the row-parallel GEMMs (o_proj, down_proj) computed in
# ROW_BLOCKS blocks of rows, each block's all-reduce running on NCCL's stream while the next
# block's GEMM runs (blocks of at least MIN_BLOCK_ROWS rows: a decode step stays one GEMM); and
# the column-parallel GEMMs' input gradient all-reduced while their weight gradient's GEMM runs.
ROW_BLOCKS = 1
MIN_BLOCK_ROWS = 1024
OVERLAP_GRAD_X = False


class _RowParallelBlocks(torch.autograd.Function):
    """``x @ weight^T`` summed over the ranks, computed in ``blocks`` blocks of rows whose
    all-reduces overlap the next block's GEMM; backward: the two local GEMMs (every rank holds
    the whole output gradient: nothing to reduce)."""

    @staticmethod
    def forward(ctx, x, weight, group, blocks):
        ctx.save_for_backward(x, weight)
        parts, pending = [], []
        for rows in x.reshape(-1, x.shape[-1]).tensor_split(blocks):
            parts.append(dispatch.matmul(rows, weight.t()))
            pending.append(dist.all_reduce(parts[-1], group=group, async_op=True))
        for work in pending:
            work.wait()
        return torch.cat(parts).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.no_grad():
            grad_x, grad_w = fused_linear.linear_grads(grad, x, weight, ctx.needs_input_grad[0],
                                                       ctx.needs_input_grad[1])
        return grad_x, grad_w, None, None


def _row_blocks(x: Tensor, weight: Tensor) -> int:
    """How many blocks ``_RowParallelBlocks`` splits this call into; 1: not split."""
    blocks = min(ROW_BLOCKS, x.numel() // x.shape[-1] // MIN_BLOCK_ROWS)
    return blocks if blocks > 1 and fused_linear.uses_eager_autograd(x, weight) else 1


def _local(weights: Sequence[Tensor]) -> list[Tensor]:
    return [w.to_local() if hasattr(w, "to_local") else w for w in weights]


class TensorParallelGemms:
    """A fused module's merged and residual GEMMs on its rank's shards (a
    ``cutlass_ops.block_gemms.BlockGemms``, held in the module's ``BlockState``)."""

    input_fp8 = None
    takes_amaxes = False
    copies_weights = False
    collectives = True  # the row-parallel GEMMs' partial sums are all-reduced

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return TensorParallelGemms(self.group)

    def merged_linear(self, x: Tensor, weights: Sequence[Tensor],
                      bias: Optional[Tensor] = None,
                      view: Optional[fused_linear.MergedView] = None) -> Tensor:
        """The rank's columns of ``x @ cat(weights)^T``: its own q, k, v (or gate, up)."""
        local = _local(weights)
        bias = None if bias is None else _local([bias])[0]
        if not torch.is_grad_enabled():
            return fused_linear.merged_linear(x, local, bias, view)
        if OVERLAP_GRAD_X and fused_linear.uses_eager_autograd(x, bias, *local):
            return fused_linear.merged_linear(x, local, bias, view,
                                              grad_x_reduction=self._all_reduce_async)
        return fused_linear.merged_linear(_CopyToRanks.apply(x, self.group), local, bias, view)

    def _all_reduce_async(self, grad_x: Tensor):
        return dist.all_reduce(grad_x, group=self.group, async_op=True)

    def linear_reduced(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """``x @ weight^T (+ bias)`` with x the rank's columns and weight its column shard:
        the partial products summed over the ranks, then the bias (replicated) once."""
        from cutlass_ops.ops import linear_fast

        local = _local([weight])[0]
        blocks = _row_blocks(x, local)
        if blocks > 1:
            y = _RowParallelBlocks.apply(x, local, self.group, blocks)
        else:
            y = _SumOverRanks.apply(linear_fast(x, local), self.group)
        return y if bias is None else y + bias

    def linear_residual(self, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                        residual: Tensor) -> Tensor:
        return self.linear_reduced(x, weight, bias) + residual

    def output_projection(self, module: nn.Module, x: Tensor) -> Tensor:
        return self.linear_reduced(x, module.weight, module.bias)


def is_sharded(weight) -> bool:
    return hasattr(weight, "to_local") and hasattr(weight, "placements")


def _placement(weight) -> tuple:
    """(mesh, the sharded dimension) of a 1-D-mesh ``Shard`` DTensor, else None."""
    from torch.distributed.tensor import Shard

    if not is_sharded(weight) or weight.device_mesh.ndim != 1 or \
            not isinstance(weight.placements[0], Shard):
        return None
    return weight.device_mesh, weight.placements[0].dim


def pack_shards(modules: Sequence[nn.Linear]) -> None:
    """The modules' ``Shard(0)`` weights again as DTensor Parameters whose local shards lie end
    to end in one buffer (their values unchanged)."""
    from torch.distributed.tensor import DTensor

    locals_ = [m.weight.to_local().detach() for m in modules]
    if fused_linear.merged_view(locals_) is not None:
        return
    buffer = torch.cat(locals_)
    start = 0
    for module, local in zip(modules, locals_):
        view = buffer[start:start + local.shape[0]]
        start += local.shape[0]
        weight = module.weight
        module.weight = nn.Parameter(
            DTensor.from_local(view, weight.device_mesh, weight.placements, run_check=False,
                               shape=weight.shape, stride=weight.stride()),
            requires_grad=weight.requires_grad)


def adopt(attention: nn.Module, mlp: Optional[nn.Module]):
    """For a layer whose weights are DTensors: its ``TensorParallelGemms`` (the q, k, v and
    gate, up shards packed), or a string saying why its sharding is not one the fused block
    runs; None for plain weights."""
    names = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1}
    modules = {n: getattr(attention, n) for n in names}
    if mlp is not None:
        names.update(gate_proj=0, up_proj=0, down_proj=1)
        modules.update({n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")})
    sharded = [is_sharded(m.weight) for m in modules.values()]
    if not any(sharded):
        return None
    placements = {n: _placement(m.weight) for n, m in modules.items()}
    meshes = {id(p[0]) for p in placements.values() if p is not None}
    wrong = [n for n, p in placements.items() if p is None or p[1] != names[n]]
    if wrong or len(meshes) != 1:
        return (f"tensor-parallel weights sharded otherwise than q, k, v, gate, up by rows and "
                f"o_proj, down_proj by columns on one 1-D mesh ({', '.join(wrong) or 'meshes'})")
    if any(m.bias is not None for m in modules.values()):
        return "tensor-parallel projections with biases: not sharded yet"
    pack_shards([modules["q_proj"], modules["k_proj"], modules["v_proj"]])
    if mlp is not None:
        pack_shards([modules["gate_proj"], modules["up_proj"]])
    mesh = next(iter(placements.values()))[0]
    return TensorParallelGemms(mesh.get_group())


__all__ = ["TensorParallelGemms", "adopt", "is_sharded", "pack_shards"]
