"""The FP8 conversion: ``cutlass_ops.convert(model, fp8=recipe)`` runs the bf16 conversion, then
``convert_fp8``, which makes FP8 (per ``cutlass_ops.fp8.recipes``) every Linear that takes the
recipe and every fused decoder block whose seven projections all do, and says per layer what it
chose and why (``Choice``; ``cutlass_ops.nn`` folds them into its report).

- A Linear (``nn.Linear``, or one of the ``linear_types`` the caller names: convert's own
  ``cutlass_ops.nn.Linear``, whose fused activation carries over) becomes
  ``cutlass_ops.fp8.Fp8Linear`` sharing its parameters: same names, values, dtypes, state_dict.
- A fused decoder block (``cutlass_ops.decoder_blocks``) gets ``FusedGemms`` for its merged
  QKV, o_proj, merged gate+up and down_proj GEMMs (the residual adds then run in torch after
  the GEMM), and its seven projections become FP8 Linears too (a call of the module itself, as
  o_proj's beside our fused norm, is FP8 as well). All or nothing: a block one of whose
  projections cannot take the recipe keeps bf16 GEMMs throughout.
- A converted MoE layer's ``GroupedExperts`` becomes ``cutlass_ops.fp8.fp8_experts.
  Fp8GroupedExperts`` under the blockwise recipe, bf16 weights, N and K multiples of 128, and
  ``fp8_experts.ENABLED`` (on by default); otherwise it stays, and says why.
- Refused, with the reason: weights that are not bf16/fp16, in/out features not multiples of 16
  (128 for blockwise), a CUDA device that is not sm90, names the caller excluded; the LM head
  (``get_output_embeddings()``, else a Linear named ``lm_head``) stays bf16 unless
  ``lm_head=True``.
Off a GPU the FP8 layers compute the same quantization with the products in float32
(``cutlass_ops.scaled_mm``'s reference, the CPU rule), so a converted model runs anywhere and the
conversion can be checked on a CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn

from cutlass_ops import conversion_refusals, decoder_blocks, lm_loss
from cutlass_ops.fp8 import fp8_experts, recipes
from cutlass_ops.fp8.linear import FusedGemms, Fp8Linear
from cutlass_ops.fp8.recipes import Recipe
from cutlass_ops.moe.experts import GroupedExperts


@dataclasses.dataclass(frozen=True)
class RecipeChoice:
    """One layer's FP8 outcome: ``recipe`` its name, or None when the layer stays 16-bit."""

    name: str
    kind: str
    recipe: Optional[str]
    reason: str


def convert_fp8(model: nn.Module, recipe: Recipe | str, *, lm_head: bool = False,
                include=None, exclude=(), linear_types: tuple = (nn.Linear,)) -> list[RecipeChoice]:
    """Makes ``model``'s Linear layers and fused decoder blocks FP8 per ``recipe`` in place,
    where they take it (module docstring); returns a RecipeChoice per layer considered. Layers the
    caller excluded, and Linears of other types than ``linear_types`` (subclasses with forwards
    of their own), are left alone without a RecipeChoice."""
    recipe = recipes.get(recipe)
    head = _lm_head(model)
    choices: list[RecipeChoice] = []
    in_blocks: set = set()
    for name, module in list(model.named_modules()):
        if decoder_blocks.is_fused(module) and not _excluded(name, include, exclude):
            choices += _convert_block(model, name, module, recipe)
            in_blocks.update(f"{name}.{child}" for child in _block_linears(module))
    for name, module in list(model.named_modules()):
        if type(module) not in linear_types or not name or name in in_blocks or \
                _excluded(name, include, exclude):
            continue
        kind = type(module).__name__
        if module is head and not lm_head:
            choices.append(RecipeChoice(name, kind, None, "the LM head stays bf16 (fp8_lm_head=True "
                                  "makes it FP8)"))
            continue
        why = refusal(module, recipe)
        if why is not None:
            choices.append(RecipeChoice(name, kind, None, why))
            continue
        _swap(model, name, Fp8Linear.from_linear(module, recipe))
        reason = _converted_reason(module.weight, recipe)
        if module is head:
            reason += _head_note(model)
        choices.append(RecipeChoice(name, kind, recipe.name, reason))
    for name, module in list(model.named_modules()):
        if type(module) is GroupedExperts and not _excluded(name, include, exclude):
            choices.append(_convert_experts(model, name, module, recipe))
    return choices


