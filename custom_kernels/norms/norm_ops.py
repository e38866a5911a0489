"""Fused RMSNorm and LayerNorm (``csrc/norms.cu``), forward and backward, with an optional fused
residual add (pre-norm: ``h = x + residual; y = norm(h); return y, h``).

Read top-down: the launchers, the tensor-free compile function, the custom ops with their fake
impls and autograd, the public functions, then the reference implementations.

Inputs: ``x`` of float32, float16 or bfloat16, any shape ``[..., hidden]`` with a contiguous last
dimension (other strides are fine: rows with a uniform stride are read in place, anything else is
copied), 1 <= hidden <= 262144, any number of rows. ``weight`` (and ``bias``) of shape
``[hidden]`` with ``x``'s dtype or float32 (a float32 weight with a bf16/fp16 input is the usual
mixed-precision layout; any other mix is refused). ``residual`` has ``x``'s shape and dtype; the
returned new residual ``h`` has ``x``'s dtype (rounded from the fp32 sum, exactly the value the
norm reads). ``out_dtype`` (default ``x.dtype``) is the dtype of ``y``. Statistics are fp32; the
fp32 ``rstd`` (and ``mean``) per row are saved for the backward pass, which returns dx (also the
gradient of ``residual``, with the gradient of the new residual added), dweight and dbias.

Everything runs on torch's current stream with memory from torch's allocator and no host sync,
so the ops work eagerly, under ``torch.compile(fullgraph=True)`` and inside CUDA graphs.

The inputs are checked once per call, by ``refusal`` (``why_unsupported``, remembered per input
signature), for the public functions and the modules alike; input the kernels refuse raises
UnsupportedInputError naming the problem. Tensors off a CUDA device run the references below
(the CPU rule, ``custom_kernels.core.fallback``), unless a ``config`` names a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Optional

import numpy as np
import torch

from custom_kernels import host_ops, jit
from custom_kernels.parallel import sharding_rules
from custom_kernels.norms import norm_config as nc
from custom_kernels.norms.tuned import tuned_config
from custom_kernels.launch import (allow_large_clusters, launch, max_active_blocks_per_sm,
                                   max_active_clusters, set_max_dynamic_shared, sm_count)
from custom_kernels.core import fallback
from custom_kernels.core.eager import PLAIN, plain_eager
from custom_kernels.core.elements import FLOATS
from custom_kernels.core.errors import UnsupportedInputError

_log = logging.getLogger(__name__)
_DTYPES = {e.torch_dtype: e.torch_name for e in FLOATS}  # torch dtype -> the norms' key


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def _launch_fwd(kind, x2, weight, bias, res2, y, res_out, mean, rstd, eps, config):
    rows, hidden = x2.shape
    device = x2.device.index
    aligned = _vector_ok(x2.dtype, hidden, (x2, res2, y, res_out, weight, bias),
                         (x2.stride(0), res2.stride(0) if res2 is not None else 0))
    plan = _fwd_plan(kind, hidden, _DTYPES[x2.dtype], _DTYPES[y.dtype], _DTYPES[weight.dtype],
                     aligned, res2 is not None, config, device)
    if config is None:  # the compiled host path takes this signature from the next call on
        host_ops.record_norm(kind, hidden, x2.dtype, y.dtype, weight.dtype, aligned,
                             res2 is not None, device, plan)
    cfg = plan.config
    blocks = plan.blocks(rows)
    launch(plan.kernel, x2.data_ptr(), _ptr(res2), weight.data_ptr(), _ptr(bias), y.data_ptr(),
           _ptr(res_out), _ptr(mean), _ptr(rstd), np.int64(rows), np.int32(hidden),
           np.int64(x2.stride(0)), np.int64(res2.stride(0) if res2 is not None else 0),
           np.float32(eps), grid=blocks, block=cfg.threads, cluster=cfg.cluster,
           shared_mem=plan.shared_mem, device=device)


def _launch_bwd(kind, dy2, h2, weight, mean, rstd, dres2, dx, dw, db, config):
    rows, hidden = h2.shape
    device = h2.device.index
    strides = (h2.stride(0), dy2.stride(0), dres2.stride(0) if dres2 is not None else 0)
    aligned = _vector_ok(h2.dtype, hidden, (dy2, h2, weight, dres2, dx), strides)
    plan = _bwd_plan(kind, hidden, _DTYPES[h2.dtype], _DTYPES[dy2.dtype], _DTYPES[weight.dtype],
                     aligned, dres2 is not None, config, device)
    cfg = plan.config
    blocks = plan.blocks(rows)
    # One partial row per block (a warp per row) or per row unit (a block or a cluster).
    parts = blocks if cfg.warp_per_row else blocks // cfg.cluster
    dw_part = torch.empty((parts, hidden), dtype=torch.float32, device=h2.device)
    db_part = torch.empty((parts, hidden), dtype=torch.float32, device=h2.device) \
        if kind == "ln" else None
    launch(plan.kernel, h2.data_ptr(), dy2.data_ptr(), _ptr(dres2), weight.data_ptr(),
           _ptr(mean), rstd.data_ptr(), dx.data_ptr(), dw_part.data_ptr(), _ptr(db_part),
           np.int64(rows), np.int32(hidden), *(np.int64(s) for s in strides),
           grid=blocks, block=cfg.threads, cluster=cfg.cluster, shared_mem=plan.shared_mem,
           device=device)
    launch(plan.reduce_kernel, dw_part.data_ptr(), dw.data_ptr(), _ptr(db_part), _ptr(db),
           np.int32(parts), np.int32(hidden), grid=(math.ceil(hidden / 32), 2 if db is not None
                                                   else 1), block=1024, device=device)


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _vector_ok(dtype, hidden, tensors, strides) -> bool:
    """The 16-byte vector path: every pointer 16-byte aligned, hidden and the row strides
    multiples of the vector width. Otherwise the scalar kernel runs."""
    vec = 16 // dtype.itemsize
    if hidden % vec or any(s % vec for s in strides):
        return False
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


@dataclasses.dataclass(frozen=True)
class _NormPlan:
    """A compiled kernel and how to launch it for any number of rows. ``persistent``: the grid
    is at most one wave of ``max_units`` row units (blocks of warps, blocks or clusters), each
    walking the rows with a stride; otherwise one unit per row (group of rows)."""
    config: nc.NormConfig
    kernel: object
    persistent: bool
    max_units: int
    shared_mem: int  # dynamic bytes per block
    reduce_kernel: object = None

    def blocks(self, rows: int) -> int:
        cfg = self.config
        units = math.ceil(rows / cfg.rows_per_launch_unit)
        if self.persistent:
            units = min(units, self.max_units)
        return units * cfg.cluster


@functools.lru_cache(maxsize=None)
def _fwd_plan(kind, hidden, dtype, out_dtype, weight_dtype, aligned, residual, config,
              device) -> _NormPlan:
    problem = nc.NormProblem(kind, "fwd", hidden, dtype, out_dtype, weight_dtype, aligned,
                             residual)
    cfg = _choose(problem, config, device)
    # One stage has nothing to prefetch: one row unit per row, and the block scheduler overlaps
    # rows (the direct kernel is never persistent in the forward pass).
    return _plan(problem, cfg, device, persistent=cfg.stages > 1)


@functools.lru_cache(maxsize=None)
def _bwd_plan(kind, hidden, dtype, out_dtype, weight_dtype, aligned, residual, config,
              device) -> _NormPlan:
    problem = nc.NormProblem(kind, "bwd", hidden, dtype, out_dtype, weight_dtype, aligned,
                             residual)
    reduce_kernel = jit.get_kernel(nc.REDUCE_SOURCE, "norm_dw_reduce",
                                   defines=nc.reduce_defines(weight_dtype), device=device)
    # Both backward kernels are persistent (their dW/dB partials are per row unit).
    return dataclasses.replace(_plan(problem, _choose(problem, config, device), device,
                                     persistent=True),
                               reduce_kernel=reduce_kernel)


def _plan(problem: nc.NormProblem, cfg: nc.NormConfig, device: int, persistent: bool,
          defines: Optional[dict] = None) -> _NormPlan:
    """``defines``: in place of ``cfg.defines(problem)`` (the FP8 output's, ``norms.fp8``)."""
    kernel = jit.get_kernel(cfg.source, cfg.kernel_name(problem.direction),
                            defines=defines or cfg.defines(problem), device=device)
    shared_mem = cfg.shared_mem(problem)
    set_max_dynamic_shared(kernel, shared_mem, device)
    if cfg.cluster > 8:
        allow_large_clusters(kernel, device)
    return _NormPlan(cfg, kernel, persistent, _max_units(kernel, cfg, shared_mem, device),
                 shared_mem)


def _tuned(problem: nc.NormProblem, device: int) -> Optional[nc.NormConfig]:
    """The tuned config of ``problem``, if the norm tuner stored one (``tuned``: entries that
    fail their schema were skipped when the file was read). A cache that cannot be read never
    stops a norm: the heuristic runs."""
    if os.environ.get("CUTLASS_OPS_NORM_TUNED", "1") == "0":
        return None
    try:
        return tuned_config(problem, device)
    except OSError as exc:
        _log.warning("norm tuning cache unreadable (%s); using the heuristic", exc)
        return None


def _max_units(kernel, cfg: nc.NormConfig, shared_mem: int, device: int) -> int:
    """Row units that are resident at once: one wave of the persistent grid."""
    if cfg.cluster > 1:
        clusters = max_active_clusters(kernel, cfg.threads, cfg.cluster, shared_mem, device)
        if clusters < 1:
            raise UnsupportedInputError(
                f"norm config {cfg.name}: a cluster of {cfg.cluster} blocks of {cfg.threads} "
                f"threads with {shared_mem} bytes of shared memory does not fit this GPU")
        return clusters
    per_sm = max(1, max_active_blocks_per_sm(kernel, cfg.threads, shared_mem))
    return sm_count(device) * per_sm


def _choose(problem: nc.NormProblem, config: Optional[str], device: int = 0) -> nc.NormConfig:
    """The override when given, else the tuning cache's winner for this problem on this GPU
    (``cutlass-tune norms tune``), else the heuristic. Where the pointers do not allow 16-byte
    accesses, an override runs as the direct kernel with scalar accesses, or as the heuristic's
    choice when that split is not valid for scalars."""
    if config is None:
        return _tuned(problem, device) or nc.heuristic(problem)
    cfg = nc.NormConfig.from_name(config)
    if cfg.vec != 1 and not problem.aligned:
        cfg = dataclasses.replace(cfg, vec=1, stages=0, param_smem=False)
        if cfg.why_invalid(problem):
            return nc.heuristic(problem)
    why = cfg.why_invalid(problem)
    if why:
        raise ValueError(f"norm config {cfg.name} is invalid for {problem}: {why}")
    return cfg


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free: scalars in, cubins on disk; for a process pool or a GPU-less machine)
# ---------------------------------------------------------------------------------------------

