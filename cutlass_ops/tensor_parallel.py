"""Tensor parallelism for converted models (issue 40): ``parallelize(model, mesh)`` shards a
model whose decoder layers ``convert`` fused (``cutlass_ops.decoder_blocks``) over a 1-D device
mesh, Megatron-style, keeping every fusion on each rank's own shard:

- Q, K, V and gate, up: rows (output features) sharded, each rank its own heads' q, k and v and
  its own slice of gate and up, laid end to end in one local buffer, so the merged QKV and
  gate+up GEMMs stay one GEMM a rank; the rotary kernel, the attention and SwiGLU run on the
  local heads and columns.
- o_proj and down_proj: columns (input features) sharded; each rank's partial product is summed
  over the ranks (one all-reduce), then the residual is added (in the post-attention norm's pass,
  as unsharded).
- The norms, the embedding and the residual stream stay replicated; the gradient of each
  sharded GEMM's input is summed over the ranks (one all-reduce) before it reaches the norm.
- lm_head: rows (the vocabulary) sharded with torch's ``ColwiseParallel`` (its logits gathered
  for calls without labels, as torch's plan gathers them); with labels, the loss runs on each
  rank's slice of the vocabulary (``cutlass_ops.vocab_parallel_loss``): no logits gathered.

Collectives a layer: two all-reduces forward (o_proj, down_proj), two backward (the QKV and
gate+up inputs) — torch's own Llama plan (``ColwiseParallel`` on q, k, v, gate and up) issues one
backward all-reduce for each of its five column-sharded inputs.

The sharded weights are DTensor Parameters (``Shard(0)`` or ``Shard(1)`` on the mesh): the
optimizer, ``state_dict`` (sharded, or ``full_tensor()`` per entry) and gradient clipping see
them as they see torch's plan's. Parallelize after ``convert`` (and before an optimizer is
made); refused with the reason: layers that are not fused, FP8 or mixture-of-experts layers,
head counts or widths the mesh does not divide, a mesh that is not 1-D. Decode steps run
eagerly (no step graphs). Under torch.compile the collectives are torch.distributed's eager
ones: not traced.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cutlass_ops import decoder_blocks, fused_linear
from custom_kernels.core.errors import UnsupportedInputError



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


def _local(weights: Sequence[Tensor]) -> list[Tensor]:
    return [w.to_local() if hasattr(w, "to_local") else w for w in weights]


class TensorParallelGemms:
    """A fused module's merged and residual GEMMs on its rank's shards (``decoder_blocks``
    calls them through ``GEMMS``, as it calls ``cutlass_ops.fused_linear``'s)."""

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return TensorParallelGemms(self.group)

    def merged_linear(self, x: Tensor, weights: Sequence[Tensor],
                      bias: Optional[Tensor] = None,
                      view: Optional[fused_linear.MergedView] = None) -> Tensor:
        """The rank's columns of ``x @ cat(weights)^T``: its own q, k, v (or gate, up)."""
        x = _CopyToRanks.apply(x, self.group) if torch.is_grad_enabled() else x
        local = _local(weights)
        return fused_linear.merged_linear(x, local, None if bias is None else
                                          _local([bias])[0], view)

    def linear_reduced(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """``x @ weight^T (+ bias)`` with x the rank's columns and weight its column shard:
        the partial products summed over the ranks, then the bias (replicated) once."""
        from cutlass_ops.ops import linear_fast

        y = _SumOverRanks.apply(linear_fast(x, _local([weight])[0]), self.group)
        return y if bias is None else y + bias

    def linear_residual(self, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                        residual: Tensor) -> Tensor:
        return self.linear_reduced(x, weight, bias) + residual


def refusal(model: nn.Module, world: int) -> Optional[str]:
    """Why ``parallelize`` cannot shard ``model`` over ``world`` ranks, or None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        return "no decoder layers at model.model.layers"
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return "no lm_head Linear"
    embed = getattr(model.model, "embed_tokens", None)
    if embed is not None and getattr(embed, "weight", None) is model.lm_head.weight:
        return "lm_head shares its weight with the embedding (tied): not sharded yet"
    for i, layer in enumerate(layers):
        if not decoder_blocks.is_fused(layer):
            return f"layer {i} is not a fused block (convert the model on a GPU first)"
        if decoder_blocks.has_moe_mlp(layer):
            return f"layer {i} is a mixture of experts: not sharded yet"
        attention, mlp = layer.self_attn, layer.mlp
        for module in (attention, mlp):
            if module.__dict__.get(decoder_blocks.GEMMS) is not None:
                return f"layer {i} has GEMMs of its own (FP8, or sharded already)"
        heads = attention.q_proj.out_features // attention.head_dim
        kv_heads = attention.k_proj.out_features // attention.head_dim
        if heads % world or kv_heads % world:
            return (f"layer {i}: {heads} query and {kv_heads} key/value heads do not split "
                    f"over {world} ranks")
        if mlp.gate_proj.out_features % world or mlp.down_proj.in_features % world:
            return f"layer {i}: the MLP width {mlp.gate_proj.out_features} does not split " \
                   f"over {world} ranks"
        if any(p.bias is not None for p in (attention.q_proj, attention.k_proj,
                                              attention.v_proj, mlp.gate_proj, mlp.up_proj)):
            return f"layer {i}: biases on the column-sharded projections are not sharded yet"
    if model.lm_head.out_features % world:
        return f"the vocabulary ({model.lm_head.out_features}) does not split over {world} ranks"
    return None


def _shard_packed(modules: Sequence[nn.Linear], mesh, rank: int, world: int) -> None:
    """Each module's weight as a ``Shard(0)`` DTensor Parameter whose local rows (this rank's
    chunk) lie end to end with the others' in one buffer (one merged GEMM a rank)."""
    from torch.distributed.tensor import DTensor, Shard

    chunks = [m.weight.detach().chunk(world, dim=0)[rank] for m in modules]
    buffer = torch.cat(chunks)
    start = 0
    for module, chunk in zip(modules, chunks):
        local = buffer[start:start + chunk.shape[0]]
        start += chunk.shape[0]
        module.weight = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)],
                                                        run_check=False),
                                     requires_grad=module.weight.requires_grad)


