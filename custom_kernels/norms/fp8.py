"""RMSNorm whose kernel also writes its output in FP8 (quantization where the data
already is): the QKV and gate+up GEMMs of an FP8 decoder block read ``q`` and its scales instead
of quantizing ``y`` in a pass of their own.

``y, q, scale = rms_norm_fp8(x, weight, eps, granularity)`` (``residual=``: ``y, q, scale, h``
with ``h = x + residual``, the new residual stream, as ``rms_norm`` returns ``(y, h)``). ``y`` is
``rms_norm``'s output, the same bits (the same kernel and launch config, ``csrc/norm_fp8.cuh``
adds the FP8 write); ``q`` (``x``'s shape, ``fp8_dtype``, row-major contiguous) and ``scale``
equal ``custom_kernels.fp8.fp8_quant.quantize(y.reshape(-1, hidden), granularity)`` bit for bit:
the rounded ``y`` is what is quantized, so FP8 layers may take either path. Granularities:

- ``"row"``: ``scale`` (rows, 1). The kernel reduces each row's amax of ``|y|`` (one more
  reduction of the row: shuffles, or the block's / cluster's reducer) and then computes ``y``
  again from the row it holds (registers or shared memory) to write ``q``.
- ``"block_1x128"``: ``scale`` (rows, hidden / 128) column-major (``scaled_mm``'s blockwise
  ``scale_a``); ``hidden`` a multiple of 128. One pass: a chunk's 128 values sit in 8 or 16
  consecutive lanes (a few shuffles).

``"tensor"`` (one amax over the whole tensor before any value can be quantized: a grid-wide
reduction, then a second pass) and ``"block_128x128"`` (a weight's layout) are refused: quantize
``y`` with ``fp8_quant.quantize`` for those. ``write_y=False`` skips the 16-bit ``y`` (``None``
comes back), for calls that need no gradient (inference: the FP8 GEMM reads ``q`` alone); with
``write_y=True`` the norm's backward is ``rms_norm``'s (``q`` and ``scale`` carry no gradient).

Inputs as ``rms_norm`` takes them (``custom_kernels.norms.norm_ops``), with ``hidden`` a multiple of
16 (an FP8 GEMM's K). The kernels read 16 bytes an access: rows whose stride or pointer does
not allow it (and a misaligned weight) are copied first. ``config`` overrides the launch config
as in ``rms_norm`` (16-byte vectors only). Tensors off a CUDA device run
``rms_norm_fp8_reference`` (the torch norm, then ``fp8_quant.torch_quantize``).

Read top-down: the launcher, the compile function, the custom op with its fake and autograd,
the public function and its checks, the reference.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from custom_kernels import jit
from custom_kernels.core import elements
from custom_kernels.core.eager import plain_eager
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.fp8.fp8_quant import (Granularity, check_fused_output, empty_scale,
                                      torch_quantize)
from custom_kernels.launch import launch
from custom_kernels.norms import norm_config as nc
from custom_kernels.norms import norm_ops as ops

# The granularities the kernels write, and their codes (csrc/norm_fp8.cuh's NORM_FP8).
MODE_CODES = {Granularity.ROW: 1, Granularity.BLOCK_1X128: 2}


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def fp8_defines(problem: nc.NormProblem, cfg: nc.NormConfig, g: Granularity,
                fp8: str) -> dict:
    """The kernel's -D values: the norm's, with the FP8 output's. The direct kernel's register
    cap (``NORM_MAX_REGS``, 16-lane rows) is dropped: the FP8 write needs more than 32."""
    if cfg.vec != problem.vec:
        raise ValueError(f"norm config {cfg.name}: the FP8 output takes 16-byte vectors "
                         f"(v{problem.vec})")
    defines = cfg.defines(problem)
    defines.pop("NORM_MAX_REGS", None)
    defines.update(NORM_FP8=MODE_CODES[g], NORM_FP8_TYPE=elements.element(fp8).code)
    return defines


@functools.lru_cache(maxsize=None)
def _plan(hidden: int, dtype: str, out_dtype: str, weight_dtype: str, residual: bool,
          g: Granularity, fp8: str, config: Optional[str], device: int) -> ops._NormPlan:
    """The norm's plan for the aligned problem (its tuned config or heuristic, or ``config``),
    compiled with the FP8 output. A tuned config of scalar accesses gives way to the
    heuristic."""
    problem = nc.NormProblem("rms", "fwd", hidden, dtype, out_dtype, weight_dtype, True,
                             residual)
    cfg = ops._choose(problem, config, device)
    if cfg.vec != problem.vec and config is None:
        cfg = nc.heuristic(problem)
    return ops._plan(problem, cfg, device, persistent=cfg.stages > 1,
                     defines=fp8_defines(problem, cfg, g, fp8))


def _launch(x2, weight, res2, y, res_out, rstd, q, scale, eps, out_dtype, g, config) -> None:
    """x2, res2: [rows, hidden] with 16-byte aligned rows; outputs contiguous, y optional (its
    dtype ``out_dtype`` is what is quantized either way)."""
    rows, hidden = x2.shape
    device = x2.device.index
    names = ops._DTYPES
    plan = _plan(hidden, names[x2.dtype], names[out_dtype], names[weight.dtype],
                 res2 is not None, g, elements.element(q.dtype).name, config, device)
    cfg = plan.config
    launch(plan.kernel, x2.data_ptr(), ops._ptr(res2), weight.data_ptr(), 0, ops._ptr(y),
           ops._ptr(res_out), 0, ops._ptr(rstd), np.int64(rows), np.int32(hidden),
           np.int64(x2.stride(0)), np.int64(res2.stride(0) if res2 is not None else 0),
           np.float32(eps), q.data_ptr(), scale.data_ptr(), grid=plan.blocks(rows),
           block=cfg.threads, cluster=cfg.cluster, shared_mem=plan.shared_mem, device=device)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([rows, hidden] or [hidden], unit last stride) when its pointer and row stride
    allow 16-byte accesses, else a contiguous copy (fresh memory: aligned)."""
    vec = 16 // t.element_size()
    strided = t.dim() == 2 and t.shape[0] > 1 and t.stride(0) % vec
    return t.clone(memory_format=torch.contiguous_format) if strided or t.data_ptr() % 16 else t


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_rms_norm_fp8(hidden: int, dtype: str = "bfloat16", granularity: str = "row",
                         fp8: str = "e4m3", *, residual: bool = False,
                         weight_dtype: Optional[str] = None, config: Optional[str] = None,
                         arch: str = jit.DEFAULT_ARCH) -> Path:
    """The cubin ``rms_norm_fp8`` runs for these values (the heuristic's config unless
    ``config`` names one); y in ``dtype``."""
    problem = nc.NormProblem("rms", "fwd", hidden, dtype, dtype, weight_dtype or dtype, True,
                             residual)
    cfg = nc.NormConfig.from_name(config) if config else nc.heuristic(problem)
    g = _granularity(granularity, "compile_rms_norm_fp8")
    fp8_name = elements.element(fp8).name
    return jit.compile_cubin(cfg.source, defines=fp8_defines(problem, cfg, g, fp8_name),
                             name_expressions=(cfg.kernel_name("fwd"),), arch=arch)


