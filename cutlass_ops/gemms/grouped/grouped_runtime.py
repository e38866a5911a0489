"""Running a built grouped GEMM kernel (``grouped_build``) on torch tensors: the C ABI of
``csrc/grouped_launcher.cu`` through ctypes, on torch's current stream, with the workspace from
torch's allocator and the offsets never read on the host.

``run(config, a, b, offs)`` takes the operands of ``cutlass_ops.moe.grouped``'s forms (checked
there) whose layouts are the config's and returns the new output.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from custom_kernels.core import int_limits
from custom_kernels.core.errors import KernelLaunchError, UnsupportedInputError
from cutlass_ops.gemms.grouped.grouped_build import ELEMENTS, GroupedConfig, build, load_library
from custom_kernels.core.elements import element

ABI_VERSION = 1
FORMS = {"2d3d": 0, "2d2d": 1, "3d2d": 2, "3d3d": 3}


class _Args(ctypes.Structure):
    """CutlassOpsGroupedArgs of the launcher (strides in elements)."""

    _fields_ = [("form", ctypes.c_int32), ("groups", ctypes.c_int32),
                ("m", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("offs", ctypes.c_void_p), ("a", ctypes.c_void_p), ("b", ctypes.c_void_p),
                ("d", ctypes.c_void_p),
                *((name, ctypes.c_int64) for name in (
                    "a_stride_m", "a_stride_k", "a_stride_group", "b_stride_k", "b_stride_n",
                    "b_stride_group", "d_stride_m", "d_stride_n", "d_stride_group")),
                ("alpha", ctypes.c_float), ("sm_count", ctypes.c_int32),
                ("device", ctypes.c_int32)]


# The C types the launcher computes in: _Args' own for the group count (int32) and the strides
# (int64), but int32 for m, n and k, which prepare_groups narrows to CUTLASS's int problem shape.
# ctypes and that narrowing would keep only the low bits of a larger value: another problem.
_INTEGER_TYPES = {**int_limits.field_types(_Args), "m": ctypes.c_int32, "n": ctypes.c_int32,
                  "k": ctypes.c_int32}


def integer_refusal(form: str, a: torch.Tensor, b: torch.Tensor,
                    offs: Optional[torch.Tensor]) -> Optional[str]:
    """Why the launcher cannot take this call's group count, extents or strides
    (``_INTEGER_TYPES``), naming the value and the limit; None when they fit."""
    groups, m, n, k = _extents(form, a, b, offs)
    values = {"groups": groups, "m": m, "n": n, "k": k}
    types = dict(_INTEGER_TYPES)
    for name, t in (("a", a), ("b", b)):
        for d, stride in enumerate(t.stride()):
            values[f"{name}'s stride {d}"] = stride
            types[f"{name}'s stride {d}"] = _INTEGER_TYPES[f"{name}_stride_group"]
    return int_limits.misfit(values, types, "the grouped launcher's")


@functools.lru_cache(maxsize=None)
def _loaded(config: GroupedConfig) -> ctypes.CDLL:
    """``config``'s kernel library, found in the build cache (or built) and loaded once per
    process. The lookup (a key over the launcher's source, the artifact's ELF header, its
    sidecar, the trust checks of its directories) cost more host time than the launch, and a
    Qwen3-MoE train step makes dozens of grouped calls (docs/measurements.md has the figures). A failed build raises and is not remembered."""
    return _library(build(config))


def _library(path: Path) -> ctypes.CDLL:
    return load_library(path, "cutlass_ops_grouped", _Args, ABI_VERSION)


def layout(t: torch.Tensor) -> str:
    """``t`` (row-major) or ``n`` (column-major) of a tensor's last two dimensions."""
    return "t" if t.stride(-1) == 1 else "n"


def config_for(a: torch.Tensor, b: torch.Tensor, **options) -> GroupedConfig:
    """The default kernel config for these operands' dtype and layouts."""
    name = element_name(a.dtype)
    if name is None:
        raise UnsupportedInputError(f"grouped GEMM kernels take bf16 or fp16, not {a.dtype}")
    return GroupedConfig(name, layout(a), layout(b), **options)


def element_name(dtype: torch.dtype) -> Optional[str]:
    """The grouped kernels' name of a tensor's element type (``grouped_build.ELEMENTS``), or
    None where no grouped kernel takes it."""
    try:
        name = element(dtype).name
    except ValueError:
        return None
    return name if name in ELEMENTS else None


