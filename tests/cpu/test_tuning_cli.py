"""Every cutlass-tune command, with --json where it has one, on a CPU: tune and bench run on
the fake backend of tuning_fakes."""

import json

import pytest
from tuning_fakes import FakeBackend

from tuning import cli


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "make_backend", lambda args: FakeBackend())
    from cutlass_ops.gemms import dispatch

    dispatch.reset()


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_tune_list_show_bench(capsys):
    result = run_json(capsys, "tune", "16x4096x4096", "4096x4096x4096x2", "--strategy",
                      "quick", "--no-heuristics")
    rows = result["results"]
    assert [r["shape"] for r in rows] == ["16x4096x4096", "4096x4096x4096x2"]
    assert all(r["winner"] and not r["cached"] for r in rows)
    again = run_json(capsys, "tune", "16x4096x4096", "--strategy", "quick")
    assert again["results"][0]["cached"]

    listed = run_json(capsys, "list")
    assert {r["shape"] for r in listed} == {"16x4096x4096", "4096x4096x4096x2"}
    assert all(r["speedup"] > 0 for r in listed)
    code, out, _ = run(capsys, "list")
    assert code == 0 and "16x4096x4096" in out

    shown = run_json(capsys, "show", "16x4096x4096")
    assert shown[0]["winner_name"] and "runners_up" in shown[0] and "failures" in shown[0]
    code, out, _ = run(capsys, "show", "16x4096x4096")
    assert code == 0 and "runner-up" in out
    code, _, err = run(capsys, "show", "1x2x3")
    assert code == 1 and "no tuned entry" in err

    bench = run_json(capsys, "bench", "--reps", "5")
    assert len(bench["rows"]) == 2 and all(r["ratio"] > 0 for r in bench["rows"])


def test_tune_reads_files_and_models(capsys, tmp_path, monkeypatch):
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("# decode\n16x1024x1024\n\n32x1024x1024  # prefill\n")
    module = tmp_path / "tiny_model.py"
    module.write_text("import torch\n"
                      "def build():\n"
                      "    return torch.nn.Sequential(torch.nn.Linear(256, 512),\n"
                      "                               torch.nn.Linear(512, 256))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run_json(capsys, "tune", "--file", str(shapes), "--model", "tiny_model:build",
                      "--tokens", "64", "--strategy", "quick", "--no-heuristics")
    assert [r["shape"] for r in result["results"]] == [
        "16x1024x1024", "32x1024x1024", "64x512x256", "64x256x512"]
    backward = run_json(capsys, "tune", "--model", "tiny_model:build", "--tokens", "64",
                        "--backward", "--strategy", "quick", "--no-heuristics")
    layouts = {(r["shape"], r["operands"].split("_")[5]) for r in backward["results"]}
    # forward tn, dX = dY W in tt, dW = dY^T X in nt (output row-major: third letter t)
    assert {("64x512x256", "tnt"), ("64x256x512", "ttt"), ("512x256x64", "ntt")} <= layouts


def test_bad_input_is_a_clear_usage_error(capsys):
    code, _, err = run(capsys, "tune", "16x4096")
    assert code == 2 and "MxNxK" in err
    code, _, err = run(capsys, "tune")
    assert code == 2 and "no shapes" in err
    code, _, err = run(capsys, "tune", "--model", "tiny:build")
    assert code == 2 and "--tokens" in err
    code, _, err = run(capsys, "tune", "64x64x64", "--layout", "tx")
    assert code == 2 and "--layout" in err
    code, _, err = run(capsys, "import", "/nonexistent/file.json")
    assert code == 2 and "cannot read" in err


def test_export_import_merge_clear(capsys, tmp_path):
    run_json(capsys, "tune", "16x4096x4096", "--strategy", "quick", "--no-heuristics")
    export = tmp_path / "export.json"
    code, out, _ = run(capsys, "export", str(export))
    assert code == 0 and "1 entries" in out
    document = json.loads(export.read_text())
    assert document["kind"] == "cutlass-ops-tuning-bundle"

    # Another machine's result for a second shape, merged offline, then imported.
    other = json.loads(export.read_text())
    (name, entry), = other["caches"][0]["entries"].items()
    other["caches"][0]["entries"] = {name.replace("16x4096", "32x4096"): {
        **entry, "problem": {**entry["problem"], "m": 32}}}
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    merged_path = tmp_path / "merged.json"
    merged = run_json(capsys, "merge", str(export), str(other_path), "-o", str(merged_path))
    assert merged == {"scopes": 1, "entries": 2}

    code, _, err = run(capsys, "clear")
    assert code == 1 and "--yes" in err  # refuses without confirmation
    code, out, _ = run(capsys, "clear", "--yes")
    assert code == 0 and run_json(capsys, "list") == []
    assert run_json(capsys, "import", str(merged_path)) == {"changed": 2}
    assert len(run_json(capsys, "list")) == 2

    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"format": 1, "entries": 3}')
    code, _, err = run(capsys, "import", str(garbage))
    assert code == 2 and "not a cutlass-ops tuning cache export" in err


def test_doctor_reports_every_check(capsys):
    code, out, _ = run(capsys, "doctor", "--json")
    report = json.loads(out)
    assert code in (0, 1)
    names = {c["what"] for c in report["checks"]}
    assert {"gpu", "nvcc", "cutlass", "cache", "nvidia-matmul-heuristics"} <= names
    assert set(report["missing_required"]) <= set(report["missing"])
    code, out, _ = run(capsys, "doctor")
    assert "cache" in out


def test_compile_dry_run_lists_kernels_without_a_gpu(capsys):
    result = run_json(capsys, "compile", "--dry-run", "16x4096x4096", "4096x4096x4096",
                      "--gpu", "H200", "--strategy", "quick", "--no-heuristics")
    assert result["gpu"] == "NVIDIA H200" and result["arch"] == "sm90a"
    kernels = result["kernels"]
    assert 4 <= len(kernels) <= 8 and not any(k["built"] for k in kernels)
    assert any(k["operands"].endswith("tnn_align8x8x8") for k in kernels)  # swap-A/B kernels
    code, out, _ = run(capsys, "compile", "--dry-run", "16x4096x4096", "--gpu", "H100")
    assert code == 0 and "to build" in out
    code, _, err = run(capsys, "compile", "--dry-run", "16x4096x4096", "--gpu", "Z9")
    assert code == 2 and "unknown GPU" in err


def test_report_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, _, err = run(capsys, "report", "--out", str(tmp_path / "r.png"))
    assert code == 1 and "nothing tuned" in err
    run_json(capsys, "tune", "16x4096x4096", "256x4096x4096", "--strategy", "quick",
             "--no-heuristics")
    result = run_json(capsys, "report", "--out", str(tmp_path / "r.png"))
    png = tmp_path / "r.png"
    assert result["reports"] == [str(png)] and png.read_bytes()[:4] == b"\x89PNG"


def test_compile_tuned_lists_the_cached_winners(capsys, monkeypatch):
    from tuning_fakes import SCOPE

    run_json(capsys, "tune", "16x4096x4096", "--strategy", "quick", "--no-heuristics")
    winner = run_json(capsys, "show", "16x4096x4096")[0]["winner_name"]
    result = run_json(capsys, "compile", "--dry-run", "--tuned", "--gpu", "H100")
    assert SCOPE.gpu.startswith(result["gpu"])
    listed = [k["kernel"] for k in result["kernels"]]
    assert any(winner.removeprefix("swap:").startswith(k) for k in listed)
    code, _, err = run(capsys, "compile", "--dry-run", "--gpu", "H100")
    assert code == 2 and "--tuned" in err