def kernel_specs(problem: nc.NormProblem, config: Optional[nc.NormConfig] = None) -> list:
    """(source, name, defines) of every kernel ``problem`` runs."""
    cfg = config or nc.heuristic(problem)
    specs = [(cfg.source, cfg.kernel_name(problem.direction), cfg.defines(problem))]
    if problem.direction == "bwd":
        specs.append((nc.REDUCE_SOURCE, "norm_dw_reduce",
                      nc.reduce_defines(problem.weight_dtype)))
    return specs


def compile_problem(problem: nc.NormProblem, config: Optional[nc.NormConfig] = None,
                    arch: str = jit.DEFAULT_ARCH) -> list:
    """Compiles (or finds cached) the cubins of ``problem``; returns their paths. No GPU."""
    return [jit.compile_cubin(source, defines=defines, name_expressions=(name,), arch=arch)
            for source, name, defines in kernel_specs(problem, config)]


def precompile(problems, workers: int = 8, arch: str = jit.DEFAULT_ARCH) -> None:
    """Compiles the kernels of many problems in parallel processes (before tests/benchmarks);
    raises the first build error."""
    jobs = {_job(spec) for problem in problems for spec in kernel_specs(problem)}
    for error in _compile(jobs, workers, arch).values():
        raise error


def precompile_configs(problem: nc.NormProblem, configs, workers: int = 8,
                       arch: str = jit.DEFAULT_ARCH) -> dict[str, str]:
    """Compiles ``problem``'s kernels for each config in parallel (a tuner's candidates).
    Returns {config name: error} for the configs that failed to build."""
    jobs = {config.name: [_job(spec) for spec in kernel_specs(problem, config)]
            for config in configs}
    errors = _compile({job for config_jobs in jobs.values() for job in config_jobs}, workers,
                      arch)
    return {name: f"build: {type(errors[job]).__name__}: {errors[job]}"[:300]
            for name, config_jobs in jobs.items() for job in config_jobs if job in errors}


