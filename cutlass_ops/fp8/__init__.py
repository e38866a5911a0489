"""FP8 training and inference on Hopper: FP8 Linear layers whose forward and backward
GEMMs run through ``cutlass_ops.scaled_mm`` per a recipe (tensorwise, rowwise, blockwise), and
the conversion that ``cutlass_ops.convert(model, fp8=...)`` delegates to. See README.md here.

- ``recipes``: the three recipes (FP8 types, scale granularities per GEMM operand, layer rules);
- ``linear``: ``fp8_linear``, the ``Linear`` module, the fused blocks' FP8 GEMMs, the weights'
  FP8 copies for inference;
- ``convert``: the module swap and its per-layer choices;
- ``scaled_mm_op``: ``cutlass_ops.scaled_mm`` and its custom op ``cutlass_ops::scaled_mm``;
- ``fp8_routes``: which kernel runs a ``scaled_mm`` call (a tuned CUTLASS or few-rows kernel, or
  ``torch._scaled_mm``), memoized per call signature;
- ``fp8_plan``: a scaled call as a GEMM problem of the CUTLASS chain, and one kernel's launch.

The FP8 rules that the GEMM chain's own modules read (the operands' checks, the few-rows
kernel's route, the blockwise emission) are a layer down, in ``cutlass_ops/gemms/fp8/``.
"""

from cutlass_ops.fp8.convert import RecipeChoice, convert_fp8
from cutlass_ops.fp8.linear import FusedGemms, Fp8Linear, WeightCache, fp8_linear
from cutlass_ops.fp8.recipes import RECIPES, Recipe

__all__ = ["RecipeChoice", "convert_fp8", "fp8_linear", "Fp8Linear", "FusedGemms", "WeightCache",
           "RECIPES", "Recipe"]
