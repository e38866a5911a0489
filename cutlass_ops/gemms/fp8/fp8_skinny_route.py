"""The few-rows FP8 kernel (``custom_kernels.fp8.fp8_skinny``) as a backend of ``scaled_mm``: which
scaled problems it takes, its candidates beside the CUTLASS kernels in a tune, whether a tuned
winner can run without a compile, and its launch on one call's tensors.

Its configs (``SkinnyConfig``, ``skinny-m16-s4-p6``) are tuned, stored and dispatched as the
CuTe DSL's are: a tuning entry's winner ``{"backend": "skinny", "name": ...}``, validated when
the store is read (``operands_refusal``: only scaled FP8 problems of K-major operands, M <= 128,
N and K multiples of 128, on an sm90 GPU). The kernel compiles with NVRTC in about 5 s, once per
build (recipe, element types, output type, bias, rows, stages: the split count is a launch
parameter); the tuner compiles it while verifying, and dispatch runs a winner only when its
cubin is in the cache (``is_built``), never compiling on a call.
"""

from __future__ import annotations

from typing import Any, Callable

from cutlass_ops.gemms.config import DType, GemmProblem, Layout, Scaling
from custom_kernels.fp8 import fp8_skinny
from custom_kernels.fp8.fp8_skinny import SkinnyConfig

BACKEND = fp8_skinny.PREFIX
_OUT_TYPES = (DType.BF16, DType.F32)


def operands_refusal(problem: GemmProblem) -> str | None:
    """Why the kernel cannot compute ``problem`` (None when it can)."""
    ops = problem.operands
    if ops.scaling is Scaling.NONE:
        return "the skinny kernel computes scaled FP8 GEMMs only"
    if ops.layout_a is not Layout.ROW or ops.layout_b is not Layout.COL or \
            ops.layout_c is not Layout.ROW:
        return "the skinny kernel reads K-major A and B and writes a row-major D"
    fp8 = (DType.E4M3, DType.E5M2)
    if ops.element_a not in fp8 or ops.element_b not in fp8:
        return f"operands {ops.element_a.value} x {ops.element_b.value} are not FP8"
    if ops.element_d not in _OUT_TYPES or ops.element_c != ops.element_d:
        return f"the skinny kernel writes bf16 or f32, not {ops.element_d.value}"
    if problem.batch != 1:
        return "the skinny kernel computes one GEMM, not a batch"
    return fp8_skinny.refusal(problem.m, problem.n, problem.k, ops.element_a.value,
                              ops.element_b.value)


def candidates(problem: GemmProblem) -> list[SkinnyConfig]:
    """Its configs worth timing for ``problem`` (none when it refuses the problem)."""
    if operands_refusal(problem) is not None:
        return []
    return fp8_skinny.candidates(problem.m, problem.n, problem.k)


def is_built(problem: GemmProblem, config: SkinnyConfig, device: int, *, bias: bool) -> bool:
    """Whether ``config`` can run ``problem`` on GPU ``device`` without compiling: it takes the
    problem and the cubin of its build (for a call with or without a bias) is in the cache."""
    from custom_kernels import jit

    if operands_refusal(problem) is not None:
        return False
    ops = problem.operands
    defines = fp8_skinny.defines(config, ops.scaling.value, ops.element_a.value,
                                 ops.element_b.value, ops.element_d is DType.F32, bias)
    return jit.cubin_path(fp8_skinny.SOURCE, defines, (fp8_skinny.KERNEL,),
                          jit.device_arch(device)).is_file()


def launcher(config: SkinnyConfig, recipe: str, a, b, scale_a, scale_b, bias,
             out) -> Callable[[], Any]:
    """``launch()`` of one call's tensors into ``out`` (the tuner's and the benchmarks' timed
    call), which returns ``out``."""
    def launch():
        fp8_skinny.run(config, a, b, scale_a, scale_b, recipe, bias, out)
        return out

    return launch


def run(config: SkinnyConfig, recipe: str, a, b, scale_a, scale_b, bias, out_dtype):
    """A call into a new output (dispatch's route)."""
    import torch

    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    fp8_skinny.run(config, a, b, scale_a, scale_b, recipe, bias, out)
    return out


__all__ = ["BACKEND", "SkinnyConfig", "candidates", "is_built", "launcher", "operands_refusal",
           "run"]