# ---------------------------------------------------------------------------------------------
# Custom op: real impl, fake impl and autograd next to each other
# ---------------------------------------------------------------------------------------------

def _fp8_impl(x, weight, residual, eps, out_dtype, g: Granularity, fp8_dtype, write_y: bool,
              config, stats: bool = True):
    """(y or None, new residual or None, rstd or None, q, scale) on a CUDA device."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device) if write_y else None
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) \
        if residual is not None else None
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) if stats else None
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale = empty_scale(g, rows, hidden, x.device)
    if rows:
        res2 = _aligned(ops._rows(residual, hidden)) if residual is not None else None
        _launch(_aligned(ops._rows(x, hidden)), _aligned(weight), res2, y, res_out, rstd, q,
                scale, eps, out_dtype, g, config)
    return y, res_out, rstd, q, scale


def _reference_impl(x, weight, residual, eps, out_dtype, g: Granularity, fp8_dtype,
                    write_y: bool):
    """The op's outputs off a CUDA device: the reference, and rstd."""
    with torch.no_grad():
        y, h, q, scale = _reference(x, weight, eps, g, residual, fp8_dtype, out_dtype, write_y)
        hf = (h if h is not None else x).float()
        rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)
    return y, h, rstd, q, scale


@torch.library.custom_op("custom_kernels::rms_norm_fp8_fwd", mutates_args=())
def rms_norm_fp8_fwd(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor],
                     eps: float, out_dtype: torch.dtype, granularity: str,
                     fp8_dtype: torch.dtype, write_y: bool, config: Optional[str] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor]:
    """(y or an empty tensor, new residual or an empty tensor, rstd, q, scale); off a CUDA
    device, the torch reference."""
    g = _check_fp8(x, granularity, fp8_dtype, "custom_kernels::rms_norm_fp8_fwd")
    impl = _fp8_impl if x.is_cuda else _reference_impl
    args = (x, weight, residual, eps, out_dtype, g, fp8_dtype, write_y)
    y, res_out, rstd, q, scale = impl(*args, config) if x.is_cuda else impl(*args)
    return (ops._or_empty(y, x.new_empty(0, dtype=out_dtype)), ops._or_empty(res_out, x), rstd,
            q, scale)


