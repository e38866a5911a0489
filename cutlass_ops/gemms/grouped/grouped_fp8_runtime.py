"""Running the FP8 grouped kernels (``grouped_build.GroupedFp8Config``,
``csrc/grouped_fp8_launcher.cu``; issue 53) on torch tensors. Its float32 ground truth is
``cutlass_ops.fp8.scaled_grouped_mm_op.reference`` (the public op's: b as [E, K, N]).

The semantics (the forward of an FP8 mixture-of-experts layer, DeepSeek-V3's recipe):

    out[rows of expert g] = (a[rows of g] * scale_a) @ (b[g] * scale_b[g])^T   in float32, as bf16

with ``a`` [M, K] e4m3 (tokens sorted by expert; ``offs`` [E] int32, cumulative ends, never read
on the host), ``b`` [E, N, K] e4m3 (each expert's weight, K contiguous), ``scale_a`` [M, K/128]
float32 (one scale a token and 128 columns; any strides: the launcher packs each expert's rows
into the layout CUTLASS's mainloop reads, on the device) and ``scale_b`` [E, N/128, K/128] float32
(one a 128x128 block of a weight; stored with N blocks contiguous: ``weight_scale_layout``).
Offsets must not decrease (as ``torch._grouped_mm``'s); offsets past M end at M. A rowwise
kernel (``recipe="rowwise"``) takes torch's rowwise scales instead: ``scale_a`` [M] and
``scale_b`` [E, N], contiguous float32, applied in the epilogue; K and N multiples of 16. It has
been compiled, not run: ``scaled_grouped_mm`` runs one only where a GPU tune stored it as faster
than ``torch._scaled_grouped_mm`` after checking it against the float32 reference.

``cutlass_ops.scaled_grouped_mm`` runs its blockwise calls here
(``cutlass_ops.fp8.scaled_grouped_mm_op.BLOCKWISE_KERNEL``). It builds (``tests/compile``), its
semantics are tested on the CPU, and its GPU tests (``tests/gpu/moe``) compare it with the float32
reference on every routing and both schedules (docs/measurements.md has the runs).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from custom_kernels.core.errors import KernelLaunchError, UnsupportedInputError
from cutlass_ops.gemms.grouped.grouped_build import GroupedFp8Config, build, load_library

ABI_VERSION = 3  # 2: scale_a any strides, packed per expert on the device; 3: rowwise builds
BLOCK = 128  # K (and N for the weights) elements one scale covers
FP8 = torch.float8_e4m3fn


class _Args(ctypes.Structure):
    """CutlassOpsGroupedFp8Args of the launcher (strides in elements)."""

    _fields_ = [("groups", ctypes.c_int32),
                ("m_total", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("offs", ctypes.c_void_p), ("a", ctypes.c_void_p), ("b", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("scale_a", ctypes.c_void_p),
                ("scale_b", ctypes.c_void_p),
                ("scale_a_stride_m", ctypes.c_int64), ("scale_a_stride_k", ctypes.c_int64),
                *((name, ctypes.c_int64) for name in (
                    "a_stride_m", "b_stride_n", "b_stride_group", "d_stride_m")),
                ("sm_count", ctypes.c_int32), ("device", ctypes.c_int32)]


def library(path: Path) -> ctypes.CDLL:
    """The kernel library at ``path``, loaded once, its ABI checked."""
    return load_library(path, "cutlass_ops_grouped_fp8", _Args, ABI_VERSION)


@functools.lru_cache(maxsize=None)
def _loaded(config: GroupedFp8Config) -> ctypes.CDLL:
    """``config``'s library, found in the build cache (or built) once per process: the lookup
    costs more host time than the launch (``grouped_runtime._loaded``)."""
    return library(build(config))


def refusal(a, b, scale_a, scale_b, offs, recipe: str = "blockwise") -> Optional[str]:
    """Why a kernel of ``recipe`` cannot take these operands, or None."""
    if a.dtype != FP8 or b.dtype != FP8:
        return f"the FP8 grouped kernel takes e4m3 operands, not {a.dtype} and {b.dtype}"
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        return f"a [M, K] and b [E, N, K] with one K, not {tuple(a.shape)}, {tuple(b.shape)}"
    experts, n, k = b.shape
    multiple = BLOCK if recipe == "blockwise" else 16
    if n % multiple or k % multiple:
        return f"{recipe}: N and K must be multiples of {multiple}, not {n} and {k}"
    if a.stride(1) != 1 or b.stride(2) != 1:
        return "a's rows and b's rows (each expert's [N, K]) must be K contiguous"
    if offs is None or offs.dtype != torch.int32 or offs.shape != (experts,):
        return f"offs must be int32 of shape ({experts},)"
    m = a.shape[0]
    if recipe == "rowwise":
        if scale_a.dtype != torch.float32 or scale_a.shape != (m,) or not scale_a.is_contiguous():
            return f"rowwise scale_a must be contiguous float32 [{m}]"
        if scale_b.dtype != torch.float32 or scale_b.shape != (experts, n) or \
                not scale_b.is_contiguous():
            return f"rowwise scale_b must be contiguous float32 [{experts}, {n}]"
    else:
        if scale_a.dtype != torch.float32 or scale_a.shape != (m, k // BLOCK):
            return f"scale_a must be float32 [{m}, {k // BLOCK}]"
        if scale_b.dtype != torch.float32 or \
                scale_b.shape != (experts, n // BLOCK, k // BLOCK) or \
                not scale_b.transpose(1, 2).is_contiguous():
            return (f"scale_b must be float32 [{experts}, {n // BLOCK}, {k // BLOCK}] with N "
                    "blocks contiguous (weight_scale_layout)")
    tensors = (a, b, scale_a, scale_b, offs)
    if any(t.device != a.device for t in tensors) or a.device.type != "cuda":
        return "every tensor on one CUDA device"
    return None


def weight_scale_layout(scale_b: torch.Tensor) -> torch.Tensor:
    """``scale_b`` [E, N/128, K/128] in the layout the kernel reads (N blocks contiguous), copied
    only where it is not already."""
    if not scale_b.transpose(1, 2).is_contiguous():
        scale_b = scale_b.transpose(1, 2).contiguous().transpose(1, 2)
    return scale_b


def run(config: GroupedFp8Config, a, b, scale_a, scale_b, offs) -> torch.Tensor:
    """The kernel's product as a new bf16 [M, N] tensor, on torch's current stream."""
    why = refusal(a, b, scale_a, scale_b, offs, config.recipe)
    if why:
        raise UnsupportedInputError(why)
    experts, n, k = b.shape
    out = torch.empty((a.shape[0], n), dtype=torch.bfloat16, device=a.device)
    args = _Args(groups=experts, m_total=a.shape[0], n=n, k=k, offs=offs.data_ptr(),
                 a=a.data_ptr(), b=b.data_ptr(), d=out.data_ptr(),
                 scale_a=scale_a.data_ptr(), scale_b=scale_b.data_ptr(),
                 scale_a_stride_m=scale_a.stride(0),
                 scale_a_stride_k=scale_a.stride(1) if scale_a.dim() == 2 else 0,
                 a_stride_m=a.stride(0), b_stride_n=b.stride(1), b_stride_group=b.stride(0),
                 d_stride_m=out.stride(0),
                 sm_count=torch.cuda.get_device_properties(a.device).multi_processor_count,
                 device=a.device.index)
    lib = _loaded(config)
    size = ctypes.c_size_t(0)
    if lib.cutlass_ops_grouped_fp8_workspace_size(ctypes.byref(args), ctypes.byref(size)):
        raise KernelLaunchError(lib.cutlass_ops_grouped_fp8_last_error().decode())
    workspace = torch.empty(size.value, dtype=torch.uint8, device=a.device)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    status = lib.cutlass_ops_grouped_fp8_run(ctypes.byref(args), workspace.data_ptr(),
                                             size.value, stream)
    if status:
        raise KernelLaunchError(f"{config.name}: "
                                f"{lib.cutlass_ops_grouped_fp8_last_error().decode()}")
    return out
