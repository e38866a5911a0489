"""The steps of an FP8 linear layer's three GEMMs, without autograd: each operand quantized as
the recipe says (``custom_kernels.fp8.fp8_quant``) and the GEMMs through ``scaled_mm``.
``cutlass_ops.fp8.linear`` (the layer, its ops and autograd) and ``cutlass_ops.fp8.loss_head``
(an FP8 LM head inside the chunked loss) both build on them; the formulas are in
``linear``'s docstring."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from cutlass_ops.fp8.recipes import Operand, Recipe
from cutlass_ops.fp8.scaled_mm_op import scaled_mm
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.fp8.fp8_quant import Granularity, quantize, quantize_pair, tensor_amax


def rows_of(t: Tensor) -> Tensor:
    t = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def quantize_operand(t: Tensor, operand: Operand, transpose: bool = False, amax=None):
    if amax is not None:
        return quantize(t, operand.granularity, fp8_dtype=operand.dtype, transpose=transpose,
                        amax=amax)
    return quantize(t, operand.granularity, fp8_dtype=operand.dtype, transpose=transpose)


def training_weight_operand(weight: Tensor, recipe: Recipe):
    """((q, scale), amax): W's forward operand for a call that trains W, and for a tensorwise
    recipe W's amax, which the backward's W^T (the same tensor's scale) reuses instead of
    reading W once more (None otherwise)."""
    b = recipe.forward.b
    if b.granularity is Granularity.TENSOR and recipe.dgrad.b.granularity is Granularity.TENSOR:
        amax = tensor_amax(weight)
        return quantize_operand(weight, b, amax=amax), amax
    return quantize_operand(weight, b), None


def padded(rows: Tensor, multiple: int) -> Tensor:
    """``rows`` with zero rows added up to a multiple of ``multiple``."""
    extra = -rows.shape[0] % multiple
    return rows if extra == 0 else torch.nn.functional.pad(rows, (0, 0, 0, extra))


def nothing_kept(like: Tensor):
    """The kept x^T of a call that keeps none."""
    return (like.new_empty(0, dtype=torch.float8_e4m3fn), like.new_empty(0, dtype=torch.float32))


def pairable(one: Operand, other: Operand) -> bool:
    return one.granularity == other.granularity and one.fp8 == other.fp8


def fp8_gemm(a, scale_a, b_rows, scale_b_rows, gemm, dtype, bias=None) -> Tensor:
    """``scaled_mm`` of ``a`` (M, K) and the matrix whose rows are ``b_rows`` (N, K) (passed
    K-major as ``b_rows.t()``, its scales transposed alike), in ``dtype``. The GEMM writes bf16,
    the one output every recipe of ``torch._scaled_mm`` takes (rowwise writes nothing else); an
    fp16 layer casts it and adds its bias after (FP8 operands carry 3 or 2 mantissa bits: bf16's
    8 do not limit the result)."""
    fused = bias if dtype == torch.bfloat16 else None
    y = scaled_mm(a, b_rows.t(), scale_a, scale_b_rows.t(), bias=fused,
                  out_dtype=torch.bfloat16, use_fast_accum=gemm.fast_accum)
    if dtype == torch.bfloat16:
        return y
    y = y.to(dtype)
    return y if bias is None else y.add_(bias)


def shared_amax(amax, *operands: Operand):
    """``amax`` where every operand takes the tensor's scale (the amax is theirs), else None."""
    if amax is None or any(o.granularity is not Granularity.TENSOR for o in operands):
        return None
    return amax


def activations(rows: Tensor, recipe: Recipe, keep: bool, x_fp8=None, x_amax=None):
    """(x_q, x_s, xt_q, xt_s): x for the forward (``x_fp8``'s when given), x^T for the wgrad
    when ``keep`` (the tokens padded to the recipe's multiple: zero rows, the amax unchanged).
    ``x_amax``: x's amax when a kernel that wrote x reduced it (tensorwise)."""
    a, b = recipe.forward.a, recipe.wgrad.b
    a_amax, b_amax = shared_amax(x_amax, a), shared_amax(x_amax, b)
    if x_fp8 is not None:
        xt = quantize_operand(padded(rows, recipe.token_multiple), b, True, b_amax) if keep else \
            nothing_kept(rows)
        return x_fp8[0].reshape(rows.shape), x_fp8[1], *xt
    if not keep:
        return (*quantize_operand(rows, a, amax=a_amax), *nothing_kept(rows))
    if pairable(a, b) and rows.shape[0] % recipe.token_multiple == 0:
        (q, s), (qt, st) = quantize_pair(rows, a.granularity, fp8_dtype=a.dtype, amax=a_amax)
        return q, s, qt, st
    return (*quantize_operand(rows, a, amax=a_amax),
            *quantize_operand(padded(rows, recipe.token_multiple), b, True, b_amax))


def forward_gemm(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: Recipe, keep: bool,
                 weight_fp8=None, x_fp8=None, x_amax=None):
    """(y, xt_q, xt_s): y = x W^T + b; x^T quantized for the wgrad when ``keep`` (else empty).
    ``weight_fp8``: W's forward operand (q, scale) when the caller has it; ``x_fp8``: x's;
    ``x_amax``: x's amax (tensorwise)."""
    rows = rows_of(x)
    wq, ws = weight_fp8 if weight_fp8 is not None else quantize_operand(weight, recipe.forward.b)
    xq, xs, xtq, xts = activations(rows, recipe, keep, x_fp8, x_amax)
    y = fp8_gemm(xq, xs, wq, ws, recipe.forward, x.dtype, bias)
    return y.view(*x.shape[:-1], weight.shape[0]), xtq, xts


def backward_gemms(grad: Tensor, xt, recipe: Recipe, need_x: bool, need_w: bool, weight_dtype,
                   weight_t: Callable[[], tuple], dy_amax=None):
    """(dx, dW), None where not needed. ``xt``: the forward's kept (xt_q, xt_s); ``weight_t()``
    gives W^T's dgrad operand (q, scale); ``dy_amax``: dy's amax when the kernel that wrote dy
    reduced it (tensorwise)."""
    dy = rows_of(grad)
    a_x, a_w = recipe.dgrad.a, recipe.wgrad.a
    x_amax, w_amax = shared_amax(dy_amax, a_x), shared_amax(dy_amax, a_w)
    if need_w and xt[0].numel() == 0 and dy.numel() > 0:
        raise UnsupportedInputError("fp8_linear's wgrad needs the x^T its forward keeps: the "
                                    "forward ran with keep=False")
    whole = dy.shape[0] % recipe.token_multiple == 0
    if need_x and need_w and whole and pairable(a_x, a_w):
        (dq, ds), (dtq, dts) = quantize_pair(dy, a_x.granularity, fp8_dtype=a_x.dtype,
                                             amax=x_amax)
    else:
        dq, ds = quantize_operand(dy, a_x, amax=x_amax) if need_x else (None, None)
        dtq, dts = quantize_operand(padded(dy, recipe.token_multiple), a_w, True, w_amax) \
            if need_w else (None, None)
    grad_x = grad_w = None
    if need_x:
        wtq, wts = weight_t()
        grad_x = fp8_gemm(dq, ds, wtq, wts, recipe.dgrad, grad.dtype)
        grad_x = grad_x.view(*grad.shape[:-1], wtq.shape[0])
    if need_w:
        grad_w = fp8_gemm(dtq, dts, xt[0], xt[1], recipe.wgrad, weight_dtype)
    return grad_x, grad_w
