"""Module drop-ins and ``convert``.

``cutlass_ops.nn.Linear`` is a ``torch.nn.Linear`` (same parameters, same state_dict, loads and
saves interchangeably) whose forward runs ``cutlass_ops::linear``, with the bias and an optional
activation fused into the GEMM's epilogue. ``convert(model)`` swaps Linear layers in place where
our kernels apply, fuses an activation module that directly follows a Linear inside an
``nn.Sequential`` (where the order of calls is certain), swaps RMSNorm and LayerNorm for the
fused norm kernels' modules (``custom_kernels.norms.modules``, re-exported here), and reports every
decision with its reason. On tensors off a CUDA device the modules run torch's computation, with
one warning per reason (the CPU rule, ``custom_kernels.core.fallback``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Collection, Optional

import torch
from torch import nn

from cutlass_ops import (causal_mask, decoder_blocks, lm_loss, norm_probe, ops, rotary_embedding,
                         step_graphs)
from cutlass_ops.gemms.config import Activation
from cutlass_ops.moe import experts as moe_experts, moe_router
from cutlass_ops.parallel import sharded_gemms
from custom_kernels.norms.modules import LayerNorm, RMSNorm

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    """torch.nn.Linear on tuned CUTLASS kernels (forward and backward), computing
    ``activation(x W^T + b)`` with the bias and the activation (identity, relu, gelu, gelu_tanh,
    silu) in the GEMM's epilogue. The activation is not state: the state_dict is nn.Linear's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, activation: str = "identity"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = Activation(activation).value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear_fast(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        fused = f", activation={self.activation}" if self.activation != "identity" else ""
        return super().extra_repr() + fused

    @classmethod
    def from_linear(cls, layer: nn.Linear, activation: str = "identity") -> Linear:
        """A Linear sharing ``layer``'s parameters (no copy: optimizers keep working)."""
        new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None,
                  device="meta", activation=activation)
        new.weight = layer.weight
        new.bias = layer.bias
        new.train(layer.training)
        return new


def fusable_activation(module: nn.Module) -> str | None:
    """The epilogue activation that computes ``module`` exactly, or None."""
    if type(module) is nn.ReLU:
        return "relu"
    if type(module) is nn.SiLU:
        return "silu"
    if type(module) is nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return None


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    name: str
    kind: str
    converted: bool
    reason: str
    fp8: str | None = None  # the FP8 recipe the layer runs (convert's ``fp8``), if any


@dataclasses.dataclass
class ConversionReport:
    decisions: list[LayerDecision]

    @property
    def converted(self) -> list[str]:
        return [d.name for d in self.decisions if d.converted]

    @property
    def skipped(self) -> dict[str, str]:
        return {d.name: d.reason for d in self.decisions if not d.converted}

    @property
    def fp8(self) -> dict[str, str]:
        """The layers that run FP8, with their recipe."""
        return {d.name: d.fp8 for d in self.decisions if d.fp8 is not None}

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} of {len(self.decisions)} layers"]
        lines += [f"  {'+' if d.converted else '-'} {d.name or '<root>'} ({d.kind}): {d.reason}"
                  for d in self.decisions]
        return "\n".join(lines)


def _why_not(layer: nn.Linear) -> str | None:
    """Why this Linear stays torch's, or None if ours applies."""
    if type(layer) is not nn.Linear:
        return f"{type(layer).__name__} subclasses Linear; its forward may differ, left alone"
    weight = layer.weight
    if hasattr(weight, "to_local"):  # a new module would lose the plan's hooks on this one
        return "a tensor-parallel (DTensor) weight: left to its plan"
    if weight.device.type != "cuda":
        return f"weights on {weight.device}: move the model to a CUDA device first"
    if weight.dtype not in _SUPPORTED_DTYPES:
        return (f"{weight.dtype} weights: our kernels are bf16/fp16 (fp32 would run as tf32 and "
                "change the numbers)")
    if torch.cuda.get_device_capability(weight.device) != (9, 0):
        return f"{torch.cuda.get_device_name(weight.device)} is not an sm90 GPU"
    if layer.in_features % 8 or layer.out_features % 8:
        return (f"{layer.in_features}x{layer.out_features}: both must be multiples of 8 for "
                "16-byte aligned rows (TMA)")
    return None


