"""Module drop-ins and ``convert``.

``cutlass_ops.nn.Linear`` is a ``torch.nn.Linear`` (same parameters, same state_dict, loads and
saves interchangeably) whose forward runs ``cutlass_ops::linear``, with the bias and an optional
activation fused into the GEMM's epilogue. ``convert(model)`` swaps Linear layers in place where
our kernels apply, fuses an activation module that directly follows a Linear inside an
``nn.Sequential`` (where the order of calls is certain), swaps RMSNorm and LayerNorm for the
fused norm kernels' modules (``custom_kernels.norms.modules``, re-exported here), and reports every
decision with its reason. Each swap is a pass of its own, run in the order their inputs need
(``_STEPS``); the refusals they share are phrased in ``cutlass_ops.conversion_refusals``. On
tensors off a CUDA device the modules run torch's computation, with one warning per reason (the
CPU rule, ``custom_kernels.core.fallback``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Collection, NamedTuple, Optional

import torch
from torch import nn

from cutlass_ops import (causal_mask, conversion_refusals, decoder_blocks, lm_loss, norm_probe, ops,
                         rotary_embedding, step_graphs)
from cutlass_ops.gemms.config import Activation
from cutlass_ops.moe import experts as moe_experts, moe_router
from cutlass_ops.parallel import sharded_gemms
from custom_kernels.norms.modules import LayerNorm, RMSNorm

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


# A pass: (model, config) -> its decisions, the model changed in place.
_Pass = Callable[[nn.Module, ConvertConfig], list[LayerDecision]]


class _Step(NamedTuple):
    option: Optional[str]  # the ConvertConfig field that turns the pass on; None: it always runs
    run: _Pass
    amends: bool = False  # its decisions amend the earlier ones of the same layers (FP8's)


def convert(model: nn.Module, config: ConvertConfig | None = None,
            **options) -> ConversionReport:
    """Swaps the model's Linear layers, norms, decoder blocks, experts and loss for ours in place
    (sharing parameters; ``state_dict`` unchanged) where our kernels apply, per ``config`` (a
    ``ConvertConfig``) or its fields as keywords, not both; returns what was done and why, per
    layer: the decisions of each pass (``_STEPS``) in turn."""
    if config is not None and options:
        raise TypeError("convert takes a ConvertConfig or its fields as keywords, not both")
    config = ConvertConfig(**options) if config is None else config
    if config.fp8 is not None:
        from cutlass_ops.fp8 import recipes

        recipes.get(config.fp8)  # an unknown recipe raises before anything changes
    decisions: list[LayerDecision] = []
    with step_graphs.paused():  # the probes' calls leave no CUDA graphs behind
        for step in _enabled_steps(config):
            decided = step.run(model, config)
            decisions = _amended(decisions, decided) if step.amends else decisions + decided
    return ConversionReport(decisions)


def _enabled_steps(config: ConvertConfig) -> list[_Step]:
    return [step for step in _STEPS if step.option is None or getattr(config, step.option)]


def _amended(decisions: list[LayerDecision], fp8: list[LayerDecision]) -> list[LayerDecision]:
    """``decisions`` with each FP8 decision folded into its layer's earlier one; the FP8
    decisions of layers no earlier pass decided come after them."""
    by_name = {d.name: d for d in fp8}
    folded = [_fp8_amendment(d, by_name.pop(d.name)) if d.name in by_name else d
              for d in decisions]
    return folded + list(by_name.values())


def _fp8_amendment(decision: LayerDecision, fp8: LayerDecision) -> LayerDecision:
    if fp8.fp8 is None:  # the layer stays 16-bit: why not FP8 follows what it runs
        return dataclasses.replace(decision, reason=f"{decision.reason}; not FP8: {fp8.reason}")
    return dataclasses.replace(decision, converted=True, reason=fp8.reason, fp8=fp8.fp8)


# ---- the walk every per-module pass shares ---------------------------------------------------

def _excluded(name: str, config: ConvertConfig) -> bool:
    """The caller's choice: ``name`` is outside ``include`` (when given) or inside ``exclude``."""
    return config.include is not None and name not in config.include or name in config.exclude


def _walk(model, config, recognised, decide) -> list[LayerDecision]:
    """A decision for each module ``recognised`` by structure, in ``named_modules`` order as
    listed before any swap (recognised when its turn comes): excluded by the caller, else
    ``decide(name, module)``."""
    return [_refused(name, module, "excluded by the caller")
            if _excluded(name, config) else decide(name, module)
            for name, module in list(model.named_modules()) if recognised(module)]


