"""The benchmarks' front door on a machine without a usable GPU: each script stops at once with
one line saying what it needs (exit code 2, no traceback) instead of compiling kernels first,
and listing the shapes to tune still works."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Hiding every GPU makes this the no-GPU case on any machine, a GPU machine included.
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
# Importing torch takes seconds on a loaded machine; without the check gemm.py spent minutes
# in nvcc before it failed.
TIMEOUT_S = 60


def run_benchmark(script, *args):
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], env=NO_GPU,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("script, args", [("gemm.py", ["--quick"]), ("norms.py", ["--quick"]),
                                          ("reductions.py", ["--quick"]),
                                          ("torch_integration.py", ["--quick"]),
                                          ("host_cost.py", []), ("e2e.py", ["--quick"]),
                                          ("cross_entropy.py", ["--quick"]),
                                          ("sweeps/gemm_configs.py", ["--preset", "small-m"]),
                                          ("sweeps/norm_configs.py", []),
                                          ("sweeps/dsl_gemm.py", ["--quick"]),
                                          ("sweeps/dsl_gemm_space.py", []),
                                          ("sweeps/dsl_grouped_space.py", []),
                                          ("sweeps/skew_dispatch_cost.py", []),
                                          ("moe.py", ["--quick"]),
                                          ("profile_model.py", [])])
def test_without_a_gpu_a_benchmark_stops_at_once_with_one_line(script, args):
    result = run_benchmark(script, *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert Path(script).name in lines[0] and "needs an sm90 CUDA GPU" in lines[0]
    assert result.stdout == ""


def test_moe_refuses_no_dynamic_twins_without_a_tune():
    """The flag changes the tune; without one it would label a cached tune's rows wrongly."""
    result = run_benchmark("moe.py", "--no-dynamic-twins")
    assert result.returncode == 2 and "give --tune too" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, count", [([], 16), (["--quick"], 3)])
def test_print_shapes_needs_no_gpu(args, count):
    result = run_benchmark("gemm.py", "--print-shapes", *args)
    assert result.returncode == 0, result.stderr
    shapes = result.stdout.split()
    assert len(shapes) == count
    assert all(re.fullmatch(r"\d+x\d+x\d+", shape) for shape in shapes)


def test_e2e_sections_keep_the_other_sections_rows_of_the_same_model(tmp_path, monkeypatch):
    import json

    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks import common, e2e

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "versions", lambda: {"project": "0.1.0+abc"})
    meta = {"layers": 8, "tokens": 4096}
    rows = [{"case": c} for c in ("train ours vs eager", "peak memory train ours vs eager",
                                  "gpu busy train ours", "prefill ours vs eager",
                                  "decode batch 1 ours vs eager")]
    (tmp_path / "e2e.json").write_text(json.dumps(
        {"versions": {"project": "0.1.0+abc"}, **meta, "rows": rows}))
    kept = e2e.kept_rows("e2e", meta, {"prefill", "decode"})
    assert [r["case"] for r in kept] == ["train ours vs eager", "peak memory train ours vs eager",
                                         "gpu busy train ours"]
    assert e2e.kept_rows("e2e", meta, set(e2e.SECTIONS)) == []
    assert e2e.kept_rows("e2e", {**meta, "layers": 2}, {"train"}) == []  # another model
    assert all("run" not in r.get("detail", {}) for r in kept)  # this code's own rows
    monkeypatch.setattr(common, "versions", lambda: {"project": "0.1.0+def"})
    other = e2e.kept_rows("e2e", {**meta, "converted": 85}, {"train"})  # other code: labelled
    assert [r["case"] for r in other] == ["prefill ours vs eager", "decode batch 1 ours vs eager"]
    assert all(r["detail"]["run"]["versions"]["project"] == "0.1.0+abc" for r in other)
    assert e2e.kept_rows("missing", meta, {"train"}) == []


def test_e2e_full_run_carries_the_two_layer_run_of_the_same_code(tmp_path, monkeypatch):
    import json

    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks import common, e2e

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "versions", lambda: {"project": "0.1.0+abc"})
    assert e2e.two_layer_run() is None  # no quick run yet
    row = {"case": "train ours vs eager", "ours": 2.0, "reference": 1.0, "ratio": 2.0,
           "correct": True, "detail": {"ours_ms": 1.0}}
    (tmp_path / "e2e_quick.json").write_text(json.dumps(
        {"versions": {"project": "0.1.0+abc"}, "layers": 2, "tokens": 1024, "new_tokens": 32,
         "rows": [row]}))
    carried = e2e.two_layer_run()
    assert carried["layers"] == 2 and carried["rows"] == [
        {k: row[k] for k in ("case", "ours", "reference", "ratio", "correct")}]
    monkeypatch.setattr(common, "versions", lambda: {"project": "0.1.0+def"})
    assert e2e.two_layer_run() is None  # another code's run