@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """What ``convert`` swaps, one option a field (torchao's ``Float8LinearConfig`` is the
    model). Each swap happens after a numeric probe where the module is recognised by structure,
    and the report names every layer's choice or why not."""

    include: Optional[Collection[str]] = None  # names to consider (default all)
    exclude: Collection[str] = ()  # names to leave alone
    # A ReLU / GELU / SiLU module directly after a converted Linear in an nn.Sequential moves into
    # the Linear's epilogue (and becomes nn.Identity).
    fuse_activations: bool = True
    # torch's RMSNorm / LayerNorm, and modules built like an RMSNorm (Hugging Face's Llama,
    # Mistral, Qwen2, Qwen3 norms) once a probe agrees, become the fused norm modules.
    norms: bool = True
    # A Hugging Face causal LM called with labels computes its head and loss a chunk at a time,
    # without materializing the logits (then not returned; ``cutlass_ops.lm_loss``).
    fused_loss: bool = True
    # Decoder layers built like Llama's run as fused blocks (``cutlass_ops.decoder_blocks``); on
    # SDPA an unpadded batch's causal mask is then left to ``is_causal`` (``causal_mask``).
    fuse_blocks: bool = True
    # Experts built like Hugging Face's (3-D gate_up_proj / down_proj, SiLU) run as grouped
    # GEMMs (``cutlass_ops.moe``), their block's top-k router as one routing pass.
    experts: bool = True
    # "tensorwise", "rowwise" or "blockwise": Linears and fused blocks' GEMMs that take the recipe
    # run FP8 forward and backward, bf16 master weights (``cutlass_ops.fp8``).
    fp8: Optional[str] = None
    fp8_lm_head: bool = False  # the LM head in FP8 too (bf16 by default)


def convert(model: nn.Module, config: ConvertConfig | None = None,
            **options) -> ConversionReport:
    """Swaps the model's Linear layers, norms, decoder blocks, experts and loss for ours in place
    (sharing parameters; ``state_dict`` unchanged) where our kernels apply, per ``config`` (a
    ``ConvertConfig``) or its fields as keywords, not both; returns what was done and why, per
    layer."""
    if config is not None and options:
        raise TypeError("convert takes a ConvertConfig or its fields as keywords, not both")
    config = ConvertConfig(**options) if config is None else config
    if config.fp8 is not None:
        from cutlass_ops.fp8 import recipes

        recipes.get(config.fp8)  # an unknown recipe raises before anything changes
    with step_graphs.paused():  # the probes' calls leave no CUDA graphs behind
        report = _convert(model, config.include, config.exclude, config.fuse_activations,
                          config.norms, config.fused_loss, config.fuse_blocks, config.experts)
    if config.fp8 is None:
        return report
    from cutlass_ops.fp8.convert import convert_fp8

    return _with_fp8(report, convert_fp8(model, config.fp8, lm_head=config.fp8_lm_head,
                                         include=config.include, exclude=config.exclude,
                                         linear_types=(nn.Linear, Linear)))


def _with_fp8(report: ConversionReport, choices) -> ConversionReport:
    """The report with each layer's FP8 choice (``cutlass_ops.fp8.RecipeChoice``) folded in."""
    by_name = {c.name: c for c in choices}
    decisions = []
    for d in report.decisions:
        c = by_name.pop(d.name, None)
        if c is None:
            decisions.append(d)
        elif c.recipe is None:
            decisions.append(dataclasses.replace(d, reason=f"{d.reason}; not FP8: {c.reason}"))
        else:
            decisions.append(dataclasses.replace(d, converted=True, reason=c.reason,
                                                 fp8=c.recipe))
    decisions += [LayerDecision(c.name, c.kind, c.recipe is not None, c.reason, c.recipe)
                  for c in by_name.values()]
    return ConversionReport(decisions)


