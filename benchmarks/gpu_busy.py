"""How much of a repeated step's wall time the GPU spends running kernels, from a profiler trace.

``busy_share(fn)`` runs ``fn`` several times back to back (as a training loop does: no host wait
between steps) under torch.profiler, between two CUDA events. Busy time is the union of the
kernels' intervals on the device (kernels on two streams that overlap count once), wall time the
events' elapsed time: so the share counts every gap, the launch gaps inside a step, the host
stretches that leave the queue empty, and the wait between steps. A single profiled call after a
sync would miss the last two and run on a rested GPU at its highest clocks.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BusyShare:
    busy_ms: float  # per step: the union of the kernels' intervals
    wall_ms: float  # per step: CUDA events around the steps
    kernels: int  # per step

    @property
    def share(self) -> float:
        return self.busy_ms / self.wall_ms

    def detail(self) -> dict:
        return {"busy_ms_per_step": round(self.busy_ms, 3),
                "wall_ms_per_step": round(self.wall_ms, 3),
                "idle_ms_per_step": round(self.wall_ms - self.busy_ms, 3),
                "kernels_per_step": self.kernels}


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """The length covered by ``intervals`` (start, end) in microseconds, in milliseconds."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered / 1e3


def busy_share(fn, steps: int = 5, warmup: int = 2) -> BusyShare:
    """``fn``'s busy share over ``steps`` calls back to back (after ``warmup`` calls)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = union_ms([(e.time_range.start, e.time_range.end) for e in kernels])
    return BusyShare(busy / steps, start.elapsed_time(end) / steps, len(kernels) // steps)


def busy_row(name: str, measured: BusyShare, correct: bool) -> dict:
    """The row ``gpu busy NAME``, a fraction of a limit (BENCHMARKS.md): ``ours`` the share of
    the wall time the GPU is busy, ``reference`` 1.0 (the wall time), ``ratio`` the share; the
    milliseconds a step in ``detail``."""
    share = round(measured.share, 4)
    return {"case": f"gpu busy {name}", "unit": "fraction of wall time", "ours": share,
            "reference": 1.0, "reference_name": "wall time", "ratio": share,
            "correct": correct, "detail": measured.detail()}
