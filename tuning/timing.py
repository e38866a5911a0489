"""The one timing function of the project, shared by the tuner and benchmarks/.

Protocol of BENCHMARKS.md: warm-up, then each repetition preceded by an L2 flush (a write to a
buffer twice the L2 size, outside the timed region), timed with CUDA events; the median is reported
with the quartiles.
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


def do_bench(fn: Callable[[], object], *, warmup: int = 5, reps: int = 50,
             flush_l2: bool = True, device=None) -> Timing:
    """Times ``fn`` on the current stream. ``reps`` of at least 20 per BENCHMARKS.md."""
    import torch

    device = device if device is not None else torch.cuda.current_device()
    flush = _flush_buffer(device) if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return Timing(statistics.median(times), q[0], q[2], reps)