def _convert_experts(model, name: str, experts: GroupedExperts, recipe: Recipe) -> RecipeChoice:
    """A converted MoE layer's experts made FP8 (``cutlass_ops.fp8.fp8_experts``) where they
    take it, else a RecipeChoice saying why they stay bf16."""
    kind = type(experts).__name__
    weight = experts.gate_up_proj
    if recipe.name != "blockwise":
        why = f"FP8 experts take the blockwise recipe, not {recipe.name}"
    elif not fp8_experts.ENABLED:
        why = "the FP8 experts are turned off (cutlass_ops.fp8.fp8_experts.ENABLED)"
    else:
        why = (conversion_refusals.not_sm90(weight.device, ": FP8 experts need one")
               if weight.device.type == "cuda" else None) or fp8_experts.refusal(experts)
    if why is not None:
        return RecipeChoice(name, kind, None, f"the experts stay 16-bit: {why}")
    new = fp8_experts.Fp8GroupedExperts(experts)
    new.replaced = experts.replaced
    _swap(model, name, new)
    return RecipeChoice(name, kind, recipe.name,
                        "FP8 blockwise expert GEMMs (forward and input gradient; the weight "
                        "gradient in bf16)" + _converted_reason(weight, recipe)[
                            len(f"FP8 {recipe.name} forward and backward"):])


def refusal(layer: nn.Linear, recipe: Recipe) -> str | None:
    """Why ``layer`` cannot run FP8 per ``recipe``, or None."""
    weight = layer.weight
    # Off a GPU the FP8 layers compute in float32 (the CPU rule): no GPU to refuse there.
    why = conversion_refusals.not_sm90(weight.device, ": FP8 layers need one") \
        if weight.device.type == "cuda" else None
    return why or recipe.refusal(layer.in_features, layer.out_features, weight.dtype)


def _converted_reason(weight, recipe: Recipe) -> str:
    where = "" if weight.device.type == "cuda" else (
        f" (weights on {weight.device}: the FP8 products computed in float32 there)")
    return f"FP8 {recipe.name} forward and backward{where}"


def _head_note(model) -> str:
    if lm_loss.is_routed(model):  # cutlass_ops.lm_loss routed the loss
        return ("; with labels the fused head and loss (cutlass_ops.lm_loss) run its GEMMs in "
                "FP8 too (bf16 under torch.compile or a sharded vocabulary)")
    return ""


def _block_linears(layer) -> dict:
    """The block's projections by their names under the layer."""
    out = {f"self_attn.{n}": getattr(layer.self_attn, n) for n in decoder_blocks.ATTENTION_LINEARS}
    if not decoder_blocks.has_moe_mlp(layer):
        out.update({f"mlp.{n}": getattr(layer.mlp, n) for n in decoder_blocks.MLP_LINEARS})
    for name, shared in _fused_shared_experts(layer).items():  # the routed experts stay 16-bit
        out.update({f"mlp.{name}.{n}": getattr(shared, n) for n in decoder_blocks.MLP_LINEARS})
    return out


def _fused_shared_experts(layer) -> dict:
    """A fused MoE layer's shared-expert MLPs that run as fused dense MLPs, by name."""
    if not decoder_blocks.has_moe_mlp(layer):
        return {}
    return {name: module for name, module in decoder_blocks.shared_expert_mlps(layer.mlp).items()
            if isinstance(module, decoder_blocks.FusedMLP)}


def _convert_block(model, name: str, layer, recipe: Recipe) -> list[RecipeChoice]:
    """A fused decoder block's GEMMs made FP8, all or none; a RecipeChoice for it and each
    projection."""
    linears = _block_linears(layer)
    why = next((f"{child}: {r}" for child, lin in linears.items()
                for r in (refusal(lin, recipe),) if r is not None), None)
    kind = type(layer).__name__
    if why is not None:
        return [RecipeChoice(name, kind, None, why)] + [
            RecipeChoice(f"{name}.{child}", type(lin).__name__, None,
                   f"its decoder block's GEMMs stay 16-bit ({why})")
            for child, lin in linears.items()]
    moe = decoder_blocks.has_moe_mlp(layer)
    shared = list(_fused_shared_experts(layer).values())
    for module in (layer.self_attn, *shared) if moe else (layer.self_attn, layer.mlp):
        decoder_blocks.set_gemms(module, FusedGemms(recipe))
    gemms = "merged QKV, o_proj" if moe else "merged QKV, o_proj, merged gate+up, down_proj"
    if shared:
        gemms += ", the shared experts' merged gate+up and down_proj"
    choices = [RecipeChoice(name, kind, recipe.name, (
        f"fused block with FP8 {recipe.name} GEMMs ({gemms}; forward and backward), the "
        "residual adds after the GEMMs in torch" + ("; its experts stay 16-bit" if moe else "")))]
    for child, lin in linears.items():
        _swap(model, f"{name}.{child}", Fp8Linear.from_linear(lin, recipe))
        choices.append(RecipeChoice(f"{name}.{child}", type(lin).__name__, recipe.name,
                              _converted_reason(lin.weight, recipe) + " in its fused block"))
    return choices


def _lm_head(model) -> Optional[nn.Module]:
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        head = None
    return head if isinstance(head, nn.Linear) else getattr(model, "lm_head", None)


def _excluded(name: str, include, exclude) -> bool:
    return include is not None and name not in include or name in exclude


def _swap(model, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


__all__ = ["RecipeChoice", "convert_fp8", "refusal"]