def _swaps(model, config, recognised, swap, done) -> list[LayerDecision]:
    """``_walk`` for swaps made in place: ``swap(module)``'s refusal, or ``done(module)`` when it
    swapped."""
    def decide(name, module):
        kind = type(module).__name__  # before the swap, which may change the class
        why = swap(module)
        return LayerDecision(name, kind, why is None, why or done(module))

    return _walk(model, config, recognised, decide)


def _refused(name: str, module: nn.Module, why: str) -> LayerDecision:
    return LayerDecision(name, type(module).__name__, False, why)


def _at_root(name: str, what: str) -> str | None:
    """The model itself is the module (``what``): there is no parent to put ours in."""
    return None if name else f"the model itself is {what}"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


# ---- Linear layers ----------------------------------------------------------------------------

_TF32_NOTE = " (fp32 would run as tf32 and change the numbers)"


def _linear_pass(model: nn.Module, config: ConvertConfig) -> list[LayerDecision]:
    """torch's Linear layers made ours where the kernels apply; with ``fuse_activations``, an
    activation module right after one in an nn.Sequential moves into its epilogue."""
    return _walk(model, config, _is_torch_linear,
                 lambda name, layer: _convert_linear(model, name, layer, config.fuse_activations))


def _is_torch_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and not isinstance(module, Linear)


def _why_not(layer: nn.Linear) -> str | None:
    """Why this Linear stays torch's, or None if ours applies."""
    if type(layer) is not nn.Linear:
        return f"{type(layer).__name__} subclasses Linear; its forward may differ, left alone"
    k, n = layer.in_features, layer.out_features
    return conversion_refusals.weight_refusal(
        layer.weight, kernels="our kernels", dtype_note=_TF32_NOTE, sm90=True, dtensor=True) or \
        conversion_refusals.unaligned(f"{k}x{n}", k, n, note=" (TMA)")


def _convert_linear(model, name: str, layer: nn.Linear, fuse_activations: bool) -> LayerDecision:
    why = _why_not(layer) or _at_root(name, "a Linear: wrap it or use "
                                      "cutlass_ops.nn.Linear.from_linear")
    if why is not None:
        return _refused(name, layer, why)
    return LayerDecision(name, type(layer).__name__, True,
                         _swap_linear(model, name, layer, fuse_activations))


