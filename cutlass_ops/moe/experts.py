"""Mixture-of-experts experts as two grouped GEMMs: Hugging Face's experts modules
(``MixtralExperts``, ``Qwen3MoeExperts`` and the modules built like them: ``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I], SiLU) run without their per-expert loop.

Hugging Face's sparse MoE block calls its router, then ``experts(hidden, top_k_index,
top_k_weights)``, which loops over the experts that received tokens (a host sync per expert
and two GEMMs each). ``GroupedExperts`` keeps the router and the parameters (same module path,
same ``state_dict`` keys) and computes the same sum with no host sync:

1. the (token, slot) pairs sorted by expert (a stable sort), and the cumulative expert counts
   as the grouped GEMMs' offsets (a scatter-add on the device), or the same from the routing
   pass of a fused router (``cutlass_ops.moe.moe_router``);
2. the tokens gathered in that order (the backward sums each token's rows in one kernel, as
   step 3 does), one grouped GEMM with every expert's ``gate_up_proj``,
   SiLU(gate) * up in one kernel (``custom_kernels.swiglu``, Hugging Face's bits), one grouped
   GEMM with ``down_proj`` (``cutlass_ops.moe.grouped``: the routed pairs cover every row);
3. each token's results read through the inverse of the sort and summed over its slots with
   their routing weights, in float32, rounded once, in one kernel each way
   (``custom_kernels.moe.moe_combine.combine``; its backward gives the expert outputs' and the
   routing weights' gradients). Hugging Face rounds each expert's share to the model's dtype
   before adding it: the two agree within that dtype's tolerance.

``convert`` swaps an experts module only after a numeric probe: on a small random input, its
own forward and ours agree within the dtype's tolerance (``probe``); otherwise it stays, and the
report says why. Autograd, ``torch.compile`` and CUDA graphs work (nothing reads the routing on
the host).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from cutlass_ops import module_state
from cutlass_ops.moe.grouped import routed_grouped_mm
from custom_kernels.core.tolerances import GEMM, relative_error, relative_tolerance
from custom_kernels.moe.moe_combine import combine
from custom_kernels.swiglu import swiglu

PROBE_TOKENS = 64
PROBE_TOP_K = 2


class SortedPairs(NamedTuple):
    """What a fused router (``cutlass_ops.moe.moe_router``) hands its experts for one call
    (``cutlass_ops.module_state``): the top-k index it routed and that index's sort."""

    index: torch.Tensor
    pairs: tuple  # sorted_pairs(index)


def looks_like_experts(module: nn.Module) -> bool:
    """Built like Hugging Face's experts modules: 3-D ``gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I] parameters and a SiLU activation."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, double_inter, hidden = gate_up.shape
    return (tuple(down.shape) == (experts, hidden, double_inter // 2) and double_inter % 2 == 0
            and _is_silu(getattr(module, "act_fn", None)))


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def sorted_pairs(top_k_index: torch.Tensor, experts: int):
    """(token_of_row [T * k], offsets [E] int32, inverse [T, k]): the (token, slot) pairs
    sorted by expert (stably), each sorted row's token, the grouped GEMMs' cumulative group
    ends, and the sorted row holding pair (t, j); in torch, with no host sync
    (``custom_kernels.moe.moe_routing.route`` writes the same in its routing pass)."""
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the pairs, grouped by expert
    counts = torch.zeros(experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return order // top_k, offs, inverse.view(tokens, top_k)


def experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, pairs=None, gemm=None) -> torch.Tensor:
    """``sum_j w[t, j] * down[e] @ silu_and_mul(gate_up[e] @ x[t])`` over each token's slots
    ``j`` (expert ``e = top_k_index[t, j]``): hidden [T, H], top_k_index / top_k_weights
    [T, k]. ``pairs``: ``sorted_pairs(top_k_index, E)`` when the router made them. ``gemm(rows,
    weight [E, N, K], offs)``: the routed expert GEMM, ``rows @ weight[e]^T`` an expert
    (default: bf16 grouped GEMMs; ``cutlass_ops.fp8.fp8_experts`` passes its FP8 one). Returns
    [T, H] in hidden's dtype."""
    token_of_row, offs, inverse = pairs if pairs is not None else \
        sorted_pairs(top_k_index, gate_up_proj.shape[0])
    routed = _GatherPairs.apply(hidden, token_of_row, inverse)  # [T * k, H]: pair's token
    # every pair is routed, so offs[-1] is every row: the backward need not zero a tail
    gemm = gemm or _bf16_gemm
    gate_up = gemm(routed, gate_up_proj, offs)
    out = gemm(swiglu(gate_up), down_proj, offs)
    weights = top_k_weights
    if weights.dtype not in (torch.float32, out.dtype):  # the kernel reads these two
        weights = weights.float()
    return combine(out, inverse, weights).to(hidden.dtype)


