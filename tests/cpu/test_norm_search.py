"""Norm tuning without a GPU: problem keys, candidates per strategy, the cache round trip, the
lookup the norms use (a tuned winner replaces the heuristic; a stale or foreign one does not),
and ``cutlass-tune norms list / clear`` with --json. The search itself runs in
tests/gpu/test_norms_gpu.py."""

import json

import pytest
from tuning_fakes import SCOPE

from custom_kernels.norms import norm_config as nc
from custom_kernels.norms import norm_ops as norms
from custom_kernels.norms import tuned
from tuning import cli, norm_search
from custom_kernels.core.tuned_store import TuningCache
from tuning_fakes import stored


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path / "cache"))
    def cache(device=None, root=None):
        return TuningCache(SCOPE, tuned.SCHEMA, root)

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
    assert norm_search.tuned_config(p) == nc.NormConfig(512, 1, 1, 8, 2)
    assert norms._choose(p, None) == nc.NormConfig(512, 1, 1, 8, 2)
    assert norms._choose(p, "t128_r1_c1_v8") == nc.NormConfig(128, 1, 1, 8)  # override wins
    other = problem(8192)  # another problem is untouched
    assert norms._choose(other, None) == nc.heuristic(other)
    monkeypatch.setenv("CUTLASS_OPS_NORM_TUNED", "0")
    assert norms._choose(p, None) == nc.heuristic(p)


def test_an_invalid_or_garbage_entry_falls_back_to_the_heuristic(caplog):
    p = problem(4096)
    cache = norm_search.norm_cache()
    other = problem(8192)
    fields = {"winner_ms": 0.5, "torch_ms": 0.9}
    report = cache.merge({p.name: {**fields, "winner": "t256_r8_c2_v8_s2",  # a warp per row
                                   "problem": p.to_dict()},  # takes no cluster
                          other.name: {**fields, "winner": "fastest-please",
                                       "problem": other.to_dict()}})
    assert report.changed == 0 and len(report.rejections) == 2
    assert "cannot run" in report.rejections[0].reason
    assert "not a norm config name" in report.rejections[1].reason
    assert norms._choose(p, None) == nc.heuristic(p)
    put(p, "t512_r1_c1_v8_s2")
    assert norms._choose(p, None) == nc.NormConfig(512, 1, 1, 8, 2)


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

    assert cli.main(["clear", "--yes", "--family", "gemm"]) == cli.EXIT_OK  # GEMMs only
    capsys.readouterr()
    assert len(run_json(capsys, "norms", "list")) == 2
    assert run_json(capsys, "list", "--family", "gemm") == []  # never GEMM rows
    assert {r["family"] for r in run_json(capsys, "list")} == {"norms"}
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
    assert merged == {"scopes": 1, "entries": 2, "rejected": []}
    assert run_json(capsys, "import", str(tmp_path / "merged.json")) == {
        "changed": 2, "valid": 2, "rejected": []}
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


# ---- the search itself, on a fake GPU: the tuner protocol with the norms' family ------------

def fake_ms(config):
    """More threads and stages run faster; a cluster costs a little."""
    return 1000 / (config.threads * (1 + config.stages)) + 0.01 * config.cluster


class FakeNormSession:
    """Candidates with a cluster of 4 compute wrong results; times from ``fake_ms``."""

    def __init__(self, problem, rows):
        self.problem, self.rows = problem, rows
        self.timed, self.compared, self.closed = [], [], False
        SESSIONS.append(self)

    def verify(self, config):
        return "wrong result: relative error 0.5 > 0.02" if config.cluster == 4 else None

    def time_ms(self, config, reps):
        self.timed.append(config)
        return fake_ms(config)

    def torch_ms(self, reps):
        return 1.0

    def compare_ms(self, configs, reps):
        self.compared.append((list(configs), reps))
        return {c: fake_ms(c) for c in configs}, 1.0

    def close(self):
        self.closed = True


SESSIONS = []
UNBUILDABLE = ("t1024_r1_c1_v8_s3", "t1024_r1_c2_v8_s3")  # the fastest, were they built


@pytest.fixture
def fake_gpu(monkeypatch):
    SESSIONS.clear()
    monkeypatch.setattr(norm_search, "NormSession", FakeNormSession)

    def precompile_configs(problem, configs, workers=8):
        return {c.name: "build: NVRTCError: fake" for c in configs if c.name in UNBUILDABLE}

    monkeypatch.setattr(norms, "precompile_configs", precompile_configs)
    return SESSIONS


def test_tune_problem_verifies_times_and_picks_the_fastest_right_config(fake_gpu):
    p = problem(8192)
    configs = norm_search.candidates(p, "quick")
    entry = norm_search.tune_problem(p, strategy="quick", rows=64, reps=5)
    (session,) = fake_gpu
    right = [c for c in configs if c.cluster != 4 and c.name not in UNBUILDABLE]
    assert session.closed and session.rows == 64
    assert session.timed == right  # every built and verified candidate, nothing else
    best = sorted(right, key=fake_ms)
    assert entry["winner"] == best[0].name and entry["winner_ms"] == fake_ms(best[0])
    # Finals: the best three and the heuristic's choice, in one group beside torch.
    heuristic = nc.heuristic(p)
    assert session.compared == [(best[:3] + [heuristic], 20)]
    assert entry["heuristic"] == heuristic.name and entry["heuristic_ms"] == fake_ms(heuristic)
    assert entry["torch_ms"] == 1.0 and entry["rows"] == 64 and entry["strategy"] == "quick"
    assert entry["failures"] == {
        **{name: "build: NVRTCError: fake" for name in UNBUILDABLE},
        **{c.name: "wrong result: relative error 0.5 > 0.02" for c in configs
           if c.cluster == 4}}
    assert [r["config"] for r in entry["runners_up"]] == [c.name for c in best[:8]]
    assert set(entry) == {"winner", "winner_ms", "heuristic", "heuristic_ms", "torch_ms",
                          "reference", "rows", "strategy", "gbps", "runners_up", "failures",
                          "timings_s"}