def _shard_columns(module: nn.Linear, mesh, rank: int, world: int) -> None:
    from torch.distributed.tensor import DTensor, Shard

    local = module.weight.detach().chunk(world, dim=1)[rank].contiguous()
    module.weight = nn.Parameter(DTensor.from_local(local, mesh, [Shard(1)], run_check=False),
                                 requires_grad=module.weight.requires_grad)


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Shards the converted ``model`` over the 1-D ``mesh`` in place (see the module docstring);
    returns it. UnsupportedInputError with the reason where it cannot."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.distributed.tensor import Replicate

    if mesh.ndim != 1:
        raise UnsupportedInputError(f"parallelize: a 1-D mesh, got {mesh.ndim}-D")
    world, rank = mesh.size(), mesh.get_local_rank()
    why = refusal(model, world)
    if why is not None:
        raise UnsupportedInputError(f"parallelize: {why}")
    group = mesh.get_group()
    gemms = TensorParallelGemms(group)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        _shard_packed([attention.q_proj, attention.k_proj, attention.v_proj], mesh, rank, world)
        _shard_packed([mlp.gate_proj, mlp.up_proj], mesh, rank, world)
        _shard_columns(attention.o_proj, mesh, rank, world)
        _shard_columns(mlp.down_proj, mesh, rank, world)
        for module in (attention, mlp):
            module.__dict__[decoder_blocks.GEMMS] = gemms
            module.__dict__.pop("_cutlass_ops_merged_view", None)
        layer.__dict__[decoder_blocks.TENSOR_PARALLEL] = gemms
    parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Replicate()))
    return model


__all__ = ["parallelize", "refusal", "TensorParallelGemms"]
