"""``cutlass_ops.scaled_mm``: FP8 GEMMs with ``torch._scaled_mm``'s meaning, and the custom op
``cutlass_ops::scaled_mm`` (a fake for ``torch.compile(fullgraph=True)``; no host sync, so a
call can be captured in a CUDA graph).

The recipe (tensorwise, rowwise, blockwise) is read from the scales' shapes as torch reads it;
the inputs are checked by ``cutlass_ops.gemms.fp8.fp8_operands`` (K-major FP8 operands, float32
scales, alignment), and a refusal names the rule. Where the call runs:
- on a GPU: a tuned CUTLASS FP8 kernel (``cutlass-tune tune --fp8 RECIPE SHAPES``), chosen by
  ``cutlass_ops.fp8.fp8_routes``; else ``torch._scaled_mm``, with one log line saying why;
- off a GPU (the CPU rule of ``custom_kernels.core.fallback``): the dequantized float32 product
  (``fp8_operands.reference``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cutlass_ops.fp8 import fp8_routes
from cutlass_ops.gemms.fp8 import fp8_operands
from cutlass_ops.gemms.fp8.fp8_operands import ScaleRecipe
from custom_kernels.core import fallback

ENTRY = "cutlass_ops.scaled_mm"


def _recipe(a, b, scale_a, scale_b) -> ScaleRecipe:
    return fp8_operands.recipe_of(scale_a, scale_b, a.shape[0], b.shape[-1], a.shape[-1])


def _run(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum) -> Tensor:
    """A call on a CUDA device: every check (``fp8_operands.check_scaled``) the first time a
    signature is seen, then the route dispatch chose for it."""
    checked = fp8_operands.check_scaled(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    route = fp8_routes.route(a, b, scale_a, scale_b, bias, checked, use_fast_accum)
    return route.run(a, b, scale_a, scale_b, bias)


@torch.library.custom_op("cutlass_ops::scaled_mm", mutates_args=())
def scaled_mm_op(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor,
                 bias: Optional[Tensor], out_dtype: torch.dtype, use_fast_accum: bool) -> Tensor:
    return _run(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)


@scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
    # The checks a trace can make (all but the data pointers, which the op checks at run time).
    fp8_operands.check_scaled(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                              pointers=False)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, *,
              bias: Optional[Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
              use_fast_accum: bool = False) -> Tensor:
    """``(a * scale_a) @ (b * scale_b) + bias`` in ``out_dtype`` (bf16 or float32), for FP8 a
    (M, K) row-major and b (K, N) column-major, as ``torch._scaled_mm`` (the recipe from the
    scales' shapes: ``cutlass_ops.gemms.fp8.fp8_operands``). ``use_fast_accum``: torch's flag
    (FP8 tensor-core accumulation without periodic promotion to float32). Bad input raises
    UnsupportedInputError naming the tensor and the rule."""
    if torch.compiler.is_compiling():  # the op's fake checks the trace, the op the run
        return scaled_mm_op(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
    # Eagerly, a signature seen before skips the checks and the op's dispatch (host time is
    # most of a small FP8 GEMM's time).
    known = fp8_routes.known_route(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
    if known is not None:
        return known.run(a, b, scale_a, scale_b, bias)
    device = fallback.common_device(
        {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "bias": bias}, ENTRY)
    if device is not None and device.type != "cuda":
        checked = fp8_operands.check_scaled(a, b, scale_a, scale_b, bias=bias,
                                            out_dtype=out_dtype)
        fallback.log_once(f"{ENTRY} computes the dequantized product in torch",
                          f"the tensors are on {device}, not a CUDA device")
        return fp8_operands.reference(a, b, scale_a, scale_b, bias, out_dtype, checked.recipe)
    return _run(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)


def recipe(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> ScaleRecipe:
    """Which recipe ``scaled_mm`` reads from these scales (UnsupportedInputError if none)."""
    return _recipe(a, b, scale_a, scale_b)


__all__ = ["ScaleRecipe", "recipe", "scaled_mm", "scaled_mm_op"]
