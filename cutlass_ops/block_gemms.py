"""The contract of a fused decoder block's GEMMs (``cutlass_ops.decoder_blocks``): the merged
projections (Q, K and V; gate and up) and the projections whose output meets the residual
(o_proj, down_proj). Three implementations plug in, one per module, held in its ``BlockState``:

- ``Bf16Gemms`` (the default): ``cutlass_ops.fused_linear``'s GEMMs, the residual added in the
  epilogue;
- ``cutlass_ops.fp8.FusedGemms``: FP8 GEMMs of a recipe, reading the input operand the norm or
  SwiGLU kernel wrote beside its output where the recipe allows (``input_fp8``), or taking the
  amaxes those kernels reduced (``takes_amaxes``, tensorwise);
- ``cutlass_ops.parallel.sharded_gemms.TensorParallelGemms``: the same GEMMs on each rank's shards, the
  row-parallel partial sums reduced over the ranks (``collectives``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence, runtime_checkable

from torch import Tensor, nn

from cutlass_ops import fused_linear


@runtime_checkable
class BlockGemms(Protocol):
    """What a fused block calls for its GEMMs. The keywords ``x_fp8`` (an FP8 operand of x the
    caller has), ``grad_amax`` and ``x_amax`` (tensorwise amaxes) are passed only to GEMMs that
    declare they take them (``input_fp8``, ``takes_amaxes``)."""

    input_fp8: Optional[tuple]  # (granularity, FP8 dtype) of the input operand read, or None
    takes_amaxes: bool  # tensorwise FP8: the kernels before the GEMMs hand over the amaxes
    copies_weights: bool  # reads copies made from the weights' values (step graphs track them)
    collectives: bool  # runs collectives (tensor parallel): the layer runs without step graphs

    def merged_linear(self, x: Tensor, weights: Sequence[Tensor], bias: Optional[Tensor] = None,
                      view: Optional[fused_linear.MergedView] = None, **fp8) -> Tensor:
        """``x @ cat(weights)^T (+ bias)`` as one GEMM."""

    def linear_residual(self, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                        residual: Tensor, **fp8) -> Tensor:
        """``x @ weight^T (+ bias) + residual``."""

    def output_projection(self, module: nn.Module, x: Tensor) -> Tensor:
        """The projection ``module`` (o_proj) of ``x``, whose residual add a norm kernel does."""


class Bf16Gemms:
    """The block's own 16-bit GEMMs (``cutlass_ops.fused_linear``)."""

    input_fp8 = None
    takes_amaxes = False
    copies_weights = False
    collectives = False

    def merged_linear(self, x, weights, bias=None, view=None):
        return fused_linear.merged_linear(x, weights, bias, view)

    def linear_residual(self, x, weight, bias, residual):
        return fused_linear.linear_residual(x, weight, bias, residual)

    def output_projection(self, module, x):
        return module(x)


BF16 = Bf16Gemms()


@dataclasses.dataclass
class BlockState:
    """A fused attention's or MLP's state (``cutlass_ops.module_state``): its GEMMs and the kept
    view of its packed weights (``fused_linear.MergedView``)."""

    gemms: BlockGemms = BF16
    view: fused_linear.MergedView = dataclasses.field(default_factory=fused_linear.MergedView)


__all__ = ["BlockGemms", "Bf16Gemms", "BF16", "BlockState"]