def _bf16_gemm(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return routed_grouped_mm(rows, weight.transpose(1, 2), offs)


class _GatherPairs(torch.autograd.Function):
    """``hidden[token_of_row]``: each sorted pair's token row. The backward sums each token's k
    rows of the gradient, found through ``inverse``, in float32 rounded once: ``combine`` with
    unit weights (index_select's own backward adds them with atomics, in the dtype, in no fixed
    order)."""

    @staticmethod
    def forward(ctx, hidden, token_of_row, inverse):
        ctx.save_for_backward(inverse)
        return hidden.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        ones = torch.ones(inverse.shape, dtype=torch.float32, device=grad.device)
        return combine(grad, inverse, ones), None, None


class GroupedExperts(nn.Module):
    """A Hugging Face experts module on grouped GEMMs, with its parameters (no copy: the same
    ``state_dict`` keys, optimizers keep working)."""

    gemm = None  # the routed expert GEMM (experts_forward's ``gemm``); a subclass's own

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.num_experts = self.gate_up_proj.shape[0]
        self.replaced = type(experts).__name__
        self.train(experts.training)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # The sort a fused router (cutlass_ops.moe.moe_router) made for this very index, if any.
        # (None while torch.compile traces: the router hands nothing over then.)
        handed = None if torch.compiler.is_compiling() else \
            module_state.take(self, SortedPairs)
        pairs = handed.pairs if handed is not None and handed.index is top_k_index else None
        return experts_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                               self.down_proj, pairs, gemm=type(self).gemm)

    def extra_repr(self) -> str:
        return f"{self.num_experts} experts, replaces {self.replaced}"


def probe(experts: nn.Module, seed: int = 0) -> Optional[str]:
    """None when ``experts``' own forward and ours agree on a small random routing within the
    dtype's tolerance, else why not."""
    weight = experts.gate_up_proj
    hidden = weight.shape[-1]
    device, dtype = weight.device, weight.dtype
    generator = torch.Generator(device).manual_seed(seed)
    top_k = min(PROBE_TOP_K, weight.shape[0])
    x = torch.randn(PROBE_TOKENS, hidden, device=device, generator=generator).to(dtype)
    scores = torch.rand(PROBE_TOKENS, weight.shape[0], device=device, generator=generator)
    weights, index = scores.topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    try:
        with torch.no_grad():
            theirs = experts(x, index, weights)
            ours = experts_forward(x, index, weights, experts.gate_up_proj, experts.down_proj)
    except Exception as exc:  # noqa: BLE001 - a module that is not what its structure says
        return f"the probe failed: {type(exc).__name__}: {exc}"[:300]
    error = relative_error(ours, theirs)
    bound = relative_tolerance(dtype, GEMM)
    if not error <= bound:
        return (f"its forward differs from the grouped experts' on a random routing "
                f"(relative error {error:.3g} > {bound:g})")
    return None


__all__ = ["GroupedExperts", "experts_forward", "sorted_pairs", "looks_like_experts", "probe"]