@pytest.mark.parametrize("routing", ["uniform", "zipf"])
def test_moe_routing_counts_sum_to_the_rows_and_zipf_is_skewed(routing):
    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks import moe

    counts = moe.expert_counts(16384 * 8, 256, routing)
    assert sum(counts) == 16384 * 8 and len(counts) == 256
    spread = max(counts) / (sum(counts) / len(counts))
    assert spread < 1.01 if routing == "uniform" else spread > 20


def test_gemm_tuned_rows_say_kernel_or_whole_call_and_summarize_each_apart():
    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks import gemm

    kernel = gemm.labelled({"case": "bf16 M=16 N=4096 K=4096", "ratio": 1.08}, gemm.KERNEL)
    assert kernel["case"] == "bf16 M=16 N=4096 K=4096, kernel"
    # 2*16*4096*4096 FLOP in 0.02 ms: 26.8 TFLOP/s; in 0.04 ms: 13.4.
    call = gemm.whole_call_row(16, 4096, 4096, 0.04, 0.02, True, input_sets=5)
    assert call["case"] == "bf16 M=16 N=4096 K=4096, whole call"
    assert (call["ours"], call["reference"]) == (13.4, 26.8)
    assert call["ratio"] == round(call["ours"] / call["reference"], 4) == 0.5
    assert call["detail"] == {"ours_ms": 0.04, "torch_ms": 0.02, "input_sets": 5}
    untuned = gemm.labelled({"case": "bf16 M=128 N=4096 K=4096", "ratio": 0.0}, gemm.KERNEL)
    rows = [kernel, call, untuned, gemm.whole_call_row(128, 4096, 4096, 0.02, 0.04, True)]
    assert gemm.ratio_summary(rows, gemm.KERNEL) == {"geomean_ratio_kernel": 1.08,
                                                     "min_ratio_kernel": 1.08}
    assert rows[3]["ratio"] == round(214.7 / 107.4, 4)  # from the rounded TFLOP/s
    assert gemm.ratio_summary(rows, gemm.WHOLE_CALL) == {
        "geomean_ratio_whole_call": round((0.5 * rows[3]["ratio"]) ** 0.5, 4),
        "min_ratio_whole_call": 0.5}


@pytest.mark.parametrize("set_mb, l2_mb, sets", [(32, 50, 5), (60, 50, 3), (100, 50, 1),
                                                 (117, 60, 3), (2000, 50, 1)])
def test_gemm_whole_call_inputs_rotate_out_of_l2(set_mb, l2_mb, sets):
    """The sets besides the current one hold at least twice the L2, as the flush buffer."""
    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks import gemm

    assert gemm.rotation_sets(set_mb << 20, l2_mb << 20) == sets
    assert (sets - 1) * set_mb >= 2 * l2_mb or sets == 1 and set_mb >= 2 * l2_mb


def test_e2e_memory_rows_carry_the_train_check_of_the_step_they_measured():
    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks import e2e, model_checks

    def measured(loss, worst):
        grads = model_checks.GradientCheck("model.layers.0.mlp.up_proj.weight", worst, 0.05,
                                           int(worst > 0.05), 10)
        return {"ms": 10.0, "loss": loss, "peak_gb": 2.0,
                "check": model_checks.TrainCheck(loss, 5.0, grads)}

    for worst, ok in ((0.01, True), (1.0, False)):
        train = {"eager": {"ms": 12.0, "loss": 5.0, "peak_gb": 3.0, "check": None},
                 "ours": measured(5.01, worst)}
        rows = e2e.train_rows(train, 1024)
        assert [r["case"] for r in rows] == ["train ours vs eager",
                                             "peak memory train ours vs eager"]
        assert [r["correct"] for r in rows] == [ok, ok]
        assert rows[0]["detail"]["grad_worst_parameter"] == "model.layers.0.mlp.up_proj.weight"
        assert rows[0]["detail"]["grad_worst_relative_error"] == worst
    # The loss alone no longer makes a row correct, nor does a loss 2% off pass.
    train["ours"] = measured(5.1, 0.01)
    assert [r["correct"] for r in e2e.train_rows(train, 1024)] == [False, False]


def test_multigpu_tune_rows_are_correct_only_when_both_tunes_stored_every_shape():
    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks import multigpu

    done = {"wall_s": 100.0, "workers": [], "untuned": []}
    short = {**done, "wall_s": 60.0, "untuned": ["16x4096x4096"]}
    assert multigpu.tune_row(2, "quick", "empty", done, {**done, "wall_s": 60.0})["correct"]
    row = multigpu.tune_row(2, "quick", "empty", done, short)
    assert not row["correct"] and row["detail"]["gpus_untuned"] == ["16x4096x4096"]
    assert not multigpu.tune_row(2, "quick", "empty", short, done)["correct"]
