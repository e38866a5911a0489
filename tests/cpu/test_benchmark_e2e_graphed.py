"""benchmarks/e2e.py's rows of the graphed variants (issue 52): ours graphed against compile,
compile with CUDA graphs and ours ungraphed; a graphed variant that failed is a row saying why
(not correct, no ratio), never a missing row or a crash; the graph's memory row counts its pool."""

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import e2e  # noqa: E402

TOKENS = 4096


def entry(ms, ok=True, peak=10.0):
    check = SimpleNamespace(ok=ok, detail=lambda: {"worst_parameter": "w"})
    return {"ms": ms, "loss": 11.0, "check": check, "peak_gb": peak,
            "memory": {"peak_gb": peak, "forward_peak_gb": None}}


def by_case(rows):
    return {r["case"]: r for r in rows}


def test_graphed_rows_against_each_reference():
    train = {"eager": entry(110.0), "ours": entry(94.0), "compile": entry(102.0),
             e2e.GRAPHED: entry(85.0, peak=20.0), e2e.COMPILE_GRAPHS: entry(98.0)}
    rows = by_case(e2e.train_rows(train, TOKENS))
    for reference, ms in (("compile", 102.0), (e2e.COMPILE_GRAPHS, 98.0), ("ours", 94.0)):
        row = rows[f"train {e2e.GRAPHED} vs {reference}"]
        assert row["correct"] is True
        assert row["ratio"] == round(round(TOKENS / 85.0 * 1e3, 1) / round(TOKENS / ms * 1e3, 1),
                                     4)
    memory = rows[f"peak memory train {e2e.GRAPHED} vs ours"]
    assert memory["ratio"] == 0.5 and memory["correct"] is True


def test_a_graphed_variant_that_failed_is_a_row_saying_why():
    train = {"eager": entry(110.0), "ours": entry(94.0), "compile": entry(102.0),
             e2e.GRAPHED: {"error": "its first train step raised CaptureRefused: a sync"},
             e2e.COMPILE_GRAPHS: entry(98.0)}
    rows = by_case(e2e.train_rows(train, TOKENS))
    row = rows[f"train {e2e.GRAPHED} vs compile"]
    assert row["correct"] is False and row["ratio"] is None
    assert "CaptureRefused" in row["detail"]["missing"]
    assert row["reference"] == round(TOKENS / 102.0 * 1e3, 1)
    assert f"peak memory train {e2e.GRAPHED} vs ours" not in rows


def test_a_failed_prefill_peer_is_a_row_saying_why():
    import torch

    logits = torch.ones(2, 16, 8)
    prefill = {"eager": {"ms": 36.0, "logits": logits}, "ours": {"ms": 31.0, "logits": logits},
               e2e.GRAPHED: {"ms": 28.0, "logits": logits},
               e2e.COMPILE_GRAPHS: {"error": "its prefill raised RuntimeError: boom"}}
    rows = by_case(e2e.prefill_rows(prefill, TOKENS))
    assert rows[f"prefill {e2e.GRAPHED} vs ours"]["correct"] is True
    failed = rows[f"prefill {e2e.GRAPHED} vs {e2e.COMPILE_GRAPHS}"]
    assert failed["correct"] is False and "boom" in failed["detail"]["missing"]
