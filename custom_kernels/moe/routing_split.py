"""Choosing between two grouped GEMM kernels by the routing's skew, on the device
(``csrc/routing_split.cu``).

``split_by_skew(offs, skew)`` takes a grouped GEMM's cumulative group ends (int32, one per group,
as ``torch._grouped_mm`` takes them) and returns two offset tensors of the same shape: ``even``
holds ``offs`` and ``uneven`` all zeros when the largest group has at most ``skew`` times the mean
rows, and the other way round when it has more. Launching a kernel tuned for even routing on
``even`` and one tuned for skewed routing on ``uneven`` computes the product once, with the
kernel that suits the routing, without reading the offsets on the host: one launch of one block,
CUDA-graph safe, and the choice is made afresh at every replay. The caller's kernels must write
nothing for all-empty groups (the 2d3d form: groups of rows; ``cutlass_ops.gemms.grouped.skew_dispatch``).

Offsets off a CUDA device take ``reference`` (the CPU rule, ``custom_kernels.core.fallback``).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from custom_kernels import jit
from custom_kernels.core import fallback
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.launch import launch

SOURCE = "routing_split.cu"
KERNEL = "routing_split"
BLOCK = 256


def _check(offs: torch.Tensor, skew: float) -> None:
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise UnsupportedInputError(f"split_by_skew: offs must be a 1-D int32 tensor (the groups' "
                                    f"cumulative ends), got {offs.dtype} of shape "
                                    f"{tuple(offs.shape)}")
    if not (isinstance(skew, (int, float)) and math.isfinite(skew) and skew >= 1):
        raise UnsupportedInputError(f"split_by_skew: skew must be a finite number >= 1 (the "
                                    f"largest group over the mean), got {skew!r}")


def split_by_skew(offs: torch.Tensor, skew: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(even, uneven)``: see the module docstring."""
    _check(offs, skew)
    if fallback.off_cuda({"offs": offs}, "split_by_skew", "routing_split.reference"):
        return reference(offs, skew)
    return split_checked(offs, skew)


def split_checked(offs: torch.Tensor, skew: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``split_by_skew`` for callers that have checked its rules already (a 1-D int32 CUDA
    tensor, ``skew`` finite and at least 1): the skew dispatch's per-call path."""
    offs = offs.contiguous()
    even, uneven = torch.empty_like(offs), torch.empty_like(offs)
    if offs.numel():
        launch(_kernel(offs.device.index), offs, even, uneven, offs.numel(), float(skew),
               grid=1, block=BLOCK, device=offs.device.index)
    return even, uneven


@functools.cache
def _kernel(device: int):
    """The loaded kernel, cached here too (saves get_kernel's key normalisation per call)."""
    return jit.get_kernel(SOURCE, KERNEL, device=device, defines={"BLOCK": BLOCK})


def reference(offs: torch.Tensor, skew: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same split in torch ops (a host sync on a GPU: for tests and the CPU)."""
    sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).clamp_min(0)
    total = float(offs[-1]) if offs.numel() else 0.0
    skewed = offs.numel() > 0 and float(sizes.max()) * offs.numel() > skew * total
    zeros = torch.zeros_like(offs)
    return (zeros, offs.clone()) if skewed else (offs.clone(), zeros)


def compile_routing_split(arch: str = jit.DEFAULT_ARCH) -> Path:
    """The cubin, without a GPU (prebuild, compile-only tests)."""
    return jit.compile_cubin(SOURCE, defines={"BLOCK": BLOCK}, name_expressions=(KERNEL,),
                             arch=arch)


__all__ = ["split_by_skew", "split_checked", "reference", "compile_routing_split"]