def _job(spec) -> tuple:
    source, name, defines = spec
    return source, name, tuple(sorted(defines.items()))


def _compile(jobs, workers: int, arch: str) -> dict[tuple, Exception]:
    """Builds each (source, name, defines) job once, in spawned processes (NVRTC and CUDA state
    stay out of the parent); returns the jobs that failed with their errors."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    errors = {}
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {job: pool.submit(jit.compile_cubin, job[0], defines=dict(job[2]),
                                    name_expressions=(job[1],), arch=arch)
                   for job in sorted(jobs)}
        for job, future in futures.items():
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - the callers decide what a failure means
                errors[job] = exc
    return errors


# ---------------------------------------------------------------------------------------------
# Custom ops: real impl, fake impl and autograd next to each other
# ---------------------------------------------------------------------------------------------

def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """``t`` as [rows, hidden] with a unit last stride (a view when possible)."""
    t2 = t.reshape(-1, hidden)
    return t2 if hidden == 1 or t2.stride(1) == 1 else t2.contiguous()


def _fwd_impl(kind, x, weight, bias, residual, eps, out_dtype, config, stats=True):
    """``stats=False`` (no gradient wanted): the kernel writes no mean / rstd, and None comes
    back for them."""
    hidden = x.shape[-1]
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) \
        if residual is not None else None
    stats_shape = x.shape[:-1]
    rstd = torch.empty(stats_shape, dtype=torch.float32, device=x.device) if stats else None
    mean = torch.empty(stats_shape, dtype=torch.float32, device=x.device) \
        if kind == "ln" and stats else None
    if x.numel():
        _launch_fwd(kind, _rows(x, hidden), weight, bias,
                    _rows(residual, hidden) if residual is not None else None, y,
                    res_out, mean, rstd, eps, config)
    return y, res_out, mean, rstd


def _bwd_impl(kind, dy, h, weight, mean, rstd, d_res_out, config):
    hidden = h.shape[-1]
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    db = torch.empty_like(weight, memory_format=torch.contiguous_format) \
        if kind == "ln" else None
    if h.numel():
        _launch_bwd(kind, _rows(dy, hidden), _rows(h, hidden), weight, mean, rstd,
                    _rows(d_res_out, hidden) if d_res_out is not None else None, dx, dw, db,
                    config)
    else:
        dw.zero_()
        if db is not None:
            db.zero_()
    return dx, dw, db


def _or_empty(t, like):
    """Custom ops return tensors only: an empty one stands for "no new residual"."""
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("custom_kernels::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor],
                 eps: float, out_dtype: torch.dtype, config: Optional[str] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, new residual or an empty tensor, rstd [rows...])."""
    y, res_out, _, rstd = _fwd_impl("rms", x, weight, None, residual, eps, out_dtype, config)
    return y, _or_empty(res_out, x), rstd