@rms_norm_fp8_fwd.register_fake
def _(x, weight, residual, eps, out_dtype, granularity, fp8_dtype, write_y, config=None):
    g = _check_fp8(x, granularity, fp8_dtype, "custom_kernels::rms_norm_fp8_fwd")
    hidden = x.shape[-1]
    return (x.new_empty(x.shape if write_y else (0,), dtype=out_dtype),
            x.new_empty(x.shape) if residual is not None else x.new_empty(0),
            x.new_empty(x.shape[:-1], dtype=torch.float32),
            x.new_empty(x.shape, dtype=fp8_dtype),
            empty_scale(g, x.numel() // hidden, hidden, x.device))


def _setup(ctx, inputs, output):
    x, weight, residual, _eps, _out_dtype, _g, _fp8, _write_y, _config = inputs
    _y, res_out, rstd, q, scale = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(res_out if ctx.has_residual else x, weight, rstd)
    ctx.mark_non_differentiable(q, scale)


def _backward(ctx, dy, d_res_out, _d_rstd, _d_q, _d_scale):
    h, weight, rstd = ctx.saved_tensors
    dy = dy if dy is not None and dy.shape == h.shape else torch.zeros_like(h)
    dx, dw = torch.ops.custom_kernels.rms_norm_bwd(
        dy, h, weight, rstd, d_res_out if ctx.has_residual else None, None)
    return dx, dw, (dx if ctx.has_residual else None), None, None, None, None, None, None


torch.library.register_autograd("custom_kernels::rms_norm_fp8_fwd", _backward,
                                setup_context=_setup)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 granularity="row", residual: Optional[torch.Tensor] = None, *,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                 out_dtype: Optional[torch.dtype] = None, write_y: bool = True, config=None):
    """``(y, q, scale)``, or ``(y, q, scale, new_residual)`` with ``residual``: RMSNorm of ``x``
    (after adding ``residual``) and its FP8 quantization at ``granularity`` ("row" or
    "block_1x128"), ``fp8_dtype`` e4m3 or e5m2; see the module docstring. ``write_y=False``:
    ``y`` is None (no gradient then). Tensors off a CUDA device run ``rms_norm_fp8_reference``
    (logged once)."""
    on_cuda = ops._kernel_runs("rms", x, weight, None, residual, out_dtype, config)
    g = _check_fp8(x, granularity, fp8_dtype, "rms_norm_fp8")
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, residual))
    if wants_grad and not write_y:
        raise UnsupportedInputError("rms_norm_fp8: write_y=False writes no differentiable "
                                    "output; call it under torch.no_grad() or keep y")
    out_dtype = out_dtype or x.dtype
    if not on_cuda:
        y, h, q, scale = _reference(x, weight, eps, g, residual, fp8_dtype, out_dtype, write_y)
    elif torch.compiler.is_compiling() or not plain_eager(x, weight, residual):
        y, h, _, q, scale = torch.ops.custom_kernels.rms_norm_fp8_fwd(
            x, weight, residual, float(eps), out_dtype, g.value, fp8_dtype, write_y,
            ops._config_name(config))
        y = y if write_y else None
    elif wants_grad:
        y, h, q, scale = _EagerNormFp8.apply(x, weight, residual, float(eps), out_dtype, g,
                                             fp8_dtype, ops._config_name(config))
    else:
        y, h, _, q, scale = _fp8_impl(x, weight, residual, float(eps), out_dtype, g, fp8_dtype,
                                      write_y, ops._config_name(config), stats=False)
    return (y, q, scale, h) if residual is not None else (y, q, scale)


