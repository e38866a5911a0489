"""Tensor parallelism for converted models: ``parallelize(model, mesh)`` shards a
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
  rank's slice of the vocabulary (``cutlass_ops.parallel.vocab_parallel_loss``): no logits gathered.

Collectives a layer: two all-reduces forward (o_proj, down_proj), two backward (the QKV and
gate+up inputs) — torch's own Llama plan (``ColwiseParallel`` on q, k, v, gate and up) issues one
backward all-reduce for each of its five column-sharded inputs.

The sharded weights are DTensor Parameters (``Shard(0)`` or ``Shard(1)`` on the mesh): the
optimizer, ``state_dict`` (sharded, or ``full_tensor()`` per entry) and gradient clipping see
them as they see torch's plan's. Parallelize after ``convert`` (and before an optimizer is
made); refused with the reason: layers that are not fused, FP8 or mixture-of-experts layers,
head counts or widths the mesh does not divide, a mesh that is not 1-D. Or the other way round:
shard the unconverted model with torch's Llama plan (``parallelize_module(model, mesh,
llama_plan(model))``) or load it with Hugging Face's ``from_pretrained(..., tp_plan="auto")``
(it needs ``accelerate``), then ``convert``: the fused blocks adopt the plan's shards (``cutlass_ops.parallel.sharded_gemms.adopt``;
Linear layers with DTensor weights keep torch's). Decode steps run eagerly (no step graphs).
Under torch.compile the collectives are torch.distributed's eager ones: not traced.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from cutlass_ops import decoder_blocks
from cutlass_ops.parallel import sharded_gemms
from cutlass_ops.block_gemms import Bf16Gemms
from custom_kernels.core.errors import UnsupportedInputError



def llama_plan(model: nn.Module) -> dict:
    """torch's tensor-parallel plan of a Llama-style model (``parallelize_module(model, mesh,
    plan)``): q, k, v, gate and up ``ColwiseParallel``, o_proj and down_proj
    ``RowwiseParallel``, lm_head ``ColwiseParallel`` with its logits gathered (what Hugging
    Face's ``tp_plan="auto"`` does). Applied before ``convert``, the fused blocks adopt it."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


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
            if not isinstance(decoder_blocks.gemms_of(module), Bf16Gemms):
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


def _shard_rows(modules: Sequence[nn.Linear], mesh, rank: int, world: int) -> None:
    """Each module's weight as a ``Shard(0)`` DTensor Parameter (this rank's chunk of rows)."""
    from torch.distributed.tensor import DTensor, Shard

    for module in modules:
        local = module.weight.detach().chunk(world, dim=0)[rank].contiguous()
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
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        _shard_rows([attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj,
                     mlp.up_proj], mesh, rank, world)
        _shard_columns(attention.o_proj, mesh, rank, world)
        _shard_columns(mlp.down_proj, mesh, rank, world)
        decoder_blocks.shard(layer, sharded_gemms.adopt(attention, mlp))
    parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Replicate()))
    return model


__all__ = ["parallelize", "refusal", "llama_plan"]