@rms_norm_fwd.register_fake
def _(x, weight, residual, eps, out_dtype, config=None):
    return (x.new_empty(x.shape, dtype=out_dtype),
            x.new_empty(x.shape) if residual is not None else x.new_empty(0),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("custom_kernels::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 d_residual_out: Optional[torch.Tensor], config: Optional[str] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight); dx includes ``d_residual_out`` when given."""
    dx, dw, _ = _bwd_impl("rms", dy, h, weight, None, rstd, d_residual_out, config)
    return dx, dw


@rms_norm_bwd.register_fake
def _(dy, h, weight, rstd, d_residual_out, config=None):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


@torch.library.custom_op("custom_kernels::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   residual: Optional[torch.Tensor], eps: float, out_dtype: torch.dtype,
                   config: Optional[str] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, new residual or an empty tensor, mean, rstd)."""
    y, res_out, mean, rstd = _fwd_impl("ln", x, weight, bias, residual, eps, out_dtype, config)
    return y, _or_empty(res_out, x), mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, residual, eps, out_dtype, config=None):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return (x.new_empty(x.shape, dtype=out_dtype),
            x.new_empty(x.shape) if residual is not None else x.new_empty(0),
            stats, torch.empty_like(stats))


@torch.library.custom_op("custom_kernels::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                   rstd: torch.Tensor, d_residual_out: Optional[torch.Tensor],
                   config: Optional[str] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dbias); dx includes ``d_residual_out`` when given."""
    return _bwd_impl("ln", dy, h, weight, mean, rstd, d_residual_out, config)


@layer_norm_bwd.register_fake
def _(dy, h, weight, mean, rstd, d_residual_out, config=None):
    return h.new_empty(h.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output):
    x, weight, residual, _eps, _out_dtype, _config = inputs
    _y, res_out, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(res_out if ctx.has_residual else x, weight, rstd)


def _rms_backward(ctx, dy, d_res_out, _d_rstd):
    h, weight, rstd = ctx.saved_tensors
    dy = dy if dy is not None else torch.zeros_like(h)
    dx, dw = torch.ops.custom_kernels.rms_norm_bwd(
        dy, h, weight, rstd, d_res_out if ctx.has_residual else None, None)
    return dx, dw, (dx if ctx.has_residual else None), None, None, None


def _ln_setup(ctx, inputs, output):
    x, weight, bias, residual, _eps, _out_dtype, _config = inputs
    _y, res_out, mean, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(res_out if ctx.has_residual else x, weight, mean, rstd)


def _ln_backward(ctx, dy, d_res_out, _d_mean, _d_rstd):
    h, weight, mean, rstd = ctx.saved_tensors
    dy = dy if dy is not None else torch.zeros_like(h)
    dx, dw, db = torch.ops.custom_kernels.layer_norm_bwd(
        dy, h, weight, mean, rstd, d_res_out if ctx.has_residual else None, None)
    return dx, dw, db, (dx if ctx.has_residual else None), None, None, None


torch.library.register_autograd("custom_kernels::rms_norm_fwd", _rms_backward,
                                setup_context=_rms_setup)
torch.library.register_autograd("custom_kernels::layer_norm_fwd", _ln_backward,
                                setup_context=_ln_setup)
# DTensor inputs (tensor parallelism) run on each rank's shard: custom_kernels.parallel.sharding_rules.
sharding_rules.register("rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd")


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
             *, config=None):
    """RMSNorm of ``x`` (after adding ``residual`` when given) scaled by ``weight``.
    Returns ``y``, or ``(y, new_residual)`` with a residual. ``config``: a ``NormConfig`` or its
    name, overriding the forward heuristic (the tuner's hook). Tensors off a CUDA device run
    ``rms_norm_reference`` (the CPU rule, ``custom_kernels.core.fallback``)."""
    if config is None and out_dtype in (None, getattr(x, "dtype", None)):
        done = host_norm("rms", x, weight, None, residual, eps)
        if done is not None:
            return done
    if _kernel_runs("rms", x, weight, None, residual, out_dtype, config):
        return _norm("rms", x, weight, None, residual, float(eps), out_dtype or x.dtype,
                     _config_name(config))
    return rms_norm_reference(x, weight, eps, residual, out_dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
               residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
               *, config=None):
    """LayerNorm over the last dimension of ``x`` (after adding ``residual`` when given).
    Returns ``y``, or ``(y, new_residual)`` with a residual. Tensors off a CUDA device run
    ``layer_norm_reference``."""
    if config is None and out_dtype in (None, getattr(x, "dtype", None)) and bias is not None:
        done = host_norm("ln", x, weight, bias, residual, eps)
        if done is not None:
            return done
    if _kernel_runs("ln", x, weight, bias, residual, out_dtype, config):
        return _norm("ln", x, weight, bias, residual, float(eps), out_dtype or x.dtype,
                     _config_name(config))
    return layer_norm_reference(x, weight, bias, eps, residual, out_dtype)


def _kernel_runs(kind, x, weight, bias, residual, out_dtype, config) -> bool:
    """The public functions' rule: True when the kernels take the inputs; False (logged once)
    when the tensors are off a CUDA device and no ``config`` names a kernel, so that the
    reference runs; raises UnsupportedInputError naming the problem otherwise."""
    why = refusal(kind, x, weight, bias, residual, out_dtype)
    if why is None:
        return True
    if config is not None or not isinstance(why, OffCuda):
        raise UnsupportedInputError(why)
    fallback.log_once("custom_kernels.norms uses the torch reference", why)
    return False


def host_norm(kind, x, weight, bias, residual, eps):
    """The compiled host path's call (``custom_kernels.host_ops``): ``y`` (``(y, new residual)``
    with a residual) in x's dtype, or None when that path does not take the call: not loaded
    (yet), traced or non-plain tensors, or inputs it has no record for. Then the Python path
    runs, and records its plan for the next call. ``kind``: "rms" (bias None) or "ln"."""
    if (HOST_NORM.off or weight is None or torch.compiler.is_compiling()
            or not plain_eager(x, weight, bias, residual) or not x.is_cuda):
        return None  # (off CUDA: nothing to launch, and no reason to build the library)
    op = HOST_NORM.op or HOST_NORM.load()
    if op is None:
        return None
    y, res_out = op(0 if kind == "rms" else 1, x, weight, bias, residual, float(eps))
    if y is None:
        return None
    return (y, res_out) if residual is not None else y


HOST_NORM = host_ops.LazyOp("norm")


def _norm(kind, x, weight, bias, residual, eps, out_dtype, config):
    """Under torch.compile (and export), the custom ops: the graph sees them with their fake
    impls. Eagerly, the same kernels without torch's Python custom-op dispatch (it costs more host
    time a call than the launch): directly when no gradient is needed, else through an
    autograd.Function whose backward is the custom ops' backward. (Its callers, the public
    functions and the modules, try the compiled host path, ``host_norm``, before it.)"""
    if torch.compiler.is_compiling() or not plain_eager(x, weight, bias, residual):
        if kind == "rms":
            y, res_out, _ = torch.ops.custom_kernels.rms_norm_fwd(
                x, weight, residual, eps, out_dtype, config)
        else:
            y, res_out, _, _ = torch.ops.custom_kernels.layer_norm_fwd(
                x, weight, bias, residual, eps, out_dtype, config)
        return (y, res_out) if residual is not None else y
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias, residual)):
        return _EagerNorm.apply(kind, x, weight, bias, residual, eps, out_dtype, config)
    y, res_out, _, _ = _fwd_impl(kind, x, weight, bias, residual, eps, out_dtype, config,
                                 stats=False)
    return (y, res_out) if residual is not None else y


