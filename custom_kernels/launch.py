"""Launching a ``cuda.core.Kernel`` on torch's current stream, with as little Python as possible.

Arguments go to the kernel as cuda.core packs them: a Python ``int`` becomes a 64-bit integer
(so pass pointers as ``tensor.data_ptr()``), a Python ``float`` a ``double`` and a ``bool`` a
``bool``. Anything else must already have the kernel parameter's C type: pass ``int`` and
``float`` parameters as ``numpy.int32(n)`` / ``numpy.float32(eps)`` (``numpy.int64`` for
``long long``). A torch tensor passed directly is turned into its ``data_ptr()``.

The stream is torch's current stream on ``device`` (torch's current device when None; launchers
pass the tensors' device): the cuda.core ``Stream`` wrapper is cached per raw handle, so a launch
costs the handle lookup, one dict lookup, a ``LaunchConfig`` and ``cuda.core.launch`` (3.4 us).
"""

from __future__ import annotations

import functools

import torch

_streams: dict = {}


def launch(kernel, *args, grid, block, shared_mem: int = 0, cluster=None, stream=None,
           device: int | None = None) -> None:
    """``kernel<<<grid, block, shared_mem, stream>>>(*args)``, with a thread block cluster of
    ``cluster`` blocks when given (``grid`` then counts blocks, as in CUDA C++; it must be a
    multiple of the cluster). ``stream``: a raw ``cudaStream_t`` handle (int), an object with
    ``__cuda_stream__`` or a ``torch.cuda.Stream``; torch's current stream when None."""
    from cuda.core import LaunchConfig
    from cuda.core import launch as cuda_launch

    args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    current = torch.cuda.current_device()
    if device is None:
        device = current
    if stream is None:
        handle = _current_stream(device)
    elif isinstance(stream, int):
        handle = stream
    elif isinstance(stream, torch.cuda.Stream):
        handle = stream.cuda_stream
    else:
        handle = stream.__cuda_stream__()[1]
    if cluster is not None and cluster > 1:
        grid = _cluster_grid(grid, cluster)
        config = LaunchConfig(grid=grid, block=block, shmem_size=shared_mem, cluster=cluster)
    else:
        config = LaunchConfig(grid=grid, block=block, shmem_size=shared_mem)
    if device != current:
        with torch.cuda.device(device):
            cuda_launch(_stream(handle), config, kernel, *args)
    else:
        cuda_launch(_stream(handle), config, kernel, *args)


def _cluster_grid(grid, cluster: int):
    """cuda.core's LaunchConfig counts clusters in ``grid`` when ``cluster`` is set (1.2.x);
    callers here count blocks as CUDA C++ does."""
    x = grid if isinstance(grid, int) else grid[0]
    if x % cluster:
        raise ValueError(f"grid {grid} is not a multiple of the cluster size {cluster}")
    if isinstance(grid, int):
        return x // cluster
    return (x // cluster, *grid[1:])


def _current_stream(index: int) -> int:
    """torch's current stream as a raw handle; the private call avoids building a Stream."""
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


def max_active_blocks_per_sm(kernel, block: int, shared_mem: int = 0) -> int:
    """How many blocks of ``block`` threads using ``shared_mem`` dynamic bytes fit on one SM."""
    return kernel.occupancy.max_active_blocks_per_multiprocessor(block, shared_mem)


@functools.cache
def sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
