"""A mixture of experts' top-k router in one pass: Hugging Face's routers (Qwen2-MoE's,
Qwen3-MoE's and Mixtral's ``...TopKRouter``: ``logits = x W^T``, softmax in float32, top-k,
renormalised or not) run as the router GEMM and ``custom_kernels.moe.moe_routing.route``, whose
kernels also sort the (token, slot) pairs by expert on the device: the counts per expert, the
grouped GEMMs' offsets, each sorted row's token and the inverse of the sort. The converted experts
(``cutlass_ops.moe.GroupedExperts``) take that sort instead of making their own (a stable
argsort, a scatter of counts, a cumulative sum and an inverse permutation: a dozen launches).

The block's own forward still runs (the jitter of Mixtral's training, Qwen2-MoE's shared expert
and its gate, whatever a block adds): the router returns what Hugging Face's returns, ``(logits,
weights, index)``, and hands its sort to the block's experts module beside them; the experts use
it only for that very ``index`` tensor (identity), so a block that changes the index between the
two calls gets a sort of its own. Under torch.compile the experts sort for themselves.

``fuse_router(block)`` swaps a block's ``gate`` in place after a numeric probe: on random
hidden states its own forward and ours must pick the same experts, in any order (rows whose
k-th and (k+1)-th scores tie may differ: ties go to the lower expert index here), with the same
weights within the dtype's tolerance; the probe also finds the router's normalisation, its scoring
(softmax or sigmoid) and the weights' dtype (Mixtral returns float32, Qwen the logits' dtype).
The router keeps its class as a base (transformers records router logits by class) and its
``weight`` (same ``state_dict`` key); ``unfuse_router`` restores it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from cutlass_ops import mixins, module_state
from cutlass_ops.moe.experts import GroupedExperts, SortedPairs
from custom_kernels.core.tolerances import GEMM, relative_error, relative_tolerance
from custom_kernels.moe.moe_routing import route

PROBE_TOKENS = 64
CANDIDATES = (("softmax", True), ("softmax", False), ("sigmoid", True), ("sigmoid", False))


class RoutingPlan(NamedTuple):
    top_k: int
    scoring: str
    normalize: bool
    weights_dtype: Optional[torch.dtype]  # None: the logits' dtype


class RouterState(NamedTuple):
    """A fused router's state (``cutlass_ops.module_state``): its plan, and the block's experts
    module it hands each call's sort to."""

    plan: RoutingPlan
    experts: Optional[nn.Module]


def _routed(weight: torch.Tensor, hidden: torch.Tensor, plan: RoutingPlan):
    """(logits, weights, index, the Routing) of ``hidden`` [T, H] under ``plan``."""
    logits = F.linear(hidden, weight)
    # float32 weights (Mixtral's): the route of the logits widened, whose weights are float32
    scores = logits if plan.weights_dtype is None else logits.to(plan.weights_dtype)
    r = route(scores, plan.top_k, scoring=plan.scoring, normalize=plan.normalize)
    return logits, r.weights, r.index, r


class FusedTopKRouter:
    """The router's forward on ``route``; mixed into the model's router class."""

    def forward(self, hidden_states):
        state = module_state.get(self, RouterState)
        hidden = hidden_states.reshape(-1, self.weight.shape[1])
        logits, weights, index, r = _routed(self.weight, hidden, state.plan)
        if state.experts is not None and not torch.compiler.is_compiling():
            module_state.put(state.experts,
                             SortedPairs(index, (r.token_of_row, r.offsets, r.inverse)))
        return logits, weights, index


def _fused_class(cls: type) -> type:
    return mixins.fused_class(FusedTopKRouter, cls, "on one routing pass")