class _EagerNorm(torch.autograd.Function):
    """Eager autograd for both norms, calling the kernels' launchers directly."""

    @staticmethod
    def forward(ctx, kind, x, weight, bias, residual, eps, out_dtype, config):
        y, res_out, mean, rstd = _fwd_impl(kind, x, weight, bias, residual, eps, out_dtype,
                                           config)
        ctx.kind = kind
        ctx.has_residual = residual is not None
        ctx.save_for_backward(res_out if ctx.has_residual else x, weight, mean, rstd)
        ctx.set_materialize_grads(False)
        return (y, res_out) if ctx.has_residual else y

    @staticmethod
    def backward(ctx, dy, d_res_out=None):
        h, weight, mean, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h)
        dx, dw, db = _bwd_impl(ctx.kind, dy, h, weight, mean, rstd, d_res_out, None)
        return (None, dx, dw, db, dx if ctx.has_residual else None, None, None, None)


def _config_name(config) -> Optional[str]:
    if config is None or isinstance(config, str):
        return config
    return config.name


def refusal(kind, x, weight, bias, residual, out_dtype) -> Optional[str]:
    """Why the kernels cannot take these inputs, or None: ``why_unsupported``, remembered per
    input signature (devices, dtypes, hidden size and the strides the rules read), so that a
    warm call of the functions or the modules pays one dictionary lookup. Raises
    UnsupportedInputError for tensors on different devices."""
    if _usual_call(kind, x, weight, bias, residual, out_dtype):
        return None
    if torch.compiler.is_compiling():  # symbolic shapes: judged while tracing, at no run cost
        return _judge(kind, x, weight, bias, residual, out_dtype)
    try:
        key = (kind, x.device, x.dtype, x.shape[-1], x.stride(-1), weight.device, weight.dtype,
               weight.shape, weight.stride(), out_dtype,
               None if bias is None else (bias.device, bias.dtype, bias.shape, bias.stride()),
               None if residual is None else (residual.device, residual.dtype,
                                              residual.shape == x.shape, residual.stride(-1)))
    except (AttributeError, IndexError, RuntimeError):  # not tensors, or x has no dimension
        return _judge(kind, x, weight, bias, residual, out_dtype)
    found = _refusals.get(key, _UNJUDGED)
    if found is _UNJUDGED:
        found = _refusals[key] = _judge(kind, x, weight, bias, residual, out_dtype)
    return found


