"""Cooperative launch of a ``cuda.core.Kernel``: all blocks co-resident, so that a kernel may call
``cooperative_groups::this_grid().sync()``.

cuda.core 1.2.0's ``LaunchConfig`` has no cooperative flag, so this goes to the driver:
``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_COOPERATIVE``, on torch's current stream (so it is
captured into CUDA graphs like any launch). The kernel handle of a cuda.core Kernel is a
``CUkernel``, which the driver accepts wherever a ``CUfunction`` is launched.

Arguments follow the convention of ``custom_kernels.launch``: a torch tensor is its
``data_ptr()``, a Python ``int`` a 64-bit integer, a ``float`` a ``double``, a ``bool`` a
``bool``, a numpy scalar its own C type; they go to the driver as a ``void*[]`` built with ctypes.

A grid larger than what can be co-resident (occupancy x SM count, ``max_cooperative_grid``) is
refused by the driver; ``launch_cooperative`` raises ``KernelLaunchError`` before that. A device
without cooperative launch raises ``CooperativeLaunchUnsupported``: callers check
``supports_cooperative_launch`` and take a non-cooperative path instead.
"""

from __future__ import annotations

import ctypes
import functools

from custom_kernels.core import int_limits
from custom_kernels.core.errors import CutlassOpsError, KernelLaunchError, UnsupportedInputError
from custom_kernels.core.fallback import require_cuda_arguments


class CooperativeLaunchUnsupported(CutlassOpsError):
    """The device cannot launch cooperative kernels (CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 0)."""


@functools.cache
def supports_cooperative_launch(device: int) -> bool:
    """Whether ``device`` (a torch device index) can launch cooperative kernels."""
    import torch
    from cuda.bindings import driver

    torch.cuda.init()  # the driver (and the primary context) torch uses
    _check(driver.cuInit(0)[0], "cuInit")
    err, dev = driver.cuDeviceGet(device)
    _check(err, "cuDeviceGet")
    err, value = driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, dev)
    _check(err, "cuDeviceGetAttribute")
    return bool(value)


def max_cooperative_grid(kernel, block: int, shared_mem: int = 0, device: int | None = None) -> int:
    """The most blocks of ``block`` threads (``shared_mem`` dynamic bytes each) that can be
    co-resident on ``device``: occupancy per SM x SM count. Memoized per kernel and shape."""
    import torch

    if device is None:
        device = torch.cuda.current_device()
    key = (kernel, block, shared_mem, device)
    grid = _grids.get(key)
    if grid is None:
        from custom_kernels.launch import max_active_blocks_per_sm, sm_count

        grid = _grids[key] = max_active_blocks_per_sm(kernel, block, shared_mem) * sm_count(device)
    return grid


_grids: dict = {}


def launch_cooperative(kernel, *args, grid: int, block: int, shared_mem: int = 0,
                       stream=None, device: int | None = None) -> None:
    """``kernel<<<grid, block, shared_mem, stream>>>(*args)`` as a cooperative launch, on torch's
    current stream of ``device`` (torch's current device when None) unless ``stream`` (a raw
    handle, a ``torch.cuda.Stream`` or an object with ``__cuda_stream__``) is given."""
    import torch
    from cuda.bindings import driver

    require_cuda_arguments(args, "launch_cooperative")
    if device is None:
        device = torch.cuda.current_device()
    if not supports_cooperative_launch(device):
        raise CooperativeLaunchUnsupported(
            f"{torch.cuda.get_device_name(device)} (device {device}) cannot launch cooperative "
            "kernels; use the non-cooperative path")
    limit = max_cooperative_grid(kernel, block, shared_mem, device)
    if not 1 <= grid <= limit:
        raise KernelLaunchError(f"cooperative grid of {grid} blocks: between 1 and {limit} blocks "
                                f"of {block} threads can be co-resident on device {device}")
    config = _config(grid, block, shared_mem, _stream_handle(stream, device))
    params, keep = _pack(args)
    with torch.cuda.device(device):
        err, = driver.cuLaunchKernelEx(config, _function(kernel), ctypes.addressof(params), 0)
    del keep
    _check(err, "cuLaunchKernelEx (cooperative)")


def _config(grid: int, block: int, shared_mem: int, stream: int):
    from cuda.bindings import driver

    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
    attr.value.cooperative = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(stream)
    config.attrs = [attr]
    config.numAttrs = 1
    return config


def _function(kernel):
    """The driver handle of a cuda.core Kernel (a CUkernel; cuda.core builds before 1.0 used a
    CUfunction), as cuLaunchKernelEx accepts it."""
    from cuda.bindings import driver

    handle = kernel.handle
    if isinstance(handle, (driver.CUkernel, driver.CUfunction)):
        return handle
    return driver.CUkernel(int(handle))


def _stream_handle(stream, device: int) -> int:
    import torch

    if stream is None:
        try:
            return torch._C._cuda_getCurrentRawStream(device)
        except AttributeError:
            return torch.cuda.current_stream(device).cuda_stream
    if isinstance(stream, int):
        return stream
    if isinstance(stream, torch.cuda.Stream):
        return stream.cuda_stream
    return stream.__cuda_stream__()[1]


def _pack(args):
    """A ctypes ``void*[]`` pointing at one ctypes value per argument; the values are returned too
    (they must outlive the launch call, which copies them)."""
    values = [_ctype(a) for a in args]
    params = (ctypes.c_void_p * max(len(values), 1))()
    for i, value in enumerate(values):
        params[i] = ctypes.cast(ctypes.pointer(value), ctypes.c_void_p)
    return params, values


_NUMPY_CTYPES = {"int8": ctypes.c_int8, "int16": ctypes.c_int16, "int32": ctypes.c_int32,
                 "int64": ctypes.c_int64, "uint8": ctypes.c_uint8, "uint16": ctypes.c_uint16,
                 "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64,
                 "float32": ctypes.c_float, "float64": ctypes.c_double, "bool": ctypes.c_bool}


# A Python int goes as a signed 64-bit value, or unsigned (an address) where only that holds it;
# ctypes would keep the low 64 bits of anything else, so it is refused (int_limits' check, with
# the bounds inlined: this runs for every argument of every launch).
_INT_LOW, _INT_HIGH = int_limits.c_range(ctypes.c_int64)[0], int_limits.c_range(ctypes.c_uint64)[1]


def _ctype(arg):
    if isinstance(arg, bool):
        return ctypes.c_bool(arg)
    if isinstance(arg, int):
        if not _INT_LOW <= arg <= _INT_HIGH:
            c_type = ctypes.c_int64 if arg < 0 else ctypes.c_uint64
            raise UnsupportedInputError(
                int_limits.misfit({"a kernel argument": arg}, c_type))
        return ctypes.c_int64(arg) if arg < (1 << 63) else ctypes.c_uint64(arg)
    if isinstance(arg, float):
        return ctypes.c_double(arg)
    if hasattr(arg, "data_ptr"):  # a torch tensor
        return ctypes.c_uint64(arg.data_ptr())
    dtype = getattr(arg, "dtype", None)
    if dtype is not None and str(dtype) in _NUMPY_CTYPES:  # a numpy scalar
        return _NUMPY_CTYPES[str(dtype)](arg.item())
    raise TypeError(f"cannot pass {type(arg).__name__} {arg!r} to a kernel: use a tensor, an int "
                    "(64-bit), a float (double), a bool or a numpy scalar")


def _check(err, what: str) -> None:
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise KernelLaunchError(f"{what} failed: {name.decode() if name else err}")