def _convert(model, include, exclude, fuse_activations, norms, fused_loss, fuse_blocks,
             experts) -> ConversionReport:
    decisions = []
    for name, module in list(model.named_modules()):
        if experts and moe_experts.looks_like_experts(module) and \
                not isinstance(module, moe_experts.GroupedExperts):
            decisions.append(_convert_experts(model, name, module, include, exclude))
            continue
        if norms and type(module) in (nn.RMSNorm, nn.LayerNorm):
            decisions.append(_convert_norm(model, name, module, include, exclude))
            continue
        if norms and norm_probe.looks_like_rms_norm(module):
            decisions.append(_convert_probed_norm(model, name, module, include, exclude))
            continue
        if not isinstance(module, nn.Linear) or isinstance(module, Linear):
            continue
        kind = type(module).__name__
        if _excluded(name, include, exclude):
            decisions.append(LayerDecision(name, kind, False, "excluded by the caller"))
            continue
        reason = _why_not(module)
        if reason is not None:
            decisions.append(LayerDecision(name, kind, False, reason))
            continue
        if not name:
            decisions.append(LayerDecision(name, kind, False, "the model itself is a Linear: wrap "
                                      "it or use cutlass_ops.nn.Linear.from_linear"))
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        activation, follower = "identity", None
        if fuse_activations and isinstance(parent, nn.Sequential):
            follower = _next_in_sequential(parent, child)
            activation = fusable_activation(follower) if follower is not None else None
            activation = activation or "identity"
        setattr(parent, child, Linear.from_linear(module, activation))
        reason = "bf16/fp16 on an sm90 GPU"
        if activation != "identity":
            follower_name = f"{parent_name}.{_child_name(parent, follower)}".lstrip(".")
            setattr(parent, _child_name(parent, follower), nn.Identity())
            reason += f"; {follower_name} ({type(follower).__name__}) fused as {activation}"
        decisions.append(LayerDecision(name, kind, True, reason))
    if experts:
        decisions += _fuse_routers(model, include, exclude)
    if fuse_blocks:
        decisions += _fuse_decoder_layers(model, include, exclude)
        decisions += _fuse_rotary_embeddings(model, include, exclude)
        if any(d.converted and decoder_blocks.is_fused(model.get_submodule(d.name))
               for d in decisions) and causal_mask.structure_refusal(model) is None:
            causal_mask.route(model)
            decisions.append(LayerDecision("attention mask", type(model).__name__, True,
                                      "SDPA: an unpadded batch's causal mask is left to "
                                      "is_causal under torch.compile too "
                                      "(cutlass_ops.causal_mask)"))
    if fused_loss and lm_loss.structure_refusal(model) is None:
        why = lm_loss.route(model)
        decisions.append(LayerDecision("lm_head+loss", type(model).__name__, why is None,
                                  why or "labels: the head and the loss a chunk of rows at a "
                                  "time, no logits (cutlass_ops.linear_cross_entropy)"))
    return ConversionReport(decisions)


def _fuse_routers(model, include, exclude) -> list:
    """The top-k routers of blocks whose experts are converted, made one routing pass
    (cutlass_ops.moe.moe_router) when the probe agrees."""
    decisions = []
    for block_name, block in model.named_modules():
        if not isinstance(getattr(block, "experts", None), moe_experts.GroupedExperts) or \
                not isinstance(getattr(block, "gate", None), nn.Module):
            continue
        name = f"{block_name}.gate".lstrip(".")
        gate = block.gate
        kind = type(gate).__name__
        if _excluded(name, include, exclude):
            decisions.append(LayerDecision(name, kind, False, "excluded by the caller"))
            continue
        why = moe_router.fuse_router(block)
        decisions.append(LayerDecision(name, kind, why is None, why or moe_router.describe(gate)))
    return decisions


def _fuse_rotary_embeddings(model, include, exclude) -> list[LayerDecision]:
    """Hugging Face rotary embedding modules (found by structure) computing their cos / sin
    tables on one launch where the probe agrees (cutlass_ops.rotary_embedding)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return _swaps(model, include, exclude, rotary_embedding.looks_like_rotary_embedding,
                  lambda module: rotary_embedding.fuse(module, dtype),
                  lambda module: "cos / sin tables in one launch, the same bits "
                  "(cutlass_ops.rotary_embedding)")


def _excluded(name: str, include, exclude) -> bool:
    """The caller's choice: ``name`` is outside ``include`` (when given) or inside ``exclude``."""
    return include is not None and name not in include or name in exclude


def _swaps(model, include, exclude, recognised, swap, done) -> list[LayerDecision]:
    """A decision for each module ``recognised`` by structure: excluded by the caller, or
    ``swap(module)``'s refusal, or ``done(module)`` when it swapped."""
    decisions = []
    for name, module in list(model.named_modules()):
        if not recognised(module):
            continue
        kind = type(module).__name__
        if _excluded(name, include, exclude):
            decisions.append(LayerDecision(name, kind, False, "excluded by the caller"))
            continue
        why = swap(module)
        decisions.append(LayerDecision(name, kind, why is None, why or done(module)))
    return decisions


def _convert_norm(model, name, module, include, exclude) -> LayerDecision:
    kind = type(module).__name__
    if _excluded(name, include, exclude):
        return LayerDecision(name, kind, False, "excluded by the caller")
    weight = module.weight
    if weight is None or len(module.normalized_shape) != 1:
        return LayerDecision(name, kind, False, "no weight or a multi-dimensional normalized_shape: "
                        "the fused kernels normalize the last dimension with a weight")
    if isinstance(module, nn.LayerNorm) and module.bias is None:
        return LayerDecision(name, kind, False, "LayerNorm without bias: left to torch")
    if weight.device.type != "cuda":
        return LayerDecision(name, kind, False, f"weights on {weight.device}: move the model to a "
                        "CUDA device first")
    if not name:
        return LayerDecision(name, kind, False, "the model itself is a norm: use "
                        f"cutlass_ops.nn.{kind}.from_module")
    ours = (RMSNorm if isinstance(module, nn.RMSNorm) else LayerNorm).from_module(module)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, ours)
    return LayerDecision(name, kind, True, "fused norm kernel (torch where the input does not fit)")