_refusals: dict[tuple, Optional[str]] = {}
_UNJUDGED = object()


def _usual_call(kind, x, weight, bias, residual, out_dtype) -> bool:
    """A fast accept of the usual call, cheaper than building the memo's key: plain CUDA tensors
    on one device, x with a unit last stride, weight (and bias) [hidden] contiguous, of x's
    dtype, no residual, no other output dtype. It accepts a subset of what ``why_unsupported``
    accepts and refuses nothing: anything else goes through the memo."""
    if residual is not None or (out_dtype is not None and out_dtype != x.dtype):
        return False
    if type(x) not in PLAIN or type(weight) not in PLAIN or not x.is_cuda:
        return False
    dtype, shape = x.dtype, x.shape
    if not shape or dtype not in _DTYPES or weight.dtype != dtype or x.stride(-1) != 1:
        return False
    hidden = shape[-1]
    if not 1 < hidden <= nc.MAX_HIDDEN or weight.shape != (hidden,) or weight.stride(0) != 1:
        return False
    if weight.device != x.device:
        return False
    if kind == "ln":
        return (type(bias) in PLAIN and bias.dtype == dtype and bias.shape == (hidden,)
                and bias.stride(0) == 1 and bias.device == x.device)
    return True


class OffCuda(str):
    """A refusal saying only that the tensors are not on a CUDA device: the CPU rule's case."""


