"""The checks of an FP8 scaled GEMM's inputs (``cutlass_ops.scaled_mm``): ``torch._scaled_mm``'s
meaning, with the scaling recipe read from the scales' shapes as torch reads it.

y = (a * scale_a) @ (b * scale_b) [+ bias], a (M, K) and b (K, N) of an FP8 element type (e4m3,
or e5m2 beside an e4m3: FP8 wgmma has no e5m2 x e5m2), both K-major (a row-major, b
column-major: what FP8 wgmma reads), float32 scales on the operands' device:

- **tensorwise**: scale_a and scale_b one number each (any shape of one element);
- **rowwise**: scale_a (M, 1), scale_b (1, N);
- **blockwise**: a scale per row and 128 columns of a, scale_a (M, K/128) column-major (stride
  (1, M)), and per 128 x 128 block of b, scale_b (K/128, N/128) with stride (1, K/128): the
  transpose of a weight's row-major (N/128, K/128) scales, as DeepSeek's recipe stores them.

The output is bf16 (default) or float32; the bias (N,) of the output's dtype. Every refusal is an
``UnsupportedInputError`` naming the tensor and the rule; ``scaled_mm`` raises it, dispatch sends
the call to ``torch._scaled_mm`` with one log line.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

from cutlass_ops.gemms.inputs import EXTENT_TYPE
from custom_kernels.core import int_limits
from custom_kernels.core.elements import element
from custom_kernels.core.errors import UnsupportedInputError

BLOCK = 128  # the blockwise recipe's block: 1 x 128 of activations, 128 x 128 of weights
ALIGN = 16  # bytes: TMA's address and stride alignment; torch._scaled_mm asks K, N % 16 too
OUT_DTYPES = ("bfloat16", "float32")


class ScaleRecipe(str, enum.Enum):
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"


@dataclasses.dataclass(frozen=True)
class CheckedScaled:
    """A scaled GEMM that passed every check: what a kernel is chosen by, and what it reads."""

    recipe: ScaleRecipe
    m: int
    n: int
    k: int
    element_a: str  # "e4m3" or "e5m2"
    element_b: str
    out_dtype: Any  # torch.bfloat16 or torch.float32
    has_bias: bool

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def recipe_of(scale_a, scale_b, m: int, n: int, k: int) -> ScaleRecipe:
    """The recipe the scales' shapes and strides name (module docstring), as torch._scaled_mm
    infers it; UnsupportedInputError naming both shapes otherwise."""
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return ScaleRecipe.TENSORWISE
    if sa == (m, 1) and sb == (1, n):
        return ScaleRecipe.ROWWISE
    blocks_k = -(-k // BLOCK)
    if sa == (m, blocks_k) and sb == (blocks_k, -(-n // BLOCK)):
        if m > 1 and scale_a.stride(0) != 1:
            raise UnsupportedInputError(
                f"blockwise scale_a {sa} must be column-major (stride (1, {m})), got stride "
                f"{tuple(scale_a.stride())}: pass s.t().contiguous().t()")
        if blocks_k > 1 and scale_b.stride(0) != 1:
            raise UnsupportedInputError(
                f"blockwise scale_b {sb} must be the transpose of a row-major (N/128, K/128) "
                f"tensor (stride (1, {blocks_k})), got stride {tuple(scale_b.stride())}")
        return ScaleRecipe.BLOCKWISE
    raise UnsupportedInputError(
        f"scale_a {sa} and scale_b {sb} name no scaling recipe for M={m}, N={n}, K={k}: "
        f"tensorwise takes one float each, rowwise ({m}, 1) and (1, {n}), blockwise "
        f"({m}, {blocks_k}) and ({blocks_k}, {-(-n // BLOCK)})")


def check_scaled(a, b, scale_a, scale_b, *, bias=None, out_dtype=None,
                 pointers: bool = True) -> CheckedScaled:
    """Every check of ``scaled_mm(a, b, scale_a, scale_b, bias=, out_dtype=)`` (module
    docstring); ``pointers=False`` leaves out ``check_pointers`` (while torch.compile traces).
    The caller has applied the device rule (``custom_kernels.core.fallback``)."""
    import torch

    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b),
                    ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise UnsupportedInputError(f"{name} is a {type(t).__name__}, not a tensor")
    element_a, element_b = _fp8(a, "a"), _fp8(b, "b")
    if element_a == element_b == "e5m2":
        raise UnsupportedInputError("a and b are both float8_e5m2; FP8 tensor cores take e5m2 "
                                    "only beside an e4m3 operand")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise UnsupportedInputError(f"a {tuple(a.shape)} and b {tuple(b.shape)} are not (M, K) "
                                    "and (K, N) matrices")
    (m, k), n = a.shape, b.shape[1]
    _check_k_major(a, b)
    if pointers:
        check_pointers(a, b)
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if element(out_dtype).torch_name not in OUT_DTYPES:
        raise UnsupportedInputError(f"out_dtype {out_dtype}: scaled_mm writes bfloat16 or "
                                    "float32")
    recipe = recipe_of(scale_a, scale_b, m, n, k)
    _check_scales(scale_a, scale_b, a)
    if recipe is ScaleRecipe.BLOCKWISE and (k % BLOCK or n % BLOCK):
        raise UnsupportedInputError(f"blockwise scaling needs K and N multiples of {BLOCK}, got "
                                    f"K={k}, N={n}")
    if bias is not None:
        _check_bias(bias, n, out_dtype, a.device)
    too_large = int_limits.misfit({"M": m, "N": n, "K": k}, EXTENT_TYPE,
                                  "the CUTLASS launcher's")
    if too_large:
        raise UnsupportedInputError(f"{too_large}; split the problem")
    return CheckedScaled(recipe, m, n, k, element_a, element_b, out_dtype, bias is not None)


def _fp8(t, name: str) -> str:
    try:
        found = element(t.dtype)
    except ValueError:
        found = None
    if found is None or not found.is_fp8:
        raise UnsupportedInputError(f"{name} has dtype {t.dtype}; scaled_mm takes "
                                    "float8_e4m3fn (or float8_e5m2) operands")
    return found.name


def _check_k_major(a, b) -> None:
    """a row-major and b column-major, leading dimensions 16-byte aligned, pointers too."""
    m, k = a.shape
    n = b.shape[1]
    if k > 1 and a.stride(1) != 1 or m > 1 and a.stride(0) < k:
        raise UnsupportedInputError(f"a must be row-major (K-major) for FP8, got stride "
                                    f"{tuple(a.stride())}: pass a.contiguous()")
    if k > 1 and b.stride(0) != 1 or n > 1 and b.stride(1) < k:
        raise UnsupportedInputError(f"b must be column-major (K-major) for FP8, got stride "
                                    f"{tuple(b.stride())}: pass w.t() of a row-major (N, K) w")
    if k % ALIGN or n % ALIGN:
        raise UnsupportedInputError(f"K={k} and N={n} must be multiples of {ALIGN} for FP8")
    for name, lead in (("a", a.stride(0)), ("b", b.stride(1))):
        if lead % ALIGN:
            raise UnsupportedInputError(f"{name}'s leading stride {lead} must be a multiple of "
                                        f"{ALIGN}")


def check_pointers(a, b) -> None:
    """The operands' addresses 16-byte aligned (TMA). Apart from ``check_scaled``'s other checks
    because torch.compile cannot trace a data pointer: the op checks them when it runs."""
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % ALIGN:
            raise UnsupportedInputError(f"{name} must start at a {ALIGN}-byte aligned address")


def _check_scales(scale_a, scale_b, a) -> None:
    import torch

    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32:
            raise UnsupportedInputError(f"{name} has dtype {s.dtype}; scales are float32")
        if s.device != a.device:
            raise UnsupportedInputError(f"{name} is on {s.device}, the operands on {a.device}")


def _check_bias(bias, n: int, out_dtype, device) -> None:
    if tuple(bias.shape) != (n,) or bias.dtype != out_dtype or bias.device != device:
        raise UnsupportedInputError(f"bias must be ({n},) of the output's dtype {out_dtype} on "
                                    f"{device}, got {tuple(bias.shape)} {bias.dtype} on "
                                    f"{bias.device}")
    if bias.stride(0) != 1:
        raise UnsupportedInputError("bias must be contiguous")


def reference(a, b, scale_a, scale_b, bias=None, out_dtype=None,
              recipe: Optional[ScaleRecipe] = None):
    """The float32 product of the dequantized operands, in ``out_dtype``: what every scaled
    kernel is checked against (and what scaled_mm computes off a GPU)."""
    import torch

    (m, k), n = a.shape, b.shape[1]
    recipe = recipe or recipe_of(scale_a, scale_b, m, n, k)
    a32, b32 = a.float(), b.float()
    if recipe is ScaleRecipe.BLOCKWISE:
        a32 = a32 * scale_a.repeat_interleave(BLOCK, dim=1)[:, :k]
        b32 = b32 * scale_b.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:k, :n]
    else:  # tensorwise scales broadcast as one number, rowwise as (M, 1) and (1, N)
        a32 = a32 * scale_a.reshape(-1, 1) if recipe is ScaleRecipe.ROWWISE else a32 * scale_a.reshape(())
        b32 = b32 * scale_b.reshape(1, -1) if recipe is ScaleRecipe.ROWWISE else b32 * scale_b.reshape(())
    out = a32 @ b32
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16 if out_dtype is None else out_dtype)


__all__ = ["BLOCK", "CheckedScaled", "ScaleRecipe", "check_pointers", "check_scaled", "recipe_of",
           "reference"]
