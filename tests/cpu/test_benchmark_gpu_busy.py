"""benchmarks/gpu_busy.py without a GPU: the union of kernel intervals (overlaps counted once,
gaps not at all) and the row's fields (ratio = busy / wall)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_busy import BusyShare, busy_row, union_ms  # noqa: E402


@pytest.mark.parametrize("intervals, expected_us", [
    ([], 0), ([(0, 10)], 10), ([(0, 10), (20, 30)], 20),  # a gap is not busy
    ([(0, 10), (5, 15)], 15), ([(0, 30), (5, 10)], 30),  # overlaps count once
    ([(20, 30), (0, 10), (8, 12)], 22),  # any order
])
def test_busy_time_is_the_union_of_the_kernels_intervals(intervals, expected_us):
    assert union_ms(intervals) == pytest.approx(expected_us / 1e3)


def test_the_row_is_a_fraction_of_the_wall_time():
    """BENCHMARKS.md: a fraction of a limit has ours = the fraction, reference = 1.0, ratio =
    ours / reference; the milliseconds go in detail."""
    row = busy_row("train ours", BusyShare(busy_ms=86.0, wall_ms=92.0, kernels=443), True)
    assert row["case"] == "gpu busy train ours"
    assert row["ours"] == row["ratio"] == round(86.0 / 92.0, 4)
    assert row["reference"] == 1.0 and row["reference_name"] == "wall time"
    assert row["ratio"] == round(row["ours"] / row["reference"], 4) and row["correct"] is True
    detail = row["detail"]
    assert (detail["busy_ms_per_step"], detail["wall_ms_per_step"]) == (86.0, 92.0)
    assert detail["idle_ms_per_step"] == 6.0 and detail["kernels_per_step"] == 443