def why_unsupported(kind, x, weight, bias, residual, out_dtype) -> Optional[str]:
    """The reason these inputs cannot run on the kernels, or None. Dtypes and shapes are
    judged before devices, so that every other rule can be tested without a GPU."""
    try:
        return _judge(kind, x, weight, bias, residual, out_dtype)
    except UnsupportedInputError as exc:  # tensors on different devices
        return str(exc)


def _judge(kind, x, weight, bias, residual, out_dtype) -> Optional[str]:
    name = "rms_norm" if kind == "rms" else "layer_norm"
    tensors = {"x": x, "weight": weight, "bias": bias, "residual": residual}
    for key, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            return f"{name}: {key} must be a torch.Tensor, got {type(t).__name__}"
    if kind == "ln" and bias is None:
        return "layer_norm: bias is required (pass zeros for a norm without bias)"
    why = _why_dtypes(name, x, weight, bias, residual, out_dtype)
    if why:
        return why
    why = _why_shapes(name, x, weight, bias, residual)
    if why:
        return why
    device = fallback.common_device(tensors, name)
    if device.type != "cuda":
        return OffCuda(f"{name}: the tensors are on {device}, not a CUDA device")
    return None


def _why_dtypes(name, x, weight, bias, residual, out_dtype) -> Optional[str]:
    if x.dtype not in _DTYPES:
        return f"{name}: x has dtype {x.dtype}; supported: float32, float16, bfloat16"
    if out_dtype is not None and out_dtype not in _DTYPES:
        return f"{name}: out_dtype {out_dtype} not supported; use float32, float16 or bfloat16"
    if weight.dtype not in (x.dtype, torch.float32):
        return (f"{name}: mixed dtypes: weight is {weight.dtype} but x is {x.dtype}; the weight "
                f"must have x's dtype or float32")
    if bias is not None and bias.dtype != weight.dtype:
        return f"{name}: mixed dtypes: bias is {bias.dtype} but weight is {weight.dtype}"
    if residual is not None and residual.dtype != x.dtype:
        return f"{name}: mixed dtypes: residual is {residual.dtype} but x is {x.dtype}"
    return None