def test_tune_stores_each_problem_and_a_second_run_is_a_cache_hit(fake_gpu):
    problems = [problem(8192), problem(4096, "bwd")]
    said = []
    first = norm_search.tune(problems, strategy="quick", rows=64, reps=5, progress=said.append)
    assert [p for p, _ in first] == problems and len(fake_gpu) == 2
    assert norm_search.tuned_config(problems[0]).name == first[0][1]["winner"]
    assert any("compiling" in s for s in said) and not any("cached" in s for s in said)
    said.clear()
    again = norm_search.tune(problems, strategy="quick", progress=said.append)
    assert len(fake_gpu) == 2 and all("cached" in s for s in said)
    assert [e["winner"] for _, e in again] == [e["winner"] for _, e in first]
    norm_search.tune(problems[:1], strategy="quick", force=True, progress=said.append)
    assert len(fake_gpu) == 3


def test_every_candidate_failing_is_an_error_naming_the_failures(fake_gpu, monkeypatch):
    monkeypatch.setattr(FakeNormSession, "verify", lambda self, c: "launch: RuntimeError: no")
    with pytest.raises(RuntimeError, match="every candidate failed.*launch: RuntimeError"):
        norm_search.tune_problem(problem(8192), strategy="quick", rows=64)
    assert norm_search.norm_cache().get(problem(8192)) is None


# ---- the session's references and verification, on CPU tensors ------------------------------

def cpu_session(kind, direction, dtype, residual, hidden=64, rows=8):
    """A NormSession's inputs and references without a GPU (the kernels are replaced)."""
    import torch

    dt = getattr(torch, dtype)
    p = nc.NormProblem(kind, direction, hidden, dtype, dtype, dtype, residual=residual)
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dt)

    s = object.__new__(norm_search.NormSession)
    s.problem, s.rows, s.eps = p, rows, 1e-6 if kind == "rms" else 1e-5
    s.x, s.dy = randn(rows, hidden), randn(rows, hidden)
    s.w = (1 + 0.5 * randn(hidden).float()).to(dt)
    s.b = randn(hidden) if kind == "ln" else None
    s.res = randn(rows, hidden) if residual else None
    s.h = (s.x.float() + s.res.float()).to(dt) if residual else s.x
    s.tolerance = norm_search.tolerances.relative_tolerance(dtype, "norms")
    s.reference = s._forward_reference() if direction == "fwd" else s._backward_reference()
    return s


def torch_norm(kind, h, w, b, eps):
    import torch.nn.functional as F

    if kind == "rms":
        return F.rms_norm(h, (h.shape[-1],), w, eps)
    return F.layer_norm(h, (h.shape[-1],), w, b, eps)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind", nc.KINDS)
def test_references_match_torch_in_float64(kind, residual):
    import torch

    fwd = cpu_session(kind, "fwd", "float32", residual)
    h = fwd.x.double() + (fwd.res.double() if residual else 0)
    b = fwd.b.double() if fwd.b is not None else None
    want = torch_norm(kind, h, fwd.w.double(), b, fwd.eps)
    torch.testing.assert_close(fwd.reference[0].double(), want, rtol=1e-5, atol=1e-5)
    assert len(fwd.reference) == (2 if residual else 1)

    bwd = cpu_session(kind, "bwd", "float32", residual)
    leaves = [t.double().requires_grad_() for t in (bwd.h, bwd.w, bwd.b) if t is not None]
    y = torch_norm(kind, leaves[0], leaves[1], leaves[2] if kind == "ln" else None, bwd.eps)
    want = list(torch.autograd.grad(y, leaves, bwd.dy.double()))
    if residual:  # the new residual's gradient (dy stands in for it) flows into dx
        want[0] = want[0] + bwd.dy.double()
    assert len(bwd.reference) == len(want) == (3 if kind == "ln" else 2)
    for got, expected in zip(bwd.reference, want):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_verify_accepts_rounding_and_refuses_wrong_or_unwritten_outputs():
    import torch

    s = cpu_session("rms", "fwd", "bfloat16", residual=True)
    y, h = s.reference

    def runs(*out):
        s._runner = lambda config: (lambda: out)

    config = nc.heuristic(s.problem)
    runs(y.to(torch.bfloat16), h, None, None)  # rounded to the output dtype: right
    assert s.verify(config) is None
    runs(y.to(torch.bfloat16), h.flip(0), None, None)  # the new residual of other rows
    assert s.verify(config).startswith("wrong result: relative error")
    runs(torch.full_like(y, float("nan")), h, None, None)
    assert "nan" in s.verify(config)

    def raises():
        raise RuntimeError("launch failed")

    s._runner = lambda config: raises
    assert s.verify(config) == "launch: RuntimeError: launch failed"
