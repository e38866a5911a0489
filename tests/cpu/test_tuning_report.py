"""Tests for tuning.report: the PNG throughput and roofline report."""

from __future__ import annotations

import os
import sys

import pytest

from tuning.report import MISSING_MATPLOTLIB, plot_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def gemm_row(m, n, k, tuned, torch):
    element = 2  # bf16 bytes
    return {
        "label": f"{m}x{n}x{k}",
        "flops": 2.0 * m * n * k,
        "bytes": float(element * (m * k + k * n + m * n)),
        "tuned_tflops": tuned,
        "torch_tflops": torch,
    }


ROWS = [
    gemm_row(16, 4096, 4096, 40.0, 35.0),
    gemm_row(4096, 4096, 4096, 700.0, 650.0),
    gemm_row(128, 11008, 4096, None, 300.0),  # not tuned yet: still drawn for torch
]


@pytest.fixture
def out_dir(tmp_path):
    """A directory of its own: tmp_path also holds the test's working directory."""
    directory = tmp_path / "out"
    directory.mkdir()
    return directory


def assert_png(path):
    assert path.is_file()
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_plot_report_writes_a_png_and_nothing_else(out_dir):
    pytest.importorskip("matplotlib")
    target = out_dir / "report.png"
    result = plot_report(ROWS, target, title="H100 bf16", peak_tflops=989.0, bandwidth_gbs=3350.0)
    assert result == target
    assert_png(target)
    assert os.listdir(out_dir) == ["report.png"]  # the temporary file was renamed away


def test_plot_report_without_roofline_limits_accepts_a_str_path(out_dir):
    pytest.importorskip("matplotlib")
    target = out_dir / "report.png"
    result = plot_report(ROWS, str(target), title="no limits")
    assert result == target
    assert_png(target)


def test_plot_report_replaces_an_existing_file(out_dir):
    pytest.importorskip("matplotlib")
    target = out_dir / "report.png"
    target.write_bytes(b"old")
    plot_report(ROWS[:1], target, title="again", peak_tflops=989.0, bandwidth_gbs=3350.0)
    assert_png(target)


def test_plot_report_rejects_no_rows(out_dir):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="at least one row"):
        plot_report([], out_dir / "report.png", title="empty")
    assert os.listdir(out_dir) == []


def test_plot_report_without_matplotlib_says_how_to_install(out_dir, monkeypatch):
    # A None entry in sys.modules makes `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError) as error:
        plot_report(ROWS, out_dir / "report.png", title="no matplotlib")
    assert str(error.value) == MISSING_MATPLOTLIB
    assert "pip install 'cutlass-ops[report]'" in str(error.value)
    assert os.listdir(out_dir) == []
