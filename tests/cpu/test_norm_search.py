"""Norm tuning without a GPU: problem keys, candidates per strategy, the cache round trip, the
lookup the norms use (a tuned winner replaces the heuristic; a stale or foreign one does not),
and ``cutlass-tune norms list / clear`` with --json. The search itself runs in
tests/gpu/test_norms_gpu.py."""

import json

import pytest
from tuning_fakes import SCOPE

from custom_kernels.norms import config as nc
from custom_kernels.norms import ops as norms
from custom_kernels.norms import tuned
from tuning import cli, norm_search
from custom_kernels.core.tuned_store import TuningCache


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path / "cache"))
    def cache(device=None, root=None):
        return TuningCache(SCOPE, root, family=norm_search.NORMS)

    monkeypatch.setattr(norm_search, "norm_cache", cache)
    monkeypatch.setattr(tuned, "norm_cache", cache)


def problem(hidden=4096, direction="fwd", residual=False):
    return nc.NormProblem("rms", direction, hidden, "bfloat16", "bfloat16", "bfloat16",
                          residual=residual)


def test_problem_names_are_stable_keys():
    p = problem(4096, "bwd", residual=True)
    assert p.name == "norm-rms-bwd-h4096-bfloat16-bfloat16-bfloat16-residual"
    assert nc.NormProblem.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    scalar = nc.NormProblem("ln", "fwd", 4097, "float16", "float32", "float32", aligned=False)
    assert scalar.name.endswith("-scalar") and scalar.name != p.name


@pytest.mark.parametrize("strategy", norm_search.STRATEGIES)
def test_candidates_start_with_the_heuristic_and_follow_the_strategy(strategy):
    p = problem(32768)
    configs = norm_search.candidates(p, strategy)
    assert configs[0] == nc.heuristic(p)
    assert len(set(configs)) == len(configs) and all(c.why_invalid(p) is None for c in configs)
    direct = [c for c in configs if not c.stages]
    assert bool(direct) == (strategy == "exhaustive")
    if strategy == "quick":
        assert all(c.stages <= 3 and c.threads >= 256 for c in configs[1:])
    with pytest.raises(ValueError, match="strategy"):
        norm_search.candidates(p, "fastest")


def test_candidate_counts_grow_with_the_strategy():
    p = problem(8192, "bwd")
    counts = [len(norm_search.candidates(p, s)) for s in norm_search.STRATEGIES]
    assert counts[0] < counts[1] < counts[2]


def test_default_rows_fill_the_gpu_within_int32_elements():
    assert norm_search.default_rows(4096) == 32768
    assert norm_search.default_rows(262144) * 262144 <= (1 << 31)


def put(p, winner, **extra):
    norm_search.norm_cache().put(p, {"winner": winner, "winner_ms": 0.5, "heuristic":
                                   nc.heuristic(p).name, "heuristic_ms": 0.6,
                                   "torch_ms": 0.9, "gbps": 4000.0, "failures": {}, **extra})


def test_a_tuned_winner_replaces_the_heuristic(monkeypatch):
    p = problem(4096)
    assert norms._tuned(p, 0) is None  # nothing tuned: the heuristic
    put(p, "t512_r1_c1_v8_s2")
    assert norm_search.tuned_config_name(p) == "t512_r1_c1_v8_s2"
    assert norms._choose(p, None) == nc.NormConfig(512, 1, 1, 8, 2)
    assert norms._choose(p, "t128_r1_c1_v8") == nc.NormConfig(128, 1, 1, 8)  # override wins
    other = problem(8192)  # another problem is untouched
    assert norms._choose(other, None) == nc.heuristic(other)
    monkeypatch.setenv("CUTLASS_OPS_NORM_TUNED", "0")
    assert norms._choose(p, None) == nc.heuristic(p)


def test_an_invalid_or_garbage_entry_falls_back_to_the_heuristic(caplog):
    p = problem(4096)
    put(p, "t256_r8_c2_v8_s2")  # a warp per row takes no cluster: invalid here
    assert norms._choose(p, None) == nc.heuristic(p)
    put(p, "fastest-please")
    assert norms._choose(p, None) == nc.heuristic(p)
    assert "unreadable" in caplog.text


def run_json(capsys, *argv):
    code = cli.main(list(argv) + ["--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_norms_list_and_clear(capsys):
    assert run_json(capsys, "norms", "list") == []
    put(problem(4096), "t256_r1_c1_v8_s1")
    put(problem(8192, "bwd"), "t1024_r1_c1_v8_s2", failures={"t64_r1_c1_v8_s4": "slow"})
    rows = {r["problem"]: r for r in run_json(capsys, "norms", "list")}
    assert rows.keys() == {problem(4096).name, problem(8192, "bwd").name}
    fwd, bwd = rows[problem(4096).name], rows[problem(8192, "bwd").name]
    assert fwd["vs_heuristic"] == 1.2 and fwd["vs_torch"] == 1.8 and fwd["failures"] == 0
    assert bwd["failures"] == 1 and bwd["gpu"] == SCOPE.gpu
    assert cli.main(["norms", "clear"]) == cli.EXIT_FAILED  # without --yes nothing goes
    assert len(run_json(capsys, "norms", "list")) == 2
    assert cli.main(["norms", "clear", "--yes"]) == cli.EXIT_OK
    capsys.readouterr()
    assert run_json(capsys, "norms", "list") == []


def test_export_import_and_merge_carry_norm_entries_apart_from_gemm_ones(capsys, tmp_path):
    put(problem(4096), "t256_r1_c1_v8_s1")
    put(problem(8192, "bwd"), "t1024_r1_c1_v8_s2")
    export = tmp_path / "export.json"
    assert cli.main(["export", str(export)]) == cli.EXIT_OK
    assert "norms 2" in capsys.readouterr().out
    docs = json.loads(export.read_text())["caches"]
    assert [d["family"] for d in docs] == ["norms"]

    assert cli.main(["clear", "--yes"]) == cli.EXIT_OK  # the GEMM cache only
    capsys.readouterr()
    assert len(run_json(capsys, "norms", "list")) == 2
    assert run_json(capsys, "list") == []  # norm entries never show as GEMM rows
    assert cli.main(["norms", "clear", "--yes"]) == cli.EXIT_OK
    capsys.readouterr()

    # Another machine's faster winner for one problem: merged offline, then imported.
    other = json.loads(export.read_text())
    name = problem(4096).name
    other["caches"][0]["entries"] = {name: {**other["caches"][0]["entries"][name],
                                            "winner": "t512_r1_c1_v8_s2", "winner_ms": 0.25}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    merged = run_json(capsys, "merge", str(export), str(tmp_path / "other.json"),
                      "-o", str(tmp_path / "merged.json"))
    assert merged == {"scopes": 1, "entries": 2}
    assert run_json(capsys, "import", str(tmp_path / "merged.json")) == {"changed": 2}
    rows = {r["problem"]: r["winner"] for r in run_json(capsys, "norms", "list")}
    assert rows == {name: "t512_r1_c1_v8_s2", problem(8192, "bwd").name: "t1024_r1_c1_v8_s2"}
    assert norms._choose(problem(4096), None) == nc.NormConfig(512, 1, 1, 8, 2)


def test_norms_tune_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["norms", "tune"])  # --hidden is required
    with pytest.raises(SystemExit):
        cli.main(["norms", "tune", "--hidden", "4096", "--strategy", "fastest"])
    assert cli.main(["norms", "tune", "--hidden", "262145"]) == cli.EXIT_USAGE
    assert "outside" in capsys.readouterr().err
