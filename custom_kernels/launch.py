"""Launching a ``cuda.core.Kernel`` on torch's current stream, with as little Python as possible.

Arguments go to the kernel as cuda.core packs them: a Python ``int`` becomes a 64-bit integer
(so pass pointers as ``tensor.data_ptr()``), a Python ``float`` a ``double`` and a ``bool`` a
``bool``. Anything else must already have the kernel parameter's C type: pass ``int`` and
``float`` parameters as ``numpy.int32(n)`` / ``numpy.float32(eps)`` (``numpy.int64`` for
``long long``). A torch tensor passed directly is turned into its ``data_ptr()``.

The stream is torch's current stream on ``device`` (torch's current device when None; launchers
pass the tensors' device): the cuda.core ``Stream`` wrapper is cached per raw handle and the
``LaunchConfig`` per shape, so a launch costs the handle lookup, two cache lookups and
``cuda.core.launch`` (docs/measurements.md, "Host cost", times each).

cuda.core launches through the driver API, which needs a context current in the calling thread.
torch's own calls bind the device's primary context lazily, so a thread whose first CUDA work is
one of ours has none (the autograd engine's worker thread running a backward that starts with
our kernel: CUDA_ERROR_INVALID_CONTEXT). The first launch in each thread binds it.
"""

from __future__ import annotations

import functools
import threading

import torch

_streams: dict = {}
_thread = threading.local()  # .bound: this thread has a current context (see the docstring)


def launch(kernel, *args, grid, block, shared_mem: int = 0, cluster=None, stream=None,
           device: int | None = None) -> None:
    """``kernel<<<grid, block, shared_mem, stream>>>(*args)``, with a thread block cluster of
    ``cluster`` blocks when given (``grid`` then counts blocks, as in CUDA C++; it must be a
    multiple of the cluster). ``stream``: a raw ``cudaStream_t`` handle (int), an object with
    ``__cuda_stream__`` or a ``torch.cuda.Stream``; torch's current stream when None."""
    from cuda.core import launch as cuda_launch

    args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    current = torch.cuda.current_device()
    if device is None:
        device = current
    if not getattr(_thread, "bound", False):
        _bind_context(current)
    if stream is None:
        handle = current_stream_handle(device)
    elif isinstance(stream, int):
        handle = stream
    elif isinstance(stream, torch.cuda.Stream):
        handle = stream.cuda_stream
    else:
        handle = stream.__cuda_stream__()[1]
    config = _launch_config(grid, block, shared_mem, cluster if cluster and cluster > 1 else 1)
    if device != current:
        with torch.cuda.device(device):
            cuda_launch(_stream(handle), config, kernel, *args)
    else:
        cuda_launch(_stream(handle), config, kernel, *args)


def _bind_context(device: int) -> None:
    """Makes ``device``'s primary context current in this thread unless one already is (torch
    keeps it so from then on when it switches devices)."""
    from cuda.bindings import driver

    err, context = driver.cuCtxGetCurrent()
    if err != driver.CUresult.CUDA_SUCCESS or not int(context):
        from cuda.core import Device

        Device(device).set_current()
    _thread.bound = True


@functools.lru_cache(maxsize=4096)
def _launch_config(grid, block, shared_mem: int, cluster: int):
    """A cached ``LaunchConfig`` (building one costs more than the launch's own Python work).
    Grids are bounded (one wave for the persistent kernels, the row count otherwise), so the
    cache stays small in practice; it is an LRU anyway."""
    from cuda.core import LaunchConfig

    if cluster > 1:
        return LaunchConfig(grid=_cluster_grid(grid, cluster), block=block, shmem_size=shared_mem,
                            cluster=cluster)
    return LaunchConfig(grid=grid, block=block, shmem_size=shared_mem)


def _cluster_grid(grid, cluster: int):
    """cuda.core's LaunchConfig counts clusters in ``grid`` when ``cluster`` is set (1.2.x);
    callers here count blocks as CUDA C++ does."""
    x = grid if isinstance(grid, int) else grid[0]
    if x % cluster:
        raise ValueError(f"grid {grid} is not a multiple of the cluster size {cluster}")
    if isinstance(grid, int):
        return x // cluster
    return (x // cluster, *grid[1:])


def current_stream_handle(index: int) -> int:
    """torch's current stream on device ``index`` as a raw handle; the private call avoids
    building a Stream object each call."""
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:
        return torch.cuda.current_stream(index).cuda_stream



class _Handle:
    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _stream(handle: int):
    stream = _streams.get(handle)
    if stream is None:
        from cuda.core import Device, Stream

        if hasattr(Stream, "from_handle"):
            stream = Stream.from_handle(handle)
        else:
            stream = Device().create_stream(_Handle(handle))
        _streams[handle] = stream
    return stream


def set_max_dynamic_shared(kernel, nbytes: int, device: int) -> None:
    """Lets ``kernel`` take ``nbytes`` of dynamic shared memory (above 48 KB a block must opt
    in, counting static shared memory too: cudaFuncSetAttribute in CUDA C++; cuda.core has no
    setter, so the driver call)."""
    if nbytes <= 0:
        return
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuKernelSetAttribute(attr, nbytes, kernel.handle, driver.CUdevice(device))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot give the kernel {nbytes} bytes of shared memory: {err}")


def allow_large_clusters(kernel, device: int) -> None:
    """Lets ``kernel`` run in clusters of more than 8 blocks (non-portable: Hopper takes 16)."""
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    (err,) = driver.cuKernelSetAttribute(attr, 1, kernel.handle, driver.CUdevice(device))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"clusters of more than 8 blocks are not available: {err}")


def max_active_clusters(kernel, block: int, cluster: int, shared_mem: int, device: int) -> int:
    """How many clusters of ``cluster`` blocks fit on the GPU at once (the GPC layout decides:
    clusters of 8 on 132 SMs leave some SMs idle)."""
    from cuda.core import LaunchConfig

    config = LaunchConfig(grid=1, block=block, shmem_size=shared_mem, cluster=cluster)
    with torch.cuda.device(device):
        stream = _stream(current_stream_handle(device))
        return kernel.occupancy.max_active_clusters(config, stream=stream)


def max_active_blocks_per_sm(kernel, block: int, shared_mem: int = 0) -> int:
    """How many blocks of ``block`` threads using ``shared_mem`` dynamic bytes fit on one SM."""
    return kernel.occupancy.max_active_blocks_per_multiprocessor(block, shared_mem)


@functools.cache
def sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
