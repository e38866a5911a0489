"""The FP8 blockwise grouped tuner on the CPU with a fake backend (issue 53): keys, candidates, the
protocol's rounds (build failures and wrong results recorded, never winners), the stored entry
and its schema's refusals, the lookup scaled_grouped_mm dispatches on, and the CLI's refusals."""

import pytest
from tuning_fakes import SCOPE, stored

from cutlass_ops.gemms.grouped import grouped_fp8_entries
from cutlass_ops.gemms.grouped.grouped_build import (GroupedFp8Config, GroupedFp8Problem,
                                                     fp8_candidates)
from custom_kernels.core.tuned_store import EntryRejected, TuningCache
from tuning import grouped_fp8_search

PINGPONG = GroupedFp8Config(pingpong=True, tile=(64, 128))


class FakeSession:
    def __init__(self, backend, problem, torch_time=1.5):
        self.backend, self.problem, self.torch_time = backend, problem, torch_time
        self.ratios = {}

    def verify(self, config):
        self.backend.verified.append(config)
        return "wrong result: relative error 0.4 > 0.01" if config.cluster == (1, 2) else None

    def time_ms(self, config, reps):
        return 0.9 if config == PINGPONG else 1.0 + 0.01 * sum(config.cluster)

    def torch_ms(self, reps):
        return self.torch_time

    def compare_ms(self, configs, reps):
        # each routing's time over torch's, as the real session records them (the rowwise rule)
        self.ratios = {c: [self.time_ms(c, reps) / self.torch_ms(reps)] * 2 for c in configs}
        return {c: self.time_ms(c, reps) for c in configs}, self.torch_ms(reps)

    def close(self):
        pass


class FakeBackend:
    def __init__(self, torch_time=1.5):
        self.built, self.verified, self.torch_time = [], [], torch_time

    def build(self, configs):
        self.built += configs
        return {c: "build: fake nvcc error" for c in configs if c.cluster == (2, 1)}

    def session(self, problem):
        return FakeSession(self, problem, self.torch_time)


def test_the_key_buckets_the_rows_per_expert_and_reads_the_kernels_orientation():
    import torch

    (problem,) = grouped_fp8_search.moe_problems(128, 768, 2048, 4096 * 8)
    assert problem == GroupedFp8Problem(128, 256, 768, 2048, "blockwise")
    assert problem.name == "2d3d-e4m3-blockwise-g128-m256-n768-k2048"
    assert GroupedFp8Problem.from_dict(problem.to_dict()) == problem
    a, b = torch.empty(4096 * 8, 2048), torch.empty(128, 768, 2048)  # b as [E, N, K]
    assert GroupedFp8Problem.of(a, b) == problem
    (rowwise,) = grouped_fp8_search.moe_problems(8, 4096, 4096, 4096, recipe="rowwise")
    assert rowwise.name == "2d3d-e4m3-rowwise-g8-m512-n4096-k4096"
    with pytest.raises(ValueError, match="blockwise and rowwise recipes, not tensorwise"):
        grouped_fp8_search.moe_problems(8, 4096, 4096, 4096, recipe="tensorwise")


def test_candidates_follow_the_rows_per_expert():
    small, large = GroupedFp8Problem(256, 128, 2048, 7168), GroupedFp8Problem(8, 1024, 14336, 4096)
    assert fp8_candidates(small, "quick")[0].pingpong
    assert fp8_candidates(large, "quick")[0] == GroupedFp8Config()
    assert [len(fp8_candidates(large, s)) for s in ("quick", "default", "exhaustive")] == [3, 4, 6]
    assert len(set(fp8_candidates(large, "exhaustive"))) == 6