def _why_shapes(name, x, weight, bias, residual) -> Optional[str]:
    if x.dim() == 0:
        return f"{name}: x must have at least one dimension"
    hidden = x.shape[-1]
    if not nc.MIN_HIDDEN <= hidden <= nc.MAX_HIDDEN:
        return (f"{name}: hidden size (last dimension) {hidden} outside the supported "
                f"{nc.MIN_HIDDEN}..{nc.MAX_HIDDEN}")
    for key, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (hidden,):
            return f"{name}: {key} has shape {tuple(t.shape)}, expected ({hidden},)"
        if t is not None and hidden > 1 and t.stride(0) != 1:
            return f"{name}: {key} must be contiguous (stride {t.stride(0)})"
    if residual is not None and residual.shape != x.shape:
        return f"{name}: residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}"
    for key, t in (("x", x), ("residual", residual)):
        if t is not None and hidden > 1 and t.stride(-1) != 1:
            return (f"{name}: {key} has a non-contiguous last dimension (stride {t.stride(-1)}); "
                    f"call .contiguous() first")
    return None


# ---------------------------------------------------------------------------------------------
# Reference implementations (float32 math; the tests' and benchmarks' ground truth)
# ---------------------------------------------------------------------------------------------

def _residual_add(x, residual):
    if residual is None:
        return x
    return (x.float() + residual.float()).to(x.dtype)


def rms_norm_reference(x, weight, eps=1e-6, residual=None, out_dtype=None):
    h = _residual_add(x, residual)
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    y = y.to(out_dtype or x.dtype)
    return (y, h) if residual is not None else y


def layer_norm_reference(x, weight, bias, eps=1e-5, residual=None, out_dtype=None):
    h = _residual_add(x, residual)
    y = torch.nn.functional.layer_norm(h.float(), (h.shape[-1],), weight.float(), bias.float(),
                                       eps)
    y = y.to(out_dtype or x.dtype)
    return (y, h) if residual is not None else y
