"""Every cutlass-tune command, with --json where it has one, on a CPU: tune and bench run on
the fake backend of tuning_fakes."""

import argparse
import json
import logging
import os
import subprocess
import sys

import pytest
from tuning_fakes import FakeArtifact, FakeBackend, FakeSpec

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
    assert merged == {"scopes": 1, "entries": 2, "rejected": []}

    code, _, err = run(capsys, "clear")
    assert code == 1 and "--yes" in err  # refuses without confirmation
    code, out, _ = run(capsys, "clear", "--yes")
    assert code == 0 and run_json(capsys, "list") == []
    assert run_json(capsys, "import", str(merged_path)) == {"changed": 2, "valid": 2,
                                                             "rejected": []}
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
    assert {"torch", "transformers", "gpu", "nvcc", "nvrtc", "cutlass", "cache",
            "nvidia-matmul-heuristics"} <= names
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


# ---- the front door: corrupt caches, errors as one line, compile's honesty, help -------------

def _tuning_dir():
    from custom_kernels.core.tuned_store import tuning_dir

    return tuning_dir()


@pytest.mark.parametrize("argv", [("list",), ("export", "EXPORT"), ("clear", "--yes"),
                                  ("norms", "list")])
def test_a_cache_file_that_is_not_utf8_is_set_aside(capsys, caplog, tmp_path, argv):
    run_json(capsys, "tune", "16x4096x4096", "--strategy", "quick", "--no-heuristics")
    bad, bad_norms = _tuning_dir() / "bad.json", _tuning_dir() / "norms" / "bad.json"
    bad_norms.parent.mkdir(exist_ok=True)
    bad.write_bytes(b"\xff\xfe\x00garbage")
    bad_norms.write_bytes(b"\xff\xfe\x00garbage")
    argv = [str(tmp_path / "export.json") if a == "EXPORT" else a for a in argv]
    with caplog.at_level(logging.WARNING, logger="custom_kernels.core.cache_dir"):
        code, out, err = run(capsys, *argv)
    assert code == 0, err
    asides = list(bad.parent.glob("bad.json.corrupt-*"))
    if argv[0] == "norms":
        assert bad.exists() and not bad_norms.exists()
        asides = list(bad_norms.parent.glob("bad.json.corrupt-*"))
    else:
        assert not bad.exists()
    assert len(asides) == 1
    assert "is not UTF-8 text" in caplog.text and asides[0].name in caplog.text
    if argv[0] == "export":
        assert "1 entries" in out
    if argv[0] == "clear":
        assert run_json(capsys, "list") == []