def test_a_tune_stores_the_fastest_verified_kernel_and_records_failures(tmp_path):
    backend = FakeBackend()
    cache = TuningCache(SCOPE, grouped_fp8_entries.SCHEMA, tmp_path)
    problems = grouped_fp8_search.moe_problems(8, 14336, 4096, 8192) + \
        grouped_fp8_search.moe_problems(128, 768, 2048, 32768)
    results = grouped_fp8_search.tune(problems, strategy="exhaustive", backend=backend,
                                      cache=cache, progress=lambda message: None)
    assert [r.problem for r in results] == problems
    assert len(backend.built) == len(set(backend.built)) == 6  # each kernel built once
    for problem in problems:
        entry = stored(cache, problem)
        assert entry["winner"] == PINGPONG.name and entry["winner_ms"] == 0.9
        assert entry["torch_ms"] == 1.5
        assert {f["stage"] for f in entry["failures"]} == {"build", "wrong result"}
        assert all("-c1x2" not in r["config"] for r in entry["runners_up"])
        # The default kernel is timed in the final round: the entry says what tuning gained.
        assert GroupedFp8Config().name in [r["config"] for r in entry["runners_up"]]
    again = grouped_fp8_search.tune(problems, backend=backend, cache=cache,
                                    progress=lambda message: None)
    assert all(r.cached for r in again)


def test_dispatch_reads_the_stored_winner_and_falls_back_to_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    problem = GroupedFp8Problem(8, 1024, 14336, 4096)
    assert grouped_fp8_entries.tuned_config(problem) is None  # nothing tuned: no device query
    cache = TuningCache(SCOPE, grouped_fp8_entries.SCHEMA)
    monkeypatch.setattr(grouped_fp8_entries, "grouped_fp8_cache", lambda device=None: cache)
    cache.put(problem, {"winner": PINGPONG.name, "winner_ms": 1.0, "torch_ms": 1.6})
    assert grouped_fp8_entries.tuned_config(problem) == PINGPONG
    assert grouped_fp8_entries.tuned_config(GroupedFp8Problem(8, 2048, 14336, 4096)) is None


@pytest.mark.parametrize("change, words", [
    ({"winner": "grouped-bf16-tn-cooperative-t128x256x64-c2x1"}, "winner"),
    ({"winner": "grouped-e4m3-blockwise-cooperative-t128x256-c1x1"}, "winner"),
    ({"winner_ms": -1.0}, "winner_ms"),
    ({"torch_ms": float("nan")}, "not finite"),
    ({"torch_ms": 0.0}, "torch_ms"),
    ({"problem": {"groups": 8, "m": 1024, "n": 14336, "k": 4096, "recipe": "tensorwise"}},
     "recipe"),
    ({"prefer": "torch"}, "always runs"),  # a blockwise winner has no torch kernel to yield to
])
def test_the_schema_refuses_entries_it_cannot_trust(change, words):
    problem = GroupedFp8Problem(8, 1024, 14336, 4096)
    raw = {"problem": problem.to_dict(), "winner": PINGPONG.name, "winner_ms": 1.0,
           "torch_ms": 1.6, **change}
    with pytest.raises(EntryRejected, match=words):
        grouped_fp8_entries.SCHEMA.parse(problem.name, raw, SCOPE)


@pytest.mark.parametrize("args, words", [
    (["--grouped", "8:14336:4096", "--tokens", "64", "--fp8", "tensorwise"], "not tensorwise"),
    (["--grouped", "8:14336:4096", "--tokens", "64", "--fp8", "blockwise", "--backward"],
     "forward"),
    (["--grouped", "8:14336:4096", "--fp8", "blockwise"], "--tokens"),
    (["--grouped", "8:14336:4096", "--tokens", "64", "--fp8", "blockwise"], "needs a CUDA GPU"),
])
def test_the_cli_refuses_bad_fp8_grouped_arguments_by_name(args, words, capsys, monkeypatch):
    import torch

    from tuning.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", *args]) != 0
    assert words in capsys.readouterr().err


def test_the_cache_commands_list_show_export_and_clear_its_entries(tmp_path, monkeypatch, capsys):
    """Every family's entries reach the cache commands: an FP8 grouped entry is listed, shown,
    exported and cleared like the others (they once failed on a family without a table row)."""
    from custom_kernels.core import device
    from tuning.cli import main

    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(device, "current_scope", lambda device=None: SCOPE)
    problem = GroupedFp8Problem(8, 1024, 14336, 4096)
    grouped_fp8_entries.grouped_fp8_cache().put(
        problem, {"winner": PINGPONG.name, "winner_ms": 1.2, "torch_ms": 1.8,
                  "runners_up": [{"config": GroupedFp8Config().name, "ms": 1.3}]})
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert problem.name in listed and "grouped_fp8" in listed and PINGPONG.name in listed
    assert main(["show", problem.name]) == 0
    assert GroupedFp8Config().name in capsys.readouterr().out  # the runner-up
    assert main(["export", str(tmp_path / "out.json"), "--family", "grouped_fp8"]) == 0
    assert "exported 1" in capsys.readouterr().out
    assert main(["clear", "--yes", "--family", "grouped_fp8"]) == 0
    assert grouped_fp8_entries.grouped_fp8_cache().get(problem) is None


