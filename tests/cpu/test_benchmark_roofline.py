"""The benchmarks' ceiling per row (benchmarks/roofline.py): bytes and FLOPs over the run's
highest measured rates, never slower than a kernel the run timed."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import roofline  # noqa: E402


def row(ours_ms, reference_ms, flops, min_bytes, dense_ms=None):
    return {"case": "grouped x", "detail": {"ours_ms": ours_ms, "reference_ms": reference_ms,
                                            "dense_same_flops_ms": dense_ms, "flops": flops,
                                            "min_bytes": min_bytes}}


def test_grouped_bytes_read_each_busy_experts_weight_once_and_skip_empty_experts():
    # 3 experts, one empty: two weights of 4x8, x of 5x8 read, y of 5x4 written, 2 bytes each
    assert roofline.grouped_gemm_bytes([2, 0, 3], n=4, k=8) == 2 * (2 * 32 + 5 * 8 + 5 * 4)
    assert roofline.grouped_gemm_bytes([0, 0], n=4, k=8) == 0


def test_the_ceiling_is_the_longer_of_the_memory_and_the_math_time():
    rates = roofline.Rates(bandwidth_gbs=1000.0, tflops=500.0)
    assert rates.ceiling_ms(min_bytes=2_000_000_000, flops=1) == pytest.approx(2.0)
    assert rates.ceiling_ms(min_bytes=1, flops=1_000_000_000_000) == pytest.approx(2.0)
    assert rates.ceiling_ms(min_bytes=10**9, flops=10**12) == pytest.approx(2.0)


def test_rates_are_the_highest_the_run_measured_and_the_dense_proxy_sets_no_bandwidth():
    rows = [row(ours_ms=2.0, reference_ms=4.0, flops=10**12, min_bytes=10**9, dense_ms=1.0),
            row(ours_ms=1.0, reference_ms=1.0, flops=10**9, min_bytes=4 * 10**9)]
    rates = roofline.run_rates(rows, probe_gbs=[3000.0, 3500.0])
    assert rates.tflops == pytest.approx(1000.0)  # the dense proxy's 1e12 FLOPs in 1 ms
    assert rates.bandwidth_gbs == pytest.approx(4000.0)  # row 2: 4 GB in 1 ms beats the probes
    # a probe above every kernel sets the bandwidth
    assert roofline.run_rates(rows, probe_gbs=[9000.0]).bandwidth_gbs == 9000.0


def test_a_ceiling_is_never_slower_than_a_timed_kernel_and_the_summary_is_its_geomean():
    rows = [row(2.0, 4.0, 10**12, 10**9), row(1.0, 1.5, 10**9, 4 * 10**9),
            row(3.0, 2.5, 2 * 10**12, 6 * 10**9)]
    summary = roofline.annotate(rows, roofline.run_rates(rows, probe_gbs=[1000.0]))
    for r in rows:
        d = r["detail"]
        assert d["ceiling_ms"] <= min(d["ours_ms"], d["reference_ms"]) + 1e-12
        assert 0 < d["ours_of_ceiling"] <= 1 and 0 < d["reference_of_ceiling"] <= 1
    best = [r["detail"]["reference_ms"] / r["detail"]["ceiling_ms"] for r in rows]
    assert summary["ceiling_geomean"] == pytest.approx(math.prod(best) ** (1 / 3), abs=1e-4)
    assert summary["ceiling_rates"]["tflops"] == pytest.approx(2 * 10**12 / 2.5 / 1e9)


def test_no_rows_or_no_timed_flops_is_an_error_not_a_ceiling():
    with pytest.raises(ValueError, match="no rows"):
        roofline.annotate([], roofline.Rates(1.0, 1.0))
    with pytest.raises(ValueError, match="no timed row"):
        roofline.run_rates([row(None, None, 10**9, 10**9)], probe_gbs=[1000.0])
