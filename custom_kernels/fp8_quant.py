"""FP8 quantization with dynamic (current) scaling and no host sync: a tensor, or its transpose, to
e4m3 / e5m2 with the scales ``cutlass_ops.scaled_mm`` (``torch._scaled_mm``) takes.

``q, scale = quantize(x, granularity, fp8_dtype=torch.float8_e4m3fn, transpose=False)`` for a
2-D ``x`` (R, C) in bf16, fp16 or fp32 with a unit last stride (any row stride). The quantized
matrix is ``m = x`` (``transpose=True``: ``m = x.t()``, (C, R), read from ``x`` in place, never
copied to a contiguous transpose). ``granularity`` (``Granularity``, or its string) says which
elements share a scale, and the scale's layout:

- ``"tensor"``: all of ``m``; ``scale`` shape ``()``.
- ``"row"``: each row of ``m``; ``scale`` (rows, 1) (``scaled_mm``'s rowwise ``scale_a``; for a
  weight (N, K), ``scale.t()`` is its ``scale_b``).
- ``"block_1x128"``: each row's 128-column chunks; ``m``'s columns a multiple of 128; ``scale``
  (rows, cols / 128) column-major (stride (1, rows)): blockwise ``scale_a`` as it is.
- ``"block_128x128"``: 128x128 blocks; both extents multiples of 128; ``scale`` (rows / 128,
  cols / 128) row-major: a weight (N, K)'s scales, whose ``.t()`` is blockwise ``scale_b``.

``q`` is (rows, cols) row-major contiguous in ``fp8_dtype`` (``float8_e4m3fn``, largest 448, or
``float8_e5m2``, 57344). The rule, in float32 (bf16 and fp16 values widen exactly):
``amax`` = the largest ``|m|`` of the group; ``scale = amax / fp8_max`` (IEEE division, one
rounding), or 1.0 where that is 0 (an all-zero group, an empty one, or float32 values below
about 6e-43 whose quotient underflows); ``q = fp8(clamp(m / scale, -fp8_max, fp8_max))``
(IEEE division, then torch's round-to-nearest-even cast). ``scale`` is the dequantization
multiplier, ``m ~= q.float() * scale``, float32. Non-finite input does not crash: a NaN makes
its group's amax and scale NaN and every q of the group NaN; an infinity makes the scale inf,
the group's finite values quantize to 0 and the infinity to NaN.

``quantize_pair(x, granularity, fp8_dtype=...)`` returns ``((q, scale), (qt, scale_t))``, the
quantization of ``x`` and of ``x.t()`` (the backward's K-major operands), both orientations'
divisibility rules applied; see its docstring for which granularities read ``x`` once.

Refused on every device with UnsupportedInputError naming the rule: ``x`` not a 2-D tensor, a
dtype other than bf16 / fp16 / fp32, a last dimension that is not contiguous, an unknown
granularity, extents the granularity cannot divide, an ``fp8_dtype`` other than the two above.
Empty input gives empty outputs with scales of ones.

Where it runs: tensors off a CUDA device run ``torch_quantize`` (the CPU rule,
``custom_kernels.core.fallback``; it is also the reference the tests compare the kernels with,
bit for bit). On a GPU, the custom ops ``custom_kernels::fp8_quantize`` / ``fp8_quantize_pair``
(fakes for ``torch.compile(fullgraph=True)``; no host sync, so a call can be captured in a CUDA
graph), which for now also run ``torch_quantize`` on the device (amax and scale are device
tensors: nothing is read back). The CUDA kernels (``csrc/fp8_quant.cu``) come next behind the
same functions. Nothing is differentiable here: the outputs carry no gradient.

Read top-down: the custom ops, the public functions and their checks, then the torch reference.
"""

from __future__ import annotations

import enum

import torch

from custom_kernels.core import elements
from custom_kernels.core import fallback
from custom_kernels.core.errors import UnsupportedInputError

DTYPE_CODES = elements.float_codes()
BLOCK_K = 128  # the extent of a block's side (block_1x128, block_128x128)


class Granularity(str, enum.Enum):
    """Which elements share one scale (see the module docstring for the scales' layouts)."""

    TENSOR = "tensor"
    ROW = "row"
    BLOCK_1X128 = "block_1x128"
    BLOCK_128X128 = "block_128x128"


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 type (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(fp8_dtype).max)