def _swap_linear(model, name: str, layer: nn.Linear, fuse_activations: bool) -> str:
    """Puts our Linear in ``layer``'s place, fusing the activation that follows it in an
    nn.Sequential (``fuse_activations``; the activation becomes nn.Identity); what was done."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    follower = _next_in_sequential(parent, child) \
        if fuse_activations and isinstance(parent, nn.Sequential) else None
    activation = fusable_activation(follower) if follower is not None else None
    setattr(parent, child, Linear.from_linear(layer, activation or "identity"))
    if activation is None:
        return "bf16/fp16 on an sm90 GPU"
    follower_child = _child_name(parent, follower)
    setattr(parent, follower_child, nn.Identity())
    follower_name = f"{parent_name}.{follower_child}".lstrip(".")
    return (f"bf16/fp16 on an sm90 GPU; {follower_name} ({type(follower).__name__}) fused as "
            f"{activation}")


def _next_in_sequential(parent: nn.Sequential, child: str) -> nn.Module | None:
    names = list(parent._modules)
    i = names.index(child)
    return parent._modules[names[i + 1]] if i + 1 < len(names) else None


def _child_name(parent: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in parent._modules.items() if m is module)


# ---- norms ------------------------------------------------------------------------------------

_TORCH_NORMS = (nn.RMSNorm, nn.LayerNorm)  # by exact type: a subclass's forward may differ


def _norm_pass(model: nn.Module, config: ConvertConfig) -> list[LayerDecision]:
    """torch's RMSNorm / LayerNorm, and modules built like an RMSNorm once a probe agrees, made
    the fused norm modules."""
    def decide(name, module):
        if type(module) in _TORCH_NORMS:
            return _convert_norm(model, name, module)
        return _convert_probed_norm(model, name, module)

    return _walk(model, config, _is_norm, decide)


def _is_norm(module: nn.Module) -> bool:
    return type(module) in _TORCH_NORMS or norm_probe.looks_like_rms_norm(module)


def _convert_norm(model, name: str, module: nn.Module) -> LayerDecision:
    kind = type(module).__name__
    why = _norm_shape_refusal(module) or conversion_refusals.off_cuda(module.weight) or \
        _at_root(name, f"a norm: use cutlass_ops.nn.{kind}.from_module")
    if why is not None:
        return _refused(name, module, why)
    _replace(model, name, (RMSNorm if isinstance(module, nn.RMSNorm) else LayerNorm)
             .from_module(module))
    return LayerDecision(name, kind, True, "fused norm kernel (torch where the input does not fit)")


def _norm_shape_refusal(module: nn.Module) -> str | None:
    if module.weight is None or len(module.normalized_shape) != 1:
        return ("no weight or a multi-dimensional normalized_shape: the fused kernels normalize "
                "the last dimension with a weight")
    if isinstance(module, nn.LayerNorm) and module.bias is None:
        return "LayerNorm without bias: left to torch"
    return None


def _convert_probed_norm(model, name: str, module: nn.Module) -> LayerDecision:
    """A module built like an RMSNorm that is not torch's (Hugging Face's LlamaRMSNorm and its
    copies): swapped only when the numeric probe agrees (cutlass_ops.norm_probe)."""
    why = conversion_refusals.off_cuda(module.weight) or _at_root(name, "a norm: wrap it")
    offset = False
    if why is None:
        offset, why = norm_probe.match(module)
    if why is not None:
        return _refused(name, module, why)
    _replace(model, name, norm_probe.drop_in(module, offset))
    what = "Gemma's RMSNorm (1 + weight)" if offset else "RMSNorm"
    return LayerDecision(name, type(module).__name__, True, f"{what} by structure and by a "
                         "numeric probe: fused norm kernel (torch where the input does not fit)")


# ---- mixture of experts -----------------------------------------------------------------------

def _experts_pass(model: nn.Module, config: ConvertConfig) -> list[LayerDecision]:
    """Mixture-of-experts experts modules made two grouped GEMMs (cutlass_ops.moe), when their
    weights suit the kernels and the probe agrees."""
    return _walk(model, config, _unconverted_experts,
                 lambda name, module: _convert_experts(model, name, module))


def _unconverted_experts(module: nn.Module) -> bool:
    return moe_experts.looks_like_experts(module) and \
        not isinstance(module, moe_experts.GroupedExperts)


def _convert_experts(model, name: str, module: nn.Module) -> LayerDecision:
    weight = module.gate_up_proj
    hidden, inter = weight.shape[-1], weight.shape[1] // 2
    why = conversion_refusals.weight_refusal(weight, kernels="the grouped GEMMs") or \
        conversion_refusals.unaligned(f"hidden {hidden} and intermediate {inter}", hidden,
                                      inter) or \
        _at_root(name, "an experts module: use cutlass_ops.moe.GroupedExperts") or \
        moe_experts.probe(module)
    if why is not None:
        return _refused(name, module, why)
    _replace(model, name, moe_experts.GroupedExperts(module))
    return LayerDecision(name, type(module).__name__, True, f"{weight.shape[0]} experts as two "
                         "grouped GEMMs and a SwiGLU kernel, no per-expert loop (cutlass_ops.moe)")


def _router_pass(model: nn.Module, config: ConvertConfig) -> list[LayerDecision]:
    """The top-k routers of blocks whose experts are grouped GEMMs, made one routing pass
    (cutlass_ops.moe.moe_router) when the probe agrees; a decision named after the gate."""
    decisions = []
    for block_name, block in model.named_modules():
        if isinstance(getattr(block, "experts", None), moe_experts.GroupedExperts) and \
                isinstance(getattr(block, "gate", None), nn.Module):
            name = f"{block_name}.gate".lstrip(".")
            decisions.append(_refused(name, block.gate, "excluded by the caller")
                             if _excluded(name, config) else _fuse_router(name, block))
    return decisions


def _fuse_router(name: str, block: nn.Module) -> LayerDecision:
    gate = block.gate
    kind = type(gate).__name__  # before the fuse, which changes the class
    why = moe_router.fuse_router(block)
    return LayerDecision(name, kind, why is None, why or moe_router.describe(gate))


# ---- decoder blocks and what they enable ------------------------------------------------------

_DENSE_BLOCK = ("fused block: QKV and gate+up as one GEMM each, rotary and SwiGLU kernels, the "
                "o_proj and down_proj residual adds in their GEMM epilogues")
_MOE_BLOCK = ("fused attention half: QKV as one GEMM, the rotary kernel, the first residual add "
              "in the post-attention norm's pass; its mixture of experts runs the model's "
              "forward (the experts as grouped GEMMs where converted, shared experts' gate+up "
              "as one GEMM and SwiGLU as one kernel where their probe agrees), the residual "
              "added after")


def _decoder_block_pass(model: nn.Module, config: ConvertConfig) -> list[LayerDecision]:
    """Decoder layers (found by structure) made fused blocks where the probe agrees."""
    return _swaps(model, config, decoder_blocks.looks_like_decoder_layer,
                  functools.partial(decoder_blocks.fuse, adopt=sharded_gemms.adopt),
                  lambda module: _MOE_BLOCK
                  if decoder_blocks.has_moe_mlp(module) else _DENSE_BLOCK)


def _rotary_pass(model: nn.Module, config: ConvertConfig) -> list[LayerDecision]:
    """Hugging Face rotary embedding modules (found by structure) computing their cos / sin
    tables on one launch where the probe agrees (cutlass_ops.rotary_embedding)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return _swaps(model, config, rotary_embedding.looks_like_rotary_embedding,
                  lambda module: rotary_embedding.fuse(module, dtype),
                  lambda module: "cos / sin tables in one launch, the same bits "
                  "(cutlass_ops.rotary_embedding)")


