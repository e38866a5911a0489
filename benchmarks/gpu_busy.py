"""How much of a repeated step's wall time the GPU spends running kernels, from a profiler trace.

``busy_share(fn)`` runs ``fn`` several times back to back (as a training loop does: no host wait
between steps) under torch.profiler, between two CUDA events. Busy time is the union of the
kernels' intervals on the device (kernels on two streams that overlap count once), wall time the
events' elapsed time: so the share counts every gap, the launch gaps inside a step, the host
stretches that leave the queue empty, and the wait between steps. A single profiled call after a
sync would miss the last two and run on a rested GPU at its highest clocks.

``breakdown(fn)`` splits the same kind of trace for a distributed step: of each step's wall time,
how much has a compute kernel running, how much only a collective (NCCL's kernels: the
communication nobody hides), and how much nothing; plus the kernels that take the most time.
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


def traced(fn, steps: int, warmup: int) -> tuple[list[tuple[str, float, float]], float]:
    """``fn`` called ``steps`` times back to back (after ``warmup`` calls) under torch.profiler:
    the kernels as (name, start us, end us) and the CUDA events' wall milliseconds a step."""
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
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return kernels, start.elapsed_time(end) / steps


def busy_share(fn, steps: int = 5, warmup: int = 2) -> BusyShare:
    """``fn``'s busy share over ``steps`` calls back to back (after ``warmup`` calls)."""
    kernels, wall = traced(fn, steps, warmup)
    busy = union_ms([(start, end) for _, start, end in kernels])
    return BusyShare(busy / steps, wall, len(kernels) // steps)


def is_collective(kernel: str) -> bool:
    """NCCL's kernels (all-gather, reduce-scatter, all-reduce, ...): the step's communication."""
    return "nccl" in kernel.lower()


def split_ms(kernels: list[tuple[str, float, float]]) -> dict:
    """From (name, start us, end us) of a trace's kernels: the milliseconds covered by any
    kernel (``busy``), by compute kernels (``compute``), by collectives (``collective``), and
    by collectives while no compute kernel runs (``exposed_collective`` = busy - compute)."""
    compute = [(a, b) for name, a, b in kernels if not is_collective(name)]
    collective = [(a, b) for name, a, b in kernels if is_collective(name)]
    busy = union_ms(compute + collective)
    covered = union_ms(compute)
    return {"busy": busy, "compute": covered, "collective": union_ms(collective),
            "exposed_collective": busy - covered}


def top_kernels(kernels: list[tuple[str, float, float]], steps: int, top: int) -> list[dict]:
    """The ``top`` kernels by total time, per step: name (cut to 100 characters), ms, calls."""
    total: dict[str, list] = {}
    for name, start, end in kernels:
        entry = total.setdefault(name, [0.0, 0])
        entry[0] += (end - start) / 1e3
        entry[1] += 1
    ranked = sorted(total.items(), key=lambda item: -item[1][0])[:top]
    return [{"kernel": name[:100], "ms": round(ms / steps, 3), "calls": calls / steps}
            for name, (ms, calls) in ranked]


def breakdown(fn, steps: int = 3, warmup: int = 1, top: int = 8) -> dict:
    """``fn``'s steps back to back under torch.profiler (every rank of a distributed step calls
    it alike, its collectives in step): per step the wall time (CUDA events), the ``split_ms``
    figures, idle = wall - busy, and the ``top`` kernels."""
    kernels, wall = traced(fn, steps, warmup)
    figures = {k: round(v / steps, 3) for k, v in split_ms(kernels).items()}
    return {"wall_ms": round(wall, 3), **{f"{k}_ms": v for k, v in figures.items()},
            "idle_ms": round(wall - figures["busy"], 3),
            "top": top_kernels(kernels, steps, top)}


def busy_row(name: str, measured: BusyShare, correct: bool) -> dict:
    """The row ``gpu busy NAME``, a fraction of a limit (BENCHMARKS.md): ``ours`` the share of
    the wall time the GPU is busy, ``reference`` 1.0 (the wall time), ``ratio`` the share; the
    milliseconds a step in ``detail``."""
    share = round(measured.share, 4)
    return {"case": f"gpu busy {name}", "unit": "fraction of wall time", "ours": share,
            "reference": 1.0, "reference_name": "wall time", "ratio": share,
            "correct": correct, "detail": measured.detail()}
