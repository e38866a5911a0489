"""The three FP8 training recipes as frozen records: for each of a Linear's three GEMMs, which
tensor each operand quantizes, to which FP8 type, with which scale granularity; and the rules a
layer must meet to take the recipe.

A Linear y = x W^T (+ b) with x (M, K) tokens by in_features and W (N, K) runs three GEMMs, each
``cutlass_ops.scaled_mm(a, b, ...)`` with both operands K-major (FP8 wgmma reads nothing else):

    forward  y  = x    W^T   a = x    (M, K)  b = W    (N, K) rows   reduction over K
    dgrad    dx = dy   W     a = dy   (M, N)  b = W^T  (K, N) rows   reduction over N
    wgrad    dW = dy^T x     a = dy^T (N, M)  b = x^T  (K, M) rows   reduction over M (tokens)

Each operand is quantized as the matrix it is read as (the ``tensor`` column), along that
matrix's rows: the backward's operands are the transposes of the forward's tensors, quantized
from them in place (``custom_kernels.fp8.fp8_quant``, ``transpose=True``).

- **tensorwise** (torchao's default recipe): one scale per operand. Gradients are **e5m2**: one
  scale must cover the whole gradient, whose values span more binades than activations' (a few
  outlier tokens hold most of its norm), and e5m2 keeps 32 binades to e4m3's 18 at the cost of one
  mantissa bit.
- **rowwise** (torchao's rowwise recipe): one scale per row of each operand along the
  reduction (per token of x and dy, per output channel of W; in the backward per input channel
  of W^T, per output channel of dy^T, per input channel of x^T). Gradients **e4m3**: a scale per
  row already follows the gradient's range, and e4m3's extra mantissa bit is the better use of
  eight bits.
- **blockwise** (DeepSeek-V3's): activations and gradients in 1 x 128 tiles along the reduction,
  weights in 128 x 128 blocks (the transposed weight has the same blocks, transposed), all
  **e4m3** (fine-grained scales make e5m2's range unnecessary; DeepSeek-V3 trains so). The wgrad
  GEMM has two activation-like operands, but ``scaled_mm``'s blockwise form takes 1 x 128 scales
  for a and 128 x 128 for b: dy^T gets the 1 x 128 tiles (per output channel and 128 tokens: the
  gradient is the operand with the widest range), x^T the 128 x 128 blocks (128 input channels
  by 128 tokens).

The tensorwise and rowwise forward GEMMs use fast accumulation (torchao's choice), the backward
GEMMs float32 promotion; blockwise GEMMs promote by construction (each 128-deep block's products
are scaled into a float32 accumulator), so none asks for it. The wgrad GEMM reduces over tokens,
which ``scaled_mm`` wants in multiples of 16 (every recipe) or 128 (blockwise): other token
counts are padded with zero rows there (zeros change no amax and add nothing to the product).
"""

from __future__ import annotations

import dataclasses
import functools

from custom_kernels.core.elements import element
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.fp8.fp8_quant import Granularity

TENSOR, ROW = Granularity.TENSOR, Granularity.ROW
BLOCK_1X128, BLOCK_128X128 = Granularity.BLOCK_1X128, Granularity.BLOCK_128X128
SUPPORTED_DTYPES = ("bfloat16", "float16")  # the layers' (master weights', activations') dtype


@dataclasses.dataclass(frozen=True)
class Operand:
    """One GEMM operand: the matrix quantized (``tensor``, read along its rows), its FP8 type
    (``elements`` name: "e4m3" or "e5m2") and its scale granularity."""

    tensor: str
    fp8: str
    granularity: Granularity

    @functools.cached_property
    def dtype(self):  # cached: read on every FP8 linear call (host time)
        return element(self.fp8).torch_dtype


@dataclasses.dataclass(frozen=True)
class Gemm:
    a: Operand
    b: Operand
    fast_accum: bool


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A recipe: its three GEMMs, the layer sizes it takes (``feature_multiple``, for in_features
    and out_features) and the token multiple its wgrad reduction is padded to."""

    name: str
    forward: Gemm
    dgrad: Gemm
    wgrad: Gemm
    feature_multiple: int
    token_multiple: int
    gradients: str  # why the gradients have their FP8 type

    def refusal(self, in_features: int, out_features: int, dtype) -> str | None:
        """Why a Linear (in_features, out_features, weights of ``dtype``) cannot take this
        recipe, or None."""
        name = _dtype_name(dtype)
        if name not in SUPPORTED_DTYPES:
            return (f"{name} weights: FP8 layers keep bf16/fp16 master weights (convert the "
                    "model's dtype first)")
        multiple = self.feature_multiple
        if in_features % multiple or out_features % multiple:
            why = "128 x 128 weight blocks" if multiple == 128 else "16-byte aligned FP8 rows"
            return (f"{in_features}x{out_features}: {self.name} needs in_features and "
                    f"out_features multiples of {multiple} ({why})")
        return None

    def check(self, in_features: int, out_features: int, dtype) -> None:
        """``refusal`` as an UnsupportedInputError."""
        why = self.refusal(in_features, out_features, dtype)
        if why is not None:
            raise UnsupportedInputError(f"FP8 {self.name} linear: {why}")


def _dtype_name(dtype) -> str:
    try:
        return element(dtype).torch_name
    except ValueError:
        return str(dtype).replace("torch.", "")


def _gemms(activation: Granularity, weight: Granularity, gradient: str, grad_a: Granularity,
           wgrad_b: Granularity, fast_forward: bool = True) -> tuple[Gemm, Gemm, Gemm]:
    return (Gemm(Operand("x", "e4m3", activation), Operand("W", "e4m3", weight), fast_forward),
            Gemm(Operand("dy", gradient, grad_a), Operand("W^T", "e4m3", weight), False),
            Gemm(Operand("dy^T", gradient, grad_a), Operand("x^T", "e4m3", wgrad_b), False))


RECIPES: dict[str, Recipe] = {
    "tensorwise": Recipe("tensorwise", *_gemms(TENSOR, TENSOR, "e5m2", TENSOR, TENSOR), 16, 16,
                         "e5m2: one scale spans the whole gradient, whose range needs e5m2's "
                         "32 binades"),
    "rowwise": Recipe("rowwise", *_gemms(ROW, ROW, "e4m3", ROW, ROW), 16, 16,
                      "e4m3: a scale per row follows the gradient's range; e4m3 keeps one more "
                      "mantissa bit"),
    "blockwise": Recipe("blockwise", *_gemms(BLOCK_1X128, BLOCK_128X128, "e4m3", BLOCK_1X128,
                                             BLOCK_128X128, False), 128, 128,
                        "e4m3: 1 x 128 tiles follow the gradient's range (DeepSeek-V3)"),
}


def get(recipe) -> Recipe:
    """The recipe named ``recipe`` (or ``recipe`` itself); UnsupportedInputError naming the
    known ones otherwise."""
    if isinstance(recipe, Recipe):
        return recipe
    found = RECIPES.get(recipe) if isinstance(recipe, str) else None
    if found is None:
        raise UnsupportedInputError(f"unknown FP8 recipe {recipe!r}; known: "
                                    f"{', '.join(RECIPES)}")
    return found


__all__ = ["Recipe", "Gemm", "Operand", "RECIPES", "get", "SUPPORTED_DTYPES"]
