"""benchmarks/gpu_busy.py without a GPU: the union of kernel intervals (overlaps counted once,
gaps not at all), the row's fields (ratio = busy / wall), and a distributed step's split into
compute, collectives and the collectives no compute hides."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_busy import (BusyShare, busy_row, is_collective, split_ms,  # noqa: E402
                                 top_kernels, union_ms)


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


def test_a_step_splits_into_compute_and_the_collectives_nothing_hides():
    """An all-gather half under a GEMM (hidden for 5 us), a reduce-scatter alone at the end
    (exposed for 10 us), and a gap: busy 35, compute 20, collective 20, exposed 15 (us)."""
    kernels = [("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgs)", 0, 10),
               ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 5, 20),
               ("norm_fwd_staged", 20, 25),
               ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 30, 40)]
    assert is_collective(kernels[0][0]) and not is_collective(kernels[1][0])
    got = split_ms(kernels)
    assert got == pytest.approx({"busy": 0.035, "compute": 0.020, "collective": 0.020,
                                 "exposed_collective": 0.015})
    top = top_kernels(kernels * 2, steps=2, top=2)  # two steps: per-step figures
    assert [t["kernel"][:12] for t in top] == ["nvjet_sm90_t", "ncclDevKerne"]
    assert top[0]["ms"] == pytest.approx(0.015) and top[0]["calls"] == 1