def group_starts_aligned(form: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether every group's A, B and D start 16 bytes apart whatever the offsets: the grouped
    extent must not be a unit-stride dimension of any operand it cuts (TMA needs 16-byte aligned
    addresses, and the offsets are not read on the host). D is row-major, so the 3d2d form
    (groups along D's columns) never qualifies."""
    step = 16 // a.element_size()
    if form == "2d3d":  # A's and D's rows
        return a.stride(0) % step == 0
    if form == "2d2d":  # A's columns and B's rows
        return a.stride(1) % step == 0 and b.stride(0) % step == 0
    return form == "3d3d"


def check_operands(config: GroupedConfig, a: torch.Tensor, b: torch.Tensor,
                   out: torch.Tensor) -> None:
    """The kernel reads A and B and writes D as the element type and layouts it was compiled
    for, whatever the tensors hold: a mismatch (a tuning entry naming another type's kernel)
    would be a wrong answer, so it is refused here, at the last step before the launch."""
    expected = element(config.element).torch_dtype
    wrong = {name: t.dtype for name, t in (("A", a), ("B", b), ("the output", out))
             if t.dtype != expected}
    if wrong:
        raise UnsupportedInputError(
            f"{config.name} is compiled for {config.element} operands; " +
            ", ".join(f"{name} is {dtype}" for name, dtype in wrong.items()))
    if (layout(a), layout(b)) != (config.layout_a, config.layout_b):
        raise UnsupportedInputError(
            f"{config.name} is compiled for layouts {config.layout_a}{config.layout_b}; A and B "
            f"are {layout(a)}{layout(b)}")


def _extents(form: str, a, b, offs) -> tuple[int, int, int, int]:
    """(groups, m, n, k): the grouped extent as its total."""
    if form == "2d3d":
        return b.shape[0], a.shape[0], b.shape[-1], a.shape[1]
    if form == "2d2d":
        return offs.shape[0], a.shape[0], b.shape[1], a.shape[1]
    if form == "3d2d":
        return a.shape[0], a.shape[1], b.shape[1], a.shape[2]
    return a.shape[0], a.shape[1], b.shape[2], a.shape[2]


def run(config: GroupedConfig, form: str, a: torch.Tensor, b: torch.Tensor,
        offs: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out`` (row-major, the form's shape) = the grouped product, with ``config``'s kernel
    (built now if it is not in the cache). Every group must start at a 16-byte aligned address
    of each operand it cuts: ``group_starts_aligned`` (or offsets that are multiples of 8
    elements, which only the caller can know). Raises KernelLaunchError with the launcher's
    text."""
    check_operands(config, a, b, out)
    library = _loaded(config)
    groups, m, n, k = _extents(form, a, b, offs)
    device = a.device.index
    args = _Args(form=FORMS[form], groups=groups, m=m, n=n, k=k,
                 offs=offs.data_ptr() if offs is not None else None,
                 a=a.data_ptr(), b=b.data_ptr(), d=out.data_ptr(),
                 a_stride_m=a.stride(-2), a_stride_k=a.stride(-1),
                 a_stride_group=a.stride(0) if a.dim() == 3 else 0,
                 b_stride_k=b.stride(-2), b_stride_n=b.stride(-1),
                 b_stride_group=b.stride(0) if b.dim() == 3 else 0,
                 d_stride_m=out.stride(-2), d_stride_n=out.stride(-1),
                 d_stride_group=out.stride(0) if out.dim() == 3 else 0,
                 alpha=1.0, sm_count=_sm_count(device), device=device)
    size = ctypes.c_size_t(0)
    if library.cutlass_ops_grouped_workspace_size(ctypes.byref(args), ctypes.byref(size)):
        raise KernelLaunchError(library.cutlass_ops_grouped_last_error().decode())
    workspace = torch.empty(size.value, dtype=torch.uint8, device=a.device)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    status = library.cutlass_ops_grouped_run(ctypes.byref(args), workspace.data_ptr(),
                                             size.value, stream)
    if status:
        raise KernelLaunchError(f"{config.name}: "
                                f"{library.cutlass_ops_grouped_last_error().decode()}")
    return out


def launch(config, form: str, a: torch.Tensor, b: torch.Tensor,
           offs: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``run`` for a C++ ``GroupedConfig``, ``dsl_grouped.run`` for a DSL config, both kernels
    of a ``skew_dispatch.SkewDispatch``: a tuned winner (``grouped_entries.tuned_config``)."""
    from cutlass_ops.gemms.grouped import dsl_grouped, skew_dispatch

    if skew_dispatch.is_skew_dispatch(config):
        return skew_dispatch.launch(config, launch, form, a, b, offs, out)
    if dsl_grouped.is_dsl(config):
        return dsl_grouped.run(config, form, a, b, offs, out)
    return run(config, form, a, b, offs, out)


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


__all__ = ["run", "launch", "check_operands", "config_for", "layout", "group_starts_aligned",
           "FORMS"]