def test_the_corrupt_file_message_is_one_line_without_our_source(tmp_path):
    # A fresh process, as a user runs it: nothing configures logging or warnings.
    from custom_kernels.core import cache_dir

    bad = cache_dir.versioned_dir("tuning") / "bad.json"
    bad.write_bytes(b"\xff\xfe garbage")
    done = subprocess.run([sys.executable, "-m", "tuning.cli", "list"], cwd=tmp_path,
                          env={**os.environ}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    aside, = bad.parent.glob("bad.json.corrupt-*")
    lines = done.stderr.splitlines()
    assert lines == [f"cutlass-ops: {bad} is not UTF-8 text; moved it to {aside.name} and will "
                     "rebuild it"], done.stderr


def test_a_shapes_file_that_cannot_be_read_is_one_usage_line(capsys, tmp_path):
    for path, why in [(tmp_path / "absent.txt", "No such file"), (tmp_path, "Is a directory")]:
        code, _, err = run(capsys, "tune", "--file", str(path))
        assert code == 2 and len(err.splitlines()) == 1
        assert err.startswith(f"cutlass-tune tune: --file {path}: cannot read it ({why}")
    binary = tmp_path / "shapes.bin"
    binary.write_bytes(b"\xff16x16x16\n")
    code, _, err = run(capsys, "tune", "--file", str(binary))
    assert code == 2 and f"--file {binary}: not UTF-8 text" in err


def test_norms_tune_without_a_gpu_is_one_line(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "norms", "tune", "--hidden", "4096")
    assert code == 2 and not out
    assert err.startswith("cutlass-tune norms tune: tuning needs a CUDA GPU")
    assert len(err.splitlines()) == 1


def test_errors_are_one_line_unless_debug(capsys, monkeypatch):
    def broken(args):
        raise PermissionError(13, "Permission denied", "/somewhere/tuning")

    monkeypatch.setattr(cli.cache_commands, "cmd_list", broken)
    code, _, err = run(capsys, "list")
    assert code == 1 and err.splitlines() == [
        "cutlass-tune list: [Errno 13] Permission denied: '/somewhere/tuning'"]
    with pytest.raises(PermissionError):
        cli.main(["--debug", "list"])


@pytest.mark.parametrize("version", ["13.0", "unavailable"])
def test_doctor_checks_nvrtc_without_compiling(capsys, monkeypatch, version):
    from custom_kernels import jit

    monkeypatch.setattr(jit, "nvrtc_version", lambda: version)
    monkeypatch.setattr(jit, "include_dirs", lambda: ("/cuda/include", "/cuda/include/cccl"))
    monkeypatch.setattr(jit, "compile_cubin", None)  # doctor must not compile
    report = json.loads(run(capsys, "doctor", "--json")[1])
    nvrtc, = [c for c in report["checks"] if c["what"] == "nvrtc"]
    if version == "13.0":
        assert nvrtc["ok"] and nvrtc["detail"] == "NVRTC 13.0, headers in /cuda/include"
    else:
        assert not nvrtc["ok"] and "libnvrtc cannot be loaded" in nvrtc["detail"]
        assert "nvrtc" in report["missing"]


def test_compile_says_when_it_ranks_for_a_gpu_it_guessed(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ("compile", "--dry-run", "16x4096x4096", "--strategy", "quick", "--no-heuristics")
    code, out, err = run(capsys, *argv)
    assert code == 0 and "on NVIDIA H100" in out
    assert err.startswith("no GPU found: ranking for H100; pass --gpu H100") and "H200" in err
    code, _, err = run(capsys, *argv, "--gpu", "H200")
    assert code == 0 and "no GPU found" not in err


def _fake_builds(monkeypatch, cached: bool):
    """loader's emission and build replaced: every kernel already built (``cached``) or built
    now, as prepare_many reports them (on_done per build, an Artifact with its seconds)."""
    from cutlass_ops.gemms import emit, loader

    monkeypatch.setattr(loader, "is_built", lambda operands, config: cached)
    monkeypatch.setattr(emit, "cached_source", lambda operands, config: "//" if cached else None)

    def prepare_many(items, *, jobs=None, on_done=None):
        results = {}
        for operands, config in items:
            results[(operands, config)] = FakeArtifact(seconds=0.0 if cached else 30.0)
            on_done(FakeSpec(config.build_name), results[(operands, config)])
        return results

    monkeypatch.setattr(loader, "prepare_many", prepare_many)


@pytest.mark.parametrize("cached", [False, True])
def test_compile_counts_only_real_builds(capsys, monkeypatch, cached):
    _fake_builds(monkeypatch, cached)
    argv = ("compile", "16x4096x4096", "--gpu", "H100", "--strategy", "quick",
            "--no-heuristics")
    kernels = len(run_json(capsys, *argv, "--dry-run")["kernels"])
    code, out, err = run(capsys, *argv)
    assert code == 0
    if cached:
        assert out.strip() == f"0 built, {kernels} already in the cache, 0 failed"
        assert "emitting" not in err and "building 0 kernels" in err
        assert "compile:" not in err  # no progress bar for nothing to build
    else:
        assert out.strip() == f"{kernels} built, 0 already in the cache, 0 failed"
        assert err.startswith(f"emitting {kernels} kernel sources with cutlass_cppgen")
        assert f"then building {kernels} kernels with nvcc" in err
        assert f"compile: {kernels}/{kernels} kernels" in err
    assert "/s" not in err  # no rate: builds and cache hits take times apart
    result = run_json(capsys, *argv)
    assert result == {"built": 0 if cached else kernels, "already_built": kernels if cached
                      else 0, "failed": {}}


def test_version_help_and_examples(capsys):
    from custom_kernels.core.version import __version__

    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out == f"cutlass-tune {__version__}\n"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "cutlass-tune tune 16x4096x4096" in out


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_and_command_has_help():
    for parser in _parsers(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                assert all(choice.help for choice in action._choices_actions), parser.prog
                continue
            assert action.help, f"{parser.prog} {action.option_strings or action.dest}"


@pytest.mark.parametrize("version, ok", [("2.10.1+cu128", False), ("2.11.0+cu130", True),
                                         ("2.13.0+cpu", True), ("3.0.0", True)])
def test_doctor_names_a_torch_older_than_the_oldest_tested(monkeypatch, version, ok):
    import torch

    from tuning import doctor

    monkeypatch.setattr(torch, "__version__", version)
    check = doctor._check("torch", doctor._torch, True)
    assert check["ok"] is ok
    if not ok:
        assert version in check["detail"] and "2.11" in check["detail"]


def test_doctor_names_an_old_transformers(monkeypatch):
    from tuning import doctor

    monkeypatch.setattr(doctor, "_version", lambda name: "4.56.0")
    check = doctor._check("transformers", doctor._transformers, False)
    assert not check["ok"] and "4.56.0" in check["detail"] and "5.17" in check["detail"]


def test_show_says_where_a_short_winner_runs(capsys, monkeypatch):
    """A winner timed as a whole eager call (issue 52): show names both calls and where the
    winner runs."""
    from tuning_fakes import FakeSession

    monkeypatch.setattr(FakeSession, "whole_call_ms", lambda self, c, reps: (0.045, 0.027),
                        raising=False)
    run_json(capsys, "tune", "16x4096x4096", "--strategy", "quick", "--no-heuristics")
    shown = run_json(capsys, "show", "16x4096x4096")
    assert (shown[0]["whole_call_ms"], shown[0]["torch_whole_call_ms"]) == (0.045, 0.027)
    code, out, _ = run(capsys, "show", "16x4096x4096")
    assert code == 0 and "whole eager call: 45.0 us, torch.matmul's 27.0 us" in out
    assert "inside CUDA graphs only" in out


def test_doctor_reports_the_host_path_without_building_it(capsys, monkeypatch):
    from custom_kernels import host_ops

    def no_build(*args, **kwargs):
        raise AssertionError("doctor built the host path")
    monkeypatch.setattr(host_ops, "build", no_build)
    monkeypatch.setattr(host_ops, "_compile", no_build)
    report = json.loads(run(capsys, "doctor", "--json")[1])
    [check] = [c for c in report["checks"] if c["what"] == "host path"]
    assert check["ok"] and ("not built yet" in check["detail"] or "built at" in check["detail"])
    monkeypatch.setenv(host_ops.ENV_VAR, "0")
    report = json.loads(run(capsys, "doctor", "--json")[1])
    [check] = [c for c in report["checks"] if c["what"] == "host path"]
    assert check["detail"].startswith("off")