def scale_shape(granularity: Granularity, rows: int, cols: int) -> tuple[int, ...]:
    """The scale's shape for a quantized matrix (rows, cols)."""
    return {Granularity.TENSOR: (), Granularity.ROW: (rows, 1),
            Granularity.BLOCK_1X128: (rows, cols // BLOCK_K),
            Granularity.BLOCK_128X128: (rows // BLOCK_K, cols // BLOCK_K)}[granularity]


def empty_scale(granularity: Granularity, rows: int, cols: int, device) -> torch.Tensor:
    """An uninitialised float32 scale in its layout: block_1x128's is column-major."""
    shape = scale_shape(granularity, rows, cols)
    if granularity is Granularity.BLOCK_1X128:
        return torch.empty(shape[::-1], dtype=torch.float32, device=device).t()
    return torch.empty(shape, dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------
# Custom ops: real impl and fake impl next to each other (no autograd: FP8 carries no gradient)
# ---------------------------------------------------------------------------------------------

def _quantize_impl(x, g: Granularity, fp8_dtype, transpose: bool):
    return torch_quantize(x, g, fp8_dtype=fp8_dtype, transpose=transpose)


def _pair_impl(x, g: Granularity, fp8_dtype):
    return (torch_quantize(x, g, fp8_dtype=fp8_dtype),
            torch_quantize(x, g, fp8_dtype=fp8_dtype, transpose=True))


@torch.library.custom_op("custom_kernels::fp8_quantize", mutates_args=())
def fp8_quantize(x: torch.Tensor, granularity: str, fp8_dtype: torch.dtype,
                 transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of ``x`` (``transpose``: of ``x.t()``); off a CUDA device, the torch
    reference."""
    g = _check(x, granularity, fp8_dtype, (transpose,), "custom_kernels::fp8_quantize")
    return _quantize_impl(x, g, fp8_dtype, transpose)


@fp8_quantize.register_fake
def _(x, granularity, fp8_dtype, transpose):
    g = _check(x, granularity, fp8_dtype, (transpose,), "custom_kernels::fp8_quantize")
    return _empty_outputs(x, g, fp8_dtype, transpose)


@torch.library.custom_op("custom_kernels::fp8_quantize_pair", mutates_args=())
def fp8_quantize_pair(x: torch.Tensor, granularity: str, fp8_dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, qt, scale_t) of ``x`` and ``x.t()``."""
    g = _check(x, granularity, fp8_dtype, (False, True), "custom_kernels::fp8_quantize_pair")
    (q, scale), (qt, scale_t) = _pair_impl(x, g, fp8_dtype)
    return q, scale, qt, scale_t


@fp8_quantize_pair.register_fake
def _(x, granularity, fp8_dtype):
    g = _check(x, granularity, fp8_dtype, (False, True), "custom_kernels::fp8_quantize_pair")
    return (*_empty_outputs(x, g, fp8_dtype, False), *_empty_outputs(x, g, fp8_dtype, True))


def _empty_outputs(x, g: Granularity, fp8_dtype, transpose: bool):
    rows, cols = x.shape[::-1] if transpose else x.shape
    return (torch.empty((rows, cols), dtype=fp8_dtype, device=x.device),
            empty_scale(g, rows, cols, x.device))


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------

def quantize(x: torch.Tensor, granularity, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
             transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` (``transpose``: ``x.t()``) in ``fp8_dtype`` with the dequantization
    scales of ``granularity``; see the module docstring for the rule and the layouts. Tensors off
    a CUDA device run ``torch_quantize`` (logged once)."""
    g = _check(x, granularity, fp8_dtype, (transpose,), "quantize")
    if fallback.off_cuda({"x": x}, "custom_kernels.fp8_quant.quantize", "torch_quantize"):
        return torch_quantize(x, g, fp8_dtype=fp8_dtype, transpose=transpose)
    return torch.ops.custom_kernels.fp8_quantize(x, g.value, fp8_dtype, transpose)


def quantize_pair(x: torch.Tensor, granularity, *,
                  fp8_dtype: torch.dtype = torch.float8_e4m3fn):
    """``((q, scale), (qt, scale_t))`` = ``(quantize(x, g), quantize(x, g, transpose=True))``,
    both orientations' extents checked. Off a CUDA device, ``torch_quantize`` twice (logged
    once); on a GPU, for now, the same on the device."""
    g = _check(x, granularity, fp8_dtype, (False, True), "quantize_pair")
    if fallback.off_cuda({"x": x}, "custom_kernels.fp8_quant.quantize_pair", "torch_quantize"):
        return _pair_impl(x, g, fp8_dtype)
    q, scale, qt, scale_t = torch.ops.custom_kernels.fp8_quantize_pair(x, g.value, fp8_dtype)
    return (q, scale), (qt, scale_t)


def _check(x, granularity, fp8_dtype, orientations, entry: str) -> Granularity:
    """The input rules, on every device; the granularity as a ``Granularity``.
    ``orientations``: the ``transpose`` values whose extents must suit the granularity."""
    if not isinstance(x, torch.Tensor):
        raise UnsupportedInputError(f"{entry}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise UnsupportedInputError(f"{entry}: x must be 2-D (R, C), got {x.dim()} dimensions "
                                    f"{tuple(x.shape)}")
    if x.dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"{entry}: x must be float32, float16 or bfloat16, not "
                                    f"{x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise UnsupportedInputError(f"{entry}: x has a non-contiguous last dimension (stride "
                                    f"{x.stride(1)}); call .contiguous() first")
    if not _is_fp8(fp8_dtype):
        raise UnsupportedInputError(f"{entry}: fp8_dtype must be torch.float8_e4m3fn or "
                                    f"torch.float8_e5m2, not {fp8_dtype}")
    g = _granularity(granularity, entry)
    for transpose in orientations:
        _check_extents(x, g, transpose, entry)
    return g


def _is_fp8(fp8_dtype) -> bool:
    try:
        return isinstance(fp8_dtype, torch.dtype) and elements.element(fp8_dtype).is_fp8
    except ValueError:  # float8_e4m3fnuz and the like: not in the table
        return False


def _granularity(granularity, entry: str) -> Granularity:
    try:
        return Granularity(granularity)
    except ValueError:
        known = ", ".join(repr(g.value) for g in Granularity)
        raise UnsupportedInputError(f"{entry}: unknown granularity {granularity!r}; known: "
                                    f"{known}") from None


def _check_extents(x, g: Granularity, transpose: bool, entry: str) -> None:
    rows, cols = x.shape[::-1] if transpose else x.shape
    what = "x.t()" if transpose else "x"
    need = {Granularity.BLOCK_1X128: (("columns", cols),),
            Granularity.BLOCK_128X128: (("rows", rows), ("columns", cols))}.get(g, ())
    for name, extent in need:
        if extent % BLOCK_K:
            raise UnsupportedInputError(
                f"{entry}: granularity {g.value!r} needs the {name} of the quantized matrix "
                f"({what}, {tuple((rows, cols))}) to be a multiple of {BLOCK_K}, got {extent}")


# ---------------------------------------------------------------------------------------------
# Torch reference (the CPU rule, and what the kernels are compared with bit for bit)
# ---------------------------------------------------------------------------------------------

def torch_quantize(x: torch.Tensor, granularity, *,
                   fp8_dtype: torch.dtype = torch.float8_e4m3fn, transpose: bool = False):
    """``quantize`` in torch, on any device, no host sync (inputs assumed checked)."""
    g = Granularity(granularity)
    m = (x.detach().t() if transpose else x.detach()).float().contiguous()
    rows, cols = m.shape
    if m.numel() == 0:
        scale = empty_scale(g, rows, cols, m.device).fill_(1.0)
        return torch.empty((rows, cols), dtype=fp8_dtype, device=m.device), scale
    top = fp8_max(fp8_dtype)
    blocks = _blocks(m, g)  # m viewed so that each group's elements share the kept dims
    amax = blocks.abs().amax(dim=_group_dims(g), keepdim=True)
    scale = amax / torch.full((), top, dtype=torch.float32, device=m.device)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (blocks / scale).clamp(-top, top).to(fp8_dtype).view(rows, cols)
    return q, _scale_layout(scale, g, rows, cols)


def _blocks(m: torch.Tensor, g: Granularity) -> torch.Tensor:
    rows, cols = m.shape
    if g is Granularity.BLOCK_1X128:
        return m.view(rows, cols // BLOCK_K, BLOCK_K)
    if g is Granularity.BLOCK_128X128:
        return m.view(rows // BLOCK_K, BLOCK_K, cols // BLOCK_K, BLOCK_K)
    return m


def _group_dims(g: Granularity) -> tuple[int, ...]:
    return {Granularity.TENSOR: (0, 1), Granularity.ROW: (1,), Granularity.BLOCK_1X128: (2,),
            Granularity.BLOCK_128X128: (1, 3)}[g]


def _scale_layout(amax_shaped: torch.Tensor, g: Granularity, rows: int, cols: int):
    """The scales (kept dims of the grouping) in the granularity's shape and layout."""
    out = empty_scale(g, rows, cols, amax_shaped.device)
    out.copy_(amax_shaped.reshape(out.shape))
    return out


__all__ = ["Granularity", "fp8_max", "quantize", "quantize_pair", "torch_quantize"]
