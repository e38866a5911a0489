"""A PNG report of tuned CUTLASS throughput against torch.matmul (cuBLAS) across GEMM shapes.

Two panels: a grouped bar chart of TFLOP/s per shape, and a roofline placing each shape by its
arithmetic intensity, so it is clear whether a shape is bound by memory or by compute and how close
each implementation gets to that bound. matplotlib is an optional dependency (the ``report`` extra)
and is imported only here, only when a report is drawn.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

MISSING_MATPLOTLIB = "cutlass-tune report needs matplotlib: pip install 'cutlass-ops[report]'"

TUNED_LABEL = "tuned CUTLASS"
TORCH_LABEL = "torch.matmul (cuBLAS)"
TUNED_COLOR = "tab:orange"
TORCH_COLOR = "tab:blue"


def _import_figure() -> Any:
    try:
        import matplotlib

        # Agg renders to files only: reports must work on headless GPU machines.
        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(MISSING_MATPLOTLIB) from error
    return Figure


def _throughput(value: float | None) -> float:
    """A missing or non-positive throughput becomes NaN, which matplotlib leaves undrawn."""
    if value is None or not value > 0:
        return math.nan
    return float(value)


def _draw_bars(axes: Any, rows: list[dict]) -> None:
    positions = range(len(rows))
    width = 0.4
    tuned = [_throughput(row["tuned_tflops"]) for row in rows]
    torch = [_throughput(row["torch_tflops"]) for row in rows]
    axes.bar([p - width / 2 for p in positions], tuned, width, label=TUNED_LABEL, color=TUNED_COLOR)
    axes.bar([p + width / 2 for p in positions], torch, width, label=TORCH_LABEL, color=TORCH_COLOR)
    axes.set_xticks(list(positions))
    axes.set_xticklabels([row["label"] for row in rows], rotation=45, ha="right")
    axes.set_ylabel("TFLOP/s")
    axes.set_title("Throughput per shape")
    axes.grid(axis="y", alpha=0.3)
    axes.legend()


def _arithmetic_intensity(row: dict) -> float:
    return row["flops"] / row["bytes"] if row["bytes"] > 0 else math.nan


def _roofline_curve(
    intensities: list[float], peak_tflops: float, bandwidth_gbs: float
) -> tuple[list[float], list[float]]:
    """min(peak, AI * bandwidth) over a log-spaced range covering the shapes and the ridge point."""
    ridge = peak_tflops * 1e3 / bandwidth_gbs  # FLOP/byte where memory and compute bounds meet
    known = [ai for ai in intensities if ai > 0] + [ridge]
    low, high = math.log10(min(known) / 4), math.log10(max(known) * 4)
    steps = 200
    xs = [10 ** (low + (high - low) * i / steps) for i in range(steps + 1)]
    # GB/s * FLOP/byte = GFLOP/s; divide by 1e3 for TFLOP/s.
    ys = [min(peak_tflops, ai * bandwidth_gbs / 1e3) for ai in xs]
    return xs, ys


def _draw_roofline(
    axes: Any, rows: list[dict], peak_tflops: float | None, bandwidth_gbs: float | None
) -> None:
    intensities = [_arithmetic_intensity(row) for row in rows]
    if peak_tflops and bandwidth_gbs:
        xs, ys = _roofline_curve(intensities, peak_tflops, bandwidth_gbs)
        label = f"roofline ({peak_tflops:g} TFLOP/s, {bandwidth_gbs:g} GB/s)"
        axes.plot(xs, ys, color="gray", linestyle="--", label=label)
    for key, label, color, marker in (
        ("tuned_tflops", TUNED_LABEL, TUNED_COLOR, "o"),
        ("torch_tflops", TORCH_LABEL, TORCH_COLOR, "s"),
    ):
        ys = [_throughput(row[key]) for row in rows]
        axes.scatter(intensities, ys, label=label, color=color, marker=marker, zorder=3)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("arithmetic intensity (FLOP/byte)")
    axes.set_ylabel("TFLOP/s")
    axes.set_title("Roofline")
    axes.grid(which="both", alpha=0.3)
    axes.legend()


def _save_atomically(figure: Any, path: Path) -> None:
    """Write beside the target and rename, so a reader never sees a half-written PNG."""
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=".tmp", dir=path.parent
    )
    try:
        with os.fdopen(descriptor, "wb") as file:
            figure.savefig(file, format="png", dpi=120)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def plot_report(
    rows: list[dict],
    path: str | os.PathLike[str],
    *,
    title: str,
    peak_tflops: float | None = None,
    bandwidth_gbs: float | None = None,
) -> Path:
    """Draw tuned vs cuBLAS TFLOP/s for each row into a PNG at ``path`` and return that path.

    Each row has ``label``, ``flops``, ``bytes``, ``tuned_tflops`` and ``torch_tflops``; a
    throughput of None (not measured) is left out of both panels. The roofline line is drawn only
    when both ``peak_tflops`` and ``bandwidth_gbs`` are given.
    """
    Figure = _import_figure()
    if not rows:
        raise ValueError("plot_report needs at least one row")
    path = Path(path)
    # Figure rather than pyplot: no global figure registry to leak into or to clean up.
    figure = Figure(figsize=(max(10.0, 4.0 + 0.6 * len(rows)), 5.0), layout="constrained")
    bars, roofline = figure.subplots(1, 2)
    _draw_bars(bars, rows)
    _draw_roofline(roofline, rows, peak_tflops, bandwidth_gbs)
    figure.suptitle(title)
    _save_atomically(figure, path)
    return path
