"""A row's ceiling: the time below which no kernel could run it on this GPU, from the rates this
run measured. ``max(min_bytes / bandwidth, flops / compute rate)`` takes both rates as the
highest the run saw anywhere (the device probes and every timed kernel, ours and the
references), so a ceiling is never slower than a kernel that was timed, and it assumes perfect
overlap of memory and math, which no real kernel reaches. A benchmark's ``ceiling_geomean`` is
the ratio to its reference that a kernel running at the ceiling on every row would score: the
most any kernel could show there, measured rather than taken from a data sheet.
"""

from __future__ import annotations

import dataclasses
import statistics


@dataclasses.dataclass(frozen=True)
class Rates:
    bandwidth_gbs: float  # bytes moved per second, in GB/s
    tflops: float

    def ceiling_ms(self, min_bytes: int, flops: int) -> float:
        return max(min_bytes / self.bandwidth_gbs / 1e6, flops / self.tflops / 1e9)


def grouped_gemm_bytes(counts: list[int], n: int, k: int, itemsize: int = 2) -> int:
    """The least a grouped GEMM y = x W^T per expert must move: each expert's weight that has
    rows read once (an expert with none needs no read), x read once, y written once."""
    rows = sum(counts)
    busy = sum(1 for c in counts if c)
    return itemsize * (busy * n * k + rows * k + rows * n)


def run_rates(rows: list[dict], probe_gbs: list[float]) -> Rates:
    """The highest bandwidth and compute rate this run measured: the probes', and every timed
    kernel's on every row (``detail``'s ``min_bytes`` and ``flops`` over each ``*_ms``)."""
    bandwidth, tflops = max(probe_gbs), 0.0
    for row in rows:
        detail = row["detail"]
        for key in ("ours_ms", "reference_ms", "dense_same_flops_ms"):
            ms = detail.get(key)
            if not ms:
                continue
            tflops = max(tflops, detail["flops"] / ms / 1e9)
            if key != "dense_same_flops_ms":  # the dense proxy moves fewer bytes than the row
                bandwidth = max(bandwidth, detail["min_bytes"] / ms / 1e6)
    if tflops <= 0:
        raise ValueError("no timed row carries flops and a time: nothing to take a rate from")
    return Rates(bandwidth_gbs=bandwidth, tflops=tflops)


def annotate(rows: list[dict], rates: Rates) -> dict:
    """Put each row's ``ceiling_ms`` and the fractions of it that ours and the reference reach in
    its ``detail``; return the run's summary: the rates, ``ceiling_geomean`` (reference time over
    ceiling) and ``ours_of_ceiling_geomean`` (ceiling over our time)."""
    if not rows:
        raise ValueError("no rows to put a ceiling on")
    best, ours = [], []
    for row in rows:
        detail = row["detail"]
        ceiling = rates.ceiling_ms(detail["min_bytes"], detail["flops"])
        detail["ceiling_ms"] = ceiling
        detail["ours_of_ceiling"] = round(ceiling / detail["ours_ms"], 4)
        detail["reference_of_ceiling"] = round(ceiling / detail["reference_ms"], 4)
        best.append(detail["reference_ms"] / ceiling)
        ours.append(ceiling / detail["ours_ms"])
    return {"ceiling_rates": dataclasses.asdict(rates),
            "ceiling_geomean": round(statistics.geometric_mean(best), 4),
            "ours_of_ceiling_geomean": round(statistics.geometric_mean(ours), 4)}
