"""Persistent kernels fed by the device-side work queue of ``csrc/work_queue.cuh``.

A persistent kernel launches as many blocks as can run at once (occupancy x SM count, never more
than there are tasks), and each block pulls task indices from an atomic ticket counter until the
queue drains: long and short tasks balance by themselves. The kernel resets its counters before
it ends, so the next launch, or the replay of a CUDA graph that captured it, finds them at zero
without a host round trip or a memset.

Counters: one bank per device, allocated once from torch's allocator and zeroed once, with
``SLOTS`` slots of ``COUNTERS`` unsigned ints. Each stream gets a slot of its own (kernels on one
stream run one after another, so they share it; kernels on two streams may overlap, so they must
not). With more than ``SLOTS`` streams in use, slots are reused round robin.

The tickets are unsigned 32-bit: a launch whose tasks, with the one ticket each consumer draws
past the last task, would pass 2**32 - 1 is refused (``check_tickets``) rather than wrap.

The bank is allocated on first use, which must not happen inside CUDA graph capture (an
allocation there would belong to the graph): run the kernel once before capturing, as the usual
warm-up does. A kernel that faulted midway leaves its slot dirty: ``reset`` zeroes the bank.
"""

from __future__ import annotations

import ctypes
import threading

from custom_kernels.core import int_limits
from custom_kernels.core.errors import CutlassOpsError, UnsupportedInputError
from custom_kernels.core.fallback import require_cuda_arguments

COUNTERS = 4  # ck::kCounters: kMaxPhases tickets, then the done counter
TICKET_TYPE = ctypes.c_uint32  # ck::BlockQueue's and warp_pull's ticket counter
_TICKET_MAX = int_limits.c_range(TICKET_TYPE)[1]
SLOTS = 64

_banks: dict = {}
_slots: dict = {}
_lock = threading.Lock()


def counters(device: int | None = None, stream: int | None = None) -> int:
    """The address of this stream's queue counters on ``device`` (torch's current device and its
    current stream when None): ``COUNTERS`` zeroed unsigned ints to pass to the kernel."""
    import torch

    if device is None:
        device = torch.cuda.current_device()
    if stream is None:
        stream = _current_stream(device)
    key = (device, stream)
    address = _slots.get(key)
    if address is None:
        address = _assign(device, key)
    return address


def _assign(device: int, key) -> int:
    import torch

    with _lock:
        bank = _banks.get(device)
        if bank is None:
            if torch.cuda.is_current_stream_capturing():
                raise CutlassOpsError(
                    "the work-queue counters are allocated on first use, which cannot happen "
                    "during CUDA graph capture: run the kernel once before capturing (warm-up)")
            bank = torch.zeros(SLOTS, COUNTERS, dtype=torch.int32, device=f"cuda:{device}")
            torch.cuda.current_stream(device).synchronize()  # zero before any stream uses it
            _banks[device] = bank
        used = sum(1 for d, _ in _slots if d == device)
        address = bank[used % SLOTS].data_ptr()
        _slots[key] = address
        return address


def zeroed_scratch(tag: str, numel: int, dtype, device: int | None = None,
                   stream: int | None = None):
    """At least ``numel`` zeros of ``dtype`` on ``device``, private to ``tag`` and the stream
    (torch's current one when None), for kernels that leave what they use zeroed when they end
    (as the queue counters). Allocated on first use and when a larger one is needed (the old
    buffer goes back to torch's allocator, ordered on this stream), never in graph capture."""
    import torch

    if device is None:
        device = torch.cuda.current_device()
    if stream is None:
        stream = _current_stream(device)
    key = (tag, device, stream)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        if torch.cuda.is_current_stream_capturing():
            raise CutlassOpsError(
                f"{tag}: a larger zeroed work buffer is needed, which cannot be allocated during "
                "CUDA graph capture: run the kernel once with these shapes before capturing")
        size = max(numel, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0, 1)
        buf = _scratch[key] = torch.zeros(size, dtype=dtype, device=f"cuda:{device}")
    return buf


_scratch: dict = {}


def reset(device: int | None = None) -> None:
    """Zero the counters and zeroed scratch buffers of ``device`` (all devices when None), on the
    current stream, after a kernel that used them faulted."""
    for index, bank in list(_banks.items()):
        if device is None or index == device:
            bank.zero_()
    for (_, index, _), buf in list(_scratch.items()):
        if device is None or index == device:
            buf.zero_()


def persistent_grid(kernel, tasks: int, block: int, shared_mem: int = 0,
                    device: int | None = None) -> int:
    """Blocks for a persistent launch: what can be co-resident, clamped to [1, tasks]."""
    from custom_kernels.cooperative import max_cooperative_grid

    return max(1, min(tasks, max_cooperative_grid(kernel, block, shared_mem, device)))


def check_tickets(tasks: int, grid: int, block: int) -> None:
    """Refuses ``tasks`` that the unsigned ticket counter cannot count: each consumer (a block,
    or a warp of one) draws one ticket past the last task, so the counter reaches at most
    ``tasks`` plus their number, which must fit it (else it would wrap and hand tasks out twice)."""
    drawn = tasks + grid * max(1, block // 32)
    if drawn > _TICKET_MAX:
        raise UnsupportedInputError(
            int_limits.misfit({"tasks + one ticket per consumer": drawn}, TICKET_TYPE,
                              "the work queue's") + "; split the work into several launches")


def launch_persistent(kernel, *args, tasks: int, block: int, shared_mem: int = 0,
                      cooperative: bool = False, device: int | None = None) -> int:
    """Launch ``kernel`` persistently for ``tasks`` tasks on torch's current stream; its arguments
    include the counters (``counters(device)``). Cooperative when asked (the grid is then
    co-resident by construction). Returns the grid size."""
    require_cuda_arguments(args, "launch_persistent")
    grid = persistent_grid(kernel, tasks, block, shared_mem, device)
    check_tickets(tasks, grid, block)
    if cooperative:
        from custom_kernels.cooperative import launch_cooperative

        launch_cooperative(kernel, *args, grid=grid, block=block, shared_mem=shared_mem,
                           device=device)
    else:
        from custom_kernels.launch import launch

        launch(kernel, *args, grid=grid, block=block, shared_mem=shared_mem, device=device)
    return grid


def _current_stream(device: int) -> int:
    from custom_kernels.launch import current_stream_handle  # imports torch: not at import

    return current_stream_handle(device)