def structure_refusal(block: nn.Module) -> Optional[str]:
    """Why ``block``'s router is not one ``fuse_router`` takes, or None."""
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if not isinstance(experts, GroupedExperts):
        return "its experts are not cutlass_ops.moe.GroupedExperts (convert them first)"
    if isinstance(gate, FusedTopKRouter):
        return "its router is fused already"
    weight = getattr(gate, "weight", None)
    if not isinstance(gate, nn.Module) or not isinstance(weight, nn.Parameter) or \
            weight.dim() != 2:
        return "its gate has no 2-D weight (a top-k router: logits = x W^T)"
    num, hidden = weight.shape
    if num != experts.num_experts or hidden != experts.gate_up_proj.shape[-1]:
        return (f"its gate's weight {tuple(weight.shape)} is not (experts, hidden) = "
                f"({experts.num_experts}, {experts.gate_up_proj.shape[-1]})")
    top_k = getattr(gate, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= min(num, 32):
        return f"its gate's top_k ({top_k!r}) is not an int from 1 to min(experts, 32)"
    return None


def probe(gate: nn.Module, seed: int = 0) -> tuple[Optional[RoutingPlan], Optional[str]]:
    """(the plan that reproduces ``gate``'s forward, None) or (None, why none does)."""
    weight = gate.weight
    generator = torch.Generator(weight.device).manual_seed(seed)
    x = torch.randn(PROBE_TOKENS, weight.shape[1], device=weight.device,
                    generator=generator).to(weight.dtype)
    with torch.no_grad():
        try:
            theirs = gate(x)
        except Exception as exc:  # noqa: BLE001 - a gate that is not what its structure says
            return None, f"its router's probe failed: {type(exc).__name__}: {exc}"[:300]
        if not (isinstance(theirs, tuple) and len(theirs) == 3 and
                all(isinstance(t, torch.Tensor) for t in theirs)):
            return None, "its router does not return (logits, weights, index) tensors"
        _, weights, index = theirs
        k = gate.top_k
        if weights.shape != (PROBE_TOKENS, k) or index.shape != (PROBE_TOKENS, k) or \
                weights.dtype not in (weight.dtype, torch.float32):
            return None, (f"its router returns weights {tuple(weights.shape)} {weights.dtype} "
                          f"and index {tuple(index.shape)}, not [tokens, top_k] of the "
                          "logits' dtype or float32")
        errors = []
        index, weights = _by_expert(index, weights)
        for scoring, normalize in CANDIDATES:
            plan = RoutingPlan(k, scoring, normalize,
                         None if weights.dtype == weight.dtype else weights.dtype)
            logits, ours, our_index, _ = _routed(weight, x, plan)
            our_index, ours = _by_expert(our_index, ours)
            same = (our_index == index).all(-1)
            # Rows agree whose picks have the same logits: the same experts, or a tie at the
            # k-th score broken another way.
            agree = (logits.gather(-1, our_index).sort(-1)[0] ==
                     logits.gather(-1, index).sort(-1)[0]).all(-1)
            error = relative_error(ours[same], weights[same]) if same.any() else float("inf")
            errors.append(error)
            if agree.float().mean() >= 0.9 and same.float().mean() >= 0.5 and \
                    error <= relative_tolerance(weights.dtype, GEMM):
                return plan, None
    return None, (f"its router is not a softmax or sigmoid top-k of x W^T, renormalised or "
                  f"not (closest relative error {min(errors):.3g})")


def _by_expert(index: torch.Tensor, weights: torch.Tensor):
    """Each token's (expert, weight) pairs in expert order. The experts take the pairs, not
    their order, and the order of tied scores inside the top k is torch.topk's choice: bf16
    logits over 128 experts tie often enough that comparing in top-k order refused Qwen3-MoE's
    routers on some layers and not others (docs/measurements.md)."""
    index, order = index.sort(-1)
    return index, weights.gather(-1, order)


def fuse_router(block: nn.Module) -> Optional[str]:
    """Swaps ``block.gate`` for the one-pass router in place; None when done, else why not (the
    gate is then unchanged)."""
    why = structure_refusal(block)
    if why is not None:
        return why
    gate = block.gate
    plan, why = probe(gate)
    if why is not None:
        return why
    gate.__class__ = _fused_class(type(gate))
    module_state.put(gate, RouterState(plan, block.experts))
    return None


def unfuse_router(gate: nn.Module) -> None:
    if isinstance(gate, FusedTopKRouter):
        gate.__class__ = type(gate)._hf_class
        module_state.drop(gate, RouterState)


def plan_of(gate: nn.Module) -> Optional[RoutingPlan]:
    """A fused router's plan, or None for another module."""
    state = module_state.get(gate, RouterState)
    return None if state is None else state.plan


def describe(gate: nn.Module) -> str:
    plan = plan_of(gate)
    weights = "float32" if plan.weights_dtype is not None else "the logits' dtype"
    return (f"top-{plan.top_k} {plan.scoring} router"
            f"{', renormalised' if plan.normalize else ''} (weights in {weights}) in one "
            "routing pass that also sorts the tokens by expert (cutlass_ops.moe.moe_router)")


__all__ = ["FusedTopKRouter", "RoutingPlan", "fuse_router", "unfuse_router", "probe",
           "structure_refusal", "describe", "plan_of"]