class _EagerNormFp8(torch.autograd.Function):
    """Eager autograd, calling the launcher directly (as ``ops._EagerNorm``)."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, out_dtype, g, fp8_dtype, config):
        y, res_out, rstd, q, scale = _fp8_impl(x, weight, residual, eps, out_dtype, g,
                                               fp8_dtype, True, config)
        ctx.has_residual = residual is not None
        ctx.save_for_backward(res_out if ctx.has_residual else x, weight, rstd)
        ctx.mark_non_differentiable(q, scale)
        ctx.set_materialize_grads(False)
        return y, res_out, q, scale

    @staticmethod
    def backward(ctx, dy, d_res_out, _d_q, _d_scale):
        h, weight, rstd = ctx.saved_tensors
        dx, dw, _ = ops._bwd_impl("rms", dy if dy is not None else torch.zeros_like(h), h,
                                  weight, None, rstd, d_res_out, None)
        return dx, dw, (dx if ctx.has_residual else None), None, None, None, None, None


def _check_fp8(x, granularity, fp8_dtype, entry: str) -> Granularity:
    """The FP8 output's rules (after the norm's own), on every device."""
    g = _granularity(granularity, entry)
    check_fused_output(entry, g, fp8_dtype, x.shape[-1], "hidden (the last dimension)")
    return g


def _granularity(granularity, entry: str) -> Granularity:
    try:
        g = Granularity(granularity)
    except ValueError:
        g = None
    if g not in MODE_CODES:
        raise UnsupportedInputError(
            f"{entry}: granularity {granularity!r} is not written by the norm kernel (it writes "
            f"'row' and 'block_1x128'); 'tensor' needs the whole tensor's amax before any value "
            f"is quantized: quantize y with custom_kernels.fp8.fp8_quant.quantize instead")
    return g


# ---------------------------------------------------------------------------------------------
# Reference (the CPU rule)
# ---------------------------------------------------------------------------------------------

def _reference(x, weight, eps, g, residual, fp8_dtype, out_dtype, write_y):
    """(y or None, new residual or None, q, scale), y with autograd."""
    out = ops.rms_norm_reference(x, weight, eps, residual, out_dtype)
    y, h = out if residual is not None else (out, None)
    q, scale = torch_quantize(y.detach().reshape(-1, x.shape[-1]), g, fp8_dtype=fp8_dtype)
    return (y if write_y else None), h, q.view(x.shape), scale


def rms_norm_fp8_reference(x, weight, eps=1e-6, granularity="row", residual=None, *,
                           fp8_dtype=torch.float8_e4m3fn, out_dtype=None):
    """``rms_norm_reference`` then ``fp8_quant.torch_quantize`` of its rounded output, returned
    as ``rms_norm_fp8`` returns it."""
    g = _check_fp8(x, granularity, fp8_dtype, "rms_norm_fp8_reference")
    y, h, q, scale = _reference(x, weight, eps, g, residual, fp8_dtype, out_dtype or x.dtype,
                                True)
    return (y, q, scale, h) if residual is not None else (y, q, scale)


__all__ = ["rms_norm_fp8", "rms_norm_fp8_reference", "compile_rms_norm_fp8"]
