"""An FP8 LM head inside the chunked loss (``cutlass_ops.fused_cross_entropy``): the head's three
products, each chunk's logits, hidden gradient and weight gradient, through the FP8 GEMMs of
``gemm_steps`` per the head's recipe, as ``Fp8Linear`` runs them, while the chunking, the fused
cross-entropy kernel and the reductions stay the bf16 loss's.

Per pass over the chunks, the weight is quantized once for the logits (W) and once for the
hidden gradient (W^T); a chunk's hidden is quantized with its transpose for the weight gradient
(kept until that chunk's gradients are done: one chunk at a time), the chunk's logit gradient
once for both backward GEMMs. The weight gradient is accumulated chunk by chunk in the weight's
dtype, one rounding per chunk, as the bf16 loss does. A head that is not trained (no gradient
to its weight) reads the layer's kept FP8 copies (``WeightCache``) instead of quantizing."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from cutlass_ops.fp8.gemm_steps import (backward_gemms, forward_gemm, quantize_operand,
                                        training_weight_operand)
from cutlass_ops.fp8.recipes import Recipe
from cutlass_ops.fused_cross_entropy import HeadProducts


class Fp8HeadProducts(HeadProducts):
    """``HeadProducts`` through FP8 GEMMs per ``recipe``; ``cache``: the head's
    ``linear.WeightCache``, read when the weight takes no gradient, or None."""

    def __init__(self, recipe: Recipe, cache=None):
        self.recipe, self.cache = recipe, cache
        self.finish()

    def start(self, weight: Tensor, train_weight: bool) -> None:
        self._weight, self._train = weight.detach(), train_weight
        if weight.requires_grad or self.cache is None:
            self._forward, self._amax = training_weight_operand(self._weight, self.recipe)
        else:
            self._forward = self.cache.get("forward", [weight], self._weight, self.recipe)

    def finish(self) -> None:
        self._weight = self._forward = self._amax = self._dgrad = None
        self._xt = self._chunk_w = None
        self._train = False

    def logits(self, hidden_chunk: Tensor, weight: Tensor, bias=None) -> Tensor:
        y, xt_q, xt_s = forward_gemm(hidden_chunk, self._weight, bias, self.recipe,
                                     self._train, self._forward)
        self._xt = (xt_q, xt_s)  # this chunk's hidden^T, for its weight gradient
        return y

    def _weight_t(self):
        if self._dgrad is None:
            self._dgrad = quantize_operand(self._weight, self.recipe.dgrad.b, True,
                                           amax=self._amax)
        return self._dgrad

    def grad_hidden(self, grad: Tensor, weight: Tensor) -> Tensor:
        # The weight's share too when it trains: both GEMMs read the logit gradient quantized
        # in one pass (dy and dy^T); grad_weight takes it next.
        grad_x, self._chunk_w = backward_gemms(grad, self._xt, self.recipe, True, self._train,
                                               self._weight.dtype, self._weight_t)
        return grad_x

    def grad_weight(self, accumulated: Optional[Tensor], grad: Tensor,
                    hidden_chunk: Tensor) -> Tensor:
        chunk_w, self._chunk_w = self._chunk_w, None
        if chunk_w is None:  # no hidden gradient asked for: dW alone
            chunk_w = backward_gemms(grad, self._xt, self.recipe, False, True,
                                     self._weight.dtype, self._weight_t)[1]
        return chunk_w if accumulated is None else accumulated.add_(chunk_w)