def _causal_mask_pass(model: nn.Module, config: ConvertConfig) -> list[LayerDecision]:
    """A model with fused blocks on SDPA leaves an unpadded batch's causal mask to
    ``is_causal`` (cutlass_ops.causal_mask)."""
    if not any(decoder_blocks.is_fused(module) for module in model.modules()) or \
            causal_mask.structure_refusal(model) is not None:
        return []
    causal_mask.route(model)
    return [LayerDecision("attention mask", type(model).__name__, True,
                          "SDPA: an unpadded batch's causal mask is left to is_causal under "
                          "torch.compile too (cutlass_ops.causal_mask)")]


# ---- the loss and FP8 -------------------------------------------------------------------------

def _fused_loss_pass(model: nn.Module, config: ConvertConfig) -> list[LayerDecision]:
    """A Hugging Face causal LM's head and loss computed a chunk of rows at a time with labels
    (cutlass_ops.lm_loss), when the probe agrees."""
    if lm_loss.structure_refusal(model) is not None:
        return []
    why = lm_loss.route(model)
    return [LayerDecision("lm_head+loss", type(model).__name__, why is None,
                          why or "labels: the head and the loss a chunk of rows at a time, no "
                          "logits (cutlass_ops.linear_cross_entropy)")]


def _fp8_pass(model: nn.Module, config: ConvertConfig) -> list[LayerDecision]:
    """Linears (torch's and ours) and fused blocks that take the recipe made FP8
    (cutlass_ops.fp8.convert); a decision per layer considered, with its recipe or why not."""
    from cutlass_ops.fp8.convert import convert_fp8

    choices = convert_fp8(model, config.fp8, lm_head=config.fp8_lm_head, include=config.include,
                          exclude=config.exclude, linear_types=(nn.Linear, Linear))
    return [LayerDecision(c.name, c.kind, c.recipe is not None, c.reason, c.recipe)
            for c in choices]


# The passes in the order they run. Experts, norms and Linears recognise disjoint modules (each
# module goes to one of them), so their order only orders the report. Experts come before
# routers (a router is fused only beside grouped experts); norms and Linears before decoder
# blocks (a block is probed, and fused, with the projections and norms it will run: ours, whose
# norm adds the residual in its own pass); blocks before the causal mask (left to is_causal only
# in a model with fused blocks); the loss before FP8 (the LM head's FP8 reason says whether the
# fused loss reads it); FP8 last, over what the others made (our Linears keep their fused
# activation, fused blocks take FP8 GEMMs), its decisions amending theirs.
_STEPS = (
    _Step("experts", _experts_pass),
    _Step("norms", _norm_pass),
    _Step(None, _linear_pass),
    _Step("experts", _router_pass),
    _Step("fuse_blocks", _decoder_block_pass),
    _Step("fuse_blocks", _rotary_pass),
    _Step("fuse_blocks", _causal_mask_pass),
    _Step("fused_loss", _fused_loss_pass),
    _Step("fp8", _fp8_pass, amends=True),
)


__all__ = ["Linear", "RMSNorm", "LayerNorm", "convert", "ConvertConfig", "ConversionReport"]
