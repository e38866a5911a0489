"""The one timing function of the project, shared by the tuner and benchmarks/.

Protocol of BENCHMARKS.md: warm-up, then each repetition preceded by an L2 flush (a write to a
buffer twice the L2 size, outside the timed region), timed with CUDA events; the median is reported
with the quartiles.

Kernels that run for tens of microseconds need the host to have enqueued them by the time the GPU
finishes the flush before them, or the events time the GPU waiting for Python. Two remedies, for
two uses: ``pad_host`` (a spin kernel before each call) and ``graph`` (each call captured once in a
CUDA graph and replayed). Both remove the host's stalls; the spin also slows long kernels by a few
percent and replays do not, so the tuner times replays (docs/measurements.md, "Timing method").
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    p25_ms: float
    p75_ms: float
    reps: int


_flush_buffers: dict = {}


def _flush_buffer(device):
    import torch

    if device not in _flush_buffers:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
        _flush_buffers[device] = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)
    return _flush_buffers[device]


# What keeps the GPU busy while the host enqueues a timed call (pad_host): about 200 us.
_PAD_CYCLES = 400_000


class GraphCaptureError(RuntimeError):
    """A timed call could not be captured in a CUDA graph (it synchronizes, or allocates outside
    torch, or launches on a stream of its own)."""


def _replay(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (after the caller's warm-up): the returned call replays the
    same kernels with one host-side launch. Outputs ``fn`` allocates live in the graph's pool."""
    import torch

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:  # torch reports capture failures as RuntimeError
        raise GraphCaptureError(f"could not capture the timed call in a CUDA graph: {exc}") \
            from exc
    return graph.replay  # the bound method keeps the graph alive


def do_bench(fn: Callable[[], object], *, warmup: int = 5, reps: int = 50,
             flush_l2: bool = True, pad_host: bool = False, graph: bool = False,
             device=None) -> Timing:
    """Times ``fn`` on the current stream. ``reps`` of at least 20 per BENCHMARKS.md.

    ``pad_host``: before each timed call, the GPU gets a short spin kernel, so the host has
    enqueued the call (and its end event) by the time the GPU reaches it: the events then time
    the GPU work alone. Without it, a call whose Python/launch cost exceeds the GPU work of the
    flush before it is timed with that host cost included (GPU idle between the events). Kernel
    throughput figures (GB/s of memory-bound kernels) use it; host cost is measured apart.

    ``graph``: time replays of ``fn`` captured in a CUDA graph: GPU time without the host's cost
    and without the spin's effect on clocks (see the module docstring). Raises
    ``GraphCaptureError`` when ``fn`` cannot be captured."""
    import torch

    device = device if device is not None else torch.cuda.current_device()
    flush = _flush_buffer(device) if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    if graph:
        fn = _replay(fn)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        if pad_host:
            torch.cuda._sleep(_PAD_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return Timing(statistics.median(times), q[0], q[2], reps)


def do_bench_interleaved(fns: dict, *, warmup: int = 3, reps: int = 50, flush_l2: bool = True,
                         pad_host: bool = False, graph: bool = False, device=None) -> dict:
    """Times several functions fairly: each repetition runs every function once (each after
    its own L2 flush), in an order that rotates, so that clock and power drift over the run
    reach all of them alike. Sequential timing favours whoever runs first on a cool GPU, by as
    much as the differences being measured. ``pad_host`` and ``graph`` as in
    ``do_bench``.
    Returns {key: Timing}."""
    import torch

    device = device if device is not None else torch.cuda.current_device()
    flush = _flush_buffer(device) if flush_l2 else None
    keys = list(fns)
    for _ in range(warmup):
        for key in keys:
            fns[key]()
    torch.cuda.synchronize(device)
    if graph:
        fns = {key: _replay(fns[key]) for key in keys}
    events = {key: [] for key in keys}
    for rep in range(reps):
        shift = rep % len(keys)
        for key in keys[shift:] + keys[:shift]:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            if flush is not None:
                flush.zero_()
            if pad_host:
                torch.cuda._sleep(_PAD_CYCLES)
            start.record()
            fns[key]()
            end.record()
            events[key].append((start, end))
    torch.cuda.synchronize(device)
    out = {}
    for key, pairs in events.items():
        times = sorted(s.elapsed_time(e) for s, e in pairs)
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        out[key] = Timing(statistics.median(times), q[0], q[2], reps)
    return out