ROWWISE_FAST = GroupedFp8Config(pingpong=True, tile=(64, 256), recipe="rowwise", fast_accum=True)


def test_rowwise_configs_name_their_scaling_and_round_trip():
    assert ROWWISE_FAST.name == "grouped-e4m3-rowwise-fastaccum-pingpong-t64x256-c1x1"
    assert GroupedFp8Config.from_name(ROWWISE_FAST.name) == ROWWISE_FAST
    assert "GROUPED_ROWWISE=1" in ROWWISE_FAST.defines()
    assert "GROUPED_FAST_ACCUM=1" in ROWWISE_FAST.defines()
    assert "GROUPED_ROWWISE=0" in GroupedFp8Config().defines()
    with pytest.raises(ValueError, match="rowwise kernel's"):
        GroupedFp8Config(fast_accum=True)  # blockwise promotes every K block
    with pytest.raises(ValueError, match="tile N 128:"):
        GroupedFp8Config(tile=(128, 256))  # blockwise: one B scale block a tile
    problem = GroupedFp8Problem(8, 1024, 14336, 4096, "rowwise")
    pool = fp8_candidates(problem, "exhaustive")
    assert len(pool) == len(set(pool)) == 12 and all(c.recipe == "rowwise" for c in pool)
    assert [len(fp8_candidates(problem, s)) for s in ("quick", "default")] == [4, 6]


@pytest.mark.parametrize("torch_time, prefer", [(1.5, "cutlass"), (0.5, "torch")])
def test_a_rowwise_winner_runs_only_where_it_beat_torchs_kernel(torch_time, prefer, tmp_path,
                                                                 monkeypatch):
    backend = FakeBackend(torch_time)
    cache = TuningCache(SCOPE, grouped_fp8_entries.SCHEMA, tmp_path)
    problems = grouped_fp8_search.moe_problems(8, 4096, 4096, 8192, recipe="rowwise")
    grouped_fp8_search.tune(problems, strategy="quick", backend=backend, cache=cache,
                            progress=lambda message: None)
    entry = stored(cache, problems[0])
    assert entry["prefer"] == prefer and entry["winner"].startswith("grouped-e4m3-rowwise")
    monkeypatch.setattr(grouped_fp8_entries, "family_dir", lambda schema: tmp_path)
    monkeypatch.setattr(grouped_fp8_entries, "grouped_fp8_cache", lambda device=None: cache)
    tuned = grouped_fp8_entries.tuned_config(problems[0])
    assert (tuned is not None) == (prefer == "cutlass")


def test_a_winner_of_another_recipe_is_refused():
    problem = GroupedFp8Problem(8, 1024, 14336, 4096, "rowwise")
    raw = {"problem": problem.to_dict(), "winner": PINGPONG.name, "winner_ms": 1.0,
           "torch_ms": 1.6}
    with pytest.raises(EntryRejected, match="blockwise kernel"):
        grouped_fp8_entries.SCHEMA.parse(problem.name, raw, SCOPE)


def test_the_public_op_asks_for_a_tuned_rowwise_kernel_by_its_problem(monkeypatch):
    """scaled_grouped_mm's rowwise route looks its problem up (in the kernel's orientation);
    with nothing stored torch._scaled_grouped_mm runs."""
    import torch

    from cutlass_ops.fp8 import scaled_grouped_mm_op as sgm

    asked = []
    monkeypatch.setattr(grouped_fp8_entries, "tuned_config",
                        lambda problem, device=None: asked.append(problem))
    a = torch.empty(4096, 2048, dtype=torch.float8_e4m3fn)
    b = torch.empty(128, 768, 2048, dtype=torch.float8_e4m3fn).transpose(1, 2)  # [E, K, N]
    assert sgm._tuned_rowwise(a, b) is None
    assert asked == [GroupedFp8Problem(128, 32, 768, 2048, "rowwise")]