def _excluded_or_off_cuda(name, kind, weight, include, exclude) -> LayerDecision | None:
    """The refusals every probed conversion starts with: the caller's choice, CPU weights."""
    if _excluded(name, include, exclude):
        return LayerDecision(name, kind, False, "excluded by the caller")
    if weight.device.type != "cuda":
        return LayerDecision(name, kind, False, f"weights on {weight.device}: move the model to a "
                        "CUDA device first")
    return None


def _convert_probed_norm(model, name, module, include, exclude) -> LayerDecision:
    """A module built like an RMSNorm that is not torch's (Hugging Face's LlamaRMSNorm and its
    copies): swapped only when the numeric probe agrees (cutlass_ops.norm_probe)."""
    kind = type(module).__name__
    refused = _excluded_or_off_cuda(name, kind, module.weight, include, exclude)
    if refused is not None:
        return refused
    if not name:
        return LayerDecision(name, kind, False, "the model itself is a norm: wrap it")
    offset, why = norm_probe.match(module)
    if why is not None:
        return LayerDecision(name, kind, False, why)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, norm_probe.drop_in(module, offset))
    what = "Gemma's RMSNorm (1 + weight)" if offset else "RMSNorm"
    return LayerDecision(name, kind, True, f"{what} by structure and by a numeric probe: fused norm "
                    "kernel (torch where the input does not fit)")


def _convert_experts(model, name, module, include, exclude) -> LayerDecision:
    """A mixture-of-experts experts module made two grouped GEMMs (cutlass_ops.moe), when its
    weights suit the kernels and the probe agrees."""
    kind = type(module).__name__
    weight = module.gate_up_proj
    refused = _excluded_or_off_cuda(name, kind, weight, include, exclude)
    if refused is not None:
        return refused
    if weight.dtype not in _SUPPORTED_DTYPES:
        return LayerDecision(name, kind, False, f"{weight.dtype} weights: the grouped GEMMs are "
                        "bf16/fp16")
    hidden, inter = weight.shape[-1], weight.shape[1] // 2
    if hidden % 8 or inter % 8:
        return LayerDecision(name, kind, False, f"hidden {hidden} and intermediate {inter}: both "
                        "must be multiples of 8 for 16-byte aligned rows")
    if not name:
        return LayerDecision(name, kind, False, "the model itself is an experts module: use "
                        "cutlass_ops.moe.GroupedExperts")
    why = moe_experts.probe(module)
    if why is not None:
        return LayerDecision(name, kind, False, why)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, moe_experts.GroupedExperts(module))
    return LayerDecision(name, kind, True, f"{weight.shape[0]} experts as two grouped GEMMs and a "
                    "SwiGLU kernel, no per-expert loop (cutlass_ops.moe)")


_DENSE_BLOCK = ("fused block: QKV and gate+up as one GEMM each, rotary and SwiGLU kernels, the "
                "o_proj and down_proj residual adds in their GEMM epilogues")
_MOE_BLOCK = ("fused attention half: QKV as one GEMM, the rotary kernel, the first residual add "
              "in the post-attention norm's pass; its mixture of experts runs the model's "
              "forward (the experts as grouped GEMMs where converted, shared experts' gate+up "
              "as one GEMM and SwiGLU as one kernel where their probe agrees), the residual "
              "added after")


def _fuse_decoder_layers(model, include, exclude) -> list[LayerDecision]:
    """Decoder layers (found by structure, after their Linears and norms were converted) made
    fused blocks where the probe agrees."""
    return _swaps(model, include, exclude, decoder_blocks.looks_like_decoder_layer,
                  functools.partial(decoder_blocks.fuse, adopt=sharded_gemms.adopt),
                  lambda module: _MOE_BLOCK
                  if decoder_blocks.has_moe_mlp(module) else _DENSE_BLOCK)


def _next_in_sequential(parent: nn.Sequential, child: str) -> nn.Module | None:
    names = list(parent._modules)
    i = names.index(child)
    return parent._modules[names[i + 1]] if i + 1 < len(names) else None


def _child_name(parent: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in parent._modules.items() if m is module)


__all__ = ["Linear", "RMSNorm", "LayerNorm", "convert", "ConvertConfig", "ConversionReport"]
