"""benchmarks/multigpu.py without a GPU: a run keeps the file's rows it does not measure again
(other GPU counts, other modes), each naming the run it came from; the check against the unconverted model on the same mesh, used where the whole batch
does not fit on one GPU."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
pytest.importorskip("transformers")  # benchmarks.e2e builds the model from a transformers config
from benchmarks import common, multigpu  # noqa: E402


def test_rows_of_other_gpu_counts_stay_with_their_run(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    two = {"case": "fsdp2 train converted vs unconverted, 2 GPUs, 4 layers", "ratio": 1.2,
           "detail": {"ours_ms": 1.0}}
    (tmp_path / "multigpu.json").write_text(json.dumps(
        {"gpu": "NVIDIA H100", "versions": {"project": "0.1.0+old"}, "world_size": 2,
         "rows": [two]}))
    kept = multigpu.kept_rows("multigpu", 4, ("fsdp2 train",))
    assert [r["case"] for r in kept] == [two["case"]]
    assert kept[0]["detail"]["run"] == {"gpu": "NVIDIA H100", "versions": {"project":
                                                                         "0.1.0+old"},
                                        "world_size": 2}
    assert kept[0]["detail"]["ours_ms"] == 1.0
    assert multigpu.kept_rows("multigpu", 2, ("fsdp2 train",)) == []
    assert [r["case"] for r in multigpu.kept_rows("multigpu", 2, ("tp train",))] == [two["case"]]
    # written again at 4 GPUs, then read at 2: the 4-GPU rows are the other count now, the
    # 2-GPU row keeps its own run
    four = {"case": "fsdp2 train converted vs unconverted, 4 GPUs, 16 layers", "detail": {}}
    (tmp_path / "multigpu.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "versions": {"project": "0.1.0+new"}, "world_size": 4,
         "rows": kept + [four]}))
    again = multigpu.kept_rows("multigpu", 2, ("fsdp2 train",))
    assert [r["case"] for r in again] == [four["case"]]
    assert again[0]["detail"]["run"]["world_size"] == 4
    # a 4-GPU run of another mode keeps the 4-GPU fsdp2 row, with its run
    tp_run = multigpu.kept_rows("multigpu", 4, ("tp train", "tp prefill"))
    assert [r["case"] for r in tp_run] == [two["case"], four["case"]]
    assert tp_run[1]["detail"]["run"]["versions"] == {"project": "0.1.0+new"}


def test_mesh_checks_compare_the_converted_model_with_the_unconverted_one():
    grads = {"w": torch.ones(4)}
    record = {"ours": {"loss": 2.0, "grads": {"w": torch.ones(4) * 1.01}},
              "unconverted": {"loss": 2.01, "grads": grads}}
    c = multigpu.mesh_checks(record)["ours"]
    assert c["loss"] == 2.0 and c["unconverted_loss"] == 2.01
    assert 0.005 < c["grad_max_relative_error_vs_unconverted"] < 0.02


def test_modes_are_an_argument(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["multigpu.py", "--help"])
    with pytest.raises(SystemExit):
        multigpu.main()
